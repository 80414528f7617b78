"""BLOOM (transformers 5.17 modeling_bloom.py): word embeddings with a LayerNorm, ALiBi (build_alibi_tensor),
its own eager attention (fused query_key_value viewed [B, S, nh, 3, d], alibi.baddbmm, softmax in fp32,
bmm, _merge_heads), BloomGelu (a custom autograd Function), dropout_add residuals, lm_head tied to the word
embeddings. BLOOM has no sdpa path (BloomPreTrainedModel does not support it). Symbols as in blocks.py.
"""

from __future__ import annotations

import math

from .. import blocks as B
from .. import blocks_linear as BL
from ..autograd import Tensor, _Ctx
from ..timing import gemm_flops
from ..causal_lm import causal_lm_head, embedding
from ..transformer import INT64, Net, Output

INT32 = 4


def dropout_add(net: Net, x: Tensor, residual: Tensor, name: str) -> Tensor:
    """dropout_add: residual + F.dropout(x, hidden_dropout)."""
    ag = net.ag
    d = B.dropout(ag, x, net.m.hidden_dropout, net.s.b, f"{name}.dropout", net.device)
    out = B.add(ag, residual, d, name)
    ag.release(d)
    return out


def alibi(net: Net) -> Tensor:
    """build_alibi_tensor(attention_mask = ones [B, S] fp32, nh): slopes = base ** arange(1, 1 + p) (p the
    largest power of two <= nh; int32 powers, promoted to fp32 on the CPU), with more heads the extra slopes
    concatenated; ((mask.cumsum(-1) - 1) * mask)[:, None] · slopes[..., None] → [B, nh, S] fp32, reshaped to
    [B·nh, 1, S] and cast to the dtype. Its locals die as it returns."""
    ag, m, s = net.ag, net.m, net.s
    nh, rows = m.num_heads, s.batch
    p2 = 2 ** math.floor(math.log2(nh))

    def pow_of(n: int, name: str) -> tuple[Tensor, Tensor]:
        powers = ag.empty(f"alibi.{name}_powers", INT32 * n)
        promoted = ag.empty(f"alibi.{name}_powers_fp32", B.FP32 * n) if net.device == "cpu" else None
        out = ag.empty(f"alibi.{name}_slopes", B.FP32 * n)
        if promoted is not None:
            ag.release(promoted)
        return powers, out

    base = ag.empty("alibi.base", B.FP32)  # torch.full((), ...) on the device
    powers, slopes = pow_of(p2, "base")
    extra = []
    if p2 != nh:
        extra.append(ag.empty("alibi.extra_base", B.FP32))
        extra_powers, extra_slopes = pow_of(min(p2, nh - p2), "extra")
        joined = ag.empty("alibi.slopes", B.FP32 * nh)  # torch.cat([slopes, pow(extra_base, extra_powers)])
        ag.release(extra_slopes)
        ag.release(slopes)
        slopes = joined
        extra.append(extra_powers)
    cum = ag.empty("alibi.cumsum", B.FP32 * rows * s.seq)
    minus = ag.empty("alibi.cumsum_minus_one", B.FP32 * rows * s.seq)
    ag.release(cum)
    arange = ag.empty("alibi.positions", B.FP32 * rows * s.seq)
    ag.release(minus)
    full = ag.empty("alibi.fp32", B.FP32 * rows * nh * s.seq)
    out = ag.empty("alibi", s.b * rows * nh * s.seq) if s.b != B.FP32 else ag.view(full)  # .to(dtype)
    for t in (base, powers, slopes, *extra, arange, full):  # co_varnames order
        ag.release(t)
    return out


def causal_mask(net: Net, rows: int) -> Tensor:
    """create_causal_mask with BLOOM's 2-D attention_mask of ones: cast to bool [B, S]; eager_mask with the
    padding mask: and_masks(kv <= q, padding_mask[b, kv]) over the index tensors (sdpa_mask), then
    torch.where(mask, 0, min) → [B, 1, S, S] in the dtype. The bool attention mask dies with
    create_causal_mask."""
    ag, s = net.ag, net.s
    S = s.seq
    bool_mask = ag.empty("mask.attention_mask_bool", rows * S)
    idx = [ag.empty("mask.batch_arange", INT64 * rows), ag.empty("mask.head_arange", INT64)]
    for which in ("q", "kv"):
        raw = ag.empty(f"mask.{which}_arange_raw", INT64 * S)
        idx.append(ag.empty(f"mask.{which}_arange", INT64 * S))
        ag.release(raw)
    start = ag.empty("mask.and_start", 1)  # and_masks: q_idx.new_ones((), dtype=torch.bool)
    causal = ag.empty("mask.causal", S * S)
    both = ag.empty("mask.and_causal", S * S)  # start & causal
    ag.release(causal)
    ag.release(start)
    padding = ag.empty("mask.padding", rows * S)  # padding_mask[batch_idx, kv_idx]: [B, 1, 1, S]
    mask = ag.empty("mask.and_padding", rows * S * S)
    ag.release(padding)
    ag.release(both)
    for t in idx:
        ag.release(t)
    out = ag.empty("mask.eager", s.b * rows * S * S)
    ag.release(mask)
    ag.release(bool_mask)
    return out


