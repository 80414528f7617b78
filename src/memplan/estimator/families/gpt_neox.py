"""GPT-NeoX (transformers 5.17 modeling_gpt_neox.py): a fused query_key_value projection viewed as
[B, nh, S, 3d] and chunked, partial rotary (the first head_dim · rotary_pct dims, concatenated back with the
rest), parallel residual (attention and MLP read the same input) or sequential, LayerNorms, GELU.
``forward`` is GPTNeoXForCausalLM.forward. Symbols as in blocks.py.
"""

from __future__ import annotations

from .. import blocks as B
from .. import blocks_attention as A
from .. import blocks_gpt as G
from ..autograd import Tensor
from ..causal_lm import causal_lm_head, embedding
from ..transformer import Net, Output, causal_mask, frame_extras, positions, rotary


def rotary_dims(net: Net) -> int:
    """GPTNeoXAttention.rotary_ndims: int(head_size · partial_rotary_factor)."""
    return int(net.m.head_dim * net.m.rotary_pct)


def dropout(net: Net, x: Tensor, p: float, name: str) -> Tensor:  # an nn.Dropout module
    """nn.Dropout(p) in training; returns x itself when p is 0."""
    return net.container(name, lambda z: B.dropout(net.ag, z, p, net.s.b, name, net.device), x)


