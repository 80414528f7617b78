"""What each op costs in time: the host's seconds and the GPU's work, as the ledger's work records carry them.

The caching allocator reuses a block freed with ``record_stream`` (ZeRO-3's gathered parameters and reduced
gradients) only once the GPU has run every kernel queued before the free, so peak reserved depends on how far the
GPU runs behind the host (memplan.estimator.gpu_time replays that). The estimator's ops record here what they
cost: the host's time per op, per backward node and per DeepSpeed hook, in seconds (constants measured on the
reference machine, ``benchmarks/timing/``), and the GPU's work as operations and bytes of one kernel kind, turned
into seconds for a given GPU by gpu_time.GpuRates. Pure: no torch.

Kernel kinds (``Ledger.work_kernel``): MEMORY, bytes over memory bandwidth (elementwise ops, copies, reductions,
the softmax, the loss); GEMM, operations over the tensor cores' rate (cuBLAS matrix products in 16-bit); GEMM_FP32,
over the CUDA cores' rate (fp32 matrix products: torch.backends.cuda.matmul.allow_tf32 is False by default, and
neither transformers nor DeepSpeed sets it); ATTENTION, the fused attention kernels (cuDNN, FlashAttention-2, the
memory-efficient one), over their own share of the tensor cores' rate.
"""

from __future__ import annotations

from math import sqrt

MEMORY, GEMM, GEMM_FP32, ATTENTION = 0, 1, 2, 3
KERNELS = ("memory", "gemm", "gemm_fp32", "attention")

# -- the host's time (seconds; benchmarks/timing/README.md says how each was measured) -------------------------
#: one eager aten op from Python with autograd recording its node: the module's Python, the dispatcher, the
#: output's allocation and the kernel's launch
CPU_OP_S = 20e-6
#: one node of the backward graph run by the autograd engine's thread (its apply and the launches it makes)
CPU_NODE_S = 15e-6
#: DeepSpeed ZeRO-3's hooks around one module's forward (DeepSpeedZeRoOffload._pre_forward_module_hook →
#: fetch_sub_module, with the trace and prefetch bookkeeping, and the PreBackwardFunction / PostBackwardFunction
#: wraps of its inputs and outputs; _post_forward_module_hook → release_sub_module)
CPU_Z3_PRE_FORWARD_S = 500e-6
CPU_Z3_POST_FORWARD_S = 250e-6
#: the same around one module's backward (pre_sub_module_backward_function, post_sub_module_backward_function)
CPU_Z3_PRE_BACKWARD_S = 500e-6
CPU_Z3_POST_BACKWARD_S = 250e-6
#: one trainable parameter's grad through stage3.py reduce_independent_p_g_buckets_and_remove_grads (the copy into
#: the IPG bucket) and one bucket's __reduce_and_partition_ipg_grads
CPU_Z3_GRAD_S = 60e-6
CPU_Z3_REDUCE_S = 300e-6

#: what a fused attention kernel's backward costs against its forward (FlashAttention-2, Dao 2023, §3.1: the
#: backward recomputes the scores and makes five matrix products to the forward's two: 2.5 times the work)
ATTENTION_BACKWARD_RATIO = 2.5
#: any other op's backward against its forward: a matrix product's two products (grad of the input and of the
#: weight), an elementwise op reading the grad and its saved inputs and writing a grad per input
BACKWARD_RATIO = 2.0


def gemm_flops(a_bytes: int, b_bytes: int, out_bytes: int, elem_bytes: int, batch: int = 1) -> float:
    """Operations of a (batched) matrix product [n, k] @ [k, m] from its operands' and output's sizes: the
    product of the three element counts is batch³·(n·k·m)², so 2·n·k·m per batch is
    2·sqrt(a·b·out / batch) elements (shapes are not kept in the autograd model)."""
    if elem_bytes <= 0 or batch <= 0:
        return 0.0
    e = float(elem_bytes)
    return 2.0 * sqrt((a_bytes / e) * (b_bytes / e) * (out_bytes / e) / batch)


def attention_flops(batch: int, heads: int, q_len: int, k_len: int, head_dim: int, v_head_dim: int,
                    causal: bool = True) -> float:
    """Forward operations of softmax(q·kᵀ)·v: two matrix products, 2·B·h·Sq·Sk·(d + dv); a causal kernel skips
    the upper triangle (half of a square score matrix)."""
    flops = 2.0 * batch * heads * q_len * k_len * (head_dim + v_head_dim)
    return flops / 2 if causal and q_len == k_len else flops
