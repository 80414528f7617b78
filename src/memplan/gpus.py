"""GPU presets for `--gpu`: memory capacity, peak throughput and link bandwidths, each with its source.

``memory_bytes`` is the capacity ``nvidia-smi`` reports as memory.total (MiB × 2**20) — what a job's device
total is compared against. It is less than the marketing number in GB for HBM3 parts and more than it for
A100 (whose "80GB" are 80 GiB). torch's ``total_memory`` is a few hundred MiB lower still (the driver keeps
some back), so a job within ~1 GiB of this capacity is a close call, not a fit.

Throughput is dense (no 2:4 sparsity): NVIDIA's datasheets quote "with sparsity" figures at twice the dense
rate, and we halve them. Bandwidths are bytes per second, decimal as the datasheets give them
(1 TB/s = 10**12 B/s); NVLink is the total per GPU (both directions), PCIe is per direction (x16).
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field

from .errors import InputError, shorten
from .units import MiB, parse_size_bytes

TB_S = 10**12
GB_S = 10**9

#: PCIe x16 bandwidth per direction, by generation (PCI-SIG: 8 / 16 / 32 GT/s per lane → ~16 / ~32 / ~64 GB/s)
PCIE_BYTES_PER_S = {3: 16 * GB_S, 4: 32 * GB_S, 5: 64 * GB_S}


class GpuSpec(BaseModel):
    """One GPU model (or a bare capacity given as a size, where only memory_bytes is known)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    aliases: tuple[str, ...] = ()
    memory_bytes: int = Field(gt=0, description="nvidia-smi memory.total")
    bf16_tflops: float | None = Field(None, description="dense BF16/FP16 tensor-core TFLOP/s (FP16 without bf16)")
    bf16: bool = Field(True, description="the tensor cores run bfloat16 (Ampere and later; Volta has FP16 only)")
    fp32_tflops: float | None = Field(None, description="FP32 (non-tensor) TFLOP/s")
    hbm_bytes_per_s: int | None = None
    nvlink_bytes_per_s: int | None = Field(None, description="NVLink per GPU, both directions added")
    pcie_gen: int | None = None
    pcie_bytes_per_s: int | None = Field(None, description="host link, x16, per direction")
    source: str = ""

    @property
    def nvlink_bytes_per_s_per_direction(self) -> int | None:
        """NVLink one way: half the datasheet's total (NVIDIA quotes both directions added)."""
        return None if self.nvlink_bytes_per_s is None else self.nvlink_bytes_per_s // 2

    @property
    def fp16_tflops(self) -> float | None:
        """Dense FP16 tensor-core TFLOP/s: the same rate as BF16 on every preset here."""
        return self.bf16_tflops


_A100_SHEET = "NVIDIA A100 Tensor Core GPU datasheet (SXM4; 312 dense BF16, 19.5 FP32, NVLink 600 GB/s, PCIe Gen4)"
_NVSMI_NOTE = "memory: nvidia-smi memory.total"

