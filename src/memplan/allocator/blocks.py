"""The allocator's data: blocks, per-(pool, stream) free lists, expandable segments, rounding and segment sizes.

Blocks are torch's ``Block``: a piece of one segment, doubly linked to its neighbours (``prev`` / ``next``), so a
free merges with free neighbours of its own segment only (``try_merge_blocks``). The free blocks of a pool and
stream are kept in BlockComparatorSize order (size, then address; ``BlockPool::blocks``) as a sorted list of
integer keys ``size * KEY_SPAN + address``, searched with bisect.
"""

from __future__ import annotations

from bisect import bisect_left

from .config import (
    MIN_BLOCK_BYTES,
    MIN_LARGE_ALLOC_BYTES,
    ROUND_LARGE_BYTES,
    ROUNDUP_FIRST_LOG2,
    ROUNDUP_INTERVALS,
    SMALL_BUFFER_BYTES,
    SMALL_SIZE_BYTES,
    AllocatorConfig,
)

#: free-list keys are size * KEY_SPAN + address, so simulated addresses stay below 2**52 (4 PiB)
KEY_SPAN = 1 << 52
#: where simulated cudaMalloc addresses start, and their alignment (the driver aligns large allocations to 2 MiB)
ADDR_BASE = 1 << 32
ADDR_ALIGN = 2 << 20
#: virtual address space reserved per expandable segment. ExpandableSegment reserves 1 1/8 of the card's memory
#: (ExpandableSegment constructor, cuMemAddressReserve); 1 TiB stands for "more than any card", so the unmapped
#: tail never runs out
EXPANDABLE_VA_BYTES = 1 << 40

#: where simulated large-pool addresses start, going down. The driver's order matters only where
#: BlockComparatorSize breaks a tie between equal-sized cached blocks by address. On an H200 (driver 580, torch
#: 2.11, benchmarks/allocator/gpu) cudaMalloc handed out large segments mostly downwards and 2 MiB ones mostly
#: upwards; modelling that (newer large segments lower, newer small ones higher) made a 1.1B Llama's replay exact
#: and halved the mismatches of the seeded random op sequences. It stays a heuristic: the driver's VA heap is
#: not modelled (see docs/allocator.md).
LARGE_TOP = 1 << 51

ALLOCATED, FREE, UNMAPPED = 0, 1, 2  # Block state: in use; cached (in BlockPool::blocks); BlockPool::unmapped


class Block:
    """Block: a piece of one segment. ``state`` is ALLOCATED, FREE or UNMAPPED (expandable segments only)."""

    __slots__ = ("addr", "es", "fl", "gcb", "key", "next", "prev", "req", "size", "state")

    def __init__(self, addr: int, size: int, state: int, fl: FreeList, es: ExpSeg | None) -> None:
        self.addr = addr
        self.size = size
        self.prev: Block | None = None
        self.next: Block | None = None
        self.state = state
        self.fl = fl
        self.key = 0
        self.es = es
        self.req = 0  # the rounded request while allocated
        self.gcb = 0  # gc_count_base: the pool's get_free_block count when the block was cached


class FreeList:
    """BlockPool restricted to one stream: the cached blocks (keys/blocks, same order) and the unmapped ones."""

    __slots__ = ("blocks", "gc_calls", "keys", "small", "stream", "ublocks", "ukeys")

    def __init__(self, small: bool, stream: int, gc_calls: list[int]) -> None:
        self.small = small
        self.stream = stream
        self.gc_calls = gc_calls  # BlockPool::get_free_blocks_call_count of [large, small], shared by all streams
        self.keys: list[int] = []
        self.blocks: list[Block] = []
        self.ukeys: list[int] = []  # BlockPool::unmapped, ordered by address (BlockComparatorAddress)
        self.ublocks: list[Block] = []

    def insert(self, b: Block) -> None:
        """BlockPool::insert_into_blocks (which also stamps gc_count_base)."""
        b.gcb = self.gc_calls[self.small]
        key = b.key = b.size * KEY_SPAN + b.addr
        k = bisect_left(self.keys, key)
        self.keys.insert(k, key)
        self.blocks.insert(k, b)

    def remove(self, b: Block) -> None:
        k = bisect_left(self.keys, b.key)
        del self.keys[k]
        del self.blocks[k]

    def insert_unmapped(self, b: Block) -> None:
        k = bisect_left(self.ukeys, b.addr)
        self.ukeys.insert(k, b.addr)
        self.ublocks.insert(k, b)

    def remove_unmapped(self, b: Block) -> None:
        k = bisect_left(self.ukeys, b.addr)
        del self.ukeys[k]
        del self.ublocks[k]


class ExpSeg:
    """ExpandableSegment: a reserved virtual range, mapped in pages of ``page`` bytes (its segment_size_)."""

    __slots__ = ("base", "page")

    def __init__(self, base: int, page: int) -> None:
        self.base = base
        self.page = page


def _round_power2_divisions(size: int, divisions: int) -> int:
    """roundup_power2_next_division: round up to the next of ``divisions`` equal steps between powers of two."""
    if size & (size - 1) == 0:
        return size
    floor2 = 1 << (size.bit_length() - 1)
    step = floor2 >> (divisions.bit_length() - 1)
    if step == 0:
        return floor2 << 1
    low = size & ~(step - 1)
    return size if low == size else low + step


def round_size(nbytes: int, config: AllocatorConfig | None = None) -> int:
    """round_size: the block size a request of ``nbytes`` asks for (512-byte multiples, or power-of-2 divisions)."""
    if nbytes < MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    table = config.divisions_table if config is not None else None
    if table is not None:
        index = min(max(nbytes.bit_length() - 1 - ROUNDUP_FIRST_LOG2, 0), ROUNDUP_INTERVALS - 1)
        d = table[index]
        if d > 1 and nbytes > MIN_BLOCK_BYTES * d:
            return _round_power2_divisions(nbytes, d)
    return -(-nbytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES


def allocation_size(size: int, config: AllocatorConfig) -> int:
    """get_allocation_size: the segment cudaMalloc'd for a rounded request that no cached block fits."""
    if size <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if size < MIN_LARGE_ALLOC_BYTES:
        return config.large_segment_size_bytes
    return -(-size // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES
