"""An optimizer parameter group flattened into one 16-bit buffer and partitioned over the ZeRO group, as DeepSpeed
0.19.8's DeepSpeedZeroOptimizer and BF16_Optimizer lay it out (runtime/zero/stage_1_and_2.py __init__:
flatten_dense_tensors_aligned, get_data_parallel_partitions): which slice of which parameter each rank holds."""

from __future__ import annotations

from dataclasses import dataclass, field

#: ZeRO-1/2 pad the flat 16-bit buffer to nccl_start_alignment_factor (2) × N elements
#: (stage_1_and_2.py, DeepSpeedZeroOptimizer.__init__: alignment = nccl_start_alignment_factor * world)
NCCL_START_ALIGNMENT_FACTOR = 2


@dataclass
class FlatGroup:
    """One optimizer parameter group flattened and partitioned over N ranks, seen from rank ``rank``."""

    names: list[str]
    numels: list[int]
    n: int
    rank: int
    padded: int = 0
    partition: int = 0
    offsets: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        total = sum(self.numels)
        align = NCCL_START_ALIGNMENT_FACTOR * self.n
        self.padded = -(-total // align) * align
        self.partition = self.padded // self.n
        off = 0
        for x in self.numels:
            self.offsets.append(off)
            off += x

    def overlap(self, i: int, rank: int | None = None) -> int:
        """Elements of parameter i inside ``rank``'s partition (this rank by default)."""
        r = self.rank if rank is None else rank
        lo, hi = r * self.partition, (r + 1) * self.partition
        a, z = self.offsets[i], self.offsets[i] + self.numels[i]
        return max(0, min(z, hi) - max(a, lo))

    def slices(self, i: int) -> list[tuple[int, int]]:
        """(destination rank, elements) of parameter i cut at partition boundaries, in order."""
        a, z = self.offsets[i], self.offsets[i] + self.numels[i]
        out = []
        while a < z:
            r = min(a // self.partition, self.n - 1)
            end = min(z, (r + 1) * self.partition)
            out.append((r, end - a))
            a = end
        return out

    def in_partition(self, i: int) -> bool:
        return self.overlap(i) > 0

    def partition_pieces(self) -> int:
        """Tensors get_flat_partition lists for this rank's partition: one per parameter it overlaps, and a zero
        pad when they do not fill it (stage_1_and_2.py _get_flat_partition_unpadded)."""
        overlaps = [self.overlap(i) for i in range(len(self.numels))]
        pieces = sum(1 for n in overlaps if n)
        return pieces + (sum(overlaps) < self.partition)
