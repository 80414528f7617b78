"""verify with tensor parallelism (DeepSpeed AutoTP) and pipeline parallelism (DeepSpeed PipelineModule).

On the CPU (DS_ACCELERATOR=cpu, gloo under torchrun for real ranks) every memory counter reads 0, so these
tests check the flow: what is refused and why, the DeepSpeed config, the stages each rank builds, AutoTP's
mesh and first-batch consistency check, and that the matrix for the two-GPU machine parses and is accepted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.dsconfig_emit import to_ds_config
from memplan.specs import Job, Layout, ModelSpec, TrainingSpec, ZeroSpec
from memplan.verify import batch, runner, worker

MATRIX = Path(__file__).resolve().parents[1] / "benchmarks" / "accuracy" / "matrix4-tp-pp-x2.jsonl"

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 512,
              "tie_word_embeddings": True}
TINY_GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 4, "n_head": 4, "vocab_size": 256, "n_positions": 512}

SPEC = ModelSpec(name="tiny-llama", family="llama", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                 head_dim=16, intermediate_size=128, vocab_size=256, max_position_embeddings=512)


def _job(model=SPEC, world=2, tp=1, pp=1, **training) -> Job:
    training.setdefault("optimizer", "torch_adamw")
    training.setdefault("seq_len", 64)
    return Job(model=model, training=TrainingSpec(**training), layout=Layout(world=world, tp=tp, pp=pp))


def _refusal(job: Job, mode: str) -> str | None:
    try:
        worker.check_supported(job, mode)
    except worker.Unsupported as exc:
        return str(exc)
    return None


def test_autotp_config_counts_every_rank_in_the_batch():
    # world 4, tp 2 → dp 2; DeepSpeed checks the batch before AutoTP's mesh exists: 2 × 3 × 4 ranks
    cfg = to_ds_config(_job(world=4, tp=2, micro_batch=2, grad_accum=3, zero=ZeroSpec(stage=1)))
    assert cfg["tensor_parallel"] == {"autotp_size": 2}
    assert cfg["train_batch_size"] == 2 * 3 * 4
    # pp: the pipeline engine counts data-parallel ranks only (world 4, pp 2 → dp 2): 1 × 2 × 2
    cfg = to_ds_config(_job(world=4, pp=2, grad_accum=2))
    assert cfg["train_batch_size"] == 1 * 2 * 2 and "tensor_parallel" not in cfg


def test_what_tp_and_pp_refuse():
    assert "--launch" in _refusal(_job(tp=2, zero=ZeroSpec(stage=1)), "emulated")
    assert _refusal(_job(tp=2, zero=ZeroSpec(stage=2)), "real") is None
    assert "ZeRO 3" in _refusal(_job(tp=2, zero=ZeroSpec(stage=3)), "real")
    assert _refusal(_job(pp=2, grad_accum=2, zero=ZeroSpec(stage=1)), "emulated") is None
    assert "--grad-accum" in _refusal(_job(pp=2, grad_accum=1), "emulated")
    assert "eager" in _refusal(_job(pp=2, grad_accum=2, attention="eager"), "emulated")
    assert "checkpointing" in _refusal(_job(pp=2, grad_accum=2, checkpointing="full"), "emulated")


def test_matrix_rows_parse_and_are_accepted(tmp_path):
    lines = [json.loads(x) for x in MATRIX.read_text().splitlines() if x.strip()]
    assert 8 <= len(lines) <= 12
    items = [batch.parse_item(line, str(tmp_path)) for line in lines]
    assert [i.error for i in items] == [None] * len(items)
    assert len({i.name for i in items}) == len(items)
    for item in items:
        job, launch = item.job, item.opts["launch"]
        assert job.training.seq_len <= 4096 and (not launch or job.layout.world <= 2), item.name
        assert _refusal(job, "real" if launch else "emulated") is None, item.name
    tp = [i.job for i in items if i.job.layout.tp == 2]
    assert {j.training.zero.stage for j in tp} == {1, 2} and {j.training.checkpointing for j in tp} == {"none", "full"}
    assert len({j.model.family for j in tp}) == 2
    pp = [i.job for i in items if i.job.layout.pp > 1]
    assert {j.layout.pp for j in pp} == {2, 4} and {j.training.zero.stage for j in pp} == {0, 1}
    assert {j.training.micro_batch for j in pp} == {1, 4} and {j.model.family for j in pp} == {"llama", "gpt2"}


def _tiny(tmp_path, config: dict, name: str):
    from memplan.presets import load_model

    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    return load_model(str(path))


def _stage_params(row) -> list[int]:
    return [r["stage_params"] for r in row["per_rank"]]


@pytest.mark.slow
@pytest.mark.parametrize("config", [TINY_LLAMA, TINY_GPT2], ids=["llama", "gpt2"])
def test_pipeline_emulates_first_and_last_stage(tmp_path, config):
    pytest.importorskip("torch")
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    model = _tiny(tmp_path, config, config["model_type"])
    job = _job(model, world=2, pp=2, grad_accum=2, zero=ZeroSpec(stage=1))
    row = runner.measure_job(job, name="pp2", out_dir=str(tmp_path), steps=2, device="cpu", timeout_s=300)
    assert row["status"] == "ok", row["error"]
    assert [r["rank"] for r in row["per_rank"]] == [0, 1] and [r["pp_stage"] for r in row["per_rank"]] == [0, 1]
    stages = [json.loads((tmp_path / "work" / "pp2" / "full" / f"rank{r}.json").read_text()) for r in (0, 1)]
    first, last = ([p["name"] for p in st["phases"]] for st in stages)
    assert first[:2] == last[:2] == ["init", "step0.setup"] and first[-1] == last[-1] == "step1.step"
    # 1F1B with 2 stages and 2 micro-batches: the first stage runs both forwards before its first backward,
    # the last stage alternates
    f, b = "forward", "backward"
    assert [n for n in first if n.startswith("step1.micro")] == [f"step1.micro{m}.{k}" for m, k in
                                                                 ((0, f), (1, f), (0, b), (1, b))]
    assert [n for n in last if n.startswith("step1.micro")] == [f"step1.micro{m}.{k}" for m, k in
                                                                ((0, f), (0, b), (1, f), (1, b))]
    assert row["global_steps"] == 2 and row["skipped_steps"] == 0
    # the stages hold every parameter once, except the tied embedding, which the first and last stage both hold
    tied = model.vocab_size * model.hidden_size
    assert sum(_stage_params(row)) == row["meta_params"] + tied


@pytest.mark.slow
def test_pipeline_four_stages_emulated(tmp_path):
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    model = _tiny(tmp_path, TINY_LLAMA, "llama")
    job = _job(model, world=4, pp=4, grad_accum=4, micro_batch=2)
    row = runner.measure_job(job, name="pp4", out_dir=str(tmp_path), steps=1, device="cpu", timeout_s=300)
    assert row["status"] == "ok", row["error"]
    assert [(r["rank"], r["pp_stage"]) for r in row["per_rank"]] == [(0, 0), (3, 3)]


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["tp", "pp"])
def test_real_ranks_on_cpu(tmp_path, parallel):
    """torchrun + gloo: AutoTP shards the tiny Llama and passes its first-batch consistency check; PP 1F1B."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    model = _tiny(tmp_path, TINY_LLAMA, "llama")
    if parallel == "tp":
        job = _job(model, world=2, tp=2, grad_accum=2, zero=ZeroSpec(stage=2), checkpointing="full")
    else:
        job = _job(model, world=2, pp=2, grad_accum=2)
    row = runner.measure_job(job, name=parallel, out_dir=str(tmp_path), steps=2, launch=True, device="cpu",
                             timeout_s=300)
    assert row["status"] == "ok", row["error"]
    assert row["mode"] == "real" and row["global_steps"] == 2
    if parallel == "tp":
        assert [(r["tp_rank"], r["dp_rank"]) for r in row["per_rank"]] == [(0, 0), (1, 0)]
        assert row["ds_config"]["tensor_parallel"] == {"autotp_size": 2}
        # AutoTP shards: each rank holds fewer parameters than the whole model, the two together at least all
        held = [r["rank_params"] for r in row["per_rank"]]
        assert max(held) < row["meta_params"] <= sum(held)
    else:
        assert [r["pp_stage"] for r in row["per_rank"]] == [0, 1]
