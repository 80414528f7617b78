"""The model a Megatron-DeepSpeed launch line builds, and the line that builds a given model.

pretrain_gpt.py never reads a config.json: its GPT comes from the launch flags, with megatron/arguments.py's
defaults (microsoft/Megatron-DeepSpeed f4157bea) for what the line leaves out:

- ``--num-layers``, ``--hidden-size``, ``--num-attention-heads``, ``--max-position-embeddings``: required
  (validate_args, ``_check_arg_is_not_none``);
- ``--num-key-value-heads``: the head count (validate_args, GQA block); ``--kv-channels``: hidden / heads;
- ``--ffn-hidden-size``: 4·hidden, or int(4·hidden·2/3 / 64)·64 with ``--swiglu`` (validate_args);
- ``--normalization``: layernorm (or rmsnorm); ``--use-rotary-position-embeddings`` turns the learned position
  table off (validate_args sets add_position_embedding = False); ``--untie-embeddings-and-output-weights``:
  tied otherwise; ``--disable-bias-linear``: every linear has a bias otherwise (add_bias_linear).

``line_model(launch)`` reads what the line builds; ``model_of_spec(m, seq)`` is the same description for a
ModelSpec, with the features pretrain_gpt.py cannot build listed; ``model_flags`` writes the flags.
"""

from __future__ import annotations

from typing import Any

from ..specs import ModelSpec

#: the description's keys, each with the flag that sets it
FLAG_OF = {
    "num_layers": "--num-layers", "hidden_size": "--hidden-size", "num_heads": "--num-attention-heads",
    "num_kv_heads": "--num-key-value-heads", "kv_channels": "--kv-channels", "ffn_hidden_size": "--ffn-hidden-size",
    "swiglu": "--swiglu", "rmsnorm": "--normalization", "rotary": "--use-rotary-position-embeddings",
    "untied": "--untie-embeddings-and-output-weights", "bias": "--disable-bias-linear",
    "max_position_embeddings": "--max-position-embeddings",
}
REQUIRED = ("num_layers", "hidden_size", "num_heads", "max_position_embeddings")


def default_ffn(hidden: int, swiglu: bool) -> int:
    """validate_args: 4·hidden, or int((4·hidden·2/3) / 64)·64 with --swiglu."""
    return int((4 * hidden * 2 / 3) / 64) * 64 if swiglu else 4 * hidden


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text not in (None, "") and len(text) <= 40 else None
    except ValueError:
        return None


