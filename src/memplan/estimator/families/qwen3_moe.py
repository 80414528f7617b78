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

from .. import blocks as B
from .. import blocks_moe as M
from ..autograd import Tensor
from ..transformer import Net, Output
from . import llama, mixtral


def _router(net: Net, x: Tensor, w: Tensor, i: int) -> tuple[Tensor, Tensor, Tensor]:
    ag, m, s = net.ag, net.m, net.s
    pre, t, e, k = f"model.layers.{i}.mlp.gate", s.tokens, m.num_experts, m.num_experts_per_tok
    xr = ag.view(x)  # hidden_states.reshape(-1, hidden_dim)
    logits = B.linear(ag, xr, w, s.b * t * e, pre)
    ag.release(xr)
    f32 = B.to_dtype(ag, logits, B.FP32 * t * e, f"{pre}.logits_fp32")  # softmax(dtype=float) converts first
    probs = ag.op(f"{pre}.softmax", B.FP32 * t * e, (f32,), ("out",),
                  lambda ctx, grad, node: (ctx.new(f"grad.{pre}.softmax", B.FP32 * t * e),))
    ag.release(f32)
    values, indices = M.topk(ag, probs, t, k, f"{pre}.topk")
    if m.norm_topk_prob:
        total = M.sum_last(ag, values, B.FP32 * t, f"{pre}.topk_sum")
        normed = M.div_inplace(ag, values, total, f"{pre}.normalized")
        ag.release(values)
        ag.release(total)
        values = normed
    weights = B.to_dtype(ag, values, s.b * t * k, f"{pre}.weights")  # router_top_value rebound: fp32 dies
    ag.release(values)
    ag.release(probs)  # router_probs: a local until the function returns
    return logits, weights, indices


def _moe(net: Net, x: Tensor, i: int) -> Tensor:
    """Qwen3MoeSparseMoeBlock.forward: view to [T, h], the router, the experts, reshape back; router_logits
    (the ``_``) and routing_weights die as it returns."""
    ag, p = net.ag, net.p
    flat = ag.view(x)
    w = p[f"model.layers.{i}.mlp.gate.weight"]
    logits, weights, index = net.module(f"model.layers.{i}.mlp.gate", lambda z: _router(net, z, w, i), flat,
                                        params=(w,), hooked=1)
    pre = f"model.layers.{i}.mlp.experts"
    out = net.module(pre, lambda z, wt: mixtral.experts(net, z, wt, index, i, wb=net.s.b), flat, weights,
                     params=(p[f"{pre}.gate_up_proj"], p[f"{pre}.down_proj"]))
    ag.release(flat)
    for z in (logits, weights, index):
        ag.release(z)
    return out


def mlp(net: Net, x: Tensor, i: int) -> Tensor:
    """The layer's MLP: the MoE block (a ZeRO-3 leaf module, with all its parameters in model order), or
    Qwen3MoeMLP (Llama's) on a dense layer."""
    m, p = net.m, net.p
    if not m.is_moe_layer(i):
        return llama.mlp(net, x, i)
    pre = f"model.layers.{i}.mlp"
    params = (p[f"{pre}.experts.gate_up_proj"], p[f"{pre}.experts.down_proj"], p[f"{pre}.gate.weight"])
    return net.leaf(pre, lambda z: _moe(net, z, i), x, params)


def forward(net: Net) -> Output:
    """Qwen3MoeForCausalLM.forward (output_router_logits False: no auxiliary loss)."""
    return llama.forward(net, mlp_fn=mlp)
