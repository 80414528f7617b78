"""The hardware figures the performance model needs, per GPU type, with their sources.

`memplan.gpus` owns GPU names, memory sizes and the per-GPU datasheet figures (dense bf16 rate, HBM, NVLink,
PCIe). The node figures it does not carry (InfiniBand per GPU, host RAM, NVMe size and bandwidth, CPU Adam
rate) are kept here because the performance model is their only user. Bandwidths are bytes per second in one
direction per GPU; rates are nominal datasheet peaks — the achievable fractions live in perf.PerfAssumptions.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from ..nodes import NODES
from ..units import GB

TB = 10**12


class Hardware(BaseModel):
    """One GPU type in the node it usually comes in (an NVIDIA DGX / HGX system)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    memory_bytes: int = Field(gt=0, description="device memory (what torch.cuda.get_device_properties shows)")
    dense_flops: float = Field(gt=0, description="dense bf16/fp16 tensor-core FLOP/s (no sparsity)")
    hbm_bytes_per_s: float = Field(gt=0)
    nvlink_bytes_per_s: float = Field(gt=0, description="NVLink, one direction, per GPU")
    inter_node_bytes_per_s: float = Field(gt=0, description="InfiniBand per GPU (one HCA per GPU), one direction")
    pcie_bytes_per_s: float = Field(gt=0, description="host link per GPU, one direction")
    host_ram_bytes_per_node: int = Field(gt=0, description="default --host-ram: the DGX system memory")
    nvme_bytes_per_node: int = Field(gt=0, description="default --nvme: the DGX internal NVMe data cache")
    nvme_bytes_per_s_per_node: float = Field(gt=0, description="assumed sustained NVMe read/write per node")
    cpu_adam_params_per_s_per_node: float = Field(gt=0, description="DeepSpeedCPUAdam updates per second per node")
    source: str = ""


#: NVMe sustained bandwidth per node (assumption): about four PCIe Gen4 U.2 drives at ~3 GB/s each.
#: ZeRO-Infinity (Rajbhandari et al. 2021, §6.1) reports ~25 GB/s per DGX-2 node with 16 drives.
NVME_BYTES_PER_S_PER_NODE = 12 * GB
#: DeepSpeedCPUAdam throughput per node (assumption, order of magnitude): ZeRO-Offload (Ren et al. 2021,
#: §4.2 and its CPU-Adam table) updates about 1e9 fp32 parameters per second on a two-socket server.
CPU_ADAM_PARAMS_PER_S_PER_NODE = 1e9

#: InfiniBand per GPU, by GPU preset name (memplan.gpus.GPU_PRESETS names); host RAM and NVMe per node are
#: memplan.nodes' (the usual DGX node of each GPU)
INTER_NODE_BYTES_PER_S: dict[str, float] = {
    # DGX-1 (V100): 4x InfiniBand EDR 100 Gb/s for 8 GPUs
    "v100-16g": 4 * 12.5 * GB / 8,
    # DGX A100: 8x ConnectX-6 HDR 200 Gb/s (one per GPU)
    "a100-40g": 25 * GB, "a100-80g": 25 * GB,
    # DGX H100 / H200 / B200: 8x ConnectX-7 NDR 400 Gb/s
    "h100-80g": 50 * GB, "h200": 50 * GB, "b200": 50 * GB,
}
#: node figures by GPU preset name: InfiniBand above, host RAM and NVMe from memplan.nodes
NODE_FIGURES: dict[str, dict] = {
    name: {"inter_node_bytes_per_s": ib, "host_ram_bytes_per_node": NODES[name].host_ram_bytes,
           "nvme_bytes_per_node": NODES[name].nvme_bytes}
    for name, ib in INTER_NODE_BYTES_PER_S.items()
}
_NODE_SOURCE = "NVIDIA DGX-1 / A100 / H100 / H200 / B200 system datasheets (network, system memory, internal NVMe)"

DEFAULT_GPU = "a100-80g"


def _from_gpu_spec(gpu, node: dict, note: str = "") -> Hardware:
    """Hardware from a memplan.gpus.GpuSpec (speed figures) and the node figures above."""
    return Hardware(
        name=gpu.name, memory_bytes=gpu.memory_bytes, dense_flops=gpu.bf16_tflops * 1e12,
        hbm_bytes_per_s=gpu.hbm_bytes_per_s, nvlink_bytes_per_s=gpu.nvlink_bytes_per_s_per_direction,
        pcie_bytes_per_s=gpu.pcie_bytes_per_s, nvme_bytes_per_s_per_node=NVME_BYTES_PER_S_PER_NODE,
        cpu_adam_params_per_s_per_node=CPU_ADAM_PARAMS_PER_S_PER_NODE,
        source=f"{gpu.source}; {_NODE_SOURCE}{'; ' + note if note else ''}", **node,
    )


def resolve_hardware(text: str) -> tuple[Hardware, str]:
    """The Hardware for ``--gpu`` (memplan.gpus.resolve_gpu) and a note when figures were borrowed.

    A preset gives its own figures. A bare capacity (e.g. ``96GiB``) keeps that size and borrows the speed and
    node figures of the default GPU, which the returned note says.
    """
    from ..gpus import resolve_gpu

    gpu = resolve_gpu(text)
    if gpu.name in NODE_FIGURES and gpu.bf16_tflops and gpu.hbm_bytes_per_s and gpu.nvlink_bytes_per_s \
            and gpu.pcie_bytes_per_s:
        return _from_gpu_spec(gpu, NODE_FIGURES[gpu.name]), ""
    base = resolve_gpu(DEFAULT_GPU)
    note = f"--gpu {text}: speed and node figures of {DEFAULT_GPU} assumed (only the memory size is known)"
    borrowed = base.model_copy(update={"name": gpu.name, "memory_bytes": gpu.memory_bytes})
    return _from_gpu_spec(borrowed, NODE_FIGURES[DEFAULT_GPU], note), note