GPU_PRESETS: tuple[GpuSpec, ...] = (
    GpuSpec(
        name="v100-16g", aliases=("v100", "v100-16gb", "v100-sxm2-16gb", "v100-16"),
        memory_bytes=16160 * MiB, bf16_tflops=125.0, bf16=False, fp32_tflops=15.7, hbm_bytes_per_s=900 * GB_S,
        nvlink_bytes_per_s=300 * GB_S, pcie_gen=3, pcie_bytes_per_s=PCIE_BYTES_PER_S[3],
        source="NVIDIA Tesla V100 GPU datasheet (SXM2: 125 tensor FP16, no BF16, 15.7 FP32, HBM2 900 GB/s, NVLink "
        f"300 GB/s, PCIe Gen3); {_NVSMI_NOTE} 16160 MiB (Tesla V100-SXM2-16GB)",
    ),
    GpuSpec(
        name="a100-40g", aliases=("a100-40gb", "a100-sxm4-40gb", "a100-40"),
        memory_bytes=40960 * MiB, bf16_tflops=312.0, fp32_tflops=19.5, hbm_bytes_per_s=1555 * GB_S,
        nvlink_bytes_per_s=600 * GB_S, pcie_gen=4, pcie_bytes_per_s=PCIE_BYTES_PER_S[4],
        source=f"{_A100_SHEET}; HBM2 1,555 GB/s; {_NVSMI_NOTE} 40960 MiB (A100-SXM4-40GB)",
    ),
    GpuSpec(
        name="a100-80g", aliases=("a100", "a100-80gb", "a100-sxm4-80gb", "a100-80"),
        memory_bytes=81920 * MiB, bf16_tflops=312.0, fp32_tflops=19.5, hbm_bytes_per_s=2039 * GB_S,
        nvlink_bytes_per_s=600 * GB_S, pcie_gen=4, pcie_bytes_per_s=PCIE_BYTES_PER_S[4],
        source=f"{_A100_SHEET}; HBM2e 2,039 GB/s; {_NVSMI_NOTE} 81920 MiB (A100-SXM4-80GB)",
    ),
    GpuSpec(
        name="h100-80g", aliases=("h100", "h100-sxm", "h100-80gb", "h100-sxm5-80gb", "h100-80"),
        memory_bytes=81559 * MiB, bf16_tflops=989.5, fp32_tflops=67.0, hbm_bytes_per_s=3350 * GB_S,
        nvlink_bytes_per_s=900 * GB_S, pcie_gen=5, pcie_bytes_per_s=PCIE_BYTES_PER_S[5],
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM: 1,979 BF16 with sparsity → 989.5 dense, 67 FP32, "
        f"HBM3 3.35 TB/s, NVLink 900 GB/s, PCIe Gen5); {_NVSMI_NOTE} 81559 MiB (H100 80GB HBM3)",
    ),
    GpuSpec(
        name="h200", aliases=("h200-141g", "h200-sxm", "h200-141gb", "h200-141"),
        memory_bytes=143771 * MiB, bf16_tflops=989.5, fp32_tflops=67.0, hbm_bytes_per_s=4800 * GB_S,
        nvlink_bytes_per_s=900 * GB_S, pcie_gen=5, pcie_bytes_per_s=PCIE_BYTES_PER_S[5],
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM: 141 GB HBM3e at 4.8 TB/s, 1,979 BF16 with sparsity "
        f"→ 989.5 dense, 67 FP32, NVLink 900 GB/s, PCIe Gen5); {_NVSMI_NOTE} 143771 MiB (NVIDIA H200)",
    ),
    GpuSpec(
        name="b200", aliases=("b200-180g", "b200-sxm", "b200-180gb", "b200-180"),
        memory_bytes=183359 * MiB, bf16_tflops=2250.0, fp32_tflops=75.0, hbm_bytes_per_s=8 * TB_S,
        nvlink_bytes_per_s=1800 * GB_S, pcie_gen=5, pcie_bytes_per_s=PCIE_BYTES_PER_S[5],
        source="NVIDIA HGX B200 datasheet, per GPU (4.5 PF FP16/BF16 with sparsity → 2.25 PF dense, FP32 600 TF "
        "per 8 GPUs, HBM3e 8 TB/s (drivers report a 7,680-bit bus: ~7.7 TB/s), NVLink 5 1.8 TB/s, PCIe Gen5); "
        f"{_NVSMI_NOTE} 183359 MiB (NVIDIA B200)",
    ),
)

_SIZE_WITH_UNIT = re.compile(r"^\s*[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?\s*[KMGTP]i?B\s*$", re.IGNORECASE)


def _key(text: str) -> str:
    """Normalise a GPU name: lower case, '_' and spaces as '-', a leading 'nvidia-' dropped."""
    key = re.sub(r"[\s_]+", "-", str(text).strip().lower())
    return key.removeprefix("nvidia-")


def gpu_names() -> list[str]:
    """The preset names, oldest GPU first."""
    return [g.name for g in GPU_PRESETS]


def _allowed() -> str:
    return f"allowed: {', '.join(gpu_names())} or a size such as 80GiB"


def _preset(text: str) -> GpuSpec | None:
    """The preset named ``text`` (its name or an alias, case-insensitive), or None."""
    key = _key(text)
    return next((g for g in GPU_PRESETS if key == g.name or key in g.aliases), None)


def resolve_gpu(text: str) -> GpuSpec:
    """A preset by name or alias (case-insensitive), or a bare capacity such as ``80GiB`` / ``141GB``."""
    gpu = _preset(text)
    if gpu is not None:
        return gpu
    if _SIZE_WITH_UNIT.match(str(text)):
        try:
            size = parse_size_bytes(text)
        except ValueError as err:
            raise InputError("--gpu", f"{shorten(text)} {str(err).split(';')[0]}; {_allowed()}") from None
        return GpuSpec(name=str(text).strip(), memory_bytes=size, source="capacity given on the command line")
    raise InputError("--gpu", f"unknown GPU {shorten(str(text), 40)}; {_allowed()}")


#: the GPU the timing constants were measured on and verify's rows were measured on (benchmarks/timing/,
#: benchmarks/accuracy/): the GPU an estimate's timing assumes when none is named
REFERENCE_GPU = "h200"


def reference_gpu() -> GpuSpec:
    """The preset of REFERENCE_GPU."""
    return resolve_gpu(REFERENCE_GPU)


def gpu_of_device(device_name: str | None) -> GpuSpec:
    """The preset of a device as torch names it (``torch.cuda.get_device_name``: "NVIDIA H200", "NVIDIA H100 80GB
    HBM3"), the reference GPU where none matches."""
    key = _key(device_name or "")
    family = [g for g in GPU_PRESETS if g.name.split("-")[0] in key]
    sized = [g for g in family if "-" in g.name and g.name.split("-")[1].rstrip("g") + "gb" in key]
    return (sized or family or [reference_gpu()])[0]


def timing_gpu(name: str | None) -> GpuSpec | None:
    """The preset an estimate times its GPU work on (memplan.estimator.gpu_time) for a --gpu value: the named
    preset, or None (the reference GPU) for a bare capacity or none."""
    return _preset(name) if name else None
