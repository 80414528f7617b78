"""The library API: `estimate(job, ...)` returns the typed Estimate for the most loaded rank.

(The estimator itself lives in memplan.estimator; this module is the stable entry point.)
"""

from __future__ import annotations

from .result import Estimate
from .specs import Job


def estimate(
    job: Job,
    *,
    target_bytes: int | None = None,
    gpu_name: str | None = None,
    gpu_bytes: int | None = None,
    emulated: bool = False,
) -> Estimate:
    """Predict the per-GPU memory of ``job``: peak allocated / reserved, the breakdown at the peak,
    the timeline of phases, and host RAM / NVMe per node for offload.

    ``target_bytes`` and ``gpu_bytes`` set the verdicts (fits_target, fits_gpu); ``gpu_name``, a preset
    (memplan.gpus), is also the GPU the job's kernels are timed on (how far it runs behind the host sets ZeRO-3's
    reserved memory: memplan.estimator.gpu_time); a bare size or none times them on the reference GPU.
    ``emulated``: the job as memplan.verify measures it by default, rank 0 of N on one GPU over torch's fake
    process group (whose collectives' copies slow the host).
    """
    from .estimator import estimate_job
    from .gpus import timing_gpu

    est = estimate_job(job, timing_gpu(gpu_name), emulated)
    return est.model_copy(update={"target_bytes": target_bytes, "gpu_name": gpu_name, "gpu_bytes": gpu_bytes})
