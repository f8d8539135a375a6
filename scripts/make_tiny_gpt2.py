#!/usr/bin/env python3
"""Make tests/assets/tiny-gpt2/: a tiny Hugging Face GPT-2 checkpoint with its tokenizer and a
golden reference, for the GPT-2 fine-tuning tests.

What it writes (into --out, default tests/assets/tiny-gpt2/):
  tokenizer.json, tokenizer_config.json, special_tokens_map.json
      a byte-level BPE tokenizer (GPT-2's kind: ByteLevel pre-tokenizer and decoder,
      add_prefix_space=False), vocabulary 1000 = <|endoftext|> (id 0) + 256 bytes + 743 merges,
      trained on the corpus; `AutoTokenizer.from_pretrained(dir)` loads it.
  config.json, generation_config.json, model.safetensors
      GPT2LMHeadModel(n_layer=2, n_head=4, n_embd=64, n_positions=128, vocab_size=1000), seeded
      (torch.manual_seed(0)) and trained for --steps AdamW steps on random 128-token windows of
      the corpus, so no parameter is at its initial value (LayerNorm weights are not all 1, nor
      their biases 0). lm_head is tied to transformer.wte and stored once, as transformer.wte.weight.
  reference.json
      computed by transformers in float32, eval mode, from the saved files: the first 300
      characters of the corpus and their ids (full list); for its first 64 ids as one sequence,
      the mean cross-entropy of model(ids, labels=ids) (over the 63 next-token predictions) and
      the logits (full vocabulary rows, 7 significant digits) at positions 0, 31 and 63; and the
      ids of two short strings with whitespace and non-ASCII edge cases.
  README.md
      what the directory is, the command and package versions that made it, its licence.

Run it (from the repository root; about 20 s on 2 CPU cores) in a virtual environment with torch
(the CPU build is enough), transformers, tokenizers and safetensors:

    python3 -m venv /tmp/hfvenv
    /tmp/hfvenv/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
    /tmp/hfvenv/bin/pip install transformers tokenizers safetensors
    /tmp/hfvenv/bin/python scripts/make_tiny_gpt2.py \
        [--corpus data/shakespeare/shakespeare.txt.gz] [--out tests/assets/tiny-gpt2] [--steps 60]

It is deterministic: the tokenizer training is deterministic, torch runs on the CPU with one
thread and deterministic algorithms, and every random draw comes from a fixed seed. (Another
torch build or CPU may still round differently, so regenerate reference.json along with the
weights, never one without the other.)
"""

import argparse
import gzip
import hashlib
import inspect
import json
import os
import platform
import sys

import safetensors
import tokenizers
import torch
import transformers
from safetensors import safe_open
from tokenizers import ByteLevelBPETokenizer
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

EOT = "<|endoftext|>"
VOCAB_SIZE = 1000
N_POSITIONS = 128
REF_CHARS = 300
REF_SEQ = 64
REF_POSITIONS = [0, 31, 63]
EXTRA_STRINGS = ["  Hello,\n\nworld!  ", "ÆØÅ café — naïve"]


def sig7(x):
    return float(f"{x:.7g}")


def train_tokenizer(text):
    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    # ByteLevelBPETokenizer's trainer starts from the 256-byte alphabet, so any UTF-8 text encodes.
    tok.train_from_iterator(
        [text], vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=[EOT], show_progress=False
    )
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    assert tok.token_to_id(EOT) == 0
    return tok