def partial_rope(net: Net, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, pre: str) -> tuple[Tensor, Tensor]:
    """apply_rotary_pos_emb: x_rot = x[..., :r], x_pass = x[..., r:] (slices) for q then k, RoPE on q_rot
    then on k_rot, then cat([q_embed, q_pass], -1) and cat([k_embed, k_pass], -1): new contiguous
    [B, nh, S, d] tensors (each RoPE output dies as its name is rebound)."""
    ag = net.ag
    r, d = rotary_dims(net), net.m.head_dim
    views = {}
    for w, x in (("q", q), ("k", k)):  # a slice of all of x is an alias (AliasBackward0 passes the grad)
        rot = ag.view(x) if r == d else B.slice_view(ag, x, x.nbytes * r // d, f"{pre}.{w}.rot")
        views[w] = (rot, B.slice_view(ag, x, x.nbytes * (d - r) // d, f"{pre}.{w}.pass"))
    emb = {w: B.rotate_half_embed(ag, views[w][0], cos, sin, f"{pre}.{w}") for w in ("q", "k")}
    out = []
    for w in ("q", "k"):
        out.append(B.cat2(ag, emb[w], views[w][1], f"{pre}.{w}.embed"))
        ag.release(emb[w])
    for w in ("q", "k"):  # the function returns: q_rot, q_pass, k_rot, k_pass die
        for t in views[w]:
            ag.release(t)
    return out[0], out[1]


def attention(net: Net, x: Tensor, i: int, cos: Tensor, sin: Tensor, mask: Tensor | None
              ) -> tuple[Tensor, Tensor | None]:
    """GPTNeoXAttention.forward: query_key_value(x).view(B, S, nh, 3d).transpose(1, 2) (its backward
    reshapes the contiguous grad of the chunk: a copy), chunk(3) into q, k, v, RoPE on q and k (cat makes
    them contiguous [B, nh, S, d]), the attention interface, reshape(..).contiguous(), dense."""
    ag, m, s = net.ag, net.m, net.s
    pre, h = f"gpt_neox.layers.{i}.attention", m.hidden_size
    g = A.Geometry(s.batch, s.attn_seq, m.num_heads, m.num_heads, m.head_dim, s.b)
    z = net.linear(x, f"{pre}.query_key_value", 3 * h, m.attention_bias)
    qkv = B.heads_view(ag, z, copy_grad=True)
    ag.release(z)
    q, k, v = G.split(ag, qkv, (qkv.nbytes // 3,) * 3, f"{pre}.chunk")
    ag.release(qkv)
    qe, ke = partial_rope(net, q, k, cos, sin, pre)
    ag.release(q)
    ag.release(k)
    if net.attention == "eager":
        out, weights = A.eager_attention(net, qe, ke, v, mask, g, dropout=m.attention_dropout,
                                         name=f"{pre}.attn", q_bshd=False, k_bshd=False)
    else:
        out = A.sdpa_attention(net, qe, ke, v, mask, g, dropout=m.attention_dropout, name=f"{pre}.attn",
                               bshd=(False, False, True))
        weights = None
    o_in = ag.view(out)  # attn_output.reshape(*input_shape, -1).contiguous()
    ag.release(out)
    y = net.linear(o_in, f"{pre}.dense", h, m.attention_out_bias)
    ag.release(o_in)
    for t in (qe, ke, v):
        ag.release(t)
    return y, weights


def mlp(net: Net, x: Tensor, i: int) -> Tensor:
    """GPTNeoXMLP.forward: dense_h_to_4h, act (F.gelu), dense_4h_to_h (both with biases)."""
    ag, m = net.ag, net.m
    pre = f"gpt_neox.layers.{i}.mlp"
    a = net.linear(x, f"{pre}.dense_h_to_4h", m.intermediate_size, True)
    act = net.container(f"{pre}.act", lambda z: G.gelu(ag, z, f"{pre}.act"), a)
    ag.release(a)
    y = net.linear(act, f"{pre}.dense_4h_to_h", m.hidden_size, True)
    ag.release(act)
    return y


def layer(net: Net, x: Tensor, i: int, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
    """GPTNeoXLayer.forward: attention(input_layernorm(x)), post_attention_dropout; parallel residual:
    mlp(post_attention_layernorm(x)) and mlp_output + attn_output + x; sequential: attn_output + x first.
    attn_output and mlp_output die as it returns."""
    ag, m = net.ag, net.m
    pre = f"gpt_neox.layers.{i}"
    h = net.layernorm(x, f"{pre}.input_layernorm")
    a, weights = net.container(f"{pre}.attention", lambda z: attention(net, z, i, cos, sin, mask), h)
    ag.release(h)
    attn_out = dropout(net, a, m.hidden_dropout, f"{pre}.post_attention_dropout")
    ag.release(a)
    if m.parallel_residual:
        h2 = net.layernorm(x, f"{pre}.post_attention_layernorm")
        y = net.container(f"{pre}.mlp", lambda z: mlp(net, z, i), h2)
        ag.release(h2)
        mlp_out = dropout(net, y, m.hidden_dropout, f"{pre}.post_mlp_dropout")
        ag.release(y)
        both = B.add(ag, mlp_out, attn_out, f"{pre}.mlp_plus_attn")
        out = B.add(ag, both, x, f"{pre}.residual")
        ag.release(both)
    else:
        res = B.add(ag, attn_out, x, f"{pre}.attn_residual")
        ag.release(attn_out)
        attn_out = res
        h2 = net.layernorm(attn_out, f"{pre}.post_attention_layernorm")
        y = net.container(f"{pre}.mlp", lambda z: mlp(net, z, i), h2)
        ag.release(h2)
        mlp_out = dropout(net, y, m.hidden_dropout, f"{pre}.post_mlp_dropout")
        ag.release(y)
        out = B.add(ag, mlp_out, attn_out, f"{pre}.residual")
    for t in (attn_out, weights, mlp_out):  # co_varnames: attn_output, _, mlp_output
        ag.release(t)
    return out


def forward(net: Net) -> Output:
    """GPTNeoXForCausalLM.forward(input_ids, labels): GPTNeoXModel (embed_in, position_ids, the mask,
    emb_dropout, the rotary tables, each layer, final_layer_norm), lm_head, ForCausalLMLoss."""
    ag, m, s, p = net.ag, net.m, net.s, net.p
    w = p["gpt_neox.embed_in.weight"]
    emb = net.module("gpt_neox.embed_in", lambda: embedding(ag, m, s, w, cuda=net.device == "cuda"), params=(w,))
    pos_ids = positions(ag, s)
    mask = causal_mask(net)
    hidden = dropout(net, emb, m.embedding_dropout, "gpt_neox.emb_dropout")
    cos, sin = net.container("gpt_neox.rotary_emb", lambda: rotary(ag, m, s, rotary_dims(net)))
    for i in range(m.num_layers):
        new = net.layer(i, hidden, lambda x, i=i: net.container(f"gpt_neox.layers.{i}", lambda z: layer(
            net, z, i, cos, sin, mask), x), frame_extras(mask, pos_ids, (cos, sin)))  # attention_mask, position_ids, …
        ag.release(hidden)
        hidden = new
    normed = net.layernorm(hidden, "gpt_neox.final_layer_norm")
    ag.release(hidden)
    for t in (pos_ids, emb, mask, cos, sin):  # GPTNeoXModel.forward returns: locals in co_varnames order
        ag.release(t)
    return causal_lm_head(net, net.base_model_output("gpt_neox", normed))
