"""The seed report (reports/176b-seq32k-8xa100.md): every claim, the check and plan verdicts, the evidence."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from memplan.report import seed_data
from memplan.report.claims import CLAIM_HEADINGS
from memplan.report.seed import COMMAND, STEM, seed_page
from memplan.report.write import page_files

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("(a) The article's configuration as written", "(b) The article's claims, one by one",
            "(c) What does reach 24 GiB on 8×A100-80GB", "(d) The evidence: a reduced-depth emulated verify on an H200")


@pytest.fixture(scope="module")
def fresh_md() -> str:
    """The seed report regenerated now (from the repository root, as its command says)."""
    import os

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        stem, title, blocks = seed_page("reports")
    finally:
        os.chdir(cwd)
    return page_files(stem, title, blocks)[f"{stem}.md"].decode()


def _committed() -> str:
    path = ROOT / "reports" / f"{STEM}.md"
    if not path.exists():
        pytest.skip("the seed report is not committed yet")
    return path.read_text()


@pytest.mark.parametrize("which", ["fresh", "committed"])
def test_seed_report_has_every_claim_section_and_verdict(which, request):
    md = request.getfixturevalue("fresh_md") if which == "fresh" else _committed()
    assert COMMAND in md.split("## (a)")[0], "the regenerating command is at the top"
    for heading in CLAIM_HEADINGS:
        assert f"### {heading}" in md
    for section in SECTIONS:
        assert f"## {section}" in md
    assert re.search(r"\*\*\d+ errors, \d+ warnings: the launch as written is refused\.\*\*", md)
    assert "nearest valid variant: ZeRO-3, sp 8, fp16, offload optimizer cpu" in md
    assert "full activation checkpointing" in md
    assert "distinct configurations fit" in md or "**None fits**" in md
    assert "Not with Ulysses" in md and "4096 tokens" in md and "per-layer slope" in md


def test_seed_report_figures_match_the_library(fresh_md):
    """The check verdict and the plan rows in the page are the library's own figures."""
    check = seed_data.run_check()
    assert any(f.severity == "error" for f in check.findings)
    errors = sum(f.severity == "error" for f in check.findings)
    assert f"**{errors} errors," in fresh_md
    result, _ = seed_data.run_plan("fp16")
    for c in result.candidates:
        assert f"{c.device_total_bytes / 2**30:,.2f} GiB" in fresh_md


def test_verify_report_is_a_verbatim_copy_of_the_measured_row():
    """reports/verify/ holds the benchmark row unchanged (measured numbers are never edited)."""
    copy = (ROOT / seed_data.VERIFY_ROW).read_text().strip()
    name = json.loads(copy)["name"]
    source = [line for line in (ROOT / seed_data.VERIFY_SOURCE).read_text().splitlines()
              if line.strip() and json.loads(line)["name"] == name]
    assert source == [copy]


def test_evidence_extrapolation_is_the_rows_own():
    """P(96) = P(K) + (96 − K)·slope reproduces the row's extrapolated peak from its two measured depths."""
    ev = seed_data.load_evidence(ROOT / seed_data.VERIFY_ROW)
    k = ev.depths[0].layers
    slope = (ev.depths[1].measured_bytes - ev.depths[0].measured_bytes) / (ev.depths[1].layers - k)
    assert ev.depths[0].measured_bytes + (ev.full_layers - k) * slope == pytest.approx(ev.measured_full_bytes,
                                                                                     rel=1e-9)


def test_committed_seed_report_is_current(fresh_md):
    """The committed page is what its command regenerates today: a model change must come with the report."""
    assert _committed() == fresh_md, f"{STEM}.md is stale: run `{COMMAND}` from the repository root"
