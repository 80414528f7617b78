"""verify builds issue 16's families: hfbuild.build_model under ZeRO-3 on torch's fake process group (CPU).

Under ZeRO-3 a plain ``deepspeed.zero.Init`` around from_config fails for models whose config sets
pad_token_id (transformers' _init_weights zeroes weight[padding_idx] of a size-0 partition); build_model
builds them as transformers does with a live HfDeepSpeedConfig. Each model must come out with memplan's
tensors (names, full shapes), in bf16, partitioned as DeepSpeed partitions (ceil(numel / world) per rank),
its padding row zeroed. One end-to-end verify run (forward, backward, step) follows, marked slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

from memplan.params import parameter_tensors
from memplan.presets import load_model
from memplan.specs import Job, Layout, TrainingSpec, ZeroSpec

SMALL = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 64}
TINY = {
    "gemma2": {"model_type": "gemma2", **SMALL, "head_dim": 8, "pad_token_id": 0, "sliding_window": 16},
    "gemma3": {"model_type": "gemma3", "text_config": {**SMALL, "head_dim": 8, "pad_token_id": 0,
                                                       "sliding_window_pattern": 2, "sliding_window": 16}},
    "phi3": {"model_type": "phi3", **SMALL, "pad_token_id": 5, "sliding_window": 16},
    "olmo2": {"model_type": "olmo2", **SMALL, "pad_token_id": 1},
    "qwen3_moe": {"model_type": "qwen3_moe", **SMALL, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 8, "head_dim": 8},
    "deepseek_v3": {"model_type": "deepseek_v3", **SMALL, "num_key_value_heads": 4, "moe_intermediate_size": 8,
                    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
                    "kv_lora_rank": 8, "q_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
                    "v_head_dim": 8, "first_k_dense_replace": 1, "pad_token_id": 0},
}
WORLD = 4  # the padding rows above lie in rank 0's partition (the first vocab_size / WORLD rows)

_BUILD = r"""
import json, math, os, sys
from memplan.dsconfig_emit import to_ds_config
from memplan.presets import load_model
from memplan.specs import Job, Layout, TrainingSpec, ZeroSpec
from memplan.verify import hfbuild, worker

args = json.loads(sys.argv[1])
worker.setup_distributed({"mode": "emulated", "device": "cpu"}, args["world"])
out = {}
# first (before a HfDeepSpeedConfig is alive), the failure build_model avoids: from_config in a plain zero.Init
import deepspeed
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

spec = load_model(args["configs"]["gemma2"])
job = Job(model=spec, training=TrainingSpec(seq_len=16, zero=ZeroSpec(stage=3)), layout=Layout(world=args["world"]))
config = hfbuild.make_config(hfbuild.hf_config_dict(spec))
MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # imported outside zero.Init, as build_model does
try:
    with deepspeed.zero.Init(config_dict_or_path=to_ds_config(job)):
        transformers.AutoModelForCausalLM.from_config(config)
    out["plain_zero_init"] = "built"
except IndexError as err:
    out["plain_zero_init"] = f"IndexError: {err}"
for name, path in args["configs"].items():
    spec = load_model(path)
    job = Job(model=spec, training=TrainingSpec(seq_len=16, zero=ZeroSpec(stage=3), optimizer="torch_adamw"),
              layout=Layout(world=args["world"]))
    config = hfbuild.make_config(hfbuild.hf_config_dict(spec))
    model = hfbuild.build_model(config, job, to_ds_config(job), "cpu")
    row = {"class": type(model).__name__, "hf_path": hfbuild.inits_padding_row(config), "params": [
        [n, list(p.ds_shape), str(p.dtype), p.ds_tensor.numel(), p.numel()] for n, p in model.named_parameters()]}
    pad = config.get_text_config().pad_token_id
    if pad is not None:  # rank 0's own partition (the fake group's collectives carry no other rank's data)
        part, width = model.get_input_embeddings().weight.ds_tensor, config.get_text_config().hidden_size
        row["pad_row_zero"] = bool((part[pad * width:(pad + 1) * width] == 0).all())
        row["std"] = float(part.float().std())
    out[name] = row
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("families")
    paths = {}
    for name, cfg in TINY.items():
        paths[name] = str(folder / f"{name}.json")
        Path(paths[name]).write_text(json.dumps(cfg))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_PORT": "29531",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    proc = subprocess.run([sys.executable, "-c", _BUILD, json.dumps({"configs": paths, "world": WORLD})],
                          check=False, capture_output=True, text=True, timeout=600, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return {"rows": json.loads(lines[0].removeprefix("RESULT ")), "paths": paths}


def test_plain_zero_init_fails_on_the_padding_row(built):
    """transformers 5.17 + DeepSpeed 0.19.8: from_config inside a plain deepspeed.zero.Init, pad_token_id set.
    If this starts to pass, transformers fixed it and check's model.pad_token_id warning can go."""
    assert built["rows"]["plain_zero_init"].startswith("IndexError: index 0 is out of bounds")


