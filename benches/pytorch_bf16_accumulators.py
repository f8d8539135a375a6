"""Issue 16's mixed-precision claim, asked of PyTorch: is bf16 compute with f32 gradient
accumulators "at least 5x closer to the f32 run after 20 updates" than the same run with bf16
accumulators?

The work is the integration test `bf16_runs_after_20_updates_against_f32`
(tests/it/precision.rs): Dense(16 -> 24) -> ReLU -> Dense(24 -> 10), inputs uniform in
[-1, 1) labelled by a fixed linear teacher, K micro-batches of B items per update, each
micro-loss the batch mean divided by K, Momentum(0.05, 0.9), 20 updates. Three runs from the
same initial weights and data:

- f32: everything in f32;
- bf16 compute, f32 accumulators: `torch.autocast("cpu", torch.bfloat16)` (weights, inputs and
  activations of the matmuls in bf16, as PyTorch users run it), `.grad` summed in f32;
- bf16 compute, bf16 accumulators: the same, with `.grad` rounded to bf16 after every
  micro-step (a bf16 accumulator: round(acc + g)).

Distance: ||theta - theta_f32|| / ||theta_f32 - theta_init|| over all parameters.

    python benches/pytorch_bf16_accumulators.py [--k 16] [--b 4] [--seeds 5]

PyTorch is never a dependency of the project: run it from a throwaway virtual environment.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

FEATURES = 16


def teacher_data(gen, teacher, n):
    x = torch.rand(n, FEATURES, generator=gen) * 2 - 1
    y = (x @ teacher.T).argmax(dim=1)
    return x, y


def train(net, batches, k, mode):
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for u in range(len(batches) // k):
        opt.zero_grad(set_to_none=True)
        for x, y in batches[u * k:(u + 1) * k]:
            if mode == "f32":
                loss = F.cross_entropy(net(x), y) / k
            else:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = net(x)
                loss = F.cross_entropy(logits.float(), y) / k
            loss.backward()
            if mode == "bf16-acc":
                for p in net.parameters():
                    p.grad = p.grad.to(torch.bfloat16).to(torch.float32)
        opt.step()
    return torch.cat([p.detach().flatten() for p in net.parameters()])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--b", type=int, default=4)
    ap.add_argument("--updates", type=int, default=20)
    ap.add_argument("--seeds", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    ratios = []
    for seed in range(a.seeds):
        gen = torch.Generator().manual_seed(seed)
        teacher = torch.rand(10, FEATURES, generator=gen) * 2 - 1
        batches = [teacher_data(gen, teacher, a.b) for _ in range(a.updates * a.k)]
        torch.manual_seed(1000 + seed)
        init = nn.Sequential(nn.Linear(FEATURES, 24), nn.ReLU(), nn.Linear(24, 10))
        theta0 = torch.cat([p.detach().flatten() for p in init.parameters()])
        runs = {}
        for mode in ("f32", "f32-acc", "bf16-acc"):
            net = nn.Sequential(nn.Linear(FEATURES, 24), nn.ReLU(), nn.Linear(24, 10))
            net.load_state_dict(init.state_dict())
            runs[mode] = train(net, batches, a.k, mode)
        moved = (runs["f32"] - theta0).norm().item()
        good = (runs["f32-acc"] - runs["f32"]).norm().item() / moved
        bad = (runs["bf16-acc"] - runs["f32"]).norm().item() / moved
        ratios.append(bad / good)
        print(f"seed {seed}: K = {a.k}, {a.b} items per micro-batch, {a.updates} updates: "
              f"f32 accumulators {good:.3e}, bf16 accumulators {bad:.3e} from the f32 run; ratio {bad / good:.2f}")
    ratios.sort()
    print(f"median ratio {ratios[len(ratios) // 2]:.2f} (range {ratios[0]:.2f}-{ratios[-1]:.2f}); torch {torch.__version__}")


if __name__ == "__main__":
    main()
