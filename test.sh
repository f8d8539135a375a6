#!/usr/bin/env bash
# The tests: installs what is missing (OpenMPI, libclang, Vulkan with Mesa's lavapipe), then
# runs every test, the device path on cubecl's wgpu runtime included (CUDA tests need
# `--features cuda` and a GPU: scripts/gpu_check.sh).
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/install-deps.sh
cargo test --workspace --locked --features wgpu "$@"
