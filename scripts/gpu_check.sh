#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: runs the CUDA tests and the device benchmark from prebuilt
# binaries, beside PyTorch on the same GPU, and prints the tables for BENCHMARKS.md.
#
# Build them (no GPU or CUDA toolkit needed; the driver is loaded at run time):
#   cargo build --release --no-default-features --features cuda \
#       --bin distributed_gradient_accumulation --example device_bench
#   cargo test --release --no-default-features --features cuda --test it --no-run
# then copy target/release/distributed_gradient_accumulation,
# target/release/examples/device_bench and the `it` test binary (the path `--no-run` printed)
# into one folder and run:
#   bash scripts/gpu_check.sh FOLDER
# PARTS (default "tests train mpi bench") picks the parts; CASES (";"-separated "net b K")
# the benchmark's configurations; UPDATES/WARMUP its timed and warm-up updates, CASE_TIMEOUT
# the seconds each benchmark command may run. A `baseline_device_bench` in FOLDER (an earlier
# build's) runs before and after the new one in each case, so a change is timed against its
# baseline in the same call. GRAPHS=1 also times device_bench with `--graphs` (each
# micro-step replayed as its captured CUDA graph) and `--graphs --in-step` (each window of K
# micro-steps replayed as one graph, as PyTorch's script captures it), alternating with the
# op-by-op run. DEADLINE (seconds since the epoch) skips, named, the benchmark commands that
# would start after it (a device call has a time limit).
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-target/release}
OUT=${OUT:-/tmp}
PARTS=${PARTS:-tests train mpi bench}
CASES=${CASES:-lenet 32 4;mlp 256 4;mlp 1024 4;resnet18 32 4;gpt 8 4}
UPDATES=${UPDATES:-100}
WARMUP=${WARMUP:-10}
CASE_TIMEOUT=${CASE_TIMEOUT:-600}
status=0
part() { [[ " $PARTS " == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || { echo "no NVIDIA GPU here"; exit 1; }

source scripts/gpu_measure.sh

if part tests; then
echo "## CUDA tests"
"$BIN/it" --test-threads 1 device:: 2>&1 | tee "$OUT/cuda_tests.log" || status=1
fi

if part train; then
echo "## Trainings on cuda:0 (one epoch each; replicated optimizer, so the fused kernels run)"
for net in lenet mlp; do
    "$BIN/distributed_gradient_accumulation" --device cuda:0 --net "$net" --epochs 1 --batch-size 128 --no-hsdp \
        --log-dir "$OUT/log_$net" --print-every 1000 || status=1
done
fi

MPI_BIN="$BIN/distributed_gradient_accumulation_mpi"
[ -x "$MPI_BIN" ] || MPI_BIN="$BIN/distributed_gradient_accumulation"
if ! part mpi; then
    :
elif command -v mpirun >/dev/null; then
    echo "## 8 ranks sharing cuda:0 (rank r takes GPU r % count)"
    for net in lenet mlp; do
        measure mpirun --allow-run-as-root --oversubscribe --mca btl self,vader -n 8 \
            -x MATMUL_NUM_THREADS=1 -x RAYON_NUM_THREADS=1 \
            "$MPI_BIN" --device cuda --net "$net" --epochs 1 --batch-size 128 --no-hsdp \
            --log-dir "$OUT/log_mpi_$net" --print-every 1000 || status=1
    done
else
    echo "## 8 ranks: skipped, no mpirun on this machine"
fi

if part bench; then
echo "## Benchmark"
first=--header
# bench BINARY NET B K: one cellgraph row, labelled with the binary's name.
# Extra arguments after K go to the binary (`--graphs`).
bench() {
    local bin=$1 net=$2 b=$3 k=$4
    shift 4
    if [ -n "${DEADLINE:-}" ] && [ "$(date +%s)" -ge "$DEADLINE" ]; then
        echo "<!-- skipped (past DEADLINE): $bin $net $b x $k $* -->"
        return
    fi
    measure timeout "$CASE_TIMEOUT" "$BIN/$bin" --device cuda:0 --net "$net" --micro-batch "$b" --micro-size "$k" \
        --updates "$UPDATES" --warmup "$WARMUP" $first "$@" | sed "s/^| cellgraph /| cellgraph ($bin) /" || status=1
    first=
}
IFS=';' read -ra cases <<<"$CASES"
for cfg in "${cases[@]}"; do
    set -- $cfg
    if [ -x "$BIN/baseline_device_bench" ]; then bench baseline_device_bench "$@"; fi
    bench device_bench "$@"
    if [ -n "${GRAPHS:-}" ]; then bench device_bench "$@" --graphs; bench device_bench "$@" --graphs --in-step; fi
    # PyTorch between our two rounds (A B A), so that a DEADLINE cut keeps a ratio.
    if [ -n "${DEADLINE:-}" ] && [ "$(date +%s)" -ge "$DEADLINE" ]; then
        echo "<!-- skipped (past DEADLINE): PyTorch $* -->"
    else
        measure timeout "$CASE_TIMEOUT" python3 benches/pytorch_accumulation.py --net "$1" --micro-batch "$2" --micro-size "$3" \
            --updates "$UPDATES" --warmup "$WARMUP" || status=1
    fi
    if [ -x "$BIN/baseline_device_bench" ]; then bench baseline_device_bench "$@"; bench device_bench "$@"; fi
    if [ -n "${GRAPHS:-}" ]; then bench device_bench "$@"; bench device_bench "$@" --graphs; bench device_bench "$@" --graphs --in-step; fi
done
fi
exit $status
