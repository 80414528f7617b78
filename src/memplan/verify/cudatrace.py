"""The real CUDA allocation order of a transformers model's forward and backward (the GPU counterpart of
memplan.verify.cputrace): the caching allocator's trace (torch.cuda.memory._record_memory_history) of one
micro-step after a warm-up step, as (±block bytes, partner) events comparable with the estimator's CUDA ledger
(memplan.estimator.model_check.model_events(device="cuda", kernel_temporaries=True), sizes rounded to the
allocator's 512-byte blocks). What CUDA allocates outside the model's tensors (cuBLAS workspaces, kept from
the warm-up) does not recur in the recorded step. Imports torch inside functions only.
"""

from __future__ import annotations

#: entries the recorded trace keeps (a tiny model's step makes a few thousand)
MAX_ENTRIES = 200_000


def record(fn, device: int = 0) -> list[dict]:
    """Run ``fn()`` once to warm up, then again while recording the allocator's history; the device's trace
    entries (dicts with action, addr, size), in order."""
    import torch

    fn()
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
    try:
        fn()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return list(snapshot["device_traces"][device])


def net_events(entries: list[dict]) -> list[tuple[int, int]]:
    """(±bytes, partner) of every alloc and free_requested entry: ``partner`` is, for a free, the index of
    its allocation in the returned list (-1 for an allocation); frees of blocks allocated before the
    recording are dropped."""
    out: list[tuple[int, int]] = []
    open_at: dict[int, int] = {}
    for e in entries:
        if e["action"] == "alloc":
            open_at[e["addr"]] = len(out)
            out.append((int(e["size"]), -1))
        elif e["action"] == "free_requested" and e["addr"] in open_at:
            out.append((-int(e["size"]), open_at.pop(e["addr"])))
    return out
