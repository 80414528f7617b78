"""Development aid: the timing model (memplan.estimator.gpu_time) against measured verify rows.

For each ZeRO-3 row (or each row named): every phase's predicted seconds (the replay's host and GPU clocks, from
one synchronization to the next) against the row's measured ``wall_s``, and peak reserved as the GPU keeping up,
as the replay times it, and as measured (the row's GPU, from its environment, sets the rates).

``--lags DIR``: with ``--phases``, each phase's compute-stream launch lag as the replay has it (median, p90, max)
beside the one tools/kernel_timeline.py measured, from DIR/NAME.json where that file exists.

Usage: python tools/timing_vs_rows.py [--lone] [--phases] [--match TEXT] [--lags DIR] [ROWS.jsonl ...]
(default: every rows*.jsonl under benchmarks/accuracy/; ``--lone``: rows measured alone on the GPU only)
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from memplan.accuracy import _measured_points, iter_rows, job_of_row, skipped_steps
from memplan.estimator import LEDGER_STEPS, quick_peak
from memplan.estimator.gpu_time import GpuRates, launch_lags, phase_seconds
from memplan.estimator.program import build_ledger
from memplan.estimator.summary import allocator_config
from memplan.gpus import gpu_of_device

GIB = 2**30


def main(argv: list[str]) -> int:
    lone = "--lone" in argv
    show_phases = "--phases" in argv
    match = argv[argv.index("--match") + 1] if "--match" in argv else None
    lag_dir = Path(argv[argv.index("--lags") + 1]) if "--lags" in argv else None
    paths = [Path(a) for a in argv if a.endswith(".jsonl")] or [Path("benchmarks/accuracy")]
    errs, ratios = [], []
    for path in paths:
        for row in iter_rows(path):
            job = job_of_row(row)
            if row.get("status") != "ok" or job.training.zero.stage != 3:
                continue
            shared = (row.get("batch") or {}).get("shared_gpu", True)
            if (lone and shared) or (match and match not in row["name"]):
                continue
            gpu = gpu_of_device((row.get("env") or {}).get("gpu"))
            for name, pjob, _alloc, reserved, _phase in _measured_points(row):
                q = quick_peak(pjob, rank0=True, skipped=skipped_steps(row), gpu=gpu)
                keep = q.peak_reserved_bytes if q.peak_reserved_behind_bytes is None else None
                err = (q.peak_reserved_bytes - reserved) / reserved if reserved else float("nan")
                errs.append(err)
                print(f"{name[:52]:52} {'shared' if shared else 'lone  '} {gpu.name:9} reserved measured "
                      f"{reserved / GIB:7.2f} predicted {q.peak_reserved_bytes / GIB:7.2f} ({err:+.1%})"
                      + ("" if keep is None else " (no deferred frees)"))
                if show_phases and not row.get("layers"):
                    L = build_ledger(pjob, steps=max(LEDGER_STEPS, row.get("steps", 3)), skipped=skipped_steps(row))
                    emulated = row.get("mode", "emulated") == "emulated"
                    pred = dict(phase_seconds(L, GpuRates.of(gpu), emulated))
                    lag_of = _lags(L, gpu, lag_dir, row["name"], emulated) if lag_dir else {}
                    for ph in row.get("phases") or ():
                        t = pred.get(ph["name"])
                        if t is None or not ph.get("wall_s") or ph["name"] == "init" or ph["name"].endswith("step"):
                            continue
                        ratios.append(t / ph["wall_s"])
                        print(f"    {ph['name']:26} measured {ph['wall_s'] * 1e3:8.1f} ms predicted {t * 1e3:8.1f} ms"
                              + lag_of.get(ph["name"], ""))
    if errs:
        under = sum(1 for e in errs if e < -0.03)
        print(f"{len(errs)} points: reserved median {statistics.median(errs):+.2%}, worst under "
              f"{min(errs):+.2%}, worst over {max(errs):+.2%}, {under} more than 3 % under")
    if ratios:
        print(f"phase time predicted / measured: median {statistics.median(ratios):.2f}, "
              f"range {min(ratios):.2f}-{max(ratios):.2f}")
    return 0


def _quantiles_ms(values: list[float]) -> str:
    v = sorted(values)
    return f"{statistics.median(v):6.2f} {v[int(0.9 * (len(v) - 1))]:6.2f} {v[-1]:6.2f}" if v else "     -"


def _lags(L, gpu, lag_dir: Path, name: str, emulated: bool) -> dict[str, str]:
    """Per phase: '  lag ms (median p90 max) replay … measured …'."""
    by: dict[str, list[float]] = {}
    for label, lag in launch_lags(L, GpuRates.of(gpu), emulated):
        by.setdefault(label, []).append(lag * 1e3)
    measured = {}
    f = lag_dir / f"{name}.json"
    if f.is_file():
        measured = {p["phase"]: p["launch_delay_ms"] for p in json.loads(f.read_text()).get("summary", [])}
    out = {}
    for label, v in by.items():
        m = measured.get(label)
        out[label] = (f"   lag ms (median p90 max) replay {_quantiles_ms(v)}"
                      + (f" measured {m['median']:6.2f} {m['p90']:6.2f} {m['max']:6.2f}" if m else ""))
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
