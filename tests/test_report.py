"""memplan report: pages and plots for a small job, atomic writes, offline HTML, bad input → exit 2, one line."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from memplan.errors import InputError

pytest.importorskip("matplotlib")

from memplan.cli import main
from memplan.report import write
from memplan.report.doc import Figure, Heading, Para, Table, to_html, to_markdown

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--model", "qwen3-0.6b", "--seq", "2048", "--gpus", "8", "--zero", "3", "--gpu", "a100-80g",
         "--target", "24GiB"]
FIGURES = ("components", "seq-sp", "zero-offload", "timeline")


@pytest.fixture(scope="module")
def small_report(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report")
    assert main(["report", *SMALL, "--out", str(out), "--name", "small"]) == 0
    return out


def test_small_job_writes_markdown_html_and_every_plot(small_report):
    md = (small_report / "small.md").read_text()
    for fig in FIGURES:
        for ext, magic in (("png", b"\x89PNG"), ("svg", b"<?xml")):
            data = (small_report / "small" / f"{fig}.{ext}").read_bytes()
            assert data.startswith(magic) and len(data) > 2000, (fig, ext)
        assert f"(small/{fig}.png)" in md
    assert "| peak allocated" in md and "qwen3-0.6b" in md


def test_html_is_self_contained(small_report):
    page = (small_report / "small.html").read_text()
    assert page.count("data:image/svg+xml;base64,") == len(FIGURES)
    assert not re.search(r"https?://", page)
    assert not re.search(r"""(src|href)\s*=\s*["'](?!data:|#|[\w./-]+$)""", page)
    assert "<style>" in page and "<link" not in page and "<script" not in page


def test_no_staging_folder_left(small_report):
    assert not [p for p in small_report.iterdir() if p.name.startswith(".memplan-report-")]


@pytest.mark.parametrize("stage", ["staging", "moving"])
def test_a_failed_write_leaves_nothing_half_written(tmp_path, monkeypatch, stage):
    """Everything is staged before anything is moved, and a move that fails puts back what was moved: a
    failure at either stage leaves the folder as it was (memplan.outputs.write_files)."""
    from memplan import outputs

    (tmp_path / "page.md").write_text("old page\n")
    calls = {"n": 0}
    real_write, real_replace = outputs._write_new, os.replace

    def failing(real):
        def call(*args):
            calls["n"] += 1
            if calls["n"] == 3:
                raise OSError(28, "No space left on device")
            return real(*args)
        return call

    if stage == "staging":
        monkeypatch.setattr(outputs, "_write_new", failing(real_write))
    else:
        monkeypatch.setattr(outputs.os, "replace", failing(real_replace))
    files = {"page/a.png": b"a", "page/a.svg": b"b", "page.md": b"new page\n", "page.html": b"<html>"}
    with pytest.raises(InputError, match="nothing was written"):
        write.write_atomically(str(tmp_path), files)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["page.md"]
    assert (tmp_path / "page.md").read_text() == "old page\n"


def test_blocks_render_to_both_formats():
    """A toy page worked by hand: the same blocks in Markdown and escaped HTML; external links are dropped."""
    blocks = [Heading("T <1>", 1), Para("see `x` and **y** at [z](https://example.com) or [w](w.md)"),
              Table(("a", "b|c"), (("1", "2"),), align_right=(1,)), Figure("cap", "d/f", {"png": b"P", "svg": b"S"})]
    md = to_markdown(blocks)
    assert md.startswith("# T <1>\n") and "| a | b\\|c |\n| --- | ---: |\n| 1 | 2 |" in md
    assert "![cap](d/f.png)" in md
    page = to_html(blocks, "t")
    assert "<h1>T &lt;1&gt;</h1>" in page and "<code>x</code>" in page and "<strong>y</strong>" in page
    assert '<a href="w.md">w</a>' in page and "example.com" not in page
    assert '<td class=num>2</td>' in page and "data:image/svg+xml;base64,Uw==" in page


def test_verify_report_is_overlaid(tmp_path):
    rows = ROOT / "benchmarks" / "accuracy" / "rows-h200x2-3-emulated.jsonl"
    name = next(json.loads(line)["name"] for line in rows.read_text().splitlines()
                if line.strip() and json.loads(line).get("timeline") and json.loads(line)["status"] == "ok")
    assert main(["report", "--verify", str(rows), "--verify-name", name, "--out", str(tmp_path),
                 "--name", "v"]) == 0
    md = (tmp_path / "v.md").read_text()
    assert f"verify report `{name}`" in md and "| backward phase peak |" in md


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("memplan: error: ") and "Traceback" not in err
    return err


@pytest.mark.parametrize("argv, field", [
    (["--verify", "/nonexistent/row.json"], "--verify"),
    (["--seed", "--model", "176b"], "--seed"),
    (["--name", "../escape"], "--name"),
    (["--seq", "0"], "--seq"),
    (["--target", "24"], "--target"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, argv, field):
    err = _one_line_error(capsys, ["report", *argv, "--out", str(tmp_path)])
    assert field in err


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"phases": "x"}', '{"phases": [{"name": "a"}]}',
                                     '{"name": "r", "phases": [{"name": "s.forward", "peak_allocated_bytes": -1}]}'])
def test_bad_verify_report_is_one_line(capsys, tmp_path, content):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    assert "--verify" in _one_line_error(capsys, ["report", "--verify", str(bad), "--out", str(tmp_path / "o")])


def test_out_that_is_a_file_is_refused(capsys, tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    assert "--out" in _one_line_error(capsys, ["report", *SMALL, "--out", str(target)])


def test_estimate_report_flag_writes_the_same_page(tmp_path, capsys):
    assert main(["estimate", *SMALL, "--json", "--report", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["peak_allocated_bytes"] > 0, "stdout stays one JSON object"
    pages = sorted(p.name for p in tmp_path.glob("*.md"))
    assert pages == ["qwen3-0.6b-seq2048-8gpu.md"] and "wrote " in captured.err
