"""The megatron-core harness: the matrix, the prediction, and an end-to-end CPU run of the worker.

The end-to-end test needs megatron-core (pip install megatron-core==0.16.1; skipped without it). On the CPU
there are no memory counters, so it holds the saved-tensor bytes the worker enumerates per layer
(saved_tensors_hooks) to memplan's term lists. Two CPU kernels keep other dtypes than their CUDA twins:
aten's LayerNorm keeps mean and rstd in the input dtype (fp32 on CUDA), and aten native_dropout's mask is in
the input dtype (bool on CUDA, aten/src/ATen/native/cuda/Dropout.cu); the compiled bias-dropout-add keeps a
bool mask on both.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from memplan.megatron import layer_terms, outside_terms, selective_terms
from memplan.megatron.harness import MegatronCase, case_job, predict
from memplan.megatron.shape import resolve
from memplan.units import GiB
from memplan.verify.megatron_runner import compare, read_matrix

ROOT = Path(__file__).resolve().parents[1]
MATRIX = ROOT / "benchmarks" / "megatron" / "matrix-megatron-core.jsonl"
H200_BYTES = 139 * GiB


def test_matrix_covers_the_issue_and_fits_one_h200():
    cases = read_matrix(str(MATRIX))
    assert len(cases) >= 8
    assert {c.checkpointing for c in cases} == {"none", "selective", "full"}
    assert {c.flash for c in cases} == {True, False}
    assert {(c.tp, c.sequence_parallel) for c in cases} >= {(1, False), (2, False), (2, True)}
    assert all(4096 <= c.hidden <= 8192 and 4096 <= c.seq <= 16384 for c in cases)
    assert len({c.name for c in cases}) == len(cases)
    assert sum(sorted(predict(c)["peak"] for c in cases)[-3:]) < H200_BYTES  # three at a time fit


def test_prediction_phases_are_ordered_as_the_loop_runs():
    case = MegatronCase(name="t", hidden=1024, heads=16, layers=2, seq=2048, flash=True, micro_steps=2)
    p = predict(case)
    assert list(p) == ["init", "micro0.forward", "micro0.backward", "micro1.forward", "micro1.backward", "peak"]
    assert p["peak"] == max(v for k, v in p.items() if k != "peak")
    assert p["micro1.forward"] > p["micro0.forward"]  # the gradients of micro-step 0 are held


def test_compare_reports_signed_percent_errors():
    row = {"predicted": {"peak": 110, "micro0.forward": 90}, "peak_allocated_bytes": 100,
           "phases": [{"name": "micro0.forward", "peak_allocated_bytes": 100}],
           "layer_forward_delta_bytes": [7, 50, 50], "predicted_layer_bytes": 49}
    got = {c["what"]: c["error_pct"] for c in compare(row)}
    assert got["peak"] == 10.0 and got["micro0.forward"] == -10.0
    assert got["layer forward delta (median, layers 1..)"] == -2.0


def _cpu_expected(case: MegatronCase) -> tuple[int, int]:
    """(one layer's saved bytes, the outside saved bytes) the CPU should show."""
    job = case_job(case)
    s = resolve(job.model, job)
    def on_cpu(t) -> int:
        if t.name.endswith(".stats"):  # mean and rstd in the input dtype
            return 2 * s.b // s.r
        if t.name in ("attn.dropout_mask", "embedding.dropout_mask"):  # native_dropout's mask: input dtype
            return s.b * t.bytes_per_token
        return t.bytes_per_token

    terms = selective_terms(job.model, job) if case.checkpointing == "selective" else layer_terms(job.model, job)
    # the ids are autograd's at tp 1 (F.embedding's indices); at tp > 1 the embedding saves a masked copy
    out = [t for t in outside_terms(job.model, job) if t.name != "batch.tokens" or s.tp == 1]
    # selective: megatron-core hands the checkpoint attn_mask_type as torch.tensor([value], dtype=torch.int)
    # (attention.py _checkpointed_attention_forward): 4 bytes a layer
    extra = 4 if case.checkpointing == "selective" else 0
    return sum(map(on_cpu, terms)) * s.tokens + extra, sum(map(on_cpu, out)) * s.tokens


CPU_CASES = [
    MegatronCase(name="cpu-core-tp2-dropout", hidden=64, heads=4, layers=2, vocab=200, seq=64, tp=2,
                 hidden_dropout=0.1, attention_dropout=0.1, micro_steps=1),
    MegatronCase(name="cpu-flash-tp2-sp", hidden=64, heads=4, layers=2, vocab=200, seq=64, tp=2,
                 sequence_parallel=True, flash=True, micro_steps=1),
    MegatronCase(name="cpu-core-selective", hidden=64, heads=4, layers=2, vocab=200, seq=64,
                 checkpointing="selective", micro_steps=2),
]


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None or
                    importlib.util.find_spec("megatron.core") is None,
                    reason="megatron-core is not installed (pip install megatron-core==0.16.1)")
def test_worker_end_to_end_on_cpu(tmp_path):
    matrix = tmp_path / "matrix.jsonl"
    matrix.write_text("".join(c.model_dump_json() + "\n" for c in CPU_CASES))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "memplan.verify.megatron_runner", str(matrix), "--out", str(out),
                           "--device", "cpu", "--workers", "3", "--deadline", "400", "--timeout", "400"],
                          check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["name"]: r for r in map(json.loads, (out / "rows.jsonl").read_text().splitlines())}
    assert set(rows) == {c.name for c in CPU_CASES}
    for case in CPU_CASES:
        row = rows[case.name]
        assert row["status"] == "ok", row["error"]
        assert row["megatron_core"] and row["env"]["megatron_core"] == row["megatron_core"]
        assert [p["name"] for p in row["phases"]][:3] == ["init", "micro0.forward", "micro0.backward"]
        layer, outside = _cpu_expected(case)
        assert row["saved_bytes"]["layer1"] == layer, case.name
        assert row["saved_bytes"]["outside"] == outside, case.name
        assert row["predicted"] == predict(case)


def test_runner_creates_out_when_work_is_elsewhere(tmp_path):
    """The first device run passed --work outside --out and died writing OUT/rows.jsonl: OUT must be made."""
    matrix = tmp_path / "matrix.jsonl"
    matrix.write_text(CPU_CASES[0].model_dump_json() + "\n")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "memplan.verify.megatron_runner", str(matrix), "--out", str(out),
                           "--work", str(tmp_path / "work"), "--device", "cpu", "--deadline", "0"],
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert out.is_dir()
