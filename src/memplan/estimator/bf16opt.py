"""DeepSpeed 0.19.8's BF16_Optimizer (runtime/bf16_optimizer.py) as ledger events.

The engine picks it (engine.py _do_optimizer_sanity_check) for bf16 with ZeRO stage 1, fp32 gradient
accumulation (data_types.grad_accum_dtype) and no optimizer offload — and, outside the ledger's scope, for bf16
under pipeline parallelism at stage 0. _setup_for_real_optimizer, per parameter group:

- the 16-bit parameters flattened, padded to nccl_start_alignment_factor (2) × N elements (align_dense_tensors:
  a zero pad tensor, then ``_flatten_dense_tensors``; the pad dies after the flatten), and each parameter pointed
  into the flat buffer (_update_storage_to_flattened_tensor: its own storage freed);
- the rank's partition cloned and cast to fp32 (``partition.clone().float()``: the clone dies);
- a FULL-size gradient buffer in the accumulation dtype (``torch.zeros_like(flat, dtype=grad_acc_dtype)``).

Backward (bfloat16.immediate_grad_update off, its default): the 16-bit grads accumulate whole as param.grad
(backward_prologue zeroes them in place: clear_lp_grads); backward_epilogue → update_hp_grads adds each one,
cast to the accumulation dtype (``lp.grad.to(fp32)``, a temporary; none when it is bf16, as under pipeline
parallelism at stage 0), into the buffer. At the boundary the engine all-reduces that
buffer (allreduce_gradients → buffered_allreduce_fallback → allreduce_bucket: the single tensor flattened in
place, cast to the communication dtype — bf16 — for the all-reduce, copied back). Step: the norm of the fp32
grads (get_global_norm_of_tensors: ``torch.stack(norms).pow(2)``, 4 bytes per parameter; each grad cast to fp32
first when the buffer is bf16), the optimizer on the fp32 partition (its grad a view of the buffer, or a cast of
it to fp32 when the buffer is bf16; states at the first step), the 16-bit partition copied back and
all-gathered in place, the buffer zeroed; the engine's zero_grad sets the 16-bit grads to None.

Symbols: P the trainable parameters, N the data-parallel group, b = 2 (bf16), g the accumulation dtype's bytes.
"""

from __future__ import annotations

from ..ledger import Ledger
from .autograd import Autograd, Tensor
from .optim import Optimizer
from .flat_groups import NCCL_START_ALIGNMENT_FACTOR

FP32 = 4


class BF16Optimizer:
    """BF16_Optimizer over one parameter group (see the module docstring)."""

    def __init__(self, ledger: Ledger, names: list[str], numels: list[int], b: int, g: int, comm_b: int, n: int,
                 optimizer: Optimizer):
        self.L, self.names, self.numels, self.b, self.g, self.comm_b, self.opt = (
            ledger, names, numels, b, g, comm_b, optimizer)
        total = sum(numels)
        align = NCCL_START_ALIGNMENT_FACTOR * n
        self.padded = -(-total // align) * align
        self.pad = self.padded - total
        self.partition = self.padded // n
        self.grads: dict[str, Tensor] = {}

    def initialize(self, param_ids: dict[str, int]) -> None:
        L, b = self.L, self.b
        pad = L.alloc("bf16_optimizer.alignment_pad", b * self.pad, "params_16bit") if self.pad else None
        L.alloc("bf16_optimizer.bf16_groups_flat", b * self.padded, "params_16bit")
        if pad is not None:
            L.free(pad)
        for name in self.names:
            if name in param_ids:
                L.free(param_ids.pop(name))
        clone = L.alloc("bf16_optimizer.partition_clone", b * self.partition, "master_params_fp32")
        L.alloc("bf16_optimizer.fp32_groups_flat_partition", FP32 * self.partition, "master_params_fp32")
        L.free(clone)
        L.alloc("bf16_optimizer.fp32_groups_gradients_flat", self.g * self.padded, "gradients")

    def on_param_grad(self, ag: Autograd, param: Tensor, grad: Tensor) -> None:
        if param.param not in self.grads:
            self.grads[param.param] = grad  # AccumulateGrad steals the first grad
        else:
            ag.release(grad)  # param.grad (zeroed by backward_prologue) += grad in place

    def end_backward(self, ag: Autograd, boundary: bool) -> None:
        """backward_epilogue (update_hp_grads), then the engine's all-reduce at the boundary."""
        L = self.L
        if self.g != self.b:  # hp_grad.add_(lp.grad.to(hp_grad.dtype)): a cast unless the dtypes agree
            for name, numel in zip(self.names, self.numels):
                if name in self.grads:
                    L.free(L.alloc("bf16_optimizer.lp_grad_fp32", self.g * numel, "optimizer_step_transient"))
        if boundary and self.comm_b != self.g:  # allreduce_bucket: tensor.to(communication_data_type)
            L.free(L.alloc("engine.allreduce_cast", self.comm_b * self.padded, "grad_bucket"))

    def skip(self, ag: Autograd) -> None:
        self._zero_grad(ag)

    def _zero_grad(self, ag: Autograd) -> None:
        for name in self.names:  # zero_grad(set_to_none=True): clear_lp_grads in parameter order
            g = self.grads.pop(name, None)
            if g is not None:
                ag.release(g)

    def step(self, ag: Autograd, first: bool) -> None:
        L = self.L
        if self.g != FP32:  # get_global_norm_of_tensors: tensor.detach().float().norm() of each hp grad
            for numel in self.numels:
                L.free(L.alloc("bf16_optimizer.norm_grad_fp32", FP32 * numel, "optimizer_step_transient"))
        count = len(self.names)  # torch.stack(all_norms).pow(norm_type)
        stack = L.alloc("bf16_optimizer.stacked_norms", FP32 * count, "optimizer_step_transient")
        power = L.alloc("bf16_optimizer.stacked_norms_pow", FP32 * count, "optimizer_step_transient")
        L.free(stack)
        L.free(power)
        # param_partition.grad = grad_partition.to(fp32) when the accumulation dtype is not fp32 (set to None
        # after the optimizer's step)
        cast = (L.alloc("bf16_optimizer.grad_partition_fp32", FP32 * self.partition, "optimizer_step_transient")
                if self.g != FP32 else None)
        self.opt.step(L, self.partition, first)
        if cast is not None:
            L.free(cast)
        self._zero_grad(ag)
