"""Keep emulated collectives' outputs finite.

On torch's fake process group every collective is a no-op: an all-to-all or all-gather leaves its output
buffer as torch.empty left it, so Ulysses attention and ZeRO-3 gathers compute on uninitialised memory.
When that holds NaN or inf, DeepSpeed's overflow check skips the optimizer step ("OVERFLOW! Skipping
step") and the optimizer states are never allocated: the measured peak would then miss what a real run
holds. Filling outputs from the input (the rank's own shard, repeated) keeps the values finite without
allocating anything: every copy goes into the buffer the caller already allocated.
"""

from __future__ import annotations


def keep_collectives_finite() -> None:
    """Wrap deepspeed.comm's all_to_all_single and all_gather_into_tensor for the fake process group."""
    import deepspeed.comm as dist

    a2a, gather = dist.all_to_all_single, dist.all_gather_into_tensor

    def all_to_all_single(output, tensor, *args, **kwargs):
        work = a2a(output, tensor, *args, **kwargs)
        if output.numel() == tensor.numel():
            output.view(-1).copy_(tensor.reshape(-1))
        return work

    def all_gather_into_tensor(output_tensor, input_tensor, *args, **kwargs):
        work = gather(output_tensor, input_tensor, *args, **kwargs)
        n = input_tensor.numel()
        if n and output_tensor.numel() % n == 0:
            output_tensor.view(-1, n).copy_(input_tensor.reshape(1, n).expand(output_tensor.numel() // n, n))
        return work

    dist.all_to_all_single = all_to_all_single
    dist.all_gather_into_tensor = all_gather_into_tensor