def attention(net: Net, x: Tensor, residual: Tensor, al: Tensor, mask: Tensor, i: int) -> tuple[Tensor, Tensor]:
    """BloomAttention.forward: fused query_key_value viewed [B, S, nh, 3, d] and q, k, v selected
    (SelectBackward0: zeros of the fused size, the grad copied in) and transposed; each reshaped to
    [B·nh, S, d] (a copy for B > 1); alibi.baddbmm(q, k^T, beta=1, alpha=1/√d); + mask; softmax in fp32,
    .to(dtype); attention_dropout; bmm with v; _merge_heads (view, permute, reshape: a copy); dense;
    dropout_add. The locals die as it returns; it returns (output_tensor, attention_probs)."""
    ag, m, s = net.ag, net.m, net.s
    pre, h, b = f"transformer.h.{i}.self_attention", m.hidden_size, s.b
    nh, S = m.num_heads, s.seq
    fused = net.linear(x, f"{pre}.query_key_value", 3 * h, True)
    fv = ag.view(fused)  # .view(B, S, nh, 3, d)
    part = fused.nbytes // 3
    copy = s.batch > 1
    heads = []
    for which in ("q", "k", "v"):  # fused_qkv[..., j, :].transpose(1, 2)
        sel = B.slice_view(ag, fv, part, f"{pre}.{which}")
        heads.append(sel)
    layers = [B.clone(ag, t, f"{pre}.{w}_layer") if copy else ag.view(t) for t, w in zip(heads, "qkv")]
    for t in heads:
        ag.release(t)
    ag.release(fv)
    q, k, v = layers
    scores_bytes = b * s.batch * nh * S * S
    scores = baddbmm(ag, al, q, k, scores_bytes, f"{pre}.scores", s.batch * nh)
    masked = B.add(ag, scores, mask, f"{pre}.masked")
    probs32 = B.softmax(ag, masked, B.FP32 * s.batch * nh * S * S, f"{pre}.softmax",
                        half_to_float=B.half_to_float(net), device=net.device)
    probs = B.to_dtype(ag, probs32, scores_bytes, f"{pre}.probs")
    ag.release(probs32)
    dropped = net.container(f"{pre}.attention_dropout", lambda z: B.dropout(  # nn.Dropout, a module
        ag, z, m.attention_dropout, b, f"{pre}.attention_dropout", net.device), probs)
    ag.release(probs)  # attention_probs is rebound to the dropout's output
    # torch.bmm; _merge_heads' view back from the permuted grad copies it for B > 1
    ctx = BL.matmul(ag, dropped, v, b * s.tokens * h, f"{pre}.context", grad_copy=copy, batch=s.batch * nh,
                    elem_bytes=b)
    merged = B.clone(ag, ctx, f"{pre}.merged")  # _merge_heads: view, permute, reshape
    ag.release(ctx)
    y = net.linear(merged, f"{pre}.dense", h, True)
    out = dropout_add(net, y, residual, f"{pre}.residual")
    ag.release(y)
    for t in (fused, q, k, v, scores, masked, merged):  # co_varnames order; attention_probs is returned
        ag.release(t)
    return out, dropped


def baddbmm(ag, al: Tensor, q: Tensor, k: Tensor, out_bytes: int, name: str, batch: int) -> Tensor:
    """alibi.baddbmm(batch1=q, batch2=k^T, beta=1, alpha): BaddbmmBackward0 saves batch1 and batch2; in
    sorted input-name order batch1's grad grad.bmm(batch2^T)·alpha, then batch2's batch1^T.bmm(grad)·alpha
    (each bmm result freed once scaled); alibi needs no grad. ``batch``: B·nh (for the operations counted)."""
    def backward(ctx: _Ctx, grad: Tensor, node):
        out = []
        for t, w in ((q, "batch1"), (k, "batch2")):
            raw = ctx.new(f"grad.{name}.{w}_bmm", t.nbytes)
            out.append(ctx.new(f"grad.{name}.{w}", t.nbytes))
            ctx.free(raw)
        return (None, out[0], out[1])

    return ag.op(name, out_bytes, (al, q, k), (q, k), backward,
                 flops=gemm_flops(q.nbytes, k.nbytes, out_bytes, ag.elem_bytes, batch))


