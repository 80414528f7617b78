"""The ops transformers' decoder models are built of, as the autograd model sees them (estimator/autograd.py).

Each function allocates what the op allocates on CUDA, records what autograd saves for it, and gives its
backward formula (the allocation order of torch's derivatives, tools/autograd/derivatives.yaml, as the real
code issues them: checked against CPU allocation traces by tests/test_ledger_trace.py). Symbols: T tokens of
this rank (micro-batch · local sequence), b bytes of the training dtype; every size is bytes.

Conventions: an op takes references it needs and returns a new tensor with one reference (the caller's);
the caller releases its own references where the Python code's variables die.
"""

from __future__ import annotations

from .autograd import Autograd, Tensor, _Ctx

FP32 = 4


def linear(ag: Autograd, x: Tensor, weight: Tensor, out_bytes: int, name: str, bias: Tensor | None = None
           ) -> Tensor:
    """nn.Linear on [.., in] → [.., out] (F.linear: mm, or addmm with a bias, on the 2-D view). Saves the
    input (and the weight, a parameter). torchgen emits a node's formulas in the sorted order of the input
    names (load_derivatives.py: sorted(defn.keys())): MmBackward0 (self, mat2) computes the weight's grad
    [out, in] first (mm_mat2_backward), then the input's [.., in] (mm_mat1_backward); AddmmBackward0
    (self, mat1, mat2) the input's, the weight's, then the bias's (the incoming grad itself, summed to [out]
    by the engine's validate_outputs)."""
    w_bytes, in_bytes = weight.nbytes, x.nbytes
    b_bytes = bias.nbytes if bias is not None else 0

    def backward(ctx: _Ctx, grad: Tensor, node):
        # the input's grad reaches x through the reshape F.linear folds [.., in] into (a view of it)
        def gx():
            return ctx.new(f"grad.{name}.input", in_bytes, view=True) if x.requires_grad else None

        def gw():  # F.linear multiplies by weight.t(): TBackward0 hands the weight a transposed view
            return ctx.new(f"grad.{name}.weight", w_bytes, view=True) if weight.requires_grad else None

        if bias is None:
            w = gw()
            return (gx(), w)
        i, w = gx(), gw()
        gb = ctx.new(f"grad.{name}.bias", b_bytes) if bias.requires_grad else None
        return (i, w, gb)

    inputs = (x, weight, bias) if bias is not None else (x, weight)
    saved = (x,) if weight.requires_grad else ()
    return ag.op(name, out_bytes, inputs, saved, backward)


def to_dtype(ag: Autograd, x: Tensor, out_bytes: int, name: str) -> Tensor:
    """x.to(dtype): a copy (ToCopyBackward0 saves nothing; its backward casts the grad back: a copy)."""
    if out_bytes == x.nbytes:  # same dtype: .to() returns self
        return ag.ref(x)

    def backward(ctx, grad, node):
        return (ctx.new(f"grad.{name}", x.nbytes),)

    return ag.op(name, out_bytes, (x,), (), backward)


def pow2(ag: Autograd, x: Tensor, name: str) -> Tensor:
    """x.pow(2): saves x. PowBackward0 (pow_backward): self.pow(1), exponent·that, grad·that: three tensors
    of x's size, the first two freed inside."""
    def backward(ctx, grad, node):
        a = ctx.new(f"{name}.bw_pow", x.nbytes)
        b = ctx.new(f"{name}.bw_scale", x.nbytes)
        out = ctx.new(f"grad.{name}", x.nbytes)
        ctx.free(b)  # a full expression's temporaries die last made first
        ctx.free(a)
        return (out,)

    return ag.op(name, x.nbytes, (x,), (x,), backward)


def mean_last(ag: Autograd, x: Tensor, out_bytes: int, name: str) -> Tensor:
    """x.mean(-1, keepdim=True): MeanBackward1 saves sizes only; its backward expands and divides: x's size."""
    def backward(ctx, grad, node):
        return (ctx.new(f"grad.{name}", x.nbytes),)

    return ag.op(name, out_bytes, (x,), (), backward)


def add_scalar(ag: Autograd, x: Tensor, name: str) -> Tensor:
    """x + python scalar: AddBackward1 passes the grad through."""
    return ag.op(name, x.nbytes, (x,), (), lambda ctx, grad, node: grad)


