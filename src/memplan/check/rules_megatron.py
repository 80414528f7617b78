"""Rules for a Megatron-DeepSpeed launch line (pretrain_gpt.py), against its DeepSpeed config and --model.

References are to microsoft/Megatron-DeepSpeed at the commit in tables.json (f4157bea): megatron/arguments.py
(parse_args with allow_abbrev=False, validate_args), pretrain_gpt.py (model_provider), megatron/training.py
(setup_model_and_optimizer, train), megatron/optimizer/__init__.py (get_megatron_optimizer),
megatron/model/gpt_model.py (GPTModelPipe); and to DeepSpeed 0.19.8's runtime/pipe/engine.py (PipelineEngine),
runtime/pipe/topology.py (PipelineParallelGrid) and runtime/engine.py (_configure_optimizer).
"""

from __future__ import annotations

import difflib

from ..dsconfig import DsSettings
from ..specs import ModelSpec
from .findings import Finding, error, info, warning
from .launch import Launch, resolve_flag
from .launch_job import FLASH_FLAGS
from .tables import megatron_flags

#: flags megatron/arguments.py defines but validate_args refuses (deprecated arguments block)
_MEGATRON_REFUSED = {
    "--batch-size": (("'--batch-size argument is no longer valid, use --micro-batch-size instead' (validate_args "
                     "asserts args.batch_size is None)"), "remove --batch-size; --micro-batch-size sets the batch"),
    "--warmup": ("validate_args asserts args.warmup is None", "use --lr-warmup-fraction"),
    "--model-parallel-size": ("validate_args asserts args.model_parallel_size is None",
                              "use --tensor-model-parallel-size"),
}
#: well-known misspellings → the flag Megatron-DeepSpeed really has
_MEGATRON_RENAMES = {"--sequence-parallel-size": "--ds-sequence-parallel-size"}


def uses_pipe_engine(launch: Launch) -> bool:
    """pretrain_gpt.py model_provider builds GPTModelPipe (a DeepSpeed PipelineModule) when --deepspeed is given
    without --no-pipeline-parallel, so deepspeed.initialize returns a PipelineEngine, at any pp."""
    return launch.has("--deepspeed") and not launch.has("--no-pipeline-parallel")


def megatron_flag_rules(launch: Launch) -> list[Finding]:
    """megatron/arguments.py parse_args (allow_abbrev=False): an unknown flag stops the job at start."""
    flags = megatron_flags()
    out = []
    for flag, _ in launch.script_args:
        if flag in _MEGATRON_REFUSED:
            why, fix = _MEGATRON_REFUSED[flag]
            out.append(error(flag, f"Megatron-DeepSpeed refuses it: {why}", fix))
        elif resolve_flag(flag, flags, allow_abbrev=False) is None:
            real = _MEGATRON_RENAMES.get(flag) or next(iter(difflib.get_close_matches(flag, list(flags), n=1)), None)
            out.append(error(flag, "not a Megatron-DeepSpeed flag: parse_args (allow_abbrev=False) stops with "
                             "'unrecognized arguments'" + (f"; the real flag is {real}" if real else ""),
                             f"use {real}" if real else "remove it"))
    if launch.script and not (launch.script.rsplit("/", 1)[-1]).startswith("pretrain_"):
        out.append(info(launch.script, "Megatron-DeepSpeed's GPT entry point is pretrain_gpt.py; memplan checks "
                        "the flags against its megatron/arguments.py", "run pretrain_gpt.py"))
    if launch.has("--deepspeed_config") and not launch.has("--deepspeed"):
        out.append(warning("--deepspeed", "--deepspeed_config is given without --deepspeed: Megatron trains "
                           "without DeepSpeed and ignores the config", "add --deepspeed"))
    return out


def pipe_engine_rules(launch: Launch, zero_stage: int, pp: int, sp: int) -> list[Finding]:
    """What DeepSpeed's PipelineEngine refuses when pretrain_gpt.py builds GPTModelPipe at pp 1 (pp > 1 is
    rules_job.parallel_rules', which applies to every launcher)."""
    if not uses_pipe_engine(launch):
        return []
    out = []
    if zero_stage >= 2 and pp == 1:
        out.append(error("zero_optimization.stage", f"ZeRO-{zero_stage} under DeepSpeed's PipelineEngine at pp=1: "
                         "pretrain_gpt.py model_provider builds GPTModelPipe unless --no-pipeline-parallel, and "
                         "runtime/pipe/engine.py PipelineEngine.__init__ asserts \"ZeRO-2 and ZeRO-3 are incompatible "
                         "with pipeline parallelism\"", "add --no-pipeline-parallel (GPTModel, no pipeline engine)"))
    if sp > 1:
        out.append(error("--no-pipeline-parallel", f"sp={sp} under DeepSpeed's PipelineEngine: GPTModelPipe's "
                         "topology is PipeModelDataParallelTopology(pp, tp, dp) with dp = world / (tp·pp·sp) "
                         "(megatron/model/gpt_model.py), which leaves out the sp ranks, and PipelineParallelGrid "
                         "asserts the grid covers the world (runtime/pipe/topology.py _is_grid_valid: 'Invalid Grid')",
                         "add --no-pipeline-parallel, as Megatron-DeepSpeed's Ulysses examples do"))
    return out


def megatron_ds_rules(launch: Launch, s: DsSettings, m: ModelSpec | None, cfg: dict | None = None) -> list[Finding]:
    """How Megatron-DeepSpeed uses the DeepSpeed config it is given."""
    out = []
    if (s.zero_stage == 3) and _int(launch.script_value("--zero-stage"), 1) != 3:
        out.append(error("--zero-stage", "the DeepSpeed config says ZeRO-3 but --zero-stage is not 3: pretrain_gpt.py "
                         "model_provider builds the model under deepspeed.zero.Init(enabled=args.zero_stage == 3), so "
                         "every rank first builds the whole model" + _whole_model(launch, m), "--zero-stage 3"))
    if s.dtype in ("fp16", "bf16") and not launch.has(f"--{s.dtype}"):
        out.append(warning(f"--{s.dtype}", f"the DeepSpeed config trains in {s.dtype} but the launch line lacks "
                           f"--{s.dtype}: Megatron builds fp32 parameters (validate_args: params_dtype = float) "
                           "and its masks/loss paths assume fp32", f"add --{s.dtype}"))
    if s.offload_optimizer in ("cpu", "nvme") and not launch.has("--cpu-optimizer"):
        out.append(error("zero_optimization.offload_optimizer", "Megatron always hands deepspeed.initialize its own "
                         "optimizer (training.py setup_model_and_optimizer: get_megatron_optimizer, apex FusedAdam "
                         "without --cpu-optimizer), which overrides any optimizer section of the JSON; with "
                         "offload_optimizer, engine._configure_optimizer raises ZeRORuntimeException for a client "
                         "optimizer that is not DeepSpeedCPUAdam", "add --cpu-optimizer (get_megatron_optimizer then "
                         "builds DeepSpeedCPUAdam)"))
    if isinstance((cfg or {}).get("optimizer"), dict):
        out.append(info("optimizer", "Megatron passes its own optimizer to deepspeed.initialize (get_megatron_"
                        "optimizer: --optimizer adam/sgd, --cpu-optimizer), so DeepSpeed never builds this section "
                        "(engine._configure_optimizer uses the client optimizer)", "remove it, or set the optimizer "
                        "with Megatron's flags"))
    if not (launch.has("--checkpoint-activations") or launch.has("--recompute-granularity")
            or launch.has("--recompute-activations")):
        out.append(info("--checkpoint-activations", "no activation checkpointing flag: every layer keeps its "
                        "activations for backward", "--checkpoint-activations (with --deepspeed-activation-"
                        "checkpointing) recomputes them"))
    if not any(launch.has(f) for f in FLASH_FLAGS):
        out.append(warning("--use-flash-attn-v2", "no flash-attention flag: Megatron's CoreAttention materialises "
                           "the [b, heads, s, s] score and softmax tensors, quadratic in seq (memplan estimates it "
                           "as eager attention)", "--use-flash-attn-v2"))
    return out


