"""--model-impl megatron through estimate, check and plan (a Megatron-DeepSpeed launch line implies it)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

from memplan import cli
from memplan.check.command import collect, estimate_for
from memplan.check.launch import parse_launch
from memplan.megatron.launch import megatron_spec_from_launch
from memplan.presets import load_model

SEED = Path(__file__).resolve().parents[1] / "examples" / "seed-176b"
LAUNCH = ("deepspeed --num_gpus 8 pretrain_gpt.py --tensor-model-parallel-size 1 --ds-sequence-parallel-size 8 "
          "--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 32768 --micro-batch-size 1 "
          "--use-flash-attn-v2 --no-pipeline-parallel --checkpoint-activations --checkpoint-num-layers 2 "
          "--deepspeed-activation-checkpointing --partition-activations --hidden-dropout 0 --deepspeed")


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exc:
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def test_launch_flags_become_megatron_spec():
    spec = megatron_spec_from_launch(parse_launch(LAUNCH))
    assert spec.flash_variant == "v2" and not spec.pipeline_engine
    assert spec.recompute_num_layers == 2 and spec.partition_activations
    assert spec.hidden_dropout == 0 and spec.attention_dropout == 0.1  # the flag given, Megatron's default


def test_check_on_a_megatron_launch_estimates_megatrons_gpt():
    launch = parse_launch(LAUNCH)
    cfg = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 8, "fp16": {"enabled": True},
           "zero_optimization": {"stage": 1}}
    model = load_model("176b")
    _, ctx = collect(cfg, launch, model, None, None, None)
    args = type("A", (), {"nodes": None, "target": None, "gpu": None})()
    est, _, _ = estimate_for(ctx, model, args)
    t = est.job.training
    assert t.model_impl == "megatron" and t.attention == "flash" and t.checkpointing == "full"
    assert t.megatron.recompute_num_layers == 2 and not t.megatron.pipeline_engine
    assert any("Megatron" in n for n in est.notes)


def test_estimate_model_impl_megatron_differs_from_transformers():
    argv = ["estimate", "--json", "--attention", "flash"]
    code_t, out_t, _ = _run(argv)
    code_m, out_m, _ = _run(argv + ["--model-impl", "megatron"])
    assert code_t == code_m == 0
    tf, meg = json.loads(out_t), json.loads(out_m)
    assert meg["peak_allocated_bytes"] != tf["peak_allocated_bytes"]


def test_model_impl_megatron_refuses_lora_in_one_line():
    code, out, err = _run(["estimate", "--model-impl", "megatron", "--lora-rank", "8"])
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("memplan: error: ") and "megatron" in err


def test_the_articles_launch_line_implies_megatron():
    launch = parse_launch((SEED / "launch.sh").read_text())
    from memplan.check.rules_job import is_megatron

    assert is_megatron(launch)
    assert megatron_spec_from_launch(launch).pipeline_engine  # --deepspeed, no --no-pipeline-parallel
