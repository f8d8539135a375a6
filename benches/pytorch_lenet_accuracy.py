"""PyTorch reference for issue 3's accuracy setting, on the vendored data.

LeNet5 as MindSpore defines it (valid 5x5 convolutions without bias, HeUniform(sqrt 5);
Dense layers with Normal(0.02) weights and Uniform(1/sqrt(in)) biases), MindSpore's LeNet
pipeline (bilinear Resize(32, 32) on the uint8 image, x/255, (x - 0.1307)/0.3081), batch 32
with drop_remainder, a fresh uniform shuffle each epoch, Momentum(0.01, 0.9), mini_steps=4 with
the loss divided by the window's batch count (`--reduction mean`) or not (`sum`), 10 epochs,
test accuracy on all 2,000 vendored test digits (as cellgraph's eval programs score them).

The incomplete window at an epoch's end (250 batches = 62 x 4 + 2) is applied with its true
count, as cellgraph does by default (`--leftover apply`), dropped (`drop`), or carried into the
next epoch's first window as the r1.6 tutorial's loop and a hand-written PyTorch loop do
(`carry`).

    python3 benches/pytorch_lenet_accuracy.py --seeds 1-40 --reduction mean

Prints one line per seed and the mean with its standard error. One thread, CPU.
"""

import argparse
import gzip
import math
import statistics
import struct
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def read_idx(path):
    data = gzip.open(path).read() if str(path).endswith(".gz") else open(path, "rb").read()
    magic, n = struct.unpack(">II", data[:8])
    if magic == 2051:
        rows, cols = struct.unpack(">II", data[8:16])
        return np.frombuffer(data, np.uint8, n * rows * cols, 16).reshape(n, rows, cols)
    return np.frombuffer(data, np.uint8, n, 8)


def lenet_pipeline(images):
    """Half-pixel bilinear 28 -> 32 on the uint8 image, rounded half up back to uint8 (OpenCV's
    fixed-point rounding, and cellgraph's), then rescaled."""
    n, h, w = images.shape
    o = 32

    def coords(size):
        f = np.maximum((np.arange(o, dtype=np.float32) + 0.5) * np.float32(size / o) - 0.5, 0)
        i0 = np.minimum(np.floor(f).astype(np.int64), size - 1)
        i1 = np.minimum(i0 + 1, size - 1)
        return i0, i1, (f - i0).astype(np.float32)

    y0, y1, fy = coords(h)
    x0, x1, fx = coords(w)
    src = images.astype(np.float32)
    top = src[:, y0][:, :, x0] * (1 - fx) + src[:, y0][:, :, x1] * fx
    bot = src[:, y1][:, :, x0] * (1 - fx) + src[:, y1][:, :, x1] * fx
    out = top * (1 - fy[:, None]) + bot * fy[:, None]
    out = np.clip(np.floor(out + 0.5), 0, 255) / 255.0
    return torch.from_numpy(((out - 0.1307) / 0.3081).astype(np.float32)).unsqueeze(1)


class LeNet5(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5, bias=False)
        self.conv2 = nn.Conv2d(6, 16, 5, bias=False)
        self.fc1 = nn.Linear(400, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)
        # Conv2d's default is kaiming_uniform(a=sqrt 5), MindSpore's HeUniform(sqrt 5); Linear's
        # bias default is Uniform(1/sqrt(in)), MindSpore's Dense default. Weights: Normal(0.02).
        for fc in (self.fc1, self.fc2, self.fc3):
            nn.init.normal_(fc.weight, 0.0, 0.02)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def train_and_eval(seed, data, args):
    x_train, y_train, x_test, y_test = data
    torch.manual_seed(seed)
    net = LeNet5()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    b, k = 32, args.mini_steps
    batches = len(x_train) // b
    pending = 0
    for _ in range(args.epochs):
        order = torch.randperm(len(x_train), generator=gen)[: batches * b].view(batches, b)
        windows = [list(range(s, min(s + k, batches))) for s in range(0, batches, k)]
        for window in windows:
            if len(window) < k and args.leftover == "drop":
                continue
            # `carry`: every window is divided by K and a short window's gradients wait for the
            # next epoch's first window, as in `if (i + 1) % K == 0: step()`.
            div = k if args.leftover == "carry" else len(window)
            for i in window:
                idx = order[i]
                loss = F.cross_entropy(net(x_train[idx]), y_train[idx])
                (loss / div if args.reduction == "mean" else loss).backward()
                pending += 1
            if len(window) == k or args.leftover == "apply":
                opt.step()
                opt.zero_grad()
                pending = 0
    with torch.no_grad():
        return (net(x_test).argmax(1) == y_test).float().mean().item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data-path", default=str(Path(__file__).resolve().parent.parent / "data" / "mnist"))
    p.add_argument("--seeds", default="1-8", help="a range, a-b")
    p.add_argument("--reduction", choices=["mean", "sum"], default="mean")
    p.add_argument("--leftover", choices=["apply", "drop", "carry"], default="apply")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--mini-steps", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(1)
    d = Path(args.data_path)
    data = (
        lenet_pipeline(read_idx(d / "train-images-idx3-ubyte.gz")),
        torch.from_numpy(read_idx(d / "train-labels-idx1-ubyte.gz").astype(np.int64)),
        lenet_pipeline(read_idx(d / "t10k-images-idx3-ubyte.gz")),
        torch.from_numpy(read_idx(d / "t10k-labels-idx1-ubyte.gz").astype(np.int64)),
    )
    lo, hi = (int(s) for s in args.seeds.split("-"))
    accs = []
    for seed in range(lo, hi + 1):
        accs.append(train_and_eval(seed, data, args))
        print(f"pytorch {args.reduction} {args.leftover} seed {seed} accuracy {accs[-1]:.6f}", flush=True)
    mean = statistics.fmean(accs)
    se = statistics.stdev(accs) / math.sqrt(len(accs)) if len(accs) > 1 else float("nan")
    at_bar = sum(a >= 0.96 for a in accs)
    print(f"pytorch {args.reduction} {args.leftover}: {len(accs)} seeds, mean {mean:.4%} +- {se:.4%} (s.e.), "
          f"{at_bar} at or above 96%")


if __name__ == "__main__":
    main()
