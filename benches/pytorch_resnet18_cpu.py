"""PyTorch side of `benches/compare_cpu.sh`, cases resnet1 and resnet2: the work of

    colossal_resnet18 --train --batch-size 32 --epochs 1 --print-every 0

in one process on the CPU with `--threads N` intra-op threads: torchvision's resnet18(num_classes=10)
(written out here, so torchvision is not needed: a 7x7 stride-2 stem, 3x3 stride-2 max pooling
padded by 1, four stages of two BasicBlocks with 1x1 strided downsample convolutions, global
average pooling, fc), BatchNorm2d in training mode, CrossEntropyLoss, batches of 32 of the
vendored MNIST digits resized to 32x32 and copied to three channels (drop_last, a fresh seeded
shuffle each epoch), each batch's loss divided by 4 and the optimizer stepping every 4 batches
(the Colossal-AI seed's loop), SGD(lr=0.1, momentum=0.9, weight_decay=5e-4).

The images are decoded, resized, augmented once (RandomCrop(32, padding=4), RandomHorizontalFlip)
and normalised before the clock starts; cellgraph augments every batch inside its loop, so this
favours PyTorch. Timed: the epoch loop, i.e. the shuffle, gathering each batch, forward,
backward, reading the loss back, the optimizer steps and zero_grad. No warm-up step, as
cellgraph's loop has none (its first step compiles the graphs).

Prints one line, the figure compare_cpu.sh reads:
    pytorch: trained 250 steps, 63 optimizer updates, 8000 images in 20.1 s (398.0 images/s)
"""

import argparse
import gzip
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def idx(path):
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(dims)


def find(d, stem):
    for name in (stem, stem + ".gz"):
        if (d / name).exists():
            return d / name
    raise SystemExit(f"{d / stem}: not found")


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.downsample is None else self.downsample(x)))


class ResNet18(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths = [(64, 64, 1), (64, 128, 2), (128, 256, 2), (256, 512, 2)]
        self.layers = nn.Sequential(*[nn.Sequential(BasicBlock(i, o, s), BasicBlock(o, o, 1)) for i, o, s in widths])
        self.fc = nn.Linear(512, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layers(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-path", default="data/mnist")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--micro-size", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    d = Path(args.data_path)
    images = torch.from_numpy(idx(find(d, "train-images-idx3-ubyte")).astype(np.float32) / 255.0)
    labels = torch.from_numpy(idx(find(d, "train-labels-idx1-ubyte")).astype(np.int64))
    x = F.interpolate(images[:, None], size=(32, 32), mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
    # RandomCrop(32, padding=4) and RandomHorizontalFlip, once, then Normalize.
    g = torch.Generator().manual_seed(0)
    padded = F.pad(x, (4, 4, 4, 4))
    off = torch.randint(0, 9, (len(x), 2), generator=g)
    x = torch.stack([padded[i, :, dy : dy + 32, dx : dx + 32] for i, (dy, dx) in enumerate(off.tolist())])
    flip = torch.rand(len(x), generator=g) < 0.5
    x[flip] = x[flip].flip(-1)
    mean = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
    std = torch.tensor([0.2023, 0.1994, 0.2010]).view(1, 3, 1, 1)
    x = ((x - mean) / std).contiguous()

    model = ResNet18(10)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    b, k = args.batch_size, args.micro_size
    steps = updates = 0
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        batches = len(x) // b
        opt.zero_grad()
        for i in range(batches):
            sel = perm[i * b : (i + 1) * b]
            loss = F.cross_entropy(model(x[sel]), labels[sel]) / k
            loss.backward()
            loss.item()
            steps += 1
            if (i + 1) % k == 0 or i + 1 == batches:
                opt.step()
                opt.zero_grad()
                updates += 1
    secs = time.perf_counter() - t0
    n = steps * b
    print(f"pytorch: trained {steps} steps, {updates} optimizer updates, {n} images in {secs:.3f} s ({n / secs:.1f} images/s)")


if __name__ == "__main__":
    main()
