"""`memplan verify --loop hf-trainer` on the CPU: a tiny Llama through a real transformers.Trainer.

DeepSpeed runs on its CPU accelerator (the runner sets DS_ACCELERATOR=cpu for --device cpu), so the whole flow
runs — TrainingArguments with the DeepSpeed JSON, the Trainer's own "auto" filling, deepspeed.initialize
through accelerate, the phases — except the numbers (every counter reads 0 on the CPU). bf16 needs a GPU for
TrainingArguments, so these run fp32. On the CPU accelerate counts one process, so emulated ranks (world > 1)
are a GPU matter; here that is refused in the row.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

from memplan.verify.command import main as verify_main

ROOT = Path(__file__).resolve().parents[1]
ZERO3 = ROOT / "examples" / "hf-trainer" / "ds_config_zero3.json"
TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 512}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("hf")
    (d / "tiny-llama.json").write_text(json.dumps(TINY))
    (d / "ds_zero2.json").write_text(json.dumps({  # no optimizer section: the Trainer's own optim
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}, "bf16": {"enabled": "auto"},
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto", "gradient_clipping": "auto"}))
    (d / "args.json").write_text(json.dumps({"output_dir": "trainer_output", "warmup_steps": 1}))
    return {"model": str(d / "tiny-llama.json"), "zero2": str(d / "ds_zero2.json"), "args": str(d / "args.json")}


def _verify(capsys, tmp_path, *argv) -> dict:
    rc = verify_main(["--loop", "hf-trainer", "--seq", "64", "--device", "cpu", "--out", str(tmp_path), "--json",
                      "--timeout", "600", *argv])
    out = capsys.readouterr().out.strip().splitlines()
    row = json.loads(out[-1])
    assert rc == (0 if row["status"] == "ok" else 1)
    return row


@pytest.mark.slow
def test_trainer_zero2_with_its_own_optimizer(files, tmp_path, capsys):
    row = _verify(capsys, tmp_path, "--model", files["model"], "--ds-config", files["zero2"], "--gpus", "1",
                  "--micro-batch", "2", "--grad-accum", "2", "--steps", "2")
    assert row["status"] == "ok", row["error"]
    names = [p["name"] for p in row["phases"]]
    expected = ["init"]
    for s in range(2):
        for m in range(2):
            expected += [f"step{s}.micro{m}.forward", f"step{s}.micro{m}.backward"]
        expected.append(f"step{s}.micro1.step")  # DeepSpeed steps at the accumulation boundary
    assert names == expected
    assert row["auto_fill_check"] == []  # memplan's filled config is the Trainer's, key by key
    assert row["ds_config"]["zero_optimization"]["reduce_bucket_size"] == 64 * 64
    assert row["trainer_optimizer"] == "AdamW" and row["job"]["training"]["optimizer"] == "torch_adamw_fused"
    assert row["training_args"]["per_device_train_batch_size"] == 2
    assert row["trainer_training_args"]["gradient_accumulation_steps"] == 2
    assert row["global_steps"] == 2 and "1 process" in row["trainer_note"]
    labels = [t["label"] for t in row["timeline"]]
    assert "forward, layer 3, after" in labels and "forward, lm_head, after" in labels


@pytest.mark.slow
def test_trainer_zero3_docs_template(files, tmp_path, capsys):
    row = _verify(capsys, tmp_path, "--model", files["model"], "--ds-config", str(ZERO3), "--training-args",
                  files["args"], "--gpus", "1", "--micro-batch", "1", "--steps", "2", "--checkpointing", "full")
    assert row["status"] == "ok", row["error"]
    assert [p["name"] for p in row["phases"]][1:4] == ["step0.micro0.forward", "step0.micro0.backward",
                                                       "step0.micro0.step"]
    assert row["auto_fill_check"] == []
    assert (row["trainer_optimizer"], row["trainer_scheduler"]) == ("DeepSpeedCPUAdam", "WarmupLR")
    assert "zero.Init" in row["trainer_note"]
    assert row["ds_config_given"]["zero_optimization"]["reduce_bucket_size"] == "auto"  # the template, as published
    assert row["job"]["training"]["checkpointing"] == "full"


def test_emulated_ranks_on_the_cpu_are_refused_in_the_row(files, tmp_path, capsys):
    row = _verify(capsys, tmp_path, "--model", files["model"], "--ds-config", files["zero2"], "--gpus", "2",
                  "--micro-batch", "1", "--steps", "1")
    assert row["status"] == "unsupported" and "accelerate counts one process" in row["error"]


@pytest.mark.slow
def test_lora_through_the_trainer(files, tmp_path, capsys):
    """peft's adapters on a frozen base, the Trainer's own optimizer over the trainable parameters only."""
    row = _verify(capsys, tmp_path, "--model", files["model"], "--ds-config", files["zero2"], "--gpus", "1",
                  "--micro-batch", "2", "--steps", "1", "--lora-rank", "4", "--lora-targets", "q_proj,v_proj")
    assert row["status"] == "ok", row["error"]
    assert row["job"]["training"]["lora"]["rank"] == 4