def gelu(net: Net, x: Tensor, name: str) -> Tensor:
    """BloomGelu (GeLUFunction.apply): forward under no_grad, x·0.5·(1 + tanh(0.79788456·x·(1 + 0.044715·x·x)))
    (eleven tensors of x's size, each temporary freed as consumed); saves x. Its backward (bloom_gelu_back)
    recomputes tanh and the derivative through 17 temporaries of x's size and returns ff·g."""
    ag = net.ag
    n = x.nbytes
    # forward: a = x·0.5, b = 0.79788456·x, c = 0.044715·x, c·x, 1 + ·, b·(·), tanh, 1 + tanh, a·(·)
    seq = [("a", None), ("b", None), ("c", None), ("cx", ("c",)), ("one_plus", ("cx",)), ("inner", ("b", "one_plus")),
           ("tanh", ("inner",)), ("one_plus_tanh", ("tanh",))]
    with_grad, ag.grad_enabled = ag.grad_enabled, False
    live = {}
    for key, frees in seq:
        live[key] = ag.empty(f"{name}.{key}", n)
        for f in frees or ():
            ag.release(live.pop(f))
    ag.grad_enabled = with_grad

    def backward(ctx: _Ctx, grad: Tensor, node):
        steps = [("a", ()), ("b", ()), ("bx", ("b",)), ("one_plus", ("bx",)), ("inner", ("a", "one_plus")),
                 ("tanh", ("inner",)), ("half_x", ()), ("tanh_sq", ()), ("one_minus", ("tanh_sq",)), ("c", ()),
                 ("cx", ("c",)), ("plus", ("cx",)), ("deriv", ("one_minus", "plus")), ("left", ("half_x", "deriv")),
                 ("one_plus_tanh", ()), ("right", ("one_plus_tanh",)), ("ff", ("left", "right"))]
        tmp = {}
        for key, frees in steps:
            tmp[key] = ctx.new(f"{name}.bw_{key}", n)
            for f in frees:
                ctx.free(tmp.pop(f))
        out = ctx.new(f"grad.{name}", n)
        ctx.free(tmp.pop("tanh"))  # bloom_gelu_back returns: tanh_out, ff die
        ctx.free(tmp.pop("ff"))
        return (out,)

    out = ag.op(name, n, (x,), (x,), backward)
    ag.release(live.pop("a"))
    ag.release(live.pop("one_plus_tanh"))
    return out


def mlp(net: Net, x: Tensor, residual: Tensor, i: int) -> Tensor:
    """BloomMLP.forward: gelu_impl(dense_h_to_4h(x)), dense_4h_to_h, dropout_add."""
    ag, m = net.ag, net.m
    pre = f"transformer.h.{i}.mlp"
    a = net.linear(x, f"{pre}.dense_h_to_4h", m.intermediate_size, True)
    act = net.container(f"{pre}.gelu_impl", lambda z: gelu(net, z, f"{pre}.gelu_impl"), a)  # BloomGelu
    ag.release(a)
    y = net.linear(act, f"{pre}.dense_4h_to_h", m.hidden_size, True)
    out = dropout_add(net, y, residual, f"{pre}.residual")
    ag.release(act)  # the function returns: hidden_states (gelu's output), intermediate_output die
    ag.release(y)
    return out


def block(net: Net, x: Tensor, i: int, al: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """BloomBlock.forward (apply_residual_connection_post_layernorm False: the residuals are the inputs):
    returns (output, attn_weights), the attention's probabilities, which the caller's ``outputs`` keeps."""
    ag = net.ag
    pre = f"transformer.h.{i}"
    ln = net.layernorm(x, f"{pre}.input_layernorm")
    a, weights = net.container(f"{pre}.self_attention", lambda z, r: attention(net, z, r, al, mask, i), ln, x)
    ln2 = net.layernorm(a, f"{pre}.post_attention_layernorm")
    ag.release(ln)  # layernorm_output rebound
    out = net.container(f"{pre}.mlp", lambda z, r: mlp(net, z, r, i), ln2, a)
    ag.release(ln2)
    ag.release(a)
    return out, weights


def forward(net: Net) -> Output:
    """BloomForCausalLM.forward(input_ids, labels): BloomModel (word_embeddings, word_embeddings_layernorm,
    attention_mask = ones, alibi, the mask, each block, ln_f), lm_head, ForCausalLMLoss."""
    ag, m, s, p = net.ag, net.m, net.s, net.p
    w = p["transformer.word_embeddings.weight"]
    emb = net.module("transformer.word_embeddings", lambda: embedding(ag, m, s, w, cuda=net.device == "cuda"), params=(w,))
    hidden = net.layernorm(emb, "transformer.word_embeddings_layernorm")
    ones = ag.empty("attention_mask", B.FP32 * s.batch * s.seq)
    al = alibi(net)
    mask = causal_mask(net, s.batch)
    weights = None  # outputs = block(...): the tuple keeps the last block's attn_weights
    for i in range(m.num_layers):
        new, new_weights = net.layer(i, hidden, lambda x, i=i: net.container(
            f"transformer.h.{i}", lambda z: block(net, z, i, al, mask), x), (mask, al))
        ag.release(weights)  # outputs rebound: the previous tuple dies
        ag.release(hidden)  # hidden_states = outputs[0]
        hidden, weights = new, new_weights
    normed = net.layernorm(hidden, "transformer.ln_f")
    ag.release(hidden)
    for t in (ones, emb, al, mask, weights):  # BloomModel.forward returns: its locals die in co_varnames order
        ag.release(t)
    return causal_lm_head(net, net.base_model_output("transformer", normed))
