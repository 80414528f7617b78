"""Development aid: every new segment of one phase, in a real trace and in the estimator's timed replay, with the
deferred frees still pending when it was made.

A segment made where the other side made none is where the two reserved figures part. Each line names the
allocation that made it (bytes, stream) and the record_stream'd frees requested before it but not completed
(trace: free_requested without its free_completed yet; replay: a free moved by estimator/gpu_time.timed past
that allocation).

Usage: python tools/segments_vs_trace.py ROW_NAME [PHASE] [ROWS.jsonl|TRACE.json.gz ...]
(PHASE defaults to the row's measured peak phase; rows and traces are looked for under benchmarks/accuracy/)
"""
from __future__ import annotations

import sys
from pathlib import Path

from memplan.accuracy import iter_rows, job_of_row, skipped_steps
from memplan.allocator import simulate
from memplan.allocator.replay import measured_reserved
from memplan.allocator.trace import (ALLOC, FREE, FREE_COMPLETED, FREE_REQUESTED, SEGMENT_ALLOC, SEGMENT_FREE,
                                     SEGMENT_MAP, SEGMENT_UNMAP, marker_test, read_trace)
from memplan.estimator import LEDGER_STEPS
from memplan.estimator.gpu_time import GpuRates, timed
from memplan.estimator.program import build_ledger
from memplan.estimator.summary import allocator_config
from memplan.gpus import gpu_of_device

MIB = 2**20
ROOT = Path("benchmarks/accuracy")


def _row(name: str, paths: list[Path]) -> dict:
    for path in paths or [ROOT]:
        for row in iter_rows(path):
            if row["name"] == name and row.get("status") == "ok":
                return row
    raise SystemExit(f"no ok row named {name}")


def _trace(row: dict, given: list[Path]) -> dict | None:
    """The trace given, else the committed trace of the row's name (the one the row names first) whose peak
    reserved is the row's: a job measured in several sessions has a trace from each."""
    name = row["name"]
    found = [p for p in given if p.name.startswith(name)]
    if found:
        return read_trace(str(found[-1]))
    named = Path(row.get("trace_file") or "")
    for path in [named] * named.name.startswith(name) + sorted(ROOT.glob(f"traces*/{name}.json.gz")):
        if path.is_file():
            tr = read_trace(str(path))
            if measured_reserved(tr, allow_incomplete=True)["peak_reserved_bytes"] == row.get("peak_reserved_bytes"):
                return tr
    return None


def trace_segments(tr: dict, phases: list[str], phase: str) -> list[str]:
    """Lines for each segment_alloc inside ``phase`` of the trace (phases: the row's phase names in order, one
    per marker)."""
    phases = (tr.get("extra") or {}).get("phases") or phases
    is_marker = marker_test(tr)
    act, size, stream, addr, frame = tr["action"], tr["size"], tr["stream"], tr["addr"], tr["frame"]
    k, cur = -1, None
    pending: dict[int, tuple[int, int]] = {}  # addr -> (bytes, stream) of a requested, not completed free
    live: dict[int, tuple[int, int]] = {}
    lines, reserved = [], 0
    for i, a in enumerate(act):
        if a == ALLOC and is_marker(frame[i], size[i]):
            k += 1
            cur = phases[k] if k < len(phases) else None
            continue
        if a == ALLOC:
            live[addr[i]] = (size[i], stream[i])
        elif a == FREE_REQUESTED:
            pending[addr[i]] = live.pop(addr[i], (size[i], stream[i]))
        elif a == FREE_COMPLETED:
            pending.pop(addr[i], None)
        elif a == FREE:
            live.pop(addr[i], None)
        elif a in (SEGMENT_FREE, SEGMENT_UNMAP):  # empty_cache or the OOM path
            reserved -= size[i]
        elif a in (SEGMENT_ALLOC, SEGMENT_MAP):
            reserved += size[i]
            if cur == phase:
                nxt = next((j for j in range(i + 1, len(act)) if act[j] == ALLOC), None)
                req = f"{size[nxt] / MIB:9.1f} MiB s{stream[nxt]}" if nxt is not None else "?"
                held = sorted(pending.values(), reverse=True)
                lines.append(f"  trace  seg {size[i] / MIB:9.1f} MiB for {req} -> {reserved / 2**30:7.2f} GiB; "
                             f"pending {len(held)} ({sum(b for b, _ in held) / MIB:.0f} MiB): "
                             + ", ".join(f"{b / MIB:.0f}s{s}" for b, s in held[:8]))
    return lines


