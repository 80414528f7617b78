"""The batch (memplan.verify.batch) running sampled lines: the sample keys it copies into rows, what it skips on a
node or checkout that cannot run a line, the host budget, and NVMe lines where async_io does not load (version-1
lines: version 2 draws no NVMe offload, the batch's skip stays for the files that have them)."""

import contextlib
import json
import os
import shutil
from pathlib import Path

import pytest

from memplan.presets import load_model
from memplan.verify import batch, sample

ROOT = Path(__file__).resolve().parent.parent
SEED1 = ROOT / "benchmarks" / "accuracy" / "sampled" / "seed1.jsonl"


@contextlib.contextmanager
def _cwd(path):
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def _flags(line):
    a = line["args"]
    return {a[i]: a[i + 1] for i in range(len(a) - 1) if a[i].startswith("--") and not a[i + 1].startswith("--")}


@pytest.fixture(scope="module")
def seed2(tmp_path_factory):
    """A fresh seed-2 draw of 30 lines in a checkout of its own (the Trainer's examples copied)."""
    folder = tmp_path_factory.mktemp("seed2")
    shutil.copytree(ROOT / "examples" / "hf-trainer", folder / "examples" / "hf-trainer")
    with _cwd(folder):
        assert sample.main(["--seed", "2", "--count", "30", "--out", "sampled/s.jsonl"]) == 0
        lines = [json.loads(x) for x in Path("sampled/s.jsonl").read_text().splitlines()]
    return folder, lines


def test_batch_copies_sample_keys_and_skips_what_this_node_cannot_run(tmp_path, seed2, monkeypatch, capsys):
    folder, lines = seed2
    from memplan.verify import runner

    seen = []

    def fake_measure(job, *, name, **opts):
        seen.append(name)
        return {"name": name, "status": "ok", "error": None, "job": job.model_dump(mode="json"), "wall_s": 1.0,
                "peak_allocated_bytes": 1, "comparison": [], "predicted": {}}

    monkeypatch.setattr(runner, "measure_job", fake_measure)
    monkeypatch.setattr(batch.report, "write_report", lambda row, out: None)
    plain = next(x for x in lines if "requires" not in x and "needs_gpus" not in x)
    tp = next(x for x in lines if x.get("needs_gpus", 1) > 1)
    hf = {**next(x for x in lines if "requires" in x), "requires": ["no/such/template.json"]}
    matrix = tmp_path / "m.jsonl"
    matrix.write_text("".join(json.dumps(x) + "\n" for x in (plain, tp, hf)))
    out = tmp_path / "out"
    with _cwd(folder):
        assert batch.main([str(matrix), "--out", str(out), "--node-gpus", "1", "--no-prebuild", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert f"{tp['name']}: skipped: needs {tp['needs_gpus']} GPUs" in printed
    assert f"{hf['name']}: skipped: needs no/such/template.json" in printed
    assert seen == [plain["name"]]
    row = json.loads((out / "rows.jsonl").read_text())
    assert {k: row[k] for k in batch.SAMPLE_KEYS if k in plain} == {k: plain[k] for k in batch.SAMPLE_KEYS
                                                                   if k in plain}
    assert row["split"] == plain["split"] and row["meta"]["regime"] == plain["meta"]["regime"]


def test_batch_keeps_rank0_host_memory_within_its_budget(tmp_path, monkeypatch):
    import argparse
    import threading
    import time

    from memplan.specs import Job
    from memplan.units import GiB
    from memplan.verify import runner

    running, peak = set(), [0]
    lock = threading.Lock()

    def fake_measure(job, *, name, **opts):
        with lock:
            running.add(name)
            peak[0] = max(peak[0], len(running))
        time.sleep(0.05)
        with lock:
            running.discard(name)
        return {"name": name, "status": "ok", "error": None, "wall_s": 0.1}

    monkeypatch.setattr(runner, "measure_job", fake_measure)
    monkeypatch.setattr(batch.report, "write_report", lambda row, out: None)
    job = Job(model=load_model("llama-3.2-1b"), training={"seq_len": 128})
    items = [batch.Item(name=n, args=[], job=job, opts={"timeout_s": 60.0, "steps": 1, "device": "cpu"},
                        need_bytes=GiB, host_bytes=60 * GiB) for n in "abc"]
    args = argparse.Namespace(out=str(tmp_path), workers=8, gpu_budget_gib=130.0, host_budget_gib=100.0,
                              deadline=None, steps=None, device=None)
    batch.Scheduler(items, args).run()
    assert peak[0] == 1  # 60 + 60 GiB of pinned host memory would pass 100 GiB


def test_batch_skips_nvme_lines_when_async_io_does_not_load(tmp_path, monkeypatch, capsys):
    from memplan.verify import runner

    folder, lines = ROOT, [json.loads(x) for x in SEED1.read_text().splitlines()]  # version 1 drew NVMe lines
    nvme = next(x for x in lines if _flags(x).get("--offload-param") == "nvme"
                or _flags(x).get("--offload-optimizer") == "nvme")
    plain = next(x for x in lines if "requires" not in x and "needs_gpus" not in x and "nvme" not in x["args"])
    seen = []
    monkeypatch.setattr(runner, "measure_job", lambda job, *, name, **o: seen.append(name) or {
        "name": name, "status": "ok", "error": None, "wall_s": 0.1})
    monkeypatch.setattr(batch.report, "write_report", lambda row, out: None)
    monkeypatch.setattr(batch, "prebuild_ops", lambda items, device: {"FusedAdamBuilder": "ok",
                                                                      "AsyncIOBuilder": "RuntimeError: no libaio"})
    matrix = tmp_path / "m.jsonl"
    matrix.write_text("".join(json.dumps(x) + "\n" for x in (nvme, plain)))
    with _cwd(folder):
        assert batch.main([str(matrix), "--out", str(tmp_path / "o"), "--node-gpus", "1", "--device", "cpu"]) == 0
    assert f"{nvme['name']}: skipped: NVMe offload needs DeepSpeed's async_io op" in capsys.readouterr().out
    assert seen == [plain["name"]]
