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
# `--net gpt` runs the character-level GPT on Shakespeare instead (sample_code/gpt_accumulation:
# token-weighted accumulation; its own options follow, see
# `./target/release/examples/gpt_accumulation --help`).
# `--net gpt2` fine-tunes a Hugging Face GPT-2 (`--model DIR`, default the vendored
# tests/assets/tiny-gpt2) on Shakespeare with `cellgraph finetune` (its options follow, see
# `./target/release/cellgraph finetune --help`) and saves it to gpt2-finetuned/.
# `--net llama` does the same with a Hugging Face Llama (default the vendored
# tests/assets/tiny-llama) and saves it to llama-finetuned/.
# Rank 0 prints its progress; every rank writes log_output/worker_<rank>.log.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/install-deps.sh
# One compute thread per rank: the ranks share the machine's cores.
export MATMUL_NUM_THREADS=1 RAYON_NUM_THREADS=1
MPIRUN=(timeout "${TIMEOUT:-1800}" mpirun --allow-run-as-root --oversubscribe --mca btl self,vader -n "${RANKS:-8}")
rest=()
gpt=0
gpt2=0
hf_model=tests/assets/tiny-gpt2
hf_out=gpt2-finetuned
while [ $# -gt 0 ]; do
    case "$1" in
        --net=gpt) gpt=1 ;;
        --net=gpt2) gpt2=1 ;;
        --net=llama) gpt2=1; hf_model=tests/assets/tiny-llama; hf_out=llama-finetuned ;;
        --net) case "${2:-}" in
                gpt) gpt=1; shift ;;
                gpt2) gpt2=1; shift ;;
                llama) gpt2=1; hf_model=tests/assets/tiny-llama; hf_out=llama-finetuned; shift ;;
                *) rest+=("$1") ;;
            esac ;;
        *) rest+=("$1") ;;
    esac
    shift
done
set -- ${rest[@]+"${rest[@]}"}
if [ "$gpt" = 1 ]; then
    cargo build --release --locked ${FEATURES:+--features "$FEATURES"} --example gpt_accumulation
    # 4 sequences per rank per update (micro-batches of 1): the 8 ranks' window of 32
    # sequences is the one-process default's. Later arguments override these.
    exec "${MPIRUN[@]}" ./target/release/examples/gpt_accumulation --batch-size 4 --micro-size 4 "$@"
fi
if [ "$gpt2" = 1 ]; then
    cargo build --release --locked ${FEATURES:+--features "$FEATURES"} --bin cellgraph
    # 1 sequence per rank per update: the 8 ranks' window of 8 sequences is the one-process
    # default's (8 in 4 micro-batches). Later arguments override these.
    exec "${MPIRUN[@]}" ./target/release/cellgraph finetune --model "$hf_model" \
        --data data/shakespeare/shakespeare.txt.gz --out "$hf_out" --batch-size 1 --micro-size 1 --steps 40 "$@"
fi
cargo build --release --locked ${FEATURES:+--features "$FEATURES"} --bin distributed_gradient_accumulation
mkdir -p log_output
exec "${MPIRUN[@]}" ./target/release/distributed_gradient_accumulation --log-dir log_output "$@"
