"""Llama-style decoder models: transformers 5.17 modeling_llama.py and its copies (modular files): mistral
(a sliding-window mask), qwen2 (q/k/v biases; the mask mapping), qwen3 (q_norm / k_norm per head before RoPE).

``forward`` is ``LlamaForCausalLM.forward``: LlamaModel (embed_tokens, position_ids, the mask, the rotary
tables, each LlamaDecoderLayer, the final norm), lm_head, ForCausalLMLoss. ``layer`` takes the MLP as a
function so that Mixtral (families/mixtral.py) reuses the rest. Symbols as in blocks.py.
"""

from __future__ import annotations

from .. import blocks as B
from .. import blocks_attention as A
from ..autograd import Tensor
from ..causal_lm import causal_lm_head, embedding
from ..transformer import Net, Output, causal_mask, frame_extras, positions, rotary


def geometry(net: Net) -> A.Geometry:
    """The attention call's sizes."""
    m, s = net.m, net.s
    return A.Geometry(s.batch, s.attn_seq, m.num_heads, m.num_kv_heads, m.head_dim, s.b)


def attention(net: Net, x: Tensor, i: int, cos: Tensor, sin: Tensor, mask: Tensor | None
              ) -> tuple[Tensor, Tensor | None]:
    """LlamaAttention.forward: q/k/v projections viewed as [B, heads, S, d] (Qwen3: each RMSNorm'd per head
    first), RoPE on q and k, the attention interface (eager or sdpa), the output projection; the locals
    (q, k, v) die as it returns, after o_proj. Returns the output and attn_weights (eager's; None for sdpa)."""
    ag, m = net.ag, net.m
    pre = f"model.layers.{i}.self_attn"
    g = geometry(net)
    dropout = m.attention_dropout
    v_copies = A.grad_copies(net, g, mask is not None, dropout)[2]
    proj = []
    for which, width in (("q", m.q_dim), ("k", m.kv_dim), ("v", m.kv_dim)):
        z = net.linear(x, f"{pre}.{which}_proj", width, m.attention_bias)
        # .view(hidden_shape).transpose(1, 2): q and k reach RoPE, whose grads come back contiguous in the
        # [B, heads, S, d] layout, so the view's backward (a reshape of the transposed grad) copies them; v's
        # grad comes back in [B, S, heads, d] memory from flash / efficient, contiguous from eager / math
        copy = which != "v" or v_copies
        if m.qk_norm and which != "v":  # Qwen3: q_norm(q_proj(x).view(hidden_shape)).transpose(1, 2)
            zv = B.heads_view(ag, z, copy_grad=copy)  # the norm's grad keeps the transposed layout
            ag.release(z)
            z = net.rmsnorm(zv, f"{pre}.{which}_norm")
            ag.release(zv)
            copy = False  # .transpose(1, 2) of the norm's output: its backward is a view
        proj.append(B.heads_view(ag, z, copy_grad=copy))
        ag.release(z)
    qv, kv, vv = proj
    qr = B.rotate_half_embed(ag, qv, cos, sin, f"{pre}.q")
    kr = B.rotate_half_embed(ag, kv, cos, sin, f"{pre}.k")
    ag.release(qv)
    ag.release(kv)
    y, weights = attend(net, qr, kr, vv, mask, g, pre)
    for z in (qr, kr, vv):  # the function returns: query/key/value_states die
        ag.release(z)
    return y, weights


