#!/usr/bin/env bash
# cellgraph against PyTorch on the CPU, side by side in one run: the same training work on each
# side, run alternately (cellgraph, PyTorch, cellgraph, PyTorch, ...), pinned with taskset;
# prints each pair's training-loop images/s and the ratio cellgraph / PyTorch, then per case
# the median ratio and its min-max range.
#
#   bash benches/compare_cpu.sh [--pairs N] [--case lenet1|lenet2|lenet8|mlp8|resnet1|resnet2|gpt1|gpt2|all]
#
#   --pairs N   pairs per case (default 5)
#   --case C    one case, or all (default):
#     lenet1  LeNet5, batch 32, 4 batches per update (across-steps, loss / 4), Momentum(0.01, 0.9),
#             one epoch, 1 thread, pinned to CPU 0
#     lenet2  the same with 2 threads on each side, pinned to CPUs 0,1
#     lenet8  8 ranks of distributed_gradient_accumulation --net lenet --batch-size 128
#             (mpirun) against torchrun + gloo DDP with no_sync, 1 thread per rank, CPUs 0,1
#     mlp8    8 ranks of the seed-002 MLP (the main job's configuration, run.sh, with --epochs 1)
#             against torchrun + gloo DDP on the same MLP, 1 thread per rank, CPUs 0,1
#     resnet1 ResNet-18 (BatchNorm in training mode) on the MNIST digits as 3x32x32 images,
#             batch 32, 4 batches per update (Colossal-AI's loop: loss / 4, SGD(0.1, 0.9,
#             weight decay 5e-4)), one epoch, 1 thread, CPU 0 (colossal_resnet18 --train)
#     resnet2 the same with 2 threads on each side, CPUs 0,1
#     gpt1    the character GPT on Shakespeare (4 layers, 4 heads, width 128, context 128),
#             20 updates of 32 windows in 4 micro-batches, token-weighted, AdamW, clip 1.0,
#             1 thread, CPU 0 (gpt_accumulation against benches/pytorch_gpt.py, whose
#             attention is scaled_dot_product_attention(is_causal=True) as nanoGPT's); tokens/s
#     gpt2    the same with 2 threads on each side, CPUs 0,1
#
# Environment:
#   PYTHON=/path/to/python  the Python with torch (default: python3). This script installs
#                           nothing; make a throwaway venv outside the repo, e.g.
#                             python3 -m venv /tmp/torchvenv
#                             /tmp/torchvenv/bin/pip install torch==2.15.0 numpy
#                             PYTHON=/tmp/torchvenv/bin/python bash benches/compare_cpu.sh
#   RUN_TIMEOUT=S           kill a single run after S seconds (default 600); that fails the script
#   GPT_ATTENTION=manual    the GPT twin's attention as nanoGPT's slow path (scores, masked_fill,
#                           softmax; what gpt1/gpt2 compared against before 2026-11-27); default sdpa
#   PRECISION=bf16          gpt1/gpt2 in bf16: gpt_accumulation --precision bf16 (bf16 products on
#                           AVX-512 BF16 where the CPU has it) against the twin under
#                           torch.autocast("cpu", bfloat16); default f32 on both sides
#
# Needs the release binaries (built elsewhere; this script builds nothing):
#   cargo build --release --locked --bin cellgraph --bin distributed_gradient_accumulation
#   cargo build --release --locked --example colossal_resnet18   (resnet1, resnet2)
#   cargo build --release --locked --example gpt_accumulation    (gpt1, gpt2)
# and bash, awk, taskset, mpirun (Open MPI) and torch's torchrun (`python -m torch.distributed.run`).
#
# What each side times (see the docstrings of benches/pytorch_lenet_cpu.py and pytorch_ddp.py):
#   cellgraph: `cellgraph train` prints "trained S steps, U optimizer updates in T s (N images/s)",
#     the time of its epoch loop (Model::train with its callbacks), which includes the data
#     pipeline per batch (resize, rescale, shuffle, batching) and the first step's graph
#     compilation; N is used as printed. distributed_gradient_accumulation's rank 0 prints
#     "training: T s, N images/s across ranks" (Model::train on rank 0, ranks already in step;
#     N counts the images trained, so drop_remainder's dropped batch is not counted).
#   PyTorch: the same loop over data decoded and normalised before the clock; 8 ranks: rank 0
#     between two barriers. Neither side has a warm-up step.
set -euo pipefail
cd "$(dirname "$0")/.."

