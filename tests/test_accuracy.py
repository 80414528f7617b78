"""The measured matrix: every committed verify row's peak allocated against the estimate.

Rows come from real GPU runs (benchmarks/accuracy/rows*.jsonl, each with its environment and command).
The bar (issue 2/3): median |error| <= 2 %, worst <= 5 %, over the whole matrix. Rows drawn by
memplan.verify.sample carry a split ("fit" / "check", issue 13); the table reports each split and each loop
apart (`python -m memplan.accuracy --split check` prints the held-out split alone).
"""

import json
from pathlib import Path

import pytest

from memplan.accuracy import (
    HAND_WRITTEN,
    Comparison,
    by_group,
    compare_rows,
    iter_rows,
    main,
    select,
    summary,
    table_lines,
)

ROWS = Path(__file__).resolve().parent.parent / "benchmarks" / "accuracy"
MEDIAN_BAR, WORST_BAR, MIN_ROWS = 0.02, 0.05, 40


def test_measured_matrix_within_bars(capsys):
    comparisons = compare_rows(iter_rows(ROWS))
    with capsys.disabled():
        print("\n" + "\n".join(table_lines(comparisons)))
    median, worst = summary(comparisons)
    assert len(comparisons) >= MIN_ROWS, f"only {len(comparisons)} measured points"
    assert median <= MEDIAN_BAR, f"median |error| {median:.2%} > {MEDIAN_BAR:.0%}"
    assert worst <= WORST_BAR, f"worst |error| {worst:.2%} > {WORST_BAR:.0%}"
    # every point is reported under exactly one split and one loop
    for key in ("split", "loop"):
        assert sum(n for n, _, _ in by_group(comparisons, key).values()) == len(comparisons)


def _cmp(name, measured, predicted, split, loop):
    return Comparison(name, measured, predicted, None, "x", split=split, loop=loop)


def test_splits_and_loops_are_summarised_apart():
    # worked by hand: fit errors +10 %, -20 %; check errors +1 %, +3 %, -2 %
    cs = [_cmp("a", 100, 110, "fit", "outputs"), _cmp("b", 100, 80, "fit", "loss"),
          _cmp("c", 100, 101, "check", "outputs"), _cmp("d", 100, 103, "check", "hf-trainer"),
          _cmp("e", 100, 98, "check", "outputs"), _cmp("f", 100, 100, HAND_WRITTEN, "loss")]
    groups = by_group(cs, "split")
    assert groups["fit"] == (2, pytest.approx(0.15), pytest.approx(0.20))
    assert groups["check"] == (3, pytest.approx(0.02), pytest.approx(0.03))
    assert groups[HAND_WRITTEN] == (1, 0.0, 0.0)
    loops = by_group(cs, "loop")
    assert loops["outputs"] == (3, pytest.approx(0.02), pytest.approx(0.10))
    assert [c.name for c in select(cs, split="check", loop="outputs")] == ["c", "e"]
    text = "\n".join(table_lines(select(cs, split="check")))
    assert "split check: 3 points, median |error| 2.00%, worst 3.00%" in text and "split fit" not in text


def test_split_of_a_row_comes_from_the_row(tmp_path, capsys):
    rows = [json.loads(x) for x in (ROWS / "rows-h200-2.jsonl").read_text().splitlines()[:2]]
    rows[0]["split"], rows[1]["split"] = "fit", "check"
    path = tmp_path / "rows-sampled.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cs = compare_rows(iter_rows(path))
    assert sorted(c.split for c in cs) == ["check", "fit"]
    assert main(["--split", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert rows[1]["name"] in out and rows[0]["name"] not in out and "split check: 1 points" in out
    assert main([str(tmp_path / "missing.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memplan: error: paths:")
