"""ZeRO stage 3 (DeepSpeed 0.19.8 runtime/zero/stage3.py, partition_parameters.py, partitioned_param_coordinator.py)
as ledger events.

Build (``deepspeed.zero.Init``): each parameter is created whole, its partition (ceil(numel / N) elements) cut,
the whole freed. initialize: the lp partitions are defragmented into one flat buffer (zero/utils.py defragment:
partitions freed, ``empty_cache()``, the flat buffer allocated), the fp32 partition made (_create_fp32_partitions),
a zero fp32 grad made and dropped (initialize_optimizer_states), the IPG bucket (reduce_bucket_size elements) and
the grad partitions (grad_partitions_flat_buffer, P/N in the grad-accumulation dtype) allocated, and every
parameter gathered once while its grad hook is registered (create_reduce_and_remove_grad_hooks).

Forward and backward (PartitionedParameterCoordinator): before a module runs, its parameters not yet available
are all-gathered on the all-gather stream — one parameter into a buffer of its aligned size
(_all_gather_sequential), several into one flat buffer (_all_gather_dtype) from which each parameter is copied
when it is waited for (AllGatherCoalescedHandle.wait: ``torch.cat(partitions)``), the flat buffer dying with its
last parameter's wait. From the second step the recorded trace drives a prefetch of up to
min(stage3_prefetch_bucket_size, stage3_max_live_parameters − available) elements per fetch. After a module runs its
parameters are released unless persistent (numel ≤ stage3_param_persistence_threshold, from the second step) or
used again within stage3_max_reuse_distance elements of the trace (__params_to_release); in the first step
everything is released. A parameter's grad is copied into the IPG bucket and freed (__add_grad_to_ipg_bucket); a
full bucket is reduce-scattered on the reduce stream (__avg_scatter_grads → reduce_scatter_coalesced: the grads
flattened, each padded to N) into the grad partitions.

Step: every gathered parameter released (_partition_all_parameters), the norm upcasts each grad partition to fp64
in turn, per sub-group the grads are flattened and cast to fp32 (_prepare_fp32_grad_for_sub_group), the optimizer
runs, the fp32 grad dropped; then the persistent parameters are gathered again (_post_step).
"""

from __future__ import annotations

from collections import deque

from ..ledger import EMPTY_CACHE, Ledger
from .autograd import Autograd, Tensor
from .optim import Optimizer
from .transformer import ModuleHooks

#: the coordinator's __allgather_stream and the optimizer's reduce_and_partition_stream (new CUDA streams)
ALLGATHER_STREAM, REDUCE_STREAM = 2, 1
FP32, FP64 = 4, 8


