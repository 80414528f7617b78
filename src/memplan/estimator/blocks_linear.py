"""The matrix products of the autograd model (conventions as in blocks.py): ``linear``, nn.Linear's F.linear
(mm, or addmm with a bias, with the engine thread's first-gemm cuBLAS workspace hooks, Autograd.before_matmul and
Autograd.backward_matmul, and CUDA's bias-grad reduction staging, estimator/cuda_reduce.py), and ``matmul``,
torch.matmul of two 4-D tensors (aten _matmul_impl: bmm on the [B·h] view).
"""

from __future__ import annotations

from . import blocks as B
from .autograd import Autograd, Tensor, _Ctx
from .cuda_reduce import stage_reduction
from .timing import GEMM_FP32, gemm_flops


def linear(ag: Autograd, x: Tensor, weight: Tensor, out_bytes: int, name: str, bias: Tensor | None = None,
           transposed: bool = True, keeps_input: bool = False, cuda_bytes: int | None = None) -> Tensor:
    """nn.Linear on [.., in] → [.., out] (F.linear: mm, or addmm with a bias, on the 2-D view). Saves the
    input (and the weight, a parameter). torchgen emits a node's formulas in the sorted order of the input
    names (load_derivatives.py: sorted(defn.keys())): MmBackward0 (self, mat2) computes the weight's grad
    [out, in] first (mm_mat2_backward), then the input's [.., in] (mm_mat1_backward); AddmmBackward0
    (self, mat1, mat2) the input's, the weight's, then the bias's (the incoming grad itself, summed to [out]
    by the engine's validate_outputs). ``transposed``: F.linear multiplies by weight.t() (TBackward0 hands
    the weight a view of its grad); GPT-2's Conv1D (addmm(bias, x, weight)) does not, nor does ZeRO-3's
    LinearFunctionForZeroStage3, which returns a plain weight grad (a tied weight's two grads then sum in
    place, InputBuffer::accumulate). ``keeps_input``: the input is saved whether or not the weight trains
    (LinearFunctionForZeroStage3.setup_context saves input, weight and bias: lora.zero3_linear_uses_saved_input;
    its backward computes the input's grad before the weight's, so under ZeRO-3 the engine thread's first gemm,
    whose output comes before the handle's workspace, is an input grad: trace19-s4-041 −7.25 % → 0.00 %; and it
    hands the weight its grad before the bias, where addmm hands the bias its first).
    ``cuda_bytes``: the element bytes when the kernels are CUDA's, whose sum of the incoming grad down to the bias
    stages in global memory (estimator/cuda_reduce.py; Autograd._validate_outputs allocates it)."""
    w_bytes, in_bytes = weight.nbytes, x.nbytes

    def backward(ctx: _Ctx, grad: Tensor, node):
        def first_gemm(t):  # the engine thread's first gemm makes its handle's workspace (Autograd.backward_matmul)
            if t is not None and ag.backward_matmul is not None:
                hook, ag.backward_matmul = ag.backward_matmul, None
                hook()
            return t

        # the input's grad reaches x through the reshape F.linear folds [.., in] into (a view of it); ZeRO-3's
        # grad_output.matmul(weight) folds inside the custom backward, returning mm's result through
        # _unsafe_view (no view: InputBuffer may accumulate into it in place)
        def gx():
            return first_gemm(ctx.new(f"grad.{name}.input", in_bytes, view=not keeps_input) if x.requires_grad
                              else None)

        def gw():
            return first_gemm(ctx.new(f"grad.{name}.weight", w_bytes, view=transposed) if weight.requires_grad
                              else None)

        if bias is None and not keeps_input:
            w = gw()
            return (gx(), w)
        i, w = gx(), gw()  # LinearFunctionForZeroStage3.backward: grad_input's matmul, then grad_weight's
        if bias is None:
            return (i, w)
        b = grad if bias.requires_grad else None  # summed to [out] by the engine
        return (i, w, b) if keeps_input else (b, i, w)

    # the grads reach the parameters' AccumulateGrad nodes in the node's edge order (engine.cpp
    # evaluate_function walks next_edges; AccumulateGrad's maximum sequence number pops it first): addmm's
    # edges are (self = bias, mat1, mat2), so the bias's reduce hook runs before the weight's; ZeRO-3's
    # LinearFunctionForZeroStage3.apply(input, weight, bias) hands the weight's first
    inputs = (x, weight) if bias is None else (x, weight, bias) if keeps_input else (bias, x, weight)
    # mm's formulas (derivatives.yaml): the input saved for the weight's grad, the weight (a view of the
    # parameter: no bytes, but a saved tensor a checkpoint's recompute is triggered by) for the input's
    saved = ((x,) if weight.requires_grad or keeps_input else ()) + ((weight,) if x.requires_grad or keeps_input
                                                                    else ())
    if weight.param is None and not keeps_input:  # a computed weight (peft's ParamWrapper): MmBackward0
        saved = saved[::-1]  # releases mat2_ (the weight) before self_; a parameter's release frees no bytes
    out = ag.op(name, out_bytes, inputs, saved, backward, flops=gemm_flops(in_bytes, w_bytes, out_bytes, ag.elem_bytes),
                saves_after=keeps_input)  # LinearFunctionForZeroStage3 is a custom autograd.Function
    ag.first_matmul()  # its output is allocated before the gemm asks for the thread's cuBLAS handle
    if bias is not None and cuda_bytes:
        stage_reduction(out, inputs.index(bias), out_bytes // bias.nbytes, bias.nbytes // cuda_bytes, True)
    return out


def matmul(ag: Autograd, a: Tensor, c: Tensor, out_bytes: int, name: str, copy_a: bool = False,
           copy_c: bool = False, grad_copy: bool = False, batch: int = 1, elem_bytes: int | None = None) -> Tensor:
    """torch.matmul of two 4-D tensors [B, h, n, m] @ [B, h, m, p] (aten _matmul_impl): each operand is
    expanded (a no-op) and reshaped to [B·h, n, m], which copies an operand whose memory is not [B·h] rows
    (``copy_a`` / ``copy_c``: clone, CloneBackward0 passes the grad through), then bmm and _unsafe_view.
    BmmBackward0 saves the operand each grad needs (self for mat2's, mat2 for self's) and computes, in the
    sorted order of its input names, mat2's grad self^T·grad [B·h, m, p] then self's grad·mat2^T
    [B·h, n, m] (derivatives.yaml bmm), each reaching its operand as a view. UnsafeViewBackward0 reshapes
    the incoming grad to [B·h, n, p]: a copy when that grad is a transposed view (``grad_copy``). ``batch``: B·h,
    ``elem_bytes``: the operands' element size (default the training dtype's), for the operations it counts."""
    a2 = B.clone(ag, a, f"{name}.self") if copy_a else ag.ref(a)
    c2 = B.clone(ag, c, f"{name}.mat2") if copy_c else ag.ref(c)

    def backward(ctx: _Ctx, grad: Tensor, node):
        gc = ctx.new(f"grad.{name}.mat2", c2.nbytes, view=True) if c2.requires_grad else None
        ga = ctx.new(f"grad.{name}.self", a2.nbytes, view=True) if a2.requires_grad else None
        return (ga, gc)

    saved = tuple(t for t, other in ((c2, a2), (a2, c2)) if other.requires_grad)  # sorted: mat2, self
    e = elem_bytes or ag.elem_bytes
    out = ag.op(name, out_bytes, (a2, c2), saved, backward, flops=gemm_flops(a2.nbytes, c2.nbytes, out_bytes, e, batch),
                kernel=GEMM_FP32 if e == B.FP32 else None)
    ag.release(c2)  # _matmul_impl's locals die last declared first: the reshaped mat2, then self
    ag.release(a2)
    if grad_copy and out.node is not None:
        v = ag.view(out)
        v.node.backward = lambda ctx, grad, node: (ctx.new(f"grad.{name}.reshaped", out_bytes),)
        ag.release(out)
        return v
    return out
