"""Gemma 2 and Gemma 3 text (transformers 5.17 modeling_gemma2.py, modeling_gemma3.py).

Gemma*TextScaledWordEmbedding multiplies the looked-up rows by embed_scale (√hidden, a buffer cast to the
weight's dtype: a 0-d temporary). Gemma*RMSNorm computes in fp32 and multiplies by (1 + weight.float()): the
[h] fp32 copy and sum are per call, the fp32 product is cast back with type_as. Gemma*DecoderLayer has four
norms (input, post-attention, pre- and post-feedforward). The model builds both masks (create_causal_mask, then
create_sliding_window_causal_mask) and each layer takes its layer type's; Gemma 3 builds one RoPE table pair
per layer type (two of the same size) and norms q and k per head before RoPE. Gemma 2's eager attention
soft-caps the scores (/ cap, tanh, · cap: attn_logit_softcapping; Gemma 3 never passes it on) and its logits
are soft-capped the same way (final_logit_softcapping) before the loss. The MLP is gated with
gelu_pytorch_tanh. Symbols as in blocks.py.
"""

from __future__ import annotations

from .. import blocks as B
from .. import blocks_attention as A
from ..autograd import Tensor
from ..cuda_reduce import stage_reduction
from ..causal_lm import causal_lm_head, embedding
from ..transformer import Net, Output, causal_mask, frame_extras, packed_sequence_check, position_ids, rotary
from . import llama


def rmsnorm(net: Net, x: Tensor, name: str) -> Tensor:
    """Gemma*RMSNorm.forward: x.float(), x·rsqrt(mean(x²) + eps), · (1.0 + weight.float()), .type_as(x)."""
    w = net.p[f"{name}.weight"]
    return net.module(name, lambda z: _rmsnorm(net, z, w, name), x, params=(w,))


def _rmsnorm(net: Net, x: Tensor, w: Tensor, name: str) -> Tensor:
    ag, b = net.ag, net.s.b
    n = x.nbytes // b
    wn = w.nbytes // b
    rows = n // max(1, wn)
    x32 = B.to_dtype(ag, x, B.FP32 * n, f"{name}.fp32_input")
    p = B.pow2(ag, x32, f"{name}.pow")
    var = B.mean_last(ag, p, B.FP32 * rows, f"{name}.variance")
    ag.release(p)
    s = B.add_scalar(ag, var, f"{name}.plus_eps")
    ag.release(var)
    r = B.rsqrt(ag, s, f"{name}.rsqrt")
    ag.release(s)
    normed = B.mul(ag, x32, r, B.FP32 * n, f"{name}.normed_fp32")
    ag.release(r)
    ag.release(x32)  # _norm returns; x.float() dies
    w32 = B.to_dtype(ag, w, B.FP32 * wn, f"{name}.weight_fp32")
    plus = B.add_scalar(ag, w32, f"{name}.one_plus_weight")
    ag.release(w32)
    out32 = B.mul(ag, normed, plus, B.FP32 * n, f"{name}.scaled_fp32")  # (1 + w)'s grad: summed to [h] fp32
    stage_reduction(out32, 1, rows, wn, net.device == "cuda")
    ag.release(plus)
    ag.release(normed)
    out = B.to_dtype(ag, out32, x.nbytes, f"{name}.out")
    ag.release(out32)
    return out


def attention(net: Net, x: Tensor, i: int, cos: Tensor, sin: Tensor, mask: Tensor | None
              ) -> tuple[Tensor, Tensor | None]:
    """Gemma*Attention.forward: q/k/v projections viewed as heads (Gemma 3: q_norm, k_norm on them), RoPE,
    the attention interface (Gemma 2's eager soft-caps), o_proj."""
    ag, m = net.ag, net.m
    pre = f"model.layers.{i}.self_attn"
    g = llama.geometry(net)
    dropout = m.attention_dropout
    v_copies = A.grad_copies(net, g, mask is not None, dropout)[2]
    views = []
    for which, width in (("q", m.q_dim), ("k", m.kv_dim), ("v", m.kv_dim)):
        z = net.linear(x, f"{pre}.{which}_proj", width, m.attention_bias)
        # RoPE's grads (through Gemma 3's norms too) come back contiguous [B, heads, S, d]: the view's
        # backward copies them; v's as the kernel returns it (blocks_attention.grad_copies)
        views.append(B.heads_view(ag, z, copy_grad=which != "v" or v_copies))
        ag.release(z)
    qv, kv, vv = views
    if m.qk_norm:
        qn = rmsnorm(net, qv, f"{pre}.q_norm")  # query_states rebound: the projection's output dies
        ag.release(qv)
        kn = rmsnorm(net, kv, f"{pre}.k_norm")
        ag.release(kv)
        qv, kv = qn, kn
    qr = B.rotate_half_embed(ag, qv, cos, sin, f"{pre}.q")
    kr = B.rotate_half_embed(ag, kv, cos, sin, f"{pre}.k")
    ag.release(qv)
    ag.release(kv)
    y, weights = llama.attend(net, qr, kr, vv, mask, g, pre, softcap=m.attn_logit_softcapping is not None)
    for z in (qr, kr, vv):
        ag.release(z)
    return y, weights


