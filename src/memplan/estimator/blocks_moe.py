"""The ops of transformers' mixture-of-experts blocks in the autograd model (conventions as in blocks.py):
the top-k router (MixtralTopKRouter) and the grouped_mm experts (integrations/moe.py
grouped_mm_experts_forward, transformers 5.17's default experts implementation on CPU and CUDA:
get_correct_experts_implementation picks "grouped_mm", and _can_use_grouped_mm takes
torch.nn.functional.grouped_mm on the CPU (torch > 2.10) and on CUDA sm80+ (torch >= 2.10)).

Device differences modelled: CPU TensorIterator casts a lower-precision operand of a mixed-dtype binary op
to the common dtype first (a temporary; TensorIteratorBase::compute_types), CUDA kernels cast while
loading; CUDA's index_put_(accumulate=True) sorts its indices (index_put_with_sort_kernel: linear, sorted and
original indices, int64) where the CPU needs none; sort and histc have device-specific internals (named
.tmp here, filtered from the CPU trace). Symbols: T tokens, S = T·k routed rows, E experts, b bytes.
"""

from __future__ import annotations

from .autograd import Autograd, Tensor, _Ctx
from .blocks import FP32
from .timing import gemm_flops

INT64, INT32 = 8, 4


def topk(ag: Autograd, x: Tensor, rows: int, k: int, name: str) -> tuple[Tensor, Tensor]:
    """torch.topk(x, k) of fp32 [rows, E]: values [rows, k] fp32, then indices int64; TopkBackward0 saves the
    indices and allocates zeros of x's size, scattered (value_selecting_reduction_backward)."""
    values = ag.op(f"{name}.values", FP32 * rows * k, (x,), (),
                   lambda ctx, grad, node: (ctx.new(f"grad.{name}", x.nbytes),))
    indices = ag.empty(f"{name}.indices", INT64 * rows * k)
    ag.keep(values, indices)
    return values, indices


def sum_last(ag: Autograd, x: Tensor, out_bytes: int, name: str) -> Tensor:
    """x.sum(-1, keepdim=True): SumBackward1 saves sizes only; its backward expands the grad (a view)."""
    return ag.op(name, out_bytes, (x,), (), lambda ctx, grad, node: (ag.view(grad, f"grad.{name}", x.nbytes),))


def div_inplace(ag: Autograd, x: Tensor, d: Tensor, name: str) -> Tensor:
    """x /= d (d broadcast over the last dim): the generated in-place op saves a clone of the original x for
    d's grad (original_self) and d. DivBackward0, in sorted input-name order: other: -grad·((self/d)/d)
    (four tensors of x's size, the three temporaries freed last made first), self: grad/d; validate_outputs
    then sums d's grad to d's size. Returns x after the op (same storage, a new grad_fn)."""
    original = ag.empty(f"{name}.original_self", x.nbytes)

    def backward(ctx: _Ctx, grad: Tensor, node):
        t1 = ctx.new(f"{name}.bw_ratio", x.nbytes)
        t2 = ctx.new(f"{name}.bw_ratio2", x.nbytes)
        t3 = ctx.new(f"{name}.bw_neg", x.nbytes)
        gd = ctx.new(f"grad.{name}.other", x.nbytes)
        for t in (t3, t2, t1):
            ctx.free(t)
        gx = ctx.new(f"grad.{name}.self", x.nbytes)
        return (gx, gd)  # the engine sums gd to d's size

    out = inplace(ag, x, name, (x, d), (d, original), backward)
    ag.release(original)
    return out


def inplace(ag: Autograd, x: Tensor, name: str, inputs: tuple, saved: tuple, backward) -> Tensor:
    """An in-place op on x: the same storage under a new grad_fn whose inputs are x's previous version."""
    out = Tensor(x.storage, x.nbytes, name, x.requires_grad)
    ag.ref(out)
    if x.requires_grad and ag.grad_enabled:
        out.node = ag._node(name, inputs, saved, backward)
    return out


def masked_fill(ag: Autograd, x: Tensor, mask: Tensor, name: str, in_place: bool = False) -> Tensor:
    """x.masked_fill(mask, 0) (clone + masked_fill_) or x.masked_fill_(mask, 0): MaskedFillBackward0 saves
    the mask and allocates grad.masked_fill(mask, 0) (x's size)."""
    def backward(ctx: _Ctx, grad: Tensor, node):
        return (ctx.new(f"grad.{name}", x.nbytes),)

    if in_place:
        return inplace(ag, x, name, (x,), (mask,), backward)
    return ag.op(name, x.nbytes, (x,), (mask,), backward)


