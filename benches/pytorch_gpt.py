"""PyTorch twin of sample_code/gpt_accumulation: the same character-level GPT (nanoGPT's,
without dropout: token and position embeddings, pre-LayerNorm blocks with causal multi-head
attention and an exact-GELU MLP, tied head, GPT-2 initialisation), the same data (the vendored
Shakespeare, the last tenth from a paragraph break held out, windows of context + 1 characters
every context characters), and the same recipe: each update is a batch sliced into micro-batches
whose summed token losses are divided by the window's token count (token-weighted accumulation),
AdamW(betas 0.9/0.99, eps 1e-8, weight decay on every parameter, as cellgraph's), linear warmup
then cosine decay to lr/10 counted in updates, gradients clipped to global norm 1.0.

Attention is nanoGPT's fast path, `F.scaled_dot_product_attention(q, k, v, is_causal=True)`
(fused, skipping the masked half), as cellgraph's `attention` op is; `--attention manual` runs
nanoGPT's slow path instead (scores, `masked_fill`, softmax, mixing: about 0.9x the tokens/s on
one CPU thread), which is what this script ran before 2026-11-27.

The shuffled order differs from cellgraph's (another RNG); compare validation losses over seeds.

    python benches/pytorch_gpt.py [--threads 1] [--epochs 2 --steps 60] [--seed 0] [--attention sdpa|manual]
                                  [--autocast off|bf16]

`--autocast bf16` runs each micro-step's forward under `torch.autocast("cpu", bfloat16)` (what
a bf16 user writes: matmuls and attention in bf16 through oneDNN, the loss computed from the
logits in f32 outside it), against `gpt_accumulation --precision bf16`.

Prints "epoch k: validation loss X" per epoch and
"pytorch: trained S steps, U optimizer updates, N tokens in T s (X tokens/s)" (the training
loop only, data already decoded, no warm-up step).
"""
import argparse
import gzip
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

class Block(nn.Module):
    def __init__(self, c, h, fused):
        super().__init__()
        self.fused = fused
        self.ln_1, self.ln_2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.c_attn, self.attn_proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.c_fc, self.mlp_proj = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.h = h

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.h, c // self.h).transpose(1, 2) for z in (q, k, v))
        if self.fused:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // self.h))
            att = att.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf")).softmax(-1)
            y = att @ v
        y = y.transpose(1, 2).reshape(b, t, c)
        x = x + self.attn_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, v, c, layers, heads, ctx, fused=True):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(v, c), nn.Embedding(ctx, c)
        self.h = nn.ModuleList(Block(c, heads, fused) for _ in range(layers))
        self.ln_f = nn.LayerNorm(c)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)
        for blk in self.h:
            for proj in (blk.attn_proj, blk.mlp_proj):
                nn.init.normal_(proj.weight, 0.0, 0.02 / math.sqrt(2 * layers))

    def forward(self, idx):
        x = self.wte(idx) + self.wpe.weight[: idx.shape[1]]
        for blk in self.h:
            x = blk(x)
        return self.ln_f(x) @ self.wte.weight.t()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data-path", default="data/shakespeare/shakespeare.txt.gz")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--micro-size", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-items", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attention", choices=["sdpa", "manual"], default="sdpa")
    p.add_argument("--autocast", choices=["off", "bf16"], default="off",
                   help="run the micro-steps' forward under torch.autocast(device, bfloat16) (CPU or CUDA), "
                        "as a bf16 user does; the loss, gradients and optimizer stay f32")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)

    with open(a.data_path, "rb") as f:
        raw = f.read()
    text = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
    vocab = sorted(set(text))
    ids_of = {b: i for i, b in enumerate(vocab)}
    data = torch.tensor([ids_of[b] for b in text], dtype=torch.long)
    at = int(len(text) * 0.9)
    nn_ = text.find(b"\n\n", at)
    cut = len(text) if nn_ < 0 else nn_ + 2
    T = a.context


    def windows(lo, hi):
        n = (hi - lo - T - 1) // T + 1 if hi - lo > T else 0
        return torch.stack([data[lo + i * T: lo + i * T + T + 1] for i in range(n)])


    train = windows(0, cut)
    val = windows(cut, len(text))[: a.eval_items]
    unigram = torch.bincount(data[:cut], minlength=len(vocab)).double() / cut
    baseline = float(-(unigram[unigram > 0] * unigram[unigram > 0].log()).sum())


    model = GPT(len(vocab), a.width, a.layers, a.heads, T, fused=a.attention == "sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.99), eps=1e-8, weight_decay=a.weight_decay)
    total = a.epochs * a.steps


    def lr_at(u):
        if u < a.warmup:
            return a.lr * (u + 1) / a.warmup
        t = min(u - a.warmup, max(total - a.warmup, 1)) / max(total - a.warmup, 1)
        return a.lr / 10 + 0.5 * (a.lr - a.lr / 10) * (1 + math.cos(math.pi * t))


    def evaluate():
        model.eval()
        with torch.no_grad():
            s, n = 0.0, 0
            for i in range(0, len(val), 64):
                w = val[i: i + 64]
                logits = model(w[:, :-1])
                s += float(F.cross_entropy(logits.reshape(-1, len(vocab)), w[:, 1:].reshape(-1), reduction="sum"))
                n += w[:, 1:].numel()
        model.train()
        return s / n


    g = torch.Generator().manual_seed(a.seed)
    steps, updates, tokens, secs = 0, 0, 0, 0.0
    mb = a.batch_size // a.micro_size
    for epoch in range(a.epochs):
        order = torch.randperm(len(train), generator=g)
        t0 = time.perf_counter()
        for s in range(a.steps):
            batch = train[order[s * a.batch_size:(s + 1) * a.batch_size]]
            window_tokens = batch[:, 1:].numel()  # labels: no padding in windows
            for k in range(a.micro_size):
                m = batch[k * mb:(k + 1) * mb]
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.autocast == "bf16"):
                    logits = model(m[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, len(vocab)), m[:, 1:].reshape(-1), reduction="sum", ignore_index=-100)
                (loss / window_tokens).backward()
            for grp in opt.param_groups:
                grp["lr"] = lr_at(updates)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            steps, updates, tokens = steps + 1, updates + 1, tokens + a.batch_size * T
        secs += time.perf_counter() - t0
        print(f"epoch {epoch + 1}: validation loss {evaluate():.4f} nats/char (unigram {baseline:.3f})", flush=True)
    print(f"pytorch: trained {steps} steps, {updates} optimizer updates, {tokens} tokens in {secs:.3f} s ({tokens / secs:.1f} tokens/s)")


if __name__ == "__main__":
    main()
