"""Development aid: the estimator's autograd ledger of a tiny model against the CPU allocation trace, side by side.

Usage: python tools/ledger_vs_cpu.py [tiny] [batch] [seq] [dtype] [attention[:kernel]] [--all] [--ckpt]
(tiny: a key of memplan.estimator.model_check.TINY; prints the first mismatch with context, or every event;
--ckpt: every decoder layer checkpointed, non-reentrant)
"""
from __future__ import annotations

import sys

import torch

from memplan.estimator import model_check
from memplan.verify import cputrace

args = [a for a in sys.argv[1:] if not a.startswith("--")]
name, batch, seq, dtype, attention = (args + ["llama", "1", "128", "bf16", "sdpa"][len(args):])[:5]
batch, seq = int(batch), int(seq)
torch.set_num_threads(1)
attention, _, backend = attention.partition(":")  # sdpa:math forces a kernel
cfg = model_check.TINY[name]
tiny = cputrace.tiny_causal_lm(cfg, dtype, attention)
ckpt = "--ckpt" in sys.argv  # transformers' default: non-reentrant
if ckpt:
    tiny.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
step = cputrace.micro_step(tiny, batch, seq, cfg["vocab_size"], sdpa_backend=backend or None)
real = cputrace.net_events(cputrace.record(step))
model = model_check.model_events(cfg, batch=batch, seq=seq, dtype=dtype, attention=attention, device="cpu",
                                 sdpa_backend=backend or None, checkpointing=ckpt)
n = max(len(real), len(model))
first = model_check.first_mismatch(real, model)
lo, hi = (0, n) if "--all" in sys.argv else (max(0, (first or n) - 30), min(n, (first or n) + 15))
for i in range(lo, hi):
    r = real[i] if i < len(real) else ("", "", "")
    m = model[i] if i < len(model) else ("", "", "")
    mark = "  " if (r[0], r[2]) == (m[0], m[2]) else "!!"
    print(f"{i:4} {mark} {r[0]!s:>9} {r[2]!s:>4} {str(r[1])[:42]:42} | {m[0]!s:>9} {m[2]!s:>4} {str(m[1])[:50]}")
print("first mismatch:", first, "of", len(real), len(model))
