"""ZeRO-3's partitioned parameters (DeepSpeed 0.19.8 runtime/zero/partition_parameters.py, partitioned_param_coordinator.py)
as ledger events: the build under ``deepspeed.zero.Init``, the all-gathers and releases around every module, and
the gathers of the persistent parameters after the step.

Build (Init._post_init_method → _partition_param): each parameter is created whole on the GPU, its partition
(ceil(numel / N) elements) made — on the GPU, or with offload_param a host tensor (pinned when pin_memory) — the
whole freed.

Gathering (PartitionedParameterCoordinator.__all_gather_params_ → Init.all_gather_coalesced): the parameters of a
module not yet available, sorted by ds_id (model order). N = 1: no gather (_no_gather_coalesced: param.data =
ds_tensor.to(device), a view of the GPU partition, a new GPU copy of a host one). One parameter
(_all_gather_sequential): a buffer of its aligned size is the parameter. Several (_all_gather_coalesced): one flat
buffer per communication dtype (_all_gather_dtype, in sort_dtypes order); at the first wait on any of them
(MultipleAllGatherHandles.wait) every parameter of the handle is copied out of its flat buffer
(``torch.cat(partitions)``), and the flat buffers die when the coordinator has popped the handle for its last
parameter. A module's fetch adds it to each parameter's ds_active_sub_modules and its release takes it out;
__release_param partitions only a parameter no module holds: a parameter a forward read outside its own module
(an external parameter, peft's lora_A) is held by the module it was read in, and a frozen parameter a
checkpoint's recompute gathered by the backward module that was active then (ds_recompute_parameters), until
that module's backward release. With offload_param the host partitions are copied to the GPU first (``ds_tensor.to(device)``, one
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
from itertools import groupby, islice

from .places import Places
from .timing import CPU_Z3_GATHER_S, FAKE_COLLECTIVE, FAKE_GATHER_COPY_S, MEMORY
from .zero3_hooks import Zero3Hooks

#: the coordinator's __allgather_stream: a new CUDA stream, or with overlap_comm off the default stream
#: (DeepSpeedZeRoOffload.__init__: ``Stream() if overlap_comm else default_stream()``)
ALLGATHER_STREAM = 2
#: _fetch_sub_module_impl synchronizes the oldest all-gather event once more than this many are pending
#: (PartitionedParameterCoordinator.__max_ongoing_fetch_events)
MAX_ONGOING_FETCH_EVENTS = 2


class Zero3Params(Zero3Hooks):
    """The partitioned parameters and their coordinator (see the module docstring)."""

    zero3_linear = True  # zero.Init's zero3_linear_wrap (ModuleHooks.zero3_linear)

    def __init__(self, places: Places, names: list[str], numels: list[int], n: int, b: int, zero,
                 widths: dict[str, int] | None = None):
        self.P, self.L, self.n, self.b = places, places.dev, n, b
        self.ag_stream = ALLGATHER_STREAM if zero.overlap else 0
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
        #: name → its handle [flat ids, names not popped, names to copy out, whether its wait synchronizes the stream]
        self.inflight: dict[str, list] = {}
        self.n_avail = 0
        self.complete = False
        self.trace_modules: list[tuple[str, ...]] = []  # params of each fetched module, in order
        self.leaf_modules: set[tuple[str, ...]] = set()  # the params of each ZeRO-3 leaf module (Net.leaf)
        self._reuse_memo: dict[tuple, frozenset[str]] = {}  # _reused_soon's walks
        self.param_order: list[tuple[str, int]] = []
        self.queue: deque = deque()
        self.recent: dict[str, int] = {}
        self.step_id = 0
        self.partitions: dict[str, int] = {}  # name → id of its partition (host ledger under offload_param)
        self.retained: dict[str, list[int | None]] = {}  # released in a recompute, kept by a saved tensor
        #: __active_backward_submodules: modules whose backward fetch ran and whose backward release has not, in
        #: first-fetch order (a dict keyed by ds_id: a second fetch keeps the place)
        self.active_backward: dict[str, None] = {}
        #: ds_recompute_parameters: per backward module, the frozen parameters a recompute gathered while it was
        #: the last active one (update_recompute_parameters)
        self.recompute_owned: dict[str, set[str]] = {}
        #: ds_active_sub_modules: per parameter, the modules whose fetch added it and whose release has not run
        #: (__release_param partitions only a parameter no module holds)
        self.holders: dict[str, set[str]] = {}
        #: register_external_parameter: per module, parameters a forward read while they were not available
        #: (ZeROOrderedDict.__getitem__ in engine.forward), fetched and released with the module from then on
        self.external: dict[str, tuple[str, ...]] = {}
        #: __ongoing_fetch_events: the all-gather stream's work record after each waited handle, oldest first
        self.fetch_events: deque[int] = deque()

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

    def build_replaced(self, name: str, like: str) -> None:
        """A parameter built under zero.Init and replaced before deepspeed.initialize (a tied lm_head: tie_weights
        points it at the embedding): made whole, partitioned, the whole freed, then its partition once Python
        collects the old parameter (in CPU traces before the engine configures its optimizer)."""
        self.w[name] = self.w[like]  # ``like``: the parameter it is replaced by (same shape and dtype)
        numel = self.numel[like]
        self.partition([(name, numel)], [self.L.alloc(name, self.w[name] * numel, "params_16bit")])
        part = self.partitions.pop(name)
        if self.offload_param:
            self.P.free_host(part)
        else:
            self.L.free(part)

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
        L, w, s = self.L, self.w, self.ag_stream
        L.work(CPU_Z3_GATHER_S * len(todo))  # each parameter's gather, wait and release in the coordinator
        self.n_avail += sum(self.numel[p] for p in todo)
        if self.n == 1:  # _no_gather_coalesced: NoGatherHandle, param.data = ds_tensor.to(device, non_blocking=True)
            handle = [[], set(todo), [], True]  # its wait synchronizes the current (all-gather) stream
            for p in todo:
                self.avail[p] = (self.P.to_device(f"{p} (gathered)", w[p] * self.numel[p], "params_gathered", s,
                                                  blocking=False) if self.offload_param else None)
                self.inflight[p] = handle
            return
        if len(todo) == 1:  # _all_gather_sequential: the buffer is the parameter, in flight until waited
            p = todo[0]
            self.avail[p] = L.alloc(f"{p} (gathered)", w[p] * self.part[p] * self.n, "params_gathered", s)
            copies = self._h2d(todo, s)
            self._fake_gather(w[p] * self.part[p])
            self._free_all(copies)
            self.inflight[p] = [[], {p}, [], False]
            return
        # _all_gather_coalesced: one _all_gather_dtype flat buffer per communication dtype, in sort_dtypes order
        # (str(dtype): bfloat16 and float16 before float32, peft's fp32 adapters last), ds_id order within each
        groups = [[p for p in todo if w[p] == width] for width in sorted({w[p] for p in todo})]
        flats = []
        for group in groups:
            local = sum(w[p] * self.part[p] for p in group)
            flats.append(L.alloc("zero3.allgather_flat", self.n * local, "params_gathered", s))
            copies = self._h2d(group, s)  # the list comprehension's blocking copies come before the cat
            L.work(0.0, 0.0, 2 * local, MEMORY, s)  # torch.cat(copies or partitions, out=flat's own slice)
            self._fake_gather(local)
            self._free_all(copies)  # the list dies after the cat
        handle = [flats, set(todo), [p for group in groups for p in group], False]
        for p in todo:
            self.inflight[p] = handle

    def _fake_gather(self, part_bytes: int) -> None:
        """all_gather_into_tensor of ``part_bytes`` a rank, as an emulated run's fake process group makes it: a
        copy of the input into each of the N chunks (timing.FAKE_GATHER_COPY_S), on the all-gather stream."""
        self.L.work(FAKE_GATHER_COPY_S * self.n, 0.0, 2 * self.n * part_bytes, FAKE_COLLECTIVE, self.ag_stream)

    def _wait(self, name: str, fetching: bool = False) -> None:
        """The coordinator pops ``name``'s handle and waits on it; ``fetching``: in _fetch_sub_module_impl, on the
        all-gather stream, after synchronizing the oldest pending fetch event if more than
        MAX_ONGOING_FETCH_EVENTS are (completed ones are dropped first: since they complete in order, that is the
        one MAX_ONGOING_FETCH_EVENTS + 1 waits ago), and followed by a new event."""
        handle = self.inflight.pop(name, None)
        if handle is None:
            return
        if fetching and len(self.fetch_events) > MAX_ONGOING_FETCH_EVENTS:
            self.L.wait(self.fetch_events.popleft())
        if handle[3]:  # NoGatherHandle.wait: current_stream().synchronize()
            self.L.wait(self.L.work(0.0, stream=self.ag_stream))
        if handle[2]:  # AllGatherCoalescedHandle.wait: every parameter copied out at the first wait
            copied = 0
            for p in handle[2]:
                self.avail[p] = self.L.alloc(f"{p} (gathered)", self.w[p] * self.numel[p], "params_gathered",
                                             self.ag_stream)
                copied += self.w[p] * self.numel[p]
            # torch.cat(partitions): the copies out of the flat buffer (read and write), on the all-gather stream
            self.L.work(0.0, 0.0, 2 * copied, MEMORY, self.ag_stream)
            handle[2] = []
        if fetching:
            self.fetch_events.append(self.L.work(0.0, stream=self.ag_stream))
        handle[1].discard(name)
        if not handle[1]:  # MultipleAllGatherHandles' list dies last item first (CPython list_dealloc)
            for flat in reversed(handle[0]):
                self.L.free(flat)

    def _release(self, name: str, retain: bool = False) -> None:
        """__release_param: an available parameter (not one still in flight, nor one another module's
        ds_active_sub_modules holds) partitioned again. ``retain``: in a checkpoint's recompute the node that
        saved the parameter keeps its gathered storage alive."""
        if name in self.avail and name not in self.inflight and not self.holders.get(name):
            tid = self.avail.pop(name)
            # free_param (partition_parameters.py): param.data.record_stream(current_stream()) before the
            # storage is dropped, so a buffer gathered on the all-gather stream waits for the compute stream
            if tid is not None:
                self.L.record_stream(tid, 0)
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
            self._wait(p, fetching=True)
        # current_stream().wait_stream(the all-gather stream)
        if self.ag_stream:
            self.L.stream_wait(self.L.work(0.0, stream=self.ag_stream))
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

    def release(self, params: tuple[str, ...], retain: frozenset | set = frozenset(),
                saved: frozenset | set = frozenset()) -> None:
        """release_sub_module with __params_to_release's rules; ``retain``: parameters a checkpoint's recompute
        saved through x.detach() (Autograd.recompute_detached), ``saved``: parameters a node keeps through a view
        (Autograd.saved_param_views): the gathered storage of both outlives the release."""
        if not self.complete:
            for p in params:
                self._release(p, p in retain or p in saved)
            return
        keep = self._reused_soon(params in self.leaf_modules)
        for p in params:
            if not (p in keep or self.persistent(p) or self.recent.get(p, -10**12) > self.step_id):
                self._release(p, p in retain or p in saved)

    def _reused_soon(self, leaf: bool) -> frozenset[str]:
        """__params_to_release's walk of the trace from the current step: the parameters of the modules ahead
        until max_reuse_distance elements are traversed. iter_params(module, recurse=z3_leaf_module(
        submodule_to_release)): the recursion follows the module being released, so releasing an ordinary module
        walks a leaf module of the trace (a MoE block, whose parameters all sit in its router and experts) without
        its parameters: they count for nothing. A function of the step, ``leaf`` and the trace (which only grows),
        remembered: a release walks up to the whole trace, and every module's forward and backward releases."""
        key = (self.step_id, leaf, len(self.trace_modules), len(self.leaf_modules))
        got = self._reuse_memo.get(key)
        if got is None:
            keep: set[str] = set()
            traversed = 0
            for module in islice(self.trace_modules, self.step_id, None):
                if traversed >= self.reuse:
                    break
                for p in (module if leaf or module not in self.leaf_modules else ()):
                    keep.add(p)
                    traversed += self.numel[p]
            got = self._reuse_memo[key] = frozenset(keep)
        return got

    def partition_all(self) -> None:
        """_partition_all_parameters → release_and_reset_all: in-flight handles waited, ds_active_sub_modules
        cleared, everything released."""
        self._drop_holds()
        for p in self.order:
            self.free_retained(p)
            self._wait(p)
            self._release(p)

    def gather_persistent(self) -> None:
        """_post_step: the persistent parameters gathered again in one Init.all_gather call."""
        names = [p for p in self.order if self.persistent(p) and p not in self.avail]
        if names:
            self.gather_now(names, "params_persistent")

    def release_leftovers(self) -> None:
        """release_backward_leftovers (backward_epilogue): what is still gathered is released, persistent
        parameters kept once the trace is complete."""
        for p in list(self.retained):
            self.free_retained(p)
        self._drop_holds()  # the drain: every module's hold on its parameters goes
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

