"""Confirming a plan (memplan.plan.confirm): the shown rows carry the exact figures, whatever the screen said.
The screen and the "exact" estimator are both FAKES here (test_plan_fake), scaled against each other."""

from __future__ import annotations

from test_plan_fake import fake_quick_peak
from test_plan_search import space

from memplan.plan.confirm import CONFIRM_LIMIT, SCREEN_BAND
from memplan.plan.search import search

TOP = 5


def _scaled(factor):
    def peak(job):
        p = fake_quick_peak(job)
        return p._replace(device_total_bytes=int(p.device_total_bytes * factor))
    return peak


def _shown(result):
    return result.candidates[:TOP]


def test_shown_rows_carry_the_exact_figures_when_the_screen_is_optimistic():
    sp_ = space(model="llama-3.2-1b", target_gib=20)
    exact = _scaled(1.3)
    result = search(sp_, fake_quick_peak, top=TOP, exact_fn=exact)
    shown = _shown(result)
    assert shown and all(c.confirmed for c in shown)
    for c in shown:
        assert c.device_total_bytes == exact(c.job).device_total_bytes <= sp_.target_bytes
    # a screened fit the exact figure refuses is reported as a miss with the exact figure
    refused = [c for c in result.closest if c.confirmed]
    assert refused and all(c.device_total_bytes == exact(c.job).device_total_bytes > sp_.target_bytes
                           for c in refused)
    assert result.confirmed >= len(shown) + len(refused) - len([c for c in refused if c.same_as_attention])


def test_a_screened_miss_within_the_band_can_be_confirmed():
    sp_ = space(model="llama-3.2-1b", target_gib=20)
    exact = _scaled(0.8)
    result = search(sp_, fake_quick_peak, top=TOP, exact_fn=exact)
    rescued = [c for c in _shown(result) if fake_quick_peak(c.job).device_total_bytes > sp_.target_bytes]
    assert rescued, "the pessimistic screen's maybes should include fits"
    assert all(fake_quick_peak(c.job).device_total_bytes <= SCREEN_BAND * sp_.target_bytes for c in rescued)


def test_the_confirmation_stops_at_its_limit_and_says_so():
    sp_ = space(model="llama-3.2-1b", target_gib=20)
    result = search(sp_, fake_quick_peak, top=TOP, exact_fn=_scaled(100.0))
    assert result.confirmed == CONFIRM_LIMIT * TOP
    assert not any(c.confirmed for c in result.candidates)
    assert any("limit" in n for n in result.notes)


def test_without_an_exact_estimator_the_given_one_is_the_estimate():
    sp_ = space(model="llama-3.2-1b", target_gib=20)
    result = search(sp_, fake_quick_peak, top=TOP)
    assert result.confirmed == 0 and all(c.confirmed for c in result.candidates)


def test_plan_for_an_8b_model_answers_with_confirmed_rows(capsys):
    """issue 18: `memplan plan --model llama-3-8b --gpu h100-80g` answers with rows (its confirmations meet
    gradient accumulation of 128+ micro-steps: estimator/fold.py folds any cycle of the allocator's state)."""
    import json

    from memplan.cli import main

    assert main(["plan", "--model", "llama-3-8b", "--gpu", "h100-80g", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["candidates"]
    assert rows and all(r["fits"] and r["confirmed"] for r in rows)
    assert all(r["device_total_bytes"] <= out["assumptions"]["target_bytes"] for r in rows)
    assert {r["grad_accum"] * r["micro_batch"] * r["dp"] for r in rows} == {out["assumptions"]["global_batch"]}
