"""memplan.options / memplan.resolve: the shared job flags, their defaults (the article's job for its model) and
their precedence."""

from __future__ import annotations

import argparse
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan import options, resolve
from memplan.errors import InputError
from memplan.specs import ModelSpec

#: a toy llama-style model, so these tests do not depend on the presets
TOY = ModelSpec(
    name="toy", family="llama", hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=8, head_dim=32,
    intermediate_size=512, vocab_size=1000, max_position_embeddings=65536,
)

#: the shared job flags ("keep these names: other tools script against them"), minus estimate's own
ISSUE_FLAGS = (
    "--model", "--seq", "--micro-batch", "--grad-accum", "--gpus", "--gpus-per-node", "--tp", "--pp", "--sp",
    "--zero", "--offload-optimizer", "--offload-param", "--dtype", "--checkpointing", "--attention", "--ds-config",
)


@pytest.fixture(autouse=True)
def toy_model(monkeypatch):
    monkeypatch.setattr(resolve, "_load_model", lambda name, flag="--model": TOY)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    options.add_job_arguments(parser)
    return parser.parse_args(list(argv))


def job(*argv: str):
    return options.job_from_args(parse(*argv))


def write_json(tmp_path, obj) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(obj))
    return str(path)


def test_job_flags_exist_and_default_to_none():
    parser = argparse.ArgumentParser()
    options.add_job_arguments(parser)
    flags = {s for a in parser._actions for s in a.option_strings}
    assert set(ISSUE_FLAGS) | {"--optimizer"} <= flags
    assert "--layers" not in flags  # verify's own flag
    ns = parser.parse_args([])
    assert all(v is None for v in vars(ns).values())


def test_no_flags_is_the_articles_job():
    j = job()
    t, z, lay = j.training, j.training.zero, j.layout
    assert (t.seq_len, t.micro_batch, t.dtype) == (32768, 1, "fp16")
    assert (lay.world, lay.sp, lay.tp, lay.pp, lay.dp) == (8, 8, 1, 1, 1)
    assert (z.stage, z.offload_optimizer, z.offload_param) == (3, "cpu", "none")
    assert t.optimizer == "cpu_adam"  # DeepSpeedCPUAdam under optimizer offload
    assert z.stage3_prefetch_bucket_size == 500_000_000 and z.reduce_bucket_size == 100_000_000


def test_seed_fields_match_the_seed_ds_config_when_present():
    from pathlib import Path

    seed = Path(__file__).resolve().parents[1] / "examples" / "seed-176b" / "ds_config_ulysses.json"
    if not seed.is_file():
        pytest.skip("examples/seed-176b/ not in this checkout")
    fields, _, _ = resolve.resolved_fields(options.request_of(parse("--ds-config", str(seed))))
    assert fields["zero"] == resolve.ARTICLE_FIELDS["zero"]
    assert (fields["dtype"], fields["micro_batch"]) == (resolve.ARTICLE_FIELDS["dtype"],
                                                        resolve.ARTICLE_FIELDS["micro_batch"])


def test_flags_override_the_defaults():
    j = job("--zero", "2", "--offload-optimizer", "none", "--dtype", "bf16", "--sp", "1", "--gpus", "4",
            "--micro-batch", "2", "--checkpointing", "full", "--attention", "flash", "--seq", "4096")
    t = j.training
    assert (t.zero.stage, t.zero.offload_optimizer, t.dtype, t.optimizer) == (2, "none", "bf16", "adamw")
    assert (j.layout.world, j.layout.sp, j.layout.dp) == (4, 1, 4)
    assert (t.micro_batch, t.checkpointing, t.attention, t.seq_len) == (2, "full", "flash", 4096)


def test_ds_config_replaces_the_seed_and_flags_override_it(tmp_path):
    path = write_json(tmp_path, {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 2e8},
    })
    j = job("--ds-config", path)
    t = j.training
    assert (t.zero.stage, t.zero.offload_optimizer, t.dtype, t.micro_batch, t.grad_accum) == (2, "none", "bf16", 2, 4)
    assert t.zero.reduce_bucket_size == 200_000_000
    assert j.layout.sp == 1  # DeepSpeed's default, not the seed's 8
    j2 = job("--ds-config", path, "--zero", "1", "--micro-batch", "3")
    assert (j2.training.zero.stage, j2.training.micro_batch, j2.training.grad_accum) == (1, 3, 4)
    assert j2.training.zero.reduce_bucket_size == 200_000_000


