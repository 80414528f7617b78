"""Development aid: the accuracy table's groups with the counts the README quotes.

For every committed row (memplan.accuracy.compare_rows, the estimator as it is): all points, the studied and
check splits, jobs with deferred frees run alone, the same measured on a shared GPU (judged only above), and jobs
with none; per group the allocated median / worst, how many reserved points are judged, their median, worst and
most under, and how many are more than 3 % under or more than 10 % over. ``--dump FILE``: every comparison as a
JSON line as well (to diff two estimator versions).

Usage: python tools/accuracy_groups.py [--dump FILE] [ROWS.jsonl|DIR ...]  (default benchmarks/accuracy/)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from memplan.accuracy import compare_rows, iter_rows, reserved_summary, summary


def _line(label: str, points) -> str:
    if not points:
        return f"{label}: 0 points"
    median, worst = summary(points)
    n, rmedian, rworst, under = reserved_summary(points)
    errors = [p.reserved_error for p in points if p.reserved_error is not None]
    return (f"{label}: {len(points)} points, allocated {median:.2%} / {worst:.2%}; reserved judged {n}: median "
            f"{rmedian:.2%}, worst {rworst:.2%}, most under {under:.2%}; more than 3 % under "
            f"{sum(1 for e in errors if e < -0.03)}, more than 10 % over {sum(1 for e in errors if e > 0.10)}")


def main(argv: list[str]) -> int:
    dump = argv[argv.index("--dump") + 1] if "--dump" in argv else None
    paths = [Path(a) for a in argv if a not in ("--dump", dump)] or [Path("benchmarks/accuracy")]
    cs = compare_rows(row for path in paths for row in iter_rows(path))
    if dump:
        with open(dump, "w") as fh:
            for c in cs:
                fh.write(json.dumps({"name": c.name, "split": c.split, "model": c.model, "loop": c.loop,
                                     "error": c.error, "reserved_error": c.reserved_error,
                                     "measured_reserved_bytes": c.measured_reserved_bytes,
                                     "predicted_reserved_bytes": c.predicted_reserved_bytes}) + "\n")
    deferred = [c for c in cs if c.predicted_reserved_behind_bytes is not None]
    groups = {
        "all": cs,
        "studied, ledger": [c for c in cs if c.split != "check" and c.model == "ledger"],
        "studied, phase lists": [c for c in cs if c.split != "check" and c.model != "ledger"],
        "check split": [c for c in cs if c.split == "check"],
        "deferred frees, run alone": [c for c in deferred if not c.reserved_upper_bound],
        "deferred frees, shared GPU": [c for c in deferred if c.reserved_upper_bound],
        "no deferred frees": [c for c in cs if c.predicted_reserved_behind_bytes is None],
    }
    print("\n".join(_line(label, points) for label, points in groups.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
