"""The ledger as the caching allocator sees it when the GPU runs behind the CPU: the bound above reserved.

A tensor another stream used (``Tensor.record_stream``; the ledger's ``stream_used``) is not reusable when Python
frees it: CUDACachingAllocator::free records an event on each stream that used the block (insert_events) and
hands the block back to the free lists only once those events have completed, checked at a later malloc
(process_events). Under ZeRO-3 DeepSpeed frees two kinds of tensor that way: every gathered parameter
(partition_parameters.py free_param, ``param.data.record_stream(current_stream())``: the buffer was gathered on
the all-gather stream) and every gradient copied into the IPG bucket (stage3.py __add_grad_to_ipg_bucket,
``param.grad.record_stream`` of the reduce stream). When the GPU keeps up with the CPU the events have completed
by the next malloc and the plain ledger is right; when it falls behind, the blocks stay unavailable and new
segments are reserved (measured: benchmarks/accuracy/README.md, "ZeRO-3 jobs run alone": the deferred frees of
nine lone traces completed 0 to 1418 allocations late, and the reserved figure followed).

How far behind the GPU falls depends on GPU time against host time, which estimator.gpu_time replays for one GPU
(the estimate's figure). What bounds it whatever the GPU is a synchronization: verify's phases start with
``torch.cuda.synchronize()`` (memplan.verify.phases), and ``torch.cuda.empty_cache()`` synchronizes and frees the
pending events (synchronize_and_free_events). So this bound moves each deferred free to the next phase mark or
empty_cache, as if the GPU were a whole phase behind: the most the cache can hold back between two
synchronizations, what a GPU shared with other work or slower than the one timed can reach. Nothing else is moved;
allocations keep their order. tests/test_accuracy.py holds it above every measured ZeRO-3 row (within the 3 % the
reserved bar allows under); it over-states the reserved figure of jobs whose GPU keeps up.
"""

from __future__ import annotations

from ..ledger import Ledger, Mark


def gpu_behind(L: Ledger) -> Ledger | None:
    """``L`` with every free of a ``stream_used`` tensor moved to just before the next mark (phase or
    empty_cache) after it, or to the end; None when ``L`` has no such tensor (the plain ledger is the bound)."""
    used = L.stream_used
    if not used:
        return None
    starts = sorted({m.at for m in L.marks})
    events: list[int] = []
    pending: list[int] = []
    moved = {}  # old event index of a mark → new index
    k = 0
    for i, ev in enumerate(L.events):
        if k < len(starts) and starts[k] == i:
            events += pending
            pending = []
            moved[i] = len(events)
            k += 1
        if ev < 0 and ~ev in used:
            pending.append(ev)
        else:
            events.append(ev)
    events += pending
    end = len(events)
    return L.reordered(events, [Mark(moved.get(m.at, end), m.label, m.kind) for m in L.marks])