def line_model(launch) -> dict[str, Any]:
    """What pretrain_gpt.py builds from the line (None where a required flag is missing or not an integer)."""
    hidden, heads = _int(launch.script_value("--hidden-size")), _int(launch.script_value("--num-attention-heads"))
    swiglu = launch.has("--swiglu")
    kv_channels = _int(launch.script_value("--kv-channels"))
    ffn = _int(launch.script_value("--ffn-hidden-size"))
    return {
        "num_layers": _int(launch.script_value("--num-layers")), "hidden_size": hidden, "num_heads": heads,
        "num_kv_heads": _int(launch.script_value("--num-key-value-heads")) or heads,
        "kv_channels": kv_channels or (hidden // heads if hidden and heads else None),
        "ffn_hidden_size": ffn or (default_ffn(hidden, swiglu) if hidden else None), "swiglu": swiglu,
        "rmsnorm": launch.script_value("--normalization") == "rmsnorm",
        "rotary": launch.has("--use-rotary-position-embeddings"),
        "untied": launch.has("--untie-embeddings-and-output-weights"), "bias": not launch.has("--disable-bias-linear"),
        "max_position_embeddings": _int(launch.script_value("--max-position-embeddings")),
    }


def unbuildable(m: ModelSpec) -> list[str]:
    """The features of ``m`` Megatron-DeepSpeed's GPT (megatron/model/transformer.py ParallelTransformerLayer)
    cannot build: it has one bias switch for every linear, pre-norm layers, GeLU or SwiGLU MLPs, learned or
    rotary positions, and no qk-norm, sliding window, soft-capping, embedding norm or MoE router of transformers'
    kind."""
    out = []
    if len({m.attention_bias, m.attention_out_bias, m.mlp_bias}) > 1:
        out.append("biases on some linears only (one --disable-bias-linear switch covers all)")
    if m.gated_mlp and m.activation != "silu":
        out.append(f"a gated {m.activation} MLP (--swiglu is SiLU)")
    if not m.gated_mlp and not m.activation.startswith("gelu"):
        out.append(f"a {m.activation} MLP (Megatron's is GeLU)")
    for present, what in (
        (m.position_embedding == "alibi", "ALiBi positions"), (m.parallel_residual, "a parallel residual"),
        (m.qk_norm, "q/k norms"), (m.embedding_norm, "an embedding LayerNorm"),
        (m.sliding_window is not None, "sliding-window attention"), (m.num_experts > 0, "a routed MoE"),
        (m.kv_lora_rank is not None, "multi-head latent attention"),
        (m.final_logit_softcapping is not None or m.attn_logit_softcapping is not None, "logit soft-capping"),
        (m.scale_embeddings, "scaled embeddings"), (m.norm_placement != "pre", f"{m.norm_placement}-norm layers"),
        (m.query_pre_attn_scalar is not None, "a custom attention scale"),
    ):
        if present:
            out.append(what)
    return out


def model_of_spec(m: ModelSpec, seq_len: int) -> dict[str, Any]:
    """The description line_model would read from a line that builds ``m`` (max positions: the learned table,
    or for rotary models at least seq, which validate_args requires: max_position_embeddings >= seq_length)."""
    rotary = m.position_embedding == "rope"
    return {
        "num_layers": m.num_layers, "hidden_size": m.hidden_size, "num_heads": m.num_heads,
        "num_kv_heads": m.num_kv_heads, "kv_channels": m.head_dim, "ffn_hidden_size": m.intermediate_size,
        "swiglu": m.gated_mlp, "rmsnorm": m.norm == "rmsnorm", "rotary": rotary, "untied": not m.tie_word_embeddings,
        "bias": m.attention_bias, "max_position_embeddings": max(seq_len, m.max_position_embeddings) if rotary
        else m.max_position_embeddings,
    }


def model_flags(m: ModelSpec, seq_len: int) -> list[str]:
    """pretrain_gpt.py's flags for ``m`` (callers refuse a model with unbuildable features first)."""
    d = model_of_spec(m, seq_len)
    flags = ["--num-layers", str(d["num_layers"]), "--hidden-size", str(d["hidden_size"]),
             "--num-attention-heads", str(d["num_heads"])]
    if d["num_kv_heads"] != d["num_heads"]:
        flags += ["--num-key-value-heads", str(d["num_kv_heads"])]
    if d["kv_channels"] != d["hidden_size"] // d["num_heads"]:
        flags += ["--kv-channels", str(d["kv_channels"])]
    flags += ["--ffn-hidden-size", str(d["ffn_hidden_size"])]
    if d["swiglu"]:
        flags.append("--swiglu")
    if d["rmsnorm"]:
        flags += ["--normalization", "rmsnorm"]
    if d["rotary"]:
        flags.append("--use-rotary-position-embeddings")
        if m.rotary_pct != 1:
            flags += ["--rotary-percent", str(m.rotary_pct)]
    if d["untied"]:
        flags.append("--untie-embeddings-and-output-weights")
    if not d["bias"]:
        flags.append("--disable-bias-linear")
    return flags + ["--max-position-embeddings", str(d["max_position_embeddings"])]


def megatron_spec(m: ModelSpec, pp: int):
    """The MegatronSpec of the line memplan writes for ``m`` (plan --emit, and a --model-impl megatron job
    without a launch line): GPTModelPipe under the PipelineEngine only at pp > 1 (--no-pipeline-parallel at pp 1),
    --hidden-dropout / --attention-dropout the model's, the other flags Megatron-DeepSpeed's defaults."""
    from ..specs import MegatronSpec

    return MegatronSpec(pipeline_engine=pp > 1, hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout)


def run_flags(m: ModelSpec) -> list[str]:
    """The dropout flags of megatron_spec (the model's, where Megatron's default 0.1 differs)."""
    return ["--hidden-dropout", f"{m.hidden_dropout:g}", "--attention-dropout", f"{m.attention_dropout:g}"]


def disagreements(launch, m: ModelSpec, seq_len: int) -> list[tuple[str, Any, Any]]:
    """(flag, what the line builds, what --model is) for each model flag where they differ (max positions only
    where it changes the model: the learned table's size)."""
    line, want = line_model(launch), model_of_spec(m, seq_len)
    out = []
    for key, flag in FLAG_OF.items():
        got = line[key]
        if key == "max_position_embeddings" and (want["rotary"] or got is None):
            continue  # rotary: no table; a missing value is the required-flag finding's
        if got is None and key in REQUIRED:
            continue
        if got != want[key]:
            out.append((flag, got, want[key]))
    return out


__all__ = ["FLAG_OF", "REQUIRED", "default_ffn", "disagreements", "line_model", "megatron_spec", "model_flags",
           "model_of_spec", "run_flags", "unbuildable"]
