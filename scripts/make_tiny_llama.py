#!/usr/bin/env python3
"""Make tests/assets/tiny-llama/: a tiny Hugging Face Llama checkpoint (LlamaForCausalLM) with a
golden reference, for the Llama fine-tuning tests.

What it writes (into --out, default tests/assets/tiny-llama/):
  tokenizer.json, tokenizer_config.json, special_tokens_map.json
      copied from tests/assets/tiny-gpt2 (its byte-level BPE of 1000 tokens, trained on the
      corpus; a Llama model directory reads any tokenizer.json).
  config.json, generation_config.json, model.safetensors
      LlamaForCausalLM(hidden_size 64, intermediate_size 160, 2 layers, 4 heads, 2 key/value
      heads (grouped-query attention), head_dim 16, max_position_embeddings 128, rope_theta
      10000, rms_norm_eps 1e-6, vocab_size 1000, untied lm_head), seeded
      (torch.manual_seed(0)) and trained for --steps AdamW steps on random 128-token windows of
      the corpus, so no parameter is at its initial value (the RMSNorm weights are not all 1).
  reference.json
      computed by transformers in float32, eval mode, from the saved files: for the first 64
      ids of the corpus as one sequence, model(ids, labels=ids).loss and the logits (full
      vocabulary rows, 7 significant digits) at positions 0, 31 and 63.
  README.md
      what the directory is, the command and package versions that made it, its licence.

Run it from the repository root (about 10 s on 2 CPU cores) in the virtual environment of
scripts/make_tiny_gpt2.py (torch, transformers, tokenizers, safetensors):

    /tmp/hfvenv/bin/python scripts/make_tiny_llama.py [--steps 40]

It is deterministic on one machine (one thread, deterministic algorithms, fixed seeds);
regenerate reference.json along with the weights, never one without the other.
"""

import argparse
import gzip
import hashlib
import json
import os
import platform
import shutil
import sys

import safetensors
import tokenizers
import torch
import transformers
from safetensors import safe_open
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

N_POSITIONS = 128
REF_SEQ = 64
REF_POSITIONS = [0, 31, 63]
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


def sig7(x):
    return float(f"{x:.7g}")


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", default=os.path.join(root, "data/shakespeare/shakespeare.txt.gz"))
    ap.add_argument("--tokenizer", default=os.path.join(root, "tests/assets/tiny-gpt2"))
    ap.add_argument("--out", default=os.path.join(root, "tests/assets/tiny-llama"))
    ap.add_argument("--steps", type=int, default=40)
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
    for name in TOKENIZER_FILES:
        shutil.copyfile(os.path.join(args.tokenizer, name), os.path.join(args.out, name))
    tok = AutoTokenizer.from_pretrained(args.out)
    ids = tok(text[:400_000], verbose=False)["input_ids"]

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=N_POSITIONS,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(1)
    data = torch.tensor(ids, dtype=torch.long)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    model.train()
    losses = []
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - N_POSITIONS, (args.batch,), generator=gen)
        x = torch.stack([data[s : s + N_POSITIONS] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print(f"training loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    model.eval()
    model.save_pretrained(args.out)
    st_path = os.path.join(args.out, "model.safetensors")
    os.chmod(st_path, 0o644)
    with safe_open(st_path, framework="pt") as f:
        for n in sorted(f.keys()):
            t = f.get_tensor(n)
            if n.endswith("norm.weight"):
                assert not torch.all(t == 1.0), f"{n} is still at its initial value"
            print(f"  {n:45s} {list(t.shape)}")

    model = LlamaForCausalLM.from_pretrained(args.out, dtype=torch.float32, attn_implementation="eager").eval()
    seq = torch.tensor([ids[:REF_SEQ]])
    with torch.no_grad():
        out = model(input_ids=seq, labels=seq)
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "safetensors": safetensors.__version__,
    }
    reference = {
        "description": "Golden values for tests/assets/tiny-llama, computed by transformers in "
        "float32, eval mode, attn_implementation=eager, from the saved files.",
        "generated_by": "scripts/make_tiny_llama.py",
        "versions": versions,
        "corpus_sha256": corpus_sha,
        "sequence": {
            "ids": ids[:REF_SEQ],
            "loss": float(out.loss.item()),
            "logits_positions": REF_POSITIONS,
            "logits": [[sig7(v) for v in out.logits[0, p].tolist()] for p in REF_POSITIONS],
        },
    }
    with open(os.path.join(args.out, "reference.json"), "w", encoding="utf-8") as f:
        json.dump(reference, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    print(f"reference loss {out.loss.item():.6f}")
    readme = f"""# tiny-llama: a tiny Hugging Face Llama checkpoint for tests

A 2-layer Llama (`LlamaForCausalLM`: hidden_size 64, intermediate_size 160, 4 attention heads
over 2 key/value heads, head_dim 16, max_position_embeddings 128, rope_theta 10000, rms_norm_eps
1e-6, vocab_size 1000, `lm_head` not tied to the embeddings) in Hugging Face's layout, float32,
seeded with `torch.manual_seed(0)` and trained for {args.steps} AdamW steps (lr {args.lr}, batch
{args.batch} x {N_POSITIONS} tokens) on random windows of `data/shakespeare/shakespeare.txt.gz`:
training loss {losses[0]:.3f} -> {losses[-1]:.3f}. The tokenizer files are `tiny-gpt2`'s (a
byte-level BPE of 1000 tokens trained on the same corpus). `reference.json`: in float32 and eval
mode, for the corpus's first 64 ids as one sequence, `model(ids, labels=ids).loss` and the logits
at positions 0, 31 and 63 (7 significant digits).

Made by `python3 scripts/make_tiny_llama.py --steps {args.steps}` with
{", ".join(f"{k} {v}" for k, v in versions.items())}, on the CPU. Corpus sha256 (uncompressed):
{corpus_sha}. Regenerate `reference.json` together with the weights, never one without the other.

## Licence

Made from the Shakespeare corpus in `data/shakespeare/` (see its README.md): the texts are in the
public domain (Project Gutenberg transcriptions); the `shakespeare` package's compilation is (c)
the Open Knowledge Foundation, Creative Commons Attribution 2.5
(http://creativecommons.org/licenses/by/2.5/). The weights and reference values are derived from
it and carry the same terms.
"""
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(readme)
    for n in sorted(os.listdir(args.out)):
        print(f"  {os.path.getsize(os.path.join(args.out, n)):8d}  {n}")


if __name__ == "__main__":
    sys.exit(main())
