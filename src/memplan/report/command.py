"""Write a capacity-planning report: a Markdown page with plots (PNG and SVG) and a self-contained HTML page.

Plots: allocation by component at each moment of a step (stacked bars); device total against sequence length
for Ulysses sp 1/2/4/8; device total by ZeRO stage and offload; the step timeline, predicted, with a verify
report's measured phases overlaid (--verify FILE: a `memplan verify` JSON report or a one-row JSON-lines file
such as benchmarks/accuracy/rows*.jsonl with --verify-name). The job flags are estimate's (with --verify and no
job flags, the job is the verify report's). Files: OUT/NAME.md, OUT/NAME.html, OUT/NAME/*.png|svg, each
written atomically. Needs matplotlib (pip install -e '.[report]').

--seed writes the answer to the seed's article instead: reports/176b-seq32k-8xa100.md and .html (run from the
repository root: it reads examples/seed-176b/ and reports/verify/).

Example: memplan report --model llama-3-8b --seq 8192 --gpus 8 --zero 3 --gpu a100-80g --out reports/
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

from ..errors import InputError, shorten

#: the job flags' argparse destinations (memplan.options.add_job_arguments)
JOB_DESTS = ("model", "seq", "micro_batch", "grad_accum", "gpus", "gpus_per_node", "tp", "pp", "sp", "zero",
             "offload_optimizer", "offload_param", "dtype", "checkpointing", "attention", "optimizer", "ds_config")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `memplan report` (issue 6): estimate's job flags, --gpu/--target, and the output."""
    from ..options import add_job_arguments

    add_job_arguments(parser)
    parser.add_argument("--gpu", metavar="NAME|SIZE", help="a100-40g, a100-80g, h100-80g, h200, b200, or a size")
    parser.add_argument("--target", metavar="SIZE", help="per-GPU budget drawn on the plots, e.g. 24GiB")
    o = parser.add_argument_group("report")
    o.add_argument("--out", metavar="DIR", default="report", help="output folder (report)")
    o.add_argument("--name", metavar="NAME", help="file stem (default: from the job)")
    o.add_argument("--verify", metavar="FILE", help="a memplan verify report whose measured phases are overlaid")
    o.add_argument("--verify-name", metavar="NAME", help="the row of a multi-row --verify JSON-lines file")
    o.add_argument("--seed", action="store_true", help="write the seed article's verdict (176b-seq32k-8xa100)")


def read_verify(path: str, name: str | None = None) -> dict:
    """One verify report from a JSON file or a JSON-lines file (the row called ``name`` when there are several),
    read through memplan.inputs (a regular UTF-8 file; duplicate keys refused: memplan's own format)."""
    from ..inputs import parse_json, read_text, shown_path

    shown = shown_path(path)
    text = read_text(path, "--verify", what="verify report")
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if len(lines) > 1 and _parses(lines[0][1]):  # JSON lines: each line a value of its own
        rows = [parse_json(line, "--verify", f"{shown} line {n}", "memplan") for n, line in lines]
    else:  # one JSON document (memplan verify writes it indented, over many lines)
        rows = [parse_json(text, "--verify", shown, "memplan")]
    if name is not None:
        rows = [r for r in rows if isinstance(r, dict) and r.get("name") == name]
        if not rows:
            raise InputError("--verify-name", f"no row named {shorten(name)} in {shown}")
    if len(rows) != 1 or not isinstance(rows[0], dict):
        raise InputError("--verify", f"{len(rows)} rows in {shown}; allowed: one report, or pick one with "
                                     "--verify-name")
    return rows[0]


def _parses(line: str) -> bool:
    from ..inputs import parse_json

    try:
        parse_json(line, "--verify", "", "memplan")
    except InputError:
        return False
    return True


def default_stem(job) -> str:
    """A file stem from the job: model, seq, gpus (characters outside [A-Za-z0-9._-] become '-')."""
    name = job.model.name
    name = Path(name).stem if name.endswith(".json") else name
    model = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "model"
    return f"{model[:60]}-seq{job.training.seq_len}-{job.layout.world}gpu"


def _job_estimate(args: argparse.Namespace, row: dict | None):
    from ..api import estimate
    from ..cli import _target_bytes
    from ..options import job_from_args
    from .series import job_of_row

    explicit = any(getattr(args, d, None) is not None for d in JOB_DESTS)
    job = job_of_row(row) if row is not None and not explicit else job_from_args(args)
    gpu = None
    if args.gpu is not None:
        from ..gpus import resolve_gpu

        gpu = resolve_gpu(args.gpu)
    return estimate(job, target_bytes=_target_bytes(args.target), gpu_name=gpu and gpu.name,
                    gpu_bytes=gpu and gpu.memory_bytes)


def write_estimate_report(est, out: str, flag: str = "--report") -> None:
    """`memplan estimate --report DIR`: the job page for an estimate already made; the paths go to stderr.
    Errors name ``flag`` (the folder estimate was given with --report)."""
    from .page import job_page
    from .write import page_files, write_atomically

    stem = default_stem(est.job)
    title, blocks = job_page(est, stem, "memplan estimate " + " ".join(shlex.quote(a) for a in sys.argv[2:]))
    written = write_atomically(out, page_files(stem, title, blocks), flag)
    sys.stderr.write(f"wrote {', '.join(str(p) for p in written if p.suffix in ('.md', '.html'))}\n")


def run(args: argparse.Namespace) -> int:
    """Write the report (or --seed's) and print the paths written."""
    from ..outputs import check_folder, check_name
    from .page import job_page
    from .write import page_files, write_atomically

    if args.name is not None:
        check_name(args.name, "--name")
    check_folder(args.out, "--out")  # refused before any work
    command = "memplan report " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if sys.argv[1:2] == ["report"] \
        else "memplan report ..."
    if args.seed:
        if any(getattr(args, d, None) is not None for d in JOB_DESTS) or args.gpu or args.target:
            raise InputError("--seed", "takes no job flags (the article fixes the job); allowed: --seed --out DIR")
        from .seed import seed_page

        stem, title, blocks = seed_page(args.out)
    else:
        row = read_verify(args.verify, args.verify_name) if args.verify else None
        from .series import measured_of

        measured = measured_of(row) if row is not None else None
        est = _job_estimate(args, row)
        stem = args.name or default_stem(est.job)
        title, blocks = job_page(est, stem, command, measured)
    written = write_atomically(args.out, page_files(stem, title, blocks))
    pages = [str(p) for p in written if p.suffix in (".md", ".html")]
    sys.stdout.write(f"wrote {', '.join(pages)} and {len(written) - len(pages)} figure files\n")
    return 0
