"""Search the configurations that fit a memory target, ranked by estimated step time.

Varies ZeRO stage, offload (optimizer / params to cpu or nvme), tp, pp, Ulysses sp, micro-batch (grad_accum
follows from the global batch), checkpointing and attention; drops invalid layouts and what exceeds the
GPU target or the nodes' host RAM / NVMe. Step time comes from the performance model in
docs/performance-model.md; its assumptions are printed with the table. Exit 0 when something fits, 1 when
nothing does (the closest misses are shown), 2 for bad input.

The fixed facts default as every command's job does (memplan.resolve): the article's for --model 176b (or no
--model: seq 32768, 8 GPUs of A100-80GB, fp16), else seq min(4096, max positions), one node of the GPU's usual
size, bf16. --model-impl megatron ranks Megatron-DeepSpeed GPT jobs, the ones --emit writes launch lines for.

Example (the article): memplan plan --model 176b --seq 32768 --gpus 8 --gpu a100-80g --target 24GiB
"""

from __future__ import annotations

import argparse
import json
import sys

from ..bounds import count_type, rank_count
from ..errors import InputError, shorten

DEFAULT_TOP = 10
#: columns of the table when stdout is a file or a pipe: a 100-column terminal (rich would assume 80)
TABLE_COLUMNS = 100


#: argparse type of plan's counts (memplan.bounds: the same rule as every command's)
_count = count_type()


def _stages(text: str) -> tuple[int, ...]:
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts or any(p not in ("0", "1", "2", "3") for p in parts):
        raise argparse.ArgumentTypeError(f"{shorten(text)}: allowed: a comma list of 0, 1, 2, 3 (e.g. 2,3)")
    return tuple(sorted({int(p) for p in parts}))


def _choices(allowed: tuple[str, ...]):
    def parse(text: str) -> tuple[str, ...]:
        parts = [p.strip() for p in str(text).split(",") if p.strip()]
        if not parts or any(p not in allowed for p in parts):
            raise argparse.ArgumentTypeError(f"{shorten(text)}: allowed: a comma list of {', '.join(allowed)}")
        return tuple(dict.fromkeys(parts))
    return parse


