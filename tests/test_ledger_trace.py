"""The estimator's autograd ledger against the real allocation order of transformers' code on the CPU.

For each tiny model, one micro-step (forward, loss, backward, parameter grads kept as .grad) is recorded with
torch's profiler (memplan.verify.cputrace) and compared, event by event, with the allocations and frees the
estimator's autograd model issues (memplan.estimator.model_check). CUDA kernels' internal temporaries and
CPU-only scalars are left out on both sides; everything else must match exactly: sizes, order, and which
tensor each free releases.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from memplan.estimator import model_check
from memplan.verify import cputrace

CASES = [
    ("llama", 1, 128, False),
    ("llama", 2, 64, False),
    ("llama", 1, 128, True),
    ("llama", 2, 64, True),
]


@pytest.mark.parametrize(("family", "batch", "seq", "checkpointing"), CASES)
def test_micro_step_matches_cpu_trace(family, batch, seq, checkpointing):
    cfg = model_check.TINY[family]
    model = cputrace.tiny_causal_lm(cfg, "bf16", "sdpa")
    if checkpointing:  # transformers' default kwargs: use_reentrant=False
        model.gradient_checkpointing_enable()
    real = cputrace.net_events(cputrace.record(cputrace.micro_step(model, batch, seq, cfg["vocab_size"])))
    predicted = model_check.model_events(cfg, batch=batch, seq=seq, checkpointing=checkpointing)
    first = next((i for i in range(max(len(real), len(predicted)))
                  if i >= len(real) or i >= len(predicted) or real[i][0] != predicted[i][0]), None)
    assert first is None, (f"event {first}: real {real[first] if first < len(real) else None} vs predicted "
                           f"{predicted[first] if first < len(predicted) else None} ({len(real)} vs {len(predicted)})")