PAIRS=5
CASE=all
usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; }
die() {
    echo "compare_cpu.sh: error: $*" >&2
    exit 1
}
while [[ $# -gt 0 ]]; do
    case "$1" in
        --pairs) [[ $# -ge 2 ]] || die "--pairs needs a number"; PAIRS=$2; shift 2 ;;
        --pairs=*) PAIRS=${1#*=}; shift ;;
        --case) [[ $# -ge 2 ]] || die "--case needs one of lenet1, lenet2, lenet8, mlp8, resnet1, resnet2, gpt1, gpt2, all"; CASE=$2; shift 2 ;;
        --case=*) CASE=${1#*=}; shift ;;
        -h | --help) usage; exit 0 ;;
        *) usage >&2; die "unknown argument: $1" ;;
    esac
done
[[ "$PAIRS" =~ ^[1-9][0-9]*$ ]] || die "--pairs must be a positive integer, got '$PAIRS'"
case "$CASE" in
    lenet1 | lenet2 | lenet8 | mlp8 | resnet1 | resnet2 | gpt1 | gpt2) CASES=("$CASE") ;;
    all) CASES=(lenet1 lenet2 lenet8 mlp8 resnet1 resnet2 gpt1 gpt2) ;;
    *) die "--case must be lenet1, lenet2, lenet8, mlp8, resnet1, resnet2, gpt1, gpt2 or all, got '$CASE'" ;;
esac
RUN_TIMEOUT=${RUN_TIMEOUT:-600}
case "${PRECISION:-f32}" in
    f32) ;;
    bf16) for c in "${CASES[@]}"; do [[ $c == gpt1 || $c == gpt2 ]] || die "PRECISION=bf16 is for gpt1 and gpt2 (ResNet-18 in bf16: device_bench --device cpu --precision bf16), got --case $c"; done ;;
    *) die "PRECISION must be f32 or bf16, got '$PRECISION'" ;;
esac
PYTHON=${PYTHON:-python3}

# --- prerequisites: nothing is installed or built here -------------------------------------
for tool in awk taskset timeout sort; do
    command -v "$tool" >/dev/null || die "'$tool' not found on PATH"
done
command -v "$PYTHON" >/dev/null || die "PYTHON=$PYTHON: no such command"
if ! TORCH_VERSION=$("$PYTHON" -c 'import numpy, torch; print(torch.__version__)' 2>/dev/null); then
    cat >&2 <<EOF
compare_cpu.sh: error: '$PYTHON -c "import torch"' failed: this Python has no PyTorch (or no numpy).
The script installs nothing. Make a throwaway virtual environment outside the repository and
point PYTHON at it:
    python3 -m venv /tmp/torchvenv
    /tmp/torchvenv/bin/pip install torch==2.15.0 numpy
    PYTHON=/tmp/torchvenv/bin/python bash benches/compare_cpu.sh
EOF
    exit 1
fi
[[ "$TORCH_VERSION" == 2.15.* ]] || echo "warning: PyTorch is $TORCH_VERSION, not 2.15" >&2
need_bin() {
    [[ -x "$1" ]] || die "$1 is missing: build it first with
    cargo build --release --locked --bin $(basename "$1")
(this script builds nothing)"
}
for c in "${CASES[@]}"; do
    case "$c" in
        lenet1 | lenet2) need_bin target/release/cellgraph ;;
        gpt1 | gpt2)
            [[ -x target/release/examples/gpt_accumulation ]] || die "target/release/examples/gpt_accumulation is missing: build it first with
    cargo build --release --locked --example gpt_accumulation"
            [[ -f data/shakespeare/shakespeare.txt.gz ]] || die "data/shakespeare/shakespeare.txt.gz (the vendored corpus) not found under $(pwd)"
            ;;
        resnet1 | resnet2)
            [[ -x target/release/examples/colossal_resnet18 ]] || die "target/release/examples/colossal_resnet18 is missing: build it first with
    cargo build --release --locked --example colossal_resnet18"
            ;;
        lenet8 | mlp8)
            need_bin target/release/distributed_gradient_accumulation
            command -v mpirun >/dev/null || die "mpirun not found (Open MPI: apt-get install openmpi-bin)"
            "$PYTHON" -c 'import torch.distributed.run' 2>/dev/null || die "$PYTHON has no torch.distributed.run (torchrun)"
            ;;
    esac
