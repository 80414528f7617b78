"""The ops transformers' decoder models are built of, as the autograd model sees them (estimator/autograd.py).

Each function allocates what the op allocates on CUDA, records what autograd saves for it, and gives its
backward formula (the allocation order of torch's derivatives, tools/autograd/derivatives.yaml, as the real
code issues them: checked against CPU allocation traces by tests/test_ledger_trace.py). Symbols: T tokens of
this rank (micro-batch · local sequence), b bytes of the training dtype; every size is bytes.

Conventions: an op takes references it needs and returns a new tensor with one reference (the caller's);
the caller releases its own references where the Python code's variables die. The matrix products
(nn.Linear's F.linear, torch.matmul) are in blocks_linear.py.
"""

from __future__ import annotations

from .autograd import Autograd, Tensor, _passthrough
from .cuda_reduce import stage_reduction

FP32 = 4


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
    at the output's size, the generated apply computing the formulas last input first (c's grad, then a's);
    the engine's validate_outputs then sums a broadcast operand's grad to its size (autograd.py)."""
    def backward(ctx, grad, node):
        full = {}
        for t in (c, a):
            if t.requires_grad:
                full[id(t)] = ctx.new(f"grad.{name}", out_bytes)
        return tuple(full.get(id(t)) for t in (a, c))

    saved = tuple(t for t, other in ((c, a), (a, c)) if other.requires_grad)
    return ag.op(name, out_bytes, (a, c), saved, backward)



def add(ag: Autograd, a: Tensor, c: Tensor, name: str) -> Tensor:
    """a + c (same shape): AddBackward0 passes the incoming grad object to both inputs."""
    return ag.op(name, max(a.nbytes, c.nbytes), (a, c), (), lambda ctx, grad, node: grad)


def sub(ag: Autograd, a: Tensor, c: Tensor, name: str) -> Tensor:
    """a - c (same shape): SubBackward0 computes, in sorted input-name order, other's grad −grad (a new
    tensor, derivatives.yaml sub.Tensor: handle_r_to_c(other, maybe_multiply(-grad, alpha))), then passes
    the incoming grad to self."""
    def backward(ctx, grad, node):
        gc = ctx.new(f"grad.{name}.other", c.nbytes) if c.requires_grad else None
        return (grad if a.requires_grad else None, gc)

    return ag.op(name, max(a.nbytes, c.nbytes), (a, c), (), backward)


def expand_view(ag: Autograd, x: Tensor, nbytes: int, name: str) -> Tensor:
    """x.expand(..): a view of ``nbytes`` logical bytes; ExpandBackward0 sums the grad back to x's size (a new
    tensor; at::sum_to returns the grad itself when nothing was expanded)."""
    v = ag.view(x, name, nbytes)
    if v.node is not None and nbytes != x.nbytes:
        v.node.backward = lambda ctx, grad, node: (ctx.new(f"grad.{name}", x.nbytes),)
    return v


def copy_slice(ag: Autograd, base: Tensor, src: Tensor, name: str) -> Tensor:
    """base[..., a:b].copy_(src) on a tensor made by new_empty: base under a CopySlices node (autograd's
    rebase_history of an in-place op on a view). CopySlices::apply (torch/csrc/autograd/functions/tensor.cpp):
    result = new_empty_strided(base) and result.copy_(grad) (base's size), then CopyBackwards on
    grad_slice.clone() (src's size, src's grad): zeros_like for the slice when base needs a grad (copied
    into result's slice and freed with the returned list), else result dies as apply returns. Returns base
    after the copy (the same storage, one more reference)."""
    needs = src.requires_grad or base.requires_grad
    out = Tensor(base.storage, base.nbytes, name, needs)
    ag.ref(out)

    def backward(ctx, grad, node):
        result = ctx.new(f"grad.{name}.base", base.nbytes)
        clone = ctx.new(f"grad.{name}.src", src.nbytes)
        if base.requires_grad:
            ctx.free(ctx.new(f"grad.{name}.zeros", src.nbytes))
            return (result, clone if src.requires_grad else None)
        ctx.free(result)
        return (None, clone if src.requires_grad else None)

    if needs and ag.grad_enabled:
        out.node = ag._node(name, (base, src), (), backward)
    return out


def rmsnorm(ag: Autograd, x: Tensor, weight: Tensor, b: int, name: str, cuda: bool = False) -> Tensor:
    """LlamaRMSNorm.forward: h = x.to(fp32); var = h.pow(2).mean(-1, keepdim); h = h·rsqrt(var + eps);
    return weight · h.to(dtype). Saved: the fp32 input (by pow and the product), rsqrt [T, 1], the cast-back
    h (by weight·h). In fp32 training both casts are no-ops. ``cuda``: the weight's grad, summed over the rows,
    stages in global memory (estimator/cuda_reduce.py)."""
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
    stage_reduction(out, 0, rows, weight.nbytes // b, cuda)
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


def rotate_half_embed(ag: Autograd, x: Tensor, cos: Tensor, sin: Tensor, name: str, wide_bytes: int | None = None,
                      cast_first: bool = False) -> Tensor:
    """apply_rotary_pos_emb for one of q, k: (x·cos) + (rotate_half(x)·sin), rotate_half = cat(−x2, x1).
    ``wide_bytes``: the products' bytes when the tables are wider than x (Olmo2's fp32 tables: type promotion);
    ``cast_first``: the CPU casts x (and rotate_half(x)) to the tables' dtype before each product, a temporary
    (TensorIteratorBase::compute_types; CUDA casts while loading)."""
    out_bytes = wide_bytes or x.nbytes

    def product(z: Tensor, table: Tensor, what: str) -> Tensor:
        tmp = ag.empty(f"{name}.{what}.promoted", out_bytes) if cast_first else None
        out = mul(ag, z, table, out_bytes, f"{name}.{what}")
        if tmp is not None:
            ag.release(tmp)
        return out

    a = product(x, cos, "cos")
    half = x.nbytes // 2
    x1 = slice_view(ag, x, half, f"{name}.x1")
    x2 = slice_view(ag, x, half, f"{name}.x2")
    n2 = neg(ag, x2, f"{name}.neg")
    rot = cat2(ag, n2, x1, f"{name}.rotated")
    ag.release(n2)
    ag.release(x1)
    ag.release(x2)
    c = product(rot, sin, "sin")
    ag.release(rot)
    out = add(ag, a, c, f"{name}.rope")
    ag.release(a)  # BINARY_OP drops its left operand first
    ag.release(c)
    return out


def soft_cap(ag: Autograd, x: Tensor, name: str) -> Tensor:
    """Gemma 2's soft-capping, ``x = x / cap; x = tanh(x); x = x * cap`` (attention scores, logits): each
    rebinding drops the previous value, ``x``'s reference (the caller's) among them; TanhBackward0 saves its
    result, the scalar ops nothing."""
    q = scale(ag, x, f"{name}.div")
    ag.release(x)
    t = ag.op(f"{name}.tanh", x.nbytes, (q,), ("out",),
              lambda ctx, grad, node: (ctx.new(f"grad.{name}.tanh", x.nbytes),))
    ag.release(q)
    out = scale(ag, t, f"{name}.mul")
    ag.release(t)
    return out


def silu(ag: Autograd, x: Tensor, name: str) -> Tensor:
    """F.silu: saves its input; SiluBackward0 allocates one grad (silu_backward)."""
    return ag.op(name, x.nbytes, (x,), (x,), lambda ctx, grad, node: (ctx.new(f"grad.{name}", x.nbytes),))


def clone(ag: Autograd, x: Tensor, name: str) -> Tensor:
    """x.contiguous() / a reshape that cannot view (clone + _unsafe_view): a copy of x; CloneBackward0 hands
    the incoming grad on unchanged (and _unsafe_view's backward reshapes it: a view of a contiguous grad)."""
    return ag.op(name, x.nbytes, (x,), (), _passthrough)


def scale(ag: Autograd, x: Tensor, name: str) -> Tensor:
    """x * python scalar (mul.Scalar): saves nothing; MulBackward1 allocates grad·scalar (x's size)."""
    return ag.op(name, x.nbytes, (x,), (), lambda ctx, grad, node: (ctx.new(f"grad.{name}", x.nbytes),))


def softmax_backward_data(ctx, name: str, in_bytes: int, grad_bytes: int, device: str) -> tuple:
    """aten _softmax_backward_data: the grad of the input (in_bytes); on CUDA (SoftMax.cu
    softmax_backward_cuda_out) the structured output comes first, then ``Tensor tmp = grad * output`` of the
    grad's size, freed as the kernel returns. The CPU kernel makes no temporary."""
    g = ctx.new(f"grad.{name}", in_bytes)
    if device == "cuda":
        ctx.free(ctx.new(f"grad.{name}.grad_times_output", grad_bytes))
    return (g,)


def half_to_float(net) -> bool:
    """CUDA's softmax takes fp16 input with an fp32 result directly (SoftMax.cpp softmax: the half_to_float
    path is for CUDA Half inputs); bf16, and every CPU input, is cast first."""
    return net.device == "cuda" and net.dtype == "fp16"


def softmax(ag: Autograd, x: Tensor, out_bytes: int, name: str, half_to_float: bool = False,
            device: str = "cuda") -> Tensor:
    """F.softmax(x, -1, dtype=fp32) (aten softmax): the input cast to fp32 first (x.to(fp32), a copy freed
    once _softmax has run; none for fp32 inputs, nor on CUDA's half_to_float path for fp16 inputs), then
    _softmax; SoftmaxBackward0 saves its result; its backward is softmax_backward_data's."""
    src = x if half_to_float else to_dtype(ag, x, out_bytes, f"{name}.input_fp32")
    in_bytes = src.nbytes
    y = ag.op(name, out_bytes, (src,), ("out",),
              lambda ctx, grad, node: softmax_backward_data(ctx, name, in_bytes, out_bytes, device))
    if not half_to_float:
        ag.release(src)  # to_dtype's reference (x itself when it is fp32 already)
    return y


def safe_softmax(ag: Autograd, x: Tensor, name: str, rows: int, device: str = "cuda") -> Tensor:
    """aten _safe_softmax (the math attention's softmax): softmax (saved by SafeSoftmaxBackward0), then the
    rows that are all -inf (x == -inf as bool, all over the last dim: [.., 1] bool) zeroed in place; the two
    bool temporaries die in reverse order. Backward: softmax_backward_data (x's size)."""
    y = ag.op(name, x.nbytes, (x,), ("out",),
              lambda ctx, grad, node: softmax_backward_data(ctx, name, x.nbytes, x.nbytes, device))
    neginf = ag.empty(f"{name}.isneginf", x.nbytes // FP32)  # its input is fp32
    masked_rows = ag.empty(f"{name}.masked_rows", rows)
    ag.release(masked_rows)
    ag.release(neginf)
    return y


def dropout(ag: Autograd, x: Tensor, p: float, b: int, name: str, device: str = "cuda") -> Tensor:
    """F.dropout(x, p) in training (aten dropout): p == 0 returns x itself. On CUDA native_dropout
    (Dropout.cu dropout_cuda): a bool mask, then the output; NativeDropoutBackward0 saves the mask and
    allocates grad·mask·scale. On the CPU _dropout: noise = empty_like(x).bernoulli_().div_(), then x·noise
    (MulBackward0 saves the noise). ``b``: bytes per element of x."""
    if p <= 0:
        return ag.ref(x)
    if device == "cpu":
        noise = ag.empty(f"{name}.noise", x.nbytes)
        out = mul(ag, x, noise, x.nbytes, name)
        ag.release(noise)
        return out
    mask = ag.empty(f"{name}.mask", x.nbytes // b)
    out = ag.op(name, x.nbytes, (x,), (mask,), lambda ctx, grad, node: (ctx.new(f"grad.{name}", x.nbytes),))
    ag.release(mask)
    return out
