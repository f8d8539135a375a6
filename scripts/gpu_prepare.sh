#!/usr/bin/env bash
# Builds the GPU check's binaries on a machine without a GPU (no CUDA toolkit needed: cubecl
# loads the driver at run time), strips and compresses them into target/gpu for one device
# call that carries `target/gpu` and runs scripts/gpu_call.sh (about 26 minutes on 2 cores the
# first time, 8 after a change to the runtime). BASELINE=REV also builds device_bench at that
# revision (in a worktree) as target/gpu/baseline_device_bench, timed beside the new build.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/work/target-cuda}
cargo build --locked --release --no-default-features --features cuda --example device_bench --example matmul_probe
it=$(cargo test --locked --release --no-default-features --features cuda --test it --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "it"][-1])')
mkdir -p target/gpu
rm -f target/gpu/*
strip -o target/gpu/device_bench "$CARGO_TARGET_DIR/release/examples/device_bench"
strip -o target/gpu/it "$it"
strip -o target/gpu/matmul_probe "$CARGO_TARGET_DIR/release/examples/matmul_probe"
if [ -n "${BASELINE:-}" ]; then
    wt=$(mktemp -d)
    git worktree add --detach "$wt" "$BASELINE"
    (cd "$wt" && cargo build --locked --release --no-default-features --features cuda --example device_bench)
    strip -o target/gpu/baseline_device_bench "$CARGO_TARGET_DIR/release/examples/device_bench"
    git worktree remove --force "$wt"
    # The new build again: the worktree's build replaced it in the shared target dir.
    cargo build --locked --release --no-default-features --features cuda --example device_bench
fi
xz -T0 -6 target/gpu/*
ls -la target/gpu
