"""The caching allocator's settings (``PYTORCH_CUDA_ALLOC_CONF``) and its fixed sizes.

Every constant cites the function of torch's ``c10/cuda/CUDACachingAllocator.cpp`` (or
``c10/core/AllocatorConfig.{h,cpp}``, ``c10/cuda/CUDAAllocatorConfig.cpp``) that uses it; the version read is
named in docs/allocator.md. A frozen dataclass rather than a pydantic model: importing memplan.allocator must
stay cheap (memplan estimate has a 0.15 s start-up budget), and the fields are few and checked by hand here.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 2**20

#: round_size: every request is rounded up to a multiple of 512 bytes (kMinBlockSize)
MIN_BLOCK_BYTES = 512
#: get_pool: a rounded request of at most 1 MiB goes to the small pool (kSmallSize); should_split: a large-pool
#: block is split only when the remainder exceeds it
SMALL_SIZE_BYTES = 1 * MiB
#: get_allocation_size: small-pool segments are 2 MiB (kSmallBuffer); find_expandable_block: the small pool's
#: expandable-segment page
SMALL_BUFFER_BYTES = 2 * MiB
#: get_allocation_size: requests under 10 MiB (kMinLargeAlloc) get a large_segment_size segment
MIN_LARGE_ALLOC_BYTES = 10 * MiB
#: get_allocation_size: larger requests get a segment of their size rounded up to 2 MiB (kRoundLarge)
ROUND_LARGE_BYTES = 2 * MiB
#: AcceleratorAllocatorConfig::large_segment_size default (kLargeBuffer, 20 MiB): the segment of a 1–10 MiB
#: request (get_allocation_size), the large pool's expandable page (find_expandable_block), the default of
#: max_non_split_rounding (get_free_block) and the smallest max_split_size_mb (parseMaxSplitSize)
LARGE_BUFFER_BYTES = 20 * MiB

#: AcceleratorAllocatorConfig::roundup_power2_divisions: 16 intervals, one per power of two from 1 MiB
#: (sizes below 2 MiB share the first) to 32 GiB and above (the last)
ROUNDUP_INTERVALS = 16
ROUNDUP_FIRST_LOG2 = 20

#: keys torch's parsers accept that change nothing the simulator models (host pinned memory, locking, CUDA
#: graph capture reuse): accepted and ignored (CUDAAllocatorConfig::getKeys, AcceleratorAllocatorConfig::getKeys)
_IGNORED_KEYS = {
    "release_lock_on_cudamalloc": "bool",
    "release_lock_on_hipmalloc": "bool",
    "pinned_use_cuda_host_register": "bool",
    "pinned_use_hip_host_register": "bool",
    "pinned_use_background_threads": "bool",
    "pinned_num_register_threads": "pow2",
    "pinned_reserve_segment_size_mb": "int",
    "graph_capture_record_stream_reuse": "bool",
}
#: keys torch accepts whose effect is not modelled: refused with the reason
_MODELLED_KEYS = ("expandable_segments", "max_split_size_mb", "max_non_split_rounding_mb", "roundup_power2_divisions",
                  "large_segment_size_mb", "backend", "garbage_collection_threshold", "per_process_memory_fraction")


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocatorConfig:
    """What the simulated allocator does; defaults are torch's with ``PYTORCH_CUDA_ALLOC_CONF`` unset."""

    #: expandable_segments:True: one growing segment per stream and pool, mapped in pages
    expandable_segments: bool = False
    #: max_split_size_mb in bytes: blocks this big or bigger are never split (None: unlimited, torch's SIZE_MAX)
    max_split_size_bytes: int | None = None
    #: max_non_split_rounding_mb in bytes: how much bigger than an oversize request a cached oversize block may be
    #: (get_free_block); None: large_segment_size_bytes
    max_non_split_rounding_bytes: int | None = None
    #: roundup_power2_divisions: one number for all sizes, or 16 per-interval numbers (0 or 1 = off)
    roundup_power2_divisions: int | tuple[int, ...] | None = None
    #: large_segment_size_mb in bytes (kLargeBuffer by default)
    large_segment_size_bytes: int = LARGE_BUFFER_BYTES
    #: bytes the allocator may take from the card: cudaMalloc (or mapping a page) fails past it
    card_bytes: int | None = None
    #: torch.cuda.set_per_process_memory_fraction(f) (per_process_memory_fraction:f), as f × the card's total
    #: memory: alloc_block refuses a new segment when reserved + its get_allocation_size would pass it, before
    #: asking the card (DeviceCachingAllocator::setMemoryFraction, alloc_block)
    allowed_bytes: int | None = None
    #: garbage_collection_threshold: with allowed_bytes set, a malloc that finds no cached block first frees the
    #: oldest whole cached large-pool segments while reserved is above threshold × allowed_bytes
    #: (garbage_collect_cached_blocks); torch ignores it without a memory fraction
    garbage_collection_threshold: float | None = None

    def __post_init__(self) -> None:
        if self.large_segment_size_bytes <= MIN_LARGE_ALLOC_BYTES or self.large_segment_size_bytes % MiB:
            raise ValueError(f"large_segment_size_bytes ({self.large_segment_size_bytes}) must be a whole number "
                             f"of MiB above {MIN_LARGE_ALLOC_BYTES // MiB} MiB (parseLargeSegmentSize)")
        for name in ("max_split_size_bytes", "max_non_split_rounding_bytes"):
            v = getattr(self, name)
            if v is not None and (v < self.large_segment_size_bytes or v % MiB):
                raise ValueError(f"{name} ({v}) must be a whole number of MiB and at least large_segment_size_bytes "
                                 f"({self.large_segment_size_bytes}) (parseMaxSplitSize)")
        d = self.roundup_power2_divisions
        if d is not None:
            table = (d,) * ROUNDUP_INTERVALS if isinstance(d, int) else tuple(d)
            if len(table) != ROUNDUP_INTERVALS or any(x != 0 and not _pow2(x) for x in table):
                raise ValueError(f"roundup_power2_divisions ({d!r}) must be a power of 2 (or 0), or {ROUNDUP_INTERVALS} "
                                 "of them, one per power-of-two interval from 1 MiB (parseRoundUpPower2Divisions)")
        for name in ("card_bytes", "allowed_bytes"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"{name} ({v}) must be positive")
        g = self.garbage_collection_threshold
        if g is not None and not 0.0 < g < 1.0:
            raise ValueError(f"garbage_collection_threshold ({g}) must be in (0.0, 1.0) (parseGarbageCollectionThreshold)")

    @property
    def divisions_table(self) -> tuple[int, ...] | None:
        """The 16 per-interval divisions (AcceleratorAllocatorConfig::roundup_power2_divisions), None when all off."""
        d = self.roundup_power2_divisions
        if d is None:
            return None
        table = (d,) * ROUNDUP_INTERVALS if isinstance(d, int) else tuple(d)
        return table if any(x > 1 for x in table) else None

    @property
    def non_split_rounding_bytes(self) -> int:
        """max_non_split_rounding_size: defaults to large_segment_size (AcceleratorAllocatorConfig::parseArgs)."""
        v = self.max_non_split_rounding_bytes
        return self.large_segment_size_bytes if v is None else v

    @classmethod
    def from_alloc_conf(cls, text: str, *, card_bytes: int | None = None,
                        total_memory_bytes: int | None = None) -> AllocatorConfig:
        """Parse ``PYTORCH_CUDA_ALLOC_CONF`` syntax, e.g. ``"expandable_segments:True,max_split_size_mb:128"``.

        Follows ConfigTokenizer and AcceleratorAllocatorConfig::parseArgs / CUDAAllocatorConfig::parseArgs: tokens
        are split at ``, : [ ]``, whitespace is dropped, booleans are exactly ``True``/``False``. Raises ValueError
        naming the key and what is allowed for anything torch rejects or that the simulator does not model.
        ``total_memory_bytes`` (the card's totalGlobalMem) is needed to read ``per_process_memory_fraction``.
        """
        fields = parse_alloc_conf(text)
        fraction = fields.pop("per_process_memory_fraction", None)
        if fraction is not None and fraction < 1.0:
            if total_memory_bytes is None:
                raise ValueError("PYTORCH_CUDA_ALLOC_CONF: per_process_memory_fraction needs the card's total memory: "
                                 "pass total_memory_bytes")
            fields["allowed_bytes"] = int(fraction * total_memory_bytes)  # setMemoryFraction: size_t(f * total)
        return cls(card_bytes=card_bytes, **fields)