def gelu(ag, x: Tensor, name: str) -> Tensor:
    """gelu_pytorch_tanh (F.gelu(approximate="tanh")): saves its input; GeluBackward0 allocates one grad."""
    return ag.op(name, x.nbytes, (x,), (x,), lambda ctx, grad, node: (ctx.new(f"grad.{name}", x.nbytes),))


def mlp(net: Net, x: Tensor, i: int) -> Tensor:
    """Gemma*MLP.forward: down(gelu_tanh(gate(x)) · up(x)), a module without parameters of its own."""
    pre = f"model.layers.{i}.mlp"
    return net.container(pre, lambda z: llama.gated_mlp(net, z, pre, net.m.intermediate_size, act=gelu), x)


def layer(net: Net, x: Tensor, i: int, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
    """Gemma*DecoderLayer.forward: the sandwich norms around attention and the MLP."""
    return llama.post_norm_layer(net, x, i, cos, sin, mask, rmsnorm, mlp, attention, pre_norms=True)


def forward(net: Net) -> Output:
    """Gemma2ForCausalLM / Gemma3ForCausalLM.forward(input_ids, labels)."""
    ag, m, s, p = net.ag, net.m, net.s, net.p
    w = p["model.embed_tokens.weight"]

    def embed():
        rows = embedding(ag, m, s, w, cuda=net.device == "cuda")
        scale = ag.empty("model.embed_tokens.embed_scale", s.b)  # embed_scale.to(weight dtype): 0-d
        out = B.mul(ag, rows, scale, rows.nbytes, "model.embed_tokens.scaled")
        ag.release(rows)
        ag.release(scale)
        return out

    emb = net.module("model.embed_tokens", embed, params=(w,))
    pos_ids = position_ids(ag, s)
    packed_sequence_check(ag, s)  # each mask function checks for packed sequences
    full = causal_mask(net, sliding=False)  # causal_mask_mapping: create_causal_mask first
    packed_sequence_check(ag, s)
    sliding = causal_mask(net, sliding=True)
    # Gemma 3: one table pair per layer type, in set(config.layer_types)'s order (string hashes: this
    # interpreter's order, as transformers' loop sees it; both pairs have one size, so only names depend on it)
    types = list({_layer_type(m, i) for i in range(m.num_layers)}) if m.family == "gemma3_text" else ["all"]
    tables = {t: net.container("model.rotary_emb", lambda: rotary(ag, m, s)) for t in types}
    hidden = ag.ref(emb)
    for i in range(m.num_layers):
        mask = sliding if m.is_sliding_layer(i) else full
        cos, sin = tables[_layer_type(m, i) if m.family == "gemma3_text" else "all"]
        new = net.layer(i, hidden, lambda x, i=i, mask=mask, cos=cos, sin=sin: net.container(
            f"model.layers.{i}", lambda z: layer(net, z, i, cos, sin, mask), x), frame_extras(mask, (cos, sin), pos_ids))
        ag.release(hidden)
        hidden = new
    normed = rmsnorm(net, hidden, "model.norm")
    ag.release(hidden)
    # the model returns (co_varnames): position_ids and inputs_embeds (still held by mask_kwargs), the mask
    # mapping (full, then sliding), mask_kwargs' values (inputs_embeds, position_ids), the RoPE tables
    for t in (full, sliding, emb, pos_ids):
        ag.release(t)
    for cos, sin in tables.values():
        ag.release(cos)
        ag.release(sin)
    cap = (lambda z: B.soft_cap(ag, z, "lm_head.softcap")) if m.final_logit_softcapping is not None else None
    return causal_lm_head(net, net.base_model_output("model", normed), cap)


def _layer_type(m, i: int) -> str:
    return "sliding_attention" if m.is_sliding_layer(i) else "full_attention"
