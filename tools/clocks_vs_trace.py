"""Development aid: the replay's host and GPU clocks against a real trace's, one phase of one row.

For each allocation of at least MIN_MIB (default 256) in the phase, in order on both sides: when the host made it,
in milliseconds from the phase's start, in the trace (``time_us``) and in the estimator's timed replay
(estimator/gpu_time.event_clocks: the host clock, and the compute stream's clock then). For each deferred free
(``record_stream``) of that size: how long after its request it completed, in the trace (free_completed: at the
first malloc after the GPU finished) and in the replay (the using stream's clock at the request minus the host's).
Where the two columns part is where the replay's host or GPU runs at another pace than the real one.

Usage: python tools/clocks_vs_trace.py ROW_NAME [PHASE] [--min-mib N] [ROWS.jsonl|TRACE.json.gz ...]
(PHASE defaults to the row's measured peak phase; rows and traces are looked for under benchmarks/accuracy/)
"""
from __future__ import annotations

import sys
from pathlib import Path

from memplan.allocator.trace import ALLOC, FREE_COMPLETED, FREE_REQUESTED, marker_test
from memplan.estimator.gpu_time import GpuRates, event_clocks
from memplan.gpus import gpu_of_device

sys.path.insert(0, str(Path(__file__).parent))
from segments_vs_trace import _row, _trace, replay  # noqa: E402

MIB = 2**20


def trace_rows(tr: dict, phases: list[str], phase: str, min_bytes: int) -> tuple[list, list]:
    """([(ms, bytes, stream)] of each large allocation in ``phase``, [(ms requested, lag ms, bytes)] of each
    large deferred free requested in it)."""
    phases = (tr.get("extra") or {}).get("phases") or phases
    is_marker = marker_test(tr)
    act, size, stream, addr, frame, t = (tr[k] for k in ("action", "size", "stream", "addr", "frame", "time_us"))
    k, cur, t0 = -1, None, 0
    allocs, frees, requested = [], [], {}
    for i, a in enumerate(act):
        if a == ALLOC and is_marker(frame[i], size[i]):
            k += 1
            cur, t0 = (phases[k] if k < len(phases) else None), t[i]
            continue
        if a == ALLOC and cur == phase and size[i] >= min_bytes:
            allocs.append(((t[i] - t0) / 1e3, size[i], stream[i]))
        elif a == FREE_REQUESTED and size[i] >= min_bytes:
            requested[addr[i]] = (t[i], cur, size[i])
        elif a == FREE_COMPLETED and addr[i] in requested:
            tr_, ph, b = requested.pop(addr[i])
            if ph == phase:
                frees.append(((tr_ - t0) / 1e3, (t[i] - tr_) / 1e3, b))
    return allocs, frees


def replay_rows(L, T, clocks, phase: str, min_bytes: int) -> tuple[list, list]:
    """The same from the plain ledger ``L`` and its timed form ``T``: (ms, bytes, stream, name, GPU ms) per large
    allocation; (ms requested, lag ms, bytes, name) per large deferred free."""
    span = next(((a, b) for label, a, b in L.phase_spans() if label == phase), None)
    if span is None:
        return [], []
    start, stop = span
    h0 = clocks[start][0]
    allocs, frees = [], []
    for j in range(start, stop):
        e = L.events[j]
        tensor = e if e >= 0 else ~e
        if L.sizes[tensor] < min_bytes:
            continue
        host, gpu = clocks[j]
        if e >= 0:
            allocs.append(((host - h0) * 1e3, L.sizes[e], L.streams[e], L.names[e], (gpu - h0) * 1e3))
        elif tensor in L.stream_used:
            frees.append(((host - h0) * 1e3, max(0.0, gpu - host) * 1e3, L.sizes[tensor], L.names[tensor]))
    return allocs, frees


def main(argv: list[str]) -> int:
    min_mib = int(argv[argv.index("--min-mib") + 1]) if "--min-mib" in argv else 256
    argv = [a for i, a in enumerate(argv) if a != "--min-mib" and (i == 0 or argv[i - 1] != "--min-mib")]
    name = argv[0]
    phase = argv[1] if len(argv) > 1 and not argv[1].endswith((".jsonl", ".gz")) else None
    given = [Path(a) for a in argv[1:] if a.endswith((".jsonl", ".gz"))]
    row = _row(name, [p for p in given if p.suffix == ".jsonl"])
    phase = phase or row["peak_phase"]
    tr = _trace(row, [p for p in given if p.suffix == ".gz"])
    if tr is None or "time_us" not in tr:
        raise SystemExit(f"no committed trace with times for {name}")
    L, T, _ = replay(row)
    gpu = gpu_of_device((row.get("env") or {}).get("gpu"))
    clocks = event_clocks(L, GpuRates.of(gpu), row.get("mode", "emulated") == "emulated")
    min_bytes = min_mib * MIB
    ta, tf = trace_rows(tr, [p["name"] for p in row.get("phases") or ()], phase, min_bytes)
    ra, rf = replay_rows(L, T, clocks, phase, min_bytes)
    print(f"{name}: phase {phase}, allocations of {min_mib} MiB or more (ms from the phase's start)")
    print("     trace ms  |  replay host ms  gpu ms   size MiB  tensor")
    for i in range(max(len(ta), len(ra))):
        left = f"{ta[i][0]:9.1f} {ta[i][1] / MIB:7.0f}s{ta[i][2]}" if i < len(ta) else " " * 19
        right = (f"{ra[i][0]:9.1f} {ra[i][4]:9.1f} {ra[i][1] / MIB:7.0f}s{ra[i][2]} {ra[i][3][:44]}"
                 if i < len(ra) else "")
        print(f"  {left} | {right}")
    print("  deferred frees: requested ms, completed after ms (trace | replay)")
    for i in range(max(len(tf), len(rf))):
        left = f"{tf[i][0]:9.1f} +{tf[i][1]:7.1f} {tf[i][2] / MIB:6.0f}" if i < len(tf) else " " * 25
        right = f"{rf[i][0]:9.1f} +{rf[i][1]:7.1f} {rf[i][2] / MIB:6.0f} {rf[i][3][:44]}" if i < len(rf) else ""
        print(f"  {left} | {right}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
