#!/usr/bin/env bash
# The tests: installs what is missing (OpenMPI, libclang), then runs every test.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/install-deps.sh
cargo test --workspace --locked "$@"
