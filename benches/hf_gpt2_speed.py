"""Fine-tuning speed of a GPT-2-small-shaped model (12 layers, 12 heads, width 768, vocabulary
50,257: 124M parameters, random weights), side by side: `cellgraph finetune` against the loop a
Hugging Face user writes with Accelerate (`accelerator.accumulate(model)`, AdamW, clipping,
token-weighted loss), alternating (cellgraph, PyTorch, ...), pinned with taskset. Issue 45's
speed bar: `--updates` updates of 4 micro-batches of 2 sequences of 256 tokens (8 x 256 tokens
per update), on 1 and 2 threads. `--precision bf16` runs cellgraph's bf16 products against
PyTorch's CPU autocast (`torch.autocast("cpu", dtype=torch.bfloat16)` around the forward and
the loss).

The model directory is made here (not vendored): transformers' GPT2LMHeadModel with the
tiny GPT-2's tokenizer (1,000 tokens, within the 50,257 ids), written to --dir once.

    python -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install torch transformers tokenizers accelerate
    cargo build --release --bin cellgraph
    /tmp/hfvenv/bin/python benches/hf_gpt2_speed.py [--threads 1] [--pairs 2] [--updates 3]

`--bound` times no cellgraph run: it profiles one PyTorch update (after a first one, warm) with
`torch.profiler` and prints how much of it the matrix products (`aten::mm`, `addmm`, `bmm`)
take and at what rate, and the ratio an implementation would reach whose products ran at that
rate and whose every other op took no time (the update's time over its products' time): the
ceiling of any speed-up at MKL's (or oneDNN's) product rate.

Each side times its training loop only: cellgraph's "trained U updates in T s (N tokens/s)"
(Model::train, including the first step's graph compilation), PyTorch's loop over batches made
before the clock. Prints each pair's tokens/s and the ratio, then the median ratio and range.
"""
import argparse
import gzip
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

root = Path(__file__).resolve().parent.parent
ap = argparse.ArgumentParser()
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--pairs", type=int, default=2)
ap.add_argument("--updates", type=int, default=3)
ap.add_argument("--block", type=int, default=256)
ap.add_argument("--batch", type=int, default=8)
ap.add_argument("--k", type=int, default=4)
ap.add_argument("--dir", default="/tmp/cellgraph-gpt2-small")
ap.add_argument("--precision", choices=["f32", "bf16"], default="f32",
                help="bf16: cellgraph --precision bf16 against torch.autocast('cpu', torch.bfloat16)")
ap.add_argument("--cellgraph", default=str(root / "target/release/cellgraph"))
ap.add_argument("--bound", action="store_true", help="profile one PyTorch update: its products' share and the ceiling it sets")
ap.add_argument("--pytorch-only", action="store_true", help=argparse.SUPPRESS)
a = ap.parse_args()
if a.bound and a.updates < 2:
    ap.error("--bound needs --updates 2 or more (one warm update, one profiled)")
cpus = "0" if a.threads == 1 else f"0-{a.threads - 1}"
text_path = Path(a.dir + "-text.txt")


def make_model():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    if (Path(a.dir) / "model.safetensors").is_file():
        return
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=12, n_head=12, n_embd=768, n_positions=1024, vocab_size=50257, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(cfg).save_pretrained(a.dir)
    for f in ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]:
        shutil.copy(root / "tests/assets/tiny-gpt2" / f, Path(a.dir) / f)


