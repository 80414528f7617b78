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
neither transformers nor DeepSpeed sets it); ATTENTION_CUDNN, ATTENTION_FLASH, ATTENTION_EFFICIENT, the fused
attention kernels sdpa dispatches to (cuDNN's, FlashAttention-2, the memory-efficient one), each over its own share
of the tensor cores' rate; HOST_LINK, a copy between pinned host memory and the GPU over the host link;
FAKE_COLLECTIVE, the copies torch's fake process group makes in place of a collective when memplan.verify emulates
N ranks on one GPU (a real job does not make them: the replay counts their host seconds and bytes only when told
the run is emulated, gpu_time.timed's ``emulated``).
"""

from __future__ import annotations

from math import sqrt

MEMORY, GEMM, GEMM_FP32, ATTENTION_CUDNN, ATTENTION_FLASH, ATTENTION_EFFICIENT, HOST_LINK = 0, 1, 2, 3, 4, 5, 6
FAKE_COLLECTIVE = 7

# -- the host's time (seconds; benchmarks/timing/README.md says how each was measured) -------------------------
#: one eager aten op from Python with autograd recording its node, inside a transformers module: a tiny Llama's
#: forward under ZeRO-2 (benchmarks/timing/rows-host-h100.jsonl host-z2-16l: 623 ops in 16 ms)
CPU_OP_S = 25e-6
#: one node of the backward graph run by the autograd engine's thread, its kernels launched
#: (benchmarks/timing/kernels-h100.json host.op_backward_node_s)
CPU_NODE_S = 20e-6
#: DeepSpeed ZeRO-3's hooks around one module's forward: _pre_forward_module_hook (fetch_sub_module's bookkeeping,
#: the PreBackwardFunction / PostBackwardFunction wraps of its inputs and outputs) and _post_forward_module_hook
#: (release_sub_module), with nothing to gather: 194 µs a module, from the tiny Llama at 16 and 32 layers, whose
#: parameters are all persistent (host-z3-16l, host-z3-32l: 56 ms forward for 208 more modules and 608 more ops)
CPU_Z3_PRE_FORWARD_S = 130e-6
CPU_Z3_POST_FORWARD_S = 64e-6
#: the same around one module's backward (pre_sub_module_backward_function, post_sub_module_backward_function):
#: the tiny Llamas' backward, 47 ms for 200 more modules, 1152 more nodes and 144 more grads
CPU_Z3_PRE_BACKWARD_S = 70e-6
CPU_Z3_POST_BACKWARD_S = 35e-6
#: one parameter through the coordinator: its all-gather (all_gather_coalesced and its handle), the wait
#: (AllGatherCoalescedHandle.wait, the fetch event) and its release (free_param, record_stream): the median, over
#: the CPU-bound ZeRO-3 rows measured alone before this model existed (benchmarks/accuracy/rows-h200-15-lone.jsonl,
#: matrix3/matrix9 rows run alone: their forwards less CPU_OP_S per op and the module hooks, per gathered
#: parameter), of 0.78 to 1.16 ms
CPU_Z3_GATHER_S = 1.0e-3
#: one trainable parameter's grad through stage3.py reduce_independent_p_g_buckets_and_remove_grads (the copy into
#: the IPG bucket) and one bucket's __reduce_and_partition_ipg_grads (not measured apart: the tiny Llamas'
#: backward leaves them tens of microseconds)
CPU_Z3_GRAD_S = 60e-6
#: the fake process group's all-gather (FakeProcessGroup.hpp ``_allgather_base``: ``outputBuffer.chunk(size_)``,
#: then a ``copy_`` of the input into each chunk; what all_gather_into_tensor runs under an emulated verify):
#: the host's seconds per chunk, measured on the H100 machine (benchmarks/timing/fake-pg-h100.jsonl,
#: tools/fake_pg_probe.py: 410 µs a call at world 64, 57 µs at world 8, whatever the chunk's size from 64 KiB
#: to 8 MiB; 6.3-7.2 µs a chunk from world 8 up). Its reduce-scatter and all-to-all copy once (4.7 and 5.3 µs a
#: call), about what a real collective's launch costs the host, so they are not counted apart.
FAKE_GATHER_COPY_S = 6.4e-6
CPU_Z3_REDUCE_S = 300e-6

#: what a fused attention kernel's backward takes against its forward, by kernel (benchmarks/timing/kernels-h100.json,
#: the median over the measured shapes of (forward + backward − forward) / forward; FlashAttention-2, Dao 2023, §3.1,
#: counts 2.5 times the operations)
ATTENTION_BACKWARD_RATIO = {ATTENTION_CUDNN: 3.0, ATTENTION_FLASH: 2.8, ATTENTION_EFFICIENT: 3.5}
#: any other op's backward against its forward: a matrix product's two products (grad of the input, of the weight;
#: measured at the forward's rate, benchmarks/timing/kernels-h100.json), an elementwise op reading the grad and its
#: saved inputs and writing a grad per input
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
