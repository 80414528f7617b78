"""memplan check against what the launchers really do (DeepSpeed 0.19.8, Megatron-DeepSpeed f4157bea): the
pipeline engine of pretrain_gpt.py, Megatron's client optimizer and batch reset, false positives that are gone,
deprecated keys, launch model flags against --model, host RAM against the node."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.budget import BudgetRequest
from memplan.check.command import CheckRequest, check
from memplan.check.launch import parse_launch
from memplan.check.megatron_model import line_model, model_flags, model_of_spec
from memplan.presets import load_model
from memplan.specs import ModelSpec

SEED = Path(__file__).resolve().parents[1] / "examples" / "seed-176b"
#: the article's launch with its errors corrected except the pipeline engine: tp 1, pp 1, sp 8 (real flag), ZeRO-3
#: model init, DeepSpeedCPUAdam, fp16; no --no-pipeline-parallel
CORRECTED = ("deepspeed --num_nodes 1 --num_gpus 8 pretrain_gpt.py --tensor-model-parallel-size 1 "
             "--pipeline-model-parallel-size 1 --ds-sequence-parallel-size 8 --num-layers 96 --hidden-size 12288 "
             "--num-attention-heads 96 --seq-length 32768 --max-position-embeddings 32768 --micro-batch-size 1 "
             "--global-batch-size 512 --zero-stage 3 --cpu-optimizer --fp16 --deepspeed --deepspeed_config ds.json")


@pytest.fixture
def seed_ds(tmp_path) -> str:
    """The article's DeepSpeed JSON without the keys DeepSpeed refuses or ignores."""
    cfg = json.loads((SEED / "ds_config_ulysses.json").read_text())
    for key in ("sparse_attention", "sequence_parallel"):
        cfg.pop(key)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def write(tmp_path, obj, name="ds.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(obj))
    return str(path)


def run(ds: str, line: str | None = None, model: str | None = None, **kw):
    launch = parse_launch(line) if line else None
    return check(CheckRequest(ds_config=ds, launch=launch, model=model, **kw))


def findings(result, severity: str) -> dict[str, str]:
    return {f.subject: f.message for f in result.findings if f.severity == severity}


def test_corrected_seed_launch_is_refused_by_the_pipeline_engine(seed_ds):
    """pretrain_gpt.py builds GPTModelPipe without --no-pipeline-parallel: PipelineEngine refuses ZeRO-3 at pp 1,
    and its grid (pp·tp·dp) leaves out the 8 sp ranks."""
    result = run(seed_ds, CORRECTED, "176b")
    errors = findings(result, "error")
    assert "PipelineEngine at pp=1" in errors["zero_optimization.stage"]
    assert "Invalid Grid" in errors["--no-pipeline-parallel"]
    assert result.estimate_of.startswith("nearest valid variant") and "--no-pipeline-parallel" in result.estimate_of
    assert result.estimate.job.training.megatron.pipeline_engine is False


def test_with_no_pipeline_parallel_it_runs_as_launched(seed_ds):
    result = run(seed_ds, CORRECTED + " --no-pipeline-parallel --use-flash-attn-v2", "176b")
    assert not findings(result, "error")
    assert result.estimate_of == "as launched"
    job = result.estimate.job
    assert (job.layout.sp, job.training.zero.stage, job.training.optimizer, job.training.grad_accum) == (
        8, 3, "cpu_adam", 512)  # Megatron's global batch 512 / (micro 1 × dp 1)


def test_megatron_offload_fix_is_cpu_optimizer_not_an_optimizer_section(tmp_path):
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    line = CORRECTED.replace(" --cpu-optimizer", "").replace("--ds-sequence-parallel-size 8", "--ds-sequence-parallel-size 1")
    result = run(write(tmp_path, cfg), line + " --no-pipeline-parallel", "176b")
    err = next(f for f in result.findings if f.subject == "zero_optimization.offload_optimizer")
    assert "--cpu-optimizer" in err.fix and "optimizer section" not in err.fix
    assert "never builds this section" in findings(result, "info")["optimizer"]


def test_megatron_batch_is_reset_every_iteration(seed_ds):
    result = run(seed_ds, CORRECTED.replace("--global-batch-size 512", "--global-batch-size 64")
                 + " --no-pipeline-parallel", "176b")
    assert "set_train_batch_size(64)" in findings(result, "warning")["--global-batch-size"]
    assert result.estimate.job.training.grad_accum == 64


@pytest.mark.parametrize("stage, allow, severity", [(2, True, None), (2, False, "error"), (0, False, None)])
def test_adafactor_trains_with_zero_allow_untested_optimizer(tmp_path, stage, allow, severity):
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "zero_optimization": {"stage": stage}, "optimizer": {"type": "Adafactor", "params": {"lr": 1e-3}}}
    if allow:
        cfg["zero_allow_untested_optimizer"] = True
    result = run(write(tmp_path, cfg), model="llama-3.2-1b", gpus=8)
    opt = [f for f in result.findings if f.subject == "optimizer.type"]
    assert (severity == "error") == any(f.severity == "error" for f in opt)
    assert result.estimate is not None and "AdamW's states" in " ".join(f.message for f in opt)


def _toy(kv: int, heads: int = 16, positions: int = 4096, position_embedding: str = "rope") -> ModelSpec:
    """A llama-style model (``heads`` of 64 dimensions, ``kv`` key-value heads)."""
    return ModelSpec(name="toy", family="llama", hidden_size=heads * 64, num_layers=2, num_heads=heads,
                     num_kv_heads=kv, head_dim=64, intermediate_size=1024, vocab_size=1000,
                     max_position_embeddings=positions, position_embedding=position_embedding)


