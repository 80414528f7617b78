"""ZeRO-3's partitioned parameters (DeepSpeed 0.19.8 runtime/zero/partition_parameters.py, partitioned_param_coordinator.py)
as ledger events: the build under ``deepspeed.zero.Init``, the all-gathers and releases around every module, and
the gathers of the persistent parameters after the step.

Build (Init._post_init_method → _partition_param): each parameter is created whole on the GPU, its partition
(ceil(numel / N) elements) made — on the GPU, or with offload_param a host tensor (pinned when pin_memory) — the
whole freed.

Gathering (PartitionedParameterCoordinator.__all_gather_params_ → Init.all_gather_coalesced): the parameters of a
module not yet available, sorted by ds_id (model order). N = 1: no gather (_no_gather_coalesced: param.data =
ds_tensor.to(device), a view of the GPU partition, a new GPU copy of a host one). One parameter
(_all_gather_sequential): a buffer of its aligned size is the parameter. Several (_all_gather_dtype): one flat
buffer; at the first wait on any of them (AllGatherCoalescedHandle.wait) every parameter of the handle is copied
out of it (``torch.cat(partitions)``), and the flat buffer dies when the coordinator has popped the handle for its
last parameter. With offload_param the host partitions are copied to the GPU first (``ds_tensor.to(device)``, one
temporary per parameter while the gather is launched). From the second step the recorded trace drives a prefetch
of up to min(stage3_prefetch_bucket_size, stage3_max_live_parameters − available) elements per fetch. After a
module runs its parameters are released unless persistent (numel ≤ stage3_param_persistence_threshold, from the
second step) or used again within stage3_max_reuse_distance elements of the trace (__params_to_release); in the
first step everything is released.

Outside the coordinator (Init._all_gather, async_op False): one parameter at a time (_allgather_params_sequential:
an aligned buffer per parameter, also for N = 1) or several (_allgather_params_coalesced: every host partition
copied to the GPU first, then one aligned buffer per parameter; N = 1 takes the no-gather path).
"""

from __future__ import annotations

from collections import deque
from itertools import groupby

from .autograd import Autograd, Tensor
from .places import Places
from .transformer import ModuleHooks

#: the coordinator's __allgather_stream (a new CUDA stream)
ALLGATHER_STREAM = 2


