"""Where an engine's tensors live: the GPU ledger, the host ledger of the same rank, and the copies between them.

DeepSpeed's offload paths keep tensors in host memory — pageable (torch's CPU allocator) or pinned
(``get_accelerator().pin_memory(t)``: on CUDA ``t.pin_memory()``, a new page-locked copy from torch's
CachingHostAllocator, the pageable original dying when the caller rebinds the name) — and copy them to the GPU
(``t.to(device)``: a new GPU tensor) and back (``dst.copy_(src)``: no new tensor). ``Places`` records each side in
its own Ledger: the GPU one is the estimate; the host one gives the rank's host memory (``host_peak_bytes``).

A CPU run (DS_ACCELERATOR=cpu, what tools/deepspeed_cpu_trace.py records) has one memory: host and device are the
same ledger, ``pin_memory`` returns its argument (deepspeed/accelerator/cpu_accelerator.py pin_memory) and
``t.to(device)`` of a host tensor is the tensor itself. With ``cpu_run`` the engines emit exactly the allocations such
a run makes, so they compare event by event with its trace (memplan.estimator.engine_check).

Host caching (aten/src/ATen/core/CachingHostAllocator.h, allocate): a pinned request is rounded up to a power of two
and a freed pinned block stays cached for a later request of the same size; pageable memory goes back to the
system when freed.
"""

from __future__ import annotations

from ..ledger import Ledger
from .timing import HOST_LINK

#: ledger component of host tensors; a pinned one's component carries the PINNED prefix
HOST = "host"
PINNED = "pinned "


def pinned_block_bytes(nbytes: int) -> int:
    """CachingHostAllocator's block for a pinned request: the next power of two (c10::llvm::PowerOf2Ceil)."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


class Places:
    """The GPU ledger, the host ledger and the copies between them (see the module docstring)."""

    def __init__(self, dev: Ledger, host: Ledger | None = None, cpu_run: bool = False):
        self.dev = dev
        self.cpu_run = cpu_run
        self.host = dev if cpu_run else (host if host is not None else Ledger())

    def host_alloc(self, name: str, nbytes: int, component: str = HOST) -> int:
        """A pageable host tensor (torch.empty / zeros / .to("cpu") / clone on the host)."""
        return self.host.alloc(name, nbytes, component)

    def pin(self, tid: int, pin_memory: bool = True) -> int:
        """``get_accelerator().pin_memory(t)`` and the caller rebinding its name: a pinned copy, the pageable
        original freed (CUDA); the tensor itself on the CPU accelerator or when pin_memory is off."""
        if self.cpu_run or not pin_memory:
            return tid
        h = self.host
        new = h.alloc(h.names[tid], h.sizes[tid], PINNED + h.components[tid])
        h.free(tid)
        return new

    def host_zeros(self, name: str, nbytes: int, pin_memory: bool, component: str = HOST) -> int:
        """``pin_memory(torch.zeros(n, device="cpu"))`` (or the pageable tensor itself without pin_memory)."""
        return self.pin(self.host_alloc(name, nbytes, component), pin_memory)

    def to_device(self, name: str, nbytes: int, component: str, stream: int = 0, blocking: bool = True
                  ) -> int | None:
        """``t.to(device)`` of a host tensor: a new GPU tensor (None on the CPU accelerator, where it is ``t``), and
        its copy over the host link on ``stream``, which the host waits for unless ``non_blocking`` (``blocking``
        False): copy_ with non_blocking=False synchronizes the stream after cudaMemcpyAsync (timing.HOST_LINK)."""
        if self.cpu_run:
            return None
        tid = self.dev.alloc(name, nbytes, component, stream)
        copy = self.dev.work(0.0, 0.0, nbytes, HOST_LINK, stream)
        if blocking:
            self.dev.wait(copy)
        return tid

    def free_dev(self, tid: int | None) -> None:
        if tid is not None:
            self.dev.free(tid)

    def free_host(self, tid: int | None) -> None:
        if tid is not None:
            self.host.free(tid)


def host_peak_bytes(host: Ledger) -> int:
    """Peak bytes of a host ledger: pageable tensors while alive, pinned ones (component prefixed PINNED) at their
    power-of-two block, kept by the host cache once freed until a request of the same block size takes them."""
    live = cached = peak = 0
    free_blocks: dict[int, int] = {}  # block bytes → cached free blocks of that size
    for ev in host.events:
        tid = ev if ev >= 0 else ~ev
        pinned = host.components[tid].startswith(PINNED)
        size = pinned_block_bytes(host.sizes[tid]) if pinned else host.sizes[tid]
        if ev >= 0:
            if pinned and free_blocks.get(size):
                free_blocks[size] -= 1
                cached -= size
            live += size
            peak = max(peak, live + cached)
        else:
            live -= size
            if pinned:
                free_blocks[size] = free_blocks.get(size, 0) + 1
                cached += size
    return peak
