"""The ops GPT-2, GPT-NeoX and BLOOM add to the autograd model (conventions as in blocks.py): LayerNorm,
the GELU variants, a broadcast add, a fused projection split in parts.
"""

from __future__ import annotations

from . import blocks as B
from .autograd import Autograd, Tensor, _Ctx
from .blocks import FP32


def layernorm(ag: Autograd, x: Tensor, weight: Tensor, bias: Tensor, rows: int, b: int, name: str,
              device: str = "cuda") -> Tensor:
    """nn.LayerNorm (aten native_layer_norm): the output, then mean and rstd [rows] — fp32 on CUDA
    (layer_norm_cuda: the accumulate type), the parameters' dtype on the CPU (layer_norm_cpu). Saves the
    input, weight, bias, mean, rstd (released: bias, input, weight, result1, result2). Backward
    (native_layer_norm_backward): dX, dgamma, dbeta, in that order (the CPU kernel's buffer is internal)."""
    stats = (FP32 if device == "cuda" else b) * rows

    def backward(ctx: _Ctx, grad: Tensor, node):
        dx = ctx.new(f"grad.{name}.input", x.nbytes) if x.requires_grad else None
        dw = ctx.new(f"grad.{name}.weight", weight.nbytes) if weight.requires_grad else None
        db = ctx.new(f"grad.{name}.bias", bias.nbytes) if bias.requires_grad else None
        return (dx, dw, db)

    out = ag.op(name, x.nbytes, (x, weight, bias), (x,), backward)
    mean = ag.empty(f"{name}.mean", stats)
    rstd = ag.empty(f"{name}.rstd", stats)
    ag.keep(out, mean)
    ag.keep(out, rstd)
    ag.release(mean)
    ag.release(rstd)
    return out


def add_broadcast(ag: Autograd, a: Tensor, c: Tensor, name: str) -> Tensor:
    """a + c with c broadcast to a's shape: AddBackward0 hands the grad to a and a copy summed to c's shape
    to c (validate_outputs → sum_to_size); the grad itself to both when nothing is broadcast (batch 1)."""
    if a.nbytes == c.nbytes:
        return B.add(ag, a, c, name)

    def backward(ctx: _Ctx, grad: Tensor, node):
        return (grad if a.requires_grad else None, grad if c.requires_grad else None)

    return ag.op(name, a.nbytes, (a, c), (), backward)


def tanh(ag: Autograd, x: Tensor, name: str) -> Tensor:
    """torch.tanh: saves its result; TanhBackward0 allocates tanh_backward(grad, result) (x's size)."""
    return ag.op(name, x.nbytes, (x,), ("out",), lambda ctx, grad, node: (ctx.new(f"grad.{name}", x.nbytes),))


def gelu_new(ag: Autograd, x: Tensor, name: str) -> Tensor:
    """transformers NewGELUActivation, in Python: 0.5·x · (1 + tanh(√(2/π)·(x + 0.044715·x³))). Each op
    allocates its result, left to right; pow saves x, tanh its result, the final product both factors;
    the temporaries between die as each is consumed."""
    a = B.scale(ag, x, f"{name}.half_x")
    p = B.pow2(ag, x, f"{name}.cube")  # pow(x, 3.0): PowBackward0 as for pow(x, 2)
    c = B.scale(ag, p, f"{name}.cube_scaled")
    ag.release(p)
    d = B.add(ag, x, c, f"{name}.inner")
    ag.release(c)
    e = B.scale(ag, d, f"{name}.inner_scaled")
    ag.release(d)
    t = tanh(ag, e, f"{name}.tanh")
    ag.release(e)
    f = B.add_scalar(ag, t, f"{name}.one_plus")
    ag.release(t)
    out = B.mul(ag, a, f, x.nbytes, f"{name}.out")
    ag.release(a)
    ag.release(f)
    return out


def gelu(ag: Autograd, x: Tensor, name: str) -> Tensor:
    """F.gelu (aten gelu, exact or tanh): saves its input; GeluBackward0 allocates one grad (gelu_backward)."""
    return ag.op(name, x.nbytes, (x,), (x,), lambda ctx, grad, node: (ctx.new(f"grad.{name}", x.nbytes),))


def split(ag: Autograd, x: Tensor, parts: tuple[int, ...], name: str) -> list[Tensor]:
    """x.split(size, dim=-1) / chunk: views under one SplitBackward0, whose backward concatenates the
    parts' grads (a new tensor of x's size; missing parts as zeros) once all have run."""
    return ag.split(x, parts, name, lambda ctx, grads, node: (ctx.new(f"grad.{name}", x.nbytes),))
