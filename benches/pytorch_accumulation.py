"""PyTorch reference for `device_bench`: the same networks, accumulation and optimizers on the
same GPU, eager and with CUDA graphs (one captured graph per accumulation window).

Prints markdown table rows in device_bench's columns, plus the GPU's measured matmul peak.
Both read the loss back once per update (the last micro-batch's), no more.
Run by scripts/gpu_check.sh; needs torch with CUDA.

    python3 benches/pytorch_accumulation.py --net lenet --micro-batch 32 --micro-size 4
"""

import argparse
import time

import torch
import torch.nn as nn


class LeNet5(nn.Module):
    """MindSpore's LeNet5: valid 5x5 convolutions, ReLU, 2x2 max pooling, 120-84-10."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)
        self.pool = nn.MaxPool2d(2)
        self.relu = nn.ReLU()

    def forward(self, x):
        x = self.pool(self.relu(self.conv1(x)))
        x = self.pool(self.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        return self.fc3(x)


def mlp():
    """The seed-002 Network."""
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def setup(args):
    torch.manual_seed(1)
    if args.net == "lenet":
        model, hw = LeNet5().cuda(), 32
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    else:
        model, hw = mlp().cuda(), 28
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    b = args.micro_batch
    # Host batches, uploaded per micro-step as a data loader's would be.
    batches = [(torch.rand(b, 1, hw, hw) * 2 - 1, torch.randint(0, 10, (b,))) for _ in range(8)]
    return model, opt, batches


def flops_per_image(args):
    """Forward + backward FLOPs (2 per multiply-add; backward = 2x forward for weights)."""
    if args.net == "lenet":
        fwd = 2 * (6 * 28 * 28 * 25 + 16 * 10 * 10 * 150 + 400 * 120 + 120 * 84 + 84 * 10)
    else:
        fwd = 2 * (784 * 512 + 512 * 512 + 512 * 10)
    return 3 * fwd


def eager(args, model, opt, batches, updates):
    loss_fn = nn.CrossEntropyLoss()
    k = args.micro_size
    i = 0
    for _ in range(updates):
        for _ in range(k):
            x, y = batches[i % len(batches)]
            i += 1
            loss = loss_fn(model(x.cuda()), y.cuda()) / k
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        # The loss read back once per update, as cellgraph's device_bench does.
        loss.item()


def make_graphed(args, model, opt, batches):
    """Captures one whole window (K forward/backward + step + zero_grad) in a CUDA graph."""
    loss_fn = nn.CrossEntropyLoss()
    k = args.micro_size
    xs = torch.stack([batches[j][0] for j in range(k)]).cuda()
    ys = torch.stack([batches[j][1] for j in range(k)]).cuda()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):  # warm up on a side stream, as the CUDA graphs docs ask
            for j in range(k):
                (loss_fn(model(xs[j]), ys[j]) / k).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=False)
    with torch.cuda.graph(g):
        for j in range(k):
            last = loss_fn(model(xs[j]), ys[j]) / k
            last.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    i = [0]

    def window(updates):
        for _ in range(updates):
            for j in range(k):
                x, y = batches[i[0] % len(batches)]
                i[0] += 1
                xs[j].copy_(x, non_blocking=False)
                ys[j].copy_(y, non_blocking=False)
            g.replay()
            last.item()  # once per update, as in eager

    return window


def optimizer_launches(model, opt, batches, k):
    """CUDA kernels launched by one optimizer step + zero_grad (eager)."""
    from torch.profiler import ProfilerActivity, profile

    loss_fn = nn.CrossEntropyLoss()
    for j in range(k):
        x, y = batches[j]
        (loss_fn(model(x.cuda()), y.cuda()) / k).backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def timed(fn, updates):
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn(updates)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def peak(dtype, tf32):
    torch.backends.cuda.matmul.allow_tf32 = tf32
    n = 8192
    a, b = torch.randn(n, n, device="cuda", dtype=dtype), torch.randn(n, n, device="cuda", dtype=dtype)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    torch.backends.cuda.matmul.allow_tf32 = False
    return 10 * 2 * n**3 / (time.perf_counter() - t) / 1e12


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--net", default="lenet")
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--micro-size", type=int, default=4)
    p.add_argument("--updates", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--peak", action="store_true", help="print the GPU's measured fp32/tf32 matmul peak")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    b, k = args.micro_batch, args.micro_size
    name = torch.cuda.get_device_name(0)
    for mode in ["eager", "CUDA graphs"]:
        model, opt, batches = setup(args)
        torch.cuda.reset_peak_memory_stats()
        if mode == "eager":
            launches = optimizer_launches(model, opt, batches, k)
            fn = lambda n: eager(args, model, opt, batches, n)
        else:
            launches = "1 graph replay / window"
            fn = make_graphed(args, model, opt, batches)
        fn(args.warmup)
        secs = timed(fn, args.updates)
        images = args.updates * b * k
        fpi = flops_per_image(args)
        mem = torch.cuda.max_memory_allocated() / 2**20
        print(
            f"| PyTorch {torch.__version__} {mode} | {name} | {args.net} | {b} x {k} | {images / secs:.0f} | "
            f"{secs * 1e3 / args.updates:.3f} | {launches} | {fpi / 1e9:.5f} | {fpi * images / secs / 1e12:.3f} |"
            f" <!-- peak allocated {mem:.1f} MiB -->"
        )
    if args.peak:
        print(f"measured matmul peak on {name}: fp32 {peak(torch.float32, False):.1f} TFLOP/s, tf32 {peak(torch.float32, True):.1f} TFLOP/s")


if __name__ == "__main__":
    main()