def megatron_batch_rules(s: DsSettings, batch: dict, launch: Launch, dp: int) -> list[Finding]:
    """Megatron's training loop resets DeepSpeed's train batch every iteration (megatron/training.py train:
    ``model[0].set_train_batch_size(dp · micro · get_num_microbatches())``): the JSON's train_batch_size only
    passes DeepSpeedConfig's check at initialize, and each step accumulates Megatron's global batch /
    (micro · dp) micro-batches."""
    out = []
    mbs = _int(launch.script_value("--micro-batch-size"), 0) or batch["micro_batch"]
    if launch.script_value("--micro-batch-size") and mbs != batch["micro_batch"]:
        out.append(warning("--micro-batch-size", f"Megatron loads {mbs} sequences per micro-step but DeepSpeed's "
                           f"train_micro_batch_size_per_gpu is {batch['micro_batch']}: set_train_batch_size "
                           "divides the global batch by DeepSpeed's, so the accumulation boundary moves",
                           "make them agree"))
    gbs = _int(launch.script_value("--global-batch-size"), mbs * dp)
    accum = gbs // (mbs * dp) if gbs % (mbs * dp) == 0 else None
    if gbs != batch["train_batch_size"]:
        steps = f"{accum} micro-batch{'es' if accum != 1 else ''}" if accum else "no whole number of micro-batches"
        out.append(warning("--global-batch-size", f"Megatron's global batch is {gbs} (--global-batch-size, else "
                           f"micro × dp: validate_args), and its training loop calls set_train_batch_size({gbs}) every "
                           f"iteration: DeepSpeed's train_batch_size {batch['train_batch_size']} holds only until the "
                           f"first step, which accumulates {steps} (global {gbs} / micro {mbs} / dp {dp})",
                           f"--global-batch-size {batch['train_batch_size']}, or train_batch_size {gbs}"))
    if s.grad_accum is None:
        out.append(info("gradient_accumulation_steps", f"derived at initialize: {batch['train_batch_size']} // micro "
                        f"{batch['micro_batch']} // dp {dp} = {batch['grad_accum']}; Megatron's set_train_batch_size "
                        f"then makes it {accum if accum else 'its own'} every iteration"))
    return out


def model_rules(launch: Launch, m: ModelSpec, seq: int | None) -> list[Finding]:
    """The model the line builds against --model: pretrain_gpt.py builds its GPT from the flags alone
    (check.megatron_model), so a disagreement means a different model than the estimate's."""
    from .megatron_model import FLAG_OF, REQUIRED, disagreements, line_model, unbuildable

    out = [info("--model", "Megatron-DeepSpeed never reads a config.json: the model is built from "
                "--num-layers/--hidden-size/--num-attention-heads/... on the launch line")]
    line = line_model(launch)
    for key in REQUIRED:
        if line[key] is None:
            out.append(error(FLAG_OF[key], "required: validate_args asserts it is not None", f"{FLAG_OF[key]} N"))
    for flag, got, want in disagreements(launch, m, seq or 0):
        if got is None:  # derived from a required flag the line lacks, which is already an error above
            continue
        shown = {True: "on", False: "off"}
        out.append(error(flag, f"the launch line builds {shown.get(got, got)}, --model {m.name} has "
                         f"{shown.get(want, want)}: Megatron trains the line's model, memplan estimates --model's",
                         "make the launch line and --model agree"))
    positions = line["max_position_embeddings"]
    if seq and positions is not None and positions < seq:
        out.append(error("--max-position-embeddings", f"{positions} < --seq-length {seq}: validate_args asserts "
                         "max_position_embeddings >= seq_length", f"--max-position-embeddings {seq}"))
    for what in unbuildable(m):
        out.append(warning("--model", f"{m.name} has {what}, which Megatron-DeepSpeed's GPT does not build: the "
                           "model it trains differs from --model's (the estimate is --model's)"))
    return out


def _int(text: str | None, default: int) -> int:
    try:
        return int(text) if text not in (None, "") and len(text) <= 40 else default
    except ValueError:
        return default


def _whole_model(launch: Launch, m: ModelSpec | None) -> str:
    if m is None:
        return ""
    from ..params import count_params
    from ..units import fmt_gib

    n = count_params(m).total_params
    width = 2 if launch.has("--fp16") or launch.has("--bf16") else 4
    return f" ({n / 1e9:.0f}B params × {width} bytes = {fmt_gib(n * width, 0)} per rank before partitioning)"


__all__ = ["megatron_batch_rules", "megatron_ds_rules", "megatron_flag_rules", "model_rules", "pipe_engine_rules",
           "uses_pipe_engine"]
