"""Hostile input, configs DeepSpeed refuses (issue 15): memplan refuses what DeepSpeed 0.19.8 refuses, naming the
same key, and accepts what it accepts.

The property is checked against DeepSpeed's own DeepSpeedConfig (on the CPU accelerator, no process group):
for each section value and batch value drawn, memplan.dsconfig.ds_settings raises iff DeepSpeedConfig does.
Then every command: estimate, verify, report and plan refuse such a config (exit 2, naming
``--ds-config <key>``); check reports it as an error finding on that key (exit 1).
"""

from __future__ import annotations

import json

import pytest
from _hostile import assert_refused, line, run_main, workdir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memplan.dsconfig import ds_settings
from memplan.errors import InputError

SECTIONS = ("zero_optimization", "optimizer", "fp16", "bf16", "data_types", "tensor_parallel",
            "activation_checkpointing")
#: values a whole section can hold: "auto" (only single values inside a section may be "auto"), null, scalars,
#: and objects DeepSpeed reads (with "auto" inside them)
section_values = st.one_of(
    st.sampled_from(["auto", None, 0, 3, True, "x", [], [1]]),
    st.sampled_from([{}, {"enabled": "auto"}, {"enabled": True}, {"stage": "3"}, {"stage": "auto"}, {"stage": 9},
                     {"type": "AdamW"}, {"autotp_size": 2}, {"grad_accum_dtype": "fp32"},
                     {"partition_activations": "auto"}]),
)
batch_values = st.sampled_from([1, 2, "auto", "2", 0, -1, None])


def test_deepspeed_config_runs_here():
    """The reference works on this machine (else every comparison below would read "refused")."""
    assert not _deepspeed_refuses({"train_micro_batch_size_per_gpu": 1})


def _deepspeed_refuses(cfg: dict) -> bool:
    config = pytest.importorskip("deepspeed.runtime.config")
    try:
        config.DeepSpeedConfig(cfg)
    except Exception:  # noqa: BLE001 - TypeError, AttributeError, AssertionError, ValidationError: all refusals
        return True
    return False


def _fits_section(section: str, value) -> bool:
    """Objects drawn for another section's fields would be refused by DeepSpeed's extra='forbid' models for a
    reason memplan leaves to `memplan check` (unknown keys); keep each object to its own section."""
    if not isinstance(value, dict) or not value:
        return True
    own = {"zero_optimization": {"stage"}, "optimizer": {"type"}, "fp16": {"enabled"}, "bf16": {"enabled"},
           "tensor_parallel": {"autotp_size"}, "data_types": {"grad_accum_dtype"},
           "activation_checkpointing": {"partition_activations"}}
    return set(value) <= own[section]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(section=st.sampled_from(SECTIONS), value=section_values, micro=batch_values)
def test_memplan_refuses_a_config_iff_deepspeed_does(section, value, micro):
    if not _fits_section(section, value):
        return
    cfg = {section: value}
    if micro is not None:
        cfg["train_micro_batch_size_per_gpu"] = micro
    else:
        cfg["train_batch_size"] = 8
    ds_refuses = _deepspeed_refuses(json.loads(json.dumps(cfg)))
    try:
        ds_settings(cfg)
        ours_refuses = False
    except InputError:
        ours_refuses = True
    assert ours_refuses == ds_refuses, (cfg, "DeepSpeed refuses" if ds_refuses else "DeepSpeed accepts")


REFUSED = [
    ({"train_micro_batch_size_per_gpu": 1, "zero_optimization": "auto"}, "zero_optimization"),
    ({"train_micro_batch_size_per_gpu": 1, "optimizer": "auto"}, "optimizer"),
    ({"train_micro_batch_size_per_gpu": 1, "fp16": "auto"}, "fp16"),
    ({"train_micro_batch_size_per_gpu": 1, "bf16": "auto"}, "bf16"),
    ({"train_micro_batch_size_per_gpu": 1, "zero_optimization": None}, "zero_optimization"),
    ({"train_micro_batch_size_per_gpu": "auto"}, "train_micro_batch_size_per_gpu"),
    ({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": "5"}}, "zero_optimization.stage"),
]


@pytest.mark.parametrize("cfg, key", REFUSED)
@pytest.mark.parametrize("command", ["estimate", "verify", "report", "plan", "check"])
def test_every_command_refuses_what_deepspeed_refuses(command, cfg, key):
    assert _deepspeed_refuses(cfg)
    with workdir() as root:
        (root / "ds.json").write_text(json.dumps(cfg))
        argv = line(command, root, "--ds-config", str(root / "ds.json"))
        if command != "check":
            assert_refused(argv, f"--ds-config {key}", root)
            return
        rc, out, err = run_main(argv)
        assert rc == 1 and err == "", err
        assert any(f["severity"] == "error" and f["subject"] == key for f in json.loads(out)["findings"])


def test_fp16_auto_is_the_trainers_to_fill_only_on_the_hf_path():
    """fp16.enabled "auto": plain DeepSpeed drops it (fp16 off, so fp32); the Trainer fills it from
    TrainingArguments (--loop hf-trainer): then memplan leaves the dtype to the flags."""
    # (a zero_optimization section: accelerate's DeepSpeedPlugin requires one on the Trainer path)
    cfg = {"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": "auto"}, "zero_optimization": {"stage": 0}}
    assert not _deepspeed_refuses(cfg)
    assert ds_settings(cfg).dtype == "fp32"
    assert ds_settings(cfg, hf=True).dtype is None
    with workdir() as root:
        (root / "ds.json").write_text(json.dumps(cfg))
        rc, out, err = run_main(line("estimate", root, "--ds-config", str(root / "ds.json")))
        assert rc == 0 and json.loads(out)["job"]["training"]["dtype"] == "fp32", err
        # (--micro-batch 1: the Trainer's per_device_train_batch_size must match the file's 1, trainer_config_finalize)
        rc, out, err = run_main(line("estimate", root, "--ds-config", str(root / "ds.json"), "--loop", "hf-trainer",
                                     "--dtype", "bf16", "--micro-batch", "1"))
        assert rc == 0 and json.loads(out)["job"]["training"]["dtype"] == "bf16", err


def test_a_megatron_layout_flag_that_is_not_an_int_is_refused_as_its_argparse_does():
    """--tensor-model-parallel-size 2.5: megatron/arguments.py declares it type=int, so parse_args stops with
    "invalid int value"; memplan names the same flag."""
    with workdir() as root:
        (root / "launch.sh").write_text("deepspeed --num_gpus 8 pretrain_gpt.py --tensor-model-parallel-size 2.5\n")
        for command in ("check", "plan"):
            text = assert_refused(line(command, root, "--launch-file", str(root / "launch.sh")),
                                  "--launch-file --tensor-model-parallel-size", root)
            assert "invalid int value '2.5'" in text