def index_rows(ag: Autograd, net, x: Tensor, index: Tensor, rows: int, row_bytes: int, name: str) -> Tensor:
    """x[index] for an int64 index of ``rows`` entries: [rows, ..] rows of x. IndexBackward0 saves the index;
    its backward is zeros of x's size with _index_put_impl_(accumulate=True, unsafe=True), on CUDA
    index_put_with_sort_kernel (aten/src/ATen/native/cuda/Indexing.cu): computeLinearIndex's
    ``index.remainder(size) * stride`` (the remainder a temporary), then sorted_indices, orig_indices and the
    ``arange`` range, cub's radix_sort_pairs (its temp storage, about two more buffers of the keys' size, is not
    counted), and the locals die last made first (range, orig, sorted, linear): trace19-s4-041's order."""
    def backward(ctx: _Ctx, grad: Tensor, node):
        g = ctx.new(f"grad.{name}", x.nbytes)
        if net.device == "cuda":
            remainder = ctx.new(f"{name}.remainder.tmp", INT64 * rows)
            tmp = [ctx.new(f"{name}.linear_indices.tmp", INT64 * rows)]
            ctx.free(remainder)
            tmp += [ctx.new(f"{name}.{w}.tmp", INT64 * rows) for w in ("sorted_indices", "orig_indices", "range")]
            for t in reversed(tmp):
                ctx.free(t)
        return (g,)

    return ag.op(name, rows * row_bytes, (x,), (index,), backward)


def grouped_mm(ag: Autograd, x: Tensor, weight: Tensor, offs: Tensor, out_bytes: int, name: str,
               experts: int = 1) -> Tensor:
    """torch.nn.functional.grouped_mm(x [S, in], weight^T [E, in, out], offs) → [S, out]. GroupedMmBackward0
    saves mat2 (the weight), offs and self (x), released in that sorted order; its backward computes mat2's
    grad [E, in, out] (reaching the parameter through TransposeBackward0, a view) then self's [S, in]
    (_grouped_mm_mat2_backward / _grouped_mm_mat1_backward, derivatives.yaml _grouped_mm). ``experts``: E (each row
    meets one expert's [in, out]: 2·S·in·out operations)."""
    def backward(ctx: _Ctx, grad: Tensor, node):
        gw = ctx.new(f"grad.{name}.weight", weight.nbytes, view=True) if weight.requires_grad else None
        gx = ctx.new(f"grad.{name}.input", x.nbytes) if x.requires_grad else None
        return (gx, gw)

    saved = ((weight,) if x.requires_grad else ()) + (offs,) + ((x,) if weight.requires_grad else ())
    if x.requires_grad and weight.param is not None and ag.saving and ag.grad_enabled:
        # transformers' _grouped_linear passes weight.transpose(-2, -1) (is_transposed False): a view is saved
        ag.saved_param_views.add(weight.param)
    return ag.op(name, out_bytes, (x, weight), saved, backward,
                 flops=gemm_flops(x.nbytes, weight.nbytes, out_bytes, ag.elem_bytes, experts))


def chunk2(ag: Autograd, x: Tensor, name: str) -> tuple[Tensor, Tensor]:
    """x.chunk(2, dim=-1): two views under one SplitBackward0; its backward concatenates both grads (a new
    tensor of x's size) once both have arrived."""
    half = x.nbytes // 2
    a, c = ag.split(x, (half, half), name, lambda ctx, grads, node: (ctx.new(f"grad.{name}", x.nbytes),))
    return a, c


def weight_rows(ag: Autograd, net, x: Tensor, w: Tensor, out_bytes: int, b: int, name: str,
                w_bytes: int = FP32) -> Tensor:
    """x [S, h] (the training dtype) · w [S, 1] (fp32: Mixtral's routing weights; Qwen3-MoE casts its to the
    training dtype, ``w_bytes`` b): with fp32 weights an fp32 [S, h] product (type promotion; on the CPU
    through an fp32 copy of x). MulBackward0 saves both; in sorted input-name order other's grad grad·x (the
    CPU promoting x again), then self's grad·w; validate_outputs casts self's grad to x's dtype and sums
    other's to [S, 1], in input order."""
    x32 = FP32 * x.nbytes // b
    mixed = b != w_bytes

    def backward(ctx: _Ctx, grad: Tensor, node):
        promoted = ctx.new(f"{name}.bw_promoted", x32) if mixed and net.device == "cpu" else None
        gw = ctx.new(f"grad.{name}.weights", out_bytes)
        if promoted is not None:
            ctx.free(promoted)
        gx = ctx.new(f"grad.{name}.rows_fp32", out_bytes)
        return (gx, gw)  # the engine casts gx to x's dtype and sums gw to w's size (both: a new tensor)

    promoted = ag.empty(f"{name}.promoted", x32) if mixed and net.device == "cpu" else None
    out = ag.op(name, out_bytes, (x, w), (w, x), backward)
    if promoted is not None:
        ag.release(promoted)
    return out
