"""Hugging Face config.json → ModelSpec, with the defaults transformers 5.17 applies to missing keys.

Each family's defaults, key aliases and derived sizes are read from its
``transformers/models/<family>/configuration_<family>.py`` (the dataclass defaults, ``attribute_map`` and
``__post_init__``) and ``modeling_<family>.py`` (what the modules actually build). ``model_type`` decides the
family; ``architectures`` is only a hint, used when ``model_type`` is missing and the architecture is GPT-2
(the seed's 176B config is written that way). Pure: no torch, no transformers import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from . import hfconfig_families as families
from .bounds import MAX_LAYERS
from .errors import InputError, from_pydantic, shorten
from .hfconfig_keys import MAX_DIM, Keys, show  # noqa: F401 - MAX_DIM is part of this module's API
from .inputs import MAX_INPUT_BYTES
from .specs import ModelSpec

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "gpt_neox", "bloom", "mixtral", *families.BUILDERS)
#: model types read through a sub-config: gemma3 (multimodal) → its text_config as gemma3_text
WRAPPERS = ("gemma3",)

#: largest JSON file read (real config.json files are a few KiB): memplan.inputs' cap for every input file
MAX_JSON_BYTES = MAX_INPUT_BYTES

#: ``attribute_map`` of each config class: generic key → the family's own field (GPT2Config, BloomConfig,
#: MixtralConfig). BloomConfig.__post_init__ also pops ``n_embed`` into hidden_size.
_ALIASES: dict[str, dict[str, str]] = {
    "gpt2": {
        "hidden_size": "n_embd",
        "max_position_embeddings": "n_positions",
        "num_attention_heads": "n_head",
        "num_hidden_layers": "n_layer",
    },
    "bloom": {"num_hidden_layers": "n_layer", "num_attention_heads": "n_head", "n_embed": "hidden_size"},
    "mixtral": {"num_experts": "num_local_experts"},
}

#: dataclass defaults of each config class in transformers 5.17 (fields that shape parameters or memory).
_LLAMA_LIKE = {
    "hidden_act": "silu", "tie_word_embeddings": False, "num_key_value_heads": None, "head_dim": None,
    "attention_dropout": 0.0,
}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {  # LlamaConfig
        **_LLAMA_LIKE, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 2048,
        "attention_bias": False, "mlp_bias": False,
    },
    "mistral": {  # MistralConfig (num_key_value_heads defaults to 8, not to the heads)
        **_LLAMA_LIKE, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 4096 * 32, "sliding_window": 4096,
    },
    "qwen2": {  # Qwen2Config (q/k/v always carry a bias in Qwen2Attention)
        **_LLAMA_LIKE, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 4096,
    },
    "qwen3": {  # Qwen3Config (head_dim defaults to 128, not hidden/heads)
        **_LLAMA_LIKE, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128,
        "max_position_embeddings": 32768, "attention_bias": False, "use_sliding_window": False,
        "sliding_window": 4096,
    },
    "mixtral": {  # MixtralConfig
        **_LLAMA_LIKE, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 4096 * 32, "num_experts_per_tok": 2, "num_local_experts": 8,
        "sliding_window": None,
    },
    "gpt2": {  # GPT2Config (n_inner None → 4·n_embd in GPT2Block)
        "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
        "activation_function": "gelu_new", "tie_word_embeddings": True, "add_cross_attention": False,
        "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
    },
    "gpt_neox": {  # GPTNeoXConfig (rotary_pct → rope_parameters.partial_rotary_factor, default 0.25)
        "vocab_size": 50432, "hidden_size": 6144, "num_hidden_layers": 44, "num_attention_heads": 64,
        "intermediate_size": 24576, "hidden_act": "gelu", "max_position_embeddings": 2048,
        "tie_word_embeddings": False, "use_parallel_residual": True, "attention_bias": True, "rotary_pct": 0.25,
        "hidden_dropout": 0.0, "attention_dropout": 0.0,
    },
    "bloom": {  # BloomConfig (MLP is 4·hidden in BloomMLP; ALiBi, no position table)
        "vocab_size": 250880, "hidden_size": 64, "n_layer": 2, "n_head": 8, "tie_word_embeddings": True,
        "hidden_dropout": 0.0, "attention_dropout": 0.0,
    },
}

#: BLOOM has no position limit (ALiBi); ModelSpec needs one: its training length (BigScience used 2048).
BLOOM_DEFAULT_POSITIONS = 2048


def _divisible(k: Keys, hidden: int, heads: int) -> None:
    """LlamaConfig/GPTNeoXConfig.validate_architecture, GPT2Attention, BloomAttention: hidden % heads == 0."""
    if hidden % heads:
        field = "n_head" if k.family in ("gpt2", "bloom") else "num_attention_heads"
        raise k.error(field, f"hidden size ({hidden}) must be divisible by the attention heads ({heads})")


def _llama_like(k: Keys) -> dict:
    """llama, mistral, qwen2, qwen3, mixtral: RMSNorm, RoPE, gated SiLU MLP (per expert for mixtral)."""
    hidden, heads = k.int("hidden_size"), k.int("num_attention_heads")
    if k.family == "llama":
        _divisible(k, hidden, heads)
    # head_dim: configured or hidden // heads (LlamaConfig.__post_init__, MistralAttention, Qwen2Attention)
    head_dim = k.opt_int("head_dim") or hidden // heads
    if head_dim <= 0:
        raise k.error("num_attention_heads", f"must be at most hidden_size ({hidden}) (got {heads})")
    kv_heads = k.opt_int("num_key_value_heads") or heads  # __post_init__: None → num_attention_heads
    if heads % kv_heads:  # repeat_kv needs whole groups of query heads per key/value head
        raise k.error("num_key_value_heads", f"must divide num_attention_heads ({heads}) (got {kv_heads})")
    attn_bias = {"llama": k.bool("attention_bias"), "qwen3": k.bool("attention_bias"), "qwen2": True}
    spec = {
        "hidden_size": hidden, "num_layers": k.int("num_hidden_layers"), "num_heads": heads, "num_kv_heads": kv_heads,
        "head_dim": head_dim, "intermediate_size": k.int("intermediate_size"), "vocab_size": k.int("vocab_size"),
        "max_position_embeddings": k.int("max_position_embeddings"),
        "tie_word_embeddings": k.bool("tie_word_embeddings"), "activation": k.str("hidden_act"),
        "attention_bias": attn_bias.get(k.family, False),
        "attention_out_bias": k.family in ("llama", "qwen3") and attn_bias[k.family],
        "mlp_bias": k.family == "llama" and k.bool("mlp_bias"), "qk_norm": k.family == "qwen3",
        "attention_dropout": k.prob("attention_dropout"),  # *Attention: dropout on the probabilities only
        "pad_token_id": k.padding_idx(k.int("vocab_size")),  # LlamaModel etc.: nn.Embedding(..., padding_idx)
        # MixtralConfig keeps head_dim=None when config.json gives none (MixtralAttention falls back to
        # hidden // heads; code that reads config.head_dim itself gets None)
        "config_head_dim_unset": k.family == "mixtral" and k.opt_int("head_dim") is None,
        # MistralConfig / MixtralConfig: sliding_window; Qwen2/3Config: only with use_sliding_window
        "sliding_window": (k.opt_int("sliding_window") if k.family in ("mistral", "mixtral")
                           or (k.family in ("qwen2", "qwen3") and k.bool("use_sliding_window")) else None),
    }
    if k.family == "mixtral":
        experts, top_k = k.int("num_local_experts"), k.int("num_experts_per_tok")
        if top_k > experts:
            raise k.error("num_experts_per_tok", f"must be at most num_local_experts ({experts}) (got {top_k})")
        spec.update(num_experts=experts, num_experts_per_tok=top_k)
    return spec


def _gpt2(k: Keys) -> dict:
    """GPT2LMHeadModel: learned positions, LayerNorm, Conv1D c_attn/c_proj/c_fc with biases."""
    hidden, heads = k.int("n_embd"), k.int("n_head")
    _divisible(k, hidden, heads)
    if k.bool("add_cross_attention"):
        raise k.error("add_cross_attention", "cross-attention (encoder-decoder) is not supported; allowed: false")
    return {
        "hidden_size": hidden, "num_layers": k.int("n_layer"), "num_heads": heads, "num_kv_heads": heads,
        "head_dim": hidden // heads, "intermediate_size": k.opt_int("n_inner") or 4 * hidden,
        "vocab_size": k.int("vocab_size"), "max_position_embeddings": k.int("n_positions"),
        "tie_word_embeddings": k.bool("tie_word_embeddings"), "attention_bias": True, "attention_out_bias": True,
        "mlp_bias": True, "norm": "layernorm", "gated_mlp": False, "activation": k.str("activation_function"),
        "position_embedding": "learned",
        # GPT2Attention.resid_dropout, GPT2MLP.dropout; attn_dropout; GPT2Model.drop after wte + wpe
        "hidden_dropout": k.prob("resid_pdrop"), "attention_dropout": k.prob("attn_pdrop"),
        "embedding_dropout": k.prob("embd_pdrop"),
    }


def _gpt_neox(k: Keys) -> dict:
    """GPTNeoXForCausalLM: fused query_key_value, LayerNorm, partial rotary, parallel residual."""
    hidden, heads = k.int("hidden_size"), k.int("num_attention_heads")
    _divisible(k, hidden, heads)
    # GPTNeoXConfig.convert_rope_params_to_dict: rope_scaling, else rope_parameters; its partial_rotary_factor
    # wins over rotary_pct
    rope = k.values.get("rope_scaling") or k.values.get("rope_parameters") or {}
    if isinstance(rope, dict) and "partial_rotary_factor" in rope:
        k.values["rotary_pct"] = rope["partial_rotary_factor"]
    bias = k.bool("attention_bias")
    return {
        "hidden_size": hidden, "num_layers": k.int("num_hidden_layers"), "num_heads": heads, "num_kv_heads": heads,
        "head_dim": hidden // heads, "intermediate_size": k.int("intermediate_size"), "vocab_size": k.int("vocab_size"),
        "max_position_embeddings": k.int("max_position_embeddings"),
        "tie_word_embeddings": k.bool("tie_word_embeddings"), "attention_bias": bias, "attention_out_bias": bias,
        "mlp_bias": True, "norm": "layernorm", "gated_mlp": False, "activation": k.str("hidden_act"),
        "parallel_residual": k.bool("use_parallel_residual"), "rotary_pct": k.fraction("rotary_pct"),
        # GPTNeoXLayer.post_attention_dropout / post_mlp_dropout and GPTNeoXModel.emb_dropout use hidden_dropout
        "hidden_dropout": k.prob("hidden_dropout"), "attention_dropout": k.prob("attention_dropout"),
        "embedding_dropout": k.prob("hidden_dropout"),
    }


def _bloom(k: Keys) -> dict:
    """BloomForCausalLM: ALiBi, LayerNorm after the embeddings, fused query_key_value, 4·hidden GELU MLP."""
    hidden, heads = k.int("hidden_size"), k.int("n_head")
    _divisible(k, hidden, heads)
    k.values.setdefault("seq_length", BLOOM_DEFAULT_POSITIONS)
    return {
        "hidden_size": hidden, "num_layers": k.int("n_layer"), "num_heads": heads, "num_kv_heads": heads,
        "head_dim": hidden // heads, "intermediate_size": 4 * hidden, "vocab_size": k.int("vocab_size"),
        "max_position_embeddings": k.int("seq_length"), "tie_word_embeddings": k.bool("tie_word_embeddings"),
        "attention_bias": True, "attention_out_bias": True, "mlp_bias": True, "norm": "layernorm", "gated_mlp": False,
        "activation": "bloom_gelu", "position_embedding": "alibi", "embedding_norm": True,
        # dropout_add after attention and MLP; BloomAttention.attention_dropout; no dropout after the embeddings
        "hidden_dropout": k.prob("hidden_dropout"), "attention_dropout": k.prob("attention_dropout"),
    }


_BUILDERS = {"gpt2": _gpt2, "gpt_neox": _gpt_neox, "bloom": _bloom, **families.BUILDERS}


def _family(cfg: dict) -> str:
    """model_type decides; a config without one whose architectures are GPT-2 ones is read as gpt2."""
    allowed = ", ".join(FAMILIES) + ", gemma3 (its text_config)"
    model_type = cfg.get("model_type")
    if model_type is None:
        archs = cfg.get("architectures")
        if isinstance(archs, list) and archs and all(isinstance(a, str) and a.startswith("GPT2") for a in archs):
            return "gpt2"
        raise InputError("model.model_type", f"missing (and architectures is not GPT2*); allowed: {allowed}")
    if model_type not in FAMILIES + WRAPPERS:
        raise InputError("model.model_type", f"unsupported model type {shorten(model_type)}; allowed: {allowed}")
    return model_type


def model_from_config(cfg: dict, name: str, source: str) -> ModelSpec:
    """The ModelSpec of a Hugging Face config dict (as json.load gives it), missing keys as transformers fills them."""
    if not isinstance(cfg, dict):
        raise InputError("model", f"a config.json must hold a JSON object (got {type(cfg).__name__})")
    family, prefix = _family(cfg), "model."
    if family == "gemma3":  # Gemma3Config: the text model only
        cfg, family, source = families.gemma3_text_config(cfg), "gemma3_text", f"{source}; {families.GEMMA3_NOTE}"
        prefix = "model.text_config."
    keys = Keys(cfg, family, {**_DEFAULTS, **families.DEFAULTS}[family],
                {**_ALIASES, **families.ALIASES}.get(family, {}), prefix)
    fields = _BUILDERS.get(family, _llama_like)(keys)
    if fields["num_layers"] > MAX_LAYERS:  # the estimator lists every layer's tensors (memplan.bounds)
        layers_key = "n_layer" if family in ("gpt2", "bloom") else "num_hidden_layers"
        raise keys.error(layers_key, f"{fields['num_layers']} layers; allowed: at most {MAX_LAYERS}")
    try:
        return ModelSpec(name=name, family=family, source=source, **fields)
    except ValidationError as err:
        raise from_pydantic(err, prefix="model.") from None


def transformers_config(cfg: dict) -> dict:
    """The keys to hand to ``AutoConfig.for_model(**keys)``: model_type filled as memplan resolved it (the seed's
    GPT2Model config has none; a gemma3 config gives its text_config as gemma3_text), memplan's own
    ``_memplan_*`` keys dropped."""
    family = _family(cfg)
    if family == "gemma3":  # AutoModelForCausalLM of a Gemma3Config is the multimodal model: build the text one
        cfg, family = families.gemma3_text_config(cfg), "gemma3_text"
    keys = {k: v for k, v in cfg.items() if not k.startswith("_memplan")}
    keys["model_type"] = family
    return keys


def read_json(path: Path, field: str = "model") -> dict:
    """Read a config.json as transformers does (PretrainedConfig._dict_from_json_file: json.loads of the UTF-8
    text, so a BOM or a comment is refused and a duplicate key's last value wins), through memplan.inputs: a
    regular file of at most MAX_JSON_BYTES; any failure is an InputError naming ``field``, on one line."""
    from .inputs import read_json_object

    return read_json_object(path, field, "json", "config.json")


def load_config_file(path: str | Path) -> ModelSpec:
    """Read a config.json and build its ModelSpec (named by the file path)."""
    path = Path(path)
    cfg = read_json(path)
    source = cfg.get("_memplan_source") or f"config file {path}"
    return model_from_config(cfg, name=str(path), source=str(source))
