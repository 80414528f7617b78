"""Qwen3-MoE (transformers 5.17 modeling_qwen3_moe.py): Qwen3's attention (q_norm / k_norm) in Mistral's model
(Qwen3MoeModel: its mask function, layer keyword order and locals), with Qwen3MoeSparseMoeBlock as the MLP on the
MoE layers (ModelSpec.is_moe_layer: decoder_sparse_step, mlp_only_layers) and Llama's gated MLP elsewhere.

The block registers its experts before its router (model order, so ZeRO-3's gather order: gate_up_proj,
down_proj, gate.weight) and is one of DeepSpeed's default ZeRO-3 leaf modules (Net.leaf). Qwen3MoeTopKRouter:
F.linear, ``softmax(router_logits, dtype=torch.float)`` (aten's softmax converts a bf16 input first, a copy
that dies with the call: its half_to_float path is for Half on CUDA only, SoftMax.cpp), topk, the in-place
renormalisation when norm_topk_prob, then ``router_top_value.to(router_logits.dtype)``: the routing weights are
in the training dtype, so the experts (the same grouped_mm_experts_forward as Mixtral's) weight their rows in it.
Symbols as in blocks_moe.py.
"""

from __future__ import annotations

from ..autograd import Tensor
from ..transformer import Net, Output
from . import llama, mixtral


def mlp(net: Net, x: Tensor, i: int) -> Tensor:
    """The layer's MLP: the MoE block (a ZeRO-3 leaf module, with all its parameters in model order; Mixtral's
    block with Qwen3's router options), or Qwen3MoeMLP (Llama's) on a dense layer."""
    m, p = net.m, net.p
    if not m.is_moe_layer(i):
        return llama.mlp(net, x, i)
    pre = f"model.layers.{i}.mlp"
    params = (p[f"{pre}.experts.gate_up_proj"], p[f"{pre}.experts.down_proj"], p[f"{pre}.gate.weight"])
    return net.leaf(pre, lambda z: mixtral.block(net, z, i, m.norm_topk_prob, net.s.b), x, params)


def forward(net: Net) -> Output:
    """Qwen3MoeForCausalLM.forward (output_router_logits False: no auxiliary loss)."""
    return llama.forward(net, mlp_fn=mlp)
