"""No ZeRO: DeepSpeed's FP16_Optimizer (fp16, and DDP_BFLOAT16 for bf16; runtime/fp16/fused_optimizer.py) or
FP16_UnfusedOptimizer (runtime/fp16/unfused_optimizer.py), and a plain torch optimizer in fp32, as ledger events.
DeepSpeedEngine._configure_fp16_optimizer takes the fused one only when the basic optimizer is a FusedAdam
(memplan's adamw); SGD, FusedLion and torch's AdamW run unfused.

FP16_Optimizer.__init__ flattens each group from clones of its parameters (``_flatten_dense_tensors([p.clone()
…])``: the clones live until the flat buffer is made), points the parameters into the flat buffer (their own
storages die), and clones the flat buffer to an fp32 master (``.clone().float()``). initialize_optimizer_states
runs one optimizer step on a zero fp32 grad, so the optimizer states exist from init. Backward keeps the 16-bit
grads as ``param.grad`` (accumulating in place over micro-steps). step(): each grad cast to fp32
(``p.grad.to(fp32)``), all of them flattened into one fp32 grad, the 16-bit grads dropped, the optimizer run,
the fp32 grad dropped.

FP16_UnfusedOptimizer.__init__ keeps the 16-bit parameters and makes an fp32 copy of each (``p.clone().float()``:
the clone dies as the copy is made); initialize_optimizer_states gives every 16-bit and every fp32 parameter a
zero grad, runs the optimizer once (its states, tensor by tensor) and drops those grads. step(): the grad norm
takes each 16-bit grad's fp32 copy in turn (get_weight_norm: ``p.data.float().norm()``), each grad is cast to
its fp32 parameter's .grad (all alive), the optimizer runs over the fp32 tensors, their grads are dropped, and
the engine's zero_grad drops the 16-bit ones. The engine's allreduce at the boundary (allreduce_gradients →
buffered_allreduce_fallback → allreduce_no_retain) walks the grads in parameter order and flattens each bucket (a copy;
a bucket of one grad is viewed, not copied) once it holds more than MEMORY_OPT_ALLREDUCE_SIZE elements, whatever the
config's bucket sizes say. It runs whenever the engine has a process group (every launch with more than one rank,
data parallel or not: a pipeline of two stages and no data parallelism still flattens, trace19-s10-055: 1.88 GiB in
its reduce_grads); a one-GPU verify run has none (DeepSpeedEngine: dist_backend None → enable_backward_allreduce off).
"""

from __future__ import annotations

from ..ledger import Ledger
from .autograd import Autograd, Tensor
from .optim import Optimizer, fused_fp16_optimizer

FP32 = 4
#: engine.py MEMORY_OPT_ALLREDUCE_SIZE: allreduce_gradients' bucket_size (the backward's call and PipelineEngine's
#: _exec_reduce_grads pass no other)
MEMORY_OPT_ALLREDUCE_SIZE = 500_000_000


