# Sourced by scripts/gpu_check.sh and scripts/gpu_call.sh.
# measure CMD...: runs CMD and then prints the largest per-process GPU memory nvidia-smi saw
# while it ran (sampled every 50 ms, CUDA context included), as an HTML comment under CMD's
# output; returns CMD's status.
measure() {
    local log
    log=$(mktemp)
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits -lms 50 >"$log" 2>/dev/null &
    local smi=$!
    "$@"
    local rc=$?
    sleep 0.2
    kill "$smi" 2>/dev/null
    wait "$smi" 2>/dev/null
    echo "<!-- GPU memory, largest process: $(awk -F', *' '{ if ($2 + 0 > m) m = $2 + 0 } END { print m + 0 }' "$log") MiB -->"
    rm -f "$log"
    return $rc
}