def pytorch_side():
    """The Accelerate loop; prints 'pytorch: N tokens/s'."""
    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator
    from tokenizers import Tokenizer
    from transformers import GPT2LMHeadModel

    torch.set_num_threads(a.threads)
    text = text_path.read_text()
    ids = Tokenizer.from_file(str(Path(a.dir) / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    blocks = [ids[i : i + a.block + 1] for i in range(0, len(ids) - a.block - 1, a.block)]
    per = a.batch // a.k
    micro = [torch.tensor(blocks[i : i + per]) for i in range(0, a.updates * a.batch, per)]
    acc = Accelerator(gradient_accumulation_steps=a.k, cpu=True)
    model = GPT2LMHeadModel.from_pretrained(a.dir, embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-5, weight_decay=0.0)
    model, opt = acc.prepare(model, opt)
    model.train()
    cast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.precision == "bf16")

    def update(u):
        window = micro[u * a.k : (u + 1) * a.k]
        tokens = sum(int(b[:, 1:].numel()) for b in window)
        for b in window:
            with acc.accumulate(model):
                with cast:
                    logits = model(b[:, :-1]).logits
                    loss = F.cross_entropy(logits.flatten(0, 1), b[:, 1:].flatten(), reduction="sum") / tokens * a.k
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()

    if a.bound:
        from torch.profiler import ProfilerActivity, profile

        update(0)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            update(1)
        ops = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
        total = sum(ops.values()) / 1e6
        mm = sum(ops.get(k, 0) for k in ["aten::mm", "aten::addmm", "aten::bmm"]) / 1e6
        cfg = model.config
        # Multiply-adds per token: the blocks' four projections and the tied head, forward and
        # backward (3 products each); attention's own products are in `bmm`/sdpa, left out.
        params = cfg.n_layer * 12 * cfg.n_embd**2 + cfg.n_embd * cfg.vocab_size
        flops = 6 * params * a.batch * a.block
        print(f"pytorch update: {total:.2f} s (profiled), products {mm:.2f} s ({100 * mm / total:.0f}%, "
              f"{flops / mm / 1e9:.0f} GFLOP/s for {flops / 1e12:.2f} TFLOP)")
        print(f"ceiling at this product rate, every other op free: {total / mm:.2f}x")
        return
    t0 = time.perf_counter()
    for u in range(a.updates):
        update(u)
    secs = time.perf_counter() - t0
    print(f"pytorch: {a.updates * a.batch * a.block / secs:.1f} tokens/s")


if a.pytorch_only:
    pytorch_side()
    sys.exit(0)

make_model()
text = gzip.open(root / "data/shakespeare/shakespeare.txt.gz", "rb").read()[:400_000].decode()
text_path.write_text(text)
env = dict(os.environ, RAYON_NUM_THREADS=str(a.threads), MATMUL_NUM_THREADS=str(a.threads), OMP_NUM_THREADS=str(a.threads))
pt = ["taskset", "-c", cpus, sys.executable, __file__, "--pytorch-only", "--threads", str(a.threads), "--updates", str(a.updates),
      "--block", str(a.block), "--batch", str(a.batch), "--k", str(a.k), "--dir", a.dir, "--precision", a.precision]
if a.bound:
    sys.exit(subprocess.run(pt + ["--bound"], env=env).returncode)
out = tempfile.mkdtemp(prefix="cellgraph-gpt2-out-")
cg = ["taskset", "-c", cpus, a.cellgraph, "finetune", "--model", a.dir, "--data", str(text_path), "--out", out, "--steps", str(a.updates),
      "--block-size", str(a.block), "--batch-size", str(a.batch), "--micro-size", str(a.k), "--dropout", "0", "--val-fraction", "0",
      "--no-shuffle", "--sample-tokens", "0", "--print-every", "0", "--device", "cpu", "--precision", a.precision]
print("cellgraph:", " ".join(cg))
print("pytorch:  ", " ".join(pt))
ratios = []
for p in range(a.pairs):
    c = subprocess.run(cg, env=env, capture_output=True, text=True)
    if c.returncode:
        sys.exit(f"cellgraph failed:\n{c.stdout}\n{c.stderr}")
    cgt = float(re.search(r"\(([0-9.]+) tokens/s\)", c.stdout).group(1))
    t = subprocess.run(pt, env=env, capture_output=True, text=True)
    if t.returncode:
        sys.exit(f"pytorch failed:\n{t.stdout}\n{t.stderr}")
    ptt = float(re.search(r"pytorch: ([0-9.]+) tokens/s", t.stdout).group(1))
    ratios.append(cgt / ptt)
    print(f"pair {p + 1}: cellgraph {cgt:.1f} tokens/s, pytorch+accelerate {ptt:.1f} tokens/s, ratio {cgt / ptt:.3f}")
print(f"{a.threads} thread(s), {a.precision}: median ratio {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f}) over {a.pairs} pairs")