def rsqrt(ag: Autograd, x: Tensor, name: str) -> Tensor:
    """torch.rsqrt: saves its result; backward −0.5·grad·result³: pow then two products (x's size each)."""
    def backward(ctx, grad, node):
        a = ctx.new(f"{name}.bw_pow", x.nbytes)
        b = ctx.new(f"{name}.bw_scale", x.nbytes)
        out = ctx.new(f"grad.{name}", x.nbytes)
        ctx.free(b)  # a full expression's temporaries die last made first
        ctx.free(a)
        return (out,)

    return ag.op(name, x.nbytes, (x,), ("out",), backward)


def mul(ag: Autograd, a: Tensor, c: Tensor, out_bytes: int, name: str) -> Tensor:
    """a * c (broadcasting): MulBackward0 saves each operand the other's grad needs; each grad is grad·other
    at the output's size (the generated apply computes the formulas last input first: c's grad, then a's),
    reduced to the operand's size afterwards (validate_outputs → sum_to_size, in input order: one more
    tensor of the operand's size, the full-size product freed)."""
    def backward(ctx, grad, node):
        full = {}
        for t in (c, a):
            if t.requires_grad:
                full[id(t)] = ctx.new(f"grad.{name}", out_bytes)
        return reduce_broadcast(ctx, (a, c), tuple(full.get(id(t)) for t in (a, c)), out_bytes, name)

    saved = tuple(t for t, other in ((c, a), (a, c)) if other.requires_grad)
    return ag.op(name, out_bytes, (a, c), saved, backward)


def reduce_broadcast(ctx: _Ctx, inputs: tuple, grads: tuple, out_bytes: int, name: str) -> tuple:
    """The engine's validate_outputs: each grad of a broadcast input (smaller than the output) is summed to
    the input's size (sum_to_size: a new tensor), the full-size grad freed; in input order."""
    reduced = []
    for t, g in zip(inputs, grads):
        if g is not None and t.nbytes != out_bytes:
            r = ctx.new(f"grad.{name}.reduced", t.nbytes)
            ctx.free(g)
            g = r
        reduced.append(g)
    return tuple(reduced)


def add(ag: Autograd, a: Tensor, c: Tensor, name: str) -> Tensor:
    """a + c (same shape): AddBackward0 passes the incoming grad object to both inputs."""
    return ag.op(name, max(a.nbytes, c.nbytes), (a, c), (), lambda ctx, grad, node: grad)


def rmsnorm(ag: Autograd, x: Tensor, weight: Tensor, b: int, name: str) -> Tensor:
    """LlamaRMSNorm.forward: h = x.to(fp32); var = h.pow(2).mean(-1, keepdim); h = h·rsqrt(var + eps);
    return weight · h.to(dtype). Saved: the fp32 input (by pow and the product), rsqrt [T, 1], the cast-back
    h (by weight·h). In fp32 training both casts are no-ops."""
    n = x.nbytes // b  # elements
    rows = n // max(1, weight.nbytes // b) if weight.nbytes else n  # T (one statistic per row)
    h32 = to_dtype(ag, x, FP32 * n, f"{name}.fp32_input")
    p = pow2(ag, h32, f"{name}.pow")
    var = mean_last(ag, p, FP32 * rows, f"{name}.variance")
    ag.release(p)
    s = add_scalar(ag, var, f"{name}.plus_eps")
    r = rsqrt(ag, s, f"{name}.rsqrt")
    ag.release(s)
    h2 = mul(ag, h32, r, FP32 * n, f"{name}.normed_fp32")
    ag.release(r)
    ag.release(h32)  # hidden_states rebound
    hb = to_dtype(ag, h2, b * n, f"{name}.normed")
    out = mul(ag, weight, hb, b * n, f"{name}.out")
    ag.release(hb)
    ag.release(h2)  # the function returns: hidden_states, then variance
    ag.release(var)
    return out


def heads_view(ag: Autograd, x: Tensor, copy_grad: bool) -> Tensor:
    """``proj(x).view(B, S, heads, d).transpose(1, 2)``: a view. Its backward reshapes the incoming grad back
    to [B, S, heads·d]: free for a grad in the projection's own layout, a copy (x's size) for one in the
    transposed layout (ViewBackward0 → reshape of a non-contiguous tensor)."""
    v = ag.view(x)
    if copy_grad and v.node is not None:
        v.node.backward = lambda ctx, grad, node: (ctx.new(f"grad.{x.name}.contiguous", x.nbytes),)
    return v


def neg(ag: Autograd, x: Tensor, name: str) -> Tensor:
    """-x: NegBackward0 allocates −grad."""
    return ag.op(name, x.nbytes, (x,), (), lambda ctx, grad, node: (ctx.new(f"grad.{name}", x.nbytes),))


