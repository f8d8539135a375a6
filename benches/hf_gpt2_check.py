"""Checks a GPT-2 model directory cellgraph saved against the real thing, with `transformers`
(a throwaway environment, never a dependency):

    python -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install torch transformers tokenizers
    cargo test --features wgpu --test it hf::   # saves target/tmp/hf-saved-tiny-gpt2
    /tmp/hfvenv/bin/python benches/hf_gpt2_check.py [SAVED_DIR] [ORIGINAL_DIR]

`GPT2LMHeadModel.from_pretrained` and `AutoTokenizer.from_pretrained` load the saved directory,
its parameters equal the original's bit for bit, and it scores the reference sequence
(`reference.json`) to the same loss as the original. Prints what it compared; exits 1 on a
difference.
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, GPT2LMHeadModel

root = Path(__file__).resolve().parent.parent
saved = Path(sys.argv[1]) if len(sys.argv) > 1 else root / "target/tmp/hf-saved-tiny-gpt2"
original = Path(sys.argv[2]) if len(sys.argv) > 2 else root / "tests/assets/tiny-gpt2"
ref = json.loads((original / "reference.json").read_text())

a = GPT2LMHeadModel.from_pretrained(original).eval()
b = GPT2LMHeadModel.from_pretrained(saved).eval()
tok = AutoTokenizer.from_pretrained(saved)
ok = True
sa, sb = a.state_dict(), b.state_dict()
differ = [k for k in sa if not torch.equal(sa[k], sb[k])]
print(f"parameters: {len(sa)} in the original, {len(sb)} loaded from {saved}; {len(differ)} differ {differ[:4]}")
ok &= not differ and sa.keys() == sb.keys()
ids = torch.tensor([ref["sequence"]["ids"]])
with torch.no_grad():
    la, lb = a(ids, labels=ids).loss.item(), b(ids, labels=ids).loss.item()
print(f"loss on the reference sequence: original {la:.9f}, saved {lb:.9f}, reference.json {ref['sequence']['loss']:.9f}")
ok &= la == lb
got = tok(ref["text"])["input_ids"]
print(f"tokenizer from the saved directory: {'same' if got == ref['ids'] else 'DIFFERENT'} ids on the reference text ({len(got)})")
ok &= got == ref["ids"]
sys.exit(0 if ok else 1)
