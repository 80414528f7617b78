"""DeepSeek-V3 (transformers 5.17 modeling_deepseek_v3.py): Llama's decoder layer and model around
DeepseekV3Attention (multi-head latent attention, MLA) and, from layer first_k_dense_replace on, DeepseekV3MoE
(DeepseekV3TopkRouter, DeepseekV3Experts through grouped_mm_experts_forward, the shared experts).

MLA (DeepseekV3Attention.forward): q from q_b_proj(q_a_layernorm(q_a_proj(x))) (or q_proj) viewed
[B, nh, S, d_qk] and split into its nope and rope parts; kv_a_proj_with_mqa(x) split into the kv latent
(kv_a_layernorm'd, viewed [B, 1, S, r_kv]) and one shared RoPE key [B, 1, S, d_r]; RoPE on the rope parts
(apply_rotary_pos_emb_interleave when rope_interleave, transformers' default; rotate_half otherwise); the
query is torch.cat(q_pass, q_rot); expand_kv: kv_b_proj(latent) viewed [B, nh, S, nope + d_v] and split
into k_nope and the values, the keys a new_empty [B, nh, S, d_qk] with both parts copy_'d in (CopySlices).
The attention kernel sees d_qk = nope + d_r for q and k and d_v for v (blocks_attention.model_geometry).

DeepseekV3TopkRouter: F.linear of fp32 copies of the input and of the weight (both saved), sigmoid (saves its
result), + e_score_correction_bias, the group-limited choice (per-group topk(2) summed, topk of the groups, a
mask, masked_fill, topk): only integer indices leave it, so its nodes die with their values in the forward
(modelled without a graph, each tensor freed where the function's locals die), then gather of the sigmoid
scores, /= their sum + 1e-20 (in place) when norm_topk_prob, × routed_scaling_factor. The routing weights stay
fp32, so the experts (families/mixtral.py experts, the same grouped_mm_experts_forward) weight fp32 rows.
DeepseekV3MoE is no ZeRO-3 leaf module (DeepSpeed's defaults name Mixtral's and Qwen's blocks only): its
experts, router and shared experts carry their own hooks. Symbols as in blocks.py and blocks_moe.py.
"""

from __future__ import annotations

from .. import blocks as B
from .. import blocks_attention as A
from .. import blocks_moe as M
from .. import peft_param as PW
from ..autograd import Tensor
from ..transformer import Net, Output
from . import llama, mixtral

INT64 = M.INT64


