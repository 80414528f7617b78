"""Development aid: a megatron-core case's forward and backward peaks recorded on the CPU (torch's profiler,
memplan.verify.cputrace) against memplan.megatron.harness.predict, above what was allocated before each.

Usage: PYTHONPATH=<megatron-core site> python tools/megatron_cpu_peaks.py '{"name": "x", "hidden": 256, ...}' [--ops]
(a MegatronCase as JSON; --ops lists the allocations live at each peak by op)
"""
from __future__ import annotations

import sys
from collections import Counter

import torch

from memplan.megatron import stage_activations
from memplan.megatron.harness import MegatronCase, case_job, predict
from memplan.verify import cputrace
from memplan.verify.megatron_worker import build, setup


def peak_of(events, start: int = 0):
    """(peak, end, live at the peak) of the running allocated bytes, the peak taken from event ``start`` on."""
    cur = top = 0
    live: dict[int, tuple[int, str]] = {}
    at_top: dict[int, tuple[int, str]] = {}
    for k, e in enumerate(events):
        if e.delta_bytes > 0:
            live[e.addr] = (e.delta_bytes, e.op)
            cur += e.delta_bytes
        elif e.addr in live:
            cur -= live.pop(e.addr)[0]
        if k >= start and cur > top:
            top, at_top = cur, dict(live)
    return top, cur, at_top


def main() -> None:
    case = MegatronCase.model_validate_json(sys.argv[1])
    torch.set_num_threads(2)
    setup(case, "cpu")
    model = build(case, "cpu")
    model.train()
    ids = torch.randint(0, case.vocab, (case.micro, case.seq))
    pos = torch.arange(case.seq).unsqueeze(0).expand(case.micro, -1)
    mask = None if case.flash else torch.triu(torch.ones(case.seq, case.seq, dtype=torch.bool), 1).view(
        1, 1, case.seq, case.seq)
    state = {}

    def fwd():
        state["loss"] = model(ids, pos, mask, labels=ids)

    def bwd():
        state["loss"].mean().backward()
        state.pop("loss")

    fwd(); bwd()  # warm-up: global memory buffer, grads exist from here on (the second micro-step)
    f = cputrace.record(fwd, warmup=False)
    b = cputrace.record(bwd, warmup=False)
    pred = predict(case)
    ftop, _, flive = peak_of(f)
    btop, _, blive = peak_of(f + b, len(f))
    job = case_job(case)
    # before the second forward: parameters, their 16-bit grads and the persistent buffers (harness.predict)
    start = 2 * pred["init"] + stage_activations(job.model, job, case.layers).buffers
    print(f"forward peak above its start: measured {ftop:,}, predicted {pred['micro1.forward'] - start:,}")
    print(f"backward peak above the forward's start: measured {btop:,}, predicted "
          f"{pred['micro1.backward'] - start:,}")
    if "--ops" in sys.argv:
        for title, live in (("forward peak", flive), ("backward peak", blive)):
            c = Counter()
            for nbytes, op in live.values():
                c[op] += nbytes
            print(title)
            for op, nbytes in c.most_common(12):
                print(f"  {nbytes:>14,}  {op}")


if __name__ == "__main__":
    main()