class Zero0:
    """FP16_Optimizer / DDP_BFLOAT16 (``mixed``), or a plain torch optimizer in fp32."""

    def __init__(self, ledger: Ledger, names: list[str], numels: list[int], b: int, optimizer: Optimizer,
                 world: int):
        self.L, self.names, self.numels, self.b, self.opt = ledger, names, numels, b, optimizer
        self.mixed = b < FP32
        self.fused = fused_fp16_optimizer(optimizer.kind)
        self.world = world
        self.grads: dict[str, Tensor] = {}
        self.total = sum(numels)

    def initialize(self, param_ids: dict[str, int]) -> None:
        L, b = self.L, self.b
        if not self.mixed:
            return
        if not self.fused:
            for n in self.numels:
                clone = L.alloc("fp16_unfused.param_clone", b * n, "params_16bit")
                L.alloc("fp16_unfused.fp32_param", FP32 * n, "master_params_fp32")
                L.free(clone)
            grads = [L.alloc("fp16_unfused.initial_grad", b * n, "optimizer_step_transient") for n in self.numels]
            grads += [L.alloc("fp16_unfused.initial_grad_fp32", FP32 * n, "optimizer_step_transient")
                      for n in self.numels]
            self.opt.step_tensors(L, self.numels)
            for g in grads:
                L.free(g)
            return
        clones = [L.alloc("fp16_optimizer.param_clone", b * n, "params_16bit") for n in self.numels]
        L.alloc("fp16_optimizer.fp16_groups_flat", b * self.total, "params_16bit")
        for c in clones:
            L.free(c)
        for name in self.names:
            if name in param_ids:
                L.free(param_ids.pop(name))
        clone = L.alloc("fp16_optimizer.flat_clone", b * self.total, "master_params_fp32")
        L.alloc("fp16_optimizer.fp32_groups_flat", FP32 * self.total, "master_params_fp32")
        L.free(clone)
        grad = L.alloc("fp16_optimizer.initial_grad", FP32 * self.total, "optimizer_step_transient")
        self.opt.step(L, self.total, True)
        L.free(grad)

    def on_param_grad(self, ag: Autograd, param: Tensor, grad: Tensor) -> None:
        old = self.grads.get(param.param)
        if old is None:
            self.grads[param.param] = grad  # AccumulateGrad steals the first grad
        else:
            ag.release(grad)  # param.grad += grad in place

    def end_backward(self, ag: Autograd, boundary: bool) -> None:
        if not (boundary and self.world > 1):  # engine.allreduce_gradients → buffered_allreduce_fallback
            return
        count = tensors = 0
        for n in self.numels:  # allreduce_no_retain: a bucket goes once it holds more than numel_per_bucket
            count, tensors = count + n, tensors + 1
            if count > MEMORY_OPT_ALLREDUCE_SIZE:
                self._flatten(count, tensors)
                count = tensors = 0
        if tensors:
            self._flatten(count, tensors)

    def _flatten(self, elements: int, tensors: int) -> None:
        """allreduce_bucket's ``self.flatten(bucket)``: a new flat tensor, dropped after the copy back (one grad is
        viewed)."""
        if tensors > 1:
            self.L.free(self.L.alloc("engine.allreduce_flat", self.b * elements, "grad_bucket"))

    def skip(self, ag: Autograd) -> None:
        """An overflowing fp16 step: FP16_Optimizer drops the 16-bit grads and returns (_skip_invalid_grad_norm)."""
        for g in self.grads.values():
            ag.release(g)
        self.grads.clear()

    def step(self, ag: Autograd, first: bool) -> None:
        L = self.L
        if not self.mixed:
            self.opt.step(L, self.total, first)
            for g in self.grads.values():  # the training loop's zero_grad (engine.step: set_to_none)
                ag.release(g)
            self.grads.clear()
            return
        if not self.fused:
            for name, n in zip(self.names, self.numels):
                if name in self.grads:
                    L.free(L.alloc("fp16_unfused.norm_grad_fp32", FP32 * n, "optimizer_step_transient"))
            casts = [L.alloc("fp16_unfused.grad_fp32", FP32 * n, "optimizer_step_transient") for n in self.numels]
            self.opt.step_tensors(L, self.numels)
            for c in casts:
                L.free(c)
            for name in self.names:  # engine.step → optimizer.zero_grad(set_to_none)
                g = self.grads.pop(name, None)
                if g is not None:
                    ag.release(g)
            return
        casts = [L.alloc("fp16_optimizer.grad_fp32", FP32 * n, "optimizer_step_transient") for n in self.numels]
        flat = L.alloc("fp16_optimizer.grads_groups_flat", FP32 * self.total, "optimizer_step_transient")
        for c in casts:
            L.free(c)
        for name in self.names:  # p.grad = None
            g = self.grads.pop(name, None)
            if g is not None:
                ag.release(g)
        self.opt.step(L, self.total, False)
        L.free(flat)
