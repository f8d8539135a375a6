#!/usr/bin/env bash
# The main job: MindSpore's distributed gradient accumulation sample (seed 002) on 8 MPI ranks:
# GradAccumulation(WithLossCell(net, loss), 4) under AutoParallel(net).hsdp(), trained with
# Model::train(10, dataset, [LossMonitor(100)]) on the vendored MNIST digits, on the CPU.
#   RANKS=N     number of ranks (default 8)
#   TIMEOUT=S   kill the whole job after S seconds (default 1800)
#   FEATURES=cuda  build with CUDA (then `--device cuda`: rank r on GPU r % count)
# Extra arguments pass through (`--net lenet`, `--net resnet18` (Colossal-AI's ResNet-18 example),
# `--epochs 2`, `--no-hsdp`, `--gradients-mean`;
# see `./target/release/distributed_gradient_accumulation --help`).
# Rank 0 prints its progress; every rank writes log_output/worker_<rank>.log.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/install-deps.sh
cargo build --release --locked ${FEATURES:+--features "$FEATURES"} --bin distributed_gradient_accumulation
mkdir -p log_output
# One compute thread per rank: the ranks share the machine's cores.
export MATMUL_NUM_THREADS=1 RAYON_NUM_THREADS=1
exec timeout "${TIMEOUT:-1800}" mpirun --allow-run-as-root --oversubscribe --mca btl self,vader \
    -n "${RANKS:-8}" ./target/release/distributed_gradient_accumulation --log-dir log_output "$@"
