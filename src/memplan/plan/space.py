"""The search space of `memplan plan`: what may vary, and which combinations are valid.

One rule set: a combination is valid when the Job validator (memplan.specs, which cites DeepSpeed's own
assertions) accepts it, as `memplan estimate` would. `job_problem` validates one Job per layout and ZeRO section
(and per attention implementation), so that the search can build its candidates with `model_construct`
without re-validating each; tests check that `memplan check`'s rules (memplan.check.rules_job, `check_problem`)
agree with it.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..specs import Attention, Checkpointing, LoraSpec, ModelImpl, ModelSpec, OffloadDevice, TrainDtype
from .hardware import Hardware
from .perf import PerfAssumptions

#: default tokens per optimizer step: 4M (Llama 2, Touvron et al. 2023, §2.2: 4M-token batches; GPT-3 175B
#: used 3.2M, Brown et al. 2020, Table 2.1). Rounded up to whole sequences and a multiple of the world size.
DEFAULT_GLOBAL_TOKENS = 2**22
#: largest micro-batch searched by default (per rank, sequences)
DEFAULT_MAX_MICRO_BATCH = 64
#: the default target keeps this share of the GPU free, and at least MIN_SAFETY_BYTES: what the estimate
#: cannot see or may miss — allocator fragmentation beyond the modelled reserve, NCCL buffers that grow with
#: more communicators, and the estimator's 5% worst-case error (the accuracy bar in tests/test_accuracy.py).
SAFETY_FRACTION = 0.05
MIN_SAFETY_BYTES = 2 * 2**30

#: search orders: most memory-saving first, so that a failure prunes what follows
CHECKPOINTING_ORDER: tuple[Checkpointing, ...] = ("full", "selective", "none")
ATTENTION_ORDER: tuple[Attention, ...] = ("flash", "sdpa", "eager")
OFFLOAD_ORDER: tuple[OffloadDevice, ...] = ("none", "cpu", "nvme")


def default_target_bytes(memory_bytes: int) -> int:
    """GPU capacity less the safety margin (SAFETY_FRACTION of it, at least MIN_SAFETY_BYTES)."""
    return memory_bytes - max(MIN_SAFETY_BYTES, int(memory_bytes * SAFETY_FRACTION))


def default_global_batch(seq_len: int, world: int) -> int:
    """DEFAULT_GLOBAL_TOKENS as whole sequences, rounded up to a multiple of ``world``."""
    sequences = max(1, -(-DEFAULT_GLOBAL_TOKENS // seq_len))
    return -(-sequences // world) * world


class PlanSpace(BaseModel):
    """Everything `search` needs: the fixed job facts, the budgets, and what may vary."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelSpec
    seq_len: int = Field(gt=0)
    global_batch: int = Field(gt=0, description="sequences per optimizer step = micro · accum · dp")
    world: int = Field(gt=0, description="--gpus")
    gpus_per_node: int = Field(8, gt=0)
    hardware: Hardware
    target_bytes: int = Field(gt=0, description="device total (reserved + non-torch) must not exceed this")
    host_ram_bytes_per_node: int = Field(gt=0)
    nvme_bytes_per_node: int = Field(ge=0)
    dtype: TrainDtype = "bf16"
    model_impl: ModelImpl = Field("transformers", description="the code that builds the model (megatron: "
                                  "Megatron-DeepSpeed's GPT, as --emit writes it)")
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    offload_devices: tuple[OffloadDevice, ...] = OFFLOAD_ORDER
    max_tp: int = Field(0, ge=0, description="0: up to the world size")
    max_pp: int = Field(0, ge=0)
    max_sp: int = Field(0, ge=0)
    checkpointing: tuple[Checkpointing, ...] = ("full", "none")
    attention: tuple[Attention, ...] = ("flash", "sdpa", "eager")
    max_micro_batch: int = Field(DEFAULT_MAX_MICRO_BATCH, gt=0)
    perf: PerfAssumptions = PerfAssumptions()
    lora: LoraSpec | None = Field(None, description="the adapter every candidate trains (fixed, not searched)")
    freeze: tuple[str, ...] = Field((), description="frozen parameter groups (fixed)")

    @model_validator(mode="after")
    def _check(self) -> PlanSpace:
        if not self.zero_stages or any(s not in (0, 1, 2, 3) for s in self.zero_stages):
            raise ValueError(f"zero_stages {self.zero_stages} must be a non-empty subset of 0, 1, 2, 3")
        if "none" not in self.offload_devices:
            raise ValueError("offload_devices must include 'none'")
        if not self.checkpointing or not self.attention:
            raise ValueError("checkpointing and attention need at least one choice each")
        return self

    def caps(self) -> tuple[int, int, int]:
        """(max tp, max pp, max sp), 0 meaning the world size."""
        return tuple(c or self.world for c in (self.max_tp, self.max_pp, self.max_sp))


def divisors(n: int) -> list[int]:
    """Divisors of n, ascending (trial division up to √n)."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def reason(err: ValidationError) -> str:
    """A validator's message as a short reason (the parenthesised values and citations dropped): the key of
    PlanResult.invalid."""
    msg = str(err.errors()[0].get("msg", "invalid")).removeprefix("Value error, ")
    msg = re.sub(r"\s*\([^()]*\)", "", msg.split(";")[0])
    return re.sub(r"\s+", " ", msg).strip(" :")


def job_problem(build: Callable[[], object]) -> str | None:
    """Why the Job ``build()`` makes is refused by the Job validator (the one rule set), or None."""
    try:
        build()
    except ValidationError as err:
        return reason(err)
    return None


def layout_problem(m: ModelSpec, seq_len: int, tp: int, pp: int, sp: int, dtype: str = "bf16",
                   model_impl: str = "transformers") -> str | None:
    """Why (tp, pp, sp) is not a valid layout for ``m`` (the Job validator's answer), or None."""
    from ..specs import Job, Layout, TrainingSpec

    return job_problem(lambda: Job(model=m, training=TrainingSpec(seq_len=seq_len, dtype=dtype, model_impl=model_impl),
                                   layout=Layout(world=tp * pp * sp, tp=tp, pp=pp, sp=sp)))


def check_problem(m: ModelSpec, seq_len: int, world: int, tp: int, pp: int, sp: int) -> str | None:
    """The first error `memplan check` (memplan.check.rules_job) reports for this layout, or None.

    Adds check's model-level rules (e.g. seq beyond max_position_embeddings, hidden not divisible by heads)
    to layout_problem's; called once per layout, not per candidate.
    """
    from ..check.rules_job import Layout as CheckLayout
    from ..check.rules_job import model_shape_rules, parallel_rules

    lay = CheckLayout(world=world, tp=tp, pp=pp, sp=sp, sp_intended=sp)
    findings = parallel_rules(lay, 0, False, None) + model_shape_rules(m, lay, seq_len)
    errors = [f for f in findings if f.severity == "error"]
    return re.sub(r"\s*\([^()]*\)$", "", errors[0].message) if errors else None  # without the citation
