"""What a replay through the simulated caching allocator reports (integer bytes; event indices into Ledger.events)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PhasePeak:
    """Peaks over one phase, read the way a harness that calls torch.cuda.reset_peak_memory_stats() at every phase
    start reads them (DeviceCachingAllocator::resetPeakStats sets each peak to its current value)."""

    label: str
    start: int  # first event index of the phase
    stop: int  # one past its last event
    peak_allocated_bytes: int  # torch.cuda.max_memory_allocated() at the phase's end
    peak_reserved_bytes: int  # torch.cuda.max_memory_reserved() at the phase's end
    peak_rounded_bytes: int  # the same peak counting each live tensor at its 512-rounded request (Ledger.peak)


@dataclass(frozen=True, slots=True)
class OomInfo:
    """The allocation torch would have refused with OutOfMemoryError (DeviceCachingAllocator::malloc)."""

    event: int  # index into Ledger.events
    tensor: int  # the tensor id the ledger allocates there
    requested_bytes: int  # the request before rounding
    alloc_bytes: int  # its get_allocation_size (the segment cudaMalloc was asked for; with expandable segments only
    #                   the pages missing were to be mapped)
    reserved_bytes: int  # reserved after the OOM path released what it could
    allocated_bytes: int


@dataclass(frozen=True, slots=True)
class SimResult:
    """A replay's outcome. ``allocated`` is torch's ``memory_allocated`` (the sizes of the blocks handed out:
    a large-pool block left unsplit counts whole); ``rounded`` counts each live tensor at its 512-rounded request,
    which is what ``Ledger.peak`` and ``ledger.block_bytes`` count (equal to allocated when every block is split)."""

    peak_reserved_bytes: int  # torch.cuda.max_memory_reserved()
    peak_reserved_at: int  # event index where reserved first reached it (-1: nothing was reserved)
    peak_allocated_bytes: int  # torch.cuda.max_memory_allocated()
    peak_allocated_at: int
    peak_rounded_bytes: int  # == Ledger.peak()[0]
    reserved_end_bytes: int
    allocated_end_bytes: int
    #: reserved − allocated just after the event that set the reserved peak
    fragmentation_at_peak_bytes: int
    #: of that, free blocks inside segments that also hold other blocks (torch's inactive_split_bytes, plus the
    #: free mapped bytes of expandable segments): what empty_cache could not give back
    inactive_split_at_peak_bytes: int
    segments_at_peak: int  # cudaMalloc'd segments plus expandable segments live at the reserved peak
    segments_end: int
    num_device_alloc: int  # cudaMalloc calls plus page mappings (memory_stats num_device_alloc)
    num_device_free: int  # cudaFree calls plus unmappings (memory_stats num_device_free)
    num_alloc_retries: int  # memory_stats num_alloc_retries: cache flushes to retry a failed cudaMalloc
    oom: OomInfo | None
    events_replayed: int  # len(ledger.events), or the OOM event's index when the replay stopped there
    phases: tuple[PhasePeak, ...]
    #: (event index, reserved bytes after it) at every change of reserved; the state before event 0 is 0
    reserved_timeline: tuple[tuple[int, int], ...]
    #: (phase label, the allocator's state where that phase begins) for the labels asked for (simulate's
    #: ``signatures``): equal states that see equal events from there on evolve equally (memplan.estimator.fold)
    signatures: tuple[tuple[str, tuple], ...] = ()
