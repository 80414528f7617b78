"""Development aid (GPU): the estimator's CUDA ledger of a tiny model against the CUDA caching allocator's
trace of the same micro-step, side by side (block sizes, which allocation each free releases).

Usage: python tools/ledger_vs_cuda.py [tiny] [batch] [seq] [dtype] [attention[:kernel]] [--all]
(tiny: a key of memplan.estimator.model_check.TINY; kernels: flash, efficient, math, as SDPBackend names them)
Exit status 1 when they differ.
"""
from __future__ import annotations

import sys

import torch

from memplan.estimator import model_check
from memplan.verify import cputrace, cudatrace

BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}

args = [a for a in sys.argv[1:] if not a.startswith("--")]
name, batch, seq, dtype, attention = (args + ["llama_gqa", "2", "64", "bf16", "sdpa"][len(args):])[:5]
batch, seq = int(batch), int(seq)
attention, _, backend = attention.partition(":")
cfg = model_check.TINY[name]
model = cputrace.tiny_causal_lm(cfg, dtype, attention).cuda()
ids = torch.randint(0, cfg["vocab_size"], (batch, seq), device="cuda")


def step():
    import contextlib
    ctx = contextlib.nullcontext()
    if backend:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        ctx = sdpa_kernel([getattr(SDPBackend, BACKENDS[backend])])
    with ctx:
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        del loss


real = cudatrace.net_events(cudatrace.record(step))
pred = model_check.model_events(cfg, batch=batch, seq=seq, dtype=dtype, attention=attention, device="cuda",
                                sdpa_backend=backend or None, kernel_temporaries=True, blocks=True)
n = max(len(real), len(pred))
first = next((i for i in range(n) if i >= len(real) or i >= len(pred)
              or (real[i][0], real[i][1]) != (pred[i][0], pred[i][2])), None)
lo, hi = (0, n) if "--all" in sys.argv else (max(0, (first or n) - 30), min(n, (first or n) + 15))
for i in range(lo, hi):
    r = real[i] if i < len(real) else ("", "")
    m = pred[i] if i < len(pred) else ("", "", "")
    mark = "  " if (r[0], r[1]) == (m[0], m[2]) else "!!"
    print(f"{i:4} {mark} {r[0]!s:>10} {r[1]!s:>5} | {m[0]!s:>10} {m[2]!s:>5} {str(m[1])[:60]}")
print("first mismatch:", first, "of", len(real), len(pred), "| torch", torch.__version__, "cudnn",
      torch.backends.cudnn.version())
sys.exit(0 if first is None else 1)
