"""The allocation ledger: the ordered CUDA allocation events of one rank, the estimator's product.

Every tensor or buffer the job allocates on the GPU is one entry: its name, the bytes requested (numel ×
element size, before the caching allocator's rounding), the component it belongs to (``params_16bit``,
``activations``, ``grad_bucket`` …), and the stream it is allocated on when that is not the default one
(ZeRO's reduce and all-gather streams). Events are its allocation and its free, in the order torch,
DeepSpeed and transformers issue them; marks name the phase that starts at an event ("step1.micro0.forward",
"backward, layer 3") and the points where ``torch.cuda.empty_cache()`` runs. Peak allocated, the breakdown at
the peak, the phases and the timeline are queries over it (this module); the caching allocator replays it for
reserved memory (memplan.allocator). Measured traces (memplan.allocator.trace) are converted into the same
structure, so predicted and measured compare event by event.

Storage is columnar for speed (a 96-layer job is tens of thousands of events): tensor ``i`` is
``names[i]``, ``sizes[i]``, ``components[i]``, ``streams[i]``; ``events`` holds ``i`` for its allocation and
``~i`` (negative) for its free. ``stream_used`` maps the tensors another stream used (``Tensor.record_stream``) to
that stream: the caching allocator reuses their blocks only once that stream has passed the use, so their frees
complete when the GPU catches up, not when Python drops them (memplan.estimator.gpu_time).

Work records say when that is: record ``k`` sits before ``events[work_at[k]]`` and is what the host did there —
``work_cpu_s[k]`` seconds of Python and dispatch, then kernels of ``work_flops[k]`` operations and
``work_bytes[k]`` bytes of memory traffic of kind ``work_kernel[k]`` (memplan.estimator.timing) queued on stream
``work_stream[k]`` — or, where ``work_wait[k]`` is not NO_WAIT, a wait for record ``work_wait[k]``'s kernels (or,
SYNC, for everything queued): by the host (an event's synchronize, torch.cuda.synchronize) or, with kernel kind
STREAM_WAIT, by the compute stream (``stream.wait_stream``, ``wait_event``). The ledger keeps operations and bytes,
not seconds: the GPU they run on is the timing pass's input. Pure: no torch, no numpy.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

#: the caching allocator's request granularity (c10/cuda/CUDACachingAllocator.cpp, kMinBlockSize):
#: torch.cuda.memory_allocated counts each block at its size rounded up to a multiple of this
MIN_BLOCK_BYTES = 512

#: mark kinds
PHASE = "phase"
EMPTY_CACHE = "empty_cache"

#: Ledger.work_wait values: no wait (a work record), or a wait for the whole GPU (torch.cuda.synchronize,
#: ``tensor.item()``); a value >= 0 waits for that work record's kernels (``event.synchronize()``)
NO_WAIT, SYNC = -1, -2
#: Ledger.work_kernel of a wait record: the host waits (HOST_WAIT) or the compute stream does (STREAM_WAIT)
HOST_WAIT, STREAM_WAIT = -1, -2


def block_bytes(nbytes: int) -> int:
    """What the allocator counts for a request of ``nbytes``: rounded up to 512 bytes (0 stays 0)."""
    if nbytes <= 0:
        return 0
    return -(-nbytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES


@dataclass(frozen=True, slots=True)
class Mark:
    """A label at an event index: a phase that begins there, or an empty_cache() before that event."""

    at: int  # index into Ledger.events of the first event after the mark
    label: str
    kind: str = PHASE


class Ledger:
    """Ordered allocation events of one rank (see the module docstring)."""

    __slots__ = ("_live", "components", "events", "marks", "names", "sizes", "stream_used", "streams", "work_at",
                 "mark_work", "work_bytes", "work_cpu_s", "work_flops", "work_kernel", "work_stream", "work_wait")

    def __init__(self) -> None:
        self.names: list[str] = []
        self.sizes: list[int] = []
        self.components: list[str] = []
        self.streams: list[int] = []
        self.events: list[int] = []
        self.marks: list[Mark] = []
        self.stream_used: dict[int, int] = {}
        self.work_at: list[int] = []
        self.work_cpu_s: list[float] = []
        self.work_flops: list[float] = []
        self.work_bytes: list[int] = []
        self.work_kernel: list[int] = []
        self.work_stream: list[int] = []
        self.work_wait: list[int] = []
        #: per mark, the number of work records made before it (a mark and records at one event index keep their
        #: order)
        self.mark_work: list[int] = []
        self._live: set[int] = set()

    # -- building -------------------------------------------------------------------------------------
    def alloc(self, name: str, nbytes: int, component: str, stream: int = 0) -> int:
        """Allocate one tensor of ``nbytes`` requested bytes; returns its id (pass it to ``free``)."""
        tid = len(self.sizes)
        self.names.append(name)
        self.sizes.append(int(nbytes))
        self.components.append(component)
        self.streams.append(stream)
        self.events.append(tid)
        self._live.add(tid)
        return tid

    def free(self, tid: int) -> None:
        """Free tensor ``tid`` (allocated earlier, not freed yet)."""
        self._live.remove(tid)
        self.events.append(~tid)

    def record_stream(self, tid: int, stream: int) -> None:
        """``tensor.record_stream(stream)`` on tensor ``tid``: once freed, its block is reused only after
        ``stream`` has passed this point (CUDACachingAllocator's recordStream, insert_events, process_events); a
        use on the stream it was allocated on is ignored there, and here."""
        if stream != self.streams[tid]:
            self.stream_used[tid] = stream

    def work(self, cpu_s: float, flops: float = 0.0, nbytes: int = 0, kernel: int = 0, stream: int = 0) -> int:
        """The host spends ``cpu_s`` here, then queues kernels of ``flops`` operations and ``nbytes`` bytes of
        memory traffic of ``kernel`` kind (timing.MEMORY, GEMM …) on ``stream``; returns the record's index (a
        point on that stream's queue that ``wait`` can name: an event recorded after its kernels)."""
        return self._record(cpu_s, flops, nbytes, kernel, NO_WAIT, stream)

    def wait(self, record: int, cpu_s: float = 0.0) -> None:
        """The host waits until work record ``record``'s kernels have run (``event.synchronize()`` on an event
        recorded after them); ``record`` SYNC waits for everything queued (``torch.cuda.synchronize()``)."""
        self._record(cpu_s, 0.0, 0, HOST_WAIT, record, 0)

    def stream_wait(self, record: int, stream: int = 0) -> None:
        """``stream`` (default the compute stream) runs nothing queued after this until work record ``record`` (on
        another stream) has run (``stream.wait_stream(other)``); the host does not wait."""
        self._record(0.0, 0.0, 0, STREAM_WAIT, record, stream)

    def _record(self, cpu_s: float, flops: float, nbytes: int, kernel: int, wait: int, stream: int) -> int:
        self.work_at.append(len(self.events))
        self.work_cpu_s.append(cpu_s)
        self.work_flops.append(flops)
        self.work_bytes.append(nbytes)
        self.work_kernel.append(kernel)
        self.work_stream.append(stream)
        self.work_wait.append(wait)
        return len(self.work_at) - 1

    def mark(self, label: str, kind: str = PHASE) -> None:
        """Label what follows: a phase's start, or (kind EMPTY_CACHE) torch.cuda.empty_cache()."""
        self.marks.append(Mark(len(self.events), label, kind))
        self.mark_work.append(len(self.work_at))

    def live(self) -> frozenset[int]:
        """Ids of the tensors allocated and not yet freed, at the end of the ledger so far."""
        return frozenset(self._live)

    def reordered(self, events: list[int], marks: list[Mark]) -> Ledger:
        """A ledger of the same tensors with ``events`` in another order and ``marks`` at their new places (the
        caching allocator's view of deferred frees: memplan.estimator.gpu_time, gpu_behind); no work records."""
        out = Ledger()
        out.names, out.sizes, out.components, out.streams = self.names, self.sizes, self.components, self.streams
        out.events, out.marks = events, marks
        return out

    # -- queries --------------------------------------------------------------------------------------
    def deltas(self) -> Iterator[int]:
        """The change of allocated bytes (512-rounded) at each event."""
        sizes = self.sizes
        for ev in self.events:
            yield block_bytes(sizes[ev]) if ev >= 0 else -block_bytes(sizes[~ev])

    def peak(self, start: int = 0, stop: int | None = None, base: int | None = None) -> tuple[int, int]:
        """(peak allocated bytes, index of the event that reaches it) over events[start:stop].

        ``base``: allocated bytes before ``start`` (computed when not given). The index is -1 when the peak
        is the base itself (nothing in the range exceeds what was live at its start)."""
        sizes, events = self.sizes, self.events
        cur = self.allocated_at(start) if base is None else base
        best, at = cur, -1
        for i in range(start, len(events) if stop is None else stop):
            ev = events[i]
            if ev >= 0:
                cur += block_bytes(sizes[ev])
                if cur > best:
                    best, at = cur, i
            else:
                cur -= block_bytes(sizes[~ev])
        return best, at

    def allocated_at(self, index: int) -> int:
        """Allocated bytes just before events[index]."""
        sizes = self.sizes
        total = 0
        for ev in self.events[:index]:
            total += block_bytes(sizes[ev]) if ev >= 0 else -block_bytes(sizes[~ev])
        return total

    def live_at(self, index: int) -> list[int]:
        """Ids of the tensors alive just after events[index] (in allocation order)."""
        alive: dict[int, None] = {}
        for ev in self.events[: index + 1]:
            if ev >= 0:
                alive[ev] = None
            else:
                del alive[~ev]
        return list(alive)

    def phase_peaks(self, kind: str = PHASE) -> list[tuple[str, int, int, int, int]]:
        """(label, start, stop, peak allocated bytes, index of the event that reaches it) of every phase, in
        one pass (the same counting as ``peak``; the index is start − 1 when nothing in the phase exceeds what
        was live at its start)."""
        sizes, events = self.sizes, self.events
        out = []
        cur = 0
        pos = 0
        for label, start, stop in self.phase_spans(kind):
            for i in range(pos, start):  # events before the first mark
                ev = events[i]
                cur += block_bytes(sizes[ev]) if ev >= 0 else -block_bytes(sizes[~ev])
            best, at = cur, start - 1
            for i in range(start, stop):
                ev = events[i]
                if ev >= 0:
                    cur += block_bytes(sizes[ev])
                    if cur > best:
                        best, at = cur, i
                else:
                    cur -= block_bytes(sizes[~ev])
            out.append((label, start, stop, best, at))
            pos = stop
        return out

    def live_sets(self, indices) -> dict[int, list[int]]:
        """{index: ids alive just after events[index]} for each of ``indices`` (one pass; -1 gives [])."""
        want = sorted(set(indices))
        out: dict[int, list[int]] = {i: [] for i in want if i < 0}
        want = [i for i in want if i >= 0]
        alive: dict[int, None] = {}
        k = 0
        for i, ev in enumerate(self.events):
            if k == len(want):
                break
            if ev >= 0:
                alive[ev] = None
            else:
                del alive[~ev]
            while k < len(want) and want[k] == i:
                out[i] = list(alive)
                k += 1
        return out

    def by_component(self, tids: list[int]) -> dict[str, int]:
        """512-rounded bytes of ``tids`` per component, in first-seen order."""
        out: dict[str, int] = {}
        for t in tids:
            c = self.components[t]
            out[c] = out.get(c, 0) + block_bytes(self.sizes[t])
        return out

    def phase_spans(self, kind: str = PHASE) -> list[tuple[str, int, int]]:
        """(label, start, stop) of each mark of ``kind``: from its event to the next such mark (or the end)."""
        marks = [m for m in self.marks if m.kind == kind]
        ends = [m.at for m in marks[1:]] + [len(self.events)]
        return [(m.label, m.at, end) for m, end in zip(marks, ends)]

    def __len__(self) -> int:
        return len(self.events)