done
[[ -d data/mnist ]] || die "data/mnist (the vendored MNIST) not found under $(pwd)"

TMP=$(mktemp -d "${TMPDIR:-/tmp}/compare_cpu.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

# --- running and parsing ----------------------------------------------------------------------
# run LOG CMD...: runs CMD with its output in LOG; a failure stops the script with LOG's tail.
run() {
    local log=$1 rc=0
    shift
    timeout "$RUN_TIMEOUT" "$@" >"$log" 2>&1 || rc=$?
    if [[ $rc -ne 0 ]]; then
        echo "compare_cpu.sh: error: run failed (exit $rc$([[ $rc -eq 124 ]] && echo ", killed after RUN_TIMEOUT=${RUN_TIMEOUT}s")):" >&2
        echo "    $*" >&2
        echo "--- last lines of its output ---" >&2
        tail -n 25 "$log" >&2
        exit 1
    fi
}
# grab LOG AWK_PROGRAM WHAT: prints the awk program's output on LOG, which must be numbers.
grab() {
    local out
    out=$(awk "$2" "$1")
    if ! [[ "$out" =~ ^[0-9]+(\.[0-9]+)?( [0-9]+(\.[0-9]+)?)*$ ]]; then
        echo "compare_cpu.sh: error: cannot parse $3 from the output:" >&2
        tail -n 25 "$1" >&2
        exit 1
    fi
    echo "$out"
}
number_is_positive() { awk -v x="$1" 'BEGIN { exit !(x > 0) }'; }

# Command lines per case (arrays: CG = cellgraph, PT = PyTorch); LOGDIR is set per run.
set_commands() {
    local c=$1
    CG_ENV=()
    case "$c" in
        lenet1 | lenet2)
            local n=${c#lenet} cpus=0
            [[ $n == 2 ]] && cpus=0,1
            CG_ENV=(MATMUL_NUM_THREADS=$n RAYON_NUM_THREADS=$n)
            CG=(taskset -c $cpus target/release/cellgraph train --net lenet --accumulation across-steps --micro-size 4
                --batch-size 32 --normalization mean --optimizer momentum --lr 0.01 --epochs 1 --device cpu)
            PT_ENV=(OMP_NUM_THREADS=$n)
            PT=(taskset -c $cpus "$PYTHON" benches/pytorch_lenet_cpu.py --threads "$n" --batch-size 32 --micro-size 4 --epochs 1)
            ;;
        resnet1 | resnet2)
            local n=${c#resnet} cpus=0
            [[ $n == 2 ]] && cpus=0,1
            CG_ENV=(MATMUL_NUM_THREADS=$n RAYON_NUM_THREADS=$n)
            CG=(taskset -c $cpus target/release/examples/colossal_resnet18 --train --batch-size 32 --epochs 1 --print-every 0
                --ckpt LOGDIR)
            PT_ENV=(OMP_NUM_THREADS=$n)
            PT=(taskset -c $cpus "$PYTHON" benches/pytorch_resnet18_cpu.py --threads "$n" --batch-size 32 --micro-size 4 --epochs 1)
            ;;
        gpt1 | gpt2)
            local n=${c#gpt} cpus=0
            [[ $n == 2 ]] && cpus=0,1
            CG_ENV=(MATMUL_NUM_THREADS=$n RAYON_NUM_THREADS=$n)
            CG=(taskset -c $cpus target/release/examples/gpt_accumulation --epochs 1 --steps 20 --eval-items 64 --sample 0
                --print-every 0 --ckpt LOGDIR --precision "${PRECISION:-f32}")
            PT_ENV=(OMP_NUM_THREADS=$n)
            PT=(taskset -c $cpus "$PYTHON" benches/pytorch_gpt.py --threads "$n" --epochs 1 --steps 20 --eval-items 64
                --attention "${GPT_ATTENTION:-sdpa}" --autocast "$([[ ${PRECISION:-f32} == bf16 ]] && echo bf16 || echo off)")
            ;;
        lenet8 | mlp8)
            local net=()
            [[ $c == lenet8 ]] && net=(--net lenet --batch-size 128)
            [[ $c == mlp8 ]] && net=(--net mlp --batch-size 32)
            CG_ENV=(MATMUL_NUM_THREADS=1 RAYON_NUM_THREADS=1)
            CG=(taskset -c 0,1 mpirun --allow-run-as-root --oversubscribe --mca btl self,vader -n 8
                target/release/distributed_gradient_accumulation "${net[@]}" --epochs 1 --device cpu --log-dir LOGDIR)
            PT_ENV=(OMP_NUM_THREADS=1)
            PT=(taskset -c 0,1 "$PYTHON" -m torch.distributed.run --standalone --nnodes 1 --nproc_per_node 8
                benches/pytorch_ddp.py "${net[@]}" --micro-size 4 --epochs 1 --threads 1)
            ;;
    esac
}

