"""Llama-style decoder models (transformers 5.17 modeling_llama.py and its copies: mistral, qwen2, qwen3).

``forward`` is ``LlamaForCausalLM.forward``: LlamaModel (embed_tokens, position_ids, the mask checks, the
rotary tables, each LlamaDecoderLayer, the final norm), lm_head, ForCausalLMLoss. Symbols as in blocks.py.
"""

from __future__ import annotations

from .. import blocks as B
from ..autograd import Tensor
from ..transformer import Net, Output, causal_lm_loss, embedding, logits_comp, positions, rotary


def attention(net: Net, x: Tensor, i: int, cos: Tensor, sin: Tensor) -> Tensor:
    """LlamaAttention.forward: q/k/v projections viewed as [B, heads, S, d], RoPE on q and k, the attention
    kernel, the output projection."""
    ag, m, s = net.ag, net.m, net.s
    pre = f"model.layers.{i}.self_attn"
    proj = []
    for which, width in (("q", m.q_dim), ("k", m.kv_dim), ("v", m.kv_dim)):
        z = net.linear(x, f"{pre}.{which}_proj", width, m.attention_bias)
        # .view(hidden_shape).transpose(1, 2): q and k reach RoPE, whose grads come back in the kernel's
        # [B, heads, S, d] layout, so the view's backward (a reshape of the transposed grad) copies them
        proj.append(B.heads_view(ag, z, copy_grad=which != "v"))
        ag.release(z)
    qv, kv, vv = proj
    qr = B.rotate_half_embed(ag, qv, cos, sin, f"{pre}.q")
    kr = B.rotate_half_embed(ag, kv, cos, sin, f"{pre}.k")
    ag.release(qv)
    ag.release(kv)
    out = B.flash_attention(ag, qr, kr, vv, heads=m.num_heads, kv_heads=m.num_kv_heads, seq=s.attn_seq,
                            batch=s.batch, head_dim=m.head_dim, b=s.b, name=f"{pre}.attn")
    o_in = ag.view(out)  # transpose(1, 2).contiguous() and reshape: already [B, S, nh, d]
    ag.release(out)
    y = net.linear(o_in, f"{pre}.o_proj", m.hidden_size, m.attention_out_bias)
    ag.release(o_in)  # attn_output rebound to o_proj's output
    for z in (qr, kr, vv):  # the function returns: query/key/value_states die
        ag.release(z)
    return y


def mlp(net: Net, x: Tensor, i: int) -> Tensor:
    """LlamaMLP.forward: down(act(gate(x)) · up(x))."""
    ag, m, s = net.ag, net.m, net.s
    pre, n = f"model.layers.{i}.mlp", m.intermediate_size
    gate = net.linear(x, f"{pre}.gate_proj", n, m.mlp_bias)
    act = B.silu(ag, gate, f"{pre}.act")
    ag.release(gate)
    up = net.linear(x, f"{pre}.up_proj", n, m.mlp_bias)
    prod = B.mul(ag, act, up, s.b * s.tokens * n, f"{pre}.act_up")
    ag.release(act)
    ag.release(up)
    y = net.linear(prod, f"{pre}.down_proj", m.hidden_size, m.mlp_bias)
    ag.release(prod)
    return y


def layer(net: Net, x: Tensor, i: int, cos: Tensor, sin: Tensor) -> Tensor:
    """LlamaDecoderLayer.forward; ``x`` stays referenced by the caller during the call."""
    ag = net.ag
    pre = f"model.layers.{i}"
    residual = ag.ref(x)
    h = net.rmsnorm(x, f"{pre}.input_layernorm")
    a = attention(net, h, i, cos, sin)
    ag.release(h)
    h = B.add(ag, residual, a, f"{pre}.attn_residual")
    ag.release(a)
    ag.release(residual)
    residual = ag.ref(h)
    h2 = net.rmsnorm(h, f"{pre}.post_attention_layernorm")
    ag.release(h)
    y = mlp(net, h2, i)
    ag.release(h2)
    out = B.add(ag, residual, y, f"{pre}.mlp_residual")
    ag.release(y)
    ag.release(residual)
    return out


def forward(net: Net) -> Output:
    """LlamaForCausalLM.forward(input_ids, labels): the output object (loss and logits)."""
    ag, m, s, p = net.ag, net.m, net.s, net.p
    w = p["model.embed_tokens.weight"]
    emb = net.module("model.embed_tokens", lambda: embedding(ag, m, s, w), params=(w,))
    pos_ids = positions(ag, s)
    cos, sin = rotary(ag, m, s)
    hidden = ag.ref(emb)
    for i in range(m.num_layers):
        extras = (cos, sin) if pos_ids is None else (cos, sin, pos_ids)  # the layer's tensor arguments
        new = net.layer(i, hidden, lambda x, i=i: layer(net, x, i, cos, sin), extras)
        ag.release(hidden)
        hidden = new
    normed = net.rmsnorm(hidden, "model.norm")
    ag.release(hidden)
    for t in (pos_ids, emb, cos, sin):  # LlamaModel.forward returns: its locals die in co_varnames order
        ag.release(t)
    head_in = ag.view(normed)  # hidden_states[:, slice(0, None), :]
    ag.release(normed)
    logits = net.linear(head_in, "lm_head", m.vocab_size)
    ag.release(head_in)
    logits_comp(ag, logits)
    loss = causal_lm_loss(ag, m, s, logits)
    return Output(loss, logits)