def _tokens(text: str) -> list[str]:
    """ConfigTokenizer: keys, values and the separators ``, : [ ]`` as tokens; whitespace ignored."""
    out: list[str] = []
    buf = ""
    for ch in text:
        if ch in ",:[]":
            if buf:
                out.append(buf)
                buf = ""
            out.append(ch)
        elif not ch.isspace():
            buf += ch
    if buf:
        out.append(buf)
    return out


def _int(key: str, tok: str) -> int:
    if not tok.isdigit():
        raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {key} needs a non-negative integer, got {tok!r}")
    return int(tok)


def _bool(key: str, tok: str) -> bool:
    if tok not in ("True", "False"):
        raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {key} needs True or False (ConfigTokenizer::toBool), got {tok!r}")
    return tok == "True"


def _divisions(key: str, toks: list[str]) -> tuple[int, ...]:
    """parseRoundUpPower2Divisions: ``N`` or ``[64:8,256:4,>:1]`` (interval starts in MiB, powers of 2)."""
    if toks[0] != "[":
        n = _int(key, toks[0])
        if not _pow2(n):
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {key} must be a power of 2, got {n}")
        return (n,) * ROUNDUP_INTERVALS
    table = [0] * ROUNDUP_INTERVALS
    first, last, j = True, 0, 1
    while j < len(toks) and toks[j] != "]":
        bound = toks[j]
        if j + 2 >= len(toks) or toks[j + 1] != ":":
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {key} list entries are BOUND_MB:DIVISIONS, got {toks!r}")
        value = _int(key, toks[j + 2])
        if value and not _pow2(value):
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {key} divisions must be a power of 2 or 0, got {value}")
        if bound == ">":
            table[last + 1:] = [value] * (ROUNDUP_INTERVALS - last - 1)
        else:
            b = _int(key, bound)
            if not _pow2(b):
                raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {key} interval bounds must be powers of 2, got {b}")
            index = min(b.bit_length() - 1, ROUNDUP_INTERVALS - 1)
            if first:
                table[:index] = [value] * index
                first = False
            table[index] = value
            last = index
        j += 3
        if j < len(toks) and toks[j] == ",":
            j += 1
    if j >= len(toks):
        raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {key} list has no closing ']'")
    return tuple(table)