def replay(row: dict):
    """(the plain ledger, the timed one, its simulation) for the row's job on the row's GPU."""
    job = job_of_row(row)
    gpu = gpu_of_device((row.get("env") or {}).get("gpu"))
    L = build_ledger(job, steps=max(LEDGER_STEPS, row.get("steps", 3)), skipped=skipped_steps(row))
    T = timed(L, GpuRates.of(gpu), row.get("mode", "emulated") == "emulated") or L
    return L, T, simulate(T, allocator_config(job))


def phase_table(row: dict, tr: dict | None, sim) -> list[str]:
    """Each phase's peak reserved: the row's, the trace's and the replay's."""
    ours = {p.label: p.peak_reserved_bytes for p in sim.phases}
    traced = {}
    if tr is not None:
        traced = {p["label"]: p["peak_reserved_bytes"] for p in measured_reserved(tr, allow_incomplete=True)["phases"]}
    out = []
    for ph in row.get("phases") or ():
        cells = [ph.get("peak_reserved_bytes"), traced.get(ph["name"]), ours.get(ph["name"])]
        out.append(f"  {ph['name']:28} " + "  ".join("      -" if v is None else f"{v / 2**30:7.2f}" for v in cells))
    return ["  phase                         row   trace  replay (GiB)", *out]


def replay_segments(L, T, sim, phase: str) -> list[str]:
    """Lines for each new segment the timed replay ``T`` of ledger ``L`` (simulated: ``sim``) makes in ``phase``."""
    span = next(((a, b) for label, a, b in T.phase_spans() if label == phase), None)
    if span is None:
        return [f"  replay has no phase {phase}"]
    start, stop = span
    free_at = {~e: j for j, e in enumerate(L.events) if e < 0}
    alloc_at = {e: j for j, e in enumerate(L.events) if e >= 0}
    tfree_at = {~e: j for j, e in enumerate(T.events) if e < 0}
    lines, prev = [], 0
    for j, reserved in sim.reserved_timeline:
        grew = reserved > prev
        prev_r, prev = prev, reserved
        if not grew or not start <= j < stop:
            continue
        e = T.events[j]
        if e < 0:
            continue
        here = alloc_at[e]
        held = sorted(((L.sizes[t], L.stream_used.get(t, 0), L.names[t]) for t, f in free_at.items()
                       if f < here and tfree_at[t] > j), reverse=True)
        lines.append(f"  replay seg {(reserved - prev_r) / MIB:9.1f} MiB for {L.sizes[e] / MIB:9.1f} MiB "
                     f"s{L.streams[e]} {L.names[e][:40]} -> {reserved / 2**30:7.2f} GiB; pending {len(held)} "
                     f"({sum(b for b, _, _ in held) / MIB:.0f} MiB): "
                     + ", ".join(f"{b / MIB:.0f}s{s} {n[:24]}" for b, s, n in held[:6]))
    return lines


def main(argv: list[str]) -> int:
    name = argv[0]
    phase = argv[1] if len(argv) > 1 and not argv[1].endswith((".jsonl", ".gz")) else None
    given = [Path(a) for a in argv[1:] if a.endswith((".jsonl", ".gz"))]
    row = _row(name, [p for p in given if p.suffix == ".jsonl"])
    phase = phase or row["peak_phase"]
    tr = _trace(row, [p for p in given if p.suffix == ".gz"])
    L, T, sim = replay(row)
    print(f"{name}: phase {phase}; measured reserved {row['peak_reserved_bytes'] / 2**30:.2f} GiB")
    print("\n".join(phase_table(row, tr, sim)))
    if tr is not None:
        print("\n".join(trace_segments(tr, [p["name"] for p in row.get("phases") or ()], phase)))
    print("\n".join(replay_segments(L, T, sim, phase)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
