"""PyTorch side of `benches/compare_cpu.sh`, cases lenet8 and mlp8: the work of

    mpirun -n 8 target/release/distributed_gradient_accumulation [--net lenet --batch-size 128] --epochs 1

as torchrun + gloo DDP on the CPU, one intra-op thread per rank:

    python -m torch.distributed.run --standalone --nproc_per_node 8 benches/pytorch_ddp.py --net mlp

As the seed-002 sample does (`GradAccumulation(WithLossCell(net, loss), 4)` under
`AutoParallel(net).hsdp()`): each rank takes its shard of the training items (item r, r + 8,
r + 16, ... of the epoch's order, ceil(N / 8) items each, as cellgraph's `shard(size, rank)` and
DistributedSampler do), batches them (`--batch-size` per rank), slices each batch into
`--micro-size` micro-batches, and sums their gradients (each micro-batch's loss is the mean over
its items, not divided by the micro-size: MindSpore's GradAccumulation); DDP's `no_sync()` keeps
the non-final micro-batches local, and the final one all-reduces. Across ranks the gradients
are summed, not averaged (cellgraph's default without `--gradients-mean`; DDP's default
averaging is replaced by a summing comm hook), then every rank steps the optimizer.

  - `--net mlp`: the seed's Network (784-512-512-10, ReLU), CrossEntropyLoss, SGD(0.01); the
    28x28 images x/255, (x - 0.1307)/0.3081; in file order (the sample does not shuffle), the
    last short batch kept (1000 items per rank: 31 batches of 32 and one of 8, sliced into
    micro-batches of 2).
  - `--net lenet`: MindSpore's LeNet5, softmax cross-entropy (mean), Momentum(0.01, 0.9);
    create_dataset's pipeline (32x32) with a seeded shuffle each epoch (the same on every rank)
    and drop_remainder (with 128 per rank: 7 batches of 128 per rank per epoch).

Data are decoded and normalised before the clock. Timed on rank 0 between two barriers: the
epoch loop (shuffle, shard, gathering each batch, micro-batch forward/backward, the all-reduce,
the loss read back every micro-batch, optimizer step and zero_grad). No warm-up step.

Rank 0 prints the line compare_cpu.sh reads:
    pytorch ddp: ranks 8, updates 7, 7168 images, training: 2.345 s, 3056.7 images/s across ranks
"""

import argparse
import contextlib
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pytorch_lenet_accuracy import LeNet5, lenet_pipeline, read_idx  # noqa: E402


def mlp():
    """The seed-002 Network: Flatten, Dense 784-512, ReLU, Dense 512-512, ReLU, Dense 512-10."""
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def mlp_pipeline(images):
    """Rescale(1/255) then Normalize(0.1307, 0.3081), 28x28, one channel."""
    x = images.astype(np.float32) * np.float32(1.0 / 255.0)
    return torch.from_numpy(((x - np.float32(0.1307)) / np.float32(0.3081)).astype(np.float32)).unsqueeze(1)


def allreduce_sum_hook(_state, bucket):
    """DDP's default all-reduce without the division by the world size."""
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--net", choices=["mlp", "lenet"], default="mlp")
    p.add_argument("--data-path", default=str(Path(__file__).resolve().parent.parent / "data" / "mnist"))
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32, help="per rank, sliced into --micro-size micro-batches")
    p.add_argument("--micro-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--gradients-mean", action="store_true", help="average across ranks (DDP's default) instead of summing")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads per rank")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    d = Path(args.data_path)
    images = read_idx(d / "train-images-idx3-ubyte.gz")
    y_all = torch.from_numpy(read_idx(d / "train-labels-idx1-ubyte.gz").astype(np.int64))
    torch.manual_seed(args.seed)
    if args.net == "mlp":
        x_all, net, shuffle, drop = mlp_pipeline(images), mlp(), False, False
        opt_fn = lambda params: torch.optim.SGD(params, lr=args.lr)  # noqa: E731
    else:
        x_all, net, shuffle, drop = lenet_pipeline(images), LeNet5(), True, True
        opt_fn = lambda params: torch.optim.SGD(params, lr=args.lr, momentum=0.9)  # noqa: E731
    x_all = x_all.contiguous()
    model = DDP(net)  # broadcasts rank 0's parameters
    if not args.gradients_mean:
        model.register_comm_hook(None, allreduce_sum_hook)
    opt = opt_fn(model.parameters())
    n, b, k = len(x_all), args.batch_size, args.micro_size
    per_rank = math.ceil(n / world)  # cellgraph's shard: ceil(N / shards) items, wrapping to pad
    gen = torch.Generator().manual_seed(args.seed)  # the same order on every rank
    updates = trained = 0
    loss_sum, micro_steps = 0.0, 0

    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.epochs):
        order = torch.randperm(n, generator=gen) if shuffle else torch.arange(n)
        mine = order[(rank + torch.arange(per_rank) * world) % n]
        nb = per_rank // b if drop else math.ceil(per_rank / b)
        for s in range(nb):
            idx = mine[s * b : (s + 1) * b]
            micro = list(zip(torch.tensor_split(x_all[idx], k), torch.tensor_split(y_all[idx], k)))
            for j, (xm, ym) in enumerate(micro):
                ctx = model.no_sync() if j < len(micro) - 1 else contextlib.nullcontext()
                with ctx:
                    loss = F.cross_entropy(model(xm), ym)
                    loss.backward()
                loss_sum += loss.item()
                micro_steps += 1
            opt.step()
            opt.zero_grad()
            updates += 1
            trained += len(idx)
    dist.barrier()
    secs = time.perf_counter() - t0

    total = torch.tensor([trained], dtype=torch.int64)
    dist.all_reduce(total)
    if rank == 0:
        images = int(total.item())
        print(f"pytorch {torch.__version__} ddp ({args.net}): {torch.get_num_threads()} thread(s) per rank, mean micro-batch loss on rank 0 {loss_sum / micro_steps:.4f}")
        print(f"pytorch ddp: ranks {world}, updates {updates}, {images} images, training: {secs:.3f} s, {images / secs:.1f} images/s across ranks")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
