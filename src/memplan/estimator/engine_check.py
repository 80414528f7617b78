"""The engine side of a job's allocations, in the form the CPU trace comparison uses (tests/test_engine_trace.py):
what DeepSpeed itself allocates — model build, deepspeed.initialize, gathers, buckets, offload staging, optimizer
states, the step — as (±bytes, name) per event, from the estimator's ledger and from a real CPU trace
(tools/deepspeed_cpu_trace.py).

Predicted: ``build_ledger(job, cpu_run=True)`` — the allocations of a DS_ACCELERATOR=cpu run, host and device in
one ledger (estimator/places.py) — less the model's own tensors (activations, logits, their grads: the autograd
model, compared with the CPU trace by tests/test_ledger_trace.py) and cuBLAS's workspaces (none on the CPU).
Real: every allocation made inside an annotated DeepSpeed frame, or during the model build (phase "init", no
frame: the parameters transformers creates), and the frees of those tensors wherever they happen. Both sides
leave out tensors under MIN_BYTES: DeepSpeed's scalar bookkeeping (norms, overflow flags), the ds_id lists
reset_step checks across ranks and the rotary tables' build temporaries. Pure (no torch).
"""

from __future__ import annotations

from ..specs import Job
from .loop import INPUTS, SCALARS

#: one caching-allocator block; smaller tensors are bookkeeping on both sides (see the module docstring)
MIN_BYTES = 512
#: record_function labels of DeepSpeed's methods (tools/deepspeed_cpu_trace.py ANNOTATED) whose allocations
#: are the engine's; engine.forward / engine.backward enclose the model's own code and are not among them
ENGINE_FRAMES = ("z3.", "coord.", "init.", "z12.", "bf16opt.", "fp16opt.", "cpuadam.", "engine._configure",
                 "engine.step", "engine.allreduce", "engine._take_model_step")
#: coordinator bookkeeping: reset_step's assert_ints_same_as_other_ranks lists (8 bytes per module or parameter)
BOOKKEEPING_FRAME, BOOKKEEPING_BYTES = "coord.reset_step", 16384
#: ledger components of the model's own tensors and of the training loop's (estimator/loop.py INPUTS, SCALARS:
#: made by the script or inside engine.forward / engine.backward, not by an ENGINE_FRAMES method)
MODEL_COMPONENTS = frozenset({"activations", "logits_loss", "cuda_workspaces", INPUTS, SCALARS})


def predicted_events(job: Job, steps: int = 2) -> list[tuple[int, str]]:
    """(±bytes, name) of the engine's events in the ledger of a CPU run of ``job``."""
    from .program import build_ledger

    L = build_ledger(job, steps, cpu_run=True)
    return engine_events(L, L.events)


def engine_events(L, events) -> list[tuple[int, str]]:
    """(±bytes, name) of the engine's events among ``events`` of ledger ``L``."""
    out = []
    for ev in events:
        tid = ev if ev >= 0 else ~ev
        if (L.components[tid] in MODEL_COMPONENTS or L.sizes[tid] < MIN_BYTES or L.names[tid].endswith(".tmp")):
            continue
        out.append((L.sizes[tid] if ev >= 0 else -L.sizes[tid], L.names[tid]))
    return out


def _engine_alloc(nbytes: int, frames: str, phase: str) -> bool:
    if nbytes < MIN_BYTES:
        return False
    if frames.endswith(BOOKKEEPING_FRAME) and nbytes <= BOOKKEEPING_BYTES:
        return False
    return any(f in frames for f in ENGINE_FRAMES) or (phase == "init" and not frames)


def real_events(rows: list[list]) -> list[tuple[int, str]]:
    """(±bytes, "op | frames") of the engine's events in a CPU trace (rows of tools/deepspeed_cpu_trace.py:
    [bytes, addr, op, frames, phase, kernel]); frees are matched to allocations by address."""
    live: dict[int, bool] = {}
    out = []
    for nbytes, addr, op, frames, phase, _kernel in rows:
        if nbytes > 0:
            engine = _engine_alloc(nbytes, frames, phase)
            live[addr] = engine
        elif not live.pop(addr, False):
            continue
        else:
            engine = True
        if engine:
            out.append((nbytes, f"{op} | {frames}"))
    return out


def _frees_sorted(events: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Each run of consecutive frees in one order (by size): release_sub_module walks a module's parameters as a
    Python set (partitioned_param_coordinator.py: ``module_params = set(iter_params(...))``), in no order the
    model can know, and frees with nothing allocated between them commute."""
    out: list[tuple[int, str]] = []
    run: list[tuple[int, str]] = []
    for ev in [*events, (1, "")]:
        if ev[0] < 0:
            run.append(ev)
            continue
        out.extend(sorted(run, key=lambda e: e[0]))
        run = []
        out.append(ev)
    return out[:-1]


def first_mismatch(real: list[tuple[int, str]], predicted: list[tuple[int, str]]) -> int | None:
    """Index of the first event whose ±bytes differ (a missing event counts), None when none does; runs of
    frees are compared in one order (_frees_sorted)."""
    real, predicted = _frees_sorted(real), _frees_sorted(predicted)
    n = max(len(real), len(predicted))
    return next((i for i in range(n) if i >= len(real) or i >= len(predicted) or real[i][0] != predicted[i][0]),
                None)


def describe(real: list[tuple[int, str]], predicted: list[tuple[int, str]], at: int, context: int = 6) -> str:
    """The events around index ``at`` side by side (for an assertion message), in first_mismatch's order."""
    real, predicted = _frees_sorted(real), _frees_sorted(predicted)
    lines = []
    for i in range(max(0, at - context), min(max(len(real), len(predicted)), at + context)):
        r = real[i] if i < len(real) else (None, "")
        p = predicted[i] if i < len(predicted) else (None, "")
        mark = "  " if r[0] == p[0] else "!!"
        lines.append(f"{i:5} {mark} {r[0]!s:>10} {r[1][:70]:70} | {p[0]!s:>10} {p[1][:60]}")
    return "\n".join(lines)
