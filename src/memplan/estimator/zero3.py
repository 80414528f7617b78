"""ZeRO stage 3's optimizer (DeepSpeed 0.19.8 runtime/zero/stage3.py, DeepSpeedZeroOptimizer_Stage3) as ledger events;
the partitioned parameters and their coordinator are estimator/zero3_params.py.

initialize (``__init__``):
- _create_fp16_partitions_with_defragmentation: the trainable parameters' partitions in one flat buffer — on the
  GPU through defragment (zero/utils.py: a host buffer, the partitions freed, ``empty_cache()``, the buffer copied
  back), or with offload_param in host memory (_create_param_groups_fp16_flat_cpu_memory, pinned when pin_memory;
  _move_to_flat_buffer frees each host partition).
- _create_fp32_partitions, per sub-group (_create_fp16_sub_groups: sub_group_size elements): ``flat.to(device,
  fp32).clone()`` — the device is the host under offload_optimizer (``self.device = "cpu"``). A blocking copy that
  also converts runs the conversion on the host (aten/src/ATen/native/cuda/Copy.cu copy_kernel_cuda: a host
  temporary in the source dtype for GPU→host, in the destination dtype for host→GPU; none on the GPU).
- initialize_optimizer_states: a zero fp32 buffer of the largest sub-group on ``self.device``, dropped at the end;
  under offload each sub-group's fp32 grad is its own host buffer (pinned when pin_memory), kept.
- the IPG bucket (reduce_bucket_size elements, on the GPU; only with contiguous_gradients), then
  grad_partitions_flat_buffer (the trainable partitions in the grad-accumulation dtype) on ``self.device``: in pinned
  host memory under offload_optimizer.
- create_reduce_and_remove_grad_hooks gathers each trainable parameter once (Init._allgather_params_sequential:
  an aligned buffer) and partitions it again.

Backward: a parameter's grad is copied into the IPG bucket and freed (__add_grad_to_ipg_bucket; one that would
overflow the bucket reduces it first, one larger than the bucket, or any without contiguous_gradients, keeps its own
grad until the bucket is reduced). __reduce_and_partition_ipg_grads: the bucket's parameters sorted by ds_id,
__avg_scatter_grads → reduce_scatter_coalesced (comm/coalesced_collectives.py: the grads flattened with each padded to
N — no copy when a single grad divides evenly; cast to the communication dtype first and to the accumulation dtype
after when those differ), then partition_grads copies (micro-step 0) or adds each partition into
grad_partitions_flat_buffer. Under offload_optimizer that buffer is on the host: each partition is copied there and
back over the host link on the reduce stream (``grad_buffer.copy_``, then ``grad_buffer.to(device)``, alive until
the next parameter's; both non_blocking, queued behind the reduction, the bucket's event after them), and at the
accumulation boundary _offload_grad_partition_at_boundary takes its norm (_constant_buffered_norm2: fp64 pieces of
250M elements) and copies it cast to fp32 into the sub-group's host fp32 grad, non_blocking too (NVMe: the fp32 casts
of the whole bucket are kept for the swap-out). The epilogue reduces what is left; backward_epilogue releases leftover parameters.

Step: every gathered parameter released (_partition_all_parameters); fp16 checks the grad buffer for inf/nan
(``torch.isinf(buffer).any()``: an abs in the buffer's dtype and a byte per element; ``isnan``: a byte per
element); without offload the norm upcasts each grad partition to fp64 in turn (get_grad_norm_direct) and per
sub-group the grads are flattened and cast to fp32 (_prepare_fp32_grad_for_sub_group); the optimizer runs (on the
host under offload: DeepSpeedCPUAdam); the updated fp32 partition is copied into the 16-bit flat buffer
(_reassign_or_swap_out_partitioned_parameters, a converting copy); the fp32 grad dropped; then the persistent
parameters are gathered again (_post_step).
"""

from __future__ import annotations

from collections import deque

from ..ledger import EMPTY_CACHE
from .autograd import Autograd, Tensor
from .optim import Optimizer
from .places import Places
from .timing import CPU_Z3_GRAD_S, CPU_Z3_REDUCE_S, HOST_LINK, MEMORY
from .zero3_params import Zero3Params

#: the optimizer's reduce_and_partition_stream: a new CUDA stream, or with overlap_comm off the default stream
#: (DeepSpeedZeroOptimizer_Stage3.__init__: ``Stream() if overlap_comm else default_stream()``)
REDUCE_STREAM = 1
FP32, FP64 = 4, 8
#: _constant_buffered_norm2's default buffer_size (elements per fp64 piece)
NORM_PIECE_ELEMENTS = 250_000_000
#: __reduce_and_partition_ipg_grads synchronizes the oldest reduce event once more than this many are pending
#: (stage3.py max_param_reduce_events)
MAX_PARAM_REDUCE_EVENTS = 2