def _values(toks: list[str], i: int, key: str) -> tuple[list[str], int]:
    """The value tokens after ``key:`` at toks[i], and the index of the last one (ConfigTokenizer::skipKey)."""
    if i + 2 >= len(toks) or toks[i + 1] != ":":
        raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: expected '{key}:VALUE'")
    j = i + 2
    if toks[j] != "[":
        return [toks[j]], j
    k = j
    while k < len(toks) and toks[k] != "]":
        k += 1
    return toks[j:k + 1], min(k, len(toks) - 1)


def parse_alloc_conf(text: str) -> dict:
    """The AllocatorConfig fields a ``PYTORCH_CUDA_ALLOC_CONF`` string sets (see AllocatorConfig.from_alloc_conf)."""
    toks = _tokens(text)
    fields: dict = {}
    raw: dict[str, list[str]] = {}
    i = 0
    while i < len(toks):
        key = toks[i]
        if key in ",:[]":
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: unexpected {key!r} in {text!r}")
        values, i = _values(toks, i, key)
        raw[key] = values
        i += 1
        if i < len(toks):
            if toks[i] != ",":
                raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: expected ',' after {key}, got {toks[i]!r}")
            i += 1
    # large_segment_size_mb is read first: the split-size minimums depend on it (AcceleratorAllocatorConfig::parseArgs)
    large = LARGE_BUFFER_BYTES
    if "large_segment_size_mb" in raw:
        mb = _int("large_segment_size_mb", raw["large_segment_size_mb"][0])
        if mb <= MIN_LARGE_ALLOC_BYTES // MiB:
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: large_segment_size_mb must be > {MIN_LARGE_ALLOC_BYTES // MiB}, "
                             f"got {mb} (parseLargeSegmentSize)")
        large = fields["large_segment_size_bytes"] = mb * MiB
    for key, values in raw.items():
        tok = values[0]
        if key == "large_segment_size_mb":
            continue
        if key == "expandable_segments":
            fields["expandable_segments"] = _bool(key, tok)
        elif key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            mb = _int(key, tok)
            if mb * MiB < large:
                raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {key} too small, must be >= {large // MiB} "
                                 f"(parseMaxSplitSize), got {mb}")
            name = "max_split_size_bytes" if key == "max_split_size_mb" else "max_non_split_rounding_bytes"
            fields[name] = mb * MiB
        elif key == "roundup_power2_divisions":
            fields["roundup_power2_divisions"] = _divisions(key, values)
        elif key == "backend":
            if tok == "native":
                continue
            if tok in ("cudaMallocAsync", "hipMallocAsync"):
                raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: backend:{tok} is not modelled (only backend:native)")
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: unknown allocator backend {tok!r}; options are native, "
                             "cudaMallocAsync and hipMallocAsync (CUDAAllocatorConfig::parseAllocatorConfig)")
        elif key in ("garbage_collection_threshold", "per_process_memory_fraction"):
            try:
                v = float(tok)
            except ValueError:
                raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {key} needs a number, got {tok!r}") from None
            low_open = key == "garbage_collection_threshold"  # (0, 1) for it, [0, 1] for the fraction
            if not ((0.0 < v < 1.0) if low_open else (0.0 <= v <= 1.0)):
                raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {key} must be in {'(0.0, 1.0)' if low_open else '[0, 1]'}, "
                                 f"got {v}")
            fields[key] = v
        elif key in _IGNORED_KEYS:
            kind = _IGNORED_KEYS[key]
            if kind == "bool":
                _bool(key, tok)
            elif kind == "pow2" and not _pow2(_int(key, tok)):
                raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {key} must be a power of 2, got {tok}")
            elif kind == "int":
                _int(key, tok)
        else:
            allowed = ", ".join(sorted((*_MODELLED_KEYS, *_IGNORED_KEYS)))
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: unrecognized key {key!r}; torch accepts {allowed} "
                             "(CUDAAllocatorConfig::parseArgs)")
    return fields
