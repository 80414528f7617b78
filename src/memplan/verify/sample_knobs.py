"""The per-line knobs memplan.verify.sample_space draws (a line's own ZeRO settings, its LoRA flags) and the
pinned copies of the Trainer lines' files that the draw parses in their place.

Pure (no torch). The weights and value tables are part of what a seed draws: a change here needs a new
SAMPLER_VERSION (sample_space.py). benchmarks/accuracy/sampled/README.md describes the values.
"""

from __future__ import annotations

import random
from typing import Any

#: TrainingArguments for Trainer lines (examples/hf-trainer/README.md: warmup_steps 1, which the templates need
#: to launch under DeepSpeed 0.19.8's WarmupLR), and its pinned copy
HF_TRAINING_ARGS = "examples/hf-trainer/training_args.json"
HF_TRAINING_ARGS_STAND_IN = {"output_dir": "trainer_output", "warmup_steps": 1}
_HF_AUTO = {"gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
            "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
            "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                     "hysteresis": 2, "min_loss_scale": 1}, "bf16": {"enabled": "auto"},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                      "weight_decay": "auto"}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                         "warmup_num_steps": "auto"}}}
#: the docs' Trainer templates (examples/hf-trainer/ds_config_zero2/3.json, transformers' DeepSpeed integration
#: docs) as published, "auto" included: the draw parses these, never the files (tests hold them equal)
HF_TEMPLATE_STAND_IN = {
    2: {**_HF_AUTO, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}, "allgather_partitions": True,
        "allgather_bucket_size": 2e8, "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
        "contiguous_gradients": True}},
    3: {**_HF_AUTO, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
        "sub_group_size": 1e9, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True}},
}
P_KNOBS = 0.35      # a line of its own ZeRO knobs (each knob then drawn with P_EACH_KNOB)
P_EACH_KNOB = 0.40


def pick(rng: random.Random, weights: dict) -> Any:
    """One key of ``weights`` drawn in proportion to its weight (keys of weight 0 never)."""
    keys = [k for k, w in weights.items() if w > 0]
    return rng.choices(keys, weights=[weights[k] for k in keys])[0]


def knobs(rng: random.Random, p, stage: int, regime: str, sp: int, dtype: str) -> dict[str, Any]:
    """zero_optimization keys (and data_types / sp dtype) of the line's own DeepSpeed JSON."""
    h, layer = p.spec.hidden_size, p.layer_params
    zero: dict[str, Any] = {}
    out: dict[str, Any] = {}
    if regime == "z3_small_knobs":
        which = pick(rng, {"live": 0.4, "prefetch": 0.4, "both": 0.2})
        for key, tag in (("stage3_max_live_parameters", "live"), ("stage3_prefetch_bucket_size", "prefetch")):
            if which in (tag, "both"):
                zero[key] = max(1, int(layer * rng.choice((0.1, 0.25, 0.5, 0.9))))
    elif rng.random() < P_KNOBS:
        table: dict[str, tuple] = {"reduce_bucket_size": (50_000_000, 100_000_000, 200_000_000, 500_000_000, h * h),
                                   "contiguous_gradients": (True, True, True, False)}
        if stage in (1, 2):
            table |= {"allgather_bucket_size": (50_000_000, 200_000_000, 500_000_000), "overlap_comm": (True, False)}
        if stage == 3:
            table |= {"stage3_prefetch_bucket_size": (int(0.9 * h * h), 50_000_000, 200_000_000, int(0.5 * layer)),
                      "stage3_param_persistence_threshold": (0, 10_000, 1_000_000, 10 * h),
                      "stage3_max_live_parameters": (100_000_000, 300_000_000, 1_000_000_000, int(0.5 * layer)),
                      "stage3_max_reuse_distance": (0, 100_000_000, 1_000_000_000),
                      "overlap_comm": (True, True, False)}
        if stage >= 1:
            table["sub_group_size"] = (100_000_000, 1_000_000_000)
        for key, values in table.items():
            if rng.random() < P_EACH_KNOB:
                zero[key] = rng.choice(values)
        if stage >= 1 and dtype == "bf16" and rng.random() < 0.15:
            out["data_types"] = {"grad_accum_dtype": "fp32"}
        if sp > 1 and rng.random() < 0.3:
            out["seq_parallel_communication_data_type"] = "bf16"
    if zero:
        out["zero_optimization"] = zero
    return out


def lora_flags(p, design) -> dict[str, Any]:
    """Attention-only: peft's default targets for the family that the model has (else its attention input
    projections by role); or all-linear."""
    from ..params import linear_modules, parameter_tensors
    from ..peftconfig import DEFAULT_TARGETS, module_matches

    if design.targets == "all-linear":
        targets = "all-linear"
    else:
        linears = linear_modules(p.spec)
        names = [t for t in DEFAULT_TARGETS.get(p.family, ()) if any(module_matches(m, t) for m in linears)]
        if not names:
            leaves = {t.name.removesuffix(".weight").rsplit(".", 1)[-1] for t in parameter_tensors(p.spec)
                      if t.role == "attn_in" and t.name.endswith(".weight")}
            names = sorted(leaves)
        targets = ",".join(names)
    return {"--lora-rank": design.rank, "--lora-targets": targets, "--lora-dropout": design.dropout}


__all__ = ["HF_TEMPLATE_STAND_IN", "HF_TRAINING_ARGS", "HF_TRAINING_ARGS_STAND_IN", "knobs", "lora_flags", "pick"]
