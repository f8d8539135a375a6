#!/usr/bin/env bash
# The tests: installs what is missing (OpenMPI, libclang, Vulkan with Mesa's lavapipe), then
# runs every test, the device path on cubecl's wgpu runtime included (CUDA tests need
# `--features cuda` and a GPU: scripts/gpu_check.sh).
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/install-deps.sh
cargo test --workspace --locked --features wgpu "$@"
if [[ $# -eq 0 ]]; then
    # Plans choose the AVX-512 BF16 pairs only where they beat f32 (not on Intel's cores):
    # the tests of plans that run them, again with the pairs chosen wherever the CPU has them.
    CELLGRAPH_BF16_PAIRS=1 cargo test --locked --features wgpu --test it -- \
        precision::bf16_products_on_the_cpu binding::a_weights_bf16_copy_that_only_bf16_products_read
fi
