"""A Megatron-DeepSpeed launch line's memory flags → MegatronSpec (megatron/arguments.py's names and defaults)."""

from __future__ import annotations

from ..specs import MegatronSpec


def _float(text: str | None, default: float) -> float:
    try:
        value = float(text) if text not in (None, "") else default
    except ValueError:
        return default
    return value if 0 <= value < 1 else default


def _int(text: str | None, default: int) -> int:
    try:
        value = int(text) if text not in (None, "") else default
    except ValueError:
        return default
    return value if value > 0 else default


def megatron_spec_from_launch(launch) -> MegatronSpec:
    """The MegatronSpec a check.launch.Launch of pretrain_gpt.py asks for (flags as megatron/arguments.py
    defines them; an unparsable value keeps the default, check's flag rules report it)."""
    flash = {"--use-flash-attn-triton": "triton", "--use-flash-attn-builder": "builder", "--use-flash-attn": "v1",
             "--use-flash-attn-v1": "v1", "--use-flash-attn-v2": "v2"}
    variant = next((v for f, v in flash.items() if launch.has(f)), "v2")
    checkpoint_layers = launch.script_value("--checkpoint-num-layers") if launch.has("--checkpoint-activations") \
        else launch.script_value("--recompute-num-layers")
    qk_scaling = not launch.has("--no-query-key-layer-scaling")
    return MegatronSpec(
        codebase="megatron-deepspeed", flash_variant=variant,
        recompute_method="block" if launch.script_value("--recompute-method") == "block" else "uniform",
        recompute_num_layers=_int(checkpoint_layers, 1),
        distribute_saved_activations=launch.has("--distribute-saved-activations"),
        masked_softmax_fusion=not launch.has("--no-masked-softmax-fusion"),
        bias_gelu_fusion=not launch.has("--no-bias-gelu-fusion"),
        bias_dropout_fusion=not launch.has("--no-bias-dropout-fusion"),
        attention_softmax_in_fp32=qk_scaling or launch.has("--attention-softmax-in-fp32"),
        hidden_dropout=_float(launch.script_value("--hidden-dropout"), 0.1),
        attention_dropout=_float(launch.script_value("--attention-dropout"), 0.1),
        deepspeed_activation_checkpointing=launch.has("--deepspeed-activation-checkpointing"),
        partition_activations=launch.has("--partition-activations") and launch.has(
            "--deepspeed-activation-checkpointing"),
        contigious_checkpointing=launch.has("--contigious-checkpointing") and launch.has(
            "--deepspeed-activation-checkpointing"),
        checkpoint_in_cpu=launch.has("--checkpoint-in-cpu") and launch.has("--deepspeed-activation-checkpointing"),
        pipeline_engine=launch.has("--deepspeed") and not launch.has("--no-pipeline-parallel"),
        make_vocab_size_divisible_by=_int(launch.script_value("--make-vocab-size-divisible-by"), 128),
        mem_efficient_ln=not launch.has("--disable-mem-efficient-ln"),
    )
