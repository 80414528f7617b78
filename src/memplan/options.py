"""The job flags of every command, defined once, and how a command line becomes a typed request.

- ``add_job_arguments(parser, flags)``: the job flags (all of them for estimate, verify and report; a subset for
  check and plan), each defined here once with its help; every default is None, so "given" is knowable.
- ``add_budget_arguments(parser)``: --gpu, --target, --host-ram, --nvme (sizes parsed by memplan.bounds.size,
  the one size rule: a bare number has no unit and is refused).
- ``request_of(args)`` → memplan.resolve.JobRequest, ``budget_request_of(args)`` → memplan.budget.BudgetRequest:
  the only places an argparse Namespace is read. Commands hand the typed requests to library functions
  (memplan.resolve.resolve_job, memplan.budget.resolve_budget).

What the defaults are (the article's job for its model, neutral defaults for any other) is memplan.resolve's.
Imports stay light (argparse and the specs' types); presets and the ds-config reader are imported when used.
"""

from __future__ import annotations

import argparse
from typing import Any, get_args

from .bounds import MAX_COUNT, count_type, rank_count, size_type
from .errors import shorten
from .inputs import MAX_INPUT_BYTES, check_regular
from .specs import Attention, Checkpointing, LayerBackwardHooks, Loop, ModelImpl, OffloadDevice, Optimizer, TrainDtype

#: the largest count a flag takes (2**40 tokens or steps is far beyond any real job; keeps byte arithmetic in
#: the estimator exact in float64 where it divides); ranks are bounded lower (memplan.bounds.MAX_RANKS)
MAX_FLAG_INT = MAX_COUNT
#: the largest input file read (memplan.inputs' cap for every input file)
MAX_INPUT_FILE_BYTES = MAX_INPUT_BYTES

_DEFAULTS = "176b: the article's; other models: DeepSpeed's / memplan's neutral defaults (memplan.resolve)"


def _unit_float(text: str) -> float:
    """argparse type: a number in [0, 1)."""
    try:
        value = float(str(text).strip()) if len(str(text)) <= 40 else None
    except ValueError:
        value = None
    if value is None:
        raise argparse.ArgumentTypeError(f"{shorten(text)} is not a number; allowed: 0 <= p < 1") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{value} is out of range; allowed: 0 <= p < 1")
    return value


_positive = count_type(maximum=MAX_FLAG_INT)


def positive_int(text: str) -> int:
    """argparse type: an integer in 1..MAX_FLAG_INT, ASCII digits only (memplan.bounds.count: the one rule)."""
    return _positive(text)


def _zero_stage(text: str) -> int:
    """argparse type for --zero: 0, 1, 2 or 3."""
    if str(text).strip() not in ("0", "1", "2", "3"):
        raise argparse.ArgumentTypeError(f"{shorten(text)} is not a ZeRO stage; allowed: 0, 1, 2, 3")
    return int(text)


