"""A replay of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, DeviceCachingAllocator).

Every rule below names the torch function it models; docs/allocator.md names the version read and what is not
modelled. The state is torch's (memplan.allocator.blocks:
blocks linked inside their segments, free lists per pool and stream in BlockComparatorSize order); expandable
segments are in memplan.allocator.expandable. Addresses are simulated (blocks.LARGE_TOP), or taken from a real
trace (``simulate(..., segment_addresses=...)``).

Speed: the common case (a cached block fits) runs inline in ``_Replay._span``; a new segment, expandable-segment
mapping, the OOM path and empty_cache run in the methods below it.
"""

from __future__ import annotations

from bisect import bisect_left

from .blocks import (
    ADDR_ALIGN,
    ADDR_BASE,
    ALLOCATED,
    KEY_SPAN,
    LARGE_TOP,
    UNMAPPED,
    Block,
    FreeList,
    allocation_size,
    round_size,
)
from .config import MIN_BLOCK_BYTES, SMALL_SIZE_BYTES, AllocatorConfig
from .events import ledger_from_events
from .expandable import ExpandableSegments
from .release import CacheRelease
from .result import OomInfo, PhasePeak, SimResult

__all__ = ["allocation_size", "ledger_from_events", "replay_series", "round_size", "simulate", "simulate_events"]


class _Oom(Exception):
    def __init__(self, alloc_bytes: int) -> None:
        self.alloc_bytes = alloc_bytes


