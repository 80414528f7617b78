"""The transformers side of a measurement: the HF config of a ModelSpec, the model, its layers.

`hf_config_dict` runs in the parent (no torch); the rest runs in the worker and imports torch and
transformers inside the functions. Nothing is downloaded and remote code is never trusted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..specs import Job, ModelSpec

#: `--attention` → transformers attn_implementation. "flash" runs sdpa restricted to torch's FlashAttention
#: backend (torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION)): the flash-attn package is not
#: installed on the measuring machine, and torch's flash kernel keeps the same O(seq) memory.
ATTN_IMPLEMENTATION = {"eager": "eager", "sdpa": "sdpa", "flash": "sdpa"}

#: config keys that would make transformers fetch or run code from elsewhere
_UNSAFE_KEYS = ("auto_map", "_name_or_path", "transformers_version", "architectures")


def _preset_file(spec: ModelSpec) -> Path | None:
    """The config.json behind ``spec``: its path, or the preset's models/<name>.json (memplan.presets)."""
    from ..presets import PRESETS_DIR

    as_path = Path(spec.name).expanduser()
    if as_path.is_file():
        return as_path
    candidate = PRESETS_DIR / f"{spec.name}.json"
    return candidate if candidate.is_file() else None


def _synthesized(spec: ModelSpec) -> dict[str, Any]:
    """An HF config for a ModelSpec without a config file (tests' tiny models): Llama-style families only."""
    if spec.family not in ("llama", "mistral", "qwen2", "qwen3"):
        raise ValueError(f"no config.json found for model {spec.name!r} ({spec.family}); pass a config.json path")
    return {
        "model_type": spec.family,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_bias": spec.attention_bias,
        "mlp_bias": spec.mlp_bias,
    }


def hf_config_dict(spec: ModelSpec) -> dict[str, Any]:
    """The HF config.json keys to build ``spec`` with (underscore keys and remote-code keys dropped)."""
    from ..inputs import read_json_object

    path = _preset_file(spec)
    raw = read_json_object(path, "--model", "json", "config.json") if path else _synthesized(spec)
    return {k: v for k, v in raw.items() if not k.startswith("_") and k not in _UNSAFE_KEYS}


def make_config(hf_cfg: dict[str, Any], num_layers: int | None = None):
    """transformers config from the dict (AutoConfig.for_model), use_cache off, depth overridden if asked."""
    import transformers

    config = transformers.AutoConfig.for_model(**hf_cfg)
    if num_layers is not None:
        config.num_hidden_layers = num_layers
    config.use_cache = False
    return config


def torch_dtype(job: Job):
    """The torch dtype of the training dtype."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[job.training.dtype]


def build_model(config, job: Job, ds_config: dict, device: str):
    """Random-init causal LM built directly on ``device`` (under deepspeed.zero.Init for ZeRO-3)."""
    import torch
    import transformers

    kwargs = {"dtype": torch_dtype(job), "attn_implementation": ATTN_IMPLEMENTATION[job.training.attention]}
    if job.training.zero.stage == 3:
        import deepspeed

        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
    else:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
    model.train()  # from_config leaves the module in training mode; say so (dropout masks count)
    if job.training.checkpointing == "full":
        model.gradient_checkpointing_enable()  # transformers' default kwargs
    return model


def decoder_layers(model) -> list:
    """The decoder layers: model.layers (Llama family), transformer.h (GPT-2, BLOOM), gpt_neox.layers."""
    for path in ("model.layers", "transformer.h", "gpt_neox.layers"):
        obj = model
        for attr in path.split("."):
            obj = getattr(obj, attr, None)
        if obj is not None:
            return list(obj)
    return []


def final_modules(model) -> list[tuple[str, Any]]:
    """(label, module) of the final norm and lm_head, where found."""
    out = []
    for label, path in (("final norm", "model.norm"), ("final norm", "transformer.ln_f"),
                        ("final norm", "gpt_neox.final_layer_norm"), ("lm_head", "lm_head"),
                        ("lm_head", "embed_out")):
        obj = model
        for attr in path.split("."):
            obj = getattr(obj, attr, None)
        if obj is not None:
            out.append((label, obj))
    return out


def meta_param_count(hf_cfg: dict[str, Any]) -> int:
    """Parameters of the full-depth model built on the meta device (tied weights counted once)."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(make_config(hf_cfg))
    return sum(p.numel() for p in model.parameters())


def analytic_param_count(spec: ModelSpec) -> int | None:
    """memplan.params.count_params(spec), or None while that module is missing."""
    try:
        from .. import params
    except ImportError:
        return None
    return params.count_params(spec).total_params