# Runs one side; sets IPS (images/s), WORK (steps/updates, compared across sides) and NOTE.
run_cellgraph() {
    local c=$1 i=$2 log=$TMP/$1.cellgraph.$2.log cmd=()
    local logdir=$TMP/$1.logs.$2
    for a in "${CG[@]}"; do [[ $a == LOGDIR ]] && cmd+=("$logdir") || cmd+=("$a"); done
    run "$log" env "${CG_ENV[@]}" "${cmd[@]}"
    NOTE=""
    case "$c" in
        lenet1 | lenet2)
            # "trained 250 steps, 63 optimizer updates in 3.85 s (2075 images/s)"
            IPS=$(grab "$log" '/^trained [0-9]+ steps, [0-9]+ optimizer updates in .* images\/s\)/ { x = $(NF-1); sub(/^\(/, "", x); print x }' "cellgraph's images/s")
            WORK=$(grab "$log" '/^trained [0-9]+ steps, [0-9]+ optimizer updates in/ { print $2, $4 }' "cellgraph's steps and updates")
            ;;
        lenet8 | mlp8 | resnet1 | resnet2 | gpt1 | gpt2)
            # "ranks: 8, updates: 7, gradient collectives: 7, ..." and "training: 2.06 s, 3891 images/s across ranks"
            # (the GPT: "training: 5.9 s, 13867.2 tokens/s across ranks")
            local ru tp ranks updates secs printed
            ru=$(grab "$log" '/^ranks: [0-9]+, updates: [0-9]+/ { r = $2; u = $4; sub(/,/, "", r); sub(/,/, "", u); print r, u }' "cellgraph's ranks and updates")
            tp=$(grab "$log" '/^training: .* s, .* (images|tokens)\/s across ranks/ { print $2, $4 }' "cellgraph's training time and images/s")
            read -r ranks updates <<<"$ru"
            read -r secs printed <<<"$tp"
            number_is_positive "$secs" || die "cellgraph's training time is $secs s (too short to measure): see $log"
            WORK="$updates"
            IPS=$printed
            ;;
    esac
}
run_pytorch() {
    local c=$1 i=$2 log=$TMP/$1.pytorch.$2.log
    run "$log" env "${PT_ENV[@]}" "${PT[@]}"
    case "$c" in
        lenet1 | lenet2)
            # "pytorch: trained 250 steps, 63 optimizer updates, 8000 images in 1.575 s (5080.0 images/s)"
            IPS=$(grab "$log" '/^pytorch: trained [0-9]+ steps/ { x = $(NF-1); sub(/^\(/, "", x); print x }' "PyTorch's images/s")
            WORK=$(grab "$log" '/^pytorch: trained [0-9]+ steps/ { print $3, $5 }' "PyTorch's steps and updates")
            ;;
        resnet1 | resnet2 | gpt1 | gpt2)
            IPS=$(grab "$log" '/^pytorch: trained [0-9]+ steps/ { x = $(NF-1); sub(/^\(/, "", x); print x }' "PyTorch's images/s")
            WORK=$(grab "$log" '/^pytorch: trained [0-9]+ steps/ { print $5 }' "PyTorch's updates")
            ;;
        lenet8 | mlp8)
            # "pytorch ddp: ranks 8, updates 7, 7168 images, training: 1.075 s, 6665.5 images/s across ranks"
            IPS=$(grab "$log" '/^pytorch ddp: ranks [0-9]+, updates/ { print $(NF-3) }' "PyTorch's images/s")
            WORK=$(grab "$log" '/^pytorch ddp: ranks [0-9]+, updates/ { u = $6; sub(/,/, "", u); print u }' "PyTorch's updates")
            ;;
    esac
}

