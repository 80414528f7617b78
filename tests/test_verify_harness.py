"""The verify harness without a GPU or a worker: extrapolation, comparison, reports, the batch scheduler."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from memplan.specs import Job, Layout, ModelSpec, TrainingSpec, ZeroSpec
from memplan.units import GiB
from memplan.verify import batch, compare, report, runner, worker

TINY = ModelSpec(
    name="tiny", family="llama", hidden_size=64, num_layers=8, num_heads=4, num_kv_heads=4, head_dim=16,
    intermediate_size=128, vocab_size=256, max_position_embeddings=512,
)


def job(**training) -> Job:
    layout = training.pop("layout", Layout(world=4))
    return Job(model=TINY, training=TrainingSpec(seq_len=128, **training), layout=layout)


def test_extrapolation_is_linear_in_layers():
    # 2 layers: 10 GiB, 4 layers: 14 GiB → 2 GiB per layer; 8 layers: 10 + 6·2 = 22 GiB
    assert runner.extrapolate(10 * GiB, 14 * GiB, 2, 8) == 22 * GiB
    assert runner.extrapolate(10, 10, 3, 96) == 10  # depth-independent peak stays put
    assert runner.extrapolate(None, 5, 1, 4) is None


def _phase(name, peak, reserved=None, end=0):
    return {"name": name, "peak_allocated_bytes": peak, "peak_reserved_bytes": reserved or peak,
            "allocated_end_bytes": end}


def test_extrapolated_row_extrapolates_every_phase():
    low = {"status": "ok", "peak_allocated_bytes": 100, "peak_reserved_bytes": 120, "init_peak_allocated_bytes": 50,
           "phases": [_phase("init", 50), _phase("step0.micro0.forward", 80), _phase("step0.micro0.backward", 100)]}
    high = {"status": "ok", "peak_allocated_bytes": 130, "peak_reserved_bytes": 150, "init_peak_allocated_bytes": 70,
            "phases": [_phase("init", 70), _phase("step0.micro0.forward", 90), _phase("step0.micro0.backward", 130)]}
    out = runner._extrapolated_row(low, high, k=1, full=4)  # P(4) = P(1) + 3·(P(2) − P(1))
    assert out["peak_allocated_bytes"] == 100 + 3 * 30
    assert out["init_peak_allocated_bytes"] == 50 + 3 * 20
    assert [p["peak_allocated_bytes"] for p in out["phases"]] == [50 + 60, 80 + 30, 100 + 90]
    assert out["peak_phase"] == "step0.micro0.backward"


def test_layers_must_leave_two_depths():
    with pytest.raises(ValueError, match="--layers"):
        runner._depths(job(), 5)  # 2·5 > 8 layers
    assert runner._depths(job(), 4) == [4, 8]


def test_error_pct_and_comparison():
    assert compare.error_pct(102, 100) == 2.0
    assert compare.error_pct(95, 100) == -5.0
    assert compare.error_pct(1, 0) is None
    predicted = {"peak_allocated_bytes": 110, "peak_reserved_bytes": 130,
                 "timeline": [{"name": "forward, loss", "allocated_bytes": 90},
                              {"name": "backward, layer 0", "allocated_bytes": 110},
                              {"name": "optimizer step", "allocated_bytes": 70}]}
    row = {"peak_allocated_bytes": 100, "peak_reserved_bytes": 130,
           "phases": [_phase("init", 500), _phase("step0.micro0.forward", 90), _phase("step0.micro0.backward", 100),
                      _phase("step0.micro0.step", 80), _phase("step1.micro0.backward", 95)]}
    rows = {c["what"]: c for c in compare.comparison(predicted, row)}
    assert rows["peak allocated"]["error_pct"] == 10.0
    assert rows["peak reserved"]["error_pct"] == 0.0
    assert rows["backward phase peak"]["measured_bytes"] == 100  # max over steps, init excluded
    assert rows["step phase peak"]["error_pct"] == -12.5


def test_unsupported_jobs_are_named():
    with pytest.raises(worker.Unsupported, match="selective"):
        worker.check_supported(job(checkpointing="selective"))
    gpt2 = job().model_copy(update={"model": TINY.model_copy(update={"family": "gpt2"}),
                                    "layout": Layout(world=4, sp=2)})
    with pytest.raises(worker.Unsupported, match="gpt2"):
        worker.check_supported(gpt2)
    worker.check_supported(job(zero=ZeroSpec(stage=3)))


def _row(name="r", status="ok", peak=3 * GiB):
    j = job()
    return {"schema": 1, "name": name, "job": j.model_dump(mode="json"), "command": ["memplan", "verify"],
            "mode": "emulated", "device": "cuda", "steps": 3, "status": status, "error": None,
            "peak_allocated_bytes": peak, "peak_reserved_bytes": peak + GiB, "init_peak_allocated_bytes": GiB,
            "phases": [_phase("init", GiB), _phase("step0.micro0.forward", peak)], "env": {"gpu": "H200"},
            "predicted": {"peak_allocated_bytes": 3 * GiB}, "comparison": [
                {"what": "peak allocated", "predicted_bytes": 3 * GiB, "measured_bytes": peak,
                 "error_pct": compare.error_pct(3 * GiB, peak)}], "wall_s": 12.0}


def test_report_files_are_written_atomically(tmp_path):
    json_path, md_path = report.write_report(_row(peak=4 * GiB), str(tmp_path))
    assert json.loads(Path(json_path).read_text())["peak_allocated_bytes"] == 4 * GiB
    md = Path(md_path).read_text()
    assert "| peak allocated | 3.000 | 4.000 | -25.00% |" in md
    assert "step0.micro0.forward" in md
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    assert "error -25.00%" in report.summary_line(_row(peak=4 * GiB))


def test_command_rejects_bad_layers_with_exit_2(tmp_path, capsys):
    from memplan.cli import main

    assert main(["verify", "--model", "llama-3.2-1b", "--seq", "128", "--gpus", "1", "--sp", "1", "--zero", "0",
                 "--offload-optimizer", "none", "--layers", "40", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--layers" in err[0]


def test_verify_command_imports_no_torch():
    code = ("import sys, memplan.verify.command, memplan.verify.batch, memplan.verify.runner;"
            "print([m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _items(*specs):
    return [batch.Item(name=n, args=[], job=job(), opts={"timeout_s": 60.0, "steps": 1, "device": "cpu"},
                       need_bytes=g * GiB) for n, g in specs]


def test_batch_schedules_within_budget_and_retries_shared_oom_alone(tmp_path, monkeypatch):
    running, peak_concurrency, calls = set(), [0], []

    def fake_measure(j, *, name, **opts):
        running.add(name)
        peak_concurrency[0] = max(peak_concurrency[0], len(running))
        calls.append(name)
        import time
        time.sleep(0.05)
        running.discard(name)
        status = "oom" if name == "b" and calls.count("b") == 1 else "ok"
        return {**_row(name=name, status=status), "error": "measured: OOM in x" if status == "oom" else None}

    monkeypatch.setattr(runner, "measure_job", fake_measure)
    args = argparse.Namespace(out=str(tmp_path), workers=4, gpu_budget_gib=100.0, deadline=None, steps=None,
                              device=None)
    batch.Scheduler(_items(("a", 40), ("b", 40), ("c", 40)), args).run()
    rows = [json.loads(x) for x in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert sorted(r["name"] for r in rows) == ["a", "b", "c"]
    assert all(r["status"] == "ok" for r in rows)
    assert calls.count("b") == 2  # the OOM while sharing was retried, alone
    assert peak_concurrency[0] == 2  # 40 + 40 fit in 100 GiB, a third does not
    b = next(r for r in rows if r["name"] == "b")
    assert b["batch"]["shared_gpu"] is False
    assert batch.done_names(str(tmp_path / "rows.jsonl")) == {"a", "b", "c"}


def test_batch_parses_a_matrix_row_like_the_command(tmp_path):
    item = batch.parse_item({"name": "x", "args": ["--model", "llama-3.2-1b", "--seq", "2048", "--gpus", "8",
                                                   "--sp", "1", "--zero", "2", "--offload-optimizer", "none"]},
                            str(tmp_path))
    assert item.error is None and item.job.training.seq_len == 2048 and item.job.layout.world == 8
    bad = batch.parse_item({"name": "y", "args": ["--model", "no-such-model"]}, str(tmp_path))
    assert bad.error and "model" in bad.error
