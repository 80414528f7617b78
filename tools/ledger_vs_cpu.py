"""Development aid: the estimator's autograd ledger of a tiny model against the CPU allocation trace, side by side.

Usage: python tools/ledger_vs_cpu.py [family]   (prints the first mismatch with context)
"""
from __future__ import annotations

import sys

from memplan.estimator import model_check
from memplan.verify import cputrace

family = sys.argv[1] if len(sys.argv) > 1 else "llama"
cfg = model_check.TINY[family]
tiny = cputrace.tiny_causal_lm(cfg, "bf16", "sdpa")
ckpt = len(sys.argv) > 4 and sys.argv[4] == "ckpt"
if ckpt:
    tiny.gradient_checkpointing_enable()
real = cputrace.net_events(cputrace.record(cputrace.micro_step(tiny, int(sys.argv[2]) if len(sys.argv) > 2 else 1, int(sys.argv[3]) if len(sys.argv) > 3 else 128, cfg["vocab_size"])))
model = model_check.model_events(cfg, batch=int(sys.argv[2]) if len(sys.argv) > 2 else 1, seq=int(sys.argv[3]) if len(sys.argv) > 3 else 128, checkpointing=ckpt)
n = max(len(real), len(model))
first = next((i for i in range(n) if i >= len(real) or i >= len(model) or real[i][0] != model[i][0]), None)
lo = max(0, (first or n) - 30)
for i in range(lo, min(n, (first or n) + 15)):
    r = real[i] if i < len(real) else ("", "")
    m = model[i] if i < len(model) else ("", "")
    mark = "  " if r[0] == m[0] else "!!"
    print(f"{i:4} {mark} {r[0]!s:>10} {str(r[1])[:40]:40} | {m[0]!s:>10} {str(m[1])[:50]}")
print("first mismatch:", first, "of", len(real), len(model))