class Zero3(ModuleHooks):
    """The stage-3 optimizer and its parameter coordinator (see the module docstring)."""

    def __init__(self, ledger: Ledger, names: list[str], numels: list[int], trainable: set[str], n: int, b: int,
                 g: int, zero, optimizer: Optimizer, comm_bytes: int):
        self.L, self.n, self.b, self.g, self.opt = ledger, n, b, g, optimizer
        self.numel = dict(zip(names, numels))
        self.order = names
        self.trainable = trainable
        self.part = {k: -(-v // n) for k, v in self.numel.items()}
        self.persist_at = zero.stage3_param_persistence_threshold
        self.rbs, self.prefetch, self.max_live = zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size, \
            zero.stage3_max_live_parameters
        self.reuse, self.sub_group, self.comm_b = zero.stage3_max_reuse_distance, zero.sub_group_size, comm_bytes
        self.avail: dict[str, int] = {}  # name → ledger id of its gathered storage
        self.inflight: dict[str, list] = {}  # name → its handle [flat id or None, set of names still to wait]
        self.n_avail = 0
        self.complete = False
        self.trace_modules: list[tuple[str, ...]] = []  # params of each fetched module, in order
        self.param_order: list[tuple[str, int]] = []
        self.queue: deque = deque()
        self.recent: dict[str, int] = {}
        self.step_id = 0
        self.bucket_params: list[tuple[str, Tensor | None]] = []
        self.bucket_elements = 0
        self._partitions_ids: list[int] = []

    def persistent(self, name: str) -> bool:
        return self.numel[name] <= self.persist_at

    # -- build and initialize ------------------------------------------------------------------------------
    def build(self, model_order: list[tuple[str, int]]) -> None:
        """zero.Init: each parameter whole, then its partition, then the whole freed."""
        L, b = self.L, self.b
        for name, numel in model_order:
            whole = L.alloc(name, b * numel, "params_16bit")
            self._partitions_ids.append(L.alloc(f"{name} (partition)", b * -(-numel // self.n), "params_16bit"))
            L.free(whole)

    def initialize(self, param_ids: dict[str, int]) -> None:
        L, b = self.L, self.b
        for tid in self._partitions_ids:  # defragment: partitions to the host, freed, empty_cache, one flat buffer
            L.free(tid)
        L.mark("defragment", EMPTY_CACHE)
        total = sum(self.part.values())
        L.alloc("zero3.lp_param_buffer", b * total, "params_16bit")
        trained = sum(self.part[k] for k in self.order if k in self.trainable)
        f1 = L.alloc("zero3.fp32_partition", FP32 * trained, "master_params_fp32")
        L.alloc("zero3.fp32_partition_clone", FP32 * trained, "master_params_fp32") if self.opt.on_gpu else None
        L.free(f1) if self.opt.on_gpu else None
        L.free(L.alloc("zero3.initial_grad", FP32 * trained, "optimizer_step_transient"))
        L.alloc("zero3.ipg_bucket", b * self.rbs, "grad_bucket")
        L.alloc("zero3.grad_partitions_flat_buffer", self.g * trained, "gradients")
        for name in self.order:  # create_reduce_and_remove_grad_hooks gathers each parameter once
            if name in self.trainable:
                L.free(L.alloc(f"{name} (gathered for its hook)", b * self.numel[name], "params_gathered"))

    # -- gathering ----------------------------------------------------------------------------------------
    def _all_gather(self, names: list[str]) -> None:
        """__all_gather_params_: one call for the parameters not yet available."""
        todo = [n for n in names if n not in self.avail and n not in self.inflight]
        if not todo:
            return
        L, b = self.L, self.b
        self.n_avail += sum(self.numel[n] for n in todo)
        if len(todo) == 1:  # _all_gather_sequential: the buffer is the parameter
            name = todo[0]
            self.avail[name] = L.alloc(f"{name} (gathered)", b * self.part[name] * self.n, "params_gathered",
                                       ALLGATHER_STREAM)
            return
        flat = L.alloc("zero3.allgather_flat", b * self.n * sum(self.part[n] for n in todo), "params_gathered",
                       ALLGATHER_STREAM)
        handle = [flat, set(todo)]
        for name in todo:
            self.inflight[name] = handle

    def _wait(self, name: str) -> None:
        handle = self.inflight.pop(name, None)
        if handle is None:
            return
        self.avail[name] = self.L.alloc(f"{name} (gathered)", self.b * self.numel[name], "params_gathered",
                                        ALLGATHER_STREAM)
        handle[1].discard(name)
        if not handle[1]:
            self.L.free(handle[0])

    def _release(self, name: str) -> None:
        tid = self.avail.pop(name, None)
        if tid is not None:
            self.L.free(tid)
            self.n_avail -= self.numel[name]

    def fetch(self, params: tuple[str, ...]) -> None:
        """fetch_sub_module: gather, wait, then (with a complete trace) prefetch."""
        if not self.complete:
            self.trace_modules.append(params)
            self.param_order.extend((p, self.step_id) for p in params)
        self._all_gather(list(params))
        for p in params:
            self._wait(p)
        if self.complete:
            pending = {p for p in params if self.recent.get(p, -10**12) < self.step_id}
            discarded: set[str] = set()
            while self.queue and len(discarded) < len(pending):
                p, used_at = self.queue.popleft()
                self.recent[p] = used_at
                discarded.add(p)
            budget = min(self.max_live - self.n_avail, self.prefetch)
            chosen: list[str] = []
            numel = 0
            while self.queue and numel < budget:
                p, used_at = self.queue.popleft()
                if p not in self.avail and p not in self.inflight and p not in chosen:
                    chosen.append(p)
                    numel += self.numel[p]
                self.recent[p] = max(self.recent.get(p, -10**12), used_at)
            if chosen:
                self._all_gather(chosen)
        self.step_id += 1

    def release(self, params: tuple[str, ...]) -> None:
        """release_sub_module with __params_to_release's rules."""
        if not self.complete:
            for p in params:
                self._release(p)
            return
        keep = {p for p in params if self.persistent(p) or self.recent.get(p, -10**12) > self.step_id}
        traversed = 0
        for module in self.trace_modules[self.step_id:]:
            if traversed >= self.reuse:
                break
            for p in module:
                keep.add(p)
                traversed += self.numel[p]
        for p in params:
            if p not in keep:
                self._release(p)

    # -- module hooks -------------------------------------------------------------------------------------
    def pre_forward(self, ag: Autograd, module: str, params: tuple[Tensor, ...], inputs: tuple[Tensor, ...]):
        names = tuple(dict.fromkeys(t.param for t in params))
        self.fetch(names)
        # PostBackwardFunctionModule on each input that requires grad: once all their grads are computed
        # (module.ds_grads_remaining back to 0), release the module's parameters
        remaining = [sum(1 for x in inputs if x.requires_grad)]

        def after_backward():
            remaining[0] -= 1
            if remaining[0] == 0:
                self.release(names)
        return tuple(ag.marker(x, after_backward) if x.requires_grad else x for x in inputs)

    def post_forward(self, ag: Autograd, module: str, params: tuple[Tensor, ...], output: Tensor) -> Tensor:
        names = tuple(dict.fromkeys(t.param for t in params))
        self.release(names)
        # PreBackwardFunctionForModule on the output: before the module's backward, fetch it
        return ag.marker(output, lambda names=names: self.fetch(names)) if output.requires_grad else output

    # -- gradients ----------------------------------------------------------------------------------------
    def on_param_grad(self, ag: Autograd, param: Tensor, grad: Tensor) -> None:
        """reduce_independent_p_g_buckets_and_remove_grads for one parameter's fresh (whole) grad."""
        name = param.param
        numel = self.numel[name]
        if self.bucket_elements + numel > self.rbs and self.bucket_elements > 0:
            self.reduce_bucket(ag)
        if self.bucket_elements + numel <= self.rbs:
            ag.release(grad)  # copied into the bucket; param.grad views it
            self.bucket_params.append((name, None))
        else:
            self.bucket_params.append((name, grad))
        self.bucket_elements += numel

    def reduce_bucket(self, ag: Autograd) -> None:
        """__reduce_and_partition_ipg_grads → __avg_scatter_grads → reduce_scatter_coalesced, then partition_grads."""
        if not self.bucket_params:
            return
        L = self.L
        padded = sum(self.part[n] * self.n for n, _ in self.bucket_params)
        casts = []
        if self.comm_b != self.b:  # full_grads_for_rank = [g.to(communication_data_type) ...]
            casts = [L.alloc("zero3.grad_comm_cast", self.comm_b * self.numel[n], "grad_bucket", REDUCE_STREAM)
                     for n, _ in self.bucket_params]
        flat = L.alloc("zero3.reduce_scatter_flat", self.comm_b * padded, "grad_bucket", REDUCE_STREAM)
        for c in casts:
            L.free(c)
        if self.comm_b != self.g:  # grad_partitions_for_rank cast to the accumulation dtype
            L.free(L.alloc("zero3.grad_partition_cast", self.g * padded // self.n, "grad_bucket", REDUCE_STREAM))
        L.free(flat)
        for _, kept in self.bucket_params:
            if kept is not None:
                ag.release(kept)
        self.bucket_params, self.bucket_elements = [], 0

    def end_backward(self, ag: Autograd, boundary: bool) -> None:
        """independent_gradient_partition_epilogue, then release_backward_leftovers."""
        self.reduce_bucket(ag)
        for p in list(self.avail):
            if not (self.complete and self.persistent(p)) and p not in self._kept_after_backward():
                self._release(p)

    def _kept_after_backward(self) -> set[str]:
        return set()

    # -- step -------------------------------------------------------------------------------------------
    def _partition_all(self) -> None:
        for p in list(self.avail):  # _partition_all_parameters
            self._release(p)
        for p in list(self.inflight):
            self._wait(p)
            self._release(p)

    def skip(self, ag: Autograd) -> None:
        """An overflowing fp16 step: parameters partitioned, then step() returns before the optimizer."""
        self._partition_all()

    def step(self, first: bool) -> None:
        L = self.L
        self._partition_all()
        trained = [k for k in self.order if k in self.trainable]
        for p in trained:  # _get_norm_groups → get_grad_norm_direct: each grad partition in fp64
            L.free(L.alloc("zero3.norm_fp64", FP64 * self.part[p], "optimizer_step_transient"))
        total = sum(self.part[p] for p in trained)
        left, group = total, 0
        while left > 0:
            n = min(left, self.sub_group)
            flat = L.alloc("zero3.flat_grad_sub_group", self.g * n, "optimizer_step_transient")
            fp32 = L.alloc("zero3.fp32_grad_sub_group", FP32 * n, "optimizer_step_transient")
            L.free(flat)
            self.opt.step(L, n, first, group)
            L.free(fp32)
            left -= n
            group += 1
        self._post_step()

    def _post_step(self) -> None:
        """Persistent parameters gathered again, one buffer each."""
        for p in self.order:
            if self.persistent(p) and p not in self.avail:
                self.avail[p] = self.L.alloc(f"{p} (persistent)", self.b * self.numel[p], "params_persistent")
                self.n_avail += self.numel[p]

    def start_forward(self) -> None:
        """reset_step (the root module's forward pre-hook): a recorded trace becomes complete; the prefetch
        queue starts over from it."""
        if self.param_order:
            self.complete = True
        self.queue = deque(self.param_order)
        self.recent = {}
        self.step_id = 0
