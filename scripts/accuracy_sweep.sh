#!/usr/bin/env bash
# Issue 3's accuracy setting over many seeds: LeNet5, batch 32, mini_steps=4, Momentum(0.01, 0.9),
# 10 epochs on the vendored 8,000 training digits, test accuracy on the 1,984 images of the
# drop_remainder test batches. One thread. One line per seed, then the mean with its standard
# error. Its PyTorch twin is benches/pytorch_lenet_accuracy.py (same arguments).
#
#   bash scripts/accuracy_sweep.sh [--seeds A-B] [--reduction mean|sum] [-- extra train args]
set -euo pipefail
cd "$(dirname "$0")/.."
seeds=1-8
reduction=mean
while [ $# -gt 0 ]; do
    case "$1" in
        --seeds) seeds=$2; shift 2 ;;
        --reduction) reduction=$2; shift 2 ;;
        --) shift; break ;;
        *) echo "unknown argument $1 (use --seeds A-B, --reduction mean|sum, -- train args)" >&2; exit 2 ;;
    esac
done
cargo build --release --locked --example gradient_accumulation_train --example gradient_accumulation_eval >&2
bin=target/release/examples
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export RAYON_NUM_THREADS=1 MATMUL_NUM_THREADS=1
for s in $(seq "${seeds%-*}" "${seeds#*-}"); do
    "$bin/gradient_accumulation_train" --epochs 10 --reduction "$reduction" --seed "$s" --ckpt "$dir/s.ckpt" "$@" >"$dir/train.log"
    acc=$("$bin/gradient_accumulation_eval" --ckpt-path "$dir/s.ckpt" | sed -n "s/.*'Accuracy': \([0-9.]*\)}.*/\1/p")
    [ -n "$acc" ] || { echo "seed $s: no accuracy printed" >&2; exit 1; }
    printf 'cellgraph %s seed %s accuracy %.6f\n' "$reduction" "$s" "$acc"
done | tee "$dir/sweep.txt"
awk -v r="$reduction" '{a[NR]=$NF; s+=$NF; if ($NF >= 0.96) k++}
    END {m=s/NR; for (i=1;i<=NR;i++) v+=(a[i]-m)^2; se=(NR>1)?sqrt(v/(NR-1)/NR):0;
         printf "cellgraph %s: %d seeds, mean %.4f%% +- %.4f%% (s.e.), %d at or above 96%%\n", r, NR, 100*m, 100*se, k}' "$dir/sweep.txt"
