"""memplan.hf.autofill: "auto" filled as the Trainer + Accelerate fill it.

Toy cases worked by hand, then the docs' templates against transformers' own code (tests/hf_reference.py runs
a real Trainer up to deepspeed.initialize) for several models, arguments and world sizes, key by key.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.hf.args import TrainingArgs
from memplan.hf.autofill import HiddenSize, fill_auto
from memplan.hf.job import hidden_of_config, trainer_job
from memplan.presets import load_model

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = ROOT / "examples" / "hf-trainer"
ZERO2 = json.loads((TEMPLATES / "ds_config_zero2.json").read_text())
ZERO3 = json.loads((TEMPLATES / "ds_config_zero3.json").read_text())


def _fill(cfg, world=1, hidden=10, steps=10, **args):
    return fill_auto(cfg, TrainingArgs(**args), world=world, hidden=HiddenSize(hidden, hidden),
                     num_training_steps=steps)


# --- toy cases -----------------------------------------------------------------------------------------------
# hidden 10: reduce_bucket_size = 10² = 100; stage3_prefetch_bucket_size = int(0.9·100) = 90;
# stage3_param_persistence_threshold = 10·10 = 100. world 4, micro 2, accumulation 3: train_batch_size = 24.

def test_zero3_template_toy_values():
    out = _fill(ZERO3, world=4, per_device_train_batch_size=2, gradient_accumulation_steps=3, bf16=True,
                warmup_steps=5)
    z = out.config["zero_optimization"]
    assert (z["reduce_bucket_size"], z["stage3_prefetch_bucket_size"], z["stage3_param_persistence_threshold"]) == \
        (100, 90, 100)
    assert (out.config["train_micro_batch_size_per_gpu"], out.config["gradient_accumulation_steps"],
            out.config["train_batch_size"]) == (2, 3, 24)
    assert out.config["bf16"]["enabled"] is True and out.config["fp16"]["enabled"] is False
    assert out.config["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 5e-5, "warmup_num_steps": 5}
    assert out.config["optimizer"]["params"]["betas"] == [0.9, 0.999]
    assert out.config["gradient_clipping"] == 1.0 and "steps_per_print" not in out.config
    assert not out.problems and not out.mismatches and out.optimizer_source == "config"
    assert not [k for k, v in _flat(out.config).items() if v == "auto"]


def test_below_zero3_accelerate_fills_the_stage3_keys_too():
    cfg = {"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                 "stage3_param_persistence_threshold": "auto"}, "train_micro_batch_size_per_gpu": 1}
    z = _fill(cfg, per_device_train_batch_size=1).config["zero_optimization"]
    assert (z["reduce_bucket_size"], z["stage3_prefetch_bucket_size"], z["stage3_param_persistence_threshold"]) == \
        (100, 90, 100)


def test_text_config_hidden_size_is_the_trainers_not_accelerates():
    composite = {"model_type": "mistral3", "text_config": {"hidden_size": 12}}
    hidden = hidden_of_config(composite)
    assert (hidden.trainer, hidden.accelerate) == (12, None)
    assert hidden_of_config({"hidden_sizes": [3, 9, 5]}) == HiddenSize(9, 9)
    z3 = fill_auto(ZERO3, TrainingArgs(warmup_steps=1), world=1, hidden=hidden, num_training_steps=5)
    assert z3.config["zero_optimization"]["reduce_bucket_size"] == 144 and not z3.problems
    cfg = {"zero_optimization": {"stage": 2, "stage3_prefetch_bucket_size": "auto"}}
    z2 = fill_auto(cfg, TrainingArgs(), world=1, hidden=hidden, num_training_steps=5)
    assert [p.key for p in z2.problems] == ["zero_optimization.stage3_prefetch_bucket_size"]


def test_values_that_contradict_the_arguments_are_mismatches():
    cfg = {**ZERO2, "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 3e-5}}}
    out = _fill(cfg, per_device_train_batch_size=2, warmup_steps=1)
    assert [m.line for m in out.mismatches] == [
        "- ds train_micro_batch_size_per_gpu=4 vs hf per_device_train_batch_size=2",
        "- ds optimizer.params.lr=3e-05 vs hf learning_rate=5e-05"]


def test_warmup_lr_with_the_trainers_default_warmup_is_refused():
    assert [p.key for p in _fill(ZERO2).problems] == ["scheduler.params.warmup_num_steps"]
    assert not _fill(ZERO2, warmup_steps=1).problems
    assert _fill(ZERO2, warmup_steps=0.1, steps=10).config["scheduler"]["params"]["warmup_num_steps"] == 1  # ceil(1.0)
    open_steps = fill_auto(ZERO2, TrainingArgs(warmup_steps=0.1), world=1, hidden=HiddenSize(10, 10),
                           num_training_steps=None)
    assert "scheduler.params.warmup_num_steps" in open_steps.unresolved and not open_steps.problems


def test_what_accelerate_cannot_fill_or_refuses():
    missing = _fill({"train_micro_batch_size_per_gpu": 1})
    assert [p.key for p in missing.problems] == ["zero_optimization"]
    leftover = _fill({"zero_optimization": {"stage": 1}, "fp16": {"enabled": "auto", "loss_scale": "auto"}})
    assert [p.key for p in leftover.problems] == ["fp16.loss_scale"]
    both = _fill({"zero_optimization": {"stage": 1}, "fp16": {"enabled": True}}, bf16=True)
    assert "fp16.enabled" in [p.key for p in both.problems] and both.mismatches


def test_the_trainers_own_optimizer_and_zero_offload():
    no_section = {k: v for k, v in ZERO2.items() if k not in ("optimizer", "scheduler")}
    offloaded = _fill(no_section)
    assert offloaded.client_optimizer == "deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True)"
    assert offloaded.config["zero_allow_untested_optimizer"] is True
    kept = _fill({**no_section, "zero_force_ds_cpu_optimizer": False})
    assert kept.client_optimizer == "torch.optim.AdamW(fused=True)"  # optim's default from torch 2.8 on
    plain = _fill({**no_section, "zero_optimization": {"stage": 2}}, optim="adamw_torch")
    assert plain.client_optimizer == "torch.optim.AdamW"


def test_trainer_job_fields():
    job = trainer_job(ZERO3, TrainingArgs(gradient_checkpointing=True, warmup_steps=1,
                                          gradient_checkpointing_kwargs={"every_n_layers": 2, "offload": True}),
                      model=load_model("qwen2.5-0.5b"), world=8)
    assert job.fields == {"loop": "hf-trainer", "checkpointing": "full", "checkpoint_reentrant": False,
                          "checkpoint_every_n_layers": 2, "checkpoint_offload": True}
    sgd = trainer_job(None, TrainingArgs(optim="sgd"), model=None, world=1)
    assert [p.key for p in sgd.problems] == ["optim_args"]
    reentrant = TrainingArgs(gradient_checkpointing=True, gradient_checkpointing_kwargs={"preserve_rng_state": False})
    assert trainer_job(None, reentrant, model=None, world=1).fields["checkpoint_reentrant"] is True  # torch default


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


# --- against transformers' own code --------------------------------------------------------------------------

def _without(cfg: dict, *keys: str) -> dict:
    return {k: v for k, v in cfg.items() if k not in keys}


CASES = [  # (template, model preset, TrainingArguments, world, max_steps)
    (ZERO3, "llama-3-8b", {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4, "bf16": True,
                           "warmup_steps": 1}, 8, 10),
    (ZERO3, "qwen2.5-0.5b", {"per_device_train_batch_size": 1, "fp16": True, "gradient_checkpointing": True}, 4, 5),
    (ZERO3, "mixtral-8x7b", {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 8, "bf16": True,
                             "learning_rate": 1e-5, "weight_decay": 0.1, "warmup_steps": 0.1}, 16, 30),
    (ZERO2, "gpt2-large", {"per_device_train_batch_size": 4, "bf16": True, "warmup_steps": 0.25}, 2, 20),
    (ZERO2, "pythia-1b", {}, 1, 3),
    (_without(ZERO2, "optimizer", "scheduler"), "qwen3-0.6b", {"per_device_train_batch_size": 2, "bf16": True}, 8, 5),
    ({**_without(ZERO3, "optimizer"), "zero_force_ds_cpu_optimizer": False}, "llama-3.2-1b",
     {"bf16": True, "optim": "adamw_torch", "warmup_steps": 2}, 2, 5),
    ({**ZERO2, "train_micro_batch_size_per_gpu": 4}, "bloom-560m", {"per_device_train_batch_size": 2}, 1, 5),
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("deepspeed")
    pytest.importorskip("accelerate")
    from memplan.verify.hfbuild import hf_config_dict

    cases = [{"ds_config": cfg, "training_args": args, "hf_config": hf_config_dict(load_model(name)), "world": world,
              "max_steps": steps} for cfg, name, args, world, steps in CASES]
    out = tmp_path_factory.mktemp("hf") / "reference.json"
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("hf_reference.py")), str(out)],
                          input=json.dumps(cases), capture_output=True, text=True, timeout=900, check=False,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{c[1]}-w{c[3]}" for c in CASES])
def test_filled_config_equals_the_trainers_key_by_key(reference, index):
    cfg, name, args, world, steps = CASES[index]
    job = trainer_job(cfg, TrainingArgs(**args), model=load_model(name), world=world, num_training_steps=steps)
    real = reference[index]
    if real["error"]:  # the Trainer refused it: memplan finds the same mismatches
        assert job.fill.mismatches and all(m.line in real["error"] for m in job.fill.mismatches), real["error"]
        return
    mine, theirs = _flat(job.fill.config), _flat(real["config"])
    assert mine == theirs, {k: (mine.get(k), theirs.get(k)) for k in set(mine) | set(theirs)
                            if mine.get(k) != theirs.get(k)}
    if job.fill.client_optimizer is not None:
        assert job.fill.client_optimizer.split(".")[-1].startswith(real["optimizer"])
        if real["adam_w_mode"] is not None:
            assert f"adamw_mode={real['adam_w_mode']}" in job.fill.client_optimizer
    else:
        assert real["optimizer"] is None  # DeepSpeed builds the config's optimizer


@pytest.mark.slow
def test_estimate_json_shows_the_trainers_zero_values(reference, capsys):
    """`memplan estimate --loop hf-trainer --json`: the job's ZeRO values are the Trainer's."""
    from memplan.cli import main

    cfg, name, args, world, _ = CASES[0]
    assert cfg is ZERO3 and args["per_device_train_batch_size"] == 2 and args["gradient_accumulation_steps"] == 4
    argv = ["estimate", "--model", name, "--loop", "hf-trainer", "--ds-config", str(TEMPLATES / "ds_config_zero3.json"),
            "--gpus", str(world), "--micro-batch", "2", "--grad-accum", "4", "--dtype", "bf16", "--seq", "2048",
            "--json"]
    assert main(argv) == 0
    zero = json.loads(capsys.readouterr().out)["job"]["training"]["zero"]
    real = reference[0]["config"]["zero_optimization"]
    for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                "stage3_max_live_parameters", "stage3_max_reuse_distance", "sub_group_size"):
        assert zero[key] == real[key], key
    assert (zero["offload_optimizer"], zero["offload_param"]) == (real["offload_optimizer"]["device"],
                                                                 real["offload_param"]["device"])


# --- properties ----------------------------------------------------------------------------------------------

_LEAVES = sorted(_flat(ZERO3))


def _unflat(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


@settings(max_examples=80, deadline=None)
@given(st.sets(st.sampled_from(_LEAVES)), st.integers(1, 16384), st.integers(1, 64), st.integers(1, 8),
       st.integers(1, 16), st.sampled_from(["bf16", "fp16", "fp32"]), st.integers(1, 5))
def test_the_trainer_fills_auto_and_never_overwrites_a_written_value(dropped, hidden, world, micro, accum, dtype,
                                                                     warmup):
    flat = {k: v for k, v in _flat(ZERO3).items() if k not in dropped or k == "zero_optimization.stage"}
    cfg = _unflat(flat)
    args = TrainingArgs(per_device_train_batch_size=micro, gradient_accumulation_steps=accum, bf16=dtype == "bf16",
                        fp16=dtype == "fp16", warmup_steps=warmup)
    out = fill_auto(cfg, args, world=world, hidden=HiddenSize(hidden, hidden), num_training_steps=10)
    filled = _flat(out.config)
    for key, value in flat.items():
        if value != "auto" and key != "steps_per_print":
            assert filled[key] == value, key  # written values are kept (a contradiction is a mismatch instead)
    assert not out.mismatches and not out.problems
    assert "auto" not in filled.values()
    if "zero_optimization.reduce_bucket_size" in flat:
        assert filled["zero_optimization.reduce_bucket_size"] == hidden * hidden
    if "train_batch_size" in flat:
        assert filled["train_batch_size"] == world * micro * accum


def test_accelerate_launch_mixed_precision_adds_a_missing_section():
    cfg = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}
    out = fill_auto(cfg, TrainingArgs(), world=1, hidden=None, num_training_steps=1, mixed_precision_env="bf16")
    assert (out.config["bf16"], out.config["fp16"]) == ({"enabled": True}, {"enabled": False})
    filled_first = fill_auto(ZERO2, TrainingArgs(warmup_steps=1), world=1, hidden=None, num_training_steps=1,
                             mixed_precision_env="bf16")
    assert filled_first.config["bf16"]["enabled"] is False  # the Trainer filled "auto" from args.bf16 first
