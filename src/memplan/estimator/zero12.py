"""ZeRO stages 1 and 2 (DeepSpeed 0.19.8 runtime/zero/stage_1_and_2.py, DeepSpeedZeroOptimizer) as ledger events.

Init: the cache is emptied, then the 16-bit parameters are flattened into one buffer per group
(flatten_dense_tensors_aligned: padded to ``nccl_start_alignment_factor`` (2) × N elements) and each parameter's own
storage is freed (_update_model_bit16_weights points it into the flat buffer); the rank's partition is cloned and cast
to the fp32 master (single_partition_of_fp32_groups); initialize_optimizer_states makes and drops a zero fp32 grad.
Backward: the first gradient hook allocates the IPG bucket (setup_buckets: reduce_bucket_size elements, two with
overlap_comm); each parameter's grad is copied into it and freed (reduce_independent_p_g_buckets_and_remove_grads); a
bucket that would overflow is reduced first (reduce_ipg_grads → average_tensor: slices of each parameter by
destination partition, flattened per small bucket when there are several → allreduce_bucket, on the reduction stream
with overlap_comm); the grads of parameters that overlap this rank's partition are copied into ``grads_in_partition``
(allocated at the first such copy, whole parameters: copy_grads_in_partition). Stage 1 keeps the full 16-bit grads
through backward and reduces them all at the boundary (reduce_gradients). At the end of backward the buckets are
released (_release_ipg_buffers). Step (step): the norm upcasts each partition piece to fp64 in turn
(get_grad_norm_direct), the partition is flattened (16-bit) and cast to fp32, grads_in_partition dropped, the
optimizer runs (states created at its first step), the fp32 grad dropped.

Symbols: P the group's trainable parameters, N the partition group, b bytes of the 16-bit dtype.
"""

from __future__ import annotations

from ..ledger import EMPTY_CACHE, Ledger
from .autograd import Autograd, Tensor
from .flat_groups import FlatGroup
from .optim import Optimizer
from .timing import MEMORY

#: the stream DeepSpeed's reduction work runs on with overlap_comm (reduction_stream, a new CUDA stream)
REDUCTION_STREAM = 1
FP32, FP64 = 4, 8


