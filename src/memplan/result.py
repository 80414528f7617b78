"""Typed results: a breakdown is a list of named parts, in integer bytes, that sum to its total."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, computed_field

from .specs import Job


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Part(_Frozen):
    """One allocation (or group of same-kind allocations) alive at a moment, in bytes."""

    name: str = Field(description="stable component key, e.g. 'params_16bit', 'activations'")
    bytes: int = Field(ge=0)
    detail: str = Field("", description="shape or formula, and the source it models")


class Phase(_Frozen):
    """The allocated bytes at one moment of a step (e.g. 'backward, layer 0')."""

    name: str
    parts: tuple[Part, ...]

    @computed_field
    @property
    def allocated_bytes(self) -> int:
        return sum(p.bytes for p in self.parts)

    def part_bytes(self, name: str) -> int:
        return sum(p.bytes for p in self.parts if p.name == name)


class Estimate(_Frozen):
    """What `memplan estimate` predicts for one rank (the most loaded one)."""

    job: Job
    peak_phase: str
    components: tuple[Part, ...] = Field(description="the breakdown at the peak; sums to peak_allocated_bytes")
    timeline: tuple[Phase, ...] = Field(description="allocated bytes at each modelled moment of a step")
    peak_reserved_bytes: int = Field(ge=0, description="predicted torch.cuda.max_memory_reserved")
    peak_reserved_gpu_behind_bytes: int | None = Field(
        None, ge=0, description="peak reserved if the GPU falls a whole phase behind the host, so that DeepSpeed's "
        "record_stream frees (ZeRO-3) wait for the next synchronization (estimator.gpu_behind): the bound of a GPU "
        "slower or busier than the one timed (a shared GPU); None where no tensor is freed that way. The verdicts "
        "use peak_reserved_bytes, which times the frees on the job's GPU (estimator.gpu_time)")
    non_torch_bytes: int = Field(ge=0, description="CUDA context, NCCL buffers and workspaces torch does not see")
    host_bytes_per_node: int = Field(ge=0, description="pinned host RAM for offload, per node")
    nvme_bytes_per_node: int = Field(ge=0, description="NVMe bytes for offload, per node")
    notes: tuple[str, ...] = ()
    target_bytes: int | None = None
    gpu_name: str | None = None
    gpu_bytes: int | None = None

    @computed_field
    @property
    def peak_allocated_bytes(self) -> int:
        return sum(p.bytes for p in self.components)

    @computed_field
    @property
    def device_total_bytes(self) -> int:
        """What the device would show in use: reserved plus what torch does not see."""
        return self.peak_reserved_bytes + self.non_torch_bytes

    @computed_field
    @property
    def device_total_gpu_behind_bytes(self) -> int | None:
        """The device total with peak_reserved_gpu_behind_bytes (None where that is None)."""
        behind = self.peak_reserved_gpu_behind_bytes
        return None if behind is None else behind + self.non_torch_bytes

    @computed_field
    @property
    def fits_target(self) -> bool | None:
        return None if self.target_bytes is None else self.device_total_bytes <= self.target_bytes

    @computed_field
    @property
    def fits_gpu(self) -> bool | None:
        return None if self.gpu_bytes is None else self.device_total_bytes <= self.gpu_bytes
