"""cellgraph's `finetune` against PyTorch + transformers on the same batches: the tiny GPT-2
(`tests/assets/tiny-gpt2`; `--model tests/assets/tiny-llama` for the tiny Llama) fine-tuned for 20 updates of K = 4 micro-batches, line by line so that
the padded micro-batches carry different numbers of tokens, AdamW, clipping at norm 1.0, cosine
decay, dropout off, the items in the text's order. PyTorch runs the loop a Trainer user writes
with token-weighted accumulation (each micro-batch's summed token loss divided by the window's
token count) and again with plain `loss / K` (the mean of the micro-batches' mean losses, what
the Trainer did before `num_items_in_batch`). Each run's parameters are scored by one measure, the token-weighted loss over the run's
batches (in float64). Prints how far each PyTorch run ends from cellgraph's, and how far
PyTorch ends from itself with the micro-batches summed in reverse order (the same sum in
another f32 order: the noise floor), and exits 1 unless
the token-weighted run ends within 1e-5 relative. Parameters are not compared element by
element: Adam's first steps are about `lr * sign(g)`, so an element whose gradient is at
rounding level moves by a full step either way, whatever the framework.

    python -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install torch transformers tokenizers
    cargo build --release --bin cellgraph
    /tmp/hfvenv/bin/python benches/hf_finetune_compare.py [--updates 20] [--chars 60000]
"""
import argparse
import gzip
import math
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM

root = Path(__file__).resolve().parent.parent
ap = argparse.ArgumentParser()
ap.add_argument("--model", default=str(root / "tests/assets/tiny-gpt2"))
ap.add_argument("--cellgraph", default=str(root / "target/release/cellgraph"))
ap.add_argument("--chars", type=int, default=60000, help="characters of the vendored Shakespeare")
ap.add_argument("--updates", type=int, default=20)
ap.add_argument("--k", type=int, default=4)
ap.add_argument("--batch", type=int, default=8)
ap.add_argument("--block", type=int, default=64)
ap.add_argument("--lr", type=float, default=1e-3)
ap.add_argument("--wd", type=float, default=0.01)
ap.add_argument("--clip", type=float, default=1.0, help="global-norm clipping (0: none)")
a = ap.parse_args()
torch.set_num_threads(1)
# Dropout off, under each architecture's keys.
NO_DROPOUT = {"gpt2": dict(embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0), "llama": dict(attention_dropout=0.0)}[
    AutoConfig.from_pretrained(a.model).model_type
]


def model(path, **kw):
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", **kw)


work = Path(tempfile.mkdtemp(prefix="cellgraph-ft-"))
text = gzip.open(root / "data/shakespeare/shakespeare.txt.gz", "rb").read()[: a.chars].decode()
(work / "text.txt").write_text(text)
cmd = [a.cellgraph, "finetune", "--model", a.model, "--data", str(work / "text.txt"), "--out", str(work / "tuned"),
       "--split", "lines", "--no-shuffle", "--dropout", "0", "--val-fraction", "0", "--steps", str(a.updates),
       "--batch-size", str(a.batch), "--micro-size", str(a.k), "--block-size", str(a.block), "--lr", str(a.lr),
       "--weight-decay", str(a.wd), "--max-grad-norm", str(a.clip), "--sample-tokens", "0", "--print-every", "0", "--device", "cpu"]
print(" ".join(cmd))
subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
ours = model(work / "tuned").state_dict()

# The same items: each line (with its newline) tokenized alone, at least 2 tokens, cut to block + 1.
tok = Tokenizer.from_file(str(Path(a.model) / "tokenizer.json"))
lines = re.findall(r"[^\n]*\n|[^\n]+$", text)
items = [ids[: a.block + 1] for ids in (tok.encode(l, add_special_tokens=False).ids for l in lines) if len(ids) >= 2]
batches = [items[i : i + a.batch] for i in range(0, len(items) - a.batch + 1, a.batch)][: a.updates]
assert len(batches) == a.updates, f"the text gives {len(batches)} batches"


def tensors(batch):
    t = max(len(x) for x in batch) - 1
    ids = torch.zeros(len(batch), t, dtype=torch.long)
    labels = torch.full((len(batch), t), -100, dtype=torch.long)
    for r, x in enumerate(batch):
        ids[r, : len(x) - 1] = torch.tensor(x[:-1])
        labels[r, : len(x) - 1] = torch.tensor(x[1:])
    return ids, labels


def lr_at(u):  # cellgraph's Cosine{base: lr, min: 0, total: updates}, no warmup
    return 0.5 * a.lr * (1 + math.cos(math.pi * min(u, a.updates) / a.updates))


def train(token_weighted, reverse=False):
    m = model(a.model, **NO_DROPOUT)
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=a.wd)
    per = a.batch // a.k
    for u, batch in enumerate(batches):
        ids, labels = tensors(batch)
        n_tokens = (labels != -100).sum()
        for k in reversed(range(a.k)) if reverse else range(a.k):
            x, y = ids[k * per : (k + 1) * per], labels[k * per : (k + 1) * per]
            logits = m(x).logits
            if token_weighted:
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum") / n_tokens
            else:
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100) / a.k
            loss.backward()
        if a.clip > 0:
            torch.nn.utils.clip_grad_norm_(m.parameters(), a.clip)
        for g in opt.param_groups:
            g["lr"] = lr_at(u)
        opt.step()
        opt.zero_grad()
    return m.state_dict()


def loss_of(state):
    """The token-weighted mean loss of a model's parameters over the run's batches (float64)."""
    m = model(a.model, **NO_DROPOUT).double().eval()
    m.load_state_dict({k: v.double() for k, v in state.items()}, strict=False)
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            ids, labels = tensors(batch)
            logits = m(ids).logits
            total += F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum").item()
            count += int((labels != -100).sum())
    return total / count


tokens = [int((tensors(b)[1][i * (a.batch // a.k) : (i + 1) * (a.batch // a.k)] != -100).sum()) for b in batches[:1] for i in range(a.k)]
print(f"{len(batches)} updates of {a.k} micro-batches; the first window's micro-batches carry {tokens} tokens")
base = model(a.model).state_dict()
l0, lc = loss_of(base), loss_of(ours)
lt, lr_, lm = loss_of(train(True)), loss_of(train(True, reverse=True)), loss_of(train(False))
print(f"loss over the run's batches (float64): before {l0:.9f}; after cellgraph {lc:.9f}")
print(f"  PyTorch token-weighted {lt:.9f}: cellgraph within {abs(lc - lt) / abs(l0 - lt):.2e} of the change ({abs(lc - lt):.2e})")
print(f"  PyTorch token-weighted, micro-batches in reverse order {lr_:.9f}: {abs(lr_ - lt) / abs(l0 - lt):.2e} of the change (f32's noise floor, {abs(lr_ - lt):.2e})")
print(f"  PyTorch plain loss / K {lm:.9f}: {abs(lm - lt) / abs(l0 - lt):.2e} of the change from token-weighted ({abs(lm - lt):.2e})")
sys.exit(0 if abs(lc - lt) <= 1e-5 * abs(lt) else 1)
