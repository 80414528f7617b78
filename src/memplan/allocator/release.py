"""Giving cached memory back to the device: DeviceCachingAllocator's garbage_collect_cached_blocks,
release_available_cached_blocks, release_cached_blocks and release_block (c10/cuda/CUDACachingAllocator.cpp),
as a mixin of memplan.allocator.sim's replay (whose state — free lists, counters — these methods read)."""

from __future__ import annotations

from bisect import bisect_left

from .blocks import KEY_SPAN, UNMAPPED, Block, FreeList


class CacheRelease:
    """The release paths of the replay (see the module docstring)."""

    def _garbage_collect_cached_blocks(self) -> None:
        """garbage_collect_cached_blocks: while reserved is above threshold × allowed, cudaFree whole cached
        large-pool segments at least as old (in get_free_block calls) as the average, oldest rounds first."""
        threshold = int(self.gc * self.allowed)
        if self.reserved <= threshold:
            return
        target = self.reserved - threshold
        now = self.gc_calls[0]
        cached = [b for st, fl in sorted(self.fls.items()) if not fl.small for b in fl.blocks]
        whole = [b for b in cached if b.prev is None and b.next is None]
        total_age, count = sum(now - b.gcb for b in whole), len(whole)
        if count == 0:
            return
        reclaimed, freed = 0, True
        while reclaimed < target and freed and count > 0:
            threshold_age = total_age / count
            freed = False
            for b in list(whole):
                if b.es is None and now - b.gcb >= threshold_age:
                    freed = True
                    reclaimed += b.size
                    total_age -= now - b.gcb
                    count -= 1
                    whole.remove(b)
                    self._release_block(b)

    def _release_available_cached_blocks(self, fl: FreeList, size: int) -> bool:
        """release_available_cached_blocks: cudaFree oversize cached blocks of this stream, just enough for ``size``."""
        m = self.msplit
        want = max(size, m)
        keys, blocks = fl.keys, fl.blocks
        j = bisect_left(keys, want * KEY_SPAN)
        if j < len(keys) and blocks[j].es is None and blocks[j].prev is None and blocks[j].next is None:
            self._release_block(blocks[j])
            return True
        if j == 0:
            return False
        released = 0
        j -= 1
        while released < want and j >= 0 and blocks[j].size >= m:
            b = blocks[j]
            j -= 1
            if b.es is None and b.prev is None and b.next is None:  # oversize cached blocks are whole segments
                released += b.size
                self._release_block(b)
        return released >= want

    def release_cached_blocks(self) -> None:
        """release_cached_blocks (empty_cache, and the OOM path): cudaFree every cached block that is a whole
        segment, large pool first (release_blocks); unmap the free pages of expandable segments (unmap_block)."""
        for small in (False, True):
            for fl in [f for f in self.fls.values() if f.small == small]:
                to_unmap = []
                for b in list(fl.blocks):
                    if b.es is not None:
                        to_unmap.append(b)
                    elif b.prev is None and b.next is None:
                        self._release_block(b)
                for b in to_unmap:
                    self._unmap_block(b)
                    if b.state == UNMAPPED and b.prev is None and b.next is None:  # release_expandable_segment
                        fl.remove_unmapped(b)
                        self.segments -= 1
                        self.free_bases.append(b.es.base)

    def _release_block(self, b: Block) -> None:
        """release_block: cudaFree a cached block that is a whole segment."""
        b.fl.remove(b)
        self.unsplit_free -= b.size
        self.segments -= 1
        self._shrink(b.size)
