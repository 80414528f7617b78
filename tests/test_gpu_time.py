"""The timing replay (estimator.gpu_time): when the caching allocator completes each record_stream free, given
the host's and the GPU's clocks over the ledger's work records.

Toy ledgers worked by hand (units: 1 s of host or GPU time, 100 MiB blocks), the two limits of the replay (a GPU
infinitely fast is the plain ledger; one infinitely slow is estimator.gpu_behind's bound), and the ZeRO-3 ledger's
work records."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.allocator import simulate
from memplan.estimator.gpu_behind import gpu_behind
from memplan.estimator.gpu_time import LAUNCH_QUEUE, GpuRates, event_clocks, launch_lags, phase_seconds, timed
from memplan.estimator.program import build_ledger
from memplan.estimator.timing import FAKE_COLLECTIVE, FAKE_GATHER_COPY_S, MEMORY, attention_flops, gemm_flops
from memplan.ledger import SYNC, Ledger
from memplan.presets import load_model
from memplan.specs import Job
from memplan.units import MiB

SIDE = 2  # a side stream (ZeRO-3's all-gather stream in the estimator)
#: a GPU on which one byte of memory traffic takes a tenth of a second (memory-bound kernels only)
SLOW = GpuRates(gemm=1.0, gemm_fp32=1.0, attention=1.0, memory=10.0)


def _layers(kernel_s: float, n: int = 3) -> Ledger:
    """Phase a: n layers, each 0.5 s of the host's Python, then a 100 MiB weight gathered on the side stream, a
    kernel of ``kernel_s`` seconds (bytes on SLOW) on the compute stream, the weight freed with record_stream."""
    L = Ledger()
    L.mark("a")
    for i in range(n):
        L.work(0.5)
        w = L.alloc(f"layer{i}.weight (gathered)", 100 * MiB, "params_gathered", SIDE)
        L.work(0.0, 0.0, round(10 * kernel_s), MEMORY)
        L.record_stream(w, 0)
        L.free(w)
    L.mark("b")
    L.free(L.alloc("activation", 4 * MiB, "activations"))
    return L


def test_a_gpu_that_keeps_up_completes_each_free_before_the_next_gather():
    # each kernel (0.1 s) ends before the host gathers the next weight (0.5 s later): the plain ledger's order
    L = _layers(kernel_s=0.1)
    late = timed(L, SLOW)
    assert late.events == L.events
    assert simulate(late).peak_reserved_bytes == simulate(L).peak_reserved_bytes == 100 * MiB + 20 * MiB


def test_a_gpu_behind_keeps_every_gathered_weight_until_it_catches_up():
    # each kernel takes 10 s: at the host's gathers (t = 0.5, 1.0, 1.5) no kernel has ended, so no free has
    # completed; the three frees land at phase b's synchronization
    L = _layers(kernel_s=10)
    late = timed(L, SLOW)
    assert late.events == [0, 1, 2, ~0, ~1, ~2, 3, ~3]
    assert simulate(late).peak_reserved_bytes == 300 * MiB + 20 * MiB
    # the phase lasted until the GPU finished its 30 s of kernels, the first launched at t = 0.5 (the host needs
    # 1.5 s in all); each kernel also takes the launch floor
    assert dict(phase_seconds(L, SLOW))["a"] == pytest.approx(30.5, abs=1e-3)


def test_launch_lags_are_each_kernels_wait_on_the_gpu_after_its_launch():
    # kernels of 0.7 s launched at t = 0.5, 1.0, 1.5 (each also takes the 6.8 µs launch floor): the first starts
    # at once, the second at 1.2 (0.2 s after its launch), the third at 1.9 (0.4 s); phase b's one kernel-less
    # alloc launches nothing
    lags = launch_lags(_layers(kernel_s=0.7), SLOW)
    assert [label for label, _ in lags] == ["a", "a", "a"]
    assert [lag for _, lag in lags] == pytest.approx([0.0, 0.2, 0.4], abs=1e-4)
    # a GPU that keeps up never makes a kernel wait
    assert all(lag == 0.0 for _, lag in launch_lags(_layers(kernel_s=0.1), SLOW))


def _layers_emulated(kernel_s: float, fake_s: float) -> Ledger:
    """_layers with ``fake_s`` of the fake process group's copies on the host after each layer's kernel (the next
    layer's prefetched all-gather, as an emulated verify run makes it)."""
    L = Ledger()
    L.mark("a")
    for i in range(3):
        L.work(0.5)
        w = L.alloc(f"layer{i}.weight (gathered)", 100 * MiB, "params_gathered", SIDE)
        L.work(0.0, 0.0, round(10 * kernel_s), MEMORY)
        L.record_stream(w, 0)
        L.free(w)
        L.work(fake_s, 0.0, 0, FAKE_COLLECTIVE, SIDE)
    L.mark("b")
    L.free(L.alloc("activation", 4 * MiB, "activations"))
    return L


def test_the_fake_groups_copies_cost_the_host_only_in_an_emulated_run():
    # a real job: the copies do not exist, the 0.7 s kernels fall behind as in _layers
    L = _layers_emulated(kernel_s=0.7, fake_s=1.0)
    assert timed(L, SLOW).events == [0, 1, ~0, 2, ~1, ~2, 3, ~3]
    # emulated: the host gathers at 0.5, 2.0 and 3.5, and each 0.7 s kernel (launched at its gather) has ended by
    # the next one: every free completes before the next malloc; the phase ends with the host at 4.5
    assert timed(L, SLOW, emulated=True).events == L.events
    assert dict(phase_seconds(L, SLOW, emulated=True))["a"] == pytest.approx(4.5, abs=1e-3)


def test_an_emulated_zero3_gather_costs_the_host_a_copy_per_rank():
    # tiny ZeRO-3 jobs at world 8 and 64: the same gathers, each all_gather_into_tensor N copies in emulation
    from memplan.gpus import resolve_gpu

    rates = GpuRates.of(resolve_gpu("h200"))
    for world in (8, 64):
        job = _zero3(seq_len=512)
        L = build_ledger(job.model_copy(update={"layout": job.layout.model_copy(update={"world": world})}), steps=1)
        fake = [k for k, kind in enumerate(L.work_kernel) if kind == FAKE_COLLECTIVE]
        assert len(fake) > 10 and all(L.work_cpu_s[k] == pytest.approx(FAKE_GATHER_COPY_S * world) for k in fake)
        real, emulated = (sum(t for _, t in phase_seconds(L, rates, e)) for e in (False, True))
        # the host is the bottleneck of a 1B model's 512 tokens: the copies' seconds add to the phases
        assert emulated - real >= 0.9 * FAKE_GATHER_COPY_S * world * len(fake)


def test_a_free_completes_at_the_first_malloc_after_the_gpu_passes_it():
    # kernels of 0.7 s launched every 0.5 s from t = 0.5: layer 0's ends at 1.2, layer 1's at 1.9; the host gathers
    # layer 1 at t = 1.0 (layer 0's free still pending) and layer 2 at 1.5 (it has completed; layer 1's has not)
    L = _layers(kernel_s=0.7)
    late = timed(L, SLOW)
    assert late.events == [0, 1, ~0, 2, ~1, ~2, 3, ~3]


def test_a_host_wait_lets_the_gpu_catch_up():
    L = Ledger()
    L.mark("a")
    w = L.alloc("w0", 100 * MiB, "params_gathered", SIDE)
    k = L.work(0.0, 0.0, 100, MEMORY)
    L.record_stream(w, 0)
    L.free(w)
    L.wait(k)  # event.synchronize(): the host reaches t = 10 here
    L.free(L.alloc("w1", 100 * MiB, "params_gathered", SIDE))
    assert timed(L, SLOW).events == L.events
    L2 = Ledger()
    L2.mark("a")
    w = L2.alloc("w0", 100 * MiB, "params_gathered", SIDE)
    L2.work(0.0, 0.0, 100, MEMORY)
    L2.record_stream(w, 0)
    L2.free(w)
    L2.wait(SYNC)
    L2.free(L2.alloc("w1", 100 * MiB, "params_gathered", SIDE))
    assert timed(L2, SLOW).events == L2.events


def test_the_launch_queue_blocks_the_host():
    # LAUNCH_QUEUE + 1 kernels of 1 s each, launched at once: the last launch waits for the first kernel's end
    L = Ledger()
    L.mark("a")
    w = L.alloc("w0", 100 * MiB, "params_gathered", SIDE)
    for _ in range(LAUNCH_QUEUE):
        L.work(0.0, 0.0, 10, MEMORY)
    L.record_stream(w, 0)
    L.free(w)  # completes when the GPU has run the LAUNCH_QUEUE kernels: t = LAUNCH_QUEUE
    L.work(0.0, 0.0, 10, MEMORY)  # the queue is full: the host blocks until t = 1
    L.free(L.alloc("w1", 100 * MiB, "params_gathered", SIDE))
    late = timed(L, SLOW)
    assert late.events == [0, 1, ~1, ~0]  # t = 1 < LAUNCH_QUEUE: w0's free is still pending at w1's malloc


def test_ops_count_their_operations():
    # [1024, 512] @ [512, 256]ᵀ in bf16: 2·1024·512·256 operations from the three tensors' bytes
    assert gemm_flops(1024 * 512 * 2, 256 * 512 * 2, 1024 * 256 * 2, 2) == 2 * 1024 * 512 * 256
    # a batch of 8 products [64, 32] @ [32, 16]
    assert gemm_flops(8 * 64 * 32 * 4, 8 * 32 * 16 * 4, 8 * 64 * 16 * 4, 4, batch=8) == 2 * 8 * 64 * 32 * 16
    assert attention_flops(1, 2, 10, 10, 4, 4) == 2 * 2 * 10 * 10 * 8 / 2
    assert attention_flops(1, 2, 10, 20, 4, 4, causal=False) == 2 * 2 * 10 * 20 * 8


_SCRIPT = st.lists(st.tuples(st.sampled_from(("gather", "free", "kernel", "mark", "wait")), st.integers(1, 8),
                             st.integers(0, 20)), max_size=60)


def _scripted(script) -> Ledger:
    L = Ledger()
    L.mark("m0")
    live: list[int] = []
    records: list[int] = []
    for kind, mib, t in script:
        if kind == "gather":
            x = L.alloc("g", mib * MiB, "params_gathered", SIDE if t % 2 else 0)
            if t % 2:
                L.record_stream(x, 0)
            live.append(x)
        elif kind == "free" and live:
            x = live.pop(mib % len(live))
            if x in L.stream_used:  # a kernel used it: its free waits for that kernel
                L.work(0.0, 0.0, 1, MEMORY)
            L.free(x)
        elif kind == "kernel":
            records.append(L.work(0.01 * mib, 0.0, t, MEMORY))
        elif kind == "mark":
            L.mark(f"m{len(L.marks)}")
        elif kind == "wait" and records:
            L.wait(records[t % len(records)])
    return L


@settings(max_examples=80, deadline=None)
@given(_SCRIPT)
def test_the_replay_lies_between_a_gpu_that_keeps_up_and_one_a_phase_behind(script):
    L = _scripted(script)
    fast = timed(L, GpuRates(gemm=1e30, gemm_fp32=1e30, attention=1e30, memory=1e30))
    slow = timed(L, GpuRates(gemm=1e-30, gemm_fp32=1e-30, attention=1e-30, memory=1e-30))
    if fast is None:
        assert not L.stream_used and gpu_behind(L) is None
        return
    # every free kept, allocations in their order; a free only ever moves later
    mid = timed(L, SLOW)
    for late in (fast, slow, mid):
        assert sorted(late.events) == sorted(L.events)
        assert [e for e in late.events if e >= 0] == [e for e in L.events if e >= 0]
        assert [m.label for m in late.marks] == [m.label for m in L.marks]
    # an infinitely fast GPU (kernels of a few microseconds at most: timed's floor) frees at the next malloc
    # the host makes after the free, as the plain ledger does for allocations
    allocs = [e for e in L.events if e >= 0]
    assert [e for e in fast.events if e >= 0] == allocs
    # one infinitely slow completes nothing before a synchronization: estimator.gpu_behind's bound. A host wait
    # on a compute-stream event (``wait``) also completes what was queued before it, which gpu_behind, a bound,
    # does not count (hypothesis found: gather, free after a kernel, wait on a later record, gather)
    behind = gpu_behind(L)
    if not any(kind == "wait" for kind, _, _ in script):
        assert slow.events == behind.events and [m.at for m in slow.marks] == [m.at for m in behind.marks]
    assert simulate(slow).peak_reserved_bytes <= simulate(behind).peak_reserved_bytes


def _zero3(**training) -> Job:
    return Job(model=load_model("llama-3.2-1b"), layout={"world": 8},
               training={"seq_len": 4096, "zero": {"stage": 3}, **training})


def test_a_zero3_ledger_times_its_forward_and_backward():
    """Every forward op and backward node of a ZeRO-3 ledger carries a work record; each training phase takes
    time, and a slower GPU never finishes a phase sooner."""
    L = build_ledger(_zero3(), steps=1)
    assert len(L.work_at) > 1000
    assert L.stream_used
    from memplan.gpus import resolve_gpu

    h200 = dict(phase_seconds(L, GpuRates.of(resolve_gpu("h200"))))
    a100 = dict(phase_seconds(L, GpuRates.of(resolve_gpu("a100-40g"))))
    for phase in ("step0.micro0.forward", "step0.micro0.backward"):
        assert 0 < h200[phase] <= a100[phase]


def test_a_host_link_copy_runs_on_a_copy_engine_but_in_its_streams_order():
    # a 10 s compute kernel launched at t = 0; then, on the side stream, a copy the host waits for (a blocking
    # .to(device)), then a free of a tensor the compute stream used. A kernel copy (MEMORY) starts once the running
    # compute kernel ends, so the host waits past t = 10 and w0's free completes before w1 is allocated. A host-link
    # copy alone does not wait for the compute kernel (benchmarks/timing/h2d-copy-h100.jsonl: a copy engine's), so
    # the host is back at t = 1 and w1 comes first; queued behind a kernel copy on its stream it waits for that one
    from memplan.estimator.timing import HOST_LINK

    def run(*kinds):  # no kinds: no copy, no host wait
        L = Ledger()
        L.mark("a")
        w = L.alloc("w0", 100 * MiB, "params_gathered", SIDE)
        L.work(0.0, 0.0, 100, MEMORY)  # 10 s on SLOW
        copy = None
        for kind in kinds:
            copy = L.work(0.0, 0.0, 10, kind, SIDE)
        if copy is not None:
            L.wait(copy)
        L.record_stream(w, 0)
        L.free(w)
        L.free(L.alloc("w1", 100 * MiB, "params_gathered", SIDE))
        return L

    rates = GpuRates(gemm=1.0, gemm_fp32=1.0, attention=(1.0, 1.0, 1.0), memory=10.0, host_link=10.0)
    assert timed(run(MEMORY), rates).events == [0, ~0, 1, ~1]
    assert timed(run(HOST_LINK), rates).events == [0, 1, ~1, ~0]
    assert timed(run(MEMORY, HOST_LINK), rates).events == [0, ~0, 1, ~1]
    # without the host's wait the free still waits for the compute kernel: w1 comes first
    assert timed(run(), rates).events == [0, 1, ~1, ~0]


def test_offloaded_grads_cross_the_host_link_on_the_reduce_stream():
    # offload_optimizer: partition_grads copies each grad partition to its pinned host buffer and back
    # (grad_buffer.copy_ / .to(device), non_blocking) and, at the boundary, its fp32 cast to the optimizer's host
    # grad (_offload_grad_partition_at_boundary): 2 + 2 + 4 bytes an element of each rank's partition, on the
    # reduce stream (stream 1); without offload none of it
    from memplan.estimator.timing import HOST_LINK
    from memplan.params import parameter_tensors

    world = 8
    numels = [t.numel for t in parameter_tensors(load_model("llama-3.2-1b"))]
    part = sum(-(-n // world) for n in numels)  # each tensor's partition: ceil(numel / world) elements
    for offload, expected in (("cpu", (2 + 2 + 4) * part), ("none", 0)):
        L = build_ledger(_zero3(seq_len=512, zero={"stage": 3, "offload_optimizer": offload}), steps=1)
        link = sum(L.work_bytes[k] for k, (kind, s) in enumerate(zip(L.work_kernel, L.work_stream))
                   if kind == HOST_LINK and s == 1)
        assert link == expected


@pytest.mark.parametrize("bucket", [50_000_000, 500_000_000])
def test_every_reduced_zero3_grad_is_freed_on_the_reduce_stream(bucket):
    # stage3.py: a grad copied into the IPG bucket (__add_grad_to_ipg_bucket) and one that kept its own storage
    # (larger than the bucket's room: partition_grads) are both recorded on the reduce stream before param.grad
    # = None, one its partitions view in place included. llama-3.2-1b ties its embedding to the head: the head's
    # grad (262M elements) is larger than a 50M bucket and divides by the 8 ranks (reduce_scatter_coalesced's
    # single-tensor path); a norm weight's grad is the reduction named ``.reduced``, not ``grad.<parameter>``
    from memplan.params import parameter_tensors

    job = _zero3(seq_len=512, zero={"stage": 3, "reduce_bucket_size": bucket})
    L = build_ledger(job, steps=1)
    grads = {f"grad.{t.name}" for t in parameter_tensors(job.model)} | {"grad.lm_head.weight"}
    freed = [~e for e in L.events if e < 0 and L.names[~e] in grads]
    assert "grad.lm_head.weight" in {L.names[t] for t in freed}
    assert len(freed) > 16 * 7  # every layer's seven matrices
    assert all(L.stream_used.get(t) == 1 for t in freed)


def test_event_clocks_are_the_host_and_compute_clocks_at_each_event():
    # _layers(10): the host spends 0.5 s, gathers layer 0's weight (the GPU has nothing queued yet), launches its
    # 10 s kernel and frees the weight at once; the compute stream will have run that kernel at 0.5 + 10 s
    clocks = event_clocks(_layers(kernel_s=10), SLOW)
    assert clocks[0] == pytest.approx((0.5, 0.0))
    assert clocks[1] == pytest.approx((0.5, 10.5))
    # the second layer's gather comes 0.5 s of host time later, with the GPU 10 s further on once it is launched
    assert clocks[2] == pytest.approx((1.0, 10.5))
    assert clocks[3] == pytest.approx((1.0, 20.5))
