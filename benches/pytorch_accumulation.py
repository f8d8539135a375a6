"""PyTorch reference for `device_bench`: the same networks (LeNet5, the seed-002 MLP,
ResNet-18, the small GPT), accumulation and optimizers on the same GPU, eager and with CUDA
graphs (one captured graph per accumulation window).

Prints markdown table rows in device_bench's columns, plus the GPU's measured matmul peak.
Both read the loss back once per update (the last micro-batch's), no more.
Run by scripts/gpu_check.sh; needs torch with CUDA (or `--device cpu`: eager only, against
`device_bench --device cpu`).

`--autocast bf16` runs each micro-step's forward under `torch.autocast(device, bfloat16)` (what
a bf16 user writes; with TF32 allowed for what stays f32 on CUDA), against
`device_bench --precision bf16`.

    python3 benches/pytorch_accumulation.py --net lenet --micro-batch 32 --micro-size 4
    python3 benches/pytorch_accumulation.py --device cpu --net gpt --micro-batch 8 --autocast bf16
"""

import argparse
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_gpt import GPT  # noqa: E402  (the twin of sample_code/gpt_accumulation)
from pytorch_resnet18_cpu import ResNet18  # noqa: E402  (torchvision's resnet18, written out)

# device_bench's GPT: 65 characters, context 128 (GptConfig::small).
GPT_VOCAB, GPT_CONTEXT = 65, 128


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


class Net:
    """A network with its optimizer, host batches and per-micro-batch loss (already divided as
    the window needs: by K for the mean, by the window's tokens for the GPT)."""

    def __init__(self, args, graphs):
        torch.manual_seed(1)
        self.device, self.autocast = args.device, args.autocast == "bf16"
        b, k = args.micro_batch, args.micro_size
        # Under CUDA graphs the optimizer keeps its step count on the GPU.
        cap = {"capturable": True} if graphs else {}
        images = lambda c, hw: [(torch.rand(b, c, hw, hw) * 2 - 1, torch.randint(0, 10, (b,))) for _ in range(8)]
        self.clip = False
        self.loss = lambda out, y: F.cross_entropy(out, y) / k
        if args.net == "lenet":
            self.model, self.batches = LeNet5().to(args.device), images(1, 32)
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        elif args.net == "mlp":
            self.model, self.batches = mlp().to(args.device), images(1, 28)
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        elif args.net == "resnet18":
            self.model, self.batches = ResNet18(10).to(args.device), images(3, 32)
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
        elif args.net == "gpt":
            t = GPT_CONTEXT
            self.model = GPT(GPT_VOCAB, 128, 4, 4, t).to(args.device)
            ids = [torch.randint(0, GPT_VOCAB, (b, t + 1)) for _ in range(8)]
            self.batches = [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in ids]
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, **cap)
            self.loss = lambda out, y: F.cross_entropy(out.reshape(-1, GPT_VOCAB), y.reshape(-1), reduction="sum") / (k * b * t)
            self.clip = True
        else:
            raise SystemExit(f"--net must be lenet, mlp, resnet18 or gpt, got {args.net}")

    def micro(self, x, y):
        with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.autocast):
            out = self.model(x)
        loss = self.loss(out.float(), y)
        loss.backward()
        return loss

    def update(self):
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()


def flops_per_item(args, net):
    """Forward + backward FLOPs of the matrix products and convolutions of one micro-step
    (torch's FlopCounterMode: 2 per multiply-add), per item."""
    from torch.utils.flop_counter import FlopCounterMode

    x, y = net.batches[0]
    with FlopCounterMode(display=False) as fc:
        net.micro(x.to(args.device), y.to(args.device))
    net.model.zero_grad(set_to_none=True)
    return fc.get_total_flops() / args.micro_batch


def eager(args, net, updates):
    k = args.micro_size
    i = 0
    for _ in range(updates):
        for _ in range(k):
            x, y = net.batches[i % len(net.batches)]
            i += 1
            loss = net.micro(x.to(args.device), y.to(args.device))
        net.update()
        net.opt.zero_grad(set_to_none=True)
        # The loss read back once per update, as cellgraph's device_bench does.
        loss.item()


def make_graphed(args, net):
    """Captures one whole window (K forward/backward + step + zero_grad) in a CUDA graph."""
    k, batches, opt = args.micro_size, net.batches, net.opt
    xs = torch.stack([batches[j][0] for j in range(k)]).cuda()
    ys = torch.stack([batches[j][1] for j in range(k)]).cuda()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):  # warm up on a side stream, as the CUDA graphs docs ask
            for j in range(k):
                net.micro(xs[j], ys[j])
            net.update()
            opt.zero_grad(set_to_none=False)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=False)
    with torch.cuda.graph(g):
        for j in range(k):
            last = net.micro(xs[j], ys[j])
        net.update()
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


def optimizer_launches(net, k):
    """CUDA kernels launched by one optimizer step (with clipping where the recipe clips) +
    zero_grad (eager)."""
    from torch.profiler import ProfilerActivity, profile

    for j in range(k):
        x, y = net.batches[j]
        net.micro(x.cuda(), y.cuda())
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        net.update()
        net.opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def timed(fn, updates, device):
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    fn(updates)
    sync()
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
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--autocast", choices=["off", "bf16"], default="off")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (torch.set_num_threads; 0: torch's default)")
    args = p.parse_args()
    cuda = args.device == "cuda"
    if args.threads:
        torch.set_num_threads(args.threads)
    # Exact f32 unless autocast (whose users leave TF32 on for what stays f32).
    torch.backends.cuda.matmul.allow_tf32 = args.autocast == "bf16"
    torch.backends.cudnn.allow_tf32 = args.autocast == "bf16"
    b, k = args.micro_batch, args.micro_size
    name = torch.cuda.get_device_name(0) if cuda else f"cpu ({torch.get_num_threads()} threads)"
    if args.autocast == "bf16":
        name += " autocast bf16"
    for mode in ["eager", "CUDA graphs"] if cuda else ["eager"]:
        net = Net(args, mode != "eager")
        fpi = flops_per_item(args, net)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        if mode == "eager" and not cuda:
            launches = "-"
            fn = lambda n: eager(args, net, n)
        elif mode == "eager":
            launches = optimizer_launches(net, k)
            fn = lambda n: eager(args, net, n)
        else:
            launches = "1 graph replay / window"
            fn = make_graphed(args, net)
        fn(args.warmup)
        secs = timed(fn, args.updates, args.device)
        items = args.updates * b * k
        mem = torch.cuda.max_memory_allocated() / 2**20 if cuda else 0.0
        tokens = f" <!-- {items * GPT_CONTEXT / secs:.0f} tokens/s -->" if args.net == "gpt" else ""
        print(
            f"| PyTorch {torch.__version__} {mode} | {name} | {args.net} | {b} x {k} | {items / secs:.0f} | "
            f"{secs * 1e3 / args.updates:.3f} | {launches} | {fpi / 1e9:.5f} | {fpi * items / secs / 1e12:.3f} |"
            f"{f' <!-- peak allocated {mem:.1f} MiB -->' if cuda else ''}{tokens}",
            flush=True,
        )
    if args.peak:
        print(f"measured matmul peak on {name}: fp32 {peak(torch.float32, False):.1f} TFLOP/s, tf32 {peak(torch.float32, True):.1f} TFLOP/s")


if __name__ == "__main__":
    main()
