"""The measured matrix: every committed verify row's peak allocated against the estimate.

Rows come from real GPU runs (benchmarks/accuracy/rows*.jsonl, each with its environment and command).
The bars (the brief): peak allocated median |error| <= 1 %, worst <= 3 %; peak reserved median <= 5 %, worst
<= 10 %, never more than 3 % under; held on the rows the model may be studied on and, apart, on the check split. Rows drawn by
memplan.verify.sample carry a split ("fit" / "check", issue 13); the table reports each split and each loop
apart (`python -m memplan.accuracy --split check` prints the held-out split alone).
"""

import json
from pathlib import Path

import pytest

from memplan.accuracy import (
    HAND_WRITTEN,
    LEDGER,
    PHASES,
    Comparison,
    allocator_retried,
    by_group,
    compare_rows,
    false_fits,
    iter_rows,
    main,
    reserved_summary,
    select,
    summary,
    table_lines,
)

ROWS = Path(__file__).resolve().parent.parent / "benchmarks" / "accuracy"
#: the brief's bars: peak allocated against torch.cuda.max_memory_allocated(), peak reserved against
#: max_memory_reserved() (never more than 3 % under: a false "fits")
ALLOC_MEDIAN, ALLOC_WORST = 0.01, 0.03
RESERVED_MEDIAN, RESERVED_WORST, RESERVED_UNDER = 0.05, 0.10, 0.03


@pytest.fixture(scope="module")
def comparisons():
    return compare_rows(iter_rows(ROWS))


#: the parts the bars are held on: the rows the model may be studied on (hand-written matrices and the sampled
#: fit split), by the model that predicts them, and the sampled check split it never was
PARTS = {
    "tuned-ledger": lambda c: c.split != "check" and c.model == LEDGER,
    "tuned-phases": lambda c: c.split != "check" and c.model == PHASES,
    "check": lambda c: c.split == "check",
}
#: (the phase lists' share shrinks as jobs move to the ledger: 18 studied points after Ulysses did, 4 after
#: pipeline parallelism and ZeRO-2's offloaded fp32 accumulation did — the hand-written AutoTP rows)
MIN_POINTS = {"tuned-ledger": 40, "tuned-phases": 4, "check": 20}
#: (part, bar) → why the bar does not hold on what is committed. Strict: a bar that starts to hold fails here
#: until its entry goes. Each names the cause found, not a number (the table prints the numbers).
_RESERVED_LEDGER = ("under: ZeRO-3 rows whose frees complete later than the timing replay has them (Phi-3 at one "
                    "rank with parameter offload, its traced run, though its gathers' copies now run on a copy "
                    "engine; a Mistral-7B 8-rank row at 16K); over: shared-GPU rows, judged only above, where the "
                    "replay times the job as if alone, and 405B-width rows measured alone on the H200 machine, whose "
                    "real GPU kept up better than the replay has it: their 1.7 GB grads, reduced in place and freed "
                    "with record_stream as DeepSpeed does, stay pending there longer than they did (issue 12)")
_PHASES = ("jobs outside the ledger (tp; untested there: the MoE auxiliary loss, Ulysses on GPT-2 / NeoX or under the "
           "Trainer): the phase lists do not simulate the caching allocator, so their reserved figure is a rule of thumb")
_CHECK = ("the held-out split is judged, never studied: under, ZeRO-3 rows run alone whose frees complete later "
          "than the timing replay has them though its lag matches the measured one in median and maximum "
          "(an offloaded 176B-width job, a Ulysses sp 8 row at 32K); over, a ZeRO-0 pipeline row, a 405B-width "
          "row measured alone on the H200 machine (its in-place reduced grads' deferred frees pending longer in "
          "the replay than on that GPU) and shared-GPU rows, judged only above, where the replay times the job "
          "as if alone (issue 12; benchmarks/timing/README.md, sessions 21 and 23)")
KNOWN_GAPS: dict[tuple[str, str], str] = {
    ("tuned-ledger", "reserved worst"): _RESERVED_LEDGER,
    ("tuned-ledger", "reserved under"): _RESERVED_LEDGER,
    ("tuned-phases", "reserved median"): _PHASES,
    ("tuned-phases", "reserved worst"): _PHASES,
    ("tuned-phases", "reserved under"): _PHASES,
    **{("check", bar): _CHECK for bar in ("reserved worst", "reserved under")},
}


def _bar_values(points):
    median, worst = summary(points)
    n, rmedian, rworst, under = reserved_summary(points)
    judged = [p for p in points
              if not ((p.reserved_lower_bound or p.reserved_upper_bound) and p.reserved_error is None)]
    assert n == len(judged), "every measured point records its reserved peak"
    return {"allocated median": (median, ALLOC_MEDIAN), "allocated worst": (worst, ALLOC_WORST),
            "reserved median": (rmedian, RESERVED_MEDIAN), "reserved worst": (rworst, RESERVED_WORST),
            "reserved under": (under, RESERVED_UNDER)}


BARS = ("allocated median", "allocated worst", "reserved median", "reserved worst", "reserved under")


def _cases():
    for part in PARTS:
        for bar in BARS:
            gap = KNOWN_GAPS.get((part, bar))
            marks = [pytest.mark.xfail(strict=True, reason=gap)] if gap else []
            yield pytest.param(part, bar, marks=marks, id=f"{part}-{bar.replace(' ', '-')}")