def train_model(model, ids, steps, batch, lr):
    gen = torch.Generator().manual_seed(1)
    data = torch.tensor(ids, dtype=torch.long)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    model.train()
    losses = []
    for step in range(steps):
        starts = torch.randint(0, len(data) - N_POSITIONS, (batch,), generator=gen)
        x = torch.stack([data[s : s + N_POSITIONS] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == steps - 1:
            print(f"  step {step:3d}  loss {loss.item():.4f}", flush=True)
    model.eval()
    return losses


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", default=os.path.join(root, "data/shakespeare/shakespeare.txt.gz"))
    ap.add_argument("--out", default=os.path.join(root, "tests/assets/tiny-gpt2"))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    os.makedirs(args.out, exist_ok=True)

    with gzip.open(args.corpus, "rb") as f:
        raw = f.read()
    text = raw.decode("utf-8")
    corpus_sha = hashlib.sha256(raw).hexdigest()
    print(f"corpus: {len(raw)} bytes, sha256 {corpus_sha}")

    # Tokenizer.
    bpe = train_tokenizer(text)
    hf_tok = GPT2TokenizerFast(
        tokenizer_object=bpe._tokenizer,
        bos_token=EOT,
        eos_token=EOT,
        unk_token=EOT,
        add_prefix_space=False,
        model_max_length=N_POSITIONS,
    )
    hf_tok.save_pretrained(args.out)
    # transformers 5 no longer writes special_tokens_map.json; older versions read it.
    with open(os.path.join(args.out, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": EOT, "eos_token": EOT, "unk_token": EOT}, f, indent=2)
        f.write("\n")

    # Model.
    ids = bpe.encode(text).ids
    print(f"corpus: {len(ids)} tokens")
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_positions=N_POSITIONS,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    losses = train_model(model, ids, args.steps, args.batch, args.lr) if args.steps > 0 else []
    if args.steps == 0:
        # Untrained: move the LayerNorm parameters off their trivial 1 and 0.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".ln_" in name:
                    p.add_(0.05 * torch.randn_like(p))
    save_kwargs = {}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        save_kwargs["safe_serialization"] = True  # transformers 4; 5 always writes safetensors
    model.save_pretrained(args.out, **save_kwargs)
    os.chmod(os.path.join(args.out, "model.safetensors"), 0o644)  # written 0600 by transformers 5

    # The saved tensors: the tied lm_head once (as transformer.wte.weight), no attn.bias buffers.
    st_path = os.path.join(args.out, "model.safetensors")
    with safe_open(st_path, framework="pt") as f:
        names = sorted(f.keys())
        shapes = {n: list(f.get_slice(n).get_shape()) for n in names}
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names, names
    assert not any(n.endswith(".attn.bias") or n.endswith(".attn.masked_bias") for n in names), names
    for n in names:
        print(f"  {n:40s} {shapes[n]}")
    for n in names:
        if ".ln_" in n:
            with safe_open(st_path, framework="pt") as f:
                t = f.get_tensor(n)
            trivial = 1.0 if n.endswith("weight") else 0.0
            assert not torch.all(t == trivial), f"{n} is still at its initial value"

    # Reference, from the saved files.
    tok = AutoTokenizer.from_pretrained(args.out)
    model = GPT2LMHeadModel.from_pretrained(
        args.out, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ref_text = text[:REF_CHARS]
    ref_ids = tok(ref_text, verbose=False)["input_ids"]
    assert ref_ids == bpe.encode(ref_text).ids
    assert tok.decode(ref_ids) == ref_text
    assert len(ref_ids) >= REF_SEQ
    seq = torch.tensor([ref_ids[:REF_SEQ]])
    with torch.no_grad():
        out = model(input_ids=seq, labels=seq)
        # The loss by hand: next-token cross-entropy, mean over the REF_SEQ-1 predictions.
        manual = torch.nn.functional.cross_entropy(out.logits[0, :-1], seq[0, 1:])
    assert torch.allclose(out.loss, manual, rtol=1e-6, atol=1e-6), (out.loss, manual)
    extra = []
    for s in EXTRA_STRINGS:
        e = tok(s)["input_ids"]
        assert e == bpe.encode(s).ids and tok.decode(e) == s
        extra.append({"text": s, "ids": e})

    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "safetensors": safetensors.__version__,
    }
    reference = {
        "description": "Golden values for tests/assets/tiny-gpt2, computed by transformers in "
        "float32, eval mode (no dropout), attn_implementation=eager, from the saved files.",
        "generated_by": "scripts/make_tiny_gpt2.py",
        "versions": versions,
        "corpus_sha256": corpus_sha,
        "text": ref_text,
        "ids": ref_ids,
        "sequence": {
            "ids": ref_ids[:REF_SEQ],
            "loss": float(out.loss.item()),
            "loss_note": "model(ids, labels=ids).loss: mean cross-entropy of logits[t] against "
            f"ids[t+1] over t = 0..{REF_SEQ - 2} ({REF_SEQ - 1} predictions)",
            "logits_positions": REF_POSITIONS,
            "logits": [[sig7(v) for v in out.logits[0, p].tolist()] for p in REF_POSITIONS],
        },
        "strings": extra,
    }
    ref_path = os.path.join(args.out, "reference.json")
    with open(ref_path, "w", encoding="utf-8") as f:
        json.dump(reference, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    print(f"reference loss {out.loss.item():.6f}")

    write_readme(args, versions, corpus_sha, losses, len(ids))
    total = 0
    for n in sorted(os.listdir(args.out)):
        size = os.path.getsize(os.path.join(args.out, n))
        total += size
        print(f"  {size:8d}  {n}")
    print(f"  {total:8d}  total")


def write_readme(args, versions, corpus_sha, losses, n_tokens):
    train = (
        f"trained for {args.steps} AdamW steps (lr {args.lr}, weight decay 0.01, batch "
        f"{args.batch} x {N_POSITIONS} tokens, dropout 0.1 as configured) on random windows of "
        f"the corpus ({n_tokens} tokens); training loss {losses[0]:.3f} -> {losses[-1]:.3f}"
        if losses
        else "not trained: the seeded initialisation, LayerNorm parameters perturbed by N(0, 0.05)"
    )
    lines = [
        "# tiny-gpt2: a tiny Hugging Face GPT-2 checkpoint for tests",
        "",
        "A 2-layer GPT-2 (`GPT2LMHeadModel`: n_layer 2, n_head 4, n_embd 64, n_positions 128, "
        "vocab_size 1000) in Hugging Face's layout, with a byte-level BPE tokenizer of 1000 "
        "tokens trained on `data/shakespeare/shakespeare.txt.gz`, and golden values computed by "
        "transformers. `AutoTokenizer.from_pretrained` and `GPT2LMHeadModel.from_pretrained` load "
        "this directory; the Rust `tokenizers` crate loads `tokenizer.json` with "
        "`Tokenizer::from_file`.",
        "",
        "- `tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json`: the tokenizer "
        "(ByteLevel pre-tokenizer and decoder, add_prefix_space false; `<|endoftext|>` is id 0 "
        "and is the bos, eos and unk token; ids 1-256 are the bytes, the rest are 743 merges).",
        "- `config.json`, `generation_config.json`, `model.safetensors`: the model, float32, "
        "seeded with `torch.manual_seed(0)` and " + train + ". `lm_head.weight` is tied to "
        "`transformer.wte.weight` and stored once, under that name; the causal-mask buffers "
        "(`attn.bias`) are not stored. `c_attn`, `c_proj` and `c_fc` are `Conv1D`s: their "
        "weights are [in, out] (y = x W + b), not `nn.Linear`'s [out, in].",
        "- `reference.json`: in float32 and eval mode, the first 300 characters of the corpus and "
        "their ids; for the first 64 ids as one sequence, `model(ids, labels=ids).loss` (the "
        "mean next-token cross-entropy over 63 predictions) and the logits at positions 0, 31 "
        "and 63 (7 significant digits); and the ids of two strings with whitespace and non-ASCII "
        "characters.",
        "",
        "## How it was made",
        "",
        "```",
        "python3 scripts/make_tiny_gpt2.py --steps "
        f"{args.steps} --batch {args.batch} --lr {args.lr}",
        "```",
        "",
        "(see the script's header for the virtual environment), with "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
        + f", on the CPU. Corpus sha256 (uncompressed): {corpus_sha}.",
        "Regenerate `reference.json` together with the weights, never one without the other.",
        "",
        "## Licence",
        "",
        "Made from the Shakespeare corpus in `data/shakespeare/` (see its README.md): the texts are "
        "in the public domain (Project Gutenberg transcriptions); the `shakespeare` package's "
        "compilation is (c) the Open Knowledge Foundation, Creative Commons Attribution 2.5 "
        "(http://creativecommons.org/licenses/by/2.5/). The tokenizer, weights and reference "
        "values are derived from it and carry the same terms.",
        "",
    ]
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