#: plan's job flags (memplan.options): the facts it fixes; the rest it searches
PLAN_FLAGS = ("--model", "--seq", "--gpus", "--gpus-per-node", "--dtype", "--model-impl")
_HELPS = {
    "--model-impl": "transformers (default) or megatron: Megatron-DeepSpeed's GPT, as --emit writes its launch line",
    "--gpus": "world size (176b: the article's 8; else one node of the GPU's usual size)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The plan flags: the job facts, the budgets, what the search varies, the output, your configuration."""
    from ..options import add_budget_arguments, add_job_arguments

    add_job_arguments(parser, PLAN_FLAGS, helps=_HELPS)
    g = parser.add_argument_group("global batch")
    batch = g.add_mutually_exclusive_group()
    batch.add_argument("--global-batch", type=_count, metavar="N", help="sequences per optimizer step")
    batch.add_argument("--global-tokens", type=_count, metavar="N",
                       help="tokens per optimizer step (default 4Mi tokens, rounded to whole sequences)")
    add_budget_arguments(parser, helps={
        "--gpu": "GPU preset or a size (176b: the article's a100-80g; else a100-80g)",
        "--target": "per-GPU device total to stay under (default: GPU capacity less 5%%, at least 2 GiB)"})
    s = parser.add_argument_group("search")
    s.add_argument("--no-offload", action="store_true", help="no optimizer or parameter offload")
    s.add_argument("--no-nvme", action="store_true", help="offload to cpu only")
    s.add_argument("--max-tp", type=rank_count, metavar="N")
    s.add_argument("--max-pp", type=rank_count, metavar="N")
    s.add_argument("--max-sp", type=rank_count, metavar="N")
    s.add_argument("--zero-stages", type=_stages, default=(0, 1, 2, 3), metavar="LIST", help="(0,1,2,3)")
    s.add_argument("--checkpointing", type=_choices(("none", "selective", "full")), default=("full", "none"),
                   metavar="LIST", help="checkpointing choices (full,none; selective as modelled)")
    s.add_argument("--no-checkpointing", action="store_true", help="only checkpointing none")
    s.add_argument("--attention", type=_choices(("flash", "sdpa", "eager")), default=("flash", "sdpa", "eager"),
                   metavar="LIST", help="(flash,sdpa,eager)")
    s.add_argument("--max-micro-batch", type=_count, default=64, metavar="N", help="(64)")
    o = parser.add_argument_group("output")
    o.add_argument("--top", type=_count, default=DEFAULT_TOP, metavar="N", help=f"rows shown ({DEFAULT_TOP})")
    o.add_argument("--json", action="store_true", help="one JSON object on stdout")
    o.add_argument("--emit", type=_count, metavar="N",
                   help="write ds_config.json + launch.sh (Megatron-DeepSpeed pretrain_gpt.py; needs --model-impl "
                        "megatron) + candidate.json for row N")
    o.add_argument("--emit-dir", metavar="DIR", help="where --emit writes (default plan-row-N)")
    u = parser.add_argument_group("your configuration")
    u.add_argument("--ds-config", metavar="PATH", help="your DeepSpeed JSON: where it ranks or why it misses")
    u.add_argument("--launch-file", metavar="PATH", help="your launch line (Megatron-DeepSpeed flags)")


def request_of(args: argparse.Namespace):
    """The typed PlanRequest of the parsed flags."""
    from ..options import budget_request_of
    from ..resolve import JobRequest
    from .request import PlanRequest

    job = JobRequest(model=args.model, seq=args.seq, gpus=args.gpus, gpus_per_node=args.gpus_per_node,
                     dtype=args.dtype, model_impl=args.model_impl, gpu=args.gpu, lora_rank=args.lora_rank,
                     lora_targets=args.lora_targets, lora_dropout=args.lora_dropout, peft_config=args.peft_config,
                     freeze=args.freeze)
    return PlanRequest(job=job, budget=budget_request_of(args), global_batch=args.global_batch,
                       global_tokens=args.global_tokens, no_offload=args.no_offload, no_nvme=args.no_nvme,
                       max_tp=args.max_tp or 0, max_pp=args.max_pp or 0, max_sp=args.max_sp or 0,
                       zero_stages=args.zero_stages,
                       checkpointing=("none",) if args.no_checkpointing else args.checkpointing,
                       attention=args.attention, max_micro_batch=args.max_micro_batch)


def run(args: argparse.Namespace) -> int:
    """Search, then print the table (or --json); --emit writes the chosen row's files."""
    from .render import candidate_dict, plan_dict, render
    from .request import plan_space
    from .search import search

    req = request_of(args)
    if args.emit is not None:  # a bad output folder or a plan --emit cannot write is refused before the search
        from ..outputs import check_folder
        from .emit import emit_problem

        check_folder(args.emit_dir or f"plan-row-{args.emit}", "--emit-dir")
        emit_problem(req)
    launch = None
    if args.ds_config or args.launch_file:  # the user's files are read (and refused) before the search
        from .user import read_user_files

        launch = read_user_files(args.ds_config, args.launch_file)
    space, notes, sources = plan_space(req)
    result = search(space, top=max(args.top, args.emit or 0))  # an emitted row is a confirmed one
    if result.searched == 0:
        why = ", ".join(f"{k} ({v})" for k, v in result.invalid.items()) or "the exclusions leave nothing"
        raise InputError("plan", f"no valid configuration to search: {why}; allowed: a global batch divisible by "
                                 "some data-parallel size, and exclusions that leave a layout")
    user, user_lines = None, []
    if args.ds_config or args.launch_file:
        from .user import user_verdict

        user, user_lines = user_verdict(result, args.model, args.ds_config, launch)
    if args.emit:
        from .emit import emit

        rows = result.shown(max(args.top, args.emit))
        row = rows[args.emit - 1] if 0 < args.emit <= len(rows) else None
        out = emit(space, rows, args.emit, args.emit_dir or f"plan-row-{args.emit}",
                   candidate_dict(row) if row else {})
        notes.append(f"--emit {args.emit}: wrote {out}/ds_config.json, launch.sh, candidate.json")
    if args.json:
        json.dump(plan_dict(result, args.top, notes, user, sources), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        from rich.console import Console

        console = Console() if sys.stdout.isatty() else Console(width=TABLE_COLUMNS)
        render(result, args.top, notes, console, user_lines, sources)
    return 0 if result.shown(args.top) else 1
