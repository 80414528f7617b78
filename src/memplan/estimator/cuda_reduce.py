"""CUDA's reduction kernel's global-memory staging (aten/src/ATen/native/cuda/Reduce.cuh, torch 2.11): what
``grad.sum(0)`` of a contiguous [rows, out] tensor allocates besides its result — the engine's
``InputMetadata::reduce_grad`` summing a broadcast operand's grad down to its size (validate_outputs): a linear's
incoming grad to its bias, an RMSNorm's ``weight · x`` grad to the weight (trace19-s4-041: Qwen3-MoE at 8K, the
[8192, 2048] fp16 sum staged 128 MiB and 64 semaphore bytes after each norm weight's 4 KiB grad).

setReduceConfig for a reduction over the slow dimension: the block maps to the outputs (block_x_reduce off), the
output vectorised by get_output_vec_size (4, halved until it divides ``out``), set_block_dimension(out / vec,
rows) under max_reduce_threads 512 / vec threads, the rows split across the block's warps when each thread would
sum at least min(block_height · 16, 256) of them, and across CTAs (ctas_per_output: max(min(target_grid /
grid.x, values / 16), values / 256), target_grid = SMs · maxThreadsPerMultiProcessor / threads) when each thread
still sums 256 or more. Then gpu_reduce_kernel allocates ``global_memory_size()`` = acc bytes · out ·
ctas_per_output · block.x · vec and ``semaphore_size()`` = 4 · grid.x, freed (semaphores first) as it returns.
Measured on the H200 for fp16, bf16 and fp32 at eight shapes, every one exact (the session-9 probe,
tools/bias_grad_probe.py; the T·out·8-byte transients of the BLOOM and Qwen2 GPU traces). Pure: no torch.
"""

from __future__ import annotations

#: H200 (sm_90): cudaDeviceProp.multiProcessorCount and maxThreadsPerMultiProcessor (the GPU verify runs on)
H200_SMS, H200_THREADS_PER_SM = 132, 2048
MAX_REDUCE_THREADS = 512  # Reduce.cuh max_reduce_threads (all but complex double)
WARP = 32
ACC_BYTES = 4  # the accumulate type of fp16, bf16 and fp32 sums: float


def _last_pow2(n: int) -> int:
    return max(1, 1 << (n.bit_length() - 1)) if n > 0 else 1


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def sum_rows_staging(rows: int, out: int, sms: int = H200_SMS, threads_per_sm: int = H200_THREADS_PER_SM
                     ) -> tuple[int, int]:
    """(global buffer bytes, semaphore bytes) of summing a contiguous [rows, out] tensor over its rows on CUDA;
    (0, 0) when the kernel reduces without global memory."""
    vec = 4
    while out % vec:
        vec //= 2
    max_threads = MAX_REDUCE_THREADS // vec
    dim0, dim1 = out // vec, rows
    p0 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    p1 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    width = min(p0, WARP)
    height = min(p1, max_threads // width)
    width = min(p0, max_threads // height)
    threads = width * height
    step_output, step_input = width, 1  # the output across the lanes
    if _div_up(rows, step_input) >= min(height * 16, 256):
        step_input *= height  # the rows across the warps
        split_warps = True
    else:
        step_output *= height
        split_warps = False
    grid_x = _div_up(out // vec, step_output)
    values = _div_up(rows, step_input)
    target = sms * (threads_per_sm // threads)
    if not (split_warps and values >= 256 and grid_x <= target):
        return 0, 0
    ctas = max(min(_div_up(target, grid_x), _div_up(values, 16)), _div_up(values, 256))
    if ctas <= 1:
        return 0, 0
    return ACC_BYTES * out * ctas * width * vec, 4 * grid_x


def stage_reduction(out, index: int, rows: int, out_elems: int, cuda: bool) -> None:
    """Input ``index`` of the node that made ``out`` gets its grad summed from [rows, out_elems] (the staging
    Autograd._validate_outputs allocates after the sum's result): on CUDA, for an input that requires grad;
    nothing for a node-less tensor."""
    node = out.node
    if cuda and node is not None and node.inputs[index].requires_grad:
        node.reduce_staging = {**(node.reduce_staging or {}), index: sum_rows_staging(rows, out_elems)}