#: every job flag: name → (argparse keyword arguments, help); choices come from the specs' types
JOB_FLAGS: dict[str, dict[str, Any]] = {
    "--model": {"metavar": "NAME|PATH", "help": "model preset or config.json path (default 176b, the article's)"},
    "--seq": {"type": positive_int, "metavar": "N",
              "help": "tokens per sequence (176b: 32768; else min(4096, max_position_embeddings))"},
    "--micro-batch": {"type": positive_int, "metavar": "N", "help": "sequences per rank per micro-step (1)"},
    "--grad-accum": {"type": positive_int, "metavar": "N", "help": "micro-steps per optimizer step (1)"},
    "--gpus": {"type": rank_count, "metavar": "N", "help": "world size, all ranks (default: one node)"},
    "--gpus-per-node": {"type": rank_count, "metavar": "N", "help": "(default: the GPU's usual node, 8)"},
    "--nodes": {"type": rank_count, "metavar": "N", "help": "nodes (gpus per node = gpus / nodes)"},
    "--tp": {"type": rank_count, "metavar": "N", "help": "tensor-parallel size (1)"},
    "--pp": {"type": rank_count, "metavar": "N", "help": "pipeline-parallel size (1)"},
    "--tp-sequence-parallel": {"action": "store_const", "const": True, "default": None,
                               "help": "Megatron-style sequence parallelism with --tp (modelled, not measured)"},
    "--sp": {"type": rank_count, "metavar": "N", "help": "Ulysses sequence-parallel size (176b: 8; else 1)"},
    "--zero": {"type": _zero_stage, "metavar": "0|1|2|3", "help": "ZeRO stage (176b: 3; else DeepSpeed's 0)"},
    "--offload-optimizer": {"choices": get_args(OffloadDevice), "help": "(176b: cpu; else none)"},
    "--offload-param": {"choices": get_args(OffloadDevice), "help": "needs ZeRO-3 (none)"},
    "--dtype": {"choices": get_args(TrainDtype), "help": "training dtype (176b: fp16; else bf16, fp16 without bf16)"},
    "--checkpointing": {"choices": get_args(Checkpointing), "help": "activation checkpointing (none)"},
    "--attention": {"choices": get_args(Attention), "help": "attention implementation (sdpa)"},
    "--optimizer": {"choices": get_args(Optimizer),
                    "help": "(adamw: DeepSpeed's FusedAdam; DeepSpeedCPUAdam under optimizer offload)"},
    "--ds-config": {"metavar": "PATH", "help": "DeepSpeed JSON; its values replace the defaults, flags win"},
    "--loop": {"choices": get_args(Loop),
               "help": "training loop: outputs (DeepSpeed's tutorial loop keeps the model output; default), loss "
                       "(only the loss survives the forward), hf-trainer (transformers' Trainer)"},
    "--training-args": {"metavar": "FILE",
                        "help": "transformers TrainingArguments as to_json_string() writes them; implies --loop "
                                "hf-trainer (the Trainer fills the --ds-config's \"auto\" from them, see memplan.hf)"},
    "--alloc-conf": {"metavar": "CONF",
                     "help": "PYTORCH_CUDA_ALLOC_CONF, e.g. expandable_segments:True (default: torch's defaults)"},
    "--layer-backward-hooks": {"choices": get_args(LayerBackwardHooks),
                               "help": "full backward hooks your code puts on every decoder layer (profilers): "
                                       "none (default), first (the first micro-step only) or every micro-step"},
    "--model-impl": {"choices": get_args(ModelImpl),
                     "help": "code that builds the model: transformers (default) or megatron (Megatron's GPT)"},
}
ADAPTER_FLAGS: dict[str, dict[str, Any]] = {
    "--lora-rank": {"type": positive_int, "metavar": "R", "help": "LoRA rank r (adapters on a frozen base)"},
    "--lora-targets": {"metavar": "LIST", "help": "adapted modules, comma-separated (q_proj,v_proj) or all-linear "
                                                  "(default: peft's for the family)"},
    "--lora-dropout": {"type": _unit_float, "metavar": "P", "help": "dropout on the adapters' input (0)"},
    "--peft-config": {"metavar": "PATH", "help": "adapter_config.json as peft writes it (instead of --lora-*)"},
    "--freeze": {"metavar": "LIST",
                 "help": "frozen parameter groups without adapters: embeddings, lm_head, norms, layers:N"},
}
BUDGET_FLAGS: dict[str, dict[str, Any]] = {
    "--gpu": {"metavar": "NAME|SIZE", "help": "v100-16g, a100-40g, a100-80g, h100-80g, h200, b200, or a size (80GiB)"},
    "--target": {"type": size_type, "metavar": "SIZE", "help": "per-GPU budget to check against, e.g. 24GiB"},
    "--host-ram": {"type": size_type, "metavar": "SIZE", "help": "host RAM per node (default: the GPU's usual node)"},
    "--nvme": {"type": size_type, "metavar": "SIZE", "help": "NVMe per node (default: the GPU's usual node)"},
}
#: the job flags every command takes by default (--nodes is check's)
ALL_JOB_FLAGS = tuple(f for f in JOB_FLAGS if f != "--nodes")


def add_job_arguments(parser: argparse.ArgumentParser, flags: tuple[str, ...] = ALL_JOB_FLAGS,
                      required: tuple[str, ...] = (), helps: dict[str, str] | None = None,
                      adapters: bool = True) -> None:
    """Add the job flags named in ``flags`` (defaults None: memplan.resolve fills them)."""
    g = parser.add_argument_group(f"job (defaults: {_DEFAULTS})")
    for flag in flags:
        kwargs = dict(JOB_FLAGS[flag])
        if helps and flag in helps:
            kwargs["help"] = helps[flag]
        g.add_argument(flag, required=flag in required, **kwargs)
    if adapters:
        a = parser.add_argument_group("fine-tuning (default: full training)")
        for flag, kwargs in ADAPTER_FLAGS.items():
            a.add_argument(flag, **kwargs)