@pytest.mark.parametrize("kv, sp, refused", [(4, 8, False), (8, 4, False), (2, 8, False), (6, 4, True)])
def test_ulysses_accepts_kv_heads_dividing_sp_or_sp_dividing_them(kv, sp, refused):
    """UlyssesSPAttentionHF: kv % sp == 0 or sp % kv == 0 (kv heads replicated); the estimate and check agree."""
    from memplan.check.rules_job import Layout, model_shape_rules
    from memplan.plan.space import layout_problem

    m = _toy(kv, heads=24)
    errors = [f for f in model_shape_rules(m, Layout(world=sp, sp=sp, sp_intended=sp), 4096) if f.severity == "error"]
    assert bool(errors) == refused
    assert (layout_problem(m, 4096, 1, 1, sp) is not None) == refused


def test_megatron_ulysses_needs_at_least_sp_kv_heads():
    from memplan.check.rules_job import Layout, model_shape_rules

    errors = model_shape_rules(_toy(4), Layout(world=8, sp=8, sp_intended=8), 4096, megatron=True)
    assert any("_resolve_kv_heads" in f.message for f in errors)


def test_seq_beyond_positions_is_cited_by_what_runs_the_job(tmp_path):
    from memplan.check.rules_job import Layout, model_shape_rules

    lay = Layout(world=1)
    rope = model_shape_rules(_toy(16), lay, 8192)
    assert [f.severity for f in rope] == ["info"] and "validate_args" not in rope[0].message
    learned = model_shape_rules(_toy(16, position_embedding="learned"), lay, 8192)
    assert learned[0].severity == "error" and "nn.Embedding" in learned[0].message
    cfg = write(tmp_path, {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}})
    line = CORRECTED.replace("--max-position-embeddings 32768", "--max-position-embeddings 4096")
    result = run(cfg, line, "176b")
    assert "validate_args asserts max_position_embeddings >= seq_length" in findings(result, "error")[
        "--max-position-embeddings"]


def test_cpu_offload_is_deprecated_not_removed(tmp_path):
    base = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
    result = run(write(tmp_path, {**base, "zero_optimization": {"stage": 2, "cpu_offload": True}}), gpus=8)
    assert "maps it to offload_optimizer" in findings(result, "warning")["zero_optimization.cpu_offload"]
    both = run(write(tmp_path, {**base, "zero_optimization": {"stage": 2, "cpu_offload": True,
                                                              "offload_optimizer": {"device": "cpu"}}}), gpus=8)
    assert "Cannot provide deprecated parameter" in findings(both, "error")["zero_optimization.cpu_offload"]


def test_launch_model_flags_must_agree_with_the_model(tmp_path):
    m = load_model("llama-3-70b")
    flags = " ".join(model_flags(m, 4096)).replace("--num-layers 80", "--num-layers 40")
    cfg = write(tmp_path, {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}})
    line = (f"deepspeed --num_gpus 8 pretrain_gpt.py --tensor-model-parallel-size 8 {flags} --seq-length 4096 "
            "--micro-batch-size 1 --bf16 --no-pipeline-parallel --deepspeed --deepspeed_config ds.json")
    errors = findings(run(cfg, line, "llama-3-70b"), "error")
    assert "builds 40" in errors["--num-layers"] and "has 80" in errors["--num-layers"]


@pytest.mark.parametrize("preset", ["176b", "gpt2-large", "llama-3-70b", "llama-3.2-1b", "llama-3-8b"])
def test_model_flags_describe_the_model(preset):
    """What model_flags writes is what line_model reads back, field by field."""
    m = load_model(preset)
    line = parse_launch("deepspeed pretrain_gpt.py " + " ".join(model_flags(m, 4096)))
    assert line_model(line) == model_of_spec(m, 4096)


def test_host_ram_beyond_the_node_is_a_finding(seed_ds):
    result = run(seed_ds, CORRECTED + " --no-pipeline-parallel", "176b", budget=BudgetRequest(gpu="a100-80g"))
    assert "the node has 1862.65 GiB (2.00 TB, DGX A100 640GB)" in findings(result, "warning")["--host-ram"]
    roomy = run(seed_ds, CORRECTED + " --no-pipeline-parallel", "176b",
                budget=BudgetRequest(gpu="a100-80g", host_ram_bytes=8 * 2**40))
    assert "--host-ram" not in findings(roomy, "warning")


def test_ulysses_refuses_a_mixtral_config_without_head_dim():
    """MixtralConfig keeps head_dim None when config.json has none; UlyssesSPAttentionHF reads config.head_dim and
    raises (measured: seed 1's s1-042 row failed so at init). A config giving head_dim, or another family, passes;
    plan skips the layout (check_problem)."""
    from memplan.check.rules_job import Layout, model_shape_rules
    from memplan.hfconfig import model_from_config
    from memplan.plan.space import check_problem
    from memplan.presets import load_model

    mixtral = load_model("mixtral-8x7b")
    assert mixtral.config_head_dim_unset and not load_model("mistral-7b").config_head_dim_unset
    lay = Layout(world=8, sp=4, sp_intended=4)
    assert any("head_dim" in f.message for f in model_shape_rules(mixtral, lay, 32768) if f.severity == "error")
    assert not any("head_dim" in f.message for f in model_shape_rules(mixtral, Layout(world=8), 32768))
    cfg = json.loads((Path(__file__).resolve().parent.parent / "models" / "mixtral-8x7b.json").read_text())
    fixed = model_from_config({**cfg, "head_dim": 128}, "mixtral-8x7b", "test")
    assert not any("head_dim" in f.message for f in model_shape_rules(fixed, lay, 32768))
    assert "head_dim" in (check_problem(mixtral, 32768, 8, 1, 1, 4) or "")
