#!/usr/bin/env bash
# The main job. Today: LeNet5 trained on the vendored MNIST digits in one process on the CPU.
# (The 8-rank mpirun launch with gradient accumulation arrives with the data-parallel work.)
# Extra arguments pass through to `cellgraph train` (see `cellgraph train --help`).
set -euo pipefail
cd "$(dirname "$0")"
cargo build --release --locked --bin cellgraph
exec ./target/release/cellgraph train "$@"