class _Replay(ExpandableSegments, CacheRelease):
    """DeviceCachingAllocator's state during one replay of a ledger."""

    def __init__(self, ledger, config: AllocatorConfig, segment_addresses=None) -> None:
        self.cfg = config
        self.addresses = iter(segment_addresses or ())
        self.events = ledger.events
        self.sizes = ledger.sizes
        self.streams = ledger.streams
        self.exp = config.expandable_segments
        self.msplit = config.max_split_size_bytes  # None: torch's SIZE_MAX
        self.nsr = config.non_split_rounding_bytes
        self.table = config.divisions_table
        self.card = config.card_bytes
        self.allowed = config.allowed_bytes
        g = config.garbage_collection_threshold
        self.gc = g if g and self.allowed is not None else None  # garbage collection acts only under a fraction
        self.gc_calls = [0, 0]
        self.round_cache: dict[int, int] = {}  # request -> round_size, when roundup_power2_divisions is set
        self.fls: dict[int, FreeList] = {}
        self.live: dict[int, Block] = {}
        self.next_addr = ADDR_BASE
        self.next_large = LARGE_TOP
        self.free_bases: list[int] = []  # virtual ranges of released expandable segments, reused first
        # counters (DeviceStats)
        self.allocated = self.rounded = self.reserved = 0
        self.unsplit_free = 0  # bytes of cached blocks that are whole cudaMalloc segments
        self.segments = 0
        self.num_device_alloc = self.num_device_free = self.retries = 0
        # peaks: over the whole replay, and since the last phase mark
        self.g_alloc = self.g_round = self.g_res = 0
        self.g_alloc_at = self.g_res_at = -1
        self.p_alloc = self.p_round = self.p_res = 0
        self.frag = self.inactive = self.seg_at_peak = 0
        self.pending_peak = False
        self.timeline: list[tuple[int, int]] = []
        self.i = 0  # the event being replayed (for the slow paths)

    # -- the common case, inline ------------------------------------------------------------------------
    def _span(self, start: int, stop: int) -> None:
        """Replay events[start:stop]; a cached block that fits is found inline, anything else goes to _malloc."""
        events, sizes, streams, live, fls = self.events, self.sizes, self.streams, self.live, self.fls
        exp, msplit, nsr, table, cfg, gc, gc_calls = self.exp, self.msplit, self.nsr, self.table, self.cfg, self.gc, self.gc_calls
        no_split_cap = msplit if msplit is not None else 1 << 62
        rcache = self.round_cache
        allocated, rounded, unsplit = self.allocated, self.rounded, self.unsplit_free
        p_alloc, p_round, g_alloc, g_round, g_alloc_at = self.p_alloc, self.p_round, self.g_alloc, self.g_round, self.g_alloc_at
        for i in range(start, stop):
            ev = events[i]
            if ev >= 0:
                n = sizes[ev]
                if n <= 0:
                    continue  # NativeCachingAllocator::allocate does not call malloc for 0 bytes
                if table is None:
                    size = (n + 511) & -512
                else:
                    size = rcache.get(n) or rcache.setdefault(n, round_size(n, cfg))
                small = size <= SMALL_SIZE_BYTES
                fl = fls.get(streams[ev] * 2 + small)
                blk = None
                if gc is not None:
                    gc_calls[small] += 1  # get_free_block: ++pool.get_free_blocks_call_count
                if fl is not None:
                    keys = fl.keys
                    j = bisect_left(keys, size * KEY_SPAN)  # get_free_block: pool.blocks.lower_bound
                    if j < len(keys):
                        blocks = fl.blocks
                        blk = blocks[j]
                        if exp and blk.es is not None:
                            # get_free_block: a block next to the unmapped tail counts as its expandable size
                            xs = blk.size + (blk.next.size if blk.next is not None and blk.next.state == 2 else 0)
                            while j + 1 < len(blocks):
                                nb = blocks[j + 1]
                                nxs = nb.size + (nb.next.size if nb.next is not None and nb.next.state == 2 else 0)
                                if nxs >= xs:
                                    break
                                j, blk, xs = j + 1, nb, nxs
                        if msplit is not None and ((size < msplit and blk.size >= msplit)
                                                   or (size >= msplit and blk.size >= size + nsr)):
                            blk = None  # get_free_block: oversize rules
                        else:
                            del keys[j]
                            del blocks[j]
                            if blk.prev is None and blk.next is None:
                                unsplit -= blk.size
                slow = blk is None
                if slow:
                    self.allocated, self.rounded, self.unsplit_free, self.i = allocated, rounded, unsplit, i
                    blk = self._malloc(size, small, streams[ev])
                    unsplit = self.unsplit_free
                    fl = blk.fl
                # alloc_found_block, with should_split's rule
                rem = blk.size - size
                if (rem >= MIN_BLOCK_BYTES) if (small or exp) else (size < no_split_cap and rem > SMALL_SIZE_BYTES):
                    nb = Block(blk.addr, size, 0, fl, blk.es)
                    p = blk.prev
                    nb.prev = p
                    if p is not None:
                        p.next = nb
                    nb.next = blk
                    blk.prev = nb
                    blk.addr += size
                    blk.size = rem
                    blk.state = 1
                    key = blk.key = rem * KEY_SPAN + blk.addr
                    k = bisect_left(fl.keys, key)
                    fl.keys.insert(k, key)
                    fl.blocks.insert(k, blk)
                    if gc is not None:
                        blk.gcb = gc_calls[small]
                    blk = nb
                else:
                    blk.state = 0
                blk.req = size
                live[ev] = blk
                allocated += blk.size
                rounded += size
                if allocated > p_alloc:
                    p_alloc = allocated
                    if allocated > g_alloc:
                        g_alloc, g_alloc_at = allocated, i
                if rounded > p_round:
                    p_round = rounded
                    g_round = max(g_round, rounded)
                if slow and self.pending_peak:
                    self.allocated, self.unsplit_free = allocated, unsplit
                    self._record_peak_state()
            else:
                blk = live.pop(~ev, None)
                if blk is None:
                    continue  # a 0-byte tensor
                allocated -= blk.size
                rounded -= blk.req
                # free_block: merge with free neighbours of the same segment (try_merge_blocks)
                fl = blk.fl
                keys, blocks = fl.keys, fl.blocks
                p = blk.prev
                if p is not None and p.state == 1:
                    k = bisect_left(keys, p.key)
                    del keys[k]
                    del blocks[k]
                    blk.addr = p.addr
                    blk.size += p.size
                    p = blk.prev = p.prev
                    if p is not None:
                        p.next = blk
                q = blk.next
                if q is not None and q.state == 1:
                    k = bisect_left(keys, q.key)
                    del keys[k]
                    del blocks[k]
                    blk.size += q.size
                    q = blk.next = q.next
                    if q is not None:
                        q.prev = blk
                blk.state = 1
                key = blk.key = blk.size * KEY_SPAN + blk.addr
                k = bisect_left(keys, key)
                keys.insert(k, key)
                blocks.insert(k, blk)
                if gc is not None:
                    blk.gcb = gc_calls[fl.small]
                if p is None and q is None:
                    unsplit += blk.size
        self.allocated, self.rounded, self.unsplit_free = allocated, rounded, unsplit
        self.p_alloc, self.p_round, self.g_alloc, self.g_round, self.g_alloc_at = p_alloc, p_round, g_alloc, g_round, g_alloc_at

    # -- DeviceCachingAllocator::malloc when no cached block was taken inline --------------------------------------
    def _malloc(self, size: int, small: bool, stream: int) -> Block:
        key = stream * 2 + small
        fl = self.fls.get(key)
        if fl is None:
            fl = self.fls[key] = FreeList(small, stream, self.gc_calls)
        blk = self._get_free_block(fl, size)
        if blk is not None:
            return blk
        if self.gc is not None:
            self._garbage_collect_cached_blocks()
        alloc = allocation_size(size, self.cfg)
        blk = self._alloc_block(fl, size, alloc)
        if blk is None and self.msplit is not None and self._release_available_cached_blocks(fl, size):
            blk = self._alloc_block(fl, size, alloc)
        if blk is None:
            self.release_cached_blocks()
            self.retries += 1  # alloc_block(isRetry=true): stats.num_alloc_retries
            blk = self._alloc_block(fl, size, alloc)
        if blk is None:
            raise _Oom(alloc)
        return blk

    def _get_free_block(self, fl: FreeList, size: int) -> Block | None:
        """get_free_block: best fit by (size, address), the expandable-size walk, the oversize rules."""
        keys, blocks = fl.keys, fl.blocks
        j = bisect_left(keys, size * KEY_SPAN)
        if j == len(keys):
            return None
        if self.exp and blocks[j].es is not None:
            def xs(b: Block) -> int:
                return b.size + (b.next.size if b.next is not None and b.next.state == UNMAPPED else 0)
            while j + 1 < len(blocks) and xs(blocks[j + 1]) < xs(blocks[j]):
                j += 1
        blk = blocks[j]
        m = self.msplit
        if m is not None and ((size < m and blk.size >= m) or (size >= m and blk.size >= size + self.nsr)):
            return None
        del keys[j]
        del blocks[j]
        if blk.prev is None and blk.next is None:
            self.unsplit_free -= blk.size
        return blk

    def _grow(self, nbytes: int) -> None:
        """reserved_bytes.increase, with the peaks (Stat::increase)."""
        r = self.reserved = self.reserved + nbytes
        self.num_device_alloc += 1
        self.timeline.append((self.i, r))
        self.p_res = max(self.p_res, r)
        if r > self.g_res:
            self.g_res, self.g_res_at, self.pending_peak = r, self.i, True

    def _shrink(self, nbytes: int) -> None:
        self.reserved -= nbytes
        self.num_device_free += 1
        self.timeline.append((self.i, self.reserved))

    def _record_peak_state(self) -> None:
        self.pending_peak = False
        self.frag = self.reserved - self.allocated
        self.inactive = self.frag - self.unsplit_free
        self.seg_at_peak = self.segments

    def _alloc_block(self, fl: FreeList, size: int, alloc: int) -> Block | None:
        """alloc_block: cudaMalloc a new segment, or map pages of the stream's expandable segment."""
        if self.allowed is not None and self.reserved + alloc > self.allowed:
            return None  # past the per-process memory fraction (checked with get_allocation_size even when expandable)
        if self.exp:
            return self._try_allocate_expandable_block(fl, size)
        if self.card is not None and self.reserved + alloc > self.card:
            return None  # cudaMalloc fails: cudaErrorMemoryAllocation
        addr = next(self.addresses, None)
        if addr is None:
            span = -(-alloc // ADDR_ALIGN) * ADDR_ALIGN
            if fl.small:
                addr = self.next_addr
                self.next_addr += span
            else:
                addr = self.next_large = self.next_large - span
        self.segments += 1
        self._grow(alloc)
        return Block(addr, alloc, ALLOCATED, fl, None)

    # -- expandable segments -------------------------------------------------------------------------------

    def signature(self) -> tuple:
        """The state the rest of a replay depends on: every block (address, size, whether it starts or ends its
        segment) — the live ones in tensor-id order, so that each live tensor keeps its place when the ids of a
        repeated span shift — the free lists, reserved and where new segments would go. Expandable segments and
        garbage collection carry more state; their signature is None (never equal)."""
        if self.exp or self.gc is not None:
            return (None, self.i)
        live = tuple((b.addr, b.size, b.req, b.prev is None, b.next is None) for _, b in sorted(self.live.items()))
        free = tuple((k, tuple((b.addr, b.size, b.prev is None, b.next is None) for b in fl.blocks))
                     for k, fl in sorted(self.fls.items()))
        return live, free, self.reserved, self.next_addr, self.next_large

    def run(self, ledger, per_event: list | None = None, signature_labels: frozenset = frozenset()) -> SimResult:
        marks = sorted(ledger.marks, key=lambda m: m.at)
        signatures: list[tuple[str, tuple]] = []
        n = len(self.events)
        phases: list[PhasePeak] = []
        label, start = None, 0
        oom = None
        pos = 0
        try:
            for m in [*marks, None]:
                stop = n if m is None else min(m.at, n)
                if per_event is None:
                    self._span(pos, stop)
                else:
                    for i in range(pos, stop):
                        self._span(i, i + 1)
                        per_event.append((self.allocated, self.reserved))
                pos = stop
                if m is None:
                    break
                if m.kind == "empty_cache":
                    self.i = m.at
                    self.release_cached_blocks()
                else:
                    if m.label in signature_labels:
                        signatures.append((m.label, self.signature()))
                    if label is not None:
                        phases.append(PhasePeak(label, start, m.at, self.p_alloc, self.p_res, self.p_round))
                    label, start = m.label, m.at
                    self.p_alloc, self.p_res, self.p_round = self.allocated, self.reserved, self.rounded
        except _Oom as e:
            ev = self.events[self.i]
            oom = OomInfo(self.i, ev, self.sizes[ev], e.alloc_bytes, self.reserved, self.allocated)
            pos = n = self.i
        if label is not None:
            phases.append(PhasePeak(label, start, n, self.p_alloc, self.p_res, self.p_round))
        return SimResult(
            peak_reserved_bytes=self.g_res, peak_reserved_at=self.g_res_at,
            peak_allocated_bytes=self.g_alloc, peak_allocated_at=self.g_alloc_at, peak_rounded_bytes=self.g_round,
            reserved_end_bytes=self.reserved, allocated_end_bytes=self.allocated,
            fragmentation_at_peak_bytes=self.frag, inactive_split_at_peak_bytes=self.inactive,
            segments_at_peak=self.seg_at_peak, segments_end=self.segments,
            num_device_alloc=self.num_device_alloc, num_device_free=self.num_device_free,
            num_alloc_retries=self.retries, oom=oom, events_replayed=pos, phases=tuple(phases),
            reserved_timeline=tuple(self.timeline), signatures=tuple(signatures))


def _as_config(config: AllocatorConfig | None) -> AllocatorConfig:
    return AllocatorConfig() if config is None else config


def simulate(ledger, config: AllocatorConfig | None = None, *, segment_addresses=None,
             signatures=()) -> SimResult:
    """Replay ``ledger`` (a memplan.ledger.Ledger) through the caching allocator; see SimResult.

    Events are ``ledger.events`` (tensor id to allocate, ``~id`` to free) with ``ledger.sizes`` and
    ``ledger.streams``; a mark of kind "phase" resets the phase peaks (torch.cuda.reset_peak_memory_stats), one
    of kind "empty_cache" runs torch.cuda.empty_cache() before the event at ``mark.at``. The replay stops at an
    out-of-memory event (``SimResult.oom``) when ``config.card_bytes`` is set.

    ``segment_addresses``: the addresses cudaMalloc returned, in order, on a real run (trace.segment_addresses):
    successive new segments take them, so ties between equal-sized cached blocks (BlockComparatorSize orders
    them by address) break as they did on the GPU. Without them, each segment takes the next address up.

    ``signatures``: phase labels at whose start the allocator's state is recorded (SimResult.signatures).
    """
    return _Replay(ledger, _as_config(config), segment_addresses).run(ledger, signature_labels=frozenset(signatures))


def replay_series(ledger, config: AllocatorConfig | None = None, *,
                  segment_addresses=None) -> tuple[SimResult, list[tuple[int, int]]]:
    """``simulate``, plus (allocated, reserved) after every replayed event (slower: for tests and timelines)."""
    series: list[tuple[int, int]] = []
    result = _Replay(ledger, _as_config(config), segment_addresses).run(ledger, per_event=series)
    return result, series


def simulate_events(events, config: AllocatorConfig | None = None) -> SimResult:
    """``simulate`` over ``(kind, key, nbytes, stream)`` tuples (see ledger_from_events), without building a
    Ledger by hand."""
    return simulate(ledger_from_events(events), config)
