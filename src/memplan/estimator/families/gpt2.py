"""GPT-2 (transformers 5.17 modeling_gpt2.py): learned positions, LayerNorm, Conv1D projections with biases,
NewGELU in Python, dropouts with the config's probabilities, eager (its own eager_attention_forward) or sdpa
attention. ``forward`` is GPT2LMHeadModel.forward (lm_head tied to wte by default). Symbols as in blocks.py.
"""

from __future__ import annotations

from .. import blocks as B
from .. import blocks_attention as A
from .. import blocks_gpt as G
from .. import blocks_linear as BL
from ..autograd import Tensor
from ..causal_lm import causal_lm_head, embedding
from ..transformer import Net, Output, causal_mask, frame_extras, packed_sequence_check, position_ids


def dropout(net: Net, x: Tensor, p: float, name: str) -> Tensor:
    """nn.Dropout(p) in training (a module: Net.container); returns x itself when p is 0."""
    return net.container(name, lambda z: B.dropout(net.ag, z, p, net.s.b, name, net.device), x)


def eager_attention(net: Net, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, g: A.Geometry,
                    name: str) -> tuple[Tensor, Tensor]:
    """GPT-2's eager_attention_forward: (q @ k^T)·scaling (torch.matmul copies q and k, whose memory is
    [B, S, 3h] rows, for B > 1), + mask, softmax in the dtype, dropout, @ v, transpose(1, 2) (a view; the
    caller's reshape copies it). Returns the output and attn_weights (the dropout's output)."""
    ag = net.ag
    copy = A._folds_copy(True, g)
    scores = BL.matmul(ag, q, k, g.scores(), f"{name}.scores", copy_a=copy, copy_c=copy, batch=g.batch * g.heads,
                       elem_bytes=g.b)
    scaled = B.scale(ag, scores, f"{name}.scaled")
    ag.release(scores)
    if mask is not None:
        masked = B.add(ag, scaled, mask, f"{name}.masked")
        ag.release(scaled)
        scaled = masked
    probs = B.softmax(ag, scaled, g.scores(), f"{name}.softmax", device=net.device)  # no dtype: the input's
    ag.release(scaled)
    dropped = dropout(net, probs, net.m.attention_dropout, f"{name}.dropout")
    ag.release(probs)
    out = BL.matmul(ag, dropped, v, g.bytes(), f"{name}.out", copy_c=copy, grad_copy=copy, batch=g.batch * g.heads,
                    elem_bytes=g.b)
    return out, dropped


