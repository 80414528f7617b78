"""Each model family's forward in the autograd model (``forward(net) -> Output``), by ModelSpec.family."""

from __future__ import annotations

from ..transformer import Net, Output
from . import bloom, deepseek_v3, gemma, gpt2, gpt_neox, llama, mixtral, olmo2, phi3, qwen3_moe

#: family → its forward (Mistral, Qwen2 and Qwen3 are copies of Llama's code in transformers 5.17)
FORWARD = {"llama": llama.forward, "mistral": llama.forward, "qwen2": llama.forward, "qwen3": llama.forward,
           "mixtral": mixtral.forward, "qwen3_moe": qwen3_moe.forward, "gpt2": gpt2.forward, "gpt_neox": gpt_neox.forward,
           "bloom": bloom.forward, "deepseek_v3": deepseek_v3.forward,
           "olmo2": olmo2.forward, "phi3": phi3.forward, "gemma2": gemma.forward, "gemma3_text": gemma.forward}


def forward(net: Net) -> Output:
    """The model's forward for its family (KeyError names a family not written yet)."""
    return FORWARD[net.m.family](net)
