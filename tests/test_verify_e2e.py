"""`memplan verify` end to end on the CPU: a tiny Llama through the real worker, DeepSpeed and the fake group.

DeepSpeed 0.19.8 runs on the CPU accelerator (DS_ACCELERATOR=cpu, which the runner sets for device "cpu"):
deepspeed.initialize, ZeRO 1/2/3 and Ulysses all run, so this exercises the whole flow except the numbers —
on the CPU every memory counter reads 0. torch AdamW avoids building FusedAdam; DeepSpeed still builds its
small shm comm op once (cached under TORCH_EXTENSIONS_DIR). The GPU test at the end checks the numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

from memplan.specs import Job, Layout, ModelSpec, TrainingSpec, ZeroSpec
from memplan.verify import report, runner

TINY_CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
               "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 512}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> ModelSpec:
    from memplan.presets import load_model

    path = tmp_path_factory.mktemp("model") / "tiny-llama.json"
    path.write_text(json.dumps(TINY_CONFIG))
    return load_model(str(path))


def _job(model, world=4, sp=1, **training) -> Job:
    training.setdefault("optimizer", "torch_adamw")
    return Job(model=model, training=TrainingSpec(seq_len=64, **training), layout=Layout(world=world, sp=sp))


@pytest.mark.slow
def test_zero2_grad_accum_runs_every_phase(tiny_model, tmp_path):
    job = _job(tiny_model, grad_accum=2, zero=ZeroSpec(stage=2))
    row = runner.measure_job(job, name="z2", out_dir=str(tmp_path), steps=2, device="cpu", timeout_s=300)
    assert row["status"] == "ok", row["error"]
    names = [p["name"] for p in row["phases"]]
    assert names[0] == "init"
    assert names[1:4] == ["step0.micro0.forward", "step0.micro0.backward", "step0.micro0.step"]
    assert len(names) == 1 + 2 * 2 * 3  # init + steps · micro-steps · (forward, backward, step)
    labels = [t["label"] for t in row["timeline"]]
    assert "forward, layer 3, after" in labels and "backward, layer 0, after" in labels
    assert "forward, lm_head, after" in labels
    assert row["meta_params"] == row["analytic_params"]
    assert row["ds_config"]["zero_optimization"]["stage"] == 2
    assert row["env"]["deepspeed"] and row["mode"] == "emulated"
    json_path, _ = report.write_report(row, str(tmp_path))
    assert json.loads(Path(json_path).read_text())["name"] == "z2"


@pytest.mark.slow
def test_zero3_ulysses_and_reduced_depth(tiny_model, tmp_path):
    job = _job(tiny_model, sp=2, zero=ZeroSpec(stage=3), checkpointing="full")
    row = runner.measure_job(job, name="z3sp2", out_dir=str(tmp_path), steps=1, layers=1, device="cpu",
                             timeout_s=300)
    assert row["status"] == "ok", row["error"]
    assert [m["num_layers"] for m in row["layers"]["measured"]] == [1, 2]
    assert row["layers"]["full_layers"] == 4
    assert not any(t["label"].startswith("backward") for t in row["timeline"])  # no backward hooks under ZeRO-3


def test_failures_are_results_not_tracebacks(tiny_model, tmp_path):
    slow = runner.measure_job(_job(tiny_model), name="t", out_dir=str(tmp_path), device="cpu", timeout_s=0.5)
    assert slow["status"] == "timeout" and "timeout" in slow["error"]
    sel = runner.measure_job(_job(tiny_model, checkpointing="selective"), name="s", out_dir=str(tmp_path),
                             device="cpu")
    assert sel["status"] == "unsupported" and "selective" in sel["error"]


@pytest.mark.gpu
def test_gpu_measurement_reads_real_peaks(tiny_model, tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    job = _job(tiny_model, zero=ZeroSpec(stage=2))
    row = runner.measure_job(job, name="gpu", out_dir=str(tmp_path), steps=2, device="cuda", timeout_s=600)
    assert row["status"] == "ok", row["error"]
    train = [p for p in row["phases"] if p["name"] != "init"]
    assert row["peak_allocated_bytes"] == max(p["peak_allocated_bytes"] for p in train) > 0
    assert all(p["peak_reserved_bytes"] >= p["peak_allocated_bytes"] for p in row["phases"])
    assert row["env"]["gpu"]


@pytest.mark.slow
def test_launch_runs_real_ranks_and_keeps_each(tiny_model, tmp_path):
    job = _job(tiny_model, world=2, zero=ZeroSpec(stage=2))
    row = runner.measure_job(job, name="real", out_dir=str(tmp_path), steps=1, launch=True, device="cpu",
                             timeout_s=300)
    assert row["status"] == "ok", row["error"]
    assert row["mode"] == "real"
    assert [r["rank"] for r in row["per_rank"]] == [0, 1]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_lora_frozen_base_and_outputs_loop(tiny_model, tmp_path, stage):
    from memplan.specs import LoraSpec

    lora = LoraSpec(rank=4, targets=("q_proj", "v_proj"), dropout=0.05)
    job = _job(tiny_model, zero=ZeroSpec(stage=stage), lora=lora, loop="outputs", checkpointing="full")
    row = runner.measure_job(job, name=f"lora{stage}", out_dir=str(tmp_path), steps=1, device="cpu",
                             timeout_s=300)
    assert row["status"] == "ok", row["error"]
    assert row["job"]["training"]["loop"] == "outputs"
    assert [p["name"] for p in row["phases"]] == ["init", "step0.micro0.forward", "step0.micro0.backward",
                                                   "step0.micro0.step"]
    # peft's adapters: r·(in + out) per adapted linear, two per layer (q_proj, v_proj: 64 → 64)
    assert row["trainable_params"] == 4 * 2 * 4 * (64 + 64)


@pytest.mark.slow
def test_frozen_groups_and_loss_loop(tiny_model, tmp_path):
    job = _job(tiny_model, zero=ZeroSpec(stage=1), freeze=("embeddings", "layers:2"), loop="loss")
    row = runner.measure_job(job, name="frozen", out_dir=str(tmp_path), steps=1, device="cpu", timeout_s=300)
    assert row["status"] == "ok", row["error"]
    assert row["frozen_params"] > 0 and row["trainable_params"] > 0
