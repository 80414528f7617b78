"""config.json → ModelSpec fields for Gemma 2, Gemma 3 (text), Phi-3, Qwen3-MoE, OLMo 2 and DeepSeek-V3.

Each table is the config class's dataclass defaults in transformers 5.17
(``transformers/models/<family>/configuration_<family>.py``), each ``attribute_map`` an alias table, and each
builder repeats the class's ``__post_init__`` / ``validate_architecture`` and what ``modeling_<family>.py``
builds from the values. Pure: no torch, no transformers import.
"""

from __future__ import annotations

from typing import Any

from .errors import InputError
from .hfconfig_keys import Keys, show

#: attribute_map: key as a config.json may write it → the field the class stores
ALIASES: dict[str, dict[str, str]] = {
    "qwen3_moe": {"num_local_experts": "num_experts"},  # Qwen3MoeConfig.attribute_map
    "deepseek_v3": {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"},
}

_GEMMA = {"pad_token_id": 0, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
          "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "attention_bias": False, "attention_dropout": 0.0, "query_pre_attn_scalar": 256,
          "sliding_window": 4096, "layer_types": None, "hidden_size": 2304, "intermediate_size": 9216,
          "num_hidden_layers": 26}
DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {  # Gemma2Config
        **_GEMMA, "vocab_size": 256000, "max_position_embeddings": 8192, "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0, "use_bidirectional_attention": None,
    },
    "gemma3_text": {  # Gemma3TextConfig (sliding_window_pattern is read from kwargs, default 6)
        **_GEMMA, "vocab_size": 262208, "max_position_embeddings": 131072, "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "use_bidirectional_attention": False, "sliding_window_pattern": 6,
    },
    "phi3": {  # Phi3Config (no head_dim field: Phi3Attention reads getattr(config, "head_dim", hidden // heads))
        "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": None, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
        "attention_dropout": 0.0, "hidden_act": "silu", "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "sliding_window": None, "rope_parameters": None, "pad_token_id": 32000,
    },
    "qwen3_moe": {  # Qwen3MoeConfig (no head_dim field either)
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
        "num_attention_heads": 32, "num_key_value_heads": 4, "hidden_act": "silu", "max_position_embeddings": 32768,
        "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False, "sliding_window": 4096,
        "attention_dropout": 0.0, "decoder_sparse_step": 1, "moe_intermediate_size": 768, "num_experts_per_tok": 8,
        "num_experts": 128, "norm_topk_prob": False, "output_router_logits": False, "router_aux_loss_coef": 0.001,
        "mlp_only_layers": None,
    },
    "olmo2": {  # Olmo2Config
        "vocab_size": 50304, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu", "max_position_embeddings": 2048,
        "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0, "pad_token_id": 1,
    },
    "deepseek_v3": {  # DeepseekV3Config
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
        "n_routed_experts": 256, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
        "first_k_dense_replace": 3, "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "rope_interleave": True, "attention_bias": False, "attention_dropout": 0.0,
    },
}

#: what memplan says of a gemma3 (multimodal) config it reads
GEMMA3_NOTE = ("gemma3 multimodal config read through its text_config as Gemma3ForCausalLM; the SigLIP vision "
               "tower and the multimodal projector are not modelled")


def gemma3_text_config(cfg: dict) -> dict:
    """Gemma3Config.__post_init__: text_config (a dict, or the Gemma3TextConfig defaults when missing)."""
    text = cfg.get("text_config")
    if text is None:
        text = {}
    if not isinstance(text, dict):
        raise InputError("model.text_config", f"must be a JSON object (got {show(text)})")
    return {**text, "model_type": "gemma3_text"}


def _heads(k: Keys, kv_default_heads: bool) -> tuple[int, int, int]:
    """(hidden, heads, kv_heads); kv_heads None → heads where the class's __post_init__ says so."""
    hidden, heads = k.int("hidden_size"), k.int("num_attention_heads")
    kv = (k.opt_int("num_key_value_heads") or heads) if kv_default_heads else k.int("num_key_value_heads")
    if heads % kv:  # repeat_kv needs whole groups of query heads per key/value head
        raise k.error("num_key_value_heads", f"must divide num_attention_heads ({heads}) (got {kv})")
    return hidden, heads, kv


def _head_dim(k: Keys, hidden: int, heads: int) -> int:
    """getattr(config, "head_dim", hidden // heads): Phi3Attention, Qwen3MoeAttention, Olmo2Attention."""
    head_dim = k.opt_int("head_dim") or hidden // heads
    if head_dim <= 0:
        raise k.error("num_attention_heads", f"must be at most hidden_size ({hidden}) (got {heads})")
    return head_dim