@pytest.mark.parametrize("name", sorted(TINY))
def test_zero3_builds_each_family_as_memplan_lists_it(built, name):
    row, spec = built["rows"][name], load_model(built["paths"][name])
    assert row["class"].endswith("ForCausalLM")  # gemma3: the text model, not the multimodal one
    assert [(n, tuple(s)) for n, s, *_ in row["params"]] == [(t.name, t.shape) for t in parameter_tensors(spec)]
    for _, shape, dtype, partition, local in row["params"]:
        assert dtype == "torch.bfloat16" and local == 0  # partitioned: nothing whole on the rank
        numel = 1
        for d in shape:
            numel *= d
        assert partition == -(-numel // WORLD)
    if spec.pad_token_id is not None:
        assert row["hf_path"] and row["pad_row_zero"]
        assert 0.01 < row["std"] < 0.03  # transformers' normal(0, initializer_range = 0.02), gathered whole


@pytest.mark.slow
@pytest.mark.parametrize(("name", "stage", "checkpointing"), [
    ("gemma2", 3, "none"), ("deepseek_v3", 2, "full"), ("qwen3_moe", 3, "full"), ("phi3", 1, "none"),
])
def test_verify_runs_the_families_end_to_end(built, tmp_path, name, stage, checkpointing):
    """The whole verify flow (DeepSpeed initialize, forward, backward, step) on the CPU: a padded family at
    ZeRO-3, MLA + experts + shared experts recomputed under checkpointing, grouped_mm experts at ZeRO-3."""
    from memplan.verify import runner

    spec = load_model(built["paths"][name])
    job = Job(model=spec, training=TrainingSpec(seq_len=32, zero=ZeroSpec(stage=stage), optimizer="torch_adamw",
                                                checkpointing=checkpointing), layout=Layout(world=WORLD))
    row = runner.measure_job(job, name=f"{name}-z{stage}", out_dir=str(tmp_path), steps=1, device="cpu",
                             timeout_s=400)
    assert row["status"] == "ok", row["error"]
    assert row["meta_params"] == row["analytic_params"]


MATRIX = Path(__file__).resolve().parents[1] / "benchmarks" / "accuracy" / "matrix6-families.jsonl"
NEW_FAMILIES = {"gemma2", "gemma3_text", "phi3", "qwen3_moe", "olmo2", "deepseek_v3"}
#: lines the H200 ran that today's estimate calls too large for it, each with the cause found. Strict: a line that
#: fits again fails here until its entry goes, and the excess stays under 5 % of the card
OVER_CARD = {"ds4l-z3-s4k-w8": "measured 134.9 GiB reserved; the replay keeps one more 7 GiB segment (141.9 GiB): its "
             "stacked-expert grads, reduced in place and freed with record_stream as DeepSpeed does (6508909), stay "
             "pending longer in the timing replay than on the GPU (issue 12, session 23)"}


def test_family_matrix_parses_and_covers_the_acceptance():
    """Issue 16's GPU matrix: each new family ZeRO-2 and 3 with checkpointing on and off; MoE shapes (Mixtral,
    Qwen3-MoE, the cut DeepSeek-V3) across ZeRO 1-3, optimizer offload and several sequence lengths, each
    predicted to fit one 141 GB H200 with emulated ranks."""
    from memplan.gpus import resolve_gpu
    from memplan.verify import batch, worker

    items = [batch.parse_item(json.loads(x), "/tmp/unused") for x in MATRIX.read_text().splitlines() if x.strip()]
    assert [i.error for i in items] == [None] * len(items) and len({i.name for i in items}) == len(items)
    # the lines the H200 measured out of memory are results (rows-h200-6-families.jsonl); the estimate of today
    # may rightly call them too large
    measured = MATRIX.parent / "rows-h200-6-families.jsonl"
    oom = {r["name"] for r in map(json.loads, measured.read_text().splitlines()) if r["status"] == "oom"}
    assert oom <= {i.name for i in items}
    card = resolve_gpu("h200").memory_bytes
    for item in items:
        worker.check_supported(item.job)  # raises Unsupported for what the harness cannot run
        assert not item.opts["launch"], item.name
        if item.name in OVER_CARD:  # measured to fit, predicted a little above the card (see OVER_CARD)
            assert card <= item.need_bytes < 1.05 * card, (item.name, OVER_CARD[item.name])
        else:  # predicted within the H200's capacity
            assert item.name in oom or item.need_bytes < card, item.name
    for family in NEW_FAMILIES:
        jobs = [i.job for i in items if i.job.model.family == family]
        cells = {(j.training.zero.stage, j.training.checkpointing) for j in jobs}
        assert {(2, "none"), (2, "full"), (3, "none"), (3, "full")} <= cells, family
    moe = [i.job for i in items if i.job.model.num_experts]
    assert {j.model.family for j in moe} == {"mixtral", "qwen3_moe", "deepseek_v3"} and len(moe) >= 12
    assert {j.training.zero.stage for j in moe} == {1, 2, 3}
    assert any(j.training.zero.offload_optimizer == "cpu" for j in moe)
    assert len({j.training.seq_len for j in moe}) >= 3
