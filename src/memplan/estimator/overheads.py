"""Beyond torch's allocated bytes: the caching allocator's reserve, the CUDA context and NCCL buffers."""

from __future__ import annotations

from ..specs import Job
from ..units import MiB, round_up

#: CUDA context with torch's kernels loaded lazily (CUDA_MODULE_LOADING=LAZY), per process; seen as
#: ~500 MiB on Hopper in nvidia-smi for torch 2.x. Not measured by memplan verify (outside the allocator).
CUDA_CONTEXT_BYTES = 512 * MiB
#: NCCL communicator buffers per communicator (NCCL_BUFFSIZE 4 MiB × channels × peers, order of magnitude).
NCCL_PER_GROUP_BYTES = 128 * MiB
#: the caching allocator rounds large blocks to 2 MiB (c10/cuda/CUDACachingAllocator.cpp kRoundLarge)
ALLOCATOR_ROUND_BYTES = 2 * MiB


def reserved_bytes(job: Job, peak_allocated: int, parts) -> int:
    """Predicted max_memory_reserved: the peak rounded per block, plus freed-but-cached blocks that a
    later, larger request could not reuse (estimated as the largest transient part)."""
    transient = max((p[1] for p in parts if p[0] in ("logits_loss", "layer_backward_transient",
                                                     "optimizer_step_transient")), default=0)
    return round_up(peak_allocated + len(parts) * ALLOCATOR_ROUND_BYTES, ALLOCATOR_ROUND_BYTES) + transient // 4


def non_torch_bytes(job: Job) -> int:
    """CUDA context plus NCCL communicators (data-parallel, and sequence / tensor / pipeline groups in use)."""
    lay = job.layout
    groups = 1 + (lay.sp > 1) + (lay.tp > 1) + (lay.pp > 1)
    return CUDA_CONTEXT_BYTES + (NCCL_PER_GROUP_BYTES * groups if lay.world > 1 else 0)