def _common(k: Keys, hidden: int, heads: int, kv: int, head_dim: int, act_key: str = "hidden_act") -> dict:
    return {
        "hidden_size": hidden, "num_layers": k.int("num_hidden_layers"), "num_heads": heads, "num_kv_heads": kv,
        "head_dim": head_dim, "intermediate_size": k.int("intermediate_size"), "vocab_size": k.int("vocab_size"),
        "max_position_embeddings": k.int("max_position_embeddings"),
        "tie_word_embeddings": k.bool("tie_word_embeddings"), "activation": k.str(act_key),
        "attention_dropout": k.prob("attention_dropout"), "pad_token_id": k.padding_idx(k.int("vocab_size")),
    }


def _layer_types(k: Keys, layers: int) -> tuple[str, ...]:
    """layer_types as given, else Gemma2Config / Gemma3TextConfig.__post_init__: layer i slides unless
    (i + 1) % pattern == 0 (Gemma 2: pattern 2; Gemma 3: sliding_window_pattern, default 6)."""
    given = k.values.get("layer_types")
    allowed = ("full_attention", "sliding_attention")
    if given is not None:
        if not isinstance(given, list) or not all(t in allowed for t in given):
            raise k.error("layer_types", f"must be a list of {' / '.join(allowed)} (got {show(given)})")
        if len(given) != layers:
            raise k.error("layer_types", f"has {len(given)} entries; num_hidden_layers is {layers}")
        return tuple(given)
    pattern = 2 if k.family == "gemma2" else k.int("sliding_window_pattern")
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers))


def gemma(k: Keys) -> dict:
    """Gemma2ForCausalLM / Gemma3ForCausalLM: sandwich norms, scaled embeddings, tied head, soft-capping,
    sliding and full layers; Gemma 3 adds per-head q/k norms and never passes attn_logit_softcapping on."""
    hidden, heads, kv = _heads(k, kv_default_heads=False)
    if hidden % heads:  # Gemma2Config / Gemma3TextConfig.validate_architecture
        raise k.error("num_attention_heads", f"hidden size ({hidden}) must be divisible by the attention heads "
                                             f"({heads})")
    if k.values.get("use_bidirectional_attention") not in (None, False):
        raise k.error("use_bidirectional_attention", "bidirectional (encoder) attention is not modelled; allowed: "
                                                     "false")
    spec = _common(k, hidden, heads, kv, k.int("head_dim"), "hidden_activation")
    types = _layer_types(k, spec["num_layers"])
    window = k.opt_int("sliding_window")
    if window is None and "sliding_attention" in types:
        raise k.error("sliding_window", "must be a positive integer: layer_types has sliding_attention layers")
    bias = k.bool("attention_bias")
    text3 = k.family == "gemma3_text"
    spec.update(
        attention_bias=bias, attention_out_bias=bias, sliding_window=window, layer_types=types,
        final_logit_softcapping=k.opt_positive("final_logit_softcapping"),
        attn_logit_softcapping=None if text3 else k.opt_positive("attn_logit_softcapping"),
        query_pre_attn_scalar=k.opt_positive("query_pre_attn_scalar"), scale_embeddings=True,
        norm_placement="sandwich", qk_norm=text3)
    if spec["query_pre_attn_scalar"] is None:  # query_pre_attn_scalar**-0.5 would fail in Gemma2Attention
        raise k.error("query_pre_attn_scalar", "must be a positive number")
    return spec


_PHI3_ROPE_TYPES = (None, "default", "longrope", "su", "yarn")  # su / yarn: Phi3Config renames them longrope