def sub_groups(numels: list[int], size: int) -> list[int]:
    """_create_fp16_sub_groups: partition numels accumulated into sub-groups of at least ``size`` elements."""
    total = sum(numels)
    if size >= total:
        return [total]
    out, acc = [], 0
    for i, x in enumerate(numels):
        acc += x
        if acc >= size or i == len(numels) - 1:
            out.append(acc)
            acc = 0
    return out


class Zero3(Zero3Params):
    """The stage-3 optimizer over its partitioned parameters (see the module docstring)."""

    def __init__(self, places: Places, names: list[str], numels: list[int], trainable: set[str], n: int, b: int,
                 g: int, zero, optimizer: Optimizer, comm_bytes: int, grad_accum: int = 1, fp16: bool = False,
                 widths: dict[str, int] | None = None):
        super().__init__(places, names, numels, n, b, zero, widths)
        self.g, self.opt, self.comm_b, self.ga, self.fp16 = g, optimizer, comm_bytes, grad_accum, fp16
        self.trainable = trainable
        self.reduce_stream = REDUCE_STREAM if zero.overlap else 0
        self.trained = [k for k in names if k in trainable]
        self.rbs, self.sub_group = zero.reduce_bucket_size, zero.sub_group_size
        self.contiguous = zero.contiguous_gradients  # the IPG buffer exists (stage3.py: if contiguous_gradients)
        self.offload_opt = zero.offload_optimizer != "none"
        self.nvme_opt = zero.offload_optimizer == "nvme"
        self.groups = sub_groups([self.part[k] for k in self.trained], self.sub_group)
        self.bucket_params: list[tuple[str, Tensor | None]] = []
        self.bucket_elements = 0
        self.micro = 0  # micro_step_id
        self.forwards = 0
        self.epilogue_ran = False
        self.leaf_params: set[str] = set()  # parameters of leaf modules (grads reduced by the module's hook)
        self.leaf_grads: dict[str, tuple[Tensor, Tensor]] = {}  # param.grad waiting for that hook
        #: param_reduce_events: the work record after each bucket's reduction (its event), oldest first
        self.reduce_events: deque[int] = deque()

    # -- initialize -----------------------------------------------------------------------------------------
    def initialize(self, param_ids: dict[str, int]) -> None:
        L, P, b = self.L, self.P, self.b
        total = sum(self.part[k] for k in self.trained)
        if not self.offload_param:  # defragment
            cpu = P.host_alloc("zero3.defragment_cpu_buffer", b * total)
            for k in self.trained:
                L.free(self.partitions.pop(k))
            L.mark("defragment", EMPTY_CACHE)
            P.to_device("zero3.lp_param_buffer", b * total, "params_16bit")
            if not P.cpu_run:  # on the CPU accelerator the host buffer is the flat buffer
                P.free_host(cpu)
        else:  # _create_param_groups_fp16_flat_cpu_memory, _move_to_flat_buffer
            P.pin(P.host_alloc("zero3.fp16_partitioned_groups_flat (host)", b * total, "params_16bit"),
                  self.pin_memory)
            for k in self.trained:
                P.free_host(self.partitions.pop(k))
        lp_host = self.offload_param and not P.cpu_run
        converted = None  # the local ``converted``: the previous sub-group's dies when the name is rebound
        for n in self.groups:  # _create_fp32_partitions
            if self.nvme_opt:
                continue  # swappable: the fp32 partition lives on NVMe (the swapper's buffers are host memory)
            if self.offload_opt:
                conv = P.host_alloc("zero3.fp32_partition (converted)", FP32 * n, "master_params_fp32")
                if not lp_host and not P.cpu_run:  # GPU → host with a conversion: a host copy in the 16-bit dtype
                    P.free_host(P.host_alloc("zero3.fp16_to_host", b * n))
                P.free_host(converted)
                P.host_alloc("zero3.fp32_partition", FP32 * n, "master_params_fp32")
            else:
                # ``flat.to(device, dtype=fp32)`` returns the flat itself when it already is fp32 on this device
                # (fp32 training; fp32 adapters), then ``.clone()`` copies it. (The branch that would reuse the
                # flat as the fp32 partition compares ``tensor.device == self.device``, and the allocation trace of
                # an fp32 job, tr25-s5-024, shows the clone: one 860 MB allocation, kept.)
                conv = (None if self.b == FP32 and not lp_host else
                        L.alloc("zero3.fp32_partition (converted)", FP32 * n, "master_params_fp32"))
                if lp_host:  # host → GPU with a conversion: the fp32 copy made on the host
                    P.free_host(P.host_alloc("zero3.fp16_to_fp32_host", FP32 * n))
                P.free_dev(converted)
                L.alloc("zero3.fp32_partition", FP32 * n, "master_params_fp32")
            converted = conv
        if converted is not None:
            P.free_host(converted) if self.offload_opt else P.free_dev(converted)
        largest = max(self.groups)  # initialize_optimizer_states
        gbuf = (P.host_alloc("zero3.initial_grad", FP32 * largest) if self.offload_opt else
                L.alloc("zero3.initial_grad", FP32 * largest, "optimizer_step_transient"))
        if self.offload_opt and not self.nvme_opt:
            for n in self.groups:
                P.host_zeros("zero3.fp32_grad_partition (host)", FP32 * n, self.pin_memory, "gradients")
        P.free_host(gbuf) if self.offload_opt else L.free(gbuf)
        if self.contiguous:
            L.alloc("zero3.ipg_bucket", self.comm_b * self.rbs, "grad_bucket")  # one per communication dtype
        if self.offload_opt:
            P.host_zeros("zero3.grad_partitions_flat_buffer (host)", self.g * total, self.pin_memory, "gradients")
        else:
            L.alloc("zero3.grad_partitions_flat_buffer", self.g * total, "gradients")
        for k in self.trained:  # create_reduce_and_remove_grad_hooks: param.all_gather(), param.partition()
            self.gather_now([k], "gathered for its hook")
            self.P.free_dev(self.avail.pop(k))

    # -- gradients ----------------------------------------------------------------------------------------
    def on_param_grad(self, ag: Autograd, param: Tensor, grad: Tensor) -> None:
        """A parameter's fresh (whole) grad: reduced now by its hook, or, in a leaf module, kept as param.grad
        until the module's full backward hook (leaf_backward)."""
        name = param.param
        self.free_retained(name)  # its node released what it saved before AccumulateGrad ran
        ag.saved_param_views.discard(name)
        if name in self.leaf_params:
            self.leaf_grads[name] = (param, grad)
            return
        self._reduce_grad(ag, param, grad)

    def leaf_backward(self, ag: Autograd, module: str, params: tuple[Tensor, ...], inputs: tuple[Tensor, ...]
                      ) -> tuple[Tensor, ...]:
        """reduce_leaf_module_grads (stage3.py, a register_full_backward_hook on the leaf module): once the
        grads of the module's inputs are computed, each of its parameters in group order — a grad never made
        becomes ``torch.zeros_like(param)``, the gathered parameter's size — through
        reduce_ready_partitions_and_remove_grads."""
        names = tuple(dict.fromkeys(t.param for t in params))
        tensors = {t.param: t for t in params}
        self.leaf_params.update(names)
        self.leaf_modules.add(names)
        # the hook covers the leaf's parameters in the optimizer's groups (create_reduce_and_remove_grad_hooks
        # walks self.fp16_groups: the trainable ones); a frozen leaf (LoRA's base experts) registers none
        names = tuple(k for k in names if k in self.trainable)
        if not names:
            return inputs

        def reduce_leaf():
            for name in sorted(names, key=self.rank_of.__getitem__):
                param, grad = self.leaf_grads.pop(name, (tensors[name], None))
                if grad is None:
                    grad = ag.empty(f"{name}.zeros_grad", self.b * self.numel[name], component="gradients")
                self._reduce_grad(ag, param, grad)
        return tuple(ag.marker(x, reduce_leaf) if x.requires_grad else x for x in inputs)

    def _reduce_grad(self, ag: Autograd, param: Tensor, grad: Tensor) -> None:
        """reduce_independent_p_g_buckets_and_remove_grads for one parameter's grad."""
        name = param.param
        numel = self.numel[name]
        if self.bucket_elements + numel > self.rbs and self.bucket_elements > 0:
            self.reduce_bucket(ag)
        if self.contiguous and self.bucket_elements + numel <= self.rbs:
            # __add_grad_to_ipg_bucket: the reduce stream waits for the compute stream, copies the grad into the
            # bucket (in the communication dtype) and records it: param.grad.record_stream(the reduce stream)
            self.L.work(CPU_Z3_GRAD_S, 0.0, grad.nbytes + self.comm_b * numel, MEMORY)
            if grad.storage is not None:
                self.L.record_stream(grad.storage.tid, self.reduce_stream)
            ag.release(grad)  # copied into the bucket; param.grad views it
            self.bucket_params.append((name, None))
        else:
            self.bucket_params.append((name, grad))
        self.bucket_elements += numel

    def reduce_bucket(self, ag: Autograd) -> None:
        """__reduce_and_partition_ipg_grads (see the module docstring)."""
        if not self.bucket_params:
            return
        L, s = self.L, self.reduce_stream
        if len(self.reduce_events) > MAX_PARAM_REDUCE_EVENTS:  # param_reduce_events.popleft().synchronize()
            L.wait(self.reduce_events.popleft())
        bucket = sorted(self.bucket_params, key=lambda kv: self.rank_of[kv[0]])
        self.bucket_params, self.bucket_elements = [], 0
        casts = []
        if self.comm_b != self.b:  # full_grads_for_rank = [g.to(communication_data_type) ...]: a grad copied into
            # the IPG bucket (in the communication dtype: __add_grad_to_ipg_bucket's casting copy_) is already
            # of that dtype (``.to`` returns it); one that kept its own storage is cast
            casts = [L.alloc("zero3.grad_comm_cast", self.comm_b * self.numel[k], "grad_bucket", s)
                     for k, kept in bucket if kept is not None]
        single = len(bucket) == 1 and self.numel[bucket[0][0]] % self.n == 0
        if single:  # the one grad (or its cast) is reduce-scattered in place
            flat = casts.pop() if casts else None
        else:
            flat = L.alloc("zero3.reduce_scatter_flat", self.comm_b * sum(self.part[k] * self.n for k, _ in bucket),
                           "grad_bucket", s)
        for c in reversed(casts):
            L.free(c)
        parts = []
        if self.comm_b != self.g:  # grad_partitions_for_rank cast to the accumulation dtype; the flat dies
            parts = [L.alloc("zero3.grad_partition_cast", self.g * self.part[k], "grad_bucket", s) for k, _ in bucket]
            if flat is not None:
                L.free(flat)
                flat = None
        # the partitions view the grad itself: it lives until they die
        holds_grad = single and self.comm_b == self.b and self.comm_b == self.g
        # the reduction's kernels (the flat's copy and the partitions' adds)
        moved = sum(self.comm_b * self.part[k] * self.n + 2 * self.g * self.part[k] for k, _ in bucket)
        if self.offload_opt:  # the partitions then go over the host link on the reduce stream, in its order
            reduced = L.work(CPU_Z3_REDUCE_S, 0.0, moved, MEMORY)
            L.stream_wait(reduced, s)
        self._partition_grads(ag, bucket, holds_grad)
        for c in reversed(parts):
            L.free(c)
        if flat is not None:
            L.free(flat)
        if holds_grad and bucket[0][1] is not None:
            ag.release(bucket[0][1])
        # its event, recorded on the reduce stream after all of it
        self.reduce_events.append(L.work(0.0, stream=s) if self.offload_opt
                                  else L.work(CPU_Z3_REDUCE_S, 0.0, moved, MEMORY))

    def _partition_grads(self, ag: Autograd, bucket, holds_grad: bool) -> None:
        """partition_grads: each partition into grad_partitions_flat_buffer (via the GPU under offload)."""
        P, L, s = self.P, self.L, self.reduce_stream
        boundary = self.forwards % self.ga == 0
        staging = None
        nvme_fp32 = []
        for k, kept in bucket:
            P.free_dev(staging)  # the previous parameter's GPU copy: ``grad_buffer`` rebound
            staging = None
            n = self.part[k]
            if self.offload_opt:
                # micro-step 0: grad_buffer.copy_(grad_partition, non_blocking=True) into the pinned host buffer,
                # then back; later micro-steps: to the GPU, add, and back (one copy each way either way)
                L.work(0.0, 0.0, self.g * n, HOST_LINK, s)
                staging = P.to_device(f"{k} (grad partition on the GPU)", self.g * n, "offload_staging", s,
                                      blocking=False)  # grad_buffer.to(device, non_blocking=True)
                if boundary:  # _offload_grad_partition_at_boundary
                    left = n
                    while left > 0:  # _constant_buffered_norm2
                        piece = min(left, NORM_PIECE_ELEMENTS)
                        L.free(L.alloc("zero3.offload_norm_fp64", FP64 * piece, "offload_staging", s))
                        left -= piece
                    cast = L.alloc("zero3.offload_grad_fp32", FP32 * n, "offload_staging", s)
                    # the norm's fp64 upcast and its read, the fp32 cast (read and write)
                    L.work(0.0, 0.0, (self.g + 2 * FP64 + self.g + FP32) * n, MEMORY, s)
                    if not self.nvme_opt:  # fp32_grad_tensor.copy_(the cast, non_blocking=True) to the host
                        L.work(0.0, 0.0, FP32 * n, HOST_LINK, s)
                    nvme_fp32.append(cast) if self.nvme_opt else L.free(cast)
            if kept is not None:
                if kept.storage is not None:  # partition_grads: param.grad.record_stream(the reduce stream),
                    L.record_stream(kept.storage.tid, s)  # a grad its partitions view included
                if not holds_grad:
                    ag.release(kept)  # param.grad = None (one its partitions view dies with them)
        for c in nvme_fp32:  # after _swap_out_offload_fp32_gradients
            L.free(c)
        P.free_dev(staging)

    def end_backward(self, ag: Autograd, boundary: bool) -> None:
        """independent_gradient_partition_epilogue, then backward_epilogue (release_backward_leftovers)."""
        self.reduce_bucket(ag)
        self.epilogue_ran = True
        self.release_leftovers()

    def start_forward(self) -> None:
        """The engine's forward: clear_backward_seen_flag (micro_step_id + 1 after a backward), the root
        module's pre-hooks (reset_step, then its fetch_sub_module: DeepSpeedZeRoOffload registers the
        coordinator's hooks on every module, parameters or not), then the base model's (``*ForCausalLM.model``)
        fetch: neither has parameters of its own, but with a complete trace each fetch prefetches."""
        if self.epilogue_ran:
            self.micro += 1
            self.epilogue_ran = False
        self.forwards += 1
        self.reset_step()
        for _ in range(2 + self.wrapper_modules):  # the root, peft's wrappers (program.engine_for), the base model
            self.fetch(())

    # -- step -------------------------------------------------------------------------------------------
    def _overflow_check(self) -> None:
        """fp16: has_overflow over grad_partitions_flat_buffer (in the grad-accumulation dtype): torch.isinf is
        ``self.abs() == inf`` (ATen TensorCompare.cpp isinf: a copy in the buffer's dtype, then a bool per
        element, the copy freed first), torch.isnan ``self != self`` (a bool per element)."""
        if not self.fp16:
            return
        total = sum(self.part[k] for k in self.trained)
        if self.offload_opt:
            alloc, free = self.P.host_alloc, self.P.free_host
        else:
            def alloc(name, nbytes):
                return self.L.alloc(name, nbytes, "optimizer_step_transient", self.reduce_stream)
            free = self.L.free
        absolute = alloc("zero3.isinf.abs", self.g * total)
        inf = alloc("zero3.isinf", total)
        free(absolute)
        free(inf)
        free(alloc("zero3.isnan", total))

    def skip(self, ag: Autograd) -> None:
        """An overflowing fp16 step: parameters partitioned, then step() returns before the optimizer."""
        self.micro, self.epilogue_ran = 0, False
        self.partition_all()
        self._overflow_check()

    def step(self, first: bool) -> None:
        L, P = self.L, self.P
        self.micro, self.epilogue_ran = 0, False  # _pre_step
        self.partition_all()
        self._overflow_check()
        if not self.offload_opt:
            for k in self.trained:  # _get_norm_groups → get_grad_norm_direct: each grad partition in fp64
                L.free(L.alloc("zero3.norm_fp64", FP64 * self.part[k], "optimizer_step_transient"))
            # torch.sum(torch.pow(torch.stack(grad_norms), 2)): one fp64 norm per parameter
            stack = L.alloc("zero3.stacked_norms", FP64 * len(self.trained), "optimizer_step_transient")
            power = L.alloc("zero3.stacked_norms_pow", FP64 * len(self.trained), "optimizer_step_transient")
            L.free(stack)
            L.free(power)
        lp_host = self.offload_param and not P.cpu_run
        for i, n in enumerate(self.groups):
            fp32 = None
            if not self.offload_opt:  # _prepare_fp32_grad_for_sub_group: flatten, then .to(fp32)
                flat = L.alloc("zero3.flat_grad_sub_group", self.g * n, "optimizer_step_transient")
                fp32 = flat
                if self.g != FP32:
                    fp32 = L.alloc("zero3.fp32_grad_sub_group", FP32 * n, "optimizer_step_transient")
                    L.free(flat)
            self.opt.step(L, n, first, i)
            if self.offload_opt and not lp_host and not P.cpu_run:
                P.free_host(P.host_alloc("zero3.fp32_to_16bit_host", self.b * n))  # host → GPU, converted
            elif not self.offload_opt and lp_host:
                P.free_host(P.host_alloc("zero3.fp32_on_host", FP32 * n))  # GPU → host, converted
            if fp32 is not None:
                L.free(fp32)  # _release_sub_group
        self.gather_persistent()
