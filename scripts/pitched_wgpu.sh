#!/usr/bin/env bash
# CUDA's memory layout on lavapipe, without a GPU: builds the device tests against a copy of
# cubecl-wgpu that allocates as cubecl's CUDA runtime does (PitchedMemoryLayoutPolicy, rows
# padded to up to 512 bytes, `can_read_tensor` taking pitched strides) and reads and writes
# pitched buffers, then runs TESTS (default `device::wgpu`).
#
# Why: burn 0.22 on CUDA hands out tensors whose rows are padded (`[64, 28]` f32 rows lie 32
# floats apart); wgpu never does, so a kernel that reads such a tensor flat is right on lavapipe
# and wrong on a GPU. On an H200 (2026-12-04) the convolution test and the GPT with dropout
# failed on CUDA and passed on lavapipe; with this copy they fail on lavapipe too (0.68 and 1.33
# relative), so they can be debugged here.
#
#   bash scripts/pitched_wgpu.sh                       # every wgpu device test
#   TESTS=device::wgpu::convolutions bash scripts/pitched_wgpu.sh
#
# It works in a worktree of HEAD beside the repository (../cellgraph-pitched, so that the tests
# find ../shared) with its own target dir
# (/work/target-pitch); the repository itself is not touched. About 13 minutes on 2 cores the
# first time.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
wt=${WORKTREE:-$repo/../cellgraph-pitched}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/work/target-pitch}
src=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cubecl-wgpu-0.11.0-pre.3 | head -1)
[ -d "$src" ] || { echo "cubecl-wgpu 0.11.0-pre.3 is not in cargo's registry: run cargo fetch first"; exit 1; }
[ -d "$wt" ] || git worktree add --detach "$wt" HEAD
mkdir -p "$wt/pitched"
rm -rf "$wt/pitched/cubecl-wgpu"
cp -r "$src" "$wt/pitched/cubecl-wgpu"
patch -d "$wt/pitched/cubecl-wgpu" -p2 -s <"$repo/scripts/pitched-wgpu.patch"
grep -q "pitched/cubecl-wgpu" "$wt/Cargo.toml" || printf '\n[patch.crates-io]\ncubecl-wgpu = { path = "pitched/cubecl-wgpu" }\n' >>"$wt/Cargo.toml"
cd "$wt"
bin=$(cargo test --features wgpu --test it --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "it"][-1])')
XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp} "$bin" --test-threads 2 ${TESTS:-device::wgpu}