@pytest.mark.parametrize(("part", "bar"), list(_cases()))
def test_measured_matrix_within_bars(part, bar, comparisons):
    """The brief's bars, one at a time, on each part (see PARTS and KNOWN_GAPS)."""
    points = [c for c in comparisons if PARTS[part](c)]
    assert len(points) >= MIN_POINTS[part], f"only {len(points)} measured points"
    value, limit = _bar_values(points)[bar]
    assert value <= limit, f"{part}: {bar} |error| {value:.2%} > {limit:.0%}"


#: the loops issue (11) and the LoRA issue (14) hold peak allocated to the same bars on each loop and on the adapter
#: jobs, every split together (each has its own points: the loop a row ran, whether it trained adapters)
SLICES = {
    **{f"loop-{loop}": (lambda c, loop=loop: c.loop == loop) for loop in ("outputs", "loss", "hf-trainer")},
    "lora": lambda c: c.adapters,
}


@pytest.mark.parametrize("part", sorted(SLICES))
def test_allocated_within_bars_on_each_loop_and_on_adapters(part, comparisons):
    points = [c for c in comparisons if SLICES[part](c)]
    assert len(points) >= 15, f"only {len(points)} measured points"
    median, worst = summary(points)
    assert median <= ALLOC_MEDIAN and worst <= ALLOC_WORST, f"{part}: median {median:.2%}, worst {worst:.2%}"


def test_the_parts_cover_every_point_once(comparisons, capsys):
    with capsys.disabled():  # the table of the studied rows (the check split's stays out of the log)
        print("\n" + "\n".join(table_lines([c for c in comparisons if c.split != "check"])))
    assert all(sum(1 for f in PARTS.values() if f(c)) == 1 for c in comparisons)
    for key in ("split", "loop", "model"):  # every point is reported under exactly one split, loop and model
        assert sum(n for n, _, _ in by_group(comparisons, key).values()) == len(comparisons)


@pytest.mark.xfail(strict=True, reason=KNOWN_GAPS.get(("check", "false fits"), "no gap"),
                   condition=("check", "false fits") in KNOWN_GAPS)
def test_no_measured_oom_is_called_a_fit():
    assert false_fits(iter_rows(ROWS)) == []


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


def test_a_reserved_peak_measured_through_allocator_retries_judges_only_an_under():
    """A row whose allocator took the retry path measured a lower bound of reserved: a prediction above it is not
    judged (None), one below it is a real under."""
    row = {"phases": [{"name": "init", "stats": {"num_alloc_retries": 0}},
                      {"name": "step0.micro0.backward", "stats": {"num_alloc_retries": 2}}]}
    assert allocator_retried(row) and not allocator_retried({"phases": [{"stats": {"num_alloc_retries": 0}}]})
    assert not allocator_retried({})
    base = {"name": "j", "measured_bytes": 100, "predicted_bytes": 100, "measured_phase": None,
            "predicted_phase": "p", "measured_reserved_bytes": 200}
    assert Comparison(**base, predicted_reserved_bytes=220, reserved_lower_bound=True).reserved_error is None
    assert Comparison(**base, predicted_reserved_bytes=180, reserved_lower_bound=True).reserved_error == -0.1
    assert Comparison(**base, predicted_reserved_bytes=220).reserved_error == pytest.approx(0.1)


def test_zero3_reserved_measured_alone_within_the_median_bar(comparisons):
    """ZeRO-3's reserved figure times its record_stream frees on the row's GPU (estimator.gpu_time): held, both
    ways, on the ZeRO-3 points nothing shared the GPU with (every split: benchmarks/accuracy/README.md lists
    which were studied); the shared ones judge only an over-prediction (Comparison.reserved_upper_bound)."""
    alone = [c for c in comparisons if c.predicted_reserved_behind_bytes is not None and not c.reserved_upper_bound]
    assert len(alone) >= 40, f"only {len(alone)} ZeRO-3 points measured alone"
    n, median, _worst, _under = reserved_summary(alone)
    assert n == len(alone) and median <= RESERVED_MEDIAN, f"median {median:.2%}"
    shared = [c for c in comparisons if c.reserved_upper_bound]
    assert all(c.reserved_error is None or c.reserved_error >= 0 for c in shared)


def test_the_gpu_behind_bound_is_never_more_than_the_bar_under_a_measured_zero3_reserved(comparisons):
    """The GPU-behind bound under ZeRO-3 (estimator.gpu_behind: DeepSpeed's record_stream frees held to the next
    synchronization) on every measured point that has one, every split, shared GPU or not: a bound, so it may sit
    above the measurement (the table prints by how much) but never more than the reserved bar's 3 % under it."""
    points = [c for c in comparisons if c.behind_error is not None]
    assert len(points) >= 400, f"only {len(points)} ZeRO-3 points with a GPU-behind bound"
    assert all(c.predicted_reserved_behind_bytes >= c.predicted_reserved_bytes for c in points)
    worst = min(points, key=lambda c: c.behind_error)
    assert worst.behind_error >= -RESERVED_UNDER, (worst.name, f"{worst.behind_error:+.2%}")


def test_a_shared_gpu_zero3_reserved_judges_only_an_over():
    """A ZeRO-3 row measured beside other processes fell further behind than alone: its reserved is an upper
    bound, so a prediction under it is not judged (None) and one over it is."""
    base = {"name": "j", "measured_bytes": 100, "predicted_bytes": 100, "measured_phase": None,
            "predicted_phase": "p", "measured_reserved_bytes": 200, "reserved_upper_bound": True}
    assert Comparison(**base, predicted_reserved_bytes=180).reserved_error is None
    assert Comparison(**base, predicted_reserved_bytes=220).reserved_error == pytest.approx(0.1)
    assert Comparison(**{**base, "reserved_upper_bound": False}, predicted_reserved_bytes=180).reserved_error == -0.1
