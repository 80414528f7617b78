"""The measured matrix: every committed verify row's peak allocated against the estimate.

Rows come from real GPU runs (benchmarks/accuracy/rows*.jsonl, each with its environment and command).
The bar (issue 2/3): median |error| <= 2 %, worst <= 5 %.
"""

from pathlib import Path

from memplan.accuracy import compare_rows, iter_rows, summary
from memplan.units import GiB

ROWS = Path(__file__).resolve().parent.parent / "benchmarks" / "accuracy"
MEDIAN_BAR, WORST_BAR, MIN_ROWS = 0.02, 0.05, 40


def test_measured_matrix_within_bars(capsys):
    comparisons = compare_rows(iter_rows(ROWS))
    lines = [f"{'job':48} {'measured GiB':>12} {'predicted GiB':>13} {'error':>7}  phase (meas / pred)"]
    for c in sorted(comparisons, key=lambda c: abs(c.error), reverse=True):
        lines.append(f"{c.name:48} {c.measured_bytes / GiB:12.3f} {c.predicted_bytes / GiB:13.3f} "
                     f"{c.error:+7.2%}  {c.measured_phase} / {c.predicted_phase}")
    median, worst = summary(comparisons)
    lines.append(f"{len(comparisons)} points: median |error| {median:.2%}, worst {worst:.2%}")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert len(comparisons) >= MIN_ROWS, f"only {len(comparisons)} measured points"
    assert median <= MEDIAN_BAR, f"median |error| {median:.2%} > {MEDIAN_BAR:.0%}"
    assert worst <= WORST_BAR, f"worst |error| {worst:.2%} > {WORST_BAR:.0%}"
