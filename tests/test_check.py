"""memplan check: the seed's findings by subject, toy batch cases, launch parsing, and agreement with
DeepSpeed's own config classes where deepspeed is installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memplan.check.command import collect
from memplan.check.launch import launch_world, parse_launch
from memplan.check.rules_ds import ds_rules
from memplan.check.tables import tables
from memplan.cli import main
from memplan.dsconfig import load_ds_config
from memplan.presets import load_model

SEED = Path(__file__).resolve().parents[1] / "examples" / "seed-176b"
SEED_ARGS = ["check", "--ds-config", str(SEED / "ds_config_ulysses.json"), "--launch-file", str(SEED / "launch.sh"),
             "--model", str(SEED / "176b_config.json"), "--gpus", "8", "--target", "24GiB"]


@pytest.fixture(scope="module")
def seed_out():
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main([*SEED_ARGS, "--json"])
    return rc, json.loads(buf.getvalue())


def test_seed_check_exits_1_and_finds_every_launch_stopper(seed_out):
    rc, out = seed_out
    assert rc == 1
    errors = {f["subject"] for f in out["findings"] if f["severity"] == "error"}
    assert {"sparse_attention", "--sequence-parallel-size", "--batch-size", "--ds-sequence-parallel-size",
            "zero_optimization.stage", "--zero-stage", "zero_optimization.offload_optimizer"} <= errors


def test_seed_check_finds_what_silently_differs(seed_out):
    _, out = seed_out
    warnings = {f["subject"] for f in out["findings"] if f["severity"] == "warning"}
    assert {"sequence_parallel", "model.seq_parallel", "model.sequence_parallel_size", "--fp16",
            "--global-batch-size", "--use-flash-attn-v2"} <= warnings


def test_seed_verdict_is_for_a_labelled_variant(seed_out):
    _, out = seed_out
    assert out["estimate"] is not None
    assert out["estimate_of"].startswith("nearest valid variant")
    layout = out["estimate"]["job"]["layout"]
    assert (layout["tp"], layout["pp"], layout["sp"]) == (1, 1, 8)
    assert out["estimate"]["target_bytes"] == 24 * 2**30
    assert all(set(f) == {"severity", "subject", "message", "fix"} for f in out["findings"])


def test_unreadable_input_exits_2(tmp_path, capsys):
    bad = tmp_path / "ds.json"
    bad.write_text("{not json")
    assert main(["check", "--ds-config", str(bad)]) == 2
    assert "is not valid JSON (line 1 column" in capsys.readouterr().err


def test_clean_config_exits_0(tmp_path, capsys):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                             "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}))
    assert main(["check", "--ds-config", str(p), "--gpus", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert not [f for f in out["findings"] if f["severity"] == "error"]


# --- batch arithmetic, worked by hand -------------------------------------------------------------
# Megatron-DeepSpeed: dp = world // (tp·pp·sp) (validate_args), and DeepSpeed checks
# train_batch_size == micro × accum × dp (DeepSpeedConfig._batch_assertion).
#   8 GPUs, tp2 pp2 sp2 → dp = 8 // 8 = 1        (and parallel_state refuses sp with tp/pp)
#   8 GPUs, tp1 pp1 sp8 → dp = 1; train 512, micro 1 → accum 512
#   8 GPUs, tp2 pp1 sp1 → dp 4; train 32, micro 2, accum 2 → 2·2·4 = 16 ≠ 32 → error
def _findings(cfg, line, gpus=8):
    return collect(cfg, parse_launch(line), None, None, gpus, None)


def test_dp_with_tp_pp_sp():
    line = ("deepspeed pretrain_gpt.py --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
            "--ds-sequence-parallel-size 2 --micro-batch-size 1 --deepspeed --fp16")
    findings, ctx = _findings({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}, line)
    assert ctx["layout"].dp == 1
    assert "--ds-sequence-parallel-size" in {f.subject for f in findings if f.severity == "error"}


def test_batch_mismatch_is_an_error_and_derivation_is_info():
    line = "deepspeed pretrain_gpt.py --tensor-model-parallel-size 2 --micro-batch-size 2 --num-layers 4 --deepspeed"
    bad = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}
    findings, _ = _findings(bad, line)
    assert any(f.subject == "train_batch_size" and f.severity == "error" and "= 16" in f.message for f in findings)
    good = {"train_batch_size": 512, "train_micro_batch_size_per_gpu": 1}
    line_sp = "deepspeed pretrain_gpt.py --ds-sequence-parallel-size 8 --micro-batch-size 1 --num-layers 4"
    findings, ctx = _findings(good, line_sp)
    assert ctx["batch"]["grad_accum"] == 512


def test_zero2_with_pipeline_is_refused():
    line = "deepspeed pretrain_gpt.py --pipeline-model-parallel-size 2 --micro-batch-size 1 --num-layers 4"
    findings, _ = _findings({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}, line)
    assert "zero_optimization.stage" in {f.subject for f in findings if f.severity == "error"}
    findings, _ = _findings({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}}, line)
    assert "zero_optimization.stage" not in {f.subject for f in findings if f.severity == "error"}


def test_model_limits_and_divisibility():
    model = load_model(str(SEED / "176b_config.json"))
    line = ("deepspeed pretrain_gpt.py --ds-sequence-parallel-size 5 --seq-length 65536 --micro-batch-size 1 "
            "--num-layers 96")
    findings, _ = collect({"train_micro_batch_size_per_gpu": 1}, parse_launch(line), model, None, 10, None)
    errors = [f for f in findings if f.severity == "error"]
    assert any("max_position_embeddings" in f.message for f in errors)  # 65536 > 32768
    assert any("heads (96) not divisible by tp·sp" in f.message for f in errors)  # 96 % 5


# --- launch lines ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "line, world",
    [
        ("deepspeed --num_nodes 2 --num_gpus 8 pretrain_gpt.py --micro-batch-size 1", 16),
        ("deepspeed --include localhost:0,1,2,3 train.py", 4),
        ("torchrun --nproc_per_node 4 --nnodes 2 train.py --lr 1", 8),
        ("python -m torch.distributed.run --nproc-per-node=8 train.py", 8),
        ("accelerate launch --num_processes 8 train.py", 8),
        ("deepspeed --num_gpu 8 train.py", 8),  # argparse's unique-prefix match (allow_abbrev=True)
    ],
)
def test_launch_world(line, world):
    assert launch_world(parse_launch(line)) == world


def test_unknown_launcher_flag_is_an_error():
    findings, _ = _findings({"train_micro_batch_size_per_gpu": 1}, "deepspeed --num_gpuz 8 --bogus train.py")
    assert "--bogus" in {f.subject for f in findings if f.severity == "error"}


# --- agreement with DeepSpeed's own classes -------------------------------------------------------
_KEYS = st.sampled_from(["stage", "reduce_bucket_size", "overlap_comm", "stage3_prefetch_bucket_size",
                         "offload_optimizer", "mics_shard_size", "no_such_knob", "contiguous_gradients"])
_VALUES = st.one_of(st.integers(0, 3), st.sampled_from([5e8, True, False]),
                    st.fixed_dictionaries({"device": st.sampled_from(["cpu", "none"])}))
# top-level keys with a value of the type DeepSpeed reads (scalar type errors are out of memplan's scope)
_TOP = st.lists(st.sampled_from([("sparse_attention", {"mode": "fixed"}), ("sequence_parallel", {"enabled": True}),
                                 ("steps_per_print", 10), ("wall_clock_breakdown", False), ("amp", {"enabled": True}),
                                 ("prescale_gradients", False), ("elasticity", {"enabled": False})]),
                max_size=2).map(dict)
_PRECISION = st.sampled_from([{}, {"fp16": {"enabled": True}}, {"bf16": {"enabled": True}},
                              {"fp16": {"enabled": True, "loss_scal": 0}}, {"bf16": {"enabled": True, "x": 1}}])


def _coherent(section: dict) -> bool:
    """Values of the type each key takes (type errors are covered by test_dsconfig)."""
    bools = ("overlap_comm", "contiguous_gradients")
    for k, v in section.items():
        if k in bools and not isinstance(v, bool):
            return False
        if k not in bools and k != "offload_optimizer" and (isinstance(v, (bool, dict))):
            return False
        if k == "offload_optimizer" and not isinstance(v, dict):
            return False
    return True


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(st.dictionaries(_KEYS, _VALUES, max_size=4).filter(_coherent), _TOP, _PRECISION)
def test_error_iff_deepspeed_config_raises(zero, top, precision):
    """memplan reports an error on the config alone iff DeepSpeedConfig(cfg) raises (world size 1 on CPU)."""
    dsc = pytest.importorskip("deepspeed.runtime.config")
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": zero,
           **top, **precision}
    try:
        dsc.DeepSpeedConfig(json.loads(json.dumps(cfg)))
        ds_ok = True
    except Exception:  # noqa: BLE001 - DeepSpeedConfigError, ValidationError, AssertionError all mean "refused"
        ds_ok = False
    _, findings = ds_rules(cfg)
    ours_ok = not any(f.severity == "error" for f in findings)
    assert ours_ok == ds_ok, [f.subject for f in findings if f.severity == "error"]


def test_committed_tables_match_installed_deepspeed():
    """A DeepSpeed release that adds, removes or renames keys fails here: rerun gen_tables."""
    pytest.importorskip("deepspeed")
    from memplan.check.gen_tables import deepspeed_tables

    fresh = deepspeed_tables()
    committed = tables()
    if fresh["deepspeed_version"] != committed["deepspeed_version"]:
        pytest.skip(f"tables are for deepspeed {committed['deepspeed_version']}, installed {fresh['deepspeed_version']}")
    for key in ("ds_top_level_keys", "ds_strict_sections", "ds_removed_top_level", "ds_removed_zero"):
        assert fresh[key] == committed[key], key


def test_seed_config_reads(seed_out):
    cfg = load_ds_config(SEED / "ds_config_ulysses.json")
    settings_, _ = ds_rules(cfg)
    assert settings_ is not None and settings_.zero_stage == 3


def test_autotp_batch_counts_every_rank(tmp_path):
    """AutoTP: DeepSpeedConfig checks train_batch_size before the tp mesh exists, so it counts all ranks
    (deepspeed/__init__.py parses the config first): micro × accum × world, not × dp."""
    import json

    from memplan.check.command import collect  # noqa: F401  (the library entry the CLI uses)
    from memplan.cli import main

    def findings(train_batch):
        cfg = {"train_batch_size": train_batch, "train_micro_batch_size_per_gpu": 1,
               "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
               "zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 2}}
        path = tmp_path / f"ds{train_batch}.json"
        path.write_text(json.dumps(cfg))
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            main(["check", "--ds-config", str(path), "--model", "llama-3.2-1b", "--gpus", "8", "--json"])
        return {f["subject"] for f in json.loads(out.getvalue())["findings"] if f["severity"] == "error"}

    assert "train_batch_size" not in findings(8)
    assert "train_batch_size" in findings(4)


# ---- issue 16: ZeRO-3 and a padding row; config keys the new families' classes consume ----

@pytest.mark.parametrize(("preset", "stage", "warned"), [
    ("gemma-2-2b", 3, True), ("phi-3-mini", 3, True), ("olmo-2-7b", 3, True), ("gemma-2-2b", 2, False),
    ("qwen3-30b-a3b", 3, False), ("deepseek-v3-4l", 3, False),
])
def test_zero3_with_a_padding_row_warns_with_the_workaround(preset, stage, warned):
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}, "bf16": {"enabled": True}}
    findings, _ = collect(cfg, None, load_model(preset), None, 8, 1024)
    hits = [f for f in findings if f.subject == "model.pad_token_id"]
    assert bool(hits) == warned
    if warned:
        assert hits[0].severity == "warning" and "IndexError" in hits[0].message
        assert "HfDeepSpeedConfig" in hits[0].fix


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "gemma-3-4b", "phi-3-mini", "olmo-2-1b", "llama-3-8b"])
def test_keys_the_config_class_consumes_are_not_called_unknown(preset):
    """head_dim (read by getattr in Qwen3Moe/Phi3/Olmo2Attention), sliding_window_pattern (Gemma3TextConfig
    kwargs), rope_theta (convert_rope_params_to_dict) all change the model: no 'does nothing' warning."""
    pytest.importorskip("transformers")
    from memplan.check.rules_job import unknown_model_keys

    raw = json.loads((Path(__file__).resolve().parents[1] / "models" / f"{preset}.json").read_text())
    unknown = unknown_model_keys(raw, load_model(preset).family)
    assert not {"head_dim", "sliding_window_pattern", "rope_theta", "rope_scaling", "partial_rotary_factor"} & set(
        unknown)


def test_gemma3_multimodal_config_keys_are_gemma3config_keys():
    pytest.importorskip("transformers")
    from memplan.check.rules_job import unknown_model_keys

    raw = {"model_type": "gemma3", "text_config": {"hidden_size": 2560}, "vision_config": {}, "mm_tokens_per_image": 256}
    assert unknown_model_keys(raw, "gemma3_text") == []