def add_adapter_arguments(parser: argparse.ArgumentParser) -> None:
    """LoRA / PEFT and frozen-parameter flags alone (add_job_arguments adds them too)."""
    a = parser.add_argument_group("fine-tuning (default: full training)")
    for flag, kwargs in ADAPTER_FLAGS.items():
        a.add_argument(flag, **kwargs)


def add_budget_arguments(parser: argparse.ArgumentParser, flags: tuple[str, ...] = tuple(BUDGET_FLAGS),
                         helps: dict[str, str] | None = None) -> None:
    """--gpu, --target, --host-ram, --nvme (a subset by ``flags``)."""
    g = parser.add_argument_group("budgets (per GPU; host RAM and NVMe per node)")
    for flag in flags:
        kwargs = dict(BUDGET_FLAGS[flag])
        if helps and flag in helps:
            kwargs["help"] = helps[flag]
        g.add_argument(flag, **kwargs)


def add_launch_arguments(parser: argparse.ArgumentParser, text: bool = True) -> None:
    """--launch-file FILE (and, with ``text``, --launch COMMAND, one or the other): a launch line to read."""
    g = parser.add_mutually_exclusive_group()
    if text:
        g.add_argument("--launch", metavar="COMMAND", help="the launch line (deepspeed / torchrun / accelerate launch)")
    g.add_argument("--launch-file", metavar="FILE", help="a shell file holding the launch line")


#: JobRequest field → argparse destination
_DESTS = {"seq": "seq", "micro_batch": "micro_batch", "grad_accum": "grad_accum", "gpus": "gpus",
          "gpus_per_node": "gpus_per_node", "nodes": "nodes", "tp": "tp", "pp": "pp", "sp": "sp",
          "tp_sequence_parallel": "tp_sequence_parallel", "zero": "zero", "offload_optimizer": "offload_optimizer",
          "offload_param": "offload_param", "dtype": "dtype", "checkpointing": "checkpointing",
          "attention": "attention", "optimizer": "optimizer", "loop": "loop", "model_impl": "model_impl",
          "layer_backward_hooks": "layer_backward_hooks",
          "model": "model", "ds_config": "ds_config", "training_args": "training_args", "alloc_conf": "alloc_conf",
          "lora_rank": "lora_rank", "lora_targets": "lora_targets", "lora_dropout": "lora_dropout",
          "peft_config": "peft_config", "freeze": "freeze", "gpu": "gpu"}


def request_of(args: argparse.Namespace, launch=None, **overrides):
    """The typed JobRequest the parsed flags stand for (``launch``: a parsed launch line; ``overrides``: values a
    command fixes itself)."""
    from .resolve import JobRequest

    values = {field: getattr(args, dest, None) for field, dest in _DESTS.items()}
    values = {k: v for k, v in values.items() if v is not None}
    if isinstance(values.get("checkpointing"), tuple) or isinstance(values.get("attention"), tuple):
        values.pop("checkpointing", None)  # plan's search lists are not job values
        values.pop("attention", None)
    return JobRequest(**{**values, **overrides, "launch": launch})


def budget_request_of(args: argparse.Namespace):
    """The typed BudgetRequest of --gpu / --target / --host-ram / --nvme."""
    from .budget import BudgetRequest

    return BudgetRequest(gpu=getattr(args, "gpu", None), target_bytes=getattr(args, "target", None),
                         host_ram_bytes=getattr(args, "host_ram", None), nvme_bytes=getattr(args, "nvme", None))


def require_regular_file(path: str, flag: str) -> None:
    """Refuse what could hang or flood a read: FIFOs, devices (/dev/zero, /dev/stdin), directories, huge files
    (memplan.inputs.check_regular: ``os.stat``, which does not block on a FIFO, before any open)."""
    check_regular(path, flag, "JSON file", MAX_INPUT_FILE_BYTES)


def job_from_args(args: argparse.Namespace):
    """The validated Job the job flags describe (memplan.resolve.resolve_job of request_of(args))."""
    from .resolve import resolve_job

    return resolve_job(request_of(args)).job


def model_from_arg(name_or_path: str, flag: str = "--model"):
    """The ModelSpec a --model value names (memplan.resolve.model_from_arg)."""
    from .resolve import model_from_arg as load

    return load(name_or_path, flag)


__all__ = ["ALL_JOB_FLAGS", "BUDGET_FLAGS", "JOB_FLAGS", "add_budget_arguments", "add_job_arguments",
           "add_launch_arguments", "budget_request_of", "job_from_args", "model_from_arg", "positive_int",
           "request_of", "require_regular_file"]
