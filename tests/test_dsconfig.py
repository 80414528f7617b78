"""memplan.dsconfig: reading DeepSpeed JSON as DeepSpeed 0.19.8 reads it.

Toy cases worked by hand, then a hypothesis property fed to DeepSpeed's own config classes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memplan.dsconfig import (
    apply_to_job_fields,
    batch_problem,
    derive_batch,
    ds_settings,
    load_ds_config,
)
from memplan.errors import InputError
from memplan.specs import TrainingSpec, ZeroSpec

SEED = Path(__file__).resolve().parents[1] / "examples" / "seed-176b"


def test_seed_config_reads_as_written():
    s = ds_settings(load_ds_config(SEED / "ds_config_ulysses.json"))
    assert s.zero_stage == 3
    assert s.dtype == "fp16"
    assert s.stage3_prefetch_bucket_size == 500_000_000  # written 5e8
    assert s.reduce_bucket_size == 100_000_000  # written 1e8
    assert s.offload_optimizer == "cpu" and s.offload_optimizer_pin_memory is True
    assert s.optimizer is None  # no optimizer section: the client's optimizer is used
    assert (s.train_batch_size, s.micro_batch, s.grad_accum) == (512, 1, None)
    assert s.fp16_loss_scale_window == 100


def test_invalid_json_names_line_and_column(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text('{"a": 1,\n "b": }')
    with pytest.raises(InputError) as e:
        load_ds_config(p)
    assert e.value.field == "--ds-config"
    assert "line 2 column 7" in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_file_and_non_object(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        load_ds_config(tmp_path / "nope.json")
    p = tmp_path / "list.json"
    p.write_text("[1, 2]")
    with pytest.raises(InputError, match="JSON object"):
        load_ds_config(p)


@pytest.mark.parametrize(
    "cfg, field",
    [
        ({"zero_optimization": {"stage": 5}}, "zero_optimization.stage"),
        ({"zero_optimization": {"reduce_bucket_size": -1}}, "zero_optimization.reduce_bucket_size"),
        ({"zero_optimization": {"reduce_bucket_size": 0}}, "zero_optimization.reduce_bucket_size"),
        ({"zero_optimization": {"sub_group_size": 1.5}}, "zero_optimization.sub_group_size"),
        ({"zero_optimization": {"offload_param": {"device": "gpu"}}}, "zero_optimization.offload_param.device"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled"),
        ({"optimizer": {"type": "Lamb"}}, "optimizer.type"),
        ({"data_types": {"grad_accum_dtype": "int8"}}, "data_types.grad_accum_dtype"),
        ({"seq_parallel_communication_data_type": "fp8"}, "seq_parallel_communication_data_type"),
        ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu"),
    ],
)
def test_invalid_values_name_the_key_path(cfg, field):
    with pytest.raises(InputError) as e:
        ds_settings(cfg)
    assert e.value.field == field


def test_auto_in_a_section_means_deepspeeds_default():
    s = ds_settings({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}, "train_batch_size": "auto"},
                    hf=True)
    assert s.reduce_bucket_size is None and s.train_batch_size is None
    assert "zero_optimization.reduce_bucket_size" in s.auto_keys and "train_batch_size" in s.auto_keys


@pytest.mark.parametrize("key", ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"])
def test_auto_batch_sizes_are_refused_without_the_hf_trainer(key):
    """DeepSpeedConfig keeps a top-level "auto" as the string and _batch_assertion compares it with 0
    (TypeError); only the HF Trainer fills it (HfTrainerDeepSpeedConfig.trainer_config_process)."""
    with pytest.raises(InputError) as e:
        ds_settings({key: "auto"})
    assert e.value.field == key and "Hugging Face Trainer" in e.value.message
    assert getattr(ds_settings({key: "auto"}, hf=True), {"train_batch_size": "train_batch_size",
                   "train_micro_batch_size_per_gpu": "micro_batch", "gradient_accumulation_steps": "grad_accum"}[key]) \
        is None


@pytest.mark.parametrize("section", ["zero_optimization", "optimizer", "fp16", "bf16", "data_types",
                                     "tensor_parallel", "activation_checkpointing"])
@pytest.mark.parametrize("value", ["auto", None, 3, [1]])
@pytest.mark.parametrize("hf", [False, True])
def test_a_section_that_is_not_an_object_is_refused(section, value, hf):
    """DeepSpeed 0.19.8 fails on each (DeepSpeedZeroConfig(**"auto"): TypeError; param_dict["optimizer"].keys():
    AttributeError; ...), and so does the HF path (find_config_node calls .get on it). bf16: null falls back to
    the old "bfloat16" key (get_bfloat16_config), so it is not an error."""
    if section == "bf16" and value is None:
        assert ds_settings({section: value}).dtype == "fp32"
        return
    with pytest.raises(InputError) as e:
        ds_settings({section: value}, hf=hf)
    assert e.value.field == section


def test_what_deepspeed_accepts_is_accepted():
    """"stage": "3" (pydantic's lax int in DeepSpeedZeroConfig), "auto" inside a section (dropped)."""
    assert ds_settings({"zero_optimization": {"stage": "3"}}).zero_stage == 3
    assert ds_settings({"zero_optimization": {"stage": 2, "reduce_bucket_size": "500"}}).reduce_bucket_size == 500
    assert ds_settings({"zero_optimization": {"stage": 3, "offload_optimizer": "auto"}}).offload_optimizer is None
    for bad in ("5e8", 1.5, "x"):  # pydantic refuses these, so DeepSpeed does
        with pytest.raises(InputError):
            ds_settings({"zero_optimization": {"reduce_bucket_size": bad}})


def test_aliases_and_deprecated_keys():
    s = ds_settings({"zero_optimization": {"stage": 3, "prefetch_bucket_size": 1e6, "cpu_offload": True}})
    assert s.stage3_prefetch_bucket_size == 1_000_000
    assert s.offload_optimizer == "cpu"
    assert ds_settings({"zero_optimization": True}).zero_stage == 1  # read_zero_config_deprecated


@pytest.mark.parametrize(
    "cfg, expected",
    [
        ({"optimizer": {"type": "AdamW"}}, "adamw"),
        ({"optimizer": {"type": "Adam", "params": {"torch_adam": True}}}, "torch_adamw"),
        ({"optimizer": {"type": "Adam"}, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
         "cpu_adam"),
        ({"optimizer": {"type": "SGD"}}, "sgd"),
        ({"optimizer": {"type": "Lion"}}, "lion"),
    ],
)
def test_optimizer_choice(cfg, expected):
    assert ds_settings(cfg).optimizer == expected


def test_precision_defaults_to_fp32_without_fp16_or_bf16():
    assert ds_settings({}).dtype == "fp32"
    assert ds_settings({"bf16": {"enabled": True}}).dtype == "bf16"
    assert ds_settings({"bfloat16": {"enabled": True}}).dtype == "bf16"  # the old key
    # "auto": DeepSpeedConfigModel drops it (fp16/bf16 off → fp32); the HF Trainer fills it (unknown here)
    assert ds_settings({"bf16": {"enabled": "auto"}}).dtype == "fp32"
    assert ds_settings({"bf16": {"enabled": "auto"}}, hf=True).dtype is None


# Batch arithmetic, worked by hand (DeepSpeedConfig._set_batch_related_parameters):
#   train 512, micro 1, dp 2       → accum = 512 // 1 // 2 = 256
#   train 512, accum 4, dp 8       → micro = 512 // 8 // 4 = 16
#   micro 2, accum 3, dp 4         → train = 2·3·4 = 24
#   train 64 alone, dp 8           → accum 1, micro 8
#   micro 4 alone, dp 8            → train 32, accum 1
@pytest.mark.parametrize(
    "given_, dp, expected",
    [
        ((512, 1, None), 2, (512, 1, 256)),
        ((512, None, 4), 8, (512, 16, 4)),
        ((None, 2, 3), 4, (24, 2, 3)),
        ((64, None, None), 8, (64, 8, 1)),
        ((None, 4, None), 8, (32, 4, 1)),
    ],
)
def test_derive_batch(given_, dp, expected):
    batch = derive_batch(*given_, dp=dp)
    assert (batch["train_batch_size"], batch["micro_batch"], batch["grad_accum"]) == expected
    assert batch_problem(batch, dp) is None


def test_batch_mismatch_shows_the_arithmetic():
    # 512 given with micro 1 and accum 1 on dp 8: 1·1·8 = 8 ≠ 512
    problem = batch_problem(derive_batch(512, 1, 1, 8), 8)
    assert problem is not None and "512" in problem and "= 8" in problem
    with pytest.raises(InputError, match="train_batch_size"):
        ds_settings({"train_batch_size": 512, "train_micro_batch_size_per_gpu": 1,
                     "gradient_accumulation_steps": 1}, dp=8)
    with pytest.raises(InputError):
        derive_batch(None, None, 4, 8)


def test_apply_to_job_fields_builds_valid_specs():
    s = ds_settings(load_ds_config(SEED / "ds_config_ulysses.json"))
    fields = apply_to_job_fields(s)
    zero = ZeroSpec(**fields["zero"])
    assert zero.stage == 3 and zero.offload_optimizer == "cpu" and zero.overlap
    training = TrainingSpec(seq_len=32768, zero=zero, **fields["training"])
    assert training.dtype == "fp16" and training.micro_batch == 1
    assert fields["layout"] == {}
    sp = apply_to_job_fields(ds_settings({"sequence_parallel_size": 4, "tensor_parallel": {"autotp_size": 2}}))
    assert sp["layout"] == {"sp": 4, "tp": 2}


# --- agreement with DeepSpeed's own classes ------------------------------------------------------

_ZERO_KEYS = ["stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "contiguous_gradients",
              "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_live_parameters",
              "sub_group_size", "offload_optimizer", "offload_param"]
_values = st.one_of(
    st.integers(-2, 6), st.sampled_from([5e8, 1e9, 1.5, "auto", True, False, "x"]),
    st.fixed_dictionaries({"device": st.sampled_from(["cpu", "nvme", "none", "gpu", "auto"])}),
)
zero_sections = st.dictionaries(st.sampled_from(_ZERO_KEYS), _values, max_size=5)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(zero_sections)
def test_zero_section_agrees_with_deepspeed(section):
    """memplan refuses a zero_optimization section iff DeepSpeedZeroConfig(**section) raises (for the keys
    memplan reads; offload ratio/zenflow checks are out of scope). Exceptions: booleans where DeepSpeed's
    lax int accepts them (True == 1) — memplan is stricter there, and says so."""
    zc = pytest.importorskip("deepspeed.runtime.zero.config")
    try:
        ds = zc.DeepSpeedZeroConfig(**section)
        ds_ok = True
    except (ValueError, TypeError, AssertionError):  # pydantic ValidationError is a ValueError
        ds_ok = False
    try:
        ds_settings({"zero_optimization": section})
        ours_ok = True
    except InputError:
        ours_ok = False
    has_bool_int = any(isinstance(v, bool) for k, v in section.items() if k not in ("overlap_comm",
                                                                                    "contiguous_gradients"))
    has_int_as_bool = any(isinstance(v, int) and not isinstance(v, bool) and v in (0, 1)
                          for k, v in section.items() if k in ("overlap_comm", "contiguous_gradients"))
    if has_bool_int or has_int_as_bool:
        assert not (ours_ok and not ds_ok)
        return
    assert ours_ok == ds_ok, f"DeepSpeed {'accepts' if ds_ok else 'refuses'} {json.dumps(section)}"
    if ds_ok:
        got = ds_settings({"zero_optimization": section})
        if "stage" in section and section["stage"] != "auto":
            assert got.zero_stage == int(ds.stage)