def _rope_interleave(net: Net, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, pre: str) -> tuple[Tensor, Tensor]:
    """apply_rotary_pos_emb_interleave(q, k, cos, sin): cos / sin halves (views), q1, q2 = q[..., 0::2],
    q[..., 1::2] and k1, k2 (SliceBackward0 views, made before any product), then for q and k in turn
    cat([x1·cos − x2·sin, x2·cos + x1·sin], -1); the list's items die last first."""
    ag = net.ag
    cos_h, sin_h = ag.view(cos), ag.view(sin)
    halves = {w: (B.slice_view(ag, x, x.nbytes // 2, f"{pre}.{w}1"), B.slice_view(ag, x, x.nbytes // 2, f"{pre}.{w}2"))
              for w, x in (("q", q), ("k", k))}
    out = []
    for w, x in (("q", q), ("k", k)):
        x1, x2 = halves[w]
        half = x.nbytes // 2
        a = B.mul(ag, x1, cos_h, half, f"{pre}.{w}1_cos")
        c = B.mul(ag, x2, sin_h, half, f"{pre}.{w}2_sin")
        first = B.sub(ag, a, c, f"{pre}.{w}_first")
        ag.release(a)
        ag.release(c)
        a = B.mul(ag, x2, cos_h, half, f"{pre}.{w}2_cos")
        c = B.mul(ag, x1, sin_h, half, f"{pre}.{w}1_sin")
        second = B.add(ag, a, c, f"{pre}.{w}_second")
        ag.release(a)
        ag.release(c)
        out.append(B.cat2(ag, first, second, f"{pre}.{w}_embed"))
        ag.release(second)
        ag.release(first)
    for x1, x2 in halves.values():
        ag.release(x1)
        ag.release(x2)
    ag.release(cos_h)
    ag.release(sin_h)
    return out[0], out[1]


def _expand_kv(net: Net, latent: Tensor, k_rot: Tensor, i: int) -> tuple[Tensor, Tensor]:
    """DeepseekV3Attention.expand_kv: kv_b_proj(latent).view(B, S, nh, nope + d_v).transpose(1, 2), split
    into k_nope and the values (SplitWithSizesBackward0: its backward concatenates both grads, then the view's
    backward reshapes the transposed result: a copy), k_rot.expand to the heads, keys = new_empty
    [B, nh, S, d_qk] with k_nope then k_rot copied into their slices. Returns (keys, values)."""
    ag, m, s = net.ag, net.m, net.s
    pre = f"model.layers.{i}.self_attn"
    nh, nope, dv, dr = m.num_heads, m.qk_nope_head_dim, m.v_head_dim, m.qk_rope_head_dim
    rows = s.b * s.batch * s.attn_seq * nh
    kvb = net.linear(latent, f"{pre}.kv_b_proj", nh * (nope + dv))
    kv = B.heads_view(ag, kvb, copy_grad=True)
    ag.release(kvb)
    k_nope, values = ag.split(kv, (rows * nope, rows * dv), f"{pre}.kv_split",
                              lambda ctx, grads, node: (ctx.new(f"grad.{pre}.kv_split", kv.nbytes),))
    ag.release(kv)
    k_rot_e = B.expand_view(ag, k_rot, rows * dr, f"{pre}.k_rot_expanded")
    keys = ag.empty(f"{pre}.key_states", rows * (nope + dr))
    with_nope = B.copy_slice(ag, keys, k_nope, f"{pre}.key_nope_copy")
    ag.release(keys)
    full = B.copy_slice(ag, with_nope, k_rot_e, f"{pre}.key_rot_copy")
    ag.release(with_nope)
    for t in (k_nope, k_rot_e):  # expand_kv returns: kv_nope (the view), k_nope, k_rot die
        ag.release(t)
    return full, values


def attention(net: Net, x: Tensor, i: int, cos: Tensor, sin: Tensor, mask: Tensor | None
              ) -> tuple[Tensor, Tensor | None]:
    """DeepseekV3Attention.forward (see the module docstring); its locals die as it returns, after o_proj:
    q_states (the q projection's output, q_pass a view of it), q_rot, compressed_kv, kv_nope, k_rot,
    query_states, key_states, value_states. Returns the output and attn_weights (eager's; None for sdpa)."""
    ag, m, s = net.ag, net.m, net.s
    pre = f"model.layers.{i}.self_attn"
    nh, nope, dr, rkv = m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
    dqk = nope + dr
    rows = s.b * s.batch * s.attn_seq * nh
    g = A.model_geometry(m, s.batch, s.attn_seq, s.b)
    if m.q_lora_rank is None:
        q = net.linear(x, f"{pre}.q_proj", nh * dqk)
    else:
        qa = net.linear(x, f"{pre}.q_a_proj", m.q_lora_rank, m.attention_bias)
        qn = net.rmsnorm(qa, f"{pre}.q_a_layernorm")
        ag.release(qa)
        q = net.linear(qn, f"{pre}.q_b_proj", nh * dqk)
        ag.release(qn)
    qv = B.heads_view(ag, q, copy_grad=True)  # .view(query_shape).transpose(1, 2): the split's grad (a cat,
    # contiguous [B, nh, S, d_qk]) is copied back to [B, S, nh·d_qk]
    ag.release(q)
    q_pass, q_rot = ag.split(qv, (rows * nope, rows * dr), f"{pre}.q_split",
                             lambda ctx, grads, node: (ctx.new(f"grad.{pre}.q_split", qv.nbytes),))
    ckv = net.linear(x, f"{pre}.kv_a_proj_with_mqa", rkv + dr, m.attention_bias)
    one = s.b * s.batch * s.attn_seq
    kv_nope, k_rot = ag.split(ckv, (one * rkv, one * dr), f"{pre}.kv_a_split",
                              lambda ctx, grads, node: (ctx.new(f"grad.{pre}.kv_a_split", ckv.nbytes),))
    latent = net.rmsnorm(kv_nope, f"{pre}.kv_a_layernorm")
    ag.release(kv_nope)
    if m.rope_interleave:
        q_rot2, k_rot2 = _rope_interleave(net, q_rot, k_rot, cos, sin, pre)
    else:
        q_rot2 = B.rotate_half_embed(ag, q_rot, cos, sin, f"{pre}.q")
        k_rot2 = B.rotate_half_embed(ag, k_rot, cos, sin, f"{pre}.k")
    ag.release(q_rot)
    ag.release(k_rot)
    query = B.cat2(ag, q_pass, q_rot2, f"{pre}.query_states")
    keys, values = _expand_kv(net, latent, k_rot2, i)
    # q from cat, k from new_empty: contiguous; v a slice of kv_b_proj's view; o_proj's bias is attention_bias
    y, weights = llama.attend(net, query, keys, values, mask, g, pre, bshd=(False, False, True),
                              out_bias=m.attention_bias)
    for t in (qv, q_pass, q_rot2, ckv, latent, k_rot2, query, keys, values):
        ag.release(t)
    return y, weights


def _router(net: Net, x: Tensor, i: int, read=None) -> tuple[Tensor, Tensor, Tensor]:
    """DeepseekV3TopkRouter.forward on x [T, h] (see the module docstring). Returns (router_logits,
    topk_weights, topk_indices). ``read``: how it reads self.weight (peft_param.reader)."""
    ag, m, s = net.ag, net.m, net.s
    pre, t, e, k, h = f"model.layers.{i}.mlp.gate", s.tokens, m.num_experts, m.num_experts_per_tok, m.hidden_size
    groups = m.n_group or 1
    xr = ag.view(x)  # hidden_states.view(-1, hidden_dim)
    x32 = B.to_dtype(ag, xr, B.FP32 * t * h, f"{pre}.input_fp32")
    ag.release(xr)
    w = (read or net.p.__getitem__)(f"{pre}.weight")  # F.linear(x.type(fp32), self.weight.type(fp32))
    w32 = B.to_dtype(ag, w, B.FP32 * e * h, f"{pre}.weight_fp32")
    def linear_backward(ctx, grad, node):  # MmBackward0: mat2's grad (w32.t()'s, a view), then self's
        gw = ctx.new(f"grad.{pre}.weight_fp32", w32.nbytes, view=True) if w32.requires_grad else None
        gx = ctx.new(f"grad.{pre}.input_fp32", x32.nbytes) if x32.requires_grad else None
        return (gx, gw)

    # F.linear(x32, w32) on 2-D inputs: mm with w32.t(); MmBackward0 saves mat2 for self's grad and self for
    # mat2's (neither is a parameter; the CPU trace releases mat2 first): a frozen router keeps only w32
    saved = ((w32,) if x32.requires_grad else ()) + ((x32,) if w32.requires_grad else ())
    logits = ag.op(f"{pre}.logits", B.FP32 * t * e, (x32, w32), saved, linear_backward)
    ag.release(x32)
    ag.release(w32)
    scores = ag.op(f"{pre}.sigmoid", B.FP32 * t * e, (logits,), ("out",),
                   lambda ctx, grad, node: (ctx.new(f"grad.{pre}.sigmoid", B.FP32 * t * e),))
    with_grad, ag.grad_enabled = ag.grad_enabled, False  # the group-limited choice: indices only (see above)
    # a 16-bit bias is cast to fp32 for the add while loading (the CPU's cast temporary is dropped by the trace
    # comparison: memplan.verify.cputrace.DEVICE_KERNELS)
    choice = ag.empty(f"{pre}.scores_for_choice", B.FP32 * t * e)
    top2 = ag.empty(f"{pre}.group_top2.values", B.FP32 * t * 2 * groups)
    top2_idx = ag.empty(f"{pre}.group_top2.indices", INT64 * t * 2 * groups)  # TopkBackward0 keeps it
    if not ag.saving:  # a checkpointed forward: the saved-tensor hook keeps a handle, the indices die here
        ag.release(top2_idx)
        top2_idx = None
    group_scores = ag.empty(f"{pre}.group_scores", B.FP32 * t * groups)
    ag.release(top2)
    gv = ag.empty(f"{pre}.group_topk.values", B.FP32 * t * m.topk_group if m.topk_group else B.FP32 * t)
    group_idx = ag.empty(f"{pre}.group_idx", INT64 * t * (m.topk_group or 1))
    ag.release(gv)
    group_mask = ag.empty(f"{pre}.group_mask", B.FP32 * t * groups)  # zeros_like, scatter_
    # unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E): a copy, except for one group (a size-1 dim folds)
    score_mask = ag.empty(f"{pre}.score_mask", B.FP32 * t * e) if groups > 1 else None
    as_bool = ag.empty(f"{pre}.score_mask_bool", t * e)
    inverted = ag.empty(f"{pre}.score_mask_not", t * e)
    ag.release(as_bool)
    masked = ag.empty(f"{pre}.scores_masked", B.FP32 * t * e)  # masked_fill(~mask, -inf); MaskedFillBackward0 saves ~mask
    if not ag.saving:
        ag.release(inverted)
        inverted = None
    ag.release(choice)
    kv_ = ag.empty(f"{pre}.topk.values", B.FP32 * t * k)
    indices = ag.empty(f"{pre}.topk_indices", INT64 * t * k)
    ag.release(kv_)
    ag.grad_enabled = with_grad
    weights = ag.op(f"{pre}.gather", B.FP32 * t * k, (scores,), (indices,),
                    lambda ctx, grad, node: (ctx.new(f"grad.{pre}.gather", scores.nbytes),))
    if m.norm_topk_prob:
        total = M.sum_last(ag, weights, B.FP32 * t, f"{pre}.topk_sum")
        denom = B.add_scalar(ag, total, f"{pre}.denominator")
        ag.release(total)
        normed = M.div_inplace(ag, weights, denom, f"{pre}.normalized")
        ag.release(weights)
        weights = normed
    else:
        denom = None
    scaled = B.scale(ag, weights, f"{pre}.scaled")
    ag.release(weights)
    # the function returns (co_varnames order): scores, scores_for_choice (with ~mask, its node's),
    # group_scores (with the group topk's indices), group_idx, group_mask, score_mask, denominator;
    # router_logits, weights and indices go out
    for z in (scores, inverted, masked, top2_idx, group_scores, group_idx, group_mask, score_mask, denom):
        ag.release(z)
    return logits, scaled, indices


def _moe(net: Net, x: Tensor, i: int) -> Tensor:
    """DeepseekV3MoE.forward: the router (a module with its weight), the routed experts on the [T, h] view,
    the shared experts (DeepseekV3MLP) on the block's input, their sum; ``_`` (router_logits), topk_weights
    and topk_indices die as it returns."""
    ag, m, p = net.ag, net.m, net.p
    pre = f"model.layers.{i}.mlp"
    acts = PW.activations(net, (f"{pre}.gate.weight",))  # peft's lora.ParamWrapper (peft_param.py)
    read = PW.reader(net, acts)
    logits, weights, index = net.module(f"{pre}.gate",
                                        lambda z: PW.run_wrapped(net, acts, lambda: _router(net, z, i, read)), x,
                                        params=(p[f"{pre}.gate.weight"],), hooked=1)
    flat = ag.view(x)
    routed = net.module(f"{pre}.experts", lambda z, w: mixtral.wrapped_experts(net, z, w, index, i, B.FP32), flat,
                        weights,
                        params=(p[f"{pre}.experts.gate_up_proj"], p[f"{pre}.experts.down_proj"]))
    ag.release(flat)
    rv = ag.view(routed)  # .view(*orig_shape)
    ag.release(routed)
    shared = net.container(f"{pre}.shared_experts", lambda z: llama.gated_mlp(
        net, z, f"{pre}.shared_experts", m.expert_intermediate_size * m.n_shared_experts), x)
    out = B.add(ag, rv, shared, f"{pre}.shared_sum")
    ag.release(shared)
    ag.release(rv)
    for z in (logits, weights, index):
        ag.release(z)
    return out


def mlp(net: Net, x: Tensor, i: int) -> Tensor:
    """The layer's MLP: DeepseekV3MoE from layer first_k_dense_replace on, DeepseekV3MLP (Llama's) before."""
    if net.m.is_moe_layer(i):  # DeepseekV3MoE: a module without parameters of its own (not a ZeRO-3 leaf)
        return net.container(f"model.layers.{i}.mlp", lambda z: _moe(net, z, i), x)
    return llama.mlp(net, x, i)


def forward(net: Net) -> Output:
    """DeepseekV3ForCausalLM.forward: LlamaForCausalLM's, with MLA and the MoE layers."""
    return llama.forward(net, mlp_fn=mlp, attn_fn=attention)