def attend(net: Net, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, g: A.Geometry, pre: str,
           bshd: tuple[bool, bool, bool] = (True, True, True), softcap: bool = False,
           out_bias: bool | None = None) -> tuple[Tensor, Tensor | None]:
    """The attention interface on the heads q, k, v (eager or sdpa; ``bshd``: their memory layouts;
    ``softcap``: Gemma 2's eager soft-capping), then ``attn_output.reshape(*input_shape, -1).contiguous()``
    (already [B, S, nh·d]: a view) and o_proj (``out_bias``: its bias, default attention_out_bias). Every
    family's attention ends so. Returns the projection and attn_weights (eager's; None for sdpa); q, k, v
    stay the caller's."""
    ag, m = net.ag, net.m
    dropout = m.attention_dropout
    if net.attention == "eager":
        out, weights = A.eager_attention(net, q, k, v, mask, g, dropout=dropout, name=f"{pre}.attn",
                                         q_bshd=bshd[0], k_bshd=bshd[1], v_bshd=bshd[2], softcap=softcap)
    elif net.s.attn_seq != net.s.seq:  # Ulysses: DeepSpeed's wrapper drops the mask and calls sdpa on full sequences
        from ..ulysses import ulysses_attention

        out = ulysses_attention(net, q, k, v, g, f"{pre}.attn", lambda q2, k2, v2, gl: A.sdpa_attention(
            net, q2, k2, v2, None, gl, dropout=dropout, name=f"{pre}.attn", bshd=(False, False, False)))
        weights = None
    else:
        out, weights = A.sdpa_attention(net, q, k, v, mask, g, dropout=dropout, name=f"{pre}.attn", bshd=bshd), None
    # reshape(*input_shape, -1).contiguous(): Ulysses' [B, S/sp, em] result is a view of [S/sp, B, em] memory
    o_in = B.clone(ag, out, f"{pre}.attn.out_contiguous") if net.s.attn_seq != net.s.seq and net.s.batch > 1 \
        else ag.view(out)
    ag.release(out)
    y = net.linear(o_in, f"{pre}.o_proj", m.hidden_size, m.attention_out_bias if out_bias is None else out_bias)
    ag.release(o_in)  # attn_output rebound to o_proj's output
    return y, weights


def mlp(net: Net, x: Tensor, i: int) -> Tensor:
    """LlamaMLP.forward: down(act(gate(x)) · up(x)), a module without parameters of its own (Net.container)."""
    pre = f"model.layers.{i}.mlp"
    return net.container(pre, lambda z: gated_mlp(net, z, pre, net.m.intermediate_size), x)


def gated_mlp(net: Net, x: Tensor, pre: str, n: int, act=B.silu) -> Tensor:
    """LlamaMLP.forward of the module ``pre`` with intermediate width ``n`` (also DeepseekV3MLP, the shared
    experts among them, and Gemma's MLP with ``act`` its gelu)."""
    ag, m, s = net.ag, net.m, net.s
    gate = net.linear(x, f"{pre}.gate_proj", n, m.mlp_bias)
    act = net.container(f"{pre}.act_fn", lambda z: act(ag, z, f"{pre}.act"), gate)  # ACT2FN's module
    ag.release(gate)
    up = net.linear(x, f"{pre}.up_proj", n, m.mlp_bias)
    prod = B.mul(ag, act, up, s.b * s.tokens * n, f"{pre}.act_up")
    ag.release(act)
    ag.release(up)
    y = net.linear(prod, f"{pre}.down_proj", m.hidden_size, m.mlp_bias)
    ag.release(prod)
    return y


def layer(net: Net, x: Tensor, i: int, cos: Tensor, sin: Tensor, mask: Tensor | None, mlp_fn=mlp,
          attn_fn=attention, dropouts: tuple[str, str] | None = None) -> Tensor:
    """LlamaDecoderLayer.forward (DeepseekV3DecoderLayer's too, with its attention); ``x`` stays referenced by
    the caller during the call. ``dropouts``: the dropout modules each sublayer's output passes before its
    residual add (Phi-3's)."""
    ag = net.ag
    pre = f"model.layers.{i}"
    residual = ag.ref(x)
    h = net.rmsnorm(x, f"{pre}.input_layernorm")
    # hidden_states, _ = self.self_attn(hidden_states=..., ...): keyword arguments, so no input is wrapped
    a, weights = net.container(f"{pre}.self_attn", lambda: attn_fn(net, h, i, cos, sin, mask))
    ag.release(h)
    a = _dropped(net, a, dropouts[0]) if dropouts else a
    h = B.add(ag, residual, a, f"{pre}.attn_residual")
    ag.release(a)
    ag.release(residual)
    residual = ag.ref(h)
    h2 = net.rmsnorm(h, f"{pre}.post_attention_layernorm")
    ag.release(h)
    y = mlp_fn(net, h2, i)
    ag.release(h2)
    y = _dropped(net, y, dropouts[1]) if dropouts else y
    out = B.add(ag, residual, y, f"{pre}.mlp_residual")
    ag.release(y)
    ag.release(residual)  # the frame's locals die in co_varnames order: residual, then _ (attn_weights)
    ag.release(weights)
    return out


def _dropped(net: Net, x: Tensor, name: str) -> Tensor:
    """An nn.Dropout module on x (a container: its hooks run under ZeRO-3), the caller's reference handed over."""
    p = net.m.hidden_dropout
    out = net.container(name, lambda z: B.dropout(net.ag, z, p, net.s.b, name, net.device), x)
    net.ag.release(x)
    return out


