"""The defaults a user expects (memplan.resolve): the article's settings for the article's model, neutral ones
for any other, and every output saying where each value came from; the node budgets of estimate and check."""

from __future__ import annotations

import json

import pytest

from memplan.budget import BudgetRequest, node_checks, resolve_budget
from memplan.cli import main
from memplan.nodes import NODES
from memplan.presets import load_model
from memplan.resolve import ARTICLE_FIELDS, NEUTRAL_SEQ, JobRequest, resolve_job
from memplan.specs import ZeroSpec


def run_json(capsys, *argv):
    rc = main([*argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def by_field(sources) -> dict:
    return {s["field"]: s for s in sources}


def test_another_model_gets_neutral_defaults():
    """llama-3-8b: DeepSpeed's ZeRO defaults (stage 0, no offload, its buckets), bf16, FusedAdam, seq
    min(4096, 8192) = 4096, one 8-GPU node, no Ulysses: not the article's 5.96 GiB job."""
    job = resolve_job(JobRequest(model="llama-3-8b")).job
    t, lay = job.training, job.layout
    assert t.zero.model_dump(exclude={"overlap_comm"}) == ZeroSpec().model_dump(exclude={"overlap_comm"})
    assert (t.dtype, t.optimizer, t.seq_len, t.micro_batch, t.grad_accum) == ("bf16", "adamw", 4096, 1, 1)
    assert (lay.world, lay.gpus_per_node, lay.sp, lay.tp, lay.pp) == (8, 8, 1, 1, 1)


@pytest.mark.parametrize("model", ["gpt2-large", "llama-3.2-1b", "qwen2.5-0.5b"])
def test_neutral_seq_is_capped_by_the_models_positions(model):
    m = load_model(model)
    assert resolve_job(JobRequest(model=model)).job.training.seq_len == min(NEUTRAL_SEQ, m.max_position_embeddings)


def test_the_article_keeps_its_settings_with_or_without_its_model_named():
    bare = resolve_job(JobRequest()).job
    named = resolve_job(JobRequest(model="176b", seq=32768, sp=8)).job
    assert bare == named
    t = bare.training
    assert (t.seq_len, t.dtype, bare.layout.sp, bare.layout.world) == (32768, "fp16", 8, 8)
    assert {k: getattr(t.zero, k) for k in ARTICLE_FIELDS["zero"]} == ARTICLE_FIELDS["zero"]
    assert t.optimizer == "cpu_adam"  # DeepSpeedCPUAdam under the article's optimizer offload


def test_fp16_on_a_gpu_without_bf16():
    assert resolve_job(JobRequest(model="llama-3.2-1b", gpu="v100-16g")).job.training.dtype == "fp16"
    assert resolve_job(JobRequest(model="llama-3.2-1b", gpu="a100-80g")).job.training.dtype == "bf16"


def test_estimate_json_says_where_each_value_came_from(capsys):
    rc, out = run_json(capsys, "estimate", "--model", "llama-3-8b", "--seq", "2048")
    assert rc == 0
    src = by_field(out["sources"])
    assert src["training.seq_len"]["source"] == "flag" and src["training.seq_len"]["value"] == 2048
    assert src["model"]["source"] == "flag"
    assert src["training.zero.stage"]["source"] == "deepspeed" and src["training.zero.stage"]["value"] == 0
    assert src["training.dtype"]["source"] == "memplan" and src["layout.world"]["source"] == "memplan"
    assert src["training.attention"]["source"] == "memplan"
    job = out["job"]
    assert src["training.zero.reduce_bucket_size"]["value"] == job["training"]["zero"]["reduce_bucket_size"]
    assert all(s["source"] in ("article", "deepspeed", "memplan", "file", "flag", "derived") for s in out["sources"])


def test_bare_estimate_names_the_article_as_the_source(capsys):
    rc, out = run_json(capsys, "estimate")
    assert rc == 0
    src = by_field(out["sources"])
    for field in ("model", "training.seq_len", "layout.sp", "training.dtype", "training.zero.stage",
                  "training.zero.stage3_prefetch_bucket_size", "gpu"):
        assert src[field]["source"] == "article", field
    assert src["training.optimizer"]["source"] == "derived"
    assert out["gpu_name"] == "a100-80g" and out["node"]["name"] == NODES["a100-80g"].name


def test_ds_config_values_are_sourced_by_key(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2,
                                "zero_optimization": {"stage": 2, "reduce_bucket_size": 2e8}}))
    _rc, out = run_json(capsys, "estimate", "--model", "llama-3.2-1b", "--ds-config", str(path))
    src = by_field(out["sources"])
    assert src["training.zero.stage"] == {"field": "training.zero.stage", "value": 2, "source": "file",
                                          "origin": "--ds-config zero_optimization.stage"}
    assert src["training.grad_accum"]["source"] == "derived" and src["training.grad_accum"]["value"] == 4  # 64/2/8
    assert src["training.dtype"]["source"] == "file"  # DeepSpeed's fp32 without an fp16/bf16 section


def test_the_table_lists_the_defaults(capsys):
    assert main(["estimate", "--model", "llama-3.2-1b"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "memplan's defaults:" in text and "seq 4096 (min(4096, max positions 131072))" in text
    assert "DeepSpeed's defaults: ZeRO stage 0" in text


def test_node_budget_defaults_to_the_gpus_usual_node():
    a100 = resolve_budget(BudgetRequest(gpu="a100-80g"))
    assert (a100.host_ram_bytes_per_node, a100.nvme_bytes_per_node) == (2 * 10**12, 30 * 10**12)
    mine = resolve_budget(BudgetRequest(gpu="a100-80g", host_ram_bytes=10**12))
    assert mine.host_ram_bytes_per_node == 10**12 and mine.host_ram_origin == "--host-ram"
    none = resolve_budget(BudgetRequest())
    assert node_checks(1, 1, none) == []


def test_the_articles_job_needs_more_pinned_host_ram_than_a_dgx_a100(capsys):
    """The article's job pins more host RAM per node than the 2 TB of a DGX A100 640GB: estimate's node verdict."""
    _, out = run_json(capsys, "estimate")
    assert out["host_bytes_per_node"] > NODES["a100-80g"].host_ram_bytes
    assert out["node"]["fits_host_ram"] is False and out["node"]["fits_nvme"] is True
    _rc, out = run_json(capsys, "estimate", "--host-ram", "4TiB")
    assert out["node"]["fits_host_ram"] is True and out["node"]["host_ram_bytes"] == 4 * 2**40


def test_estimate_table_says_the_node_verdict(capsys):
    assert main(["estimate", "--nvme", "1GiB", "--host-ram", "1TB"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "verdict vs host RAM per node" in text and "does not fit" in text
