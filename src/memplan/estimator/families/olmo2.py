"""OLMo 2 (transformers 5.17 modeling_olmo2.py): Llama's model with Olmo2Attention's q_norm / k_norm over the
whole projection width (before the heads view) and Olmo2DecoderLayer's norms after attention and after the MLP
(no input norm). Olmo2RMSNorm casts after the weight: ``(weight · x_normed).to(input_dtype)`` keeps an fp32
product. Olmo2Model.forward is LlamaModel's (the same locals and layer keywords). Symbols as in blocks.py.
"""

from __future__ import annotations

from .. import blocks as B
from .. import blocks_attention as A
from ..autograd import Tensor
from ..cuda_reduce import stage_reduction
from ..transformer import Net, Output
from . import llama


def rmsnorm(net: Net, x: Tensor, name: str) -> Tensor:
    """Olmo2RMSNorm.forward: h = x.to(fp32); var = h.pow(2).mean(-1, keepdim); h = h·rsqrt(var + eps);
    return (weight · h).to(dtype): the product (fp32, weight promoted) is saved by nothing and dies with the
    cast; the weight's grad, grad·h in fp32, is summed and cast to the weight's size (validate_outputs)."""
    w = net.p[f"{name}.weight"]
    return net.module(name, lambda z: _rmsnorm(net, z, w, name), x, params=(w,))


def _rmsnorm(net: Net, x: Tensor, w: Tensor, name: str) -> Tensor:
    ag, b = net.ag, net.s.b
    n = x.nbytes // b
    rows = n // max(1, w.nbytes // b)
    h32 = B.to_dtype(ag, x, B.FP32 * n, f"{name}.fp32_input")
    p = B.pow2(ag, h32, f"{name}.pow")
    var = B.mean_last(ag, p, B.FP32 * rows, f"{name}.variance")
    ag.release(p)
    s = B.add_scalar(ag, var, f"{name}.plus_eps")
    r = B.rsqrt(ag, s, f"{name}.rsqrt")
    ag.release(s)
    h2 = B.mul(ag, h32, r, B.FP32 * n, f"{name}.normed_fp32")
    ag.release(r)
    ag.release(h32)
    cpu16 = net.device == "cpu" and b != B.FP32  # the CPU casts the 16-bit weight for a product (a temporary)
    w32 = w.nbytes * B.FP32 // b

    def backward(ctx, grad, node):  # MulBackward0: other's (h's) grad grad·weight, then self's grad·h, which
        tmp = ctx.new(f"{name}.bw_weight_fp32", w32) if cpu16 else None  # validate_outputs sums to [h] (fp32)
        gh = ctx.new(f"grad.{name}.normed_fp32", B.FP32 * n)  # then casts to the weight's dtype
        if tmp is not None:
            ctx.free(tmp)
        if not w.requires_grad:
            return (None, gh)
        gw = ctx.new(f"grad.{name}.weight", B.FP32 * n)
        gw.summed_bytes = w32
        return (gw, gh)

    promoted = ag.empty(f"{name}.weight_fp32", w32) if cpu16 and not ag.recompute_stops_at_next_op() else None
    saved = tuple(t for t, other in ((h2, w), (w, h2)) if other.requires_grad)  # as blocks.mul
    prod = ag.op(f"{name}.weighted_fp32", B.FP32 * n, (w, h2), saved, backward)
    stage_reduction(prod, 0, rows, w.nbytes // b, net.device == "cuda")  # the weight's fp32 grad, then cast
    ag.release(promoted)
    out = B.to_dtype(ag, prod, b * n, f"{name}.out")
    ag.release(prod)
    ag.release(h2)  # the function returns: hidden_states, then variance
    ag.release(var)
    return out


def rope(net: Net, x: Tensor, cos: Tensor, sin: Tensor, name: str) -> Tensor:
    """Olmo2's apply_rotary_pos_emb for one of q, k with fp32 cos / sin: blocks.rotate_half_embed with fp32
    products (type promotion; the CPU casts the 16-bit operand first), to be cast back to x's dtype. The
    products' x grads are cast back by the engine (validate_outputs)."""
    b = net.s.b
    return B.rotate_half_embed(net.ag, x, cos, sin, name, wide_bytes=x.nbytes * B.FP32 // b,
                               cast_first=net.device == "cpu" and b != B.FP32)


def attention(net: Net, x: Tensor, i: int, cos: Tensor, sin: Tensor, mask: Tensor | None
              ) -> tuple[Tensor, Tensor | None]:
    """Olmo2Attention.forward: q_norm(q_proj(x)), k_norm(k_proj(x)), v_proj(x), then the three heads views,
    RoPE (rotate_half), the attention interface, o_proj; q, k, v die as it returns."""
    ag, m = net.ag, net.m
    pre = f"model.layers.{i}.self_attn"
    g = llama.geometry(net)
    dropout = m.attention_dropout
    v_copies = A.grad_copies(net, g, mask is not None, dropout)[2]
    flat = []
    for which, width in (("q", m.q_dim), ("k", m.kv_dim), ("v", m.kv_dim)):
        z = net.linear(x, f"{pre}.{which}_proj", width, m.attention_bias)
        if which != "v":
            normed = rmsnorm(net, z, f"{pre}.{which}_norm")
            ag.release(z)
            z = normed
        flat.append(z)
    # .view(hidden_shape).transpose(1, 2): q's and k's grads come back from RoPE contiguous (a copy), v's as
    # the kernel returns it (blocks_attention.grad_copies)
    qv, kv, vv = (B.heads_view(ag, z, copy_grad=w != "v" or v_copies) for w, z in zip("qkv", flat))
    for z in flat:
        ag.release(z)
    q32 = rope(net, qv, cos, sin, f"{pre}.q")
    k32 = rope(net, kv, cos, sin, f"{pre}.k")
    qr = B.to_dtype(ag, q32, qv.nbytes, f"{pre}.q_embed")  # return q_embed.to(q_type), k_embed.to(k_type)
    kr = B.to_dtype(ag, k32, kv.nbytes, f"{pre}.k_embed")
    ag.release(q32)  # apply_rotary_pos_emb returns: q_embed, k_embed die
    ag.release(k32)
    ag.release(qv)  # query_states, key_states rebound
    ag.release(kv)
    y, weights = llama.attend(net, qr, kr, vv, mask, g, pre)
    for z in (qr, kr, vv):
        ag.release(z)
    return y, weights


def layer(net: Net, x: Tensor, i: int, cos: Tensor, sin: Tensor, mask: Tensor | None, mlp_fn=llama.mlp,
          attn_fn=attention) -> Tensor:
    """Olmo2DecoderLayer.forward: residual + post_attention_layernorm(attention(x)), then residual +
    post_feedforward_layernorm(mlp(h))."""
    return llama.post_norm_layer(net, x, i, cos, sin, mask, rmsnorm, mlp_fn, attn_fn, pre_norms=False)


def forward(net: Net) -> Output:
    """Olmo2ForCausalLM.forward: LlamaForCausalLM's with OLMo 2's layer and final norm."""
    return llama.forward(net, attn_fn=attention, block=layer, norm_fn=rmsnorm)
