#!/usr/bin/env bash
# The one device call of a GPU check, from the binaries scripts/gpu_prepare.sh left in
# target/gpu: run it on the GPU machine with `target/gpu` carried, e.g.
#   bash scripts/gpu_call.sh            (about 4 minutes on an H100)
# 1. the CUDA tests (`it device::cuda`, TESTS_TIMEOUT seconds, default 200), replay included:
#    `checks_with_graphs_on_cuda_match_cpu` is the gate for making replay the default on CUDA;
# 2. the launches one LeNet5 window makes, op by op, each micro-step replayed, and the whole
#    window replayed as one graph (--in-step), then cubek's matmul routines at the nets'
#    products beside torch.matmul (benches/matmul_probe.rs, benches/torch_mm.py);
# 3. the benchmark beside PyTorch (eager and CUDA graphs), each case op by op, each micro-step
#    replayed and each window replayed, alternating (scripts/gpu_check.sh with GRAPHS=1).
#    CASES, UPDATES and WARMUP as there;
# 4. bf16 (BF16_CASES, default the GPT 64 x 4 and ResNet-18 32 x 4): bf16 compute with its
#    values stored in bf16 and its matmuls and convolutions on tensor cores, op by op and with
#    its window replayed, the same on f32 storage (--f32-storage), the emulation
#    (--f32-products --f32-storage), and PyTorch's autocast (bf16, TF32 on), alternating,
#    each with the GPU memory its process took (nvidia-smi, scripts/gpu_measure.sh);
# 5. issue 43's memory bar: each bf16 case in f32 at its micro-batch and in bf16 at 1.8x it,
#    and whether the second fits in the first's memory.
# Logs go to $OUT (the device tool brings them back).
# BUDGET (seconds, default 520) bounds the call, under the device tool's 600 s per command:
# benchmark commands that would start after it are skipped, named, and the parts run in order
# of what matters most (the tests gating replay by default, launches, f32, bf16).
set -u
cd "$(dirname "$0")/.."
export DEADLINE=$(( $(date +%s) + ${BUDGET:-520} ))
late() { [ "$(date +%s)" -ge "$DEADLINE" ] && echo "skipped (past BUDGET): $*"; }
OUT=${OUT:-/tmp/gpu_call}
mkdir -p "$OUT"
# The tests find their data through the path they were built in.
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
G=target/gpu
for f in $G/*.xz; do [ -e "$f" ] && xz -dkf "$f"; done
chmod +x $G/device_bench $G/it $G/matmul_probe $G/baseline_device_bench 2>/dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || { echo "no NVIDIA GPU here"; exit 1; }
python3 -c 'import torch; print("PyTorch", torch.__version__)' 2>/dev/null || echo "no PyTorch here"
echo "## CUDA tests"
# --nocapture: each failure's message is printed where it happens (libtest prints them only
# at the end, which a timeout cuts off).
timeout ${TESTS_TIMEOUT:-200} $G/it --test-threads 1 --nocapture device::cuda >"$OUT/tests.log" 2>&1
echo "rc $?"
grep -E "^test |test result|vs CPU|panicked|differ|graph replay|refusal|capture" "$OUT/tests.log" | cut -c1-600 | head -80
echo "## launches per LeNet5 window (op by op, each micro-step replayed, the window replayed)"
for g in "" --graphs "--graphs --in-step"; do
    log="$OUT/launches${g// /}.log"
    timeout 60 $G/device_bench --device cuda:0 --net lenet --micro-batch 32 --micro-size 4 --updates 5 --warmup 2 --launches $g >"$log" 2>&1
    grep -E "launches|replay|not captured|last loss|transfers|rror" "$log" | head -8
done
if [ -x $G/matmul_probe ] && ! late "matmul probe"; then
    echo "## cubek's matmul routines at the nets' products, beside torch.matmul"
    for d in f32 bf16; do
        timeout 40 $G/matmul_probe --dtype $d --routines SimpleUnit,DoubleUnit,SimpleUnitMin,DoubleUnitMin,DoubleCyclicMma,SimpleCyclicMma,SimpleCyclicCmma 2>&1 | tee -a "$OUT/probe.log" | cut -c1-260
    done
    # The GPT's tied head in a bf16 plan: a bf16 operand and an f32 one holding bf16 values,
    # staged in f32 (the runtime's choice, refused on the H200 on 2026-12-04) and in bf16.
    timeout 30 $G/matmul_probe --dtype bf16xf32 --shapes "8192x128x65:tb;8192x65x128;65x8192x128:ta;144x48x40:tb" \
        --routines SimpleUnit,DoubleCyclicMma,SimpleCyclicMma,SimpleCyclicCmma 2>&1 | tee -a "$OUT/probe.log" | cut -c1-260
    timeout 30 python3 benches/torch_mm.py 2>&1 | tee -a "$OUT/probe.log"
fi
echo "## benchmark"
OUT=$OUT GRAPHS=1 PARTS=bench CASES="${CASES:-lenet 32 4;mlp 256 4;resnet18 32 4;gpt 64 4}" UPDATES=${UPDATES:-20} WARMUP=${WARMUP:-3} \
    CASE_TIMEOUT=${CASE_TIMEOUT:-60} bash scripts/gpu_check.sh $G 2>&1 | tee "$OUT/bench.log" | grep -E "^\| |replay|not captured|rror"
echo "## bf16"
source scripts/gpu_measure.sh
IFS=';' read -ra bf16_cases <<<"${BF16_CASES:-gpt 64 4;resnet18 32 4}"
for cfg in "${bf16_cases[@]}"; do
    set -- $cfg
    for pass in 1 2; do
        # Op by op, the window replayed (issue 43's second bar: >= 1.0x autocast with CUDA
        # graphs), then the f32-storage and f32-products references. Each with the GPU memory
        # its process took (issue 43: at most PyTorch autocast's, whose process runs eager and
        # graphs and also prints its allocator's peak).
        for products in "" "--graphs --in-step" --f32-storage "--f32-products --f32-storage"; do
            late "bf16 $cfg $products" && continue
            measure timeout 90 $G/device_bench --device cuda:0 --net "$1" --micro-batch "$2" --micro-size "$3" --updates "${UPDATES:-20}" \
                --warmup "${WARMUP:-3}" --precision bf16 $products 2>&1 | tee -a "$OUT/bf16.log" | grep -E "^\| |bf16 products|storage|tensor-core|flash|GPU memory|rror"
        done
        late "bf16 $cfg PyTorch autocast" && continue
        measure timeout 90 python3 benches/pytorch_accumulation.py --net "$1" --micro-batch "$2" --micro-size "$3" --updates "${UPDATES:-20}" \
            --warmup "${WARMUP:-3}" --autocast bf16 2>&1 | tee -a "$OUT/bf16.log" | grep -E "^\| |GPU memory|rror"
    done
done
# Issue 43's memory bar: a bf16 micro-batch at least 1.8x the f32 one fits in the same memory.
# The f32 run at the case's micro-batch and the bf16 one at 1.8x it (rounded up), op by op,
# 5 updates each (the peak is reached in the first window), then the verdict (both figures
# are the process's, CUDA context included on both sides).
echo "## bf16 at 1.8x the micro-batch against f32 (GPU memory)"
for cfg in "${bf16_cases[@]}"; do
    set -- $cfg
    big=$(( ($2 * 9 + 4) / 5 ))
    peaks=()
    for run in "$2 --precision f32" "$big --precision bf16"; do
        late "memory $1 $run" && continue
        log=$(measure timeout 60 $G/device_bench --device cuda:0 --net "$1" --micro-batch "${run%% *}" --micro-size "$3" --updates 5 \
            --warmup 1 ${run#* } 2>&1 | tee -a "$OUT/memory.log")
        grep -E "^\| |GPU memory|rror" <<<"$log"
        peaks+=("$(sed -n 's/.*largest process: \([0-9]*\) MiB.*/\1/p' <<<"$log" | tail -1)")
    done
    if [ ${#peaks[@]} -eq 2 ] && [ -n "${peaks[0]}" ] && [ -n "${peaks[1]}" ]; then
        verdict="does not fit"
        [ "${peaks[1]}" -le "${peaks[0]}" ] && verdict="fits"
        echo "memory bar, $1: bf16 at $big x $3 took ${peaks[1]} MiB, f32 at $2 x $3 ${peaks[0]} MiB: $verdict"
    fi
done