def post_norm_layer(net: Net, x: Tensor, i: int, cos: Tensor, sin: Tensor, mask: Tensor | None, norm, mlp_fn,
                    attn_fn, pre_norms: bool) -> Tensor:
    """Decoder layers that norm each sublayer's output before its residual add (``norm(net, x, name)``, the
    family's RMSNorm module): Olmo2DecoderLayer (post_attention_layernorm, post_feedforward_layernorm) and
    Gemma*DecoderLayer (``pre_norms``: input_layernorm and pre_feedforward_layernorm too, the sandwich)."""
    ag = net.ag
    pre = f"model.layers.{i}"
    residual = ag.ref(x)
    h = norm(net, x, f"{pre}.input_layernorm") if pre_norms else x
    a, weights = net.container(f"{pre}.self_attn", lambda: attn_fn(net, h, i, cos, sin, mask))
    if pre_norms:
        ag.release(h)
    h = norm(net, a, f"{pre}.post_attention_layernorm")
    ag.release(a)
    h2 = B.add(ag, residual, h, f"{pre}.attn_residual")
    ag.release(h)
    ag.release(residual)
    residual = ag.ref(h2)
    f = norm(net, h2, f"{pre}.pre_feedforward_layernorm") if pre_norms else h2
    if pre_norms:
        ag.release(h2)
    y = mlp_fn(net, f, i)
    ag.release(f)
    yn = norm(net, y, f"{pre}.post_feedforward_layernorm")
    ag.release(y)
    out = B.add(ag, residual, yn, f"{pre}.mlp_residual")
    ag.release(yn)
    ag.release(residual)
    ag.release(weights)
    return out


def layer_extras(m, mask: Tensor | None, cos: Tensor, sin: Tensor, pos_ids: Tensor | None) -> tuple[Tensor, ...]:
    """The decoder layer's tensor keyword arguments as *Model.forward passes them (Llama and Qwen2/3:
    attention_mask, position_embeddings, position_ids; Mistral, Mixtral, Qwen3-MoE, Phi-3: attention_mask, position_ids,
    position_embeddings)."""
    if m.family in ("mistral", "mixtral", "qwen3_moe", "phi3"):
        return frame_extras(mask, pos_ids, (cos, sin))
    return frame_extras(mask, (cos, sin), pos_ids)


def _rmsnorm(net: Net, x: Tensor, name: str) -> Tensor:
    return net.rmsnorm(x, name)


def forward(net: Net, mlp_fn=mlp, attn_fn=attention, block=None, norm_fn=_rmsnorm) -> Output:
    """LlamaForCausalLM.forward(input_ids, labels): the output object (loss and logits). ``block``: the decoder
    layer (default ``layer``; OLMo 2's differs), ``norm_fn``: the final norm's forward."""
    block = block or layer
    ag, m, s, p = net.ag, net.m, net.s, net.p
    w = p["model.embed_tokens.weight"]
    emb = net.module("model.embed_tokens", lambda: embedding(ag, m, s, w, cuda=net.device == "cuda"), params=(w,))
    pos_ids = positions(ag, s)
    mask = causal_mask(net)
    # Olmo2RotaryEmbedding returns fp32 tables; Phi-3's cover head_dim · partial_rotary_factor (rotary_pct)
    cos, sin = net.container("model.rotary_emb", lambda: rotary(ag, m, s, int(m.head_dim * m.rotary_pct),
                                                                 cast=m.family != "olmo2"))
    hidden = ag.ref(emb)
    for i in range(m.num_layers):
        # the decoder layer is a module of its own (GradientCheckpointingLayer: its hooks run inside the checkpoint)
        new = net.layer(i, hidden, lambda x, i=i: net.container(
            f"model.layers.{i}", lambda z: block(net, z, i, cos, sin, mask, mlp_fn, attn_fn), x),
            layer_extras(m, mask, cos, sin, pos_ids))
        ag.release(hidden)
        hidden = new
    normed = norm_fn(net, hidden, "model.norm")
    ag.release(hidden)
    # *Model.forward returns: its locals die in co_varnames order. Llama / Mistral: position_ids,
    # inputs_embeds, causal_mask, position_embeddings. Qwen2 / Qwen3 keep the mask in causal_mask_mapping and
    # inputs_embeds / position_ids in mask_kwargs (dict values die in insertion order), both after the args.
    order = (mask, emb, pos_ids) if m.family in ("qwen2", "qwen3") else (pos_ids, emb, mask)
    for t in (*order, cos, sin):
        ag.release(t)
    return causal_lm_head(net, net.base_model_output("model", normed))
