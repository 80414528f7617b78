"""to_ds_config: the DeepSpeed config a Job stands for, checked against DeepSpeed's own config parser."""

from __future__ import annotations

import pytest

from memplan.dsconfig_emit import NVME_PATH, to_ds_config
from memplan.errors import InputError
from memplan.specs import Job, Layout, ModelSpec, TrainingSpec, ZeroSpec

TINY = ModelSpec(
    name="tiny-llama", family="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16,
    intermediate_size=128, vocab_size=256, max_position_embeddings=512,
)


def job(world=1, sp=1, **training) -> Job:
    zero = training.pop("zero", ZeroSpec())
    return Job(model=TINY, training=TrainingSpec(seq_len=128, zero=zero, **training), layout=Layout(world=world, sp=sp))


CASES = [
    job(),
    job(world=8, micro_batch=2, grad_accum=4, zero=ZeroSpec(stage=1)),
    job(world=4, dtype="fp16", zero=ZeroSpec(stage=2, overlap_comm=True, reduce_bucket_size=12345)),
    job(world=8, sp=4, zero=ZeroSpec(stage=3), sp_comm_dtype="bf16"),
    job(world=2, optimizer="cpu_adam", zero=ZeroSpec(stage=3, offload_optimizer="cpu", offload_param="nvme")),
    job(world=2, optimizer="torch_adamw", zero=ZeroSpec(stage=2), grad_accum_dtype="fp32"),
    job(world=2, optimizer="sgd", zero=ZeroSpec(stage=1)),
    job(world=2, optimizer="lion", dtype="fp32", zero=ZeroSpec(stage=2)),
]


def test_batch_size_is_micro_times_accum_times_dp():
    # world 8, sp 1 → dp 8; 2 sequences × 4 micro-steps × 8 ranks = 64
    assert to_ds_config(CASES[1])["train_batch_size"] == 64
    # world 8, sp 4 → dp 2; 1 × 1 × 2 = 2
    cfg = to_ds_config(CASES[3])
    assert cfg["train_batch_size"] == 2
    assert cfg["sequence_parallel_size"] == 4 and cfg["seq_parallel_communication_data_type"] == "bf16"


def test_every_zero_field_is_written():
    z = to_ds_config(CASES[0])["zero_optimization"]
    for field in ZeroSpec.model_fields:
        if field in ("overlap_comm", "pin_memory"):
            continue
        assert field in z, field
    assert z["overlap_comm"] is False  # stage 0 resolves None → False
    assert to_ds_config(CASES[3])["zero_optimization"]["overlap_comm"] is True  # stage 3 → True
    assert z["offload_optimizer"]["pin_memory"] is True


def test_optimizer_mapping_and_dtypes():
    assert to_ds_config(CASES[0])["optimizer"]["type"] == "AdamW"
    assert to_ds_config(CASES[0])["bf16"]["enabled"] and not to_ds_config(CASES[0])["fp16"]["enabled"]
    fp16 = to_ds_config(CASES[2])
    assert fp16["fp16"]["enabled"] and fp16["fp16"]["loss_scale"] == 0
    assert to_ds_config(CASES[4])["zero_optimization"]["offload_param"]["nvme_path"] == NVME_PATH
    assert to_ds_config(CASES[5])["optimizer"]["params"]["torch_adam"] is True
    assert to_ds_config(CASES[5])["data_types"] == {"grad_accum_dtype": "fp32"}
    assert to_ds_config(CASES[6])["optimizer"]["type"] == "SGD"
    assert to_ds_config(CASES[6])["zero_allow_untested_optimizer"] is True
    lion = to_ds_config(CASES[7])
    assert lion["optimizer"]["type"] == "Lion" and not lion["bf16"]["enabled"] and not lion["fp16"]["enabled"]


def test_inconsistent_optimizer_is_an_input_error():
    with pytest.raises(InputError, match="^optimizer: "):
        to_ds_config(job(optimizer="cpu_adam"))
    with pytest.raises(InputError, match="^optimizer: "):
        to_ds_config(job(world=2, optimizer="torch_adamw", zero=ZeroSpec(stage=2, offload_optimizer="cpu")))


def test_emission_is_pure():
    assert to_ds_config(CASES[1]) == to_ds_config(CASES[1])
    assert to_ds_config(CASES[1]) is not to_ds_config(CASES[1])


@pytest.mark.parametrize("case", range(len(CASES)))
def test_deepspeed_parses_what_we_emit(case, monkeypatch):
    pytest.importorskip("torch")
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    j = CASES[case]
    # DeepSpeedConfig reads the world size from deepspeed.comm; pretend it is initialised with j's world.
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(ds_config.dist, "get_world_size", lambda *a, **k: j.layout.world)
    cfg = ds_config.DeepSpeedConfig(to_ds_config(j))
    t = j.training
    assert cfg.train_batch_size == t.micro_batch * t.grad_accum * j.layout.dp
    assert cfg.gradient_accumulation_steps == t.grad_accum
    assert cfg.zero_optimization_stage == t.zero.stage
    assert cfg.zero_config.overlap_comm == t.zero.overlap
    assert cfg.zero_config.reduce_bucket_size == t.zero.reduce_bucket_size
    assert cfg.bfloat16_config.enabled == (t.dtype == "bf16")
    assert cfg.float16_config.enabled == (t.dtype == "fp16")
    offload = cfg.zero_config.offload_optimizer
    assert (offload.device if offload else "none") == t.zero.offload_optimizer
