"""Which optimizer DeepSpeed runs under optimizer offload: the one rule every command applies.

DeepSpeed 0.19.8 runtime/engine.py, DeepSpeedEngine._configure_basic_optimizer: an "Adam"/"AdamW" section
builds DeepSpeedCPUAdam when zero_use_cpu_optimizer() (offload_optimizer device cpu or nvme), FusedAdam
otherwise, torch.optim.AdamW with params.torch_adam. A client optimizer under offload that is not
DeepSpeedCPUAdam / DeepSpeedCPULion is refused (_configure_optimizer raises ZeRORuntimeException while
zero_force_ds_cpu_optimizer is true, its default).
"""

from __future__ import annotations

OFFLOADED = ("cpu", "nvme")


def offloaded(offload_optimizer: str | None) -> bool:
    """Whether the optimizer states live on the host (offload_optimizer device cpu or nvme)."""
    return offload_optimizer in OFFLOADED


def optimizer_run(optimizer: str, offload_optimizer: str | None) -> str:
    """The optimizer DeepSpeed runs for memplan's ``optimizer`` name: adamw is DeepSpeedCPUAdam (cpu_adam) under
    optimizer offload; cpu_adam without offload is FusedAdam (adamw), as a config's AdamW section would be."""
    if optimizer == "adamw" and offloaded(offload_optimizer):
        return "cpu_adam"
    if optimizer == "cpu_adam" and not offloaded(offload_optimizer):
        return "adamw"
    return optimizer


def optimizer_problem(optimizer: str, offload_optimizer: str | None) -> str | None:
    """Why ``optimizer`` cannot run with this offload setting (None when it can)."""
    if optimizer == "cpu_adam" and not offloaded(offload_optimizer):
        return ("cpu_adam needs --offload-optimizer cpu or nvme (DeepSpeedCPUAdam runs on the host); allowed without "
                "offload: adamw, torch_adamw, torch_adamw_fused, sgd, lion")
    return None


__all__ = ["OFFLOADED", "offloaded", "optimizer_problem", "optimizer_run"]
