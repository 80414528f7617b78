"""The node a GPU usually comes in (an NVIDIA DGX system): GPUs per node, host RAM and NVMe, with sources.

These are the defaults of ``--gpus-per-node``, ``--host-ram`` and ``--nvme`` in every command: a job's pinned
host memory and NVMe swap (ZeRO-Offload / ZeRO-Infinity) are checked against them per node. Sizes are the
datasheets' decimal figures (2 TB = 2·10**12 bytes): a vendor's quantity, shown in TB/GB.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from .units import GB

TB = 10**12


class Node(BaseModel):
    """One server model: how many GPUs it holds, its system memory and its internal NVMe data cache."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    gpus: int = Field(gt=0, description="GPUs per node")
    host_ram_bytes: int = Field(gt=0, description="system memory (what pinned host buffers draw on)")
    nvme_bytes: int = Field(gt=0, description="internal NVMe data cache (the ZeRO-Infinity swap space)")
    source: str


_DGX = "NVIDIA DGX {} datasheet (GPUs, system memory, internal storage)"

#: the usual node per GPU preset (memplan.gpus names)
NODES: dict[str, Node] = {
    # DGX-1 with V100: 8 GPUs, 512 GB DDR4, 4x 1.92 TB SSD (RAID 0)
    "v100-16g": Node(name="DGX-1 (V100)", gpus=8, host_ram_bytes=512 * GB, nvme_bytes=7_680 * GB,
                     source=_DGX.format("-1 (V100)")),
    # DGX A100 320GB: 1 TB RAM, 15 TB NVMe; DGX A100 640GB: 2 TB RAM, 30 TB NVMe
    "a100-40g": Node(name="DGX A100 320GB", gpus=8, host_ram_bytes=1 * TB, nvme_bytes=15 * TB,
                     source=_DGX.format("A100")),
    "a100-80g": Node(name="DGX A100 640GB", gpus=8, host_ram_bytes=2 * TB, nvme_bytes=30 * TB,
                     source=_DGX.format("A100")),
    # DGX H100 / H200 / B200: 2 TB RAM, 8x 3.84 TB NVMe
    "h100-80g": Node(name="DGX H100", gpus=8, host_ram_bytes=2 * TB, nvme_bytes=30 * TB, source=_DGX.format("H100")),
    "h200": Node(name="DGX H200", gpus=8, host_ram_bytes=2 * TB, nvme_bytes=30 * TB, source=_DGX.format("H200")),
    "b200": Node(name="DGX B200", gpus=8, host_ram_bytes=2 * TB, nvme_bytes=30 * TB, source=_DGX.format("B200")),
}

#: GPUs per node when no GPU is named: every preset's usual node (NODES) holds 8
DEFAULT_GPUS_PER_NODE = 8


def node_of(gpu_name: str | None) -> Node | None:
    """The usual node of a GPU preset; None for a bare size (``--gpu 80GiB``) or no GPU."""
    return NODES.get(gpu_name) if gpu_name else None


def fmt_vendor_bytes(n: int) -> str:
    """A vendor's quantity in its own decimal unit: 2.00 TB, 512 GB."""
    return f"{n / TB:.2f} TB" if n >= TB else f"{n / GB:.0f} GB"


__all__ = ["DEFAULT_GPUS_PER_NODE", "NODES", "Node", "fmt_vendor_bytes", "node_of"]
