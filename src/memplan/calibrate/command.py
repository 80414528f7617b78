"""Fit a calibration file from verify rows: `memplan calibrate ROWS... --out calibration.json`.

ROWS are verify rows (JSON lines, e.g. benchmarks/accuracy/rows-h200-1.jsonl) or folders (every rows*.jsonl
in them); rows whose status is not ok are skipped, at least 3 measured rows are needed. The fit (see
memplan.calibrate.fit): one factor per peak phase class, least squares on the relative error of peak
allocated bytes, bounded to 0.8–1.25. Prints |error| before and after calibration (median, worst) and writes
the file atomically; `memplan estimate --calibration FILE` applies it. Without that flag estimates are
uncalibrated: the shipped model meets the accuracy bar on its own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import datetime, timezone

from .fit import Calibration, Point, calibrated_bytes

DEFAULT_OUT = "calibration.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add calibrate's arguments to ``parser``."""
    parser.add_argument("rows", nargs="+", metavar="ROWS", help="verify rows (.jsonl) or folders of rows*.jsonl")
    parser.add_argument("--out", metavar="FILE", default=DEFAULT_OUT, help=f"calibration file to write ({DEFAULT_OUT})")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")


def error_summary(points: tuple[Point, ...], predicted: list[int]) -> dict[str, float]:
    """Median and worst |error| of ``predicted`` against the points' measured bytes."""
    errs = [abs(p_bytes - pt.measured_bytes) / pt.measured_bytes for pt, p_bytes in zip(points, predicted)]
    return {"points": len(errs), "median_abs_error": statistics.median(errs), "worst_abs_error": max(errs)}


def summaries(cal: Calibration) -> tuple[dict[str, float], dict[str, float]]:
    """|error| before and after applying ``cal`` to its own points."""
    before = error_summary(cal.points, [p.predicted_bytes for p in cal.points])
    after = error_summary(cal.points, [calibrated_bytes(cal, p) for p in cal.points])
    return before, after


def _render(cal: Calibration, out: str, before: dict, after: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    factors = Table(title=f"calibration factors ({len(cal.rows)} rows, {len(cal.points)} points)")
    for col in ("peak phase class", "points", "factor", "note"):
        factors.add_column(col, justify="left" if col != "points" else "right")
    for f in (*cal.factors, cal.default):
        note = "clamped to the bounds" if f.clamped else ""
        label = f.phase_class if f != cal.default else "any other (all points)"
        factors.add_row(label, str(f.points), f"{f.factor:.4f}", note)
    console.print(factors)
    errors = Table(title="|error| of peak allocated")
    for col in ("", "median", "worst"):
        errors.add_column(col, justify="right")
    for label, s in (("before", before), ("after", after)):
        errors.add_row(label, f"{s['median_abs_error']:.2%}", f"{s['worst_abs_error']:.2%}")
    console.print(errors)
    for env in cal.environments:
        console.print(f"environment: {env.label()}", highlight=False)
    console.print(f"wrote {out}", highlight=False)


def run(args: argparse.Namespace) -> int:
    """Fit, write, report. Returns 0; bad input raises InputError (exit 2 in memplan.cli)."""
    from .. import __version__
    from ..outputs import check_file
    from .files import points_of, read_rows, write_calibration
    from .fit import fit

    check_file(args.out, "--out")  # a device, FIFO or folder there is refused before any work
    points, envs = points_of(read_rows(args.rows))
    created_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    cal = fit(points, envs, created_at=created_at, memplan_version=__version__)
    write_calibration(cal, args.out)
    before, after = summaries(cal)
    if args.json:
        dumped = cal.model_dump(mode="json", exclude={"points"})
        sys.stdout.write(json.dumps({"out": args.out, **dumped, "before": before, "after": after}, indent=2) + "\n")
    else:
        _render(cal, args.out, before, after)
    return 0
