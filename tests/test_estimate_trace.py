"""estimate --trace FILE: the predicted ledger as Chrome trace-event JSON (issue 12, "Look at it")."""

import json

from memplan.cli import main
from memplan.estimator import LEDGER_STEPS

JOB = ["estimate", "--model", "llama-3.2-1b", "--seq", "1024", "--gpus", "8", "--zero", "2", "--sp", "1",
       "--dtype", "bf16", "--offload-optimizer", "none", "--checkpointing", "none", "--attention", "flash"]


def test_the_trace_holds_the_estimates_peaks(tmp_path, capsys):
    path = tmp_path / "ledger.json"
    assert main([*JOB, "--trace", str(path), "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    trace = json.loads(path.read_text())
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    reserved = max(e["args"]["bytes"] for e in counters if e["name"] == "reserved")
    allocated = max(e["args"]["bytes"] for e in counters if e["name"] == "allocated")
    assert reserved == est["peak_reserved_bytes"]  # ZeRO-2: the training phases hold the reserved peak
    assert allocated <= est["peak_allocated_bytes"]  # 512-rounded requests; torch's counter adds unsplit slack
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert slices and {e["args"]["component"] for e in slices} >= {"params_16bit", "activations"}
    assert trace["otherData"]["optimizer_steps"] == LEDGER_STEPS  # the steps verify measures


def test_a_job_without_a_ledger_is_refused_and_nothing_written(tmp_path, capsys):
    path = tmp_path / "ledger.json"
    tensor_parallel = [*JOB, "--tp", "2"]
    assert main([*tensor_parallel, "--trace", str(path)]) == 2  # AutoTP: phase lists only
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memplan: error: --trace:")
    assert not path.exists()


def test_a_folder_is_not_a_trace_file(tmp_path, capsys):
    assert main([*JOB, "--trace", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memplan: error: --trace")


def test_a_pipeline_job_traces_its_most_loaded_stage(tmp_path):
    path = tmp_path / "ledger.json"
    pipeline = [*JOB[:JOB.index("--zero")], "--zero", "1", *JOB[JOB.index("--zero") + 2:], "--pp", "2",
                "--grad-accum", "2"]
    assert main([*pipeline, "--trace", str(path)]) == 0
    trace = json.loads(path.read_text())
    assert trace["otherData"]["pipeline_stage"] in (0, 1)
    assert any(e.get("name") == "reserved" for e in trace["traceEvents"])