def test_ds_config_batch_is_derived_as_deepspeed_does(tmp_path):
    # train 512 = micro 1 × accum × dp 8 → accum 64 (DeepSpeedConfig._set_batch_related_parameters)
    path = write_json(tmp_path, {"train_batch_size": 512, "train_micro_batch_size_per_gpu": 1})
    assert job("--ds-config", path).training.grad_accum == 64
    assert job("--ds-config", path, "--gpus", "16").training.grad_accum == 32


@pytest.mark.parametrize(
    ("argv", "flag", "words"),
    [
        (("--gpus", "6"), "--gpus", "1·1·8 = 8"),
        (("--sp", "3"), "--sp", "1·1·3 = 3"),
        (("--sp", "1", "--tp", "3"), "--tp", "3·1·1 = 3"),
        (("--seq", "100"), "--seq", "seq (100) must be divisible by sp (8)"),
        (("--zero", "2", "--offload-param", "cpu"), "--offload-param", "stage 3"),
        (("--zero", "0"), "--offload-optimizer", "stage 1, 2 or 3"),
        (("--offload-optimizer", "none", "--optimizer", "cpu_adam"), "--optimizer", "cpu_adam"),
        (("--sp", "1", "--pp", "2"), "--zero", "pipeline"),
    ],
)
def test_errors_name_the_flag_and_keep_the_arithmetic(argv, flag, words):
    with pytest.raises(InputError) as info:
        job(*argv)
    assert info.value.field == flag
    assert words in info.value.message
    assert "\n" not in str(info.value)


def test_defaulted_sp_says_so():
    with pytest.raises(InputError, match="defaults to the article's 8"):
        job("--gpus", "4")


def test_ds_config_values_are_named_by_their_key(tmp_path):
    path = write_json(tmp_path, {"train_micro_batch_size_per_gpu": 1,
                                 "zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}}})
    with pytest.raises(InputError) as info:
        job("--ds-config", path)
    assert info.value.field == "--ds-config zero_optimization.offload_param.device"


def test_unreadable_ds_config_names_the_flag(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for path in (str(bad), str(tmp_path / "missing.json")):
        with pytest.raises(InputError) as info:
            job("--ds-config", path)
        assert info.value.field == "--ds-config"


@pytest.mark.parametrize("bad", ["0", "-3", "abc", "1.5", "", str(2**40 + 1), "9" * 5000])
def test_sizes_must_be_positive_integers(bad):
    with pytest.raises(argparse.ArgumentTypeError, match="positive integer"):
        options.positive_int(bad)


@settings(max_examples=60, deadline=None)
@given(
    zero=st.sampled_from([1, 2, 3]), dtype=st.sampled_from(["bf16", "fp16", "fp32"]),
    sp=st.sampled_from([1, 2, 4, 8]), dp=st.sampled_from([1, 2, 3]), micro=st.integers(1, 4),
    ckpt=st.sampled_from(["none", "selective", "full"]), offload=st.sampled_from(["none", "cpu", "nvme"]),
)
def test_explicit_flags_always_win(zero, dtype, sp, dp, micro, ckpt, offload):
    j = job("--zero", str(zero), "--dtype", dtype, "--sp", str(sp), "--gpus", str(sp * dp), "--micro-batch",
            str(micro), "--checkpointing", ckpt, "--offload-optimizer", offload, "--seq", str(1024 * sp))
    t = j.training
    assert (t.zero.stage, t.dtype, t.micro_batch, t.checkpointing, t.zero.offload_optimizer) == (
        zero, dtype, micro, ckpt, offload)
    assert (j.layout.sp, j.layout.dp) == (sp, dp)
    assert t.optimizer == ("cpu_adam" if offload != "none" else "adamw")
