"""Search the configurations that fit a memory target, ranked by estimated step time.

Varies ZeRO stage, offload (optimizer / params to cpu or nvme), tp, pp, Ulysses sp, micro-batch (grad_accum
follows from the global batch), checkpointing and attention; drops invalid layouts and what exceeds the
GPU target or the nodes' host RAM / NVMe. Step time comes from the performance model in
docs/performance-model.md; its assumptions are printed with the table. Exit 0 when something fits, 1 when
nothing does (the closest misses are shown), 2 for bad input.

Example (the seed): memplan plan --model 176b --seq 32768 --gpus 8 --gpu a100-80g --target 24GiB
"""

from __future__ import annotations

import argparse
import json
import sys

from ..bounds import count_type, rank_count
from ..bounds import size_type as _size
from ..errors import InputError, shorten

DEFAULT_TOP = 10
#: columns of the table when stdout is a file or a pipe (rich would otherwise assume 80 and truncate)
WIDE_OUTPUT_COLUMNS = 170


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The plan flags (issue 5)."""
    g = parser.add_argument_group("job")
    g.add_argument("--model", default="176b", metavar="NAME|PATH", help="model preset or config.json (176b)")
    g.add_argument("--seq", type=_count, default=32768, metavar="N", help="tokens per sequence (32768)")
    batch = g.add_mutually_exclusive_group()
    batch.add_argument("--global-batch", type=_count, metavar="N", help="sequences per optimizer step")
    batch.add_argument("--global-tokens", type=_count, metavar="N",
                       help="tokens per optimizer step (default 4Mi tokens, rounded to whole sequences)")
    g.add_argument("--gpus", type=rank_count, default=8, metavar="N", help="world size (8)")
    g.add_argument("--gpus-per-node", type=rank_count, default=8, metavar="N", help="(8)")
    g.add_argument("--gpu", default="a100-80g", metavar="NAME", help="GPU preset (a100-80g) or a size")
    g.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    b = parser.add_argument_group("budgets")
    b.add_argument("--target", type=_size, metavar="SIZE",
                   help="per-GPU device total to stay under (default: GPU capacity less 5%%, at least 2 GiB)")
    b.add_argument("--host-ram", type=_size, metavar="SIZE", help="host RAM per node (default: the GPU's DGX node)")
    b.add_argument("--nvme", type=_size, metavar="SIZE", help="NVMe per node (default: the GPU's DGX node)")
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
    o.add_argument("--emit", type=_count, metavar="N", help="write ds_config.json + launch.sh for row N")
    o.add_argument("--emit-dir", metavar="DIR", help="where --emit writes (default plan-row-N)")
    o.add_argument("--ds-config", metavar="PATH", help="your DeepSpeed JSON: where it ranks or why it misses")
    o.add_argument("--launch-file", metavar="PATH", help="your launch line (Megatron-DeepSpeed flags)")


def space_from_args(args: argparse.Namespace):
    """The PlanSpace the flags describe, and notes on what was assumed."""
    from pydantic import ValidationError

    from ..errors import from_pydantic
    from ..options import model_from_arg
    from .hardware import resolve_hardware
    from .space import PlanSpace, default_global_batch, default_target_bytes

    model = model_from_arg(args.model, "--model")
    hw, note = resolve_hardware(args.gpu)
    notes = [note] if note else []
    if args.global_tokens is not None:
        if args.global_tokens % args.seq:
            raise InputError("--global-tokens", f"{args.global_tokens} is not a whole number of --seq "
                                                f"({args.seq}) sequences; allowed: a multiple of {args.seq}")
        global_batch = args.global_tokens // args.seq
    else:
        global_batch = args.global_batch or default_global_batch(args.seq, args.gpus)
        if args.global_batch is None:
            notes.append(f"global batch {global_batch} sequences: 4Mi tokens rounded up to whole sequences and a "
                         "multiple of --gpus (set --global-batch or --global-tokens)")
    target = args.target or default_target_bytes(hw.memory_bytes)
    if args.target is None:
        notes.append("target: GPU capacity less 5% (at least 2 GiB) for what the estimate cannot see")
    devices = ("none",) if args.no_offload else (("none", "cpu") if args.no_nvme else ("none", "cpu", "nvme"))
    try:
        space = PlanSpace(
            model=model, seq_len=args.seq, global_batch=global_batch, world=args.gpus,
            gpus_per_node=args.gpus_per_node, hardware=hw, target_bytes=target,
            host_ram_bytes_per_node=args.host_ram or hw.host_ram_bytes_per_node,
            nvme_bytes_per_node=0 if args.no_nvme or args.no_offload else (args.nvme or hw.nvme_bytes_per_node),
            dtype=args.dtype, zero_stages=args.zero_stages, offload_devices=devices, max_tp=args.max_tp or 0,
            max_pp=args.max_pp or 0, max_sp=args.max_sp or 0,
            checkpointing=("none",) if args.no_checkpointing else args.checkpointing,
            attention=args.attention, max_micro_batch=args.max_micro_batch)
    except ValidationError as err:  # name the field in one line
        raise from_pydantic(err, prefix="plan.") from None
    return space, notes


def run(args: argparse.Namespace) -> int:
    """Search, then print the table (or --json); --emit writes the chosen row's files."""
    from .render import candidate_dict, plan_dict, render
    from .search import search

    if args.emit is not None:  # a bad output folder is refused before the search
        from ..outputs import check_folder

        check_folder(args.emit_dir or f"plan-row-{args.emit}", "--emit-dir")
    values = None
    if args.ds_config or args.launch_file:  # the user's files are read (and refused) before the search
        from .user import read_user_files

        values = read_user_files(args)
    space, notes = space_from_args(args)
    result = search(space, top=max(args.top, args.emit or 0))  # an emitted row is a confirmed one
    if result.searched == 0:
        why = ", ".join(f"{k} ({v})" for k, v in result.invalid.items()) or "the exclusions leave nothing"
        raise InputError("plan", f"no valid configuration to search: {why}; allowed: a global batch divisible by "
                                 "some data-parallel size, and exclusions that leave a layout")
    user, user_lines = None, []
    if args.ds_config or args.launch_file:
        from .user import user_verdict

        user, user_lines = user_verdict(args, result, values)
    if args.emit:
        from .emit import emit

        rows = result.shown(max(args.top, args.emit))
        row = rows[args.emit - 1] if 0 < args.emit <= len(rows) else None
        out = emit(space, rows, args.emit, args.emit_dir or f"plan-row-{args.emit}",
                   candidate_dict(row) if row else {})
        notes.append(f"--emit {args.emit}: wrote {out}/ds_config.json, launch.sh, candidate.json")
    if args.json:
        json.dump(plan_dict(result, args.top, notes, user), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        from rich.console import Console

        console = Console() if sys.stdout.isatty() else Console(width=WIDE_OUTPUT_COLUMNS)
        render(result, args.top, notes, console, user_lines)
    return 0 if result.shown(args.top) else 1