class Zero12:
    """The DeepSpeedZeroOptimizer's allocations (see the module docstring)."""

    def __init__(self, ledger: Ledger, stage: int, groups: list[FlatGroup], b: int, reduce_bucket: int,
                 overlap_comm: bool, grad_accum: int, optimizer: Optimizer, comm_bytes: int | None = None,
                 offload: bool = False, pipeline: bool = False, compact: bool = False):
        self.L, self.stage, self.groups, self.b = ledger, stage, groups, b
        self.rbs, self.overlap, self.ga, self.opt = reduce_bucket, overlap_comm, grad_accum, optimizer
        self.comm_b = comm_bytes or b  # allreduce_bucket's dtype: fp32 under Ulysses (program.engine_for)
        self.index = {n: (g, i) for g, grp in enumerate(groups) for i, n in enumerate(grp.names)}
        self.masters: list[int] = []
        self.bucket: list[int] = []  # ledger ids of the IPG buffers
        self.bucket_index = 0  # the buffer being filled (bucket.index: swapped after each reduction with overlap_comm)
        self.bucket_params: list[tuple[str, Tensor | None]] = []  # (name, grad kept outside the bucket)
        self.bucket_elements = 0
        self.grads_in_partition: int | None = None
        self.micro_partition: int | None = None  # a later micro-step's own grads_in_partition (see _copy_to_partition)
        self.held: dict[str, Tensor] = {}  # stage 1 / accumulation: param.grad kept whole
        self.micro = 0
        self.stream = REDUCTION_STREAM if overlap_comm else 0
        self.offload = offload  # offload_optimizer: fp32 master, grads and states live on the host
        #: under a PipelineEngine reduce_gradients(pipeline_parallel=True) allocates one more IPG buffer (with
        #: contiguous_gradients: "with PP we must create ipg buffer, since backward is handled outside zero")
        self.pipeline = pipeline
        #: stage 2 with fp32 accumulation of 16-bit grads (_use_compact_grad_partition_buffer, offloaded or not):
        #: the reduced grads are added, cast to fp32, into a compact fp32 partition on the GPU
        #: (_build_compact_grad_partition_buffer: zeros of the partition, at the first reduction of one of its
        #: slices, until the step) and copy_grads_in_partition returns at once (no grads_in_partition)
        self.compact = compact and stage == 2
        self.compact_buffer: int | None = None

    # -- init -------------------------------------------------------------------------------------------
    def initialize(self, param_ids: dict[str, int]) -> None:
        """Flatten each group (params' own storages freed), clone the partition to fp32, test-zero its grad."""
        L, b = self.L, self.b
        for grp in self.groups:
            # __init__ empties the cache before each group's flat buffer (deepspeed.runtime.utils.empty_cache:
            # cached blocks the model's build left, such as a tied lm_head's own weight, go back to the driver)
            L.mark("zero.empty_cache", EMPTY_CACHE)
            L.alloc("zero.bit16_groups_flat", b * grp.padded, "params_16bit")
            for name in grp.names:
                if name in param_ids:
                    L.free(param_ids.pop(name))
        for grp in self.groups:  # .detach().clone().to(device=self.device, dtype=fp32): host under offload
            if b == FP32 and not self.offload:  # .to() of an fp32 clone on its device returns the clone itself
                self.masters.append(L.alloc("zero.single_partition_of_fp32_groups", FP32 * grp.partition,
                                            "master_params_fp32"))
                continue
            clone = L.alloc("zero.partition_clone", b * grp.partition, "master_params_fp32")
            if not self.offload:
                self.masters.append(L.alloc("zero.single_partition_of_fp32_groups", FP32 * grp.partition,
                                            "master_params_fp32"))
            L.free(clone)
        if self.offload:  # temp_grad_buffer_for_gpu_offload: zeros [largest parameter] on the GPU
            largest = max(n for grp in self.groups for n in grp.numels)
            L.alloc("zero.temp_grad_buffer_for_gpu_offload", b * largest, "offload_staging")
            return
        for grp in self.groups:  # initialize_optimizer_states: a zero fp32 grad, dropped again
            L.free(L.alloc("zero.initial_grad", FP32 * grp.partition, "optimizer_step_transient"))

    # -- backward -------------------------------------------------------------------------------------
    def _setup_buckets(self) -> None:
        if not self.bucket:
            self.bucket_index = 0
            for _ in range(2 if self.overlap else 1):
                self.bucket.append(self.L.alloc("zero.ipg_bucket", self.b * self.rbs, "grad_bucket"))

    def on_param_grad(self, ag: Autograd, param: Tensor, grad: Tensor) -> None:
        """AccumulateGrad then DeepSpeed's grad hook (process_gradients) for one parameter's fresh grad."""
        name = param.param
        if name not in self.index:  # frozen: no hook
            ag.release(grad)
            return
        old = self.held.get(name)
        if old is not None:  # param.grad += grad (in place): the new one dies
            ag.release(grad)
            grad = old
        self._setup_buckets()
        if self.stage == 1:
            self.held[name] = grad  # stage 1: reduced at the boundary (reduce_gradients)
            return
        self._bucket_param(ag, name, grad)

    def _bucket_param(self, ag: Autograd, name: str, grad: Tensor) -> None:
        g, i = self.index[name]
        numel = self.groups[g].numels[i]
        if self.bucket_elements + numel > self.rbs:
            self.reduce_ipg_grads(ag)
            if self.overlap:  # contiguous_gradients and overlap_comm: the other buffer fills next
                self.bucket_index = 1 - self.bucket_index
        if numel > self.rbs:  # extra_large_param_to_reduce: its own grad is reduced, not copied
            if self.offload:  # _offload_gradient_safety_enabled: grad.data = grad.detach().clone() first
                clone = ag.empty("zero.extra_large_grad_clone", grad.nbytes, component="gradients")
                ag.release(grad)
                grad = clone
            self.bucket_params.append((name, grad))
        else:
            ag.release(grad)  # copied into the bucket; param.grad now views the bucket
            self.bucket_params.append((name, None))
        self.bucket_elements += numel

    def reduce_ipg_grads(self, ag: Autograd) -> None:
        """average_tensor on the bucket's contents, then each parameter's grad to its partition or dropped."""
        if not self.bucket_params:
            return
        self._on_reduction_stream()
        if self.compact and self.offload:
            self._reduce_into_compact(ag)
            return
        if self.compact:
            self._scatter_into_compact(ag)
            return
        s = self.stream
        for small in self._small_buckets(self._pieces(local_apart=False)):
            self._allreduce(small, sum(n for _, n, _ in small), s)
        for name, kept in self.bucket_params:
            g, i = self.index[name]
            if self.groups[g].in_partition(i):
                if self.offload:
                    self._offload_piece(self.groups[g].overlap(i))
                else:
                    self._copy_to_partition()
            if kept is not None:
                ag.release(kept)
        self.bucket_params, self.bucket_elements = [], 0

    def _on_reduction_stream(self) -> None:
        """average_tensor's kernels (the gradient average, ``tensor.div_``, in place over the reduced tensor) and,
        with overlap_comm, the reduced tensor used on the reduction stream: the whole of it under cpu_offload
        (_record_gradient_stream(tensor, reduction_stream): _offload_gradient_safety_enabled), else each slice bound
        for this rank (allreduce_and_copy_with_multiple_ranks: ``buf.record_stream(self.reduction_stream)``). The
        reduced tensor is the IPG buffer being filled, or an extra-large parameter's own grad alone in the bucket;
        either is then freed (_release_ipg_buffers, param.grad = None) where the caching allocator reuses it only
        once the GPU has run the reduction (estimator.gpu_time). The reduction stream and the compute stream wait
        for each other around it (average_tensor's wait_stream both ways), so it runs in the compute queue here."""
        L = self.L
        L.work(0.0, 0.0, 2 * self.b * self.bucket_elements, MEMORY)
        if not self.overlap:
            return
        local = any(self.groups[g].in_partition(i) for g, i in (self.index[n] for n, _ in self.bucket_params))
        if not (self.offload or local):
            return
        name, kept = self.bucket_params[0]
        if kept is not None:
            if kept.storage is not None:
                L.record_stream(kept.storage.tid, REDUCTION_STREAM)
        elif self.bucket:
            L.record_stream(self.bucket[self.bucket_index], REDUCTION_STREAM)

    def _allreduce(self, small: list, elements: int, stream: int, local: tuple[int, ...] = ()) -> None:
        """allreduce_bucket: flatten (a copy when there are several slices), cast to fp32 for Ulysses; ``local``:
        the elements of each slice of this rank's compact fp32 partition it adds into, each cast to fp32 first
        (_add_to_grad_partition_buffer: ``output.add_(source.to(output.dtype))``) while the flat copy lives."""
        L = self.L
        flat = L.alloc("zero.allreduce_flat", self.b * elements, "grad_bucket", stream) if len(small) > 1 else None
        if self.comm_b != self.b:
            L.free(L.alloc("zero.allreduce_fp32", self.comm_b * elements, "grad_bucket", stream))
        for n in local:
            L.free(L.alloc("zero.compact_add_fp32", FP32 * n, "grad_bucket", stream))
        if flat is not None:
            L.free(flat)

    def _reduce_into_compact(self, ag: Autograd) -> None:
        """average_tensor with the compact fp32 partition: the partition built at the first reduction that holds a
        slice of this rank's partition (_get_compact_grad_partition_slice, for the local partition only); the
        bucket's slices grouped by destination rank (rank_and_offsets → buckets per ("reduce", dst)), each group's
        slices all-reduced in buckets of reduce_bucket_size elements (allreduce_no_retain), this rank's slices
        added into the partition; then, at the boundary, copy_grads_in_partition per parameter in the partition
        (its slice's fp64 norm; the copy to the host's fp32 grad allocates nothing on the GPU)."""
        L, s = self.L, self.stream
        by_dst: dict[int, list[int]] = {}
        for name, _ in self.bucket_params:
            g, i = self.index[name]
            for dst, n in self.groups[g].slices(i):
                by_dst.setdefault(dst, []).append(n)
        rank = self.groups[0].rank
        if self.compact_buffer is None and rank in by_dst:  # built by the first slice of this rank's partition
            part = sum(grp.partition for grp in self.groups)
            self.compact_buffer = L.alloc("zero.compact_grad_partition", FP32 * part, "gradients", s)
        for dst, pieces in by_dst.items():
            small: list[int] = []
            count = 0
            for n in pieces:
                small.append(n)
                count += n
                if count > self.rbs:
                    self._allreduce(small, count, s, tuple(small) if dst == rank else ())
                    small, count = [], 0
            if small:
                self._allreduce(small, sum(small), s, tuple(small) if dst == rank else ())
        for name, kept in self.bucket_params:
            g, i = self.index[name]
            n = self.groups[g].overlap(i)
            if n and self.micro + 1 >= self.ga:  # the boundary: set_norm of the slice in fp64
                L.free(L.alloc("zero.offload_norm_fp64", FP64 * n, "offload_staging", s))
            if kept is not None:
                ag.release(kept)
        self.bucket_params, self.bucket_elements = [], 0

    def _scatter_into_compact(self, ag: Autograd) -> None:
        """average_tensor with the compact fp32 partition on the GPU (use_multi_rank_bucket_allreduce, DeepSpeed's
        default: every slice under the one ("allreduce", group) key). rank_and_offsets merges consecutive slices
        bound for one other rank; a slice of this rank's partition stays apart with its output, the partition's
        slice (_get_compact_grad_partition_slice builds the partition at the first one, before any reduction).
        allreduce_and_scatter then reduces buckets of more than reduce_bucket_size elements
        (allreduce_and_copy_with_multiple_ranks: a flat copy of several slices) and adds each local slice, cast
        to fp32, into the partition; copy_grads_in_partition returns at once."""
        L, s = self.L, self.stream
        pieces = self._pieces(local_apart=True)
        if self.compact_buffer is None and any(local for _, _, local in pieces):
            part = sum(grp.partition for grp in self.groups)
            self.compact_buffer = L.alloc("zero.compact_grad_partition", FP32 * part, "gradients", s)
        for small in self._small_buckets(pieces):
            self._allreduce(small, sum(n for _, n, _ in small), s, tuple(n for _, n, local in small if local))
        for _, kept in self.bucket_params:
            if kept is not None:
                ag.release(kept)
        self.bucket_params, self.bucket_elements = [], 0

    def _pieces(self, local_apart: bool) -> list[list]:
        """The bucket's slices as average_tensor's rank_and_offsets lists them, [destination, elements, local]:
        consecutive slices bound for one rank merged, except (``local_apart``, a compact fp32 partition) a slice
        of this rank's own partition, which keeps its own output."""
        rank = self.groups[0].rank
        pieces: list[list] = []
        for name, _ in self.bucket_params:
            g, i = self.index[name]
            for dst, n in self.groups[g].slices(i):
                if pieces and pieces[-1][0] == dst and not (local_apart and dst == rank):
                    pieces[-1][1] += n
                else:
                    pieces.append([dst, n, dst == rank])
        return pieces

    def _small_buckets(self, pieces: list[list]):
        """allreduce_and_scatter's small buckets: pieces gathered until they hold more than reduce_bucket_size
        elements, then the rest."""
        small: list[list] = []
        count = 0  # a running total: at 2**18 ranks a bucket has that many slices (tests/test_hostile_counts.py)
        for piece in pieces:
            small.append(piece)
            count += piece[1]
            if count > self.rbs:
                yield small
                small, count = [], 0
        if small:
            yield small

    def _offload_piece(self, n: int) -> None:
        """copy_grads_in_partition under cpu_offload at the boundary: set_norm_for_param_grad_in_gpu (the piece
        in fp64) and async_inplace_copy_grad_to_fp32_buffer_from_gpu (the piece cast to fp32, copied out)."""
        L, s = self.L, self.stream
        L.free(L.alloc("zero.offload_norm_fp64", FP64 * n, "offload_staging", s))
        L.free(L.alloc("zero.offload_grad_fp32", FP32 * n, "offload_staging", s))

    def _copy_to_partition(self) -> None:
        """copy_grads_in_partition: allocates grads_in_partition (whole parameters that overlap this rank's
        partition) at its first copy when it is None. _release_ipg_buffers sets it to None at the end of every
        backward, so under stage 2 a later micro-step of the accumulation window allocates a fresh one while the
        first one's storage lives on in the epilogue's all_grad_tensors views (ipg_epilogue
        get_all_grad_tensors); the fresh one dies with the backward (the H200 trace of s4-023: 2.32 GiB allocated
        in the boundary micro-step's first copy, freed after the bucket, the first kept into the step)."""
        if self.grads_in_partition is None:
            self.grads_in_partition = self.L.alloc("zero.grads_in_partition", self._partition_grad_bytes(),
                                                   "gradients", self.stream)
        elif self.stage == 2 and self.micro > 0 and self.micro_partition is None:
            self.micro_partition = self.L.alloc("zero.grads_in_partition (micro-step)",
                                                self._partition_grad_bytes(), "gradients", self.stream)

    def _partition_grad_bytes(self) -> int:
        """grads_in_partition's bytes: every parameter that overlaps this rank's partition, whole."""
        return self.b * sum(grp.numels[i] for grp in self.groups for i in range(len(grp.numels))
                            if grp.in_partition(i))

    def end_backward(self, ag: Autograd, boundary: bool) -> None:
        """The backward epilogue: stage 2 reduces the rest and releases the buckets; stage 1 reduces
        everything at the boundary (reduce_gradients) in parameter order."""
        if self.stage == 1:
            if not boundary:
                return
            if self.pipeline:
                self.bucket.append(self.L.alloc("zero.ipg_bucket (pipeline)", self.b * self.rbs, "grad_bucket"))
            for grp in self.groups:
                for name in grp.names:
                    grad = self.held.pop(name, None)
                    if grad is not None:
                        self._bucket_param(ag, name, grad)
        self.reduce_ipg_grads(ag)
        for tid in self.bucket:
            self.L.free(tid)
        self.bucket = []
        if self.micro_partition is not None:
            self.L.free(self.micro_partition)
            self.micro_partition = None
        self.micro += 1

    # -- step -----------------------------------------------------------------------------------------
    def _drop_grads_in_partition(self) -> None:
        if self.grads_in_partition is not None:
            self.L.free(self.grads_in_partition)
            self.grads_in_partition = None

    def skip(self, ag: Autograd) -> None:
        """An overflowing fp16 step: grads set to None, grads_in_partition kept for the next step."""
        self.micro = 0

    def step(self, first: bool) -> None:
        """DeepSpeedZeroOptimizer.step at a boundary."""
        L, b = self.L, self.b
        if self.offload:  # the norm and the optimizer run on the host (DeepSpeedCPUAdam)
            if self.compact_buffer is not None:  # averaged_gradients dropped with the step
                L.free(self.compact_buffer)
                self.compact_buffer = None
            self.micro = 0
            return
        for grp in self.groups:  # scaled_global_norm → get_grad_norm_direct: one fp64 piece at a time
            for i in range(len(grp.numels)):
                n = grp.overlap(i)
                if n:
                    L.free(L.alloc("zero.norm_fp64", FP64 * n, "optimizer_step_transient"))
        if self.compact:  # _get_preflattened_grad_partition: the compact fp32 partition is the fp32 grad itself
            for g, grp in enumerate(self.groups):
                self.opt.step(L, grp.partition, first, g)
            if self.compact_buffer is not None:  # averaged_gradients dropped with the step
                L.free(self.compact_buffer)
                self.compact_buffer = None
            self.micro = 0
            return
        last = len(self.groups) - 1
        for g, grp in enumerate(self.groups):
            # get_flat_partition lists this rank's piece of each parameter (and a zero pad up to the partition);
            # _flatten_dense_tensors views a list of one tensor and concatenates (allocates) several
            flat = (L.alloc("zero.flat_grad_partition", b * grp.partition, "optimizer_step_transient")
                    if grp.partition_pieces() > 1 else None)
            # .to(fp32): a new tensor from a 16-bit flat, the flat itself when it is fp32 already
            fp32 = (L.alloc("zero.single_grad_partition", FP32 * grp.partition, "optimizer_step_transient")
                    if b != FP32 else flat)
            if flat is not None and flat != fp32:
                L.free(flat)
            # the params' grads and averaged_gradients let go of grads_in_partition (one buffer for every group;
            # _release_ipg_buffers dropped its own reference); an fp32 grad that views it holds it to its step
            view = fp32 is None
            if g == last and not view:
                self._drop_grads_in_partition()
            self.opt.step(L, grp.partition, first, g)
            if not view:
                L.free(fp32)
            elif g == last:
                self._drop_grads_in_partition()
        self.micro = 0