def attention(net: Net, x: Tensor, i: int, mask: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """GPT2Attention.forward: c_attn, split in q, k, v (views under one SplitBackward0), each viewed as
    [B, nh, S, d]; the attention interface; reshape(..).contiguous() (a copy after eager's transpose, a view
    after sdpa's contiguous); c_proj; resid_dropout. Returns the output and attn_weights (None for sdpa)."""
    ag, m, s = net.ag, net.m, net.s
    pre, h = f"transformer.h.{i}.attn", m.hidden_size
    g = A.Geometry(s.batch, s.attn_seq, m.num_heads, m.num_heads, m.head_dim, s.b)
    qkv = net.conv1d(x, f"{pre}.c_attn", 3 * h)
    parts = G.split(ag, qkv, (qkv.nbytes // 3,) * 3, f"{pre}.split")
    ag.release(qkv)
    # key, then value, then query are viewed as heads (that order; their view backwards run in reverse)
    copies = A.grad_copies(net, g, mask is not None, m.attention_dropout)
    k = B.heads_view(ag, parts[1], copy_grad=copies[1])
    v = B.heads_view(ag, parts[2], copy_grad=copies[2])
    q = B.heads_view(ag, parts[0], copy_grad=copies[0])
    for t in parts:
        ag.release(t)
    if net.attention == "eager":
        out, weights = eager_attention(net, q, k, v, mask, g, f"{pre}.attn")
        o = B.clone(ag, out, f"{pre}.attn.out_contiguous")
    else:
        out, weights = A.sdpa_attention(net, q, k, v, mask, g, dropout=m.attention_dropout, name=f"{pre}.attn"), None
        o = ag.view(out)
    ag.release(out)
    y = net.conv1d(o, f"{pre}.c_proj", h)
    ag.release(o)
    z = dropout(net, y, m.hidden_dropout, f"{pre}.resid_dropout")
    ag.release(y)
    for t in (q, k, v):  # the locals die as forward returns
        ag.release(t)
    return z, weights


def mlp(net: Net, x: Tensor, i: int) -> Tensor:
    """GPT2MLP.forward: c_fc, act (gelu_new: NewGELUActivation in Python), c_proj, dropout."""
    ag, m = net.ag, net.m
    pre = f"transformer.h.{i}.mlp"
    a = net.conv1d(x, f"{pre}.c_fc", m.intermediate_size)
    gelu = G.gelu_new if m.activation == "gelu_new" else G.gelu
    act = net.container(f"{pre}.act", lambda z: gelu(ag, z, f"{pre}.act"), a)
    ag.release(a)
    y = net.conv1d(act, f"{pre}.c_proj", m.hidden_size)
    ag.release(act)
    z = dropout(net, y, m.hidden_dropout, f"{pre}.dropout")
    ag.release(y)
    return z


def block(net: Net, x: Tensor, i: int, mask: Tensor | None) -> Tensor:
    """GPT2Block.forward: ln_1, attn, attn_output + residual, ln_2, mlp, residual + mlp output; attn_output
    and the mlp output die as it returns."""
    ag = net.ag
    pre = f"transformer.h.{i}"
    h = net.layernorm(x, f"{pre}.ln_1")
    a, weights = net.container(f"{pre}.attn", lambda z: attention(net, z, i, mask), h)  # attn_output, _ = self.attn(...)
    hidden = B.add(ag, a, x, f"{pre}.attn_residual")
    ag.release(h)  # hidden_states (ln_1's output) rebound to attn_output + residual
    h2 = net.layernorm(hidden, f"{pre}.ln_2")
    ff = net.container(f"{pre}.mlp", lambda z: mlp(net, z, i), h2)
    out = B.add(ag, hidden, ff, f"{pre}.mlp_residual")
    ag.release(h2)  # hidden_states (ln_2's output) rebound to residual + feed_forward_hidden_states
    for t in (hidden, a, weights, ff):  # co_varnames: residual, attn_output, _, feed_forward_hidden_states
        ag.release(t)
    return out


def forward(net: Net) -> Output:
    """GPT2LMHeadModel.forward(input_ids, labels): GPT2Model (wte + wpe(position_ids), the mask, drop,
    each block, ln_f), lm_head, ForCausalLMLoss."""
    ag, m, s, p = net.ag, net.m, net.s, net.p
    wte, wpe = p["transformer.wte.weight"], p["transformer.wpe.weight"]
    emb = net.module("transformer.wte", lambda: embedding(ag, m, s, wte, name="wte", cuda=net.device == "cuda"),
                     params=(wte,))
    pos = position_ids(ag, s)
    pe = net.module("transformer.wpe", lambda: embedding(ag, m, s, wpe, rows=s.pos_batch * s.seq, name="wpe",
                                                         indices=pos, cuda=net.device == "cuda"), params=(wpe,))
    hidden = G.add_broadcast(ag, emb, pe, "transformer.embeddings")
    packed_sequence_check(ag, s)
    mask = causal_mask(net)
    dropped = dropout(net, hidden, m.embedding_dropout, "transformer.drop")
    ag.release(hidden)
    hidden = dropped
    for i in range(m.num_layers):
        # checkpointed, the frame drops the keyword arguments (position_ids), then the positional ones last
        # first: the mask (passed positionally), then the hidden states
        new = net.layer(i, hidden, lambda x, i=i: net.container(f"transformer.h.{i}", lambda z: block(net, z, i, mask), x),
                        frame_extras(pos, mask))
        ag.release(hidden)
        hidden = new
    normed = net.layernorm(hidden, "transformer.ln_f")
    ag.release(hidden)
    for t in (pos, emb, pe, mask):  # GPT2Model.forward returns: its locals die in co_varnames order
        ag.release(t)
    return causal_lm_head(net, net.base_model_output("transformer", normed))  # .view(output_shape) first: a view
