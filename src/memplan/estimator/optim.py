"""The optimizer's own allocations on the GPU at its step: states created lazily at the first step, and the
temporaries each implementation makes while it runs. ``n`` is the number of fp32 master elements it updates.

- adamw → DeepSpeed's FusedAdam (ops/adam/fused_adam.py): exp_avg and exp_avg_sq (zeros_like the master) at
  the first step; multi_tensor_apply allocates nothing per step.
- torch_adamw → torch.optim.AdamW, foreach (torch/optim/adamw.py → adam.py _multi_tensor_adam): the same two
  states; per step ``exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)``, one tensor of the master's size,
  then only in-place foreach ops (div_, add_, addcdiv_: fused CUDA kernels; the CPU's addcdiv fallback makes one
  more temporary, which a CUDA run does not), freed when the step returns.
- torch_adamw_fused → torch.optim.AdamW(fused=True) (_fused_adamw): the two states, nothing per step.
- sgd → torch.optim.SGD with momentum: momentum_buffer = clone(grad) at the first step; nothing per step.
- lion → DeepSpeed's FusedLion: exp_avg only.
- cpu_adam → DeepSpeedCPUAdam: states on the host, nothing on the GPU.

Offloaded (``on_gpu`` False), the engine runs DeepSpeedCPUAdam (DeepSpeedCPULion for lion) on the host: its
step creates exp_avg and exp_avg_sq (exp_avg only for Lion) with ``torch.zeros_like(p.data, dtype=fp32,
device="cpu")`` at the first step (ops/adam/cpu_adam.py DeepSpeedCPUAdam.step), pageable host memory, recorded
in ``host`` (estimator/places.py) when one is given.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ledger import Ledger
from .places import Places

FP32 = 4

#: optimizer → (state tensors per master element, fp32 temporaries of the master's size per step)
KINDS = {
    "adamw": (("exp_avg", "exp_avg_sq"), 0),
    "torch_adamw": (("exp_avg", "exp_avg_sq"), 1),
    "torch_adamw_fused": (("exp_avg", "exp_avg_sq"), 0),
    "sgd": (("momentum_buffer",), 0),
    "lion": (("exp_avg",), 0),
    "cpu_adam": ((), 0),
}

#: the host optimizer's states when offloaded (DeepSpeedCPUAdam; DeepSpeedCPULion for lion)
HOST_STATES = {"lion": ("exp_avg",)}
CPU_ADAM_STATES = ("exp_avg", "exp_avg_sq")


def fused_fp16_optimizer(optimizer: str) -> bool:
    """Whether DeepSpeedEngine._configure_fp16_optimizer wraps this basic optimizer in FP16_Optimizer (only a
    FusedAdam: ``isinstance(optimizer, FusedAdam)``) rather than FP16_UnfusedOptimizer (no ZeRO, 16-bit)."""
    return optimizer == "adamw"


@dataclass
class Optimizer:
    """One optimizer over one or more parameter groups; states persist once created."""

    kind: str
    on_gpu: bool = True
    host: Places | None = None

    def __post_init__(self) -> None:
        self.states: dict[int | str, list[int]] = {}

    def state_names(self) -> tuple[str, ...]:
        return KINDS[self.kind][0] if self.on_gpu else ()

    def step(self, L: Ledger, n: int, first: bool, group: int = 0) -> None:
        """optimizer.step() over ``n`` fp32 elements of group ``group``."""
        names, temporaries = KINDS[self.kind]
        if not self.on_gpu:
            if self.host is not None and group not in self.states:
                self.states[group] = [self.host.host_alloc(f"cpu_optimizer.{s}", FP32 * n, "optimizer_states")
                                      for s in HOST_STATES.get(self.kind, CPU_ADAM_STATES)]
            return
        if group not in self.states:
            self.states[group] = [L.alloc(f"optimizer.{s}", FP32 * n, "optimizer_states") for s in names]
        temps = [L.alloc("optimizer.foreach_temporary", FP32 * n, "optimizer_step_transient")
                 for _ in range(temporaries)]
        for t in temps:
            L.free(t)

    def step_tensors(self, L: Ledger, numels: list[int], key: str = "tensors") -> None:
        """optimizer.step() over one parameter group of separate fp32 tensors (FP16_UnfusedOptimizer's fp32
        copies, on the GPU): at the first step each tensor's states in turn (_init_group / FusedLion's
        zeros_like, parameter by parameter), each foreach temporary one tensor per parameter, all alive until
        the step returns."""
        names, temporaries = KINDS[self.kind]
        if key not in self.states:
            self.states[key] = [L.alloc(f"optimizer.{s}", FP32 * n, "optimizer_states") for n in numels for s in names]
        temps = [L.alloc("optimizer.foreach_temporary", FP32 * n, "optimizer_step_transient")
                 for _ in range(temporaries) for n in numels]
        for t in temps:
            L.free(t)