median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }'; }

# --- the run ---------------------------------------------------------------------------------
MODEL=$(lscpu 2>/dev/null | awk -F: '/^Model name/ { sub(/^ +/, "", $2); print $2; exit }')
echo "compare_cpu.sh: cellgraph vs PyTorch on the CPU, $PAIRS pair(s) per case, alternating cellgraph then PyTorch"
echo "date:      $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
echo "cpu:       ${MODEL:-unknown} ($(nproc) CPUs online)"
echo "load avg:  $(cut -d' ' -f1-3 /proc/loadavg) at start"
echo "cellgraph: $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD -- 2>/dev/null || echo ' (work tree modified)'), binaries from target/release"
echo "pytorch:   $TORCH_VERSION ($PYTHON)"
echo "precision: ${PRECISION:-f32}$([[ ${PRECISION:-f32} == bf16 ]] && echo " (cellgraph --precision bf16, PyTorch autocast bf16)")"
echo "mpirun:    $(mpirun --version 2>/dev/null | head -n 1 || echo 'not found')"

SUMMARY=()
for c in "${CASES[@]}"; do
    set_commands "$c"
    echo
    echo "== $c =="
    echo "cellgraph: ${CG_ENV[*]} ${CG[*]/LOGDIR/<tmpdir>}"
    echo "pytorch:   ${PT_ENV[*]} ${PT[*]}"
    ratios=() cgs=() pts=()
    UNIT=images/s
    [[ $c == gpt* ]] && UNIT=tokens/s
    for ((i = 1; i <= PAIRS; i++)); do
        run_cellgraph "$c" "$i"
        cg=$IPS cg_work=$WORK cg_note=$NOTE
        run_pytorch "$c" "$i"
        pt=$IPS pt_work=$WORK
        [[ "$cg_work" == "$pt_work" ]] || die "$c: the two sides did different work: cellgraph steps/updates '$cg_work', PyTorch '$pt_work'"
        number_is_positive "$pt" || die "$c: PyTorch's images/s is $pt"
        r=$(awk -v a="$cg" -v b="$pt" 'BEGIN { printf "%.3f", a / b }')
        ratios+=("$r") cgs+=("$cg") pts+=("$pt")
        printf '%s pair %d/%d: cellgraph %8.1f %s%s, PyTorch %8.1f %s, ratio %s\n' "$c" "$i" "$PAIRS" "$cg" "$UNIT" "$cg_note" "$pt" "$UNIT" "$r"
    done
    med=$(printf '%s\n' "${ratios[@]}" | median)
    lo=$(printf '%s\n' "${ratios[@]}" | sort -g | head -n 1)
    hi=$(printf '%s\n' "${ratios[@]}" | sort -g | tail -n 1)
    mcg=$(printf '%s\n' "${cgs[@]}" | median)
    mpt=$(printf '%s\n' "${pts[@]}" | median)
    line=$(printf '%-7s median ratio cellgraph/PyTorch %.3f (min %.3f, max %.3f, %d pairs); median %s: cellgraph %.1f, PyTorch %.1f' \
        "$c" "$med" "$lo" "$hi" "$PAIRS" "$UNIT" "$mcg" "$mpt")
    echo "$line"
    SUMMARY+=("$line")
done

echo
echo "== summary ($(date -u '+%Y-%m-%d %H:%M:%S UTC'), load avg $(cut -d' ' -f1-3 /proc/loadavg) at end) =="
printf '%s\n' "${SUMMARY[@]}"
