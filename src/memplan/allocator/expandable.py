"""expandable_segments:True: one segment per stream and pool, mapped in pages (ExpandableSegment and the
DeviceCachingAllocator methods that use it in c10/cuda/CUDACachingAllocator.cpp)."""

from __future__ import annotations

from .blocks import ALLOCATED, EXPANDABLE_VA_BYTES, FREE, UNMAPPED, Block, ExpSeg, FreeList
from .config import SMALL_BUFFER_BYTES


class ExpandableSegments:
    """The expandable-segment half of the replay (mixed into sim._Replay, whose state it uses)."""

    def _try_allocate_expandable_block(self, fl: FreeList, size: int) -> Block | None:
        """try_allocate_expandable_block: find address room (find_expandable_block), map pages until it fits."""
        c = self._find_expandable_block(fl, size)
        if c.state == UNMAPPED and not self._map_block(c, min(c.size, size)):
            return None
        while c.size < size:
            nc = c.next  # invariant: free -> unmapped -> ...
            if not self._map_block(nc, min(size - c.size, nc.size)):
                return None
            c = nc
        fl.remove(c)
        return c

    def _find_expandable_block(self, fl: FreeList, size: int) -> Block:
        """find_expandable_block: the lowest-addressed unmapped range (with the free block before it) with room."""
        for c in fl.ublocks:
            if c.prev is not None and c.prev.state == FREE:
                c = c.prev
            room, b = 0, c
            while room < size and b is not None and b.state != ALLOCATED:
                room += b.size
                b = b.next
            if room >= size:
                return c
        page = SMALL_BUFFER_BYTES if fl.small else self.cfg.large_segment_size_bytes
        if self.free_bases:
            base = self.free_bases.pop()
        else:
            base = self.next_addr
            self.next_addr += EXPANDABLE_VA_BYTES
        c = Block(base, EXPANDABLE_VA_BYTES, UNMAPPED, fl, ExpSeg(base, page))
        fl.insert_unmapped(c)
        self.segments += 1
        return c

    def _map_block(self, b: Block, size: int) -> bool:
        """map_block: map the pages covering [b.addr, b.addr + size); split off the rest; merge with free neighbours."""
        es, fl = b.es, b.fl
        off = b.addr - es.base
        mapped = (-(-(off + size) // es.page) - off // es.page) * es.page  # ExpandableSegment::map: whole pages
        if self.card is not None and self.reserved + mapped > self.card:
            return False  # cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY
        fl.remove_unmapped(b)
        b.state = FREE
        if mapped < b.size:
            rest = Block(b.addr + mapped, b.size - mapped, UNMAPPED, fl, es)
            rest.prev, rest.next = b, b.next
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            fl.insert_unmapped(rest)
            b.size = mapped
        self._merge(b, b.prev)
        self._merge(b, b.next)
        fl.insert(b)
        self._grow(mapped)
        return True

    def _merge(self, dst: Block, src: Block | None) -> None:
        """try_merge_blocks: dst absorbs src when src is unallocated and equally mapped."""
        if src is None or src.state == ALLOCATED or src.state != dst.state:
            return
        if src.state == FREE:
            src.fl.remove(src)
        else:
            src.fl.remove_unmapped(src)
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if src.prev is not None:
                src.prev.next = dst
        else:
            dst.next = src.next
            if src.next is not None:
                src.next.prev = dst
        dst.size += src.size

    def _unmap_block(self, b: Block) -> None:
        """unmap_block: unmap the whole free pages inside a cached expandable block; the partial ends stay cached."""
        es, fl = b.es, b.fl
        off = b.addr - es.base
        begin, end = -(-off // es.page), (off + b.size) // es.page
        if begin >= end:
            return
        fl.remove(b)
        before = begin * es.page - off
        after = b.size - before - (end - begin) * es.page
        if before > 0:
            bf = Block(b.addr, before, FREE, fl, es)
            bf.prev, bf.next = b.prev, b
            if b.prev is not None:
                b.prev.next = bf
            b.prev = bf
            fl.insert(bf)
        if after > 0:
            af = Block(es.base + end * es.page, after, FREE, fl, es)
            af.prev, af.next = b, b.next
            if b.next is not None:
                b.next.prev = af
            b.next = af
            fl.insert(af)
        b.addr = es.base + begin * es.page
        b.size = (end - begin) * es.page
        b.state = UNMAPPED
        self._merge(b, b.prev)
        self._merge(b, b.next)
        fl.insert_unmapped(b)
        self._shrink((end - begin) * es.page)

    # -- driving a ledger ------------------------------------------------------------------------------------