def slice_view(ag: Autograd, x: Tensor, nbytes: int, name: str) -> Tensor:
    """x[..., a:b]: a view; SliceBackward0 (slice_backward) allocates zeros of the whole input and copies."""
    v = ag.view(x, name, nbytes)
    if v.node is not None:
        v.node.backward = lambda ctx, grad, node: (ctx.new(f"grad.{name}", x.nbytes),)
    return v


def cat2(ag: Autograd, a: Tensor, c: Tensor, name: str) -> Tensor:
    """torch.cat((a, c)): one new tensor; CatBackward0 hands each input a slice (a view) of the grad."""
    def backward(ctx, grad, node):
        outs = []
        for t in (a, c):
            if t.requires_grad:
                outs.append(ag.view(grad, f"grad.{name}.part", t.nbytes))
            else:
                outs.append(None)
        return tuple(outs)

    return ag.op(name, a.nbytes + c.nbytes, (a, c), (), backward)


def rotate_half_embed(ag: Autograd, x: Tensor, cos: Tensor, sin: Tensor, name: str) -> Tensor:
    """apply_rotary_pos_emb for one of q, k: (x·cos) + (rotate_half(x)·sin), rotate_half = cat(−x2, x1)."""
    a = mul(ag, x, cos, x.nbytes, f"{name}.cos")
    half = x.nbytes // 2
    x1 = slice_view(ag, x, half, f"{name}.x1")
    x2 = slice_view(ag, x, half, f"{name}.x2")
    n2 = neg(ag, x2, f"{name}.neg")
    rot = cat2(ag, n2, x1, f"{name}.rotated")
    ag.release(n2)
    ag.release(x1)
    ag.release(x2)
    c = mul(ag, rot, sin, x.nbytes, f"{name}.sin")
    ag.release(rot)
    out = add(ag, a, c, f"{name}.rope")
    ag.release(a)  # BINARY_OP drops its left operand first
    ag.release(c)
    return out


def silu(ag: Autograd, x: Tensor, name: str) -> Tensor:
    """F.silu: saves its input; SiluBackward0 allocates one grad (silu_backward)."""
    return ag.op(name, x.nbytes, (x,), (x,), lambda ctx, grad, node: (ctx.new(f"grad.{name}", x.nbytes),))


def flash_attention(ag: Autograd, q: Tensor, k: Tensor, v: Tensor, *, heads: int, kv_heads: int, seq: int,
                    batch: int, head_dim: int, b: int, name: str) -> Tensor:
    """torch's sdpa FLASH_ATTENTION on CUDA (aten _scaled_dot_product_flash_attention → FlashAttention-2's
    mha_fwd / mha_bwd, Dao 2023). Forward: out [B, S, nh, d] and the fp32 logsumexp [B, nh, S]; saves q, k, v,
    out, logsumexp. Backward: dq, dk, dv (empty_like), then mha_bwd's fp32 softmax_d [B, nh, S₁₂₈] and
    dq_accum [B, S₁₂₈, nh, d₃₂] (S rounded up to 128, d to 32), and with grouped-query attention
    dk_expanded / dv_expanded [B, S, nh, d] summed into dk, dv; the temporaries are freed before it returns."""
    s128 = -(-seq // 128) * 128
    d32 = -(-head_dim // 32) * 32

    def backward(ctx, grad, node):
        dq = ctx.new(f"grad.{name}.q", q.nbytes)
        dk = ctx.new(f"grad.{name}.k", k.nbytes)
        dv = ctx.new(f"grad.{name}.v", v.nbytes)
        softmax_d = ctx.new(f"{name}.softmax_d.tmp", FP32 * batch * heads * s128)
        dq_accum = ctx.new(f"{name}.dq_accum.tmp", FP32 * batch * s128 * heads * d32)
        expanded = []
        if kv_heads != heads:
            expanded = [ctx.new(f"{name}.dk_expanded.tmp", b * batch * seq * heads * head_dim),
                        ctx.new(f"{name}.dv_expanded.tmp", b * batch * seq * heads * head_dim)]
        for t in (softmax_d, dq_accum, *expanded):
            ctx.free(t)
        return (dq, dk, dv)

    # the generated node releases its saved inputs in name order (key, query, value), then its saved
    # results last first (logsumexp, output): seen in CPU traces of the same node family
    out = ag.op(f"{name}.out", b * batch * seq * heads * head_dim, (q, k, v), (k, q, v), backward)
    lse = ag.empty(f"{name}.logsumexp", FP32 * batch * heads * seq)
    ag.keep(out, lse)
    ag.keep(out, out)
    ag.release(lse)
    return out
