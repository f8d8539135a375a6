"""PyTorch side of `benches/compare_cpu.sh`, cases lenet1 and lenet2: the work of

    cellgraph train --net lenet --accumulation across-steps --micro-size 4 --batch-size 32 \\
        --normalization mean --optimizer momentum --lr 0.01 --epochs 1 --device cpu

in one process on the CPU with `--threads N` intra-op threads: MindSpore's LeNet5 (valid 5x5
convolutions without bias, ReLU, 2x2 max pooling, 120-84-10), softmax cross-entropy (mean),
batches of 32 from the vendored training split (drop_remainder, a fresh seeded shuffle each
epoch), the optimizer stepping once every 4 batches with each batch's loss divided by the
window's batch count (so by 4, and by 2 for the short window at the epoch's end, which is
applied, as cellgraph's `--leftover apply` default does), Momentum(0.01, 0.9).

The images are decoded, resized to 32x32 and normalised before the clock starts (cellgraph
does that per batch inside its loop; see compare_cpu.sh). Timed: the epoch loop, i.e. the
per-epoch shuffle, gathering each batch by index, forward, backward, reading the loss back
(cellgraph's LossMonitor sees every step's loss), the optimizer steps and zero_grad. No
warm-up step, as cellgraph's loop has none (its first step compiles the micro-step graph).

Prints one line, the figure compare_cpu.sh reads:
    pytorch: trained 250 steps, 63 optimizer updates, 8000 images in 2.345 s (3411.5 images/s)
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pytorch_lenet_accuracy import LeNet5, lenet_pipeline, read_idx  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data-path", default=str(Path(__file__).resolve().parent.parent / "data" / "mnist"))
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--micro-size", type=int, default=4, help="batches per optimizer update")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    d = Path(args.data_path)
    x_train = lenet_pipeline(read_idx(d / "train-images-idx3-ubyte.gz")).contiguous()
    y_train = torch.from_numpy(read_idx(d / "train-labels-idx1-ubyte.gz").astype(np.int64))
    torch.manual_seed(args.seed)
    net = LeNet5()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(args.seed)
    b, k = args.batch_size, args.micro_size
    batches = len(x_train) // b  # drop_remainder, as create_dataset
    steps = updates = 0
    loss_sum = 0.0

    t0 = time.perf_counter()
    for _ in range(args.epochs):
        order = torch.randperm(len(x_train), generator=gen)[: batches * b].view(batches, b)
        for start in range(0, batches, k):
            window = range(start, min(start + k, batches))
            for i in window:
                idx = order[i]
                loss = F.cross_entropy(net(x_train[idx]), y_train[idx])
                (loss / len(window)).backward()
                loss_sum += loss.item()
                steps += 1
            opt.step()
            opt.zero_grad()
            updates += 1
    secs = time.perf_counter() - t0

    images = steps * b
    print(f"pytorch {torch.__version__}, {torch.get_num_threads()} thread(s): mean loss {loss_sum / steps:.4f}")
    print(f"pytorch: trained {steps} steps, {updates} optimizer updates, {images} images in {secs:.3f} s ({images / secs:.1f} images/s)")


if __name__ == "__main__":
    main()
