"""What `memplan plan` is asked (a typed PlanRequest) and the PlanSpace it searches.

The fixed job facts (model, seq, world, GPUs per node, dtype, model implementation) are resolved as every
command resolves them (memplan.resolve.resolve_facts: the article's defaults for its model, neutral defaults
otherwise); the GPU defaults to the article's A100-80GB for the article's model and to memplan's default
(a100-80g) otherwise; the budgets per node to the GPU's usual node (memplan.nodes).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..budget import BudgetRequest
from ..errors import InputError, from_pydantic
from ..resolve import JobRequest, Source


class PlanRequest(BaseModel):
    """The plan's job facts (a JobRequest: model, seq, gpus, gpus_per_node, dtype, model_impl), its budgets and
    what the search may vary."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    job: JobRequest = JobRequest()
    budget: BudgetRequest = BudgetRequest()
    global_batch: int | None = Field(None, gt=0, description="sequences per optimizer step")
    global_tokens: int | None = Field(None, gt=0, description="tokens per optimizer step")
    no_offload: bool = False
    no_nvme: bool = False
    max_tp: int = Field(0, ge=0)
    max_pp: int = Field(0, ge=0)
    max_sp: int = Field(0, ge=0)
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    checkpointing: tuple[str, ...] = ("full", "none")
    attention: tuple[str, ...] = ("flash", "sdpa", "eager")
    max_micro_batch: int = Field(64, gt=0)


def plan_space(req: PlanRequest):
    """(PlanSpace, notes on what was assumed, sources of the fixed job facts and budgets)."""
    from ..resolve import ARTICLE, ARTICLE_GPU, is_article, resolve_facts
    from .hardware import DEFAULT_GPU, resolve_hardware
    from .space import PlanSpace, default_global_batch, default_target_bytes

    given = req.budget.gpu is not None  # an empty --gpu= is a value to refuse, not a flag left out
    gpu_name = req.budget.gpu if given else (ARTICLE_GPU if is_article(req.job.model) else DEFAULT_GPU)
    hw, note = resolve_hardware(gpu_name)
    notes = [note] if note else []
    from ..gpus import resolve_gpu

    model, facts, sources = resolve_facts(req.job, resolve_gpu(gpu_name))
    gpu_source = "flag" if given else ("article" if is_article(req.job.model) else "memplan")
    sources += (Source(field="gpu", value=hw.name, source=gpu_source,
                       origin={"flag": "--gpu", "article": ARTICLE}.get(gpu_source, "memplan's default GPU")),)
    if req.job.model_impl == "megatron" or facts["model_impl"] == "megatron":
        _megatron_buildable(model)
    seq, world = facts["seq_len"], facts["world"]
    if req.global_tokens is not None:
        if req.global_tokens % seq:
            raise InputError("--global-tokens", f"{req.global_tokens} is not a whole number of --seq ({seq}) "
                                                f"sequences; allowed: a multiple of {seq}")
        global_batch = req.global_tokens // seq
    else:
        global_batch = req.global_batch or default_global_batch(seq, world)
        if req.global_batch is None:
            notes.append(f"global batch {global_batch} sequences: 4Mi tokens rounded up to whole sequences and a "
                         "multiple of --gpus (set --global-batch or --global-tokens)")
    target = req.budget.target_bytes or default_target_bytes(hw.memory_bytes)
    if req.budget.target_bytes is None:
        notes.append("target: GPU capacity less 5% (at least 2 GiB) for what the estimate cannot see")
    devices = ("none",) if req.no_offload else (("none", "cpu") if req.no_nvme else ("none", "cpu", "nvme"))
    from ..resolve import resolve_adapters

    lora, freeze = resolve_adapters(req.job, model)
    if lora is not None:
        notes.append(f"adapter fixed: LoRA rank {lora['rank']} on {', '.join(lora['targets'])} (every candidate "
                     "trains it on a frozen base)")
    if freeze:
        notes.append(f"frozen groups fixed: {', '.join(freeze)}")
    try:
        space = PlanSpace(
            # a job smaller than a node uses world GPUs of it (what the launcher's --num_gpus says)
            model=model, seq_len=seq, global_batch=global_batch, world=world,
            gpus_per_node=min(facts["gpus_per_node"], world),
            hardware=hw, target_bytes=target, host_ram_bytes_per_node=req.budget.host_ram_bytes or
            hw.host_ram_bytes_per_node, nvme_bytes_per_node=0 if req.no_nvme or req.no_offload else
            (req.budget.nvme_bytes or hw.nvme_bytes_per_node), dtype=facts["dtype"],
            model_impl=facts["model_impl"], zero_stages=req.zero_stages, offload_devices=devices,
            max_tp=req.max_tp, max_pp=req.max_pp, max_sp=req.max_sp, checkpointing=req.checkpointing,
            attention=req.attention, max_micro_batch=req.max_micro_batch, lora=lora, freeze=freeze)
    except ValidationError as err:  # name the field in one line
        raise from_pydantic(err, prefix="plan.") from None
    if space.model_impl == "megatron" and "sdpa" in space.attention:
        notes.append("attention sdpa is not a Megatron path: Megatron's CoreAttention is searched as eager")
    return space, notes, sources


def _megatron_buildable(model) -> None:
    """--model-impl megatron: refuse a model pretrain_gpt.py cannot build (its launch line could not describe it)."""
    from ..check.megatron_model import unbuildable

    missing = unbuildable(model)
    if missing:
        raise InputError("--model-impl", f"megatron: Megatron-DeepSpeed's GPT cannot build {model.name} "
                                         f"({'; '.join(missing)}); allowed: transformers for this model")


__all__ = ["PlanRequest", "plan_space"]