class Zero3Params(ModuleHooks):
    """The partitioned parameters and their coordinator (see the module docstring)."""

    zero3_linear = True  # zero.Init's zero3_linear_wrap (ModuleHooks.zero3_linear)

    def __init__(self, places: Places, names: list[str], numels: list[int], n: int, b: int, zero,
                 widths: dict[str, int] | None = None):
        self.P, self.L, self.n, self.b = places, places.dev, n, b
        #: bytes per element of each parameter: ``b`` unless ``widths`` says otherwise (peft's fp32 adapters on a
        #: 16-bit base: lora.adapter_dtype_bytes)
        self.w = {k: (widths or {}).get(k, b) for k in names}
        self.numel = dict(zip(names, numels))
        self.order = names
        self.rank_of = {k: i for i, k in enumerate(names)}  # ds_id order
        self.part = {k: -(-v // n) for k, v in self.numel.items()}
        self.offload_param = zero.offload_param != "none"
        self.pin_memory = zero.pin_memory
        self.persist_at = zero.stage3_param_persistence_threshold
        self.prefetch, self.max_live = zero.stage3_prefetch_bucket_size, zero.stage3_max_live_parameters
        self.reuse = zero.stage3_max_reuse_distance
        #: parameter-less modules above the *ForCausalLM (peft's PeftModelForCausalLM and LoraModel: program._engine)
        self.wrapper_modules = 0
        self.avail: dict[str, int | None] = {}  # name → ledger id of its gathered storage (None: a view)
        self.inflight: dict[str, list] = {}  # name → its handle [flat id, names not popped, names to copy]
        self.n_avail = 0
        self.complete = False
        self.trace_modules: list[tuple[str, ...]] = []  # params of each fetched module, in order
        self.leaf_modules: set[tuple[str, ...]] = set()  # the params of each ZeRO-3 leaf module (Net.leaf)
        self.param_order: list[tuple[str, int]] = []
        self.queue: deque = deque()
        self.recent: dict[str, int] = {}
        self.step_id = 0
        self.partitions: dict[str, int] = {}  # name → id of its partition (host ledger under offload_param)
        self.retained: dict[str, list[int | None]] = {}  # released in a recompute, kept by a saved tensor

    def persistent(self, name: str) -> bool:
        return self.numel[name] <= self.persist_at

    # -- build --------------------------------------------------------------------------------------------
    def build(self, model_order: list[tuple[str, int]]) -> None:
        """zero.Init: a module's own parameters whole as its __init__ creates them, then, as _post_init_method
        runs when that __init__ returns, each one's partition made and its whole freed (a module of several
        parameters, e.g. transformers' MixtralExperts gate_up_proj and down_proj, holds them all whole at once)."""
        L, w = self.L, self.w
        for _owner, group in groupby(model_order, key=lambda p: p[0].rsplit(".", 1)[0]):
            params = list(group)
            wholes = [L.alloc(name, w[name] * numel, "params_16bit") for name, numel in params]
            self.partition(params, wholes)

    def partition(self, params: list[tuple[str, int]], wholes: list[int]) -> None:
        """_partition_param for parameters that exist whole (ledger ids ``wholes``): each one's partition made,
        its whole freed."""
        L, P, w = self.L, self.P, self.w
        for (name, numel), whole in zip(params, wholes):
            nbytes = w[name] * -(-numel // self.n)
            if self.offload_param:
                self.partitions[name] = P.pin(P.host_alloc(f"{name} (partition)", nbytes, "params_16bit"),
                                              self.pin_memory)
            else:
                self.partitions[name] = L.alloc(f"{name} (partition)", nbytes, "params_16bit")
            L.free(whole)

    # -- gathering ----------------------------------------------------------------------------------------
    def _h2d(self, names: list[str], stream: int) -> list[int | None]:
        """``[p.ds_tensor.to(device) for p in params]``: GPU copies of host partitions (offload_param)."""
        if not self.offload_param:
            return []
        return [self.P.to_device(f"{p} (partition on the GPU)", self.w[p] * self.part[p], "params_gathered", stream)
                for p in names]

    def _free_all(self, tids: list[int | None]) -> None:
        for t in reversed(tids):  # a list's items die last to first (CPython list_dealloc)
            self.P.free_dev(t)

    def _all_gather(self, names: list[str]) -> None:
        """__all_gather_params_: one all_gather_coalesced call for the parameters not yet available."""
        todo = sorted((p for p in dict.fromkeys(names) if p not in self.avail and p not in self.inflight),
                      key=self.rank_of.__getitem__)
        if not todo:
            return
        L, w, s = self.L, self.w, ALLGATHER_STREAM
        self.n_avail += sum(self.numel[p] for p in todo)
        if self.n == 1:  # _no_gather_coalesced: param.data = ds_tensor.to(device)
            for p in todo:
                self.avail[p] = (self.P.to_device(f"{p} (gathered)", w[p] * self.numel[p], "params_gathered", s)
                                 if self.offload_param else None)
            return
        if len(todo) == 1:  # _all_gather_sequential: the buffer is the parameter
            p = todo[0]
            self.avail[p] = L.alloc(f"{p} (gathered)", w[p] * self.part[p] * self.n, "params_gathered", s)
            self._free_all(self._h2d(todo, s))
            return
        flat = L.alloc("zero3.allgather_flat", self.n * sum(w[p] * self.part[p] for p in todo), "params_gathered", s)
        self._free_all(self._h2d(todo, s))  # torch.cat(..., out=partition) of the copies
        handle = [flat, set(todo), todo]
        for p in todo:
            self.inflight[p] = handle

    def _wait(self, name: str) -> None:
        """The coordinator pops ``name``'s handle and waits on it."""
        handle = self.inflight.pop(name, None)
        if handle is None:
            return
        if handle[2]:  # AllGatherCoalescedHandle.wait: every parameter copied out at the first wait
            for p in handle[2]:
                self.avail[p] = self.L.alloc(f"{p} (gathered)", self.w[p] * self.numel[p], "params_gathered",
                                             ALLGATHER_STREAM)
            handle[2] = []
        handle[1].discard(name)
        if not handle[1]:
            self.L.free(handle[0])

    def _release(self, name: str, retain: bool = False) -> None:
        """__release_param: an available parameter (not one still in flight) partitioned again. ``retain``: in
        a checkpoint's recompute the node that saved the parameter keeps its gathered storage alive."""
        if name in self.avail and name not in self.inflight:
            tid = self.avail.pop(name)
            if retain:
                self.retained.setdefault(name, []).append(tid)
            else:
                self.P.free_dev(tid)
            self.n_avail -= self.numel[name]

    def free_retained(self, name: str) -> None:
        """The node that saved ``name`` in a recompute released what it saved: the old storage goes."""
        for tid in self.retained.pop(name, []):
            self.P.free_dev(tid)

    def gather_now(self, names: list[str], component: str = "params_gathered") -> None:
        """Init._all_gather(params, async_op=False) outside the coordinator (see the module docstring; the
        coordinator's count of available elements is not told)."""
        L, w = self.L, self.w
        if len(names) == 1:  # _allgather_params_sequential
            p = names[0]
            self.avail[p] = L.alloc(f"{p} ({component})", w[p] * self.part[p] * self.n, component)
            self._free_all(self._h2d(names, 0))
        elif self.n == 1:  # _no_gather_coalesced, then wait
            for p in names:
                self.avail[p] = (self.P.to_device(f"{p} ({component})", w[p] * self.numel[p], component)
                                 if self.offload_param else None)
        else:  # _allgather_params_coalesced: the host partitions on the GPU, then one buffer per parameter
            local = self._h2d(names, 0)
            for p in names:
                self.avail[p] = L.alloc(f"{p} ({component})", w[p] * self.part[p] * self.n, component)
            self._free_all(local)

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

    def release(self, params: tuple[str, ...], retain: bool = False, saved: frozenset | set = frozenset()) -> None:
        """release_sub_module with __params_to_release's rules; ``saved``: parameters a node keeps through a
        view (Autograd.saved_param_views), whose gathered storage outlives the release."""
        if not self.complete:
            for p in params:
                self._release(p, retain or p in saved)
            return
        keep = {p for p in params if self.persistent(p) or self.recent.get(p, -10**12) > self.step_id}
        traversed = 0
        # iter_params(module, recurse=z3_leaf_module(submodule_to_release)): the recursion follows the module
        # being released, so releasing an ordinary module walks a leaf module of the trace (a MoE block, whose
        # parameters all sit in its router and experts) without its parameters: they count for nothing
        leaf = params in self.leaf_modules
        for module in self.trace_modules[self.step_id:]:
            if traversed >= self.reuse:
                break
            for p in (module if leaf or module not in self.leaf_modules else ()):
                keep.add(p)
                traversed += self.numel[p]
        for p in params:
            if p not in keep:
                self._release(p, retain or p in saved)

    def partition_all(self) -> None:
        """_partition_all_parameters → release_and_reset_all: in-flight handles waited, everything released."""
        for p in self.order:
            self.free_retained(p)
            self._wait(p)
            self._release(p)

    def gather_persistent(self) -> None:
        """_post_step: the persistent parameters gathered again in one Init.all_gather call."""
        names = [p for p in self.order if self.persistent(p) and p not in self.avail]
        if names:
            self.gather_now(names, "params_persistent")

    # -- module hooks -------------------------------------------------------------------------------------
    # A non-reentrant checkpoint's recompute (torch/utils/checkpoint.py _recomputation_hook) runs the modules'
    # hooks again: each gathers its parameters, and the pack hook keeps ``x.detach()`` of every tensor the
    # module's node saves — the weight too (LinearFunctionForZeroStage3 saves input and weight; the norms'
    # multiply saves the weight) — so the release after the module frees nothing: the storage lives until the
    # node has run in backward and released what it saved; its backward fetch gathers the parameter again.
    # The recompute starts when backward first unpacks a saved tensor of the region (unpack_hook), so after the
    # PreBackwardFunctionForModule of the region's last module has fetched its weight: the recompute's fetch
    # of that module finds it available. It stops (_StopRecomputationError) once the last saved tensor is
    # packed: that module's post-forward hook and everything after it never run.
    def pre_forward(self, ag: Autograd, module: str, params: tuple[Tensor, ...], inputs: tuple[Tensor, ...]):
        if getattr(ag, "suppress", False):
            return inputs
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
        if getattr(ag, "suppress", False):
            return output
        names = tuple(dict.fromkeys(t.param for t in params))
        self.release(names, retain=getattr(ag, "stop_at", None) is not None, saved=ag.saved_param_views)
        # PreBackwardFunctionForModule on the output: before the module's backward, fetch it
        return ag.marker(output, lambda names=names: self.fetch(names)) if output.requires_grad else output

    def end_forward(self, ag: Autograd, out):
        """The root module's post-forward hook: its outputs (the loss, the logits) wrapped in
        PreBackwardFunctionForModule, so the backward starts with the root module's (parameter-less) fetch —
        a step of the trace like any other."""
        if getattr(ag, "suppress", False):
            return out
        for _ in range(1 + self.wrapper_modules):  # the *ForCausalLM's, then each peft wrapper's (outermost last)
            wrapped = []
            for t in (out.loss, out.logits):
                w = ag.marker(t, lambda: self.fetch(())) if t.requires_grad else t
                if w is not t:
                    ag.release(t)
                wrapped.append(w)
            out = type(out)(*wrapped)
        return out

    def release_leftovers(self) -> None:
        """release_backward_leftovers (backward_epilogue): what is still gathered is released, persistent
        parameters kept once the trace is complete."""
        for p in list(self.retained):
            self.free_retained(p)
        for p in list(self.avail):
            if not (self.complete and self.persistent(p)):
                self._release(p)

    def reset_step(self) -> None:
        """reset_step (the root module's forward pre-hook): what is still in flight waited and released
        (_clean_inflight_param_registry), a recorded trace becomes complete, the prefetch queue starts over
        from it and the count of available elements from 0."""
        for p in list(self.inflight):
            self._wait(p)
            self._release(p)
        if self.param_order:
            self.complete = True
        self.n_avail = 0
        self.queue = deque(self.param_order)
        self.recent = {}
        self.step_id = 0

