"""memplan check / estimate on the Hugging Face Trainer path: findings, the implied loop, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.cli import main

ROOT = Path(__file__).resolve().parents[1]
ZERO2 = str(ROOT / "examples" / "hf-trainer" / "ds_config_zero2.json")
ZERO3 = str(ROOT / "examples" / "hf-trainer" / "ds_config_zero3.json")
LINE = ("deepspeed --num_gpus 8 train.py --deepspeed {cfg} --model_name_or_path meta-llama/Meta-Llama-3-8B "
        "--per_device_train_batch_size 2 --gradient_accumulation_steps 4 --bf16 --gradient_checkpointing {extra}")


def _check(capsys, *argv) -> tuple[int, dict]:
    rc = main(["check", *argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def _by(out: dict, severity: str) -> dict[str, dict]:
    return {f["subject"]: f for f in out["findings"] if f["severity"] == severity}


def test_a_trainer_line_fills_auto_and_finds_the_warmup_stopper(capsys):
    rc, out = _check(capsys, "--ds-config", ZERO3, "--model", "llama-3-8b", "--seq", "4096",
                     "--launch", LINE.format(cfg=ZERO3, extra=""))
    assert rc == 1
    errors = _by(out, "error")
    assert list(errors) == ["scheduler.params.warmup_num_steps"]
    assert "warmup_num_steps must be a positive integer" in errors["scheduler.params.warmup_num_steps"]["message"]
    infos = _by(out, "info")
    assert "zero_optimization.reduce_bucket_size=16777216" in infos["auto"]["message"]  # hidden 4096: 4096²
    assert "--model_name_or_path" in infos
    training = out["estimate"]["job"]["training"]
    assert (training["loop"], training["checkpointing"], training["micro_batch"], training["dtype"]) == \
        ("hf-trainer", "full", 2, "bf16")
    assert training["zero"]["stage3_param_persistence_threshold"] == 40960  # 10 · 4096


def test_with_warmup_steps_the_template_launches(capsys):
    rc, out = _check(capsys, "--ds-config", ZERO2, "--model", "qwen2.5-0.5b", "--seq", "2048",
                     "--launch", LINE.format(cfg=ZERO2, extra="--warmup_steps 10"))
    assert rc == 0, _by(out, "error")
    assert out["estimate"]["job"]["training"]["optimizer"] == "cpu_adam"  # AdamW section under optimizer offload


def test_auto_values_the_flags_contradict(tmp_path, capsys):
    cfg = json.loads(Path(ZERO2).read_text())
    cfg["train_micro_batch_size_per_gpu"] = 4
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    rc, out = _check(capsys, "--ds-config", str(path), "--launch", LINE.format(cfg=path, extra="--warmup_steps 1"))
    assert rc == 1
    assert "contradicts TrainingArguments per_device_train_batch_size = 2" in \
        _by(out, "error")["train_micro_batch_size_per_gpu"]["message"]


def test_auto_under_plain_deepspeed(capsys):
    for extra in ((), ("--loop", "outputs"), ("--loop", "loss", "--launch", LINE.format(cfg=ZERO2, extra=""))):
        rc, out = _check(capsys, "--ds-config", ZERO2, "--gpus", "8", *extra)
        assert rc == 1
        error = _by(out, "error")["gradient_accumulation_steps, train_batch_size, train_micro_batch_size_per_gpu"]
        assert "TypeError" in error["message"] and "--loop hf-trainer" in error["fix"]


def test_training_args_file_implies_the_trainer(tmp_path, capsys):
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"per_device_train_batch_size": 1, "bf16": True, "warmup_steps": 2}))
    rc, out = _check(capsys, "--ds-config", ZERO3, "--gpus", "4", "--training-args", str(path), "--model",
                     "llama-3.2-1b", "--seq", "1024")
    assert rc == 0, _by(out, "error")
    assert out["estimate"]["job"]["training"]["loop"] == "hf-trainer"


def test_estimate_on_the_trainer_path(capsys, tmp_path):
    argv = ["estimate", "--model", "qwen2.5-0.5b", "--ds-config", ZERO3, "--loop", "hf-trainer", "--gpus", "2",
            "--micro-batch", "4", "--checkpointing", "full", "--seq", "1024", "--json"]
    assert main(argv) == 0
    job = json.loads(capsys.readouterr().out)["job"]
    assert job["training"]["zero"]["reduce_bucket_size"] == 896 * 896  # qwen2.5-0.5b: hidden 896
    assert (job["training"]["micro_batch"], job["training"]["grad_accum"], job["training"]["dtype"]) == (4, 1, "fp32")
    plain = ["estimate", "--model", "qwen2.5-0.5b", "--ds-config", ZERO3, "--gpus", "2", "--seq", "1024",
             "--micro-batch", "4", "--grad-accum", "1", "--json"]
    # without the Trainer nothing fills "auto": plain deepspeed.initialize refuses the file (exit 2, one line)
    assert main(plain) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memplan: error: --ds-config") and '"auto"' in err[0]


BAD = [
    (["estimate", "--loop", "trainer"], "--loop"),
    (["check", "--ds-config", ZERO3, "--launch", "deepspeed train.py --per_device_train_batch_size 0"],
     "--per_device_train_batch_size"),
    (["check", "--ds-config", ZERO3, "--launch", "torchrun train.py --bf16 perhaps"], "--bf16"),
    (["estimate", "--model", "llama-3.2-1b", "--training-args", "{FILE}"], "--training-args zero_optimization"),
    (["estimate", "--model", "llama-3.2-1b", "--training-args", "{FILE}", "--loop", "loss"], "--training-args"),
    (["estimate", "--model", "llama-3.2-1b", "--loop", "hf-trainer", "--checkpointing", "selective"],
     "--checkpointing"),
    (["estimate", "--model", "llama-3.2-1b", "--loop", "hf-trainer", "--optimizer", "lion"], "--optimizer"),
]


@pytest.mark.parametrize("argv, field", BAD, ids=[b[1] for b in BAD])
def test_bad_input_exits_2_with_one_line_naming_the_field(argv, field, tmp_path, capsys):
    path = tmp_path / "not-args.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    rc = main([a.replace("{FILE}", str(path)) for a in argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and err.startswith(f"memplan: error: {field}:"), err


def test_verify_refuses_what_the_trainer_would_refuse(capsys):
    from memplan.verify.command import main as verify_main

    rc = verify_main(["--model", "llama-3.2-1b", "--loop", "hf-trainer", "--ds-config", ZERO3, "--device", "cpu"])
    assert rc == 2
    assert "scheduler.params.warmup_num_steps" in capsys.readouterr().err


def test_loop_hf_trainer_alone_changes_only_the_loop(capsys):
    base = ["estimate", "--model", "llama-3.2-1b", "--seq", "2048", "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)["job"]["training"]
    assert main([*base, "--loop", "hf-trainer"]) == 0
    trainer = json.loads(capsys.readouterr().out)["job"]["training"]
    assert trainer["loop"] == "hf-trainer"
    assert {k: v for k, v in trainer.items() if k != "loop"} == {k: v for k, v in plain.items() if k != "loop"}


@pytest.mark.parametrize("head", ["deepspeed --num_gpus 8", "torchrun --nproc_per_node 8",
                                  "accelerate launch --num_processes 8"])
def test_the_launchers_agree(head, capsys):
    line = (f"{head} train.py --deepspeed {ZERO3} --per_device_train_batch_size 2 --gradient_accumulation_steps 2 "
            "--bf16 --warmup_steps 1")
    rc, out = _check(capsys, "--ds-config", ZERO3, "--model", "llama-3.2-1b", "--seq", "2048", "--launch", line)
    assert rc == 0, _by(out, "error")
    job = out["estimate"]["job"]
    assert (job["layout"]["world"], job["training"]["micro_batch"], job["training"]["grad_accum"]) == (8, 2, 2)
    assert "train_batch_size=32" in _by(out, "info")["auto"]["message"]  # 8 · 2 · 2


TRL = ("accelerate launch --num_processes 8 trl/scripts/sft.py --model_name_or_path meta-llama/Llama-3.2-1B "
       "--per_device_train_batch_size 2 --bf16 --warmup_steps 1 --deepspeed {cfg} {extra}")


def test_trl_peft_flags_train_an_adapter(capsys):
    """issue 14: TRL's --use_peft --lora_r --lora_target_modules (trl ModelConfig) are read as the adapter the
    script trains; the estimate equals the one the --lora-* flags give for the same adapter."""
    extra = "--use_peft --lora_r 32 --lora_target_modules q_proj v_proj"
    rc, out = _check(capsys, "--ds-config", ZERO2, "--model", "llama-3.2-1b", "--seq", "2048",
                     "--launch", TRL.format(cfg=ZERO2, extra=extra))
    assert rc == 0, out["findings"]
    lora = out["estimate"]["job"]["training"]["lora"]
    assert (lora["rank"], tuple(lora["targets"]), lora["dropout"]) == (32, ("q_proj", "v_proj"), 0.05)
    infos = _by(out, "info")
    assert "rank 32" in infos["--use_peft"]["message"]
    assert all("--lora_r" not in subject for subject in infos)  # read, so not "the script's own arguments"
    rc, flags = _check(capsys, "--ds-config", ZERO2, "--model", "llama-3.2-1b", "--seq", "2048",
                       "--launch", TRL.format(cfg=ZERO2, extra=""), "--lora-rank", "32",
                       "--lora-targets", "q_proj,v_proj", "--lora-dropout", "0.05")
    assert flags["estimate"]["peak_allocated_bytes"] == out["estimate"]["peak_allocated_bytes"]
    assert flags["estimate"]["trainable_params"] == out["estimate"]["trainable_params"] > 0
    rc, default = _check(capsys, "--ds-config", ZERO2, "--model", "llama-3.2-1b", "--seq", "2048",
                         "--launch", TRL.format(cfg=ZERO2, extra="--use_peft"))
    lora = default["estimate"]["job"]["training"]["lora"]
    assert lora["rank"] == 16 and lora["dropout"] == 0.05  # TRL's ModelConfig defaults


def test_trl_peft_target_the_model_lacks_is_an_error(capsys):
    extra = "--use_peft --lora_target_modules foo_proj"
    rc, out = _check(capsys, "--ds-config", ZERO2, "--model", "llama-3.2-1b", "--seq", "2048",
                     "--launch", TRL.format(cfg=ZERO2, extra=extra))
    assert rc == 1
    assert "foo_proj" in _by(out, "error")["--lora_target_modules"]["message"]


@pytest.mark.parametrize(("extra", "field"), [("--use_peft --lora_r 0", "--launch --lora_r"),
                                              ("--use_peft --lora_dropout x", "--launch --lora_dropout"),
                                              ("--use_peft maybe", "--launch --use_peft")])
def test_trl_peft_bad_values_exit_2(capsys, extra, field):
    rc = main(["check", "--ds-config", ZERO2, "--model", "llama-3.2-1b", "--launch", TRL.format(cfg=ZERO2, extra=extra)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"memplan: error: {field}"), err


def test_trl_default_dropout_on_moe_all_linear_is_pefts_error(capsys):
    """TRL's ModelConfig defaults lora_dropout to 0.05; on a fused-expert MoE peft adapts the experts through
    lora.ParamWrapper for all-linear, which refuses it (peftconfig.check_adapter_options)."""
    extra = "--use_peft --lora_target_modules all-linear"
    rc, out = _check(capsys, "--ds-config", ZERO2, "--model", "tinymixtral", "--seq", "1024",
                     "--launch", TRL.format(cfg=ZERO2, extra=extra))
    assert rc == 1
    assert "ParamWrapper" in _by(out, "error")["--lora_dropout"]["message"]
    rc, out = _check(capsys, "--ds-config", ZERO2, "--model", "tinymixtral", "--seq", "1024",
                     "--launch", TRL.format(cfg=ZERO2, extra=extra + " --lora_dropout 0"))
    assert rc == 0, out["findings"]
