"""Each model family's forward in the autograd model (``forward(net) -> Output``), by ModelSpec.family.

The family modules are imported when a ledger is built, not when ``ledger_supported`` asks which families
exist (every estimate asks; the phase-list jobs never need the autograd model)."""

from __future__ import annotations

from importlib import import_module

#: family → the module whose forward runs it (Mistral, Qwen2 and Qwen3 are copies of Llama's code in
#: transformers 5.17; Gemma 2 and Gemma 3 text share one module)
FORWARD = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama", "mixtral": "mixtral",
           "qwen3_moe": "qwen3_moe", "gpt2": "gpt2", "gpt_neox": "gpt_neox", "bloom": "bloom",
           "deepseek_v3": "deepseek_v3", "olmo2": "olmo2", "phi3": "phi3", "gemma2": "gemma",
           "gemma3_text": "gemma"}


def forward(net):
    """The model's forward for its family (KeyError names a family not written yet)."""
    return import_module(f"{__name__}.{FORWARD[net.m.family]}").forward(net)
