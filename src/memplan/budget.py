"""The budgets a job is checked against: per GPU (--target, --gpu) and per node (--host-ram, --nvme).

The node budgets default to the GPU's usual node (memplan.nodes: a DGX A100 640GB has 2 TB of system memory);
with no GPU named and no size given, the node is not checked. ``node_checks`` compares an estimate's host RAM
and NVMe per node with them: ZeRO-Offload pins its host buffers (DeepSpeedCPUAdam's fp32 states and the
gradient staging buffers, runtime/zero/stage3.py and stage_1_and_2.py), so a node without that much memory
cannot start the job.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict


class BudgetRequest(BaseModel):
    """--gpu (a name or size), --target / --host-ram / --nvme in bytes (None: not given)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu: str | None = None
    target_bytes: int | None = None
    host_ram_bytes: int | None = None
    nvme_bytes: int | None = None


@dataclass(frozen=True)
class Budget:
    """What the job is held to; None where nothing is known."""

    target_bytes: int | None
    gpu_name: str | None
    gpu_bytes: int | None
    node_name: str | None  # the node the host RAM / NVMe defaults come from
    host_ram_bytes_per_node: int | None
    nvme_bytes_per_node: int | None
    host_ram_origin: str = ""
    nvme_origin: str = ""


def resolve_budget(req: BudgetRequest, gpu=None) -> Budget:
    """The budgets for ``req``; ``gpu`` (a memplan.gpus.GpuSpec) when the job resolution already assumed one."""
    from .gpus import resolve_gpu
    from .nodes import node_of

    if req.gpu is not None:
        gpu = resolve_gpu(req.gpu)
    node = node_of(gpu.name if gpu is not None else None)
    host, host_origin = req.host_ram_bytes, "--host-ram"
    nvme, nvme_origin = req.nvme_bytes, "--nvme"
    if host is None and node is not None:
        host, host_origin = node.host_ram_bytes, f"{node.name} ({node.source})"
    if nvme is None and node is not None:
        nvme, nvme_origin = node.nvme_bytes, f"{node.name} ({node.source})"
    return Budget(target_bytes=req.target_bytes, gpu_name=gpu.name if gpu else None,
                  gpu_bytes=gpu.memory_bytes if gpu else None, node_name=node.name if node else None,
                  host_ram_bytes_per_node=host, nvme_bytes_per_node=nvme, host_ram_origin=host_origin,
                  nvme_origin=nvme_origin)


@dataclass(frozen=True)
class NodeCheck:
    """One per-node need against its budget."""

    what: str  # "host RAM" or "NVMe"
    need_bytes: int
    have_bytes: int
    origin: str

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.have_bytes


def node_checks(host_bytes_per_node: int, nvme_bytes_per_node: int, budget: Budget) -> list[NodeCheck]:
    """Host RAM and NVMe per node against the budget (where the budget is known)."""
    out = []
    for what, need, have, origin in (("host RAM", host_bytes_per_node, budget.host_ram_bytes_per_node,
                                      budget.host_ram_origin),
                                     ("NVMe", nvme_bytes_per_node, budget.nvme_bytes_per_node, budget.nvme_origin)):
        if have is not None:
            out.append(NodeCheck(what, int(need), int(have), origin))
    return out


def node_json(checks: list[NodeCheck], budget: Budget) -> dict:
    """The ``"node"`` object of estimate's and check's --json: budgets per node and whether the job fits them."""
    by = {c.what: c for c in checks}
    return {"name": budget.node_name, "host_ram_bytes": budget.host_ram_bytes_per_node,
            "nvme_bytes": budget.nvme_bytes_per_node,
            "fits_host_ram": by["host RAM"].fits if "host RAM" in by else None,
            "fits_nvme": by["NVMe"].fits if "NVMe" in by else None}


def node_lines(checks: list[NodeCheck]) -> list[str]:
    """One verdict line per node budget (GiB for the need, the vendor's TB/GB beside it for the node)."""
    from .nodes import fmt_vendor_bytes
    from .units import fmt_gib

    out = []
    for c in checks:
        word = "fits" if c.fits else "does not fit"
        out.append(f"verdict vs {c.what} per node ({fmt_gib(c.have_bytes)} = {fmt_vendor_bytes(c.have_bytes)}, "
                   f"{c.origin.split(' (')[0]}): {word}, needs {fmt_gib(c.need_bytes)}")
    return out


__all__ = ["Budget", "BudgetRequest", "NodeCheck", "node_checks", "node_json", "node_lines", "resolve_budget"]