def phi3(k: Keys) -> dict:
    """Phi3ForCausalLM: fused qkv_proj and gate_up_proj, residual dropouts (resid_pdrop), partial RoPE,
    optional sliding window on every layer. embd_pdrop is read by no module (Phi3Model has no embedding dropout)."""
    hidden, heads, kv = _heads(k, kv_default_heads=True)
    head_dim = _head_dim(k, hidden, heads)
    # Phi3Config.convert_rope_params_to_dict: rope_scaling or rope_parameters, partial_rotary_factor default 1.0
    key = "rope_scaling" if k.values.get("rope_scaling") else "rope_parameters"
    rope = k.values.get(key) or {}
    if not isinstance(rope, dict):
        raise k.error(key, f"must be a JSON object or null (got {show(rope)})")
    k.values["partial_rotary_factor"] = rope.get("partial_rotary_factor", k.values.get("partial_rotary_factor", 1.0))
    partial = k.fraction("partial_rotary_factor")
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type not in _PHI3_ROPE_TYPES:  # Phi3Config.validate_rope
        raise k.error(key, f"rope type {show(rope_type)} is not allowed; allowed: default, longrope")
    rotary_ndims = int(hidden // heads * partial)
    for factor in ("short_factor", "long_factor"):
        got = rope.get(factor)
        if got is not None and (not isinstance(got, list) or len(got) != rotary_ndims // 2):
            raise k.error(key, f"{factor} must be a list of {rotary_ndims // 2} numbers (got {show(got)})")
    spec = _common(k, hidden, heads, kv, head_dim)
    spec.update(fused_qkv=True, fused_gate_up=True, rotary_pct=partial, sliding_window=k.opt_int("sliding_window"),
                hidden_dropout=k.prob("resid_pdrop"))
    k.prob("embd_pdrop")  # checked as transformers types it, though no module reads it
    return spec


def olmo2(k: Keys) -> dict:
    """Olmo2ForCausalLM: norms after attention and MLP (no pre-norms), q/k RMSNorm over whole projections."""
    hidden, heads, kv = _heads(k, kv_default_heads=True)
    spec = _common(k, hidden, heads, kv, _head_dim(k, hidden, heads))
    bias = k.bool("attention_bias")
    spec.update(attention_bias=bias, attention_out_bias=bias, norm_placement="post", qk_norm=True,
                qk_norm_per_head=False)
    return spec


def _top_k(k: Keys, experts: int, experts_key: str) -> int:
    top_k = k.int("num_experts_per_tok")
    if experts and top_k > experts:
        raise k.error("num_experts_per_tok", f"must be at most {experts_key} ({experts}) (got {top_k})")
    return top_k


def qwen3_moe(k: Keys) -> dict:
    """Qwen3MoeForCausalLM: Qwen3 attention (per-head q/k norms), a softmax top-k router and packed experts on
    every decoder_sparse_step-th layer outside mlp_only_layers (num_experts 0: all dense)."""
    hidden, heads, kv = _heads(k, kv_default_heads=False)
    spec = _common(k, hidden, heads, kv, _head_dim(k, hidden, heads))
    experts = k.count("num_experts")
    bias = k.bool("attention_bias")
    spec.update(
        attention_bias=bias, attention_out_bias=bias, qk_norm=True, num_experts=experts,
        num_experts_per_tok=_top_k(k, experts, "num_experts"), moe_intermediate_size=k.int("moe_intermediate_size"),
        decoder_sparse_step=k.int("decoder_sparse_step"), mlp_only_layers=k.layer_list("mlp_only_layers",
                                                                                      spec["num_layers"]),
        norm_topk_prob=k.bool("norm_topk_prob"), output_router_logits=k.bool("output_router_logits"),
        router_aux_loss_coef=k.nonneg("router_aux_loss_coef"),
        # Qwen3MoeConfig.__post_init__: sliding_window only with use_sliding_window
        sliding_window=k.opt_int("sliding_window") if k.bool("use_sliding_window") else None)
    return spec


def deepseek_v3(k: Keys) -> dict:
    """DeepseekV3ForCausalLM: MLA attention (low-rank q and kv, keys expanded to every head), dense MLPs on the
    first first_k_dense_replace layers, then a sigmoid group-limited router, packed experts and shared experts.
    head_dim is what DeepseekV3Config.__post_init__ sets: qk_rope_head_dim (the RoPE width)."""
    hidden, heads, kv = _heads(k, kv_default_heads=True)
    if kv != heads:  # DeepseekV3Attention expands k and v to all heads; repeat_kv would multiply them again
        raise k.error("num_key_value_heads", f"must equal num_attention_heads ({heads}) for MLA (got {kv})")
    rope = k.int("qk_rope_head_dim")
    spec = _common(k, hidden, heads, kv, rope)
    experts = k.int("n_routed_experts")
    groups, topk_group = k.int("n_group"), k.int("topk_group")
    if experts % groups or experts // groups < 2:  # view(-1, n_group, E // n_group).topk(2)
        raise k.error("n_group", f"must divide n_routed_experts ({experts}) into groups of at least 2 (got {groups})")
    if topk_group > groups:
        raise k.error("topk_group", f"must be at most n_group ({groups}) (got {topk_group})")
    bias = k.bool("attention_bias")
    spec.update(
        attention_bias=bias, attention_out_bias=bias, num_experts=experts,
        num_experts_per_tok=_top_k(k, experts, "n_routed_experts"),
        moe_intermediate_size=k.int("moe_intermediate_size"), n_shared_experts=k.count("n_shared_experts"),
        first_k_dense_replace=k.count("first_k_dense_replace"), norm_topk_prob=bool(k.values.get("norm_topk_prob")),
        router_scoring="sigmoid", n_group=groups, topk_group=topk_group, kv_lora_rank=k.int("kv_lora_rank"),
        q_lora_rank=k.opt_int("q_lora_rank"), qk_nope_head_dim=k.int("qk_nope_head_dim"), qk_rope_head_dim=rope,
        v_head_dim=k.int("v_head_dim"), rope_interleave=bool(k.values.get("rope_interleave")))
    for flag in ("norm_topk_prob", "rope_interleave"):  # bool | None in DeepseekV3Config
        if k.values.get(flag) is not None:
            k.bool(flag)
    return spec


BUILDERS = {"gemma2": gemma, "gemma3_text": gemma, "phi3": phi3, "qwen3_moe": qwen3_moe, "olmo2": olmo2,
            "deepseek_v3": deepseek_v3}
