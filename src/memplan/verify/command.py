"""Run the job for a few steps on a real GPU and report measured against predicted memory, per phase.

The job flags of estimate plus --steps, --layers, --launch, --out; the protocol is memplan.verify's docstring
(emulated ranks on one GPU by default, real ranks with --launch).

Exit codes: 0 measured (status ok), 1 measured something else (oom, error, timeout, unsupported: still a
report), 2 bad input (one line naming the flag). Importing this module imports neither torch nor deepspeed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from ..errors import InputError
from ..options import add_job_arguments, job_from_args, positive_int

DEFAULT_OUT = "reports/verify"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the job flags (memplan.options) and verify's own flags to ``parser``."""
    add_job_arguments(parser)
    g = parser.add_argument_group("verify")
    g.add_argument("--steps", type=positive_int, default=3, metavar="N", help="optimizer steps to train (3)")
    g.add_argument("--layers", type=positive_int, metavar="K",
                   help="measure the full-width model at K and 2K layers and extrapolate to the full depth")
    g.add_argument("--launch", action="store_true",
                   help="real ranks: torchrun over this node's GPUs (default: rank 0 emulated on one GPU)")
    g.add_argument("--out", metavar="DIR", default=DEFAULT_OUT, help=f"report folder ({DEFAULT_OUT})")
    g.add_argument("--timeout", type=positive_int, default=600, metavar="S",
                   help="wall-clock limit per measuring process, seconds (600)")
    g.add_argument("--name", metavar="NAME", help="report name (default: derived from the job)")
    g.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (a measurement) or cpu (exercises the harness only: every counter reads 0)")
    g.add_argument("--json", action="store_true", help="print the report row as JSON instead of the table")
    g.add_argument("--trace", metavar="FILE",
                   help="record the allocator's real event trace and write it as Chrome trace-event JSON (Perfetto)")


def job_and_options(args: argparse.Namespace):
    """The Job of ``args`` (InputError on bad input) and the keyword arguments of runner.measure_job. The
    report's name is one path component and --out a folder (memplan.outputs), checked before anything runs."""
    from ..outputs import check_folder, check_name

    if args.name is not None:
        check_name(args.name, "--name")
    check_folder(args.out, "--out")
    job = job_from_args(args)
    if args.layers is not None and not 1 <= args.layers <= job.model.num_layers // 2:
        raise InputError("--layers", f"{args.layers} must be between 1 and half the model's depth "
                                     f"({job.model.num_layers} layers)")
    from ..hf.job import verify_task
    from ..options import trainer_job_of

    hf = verify_task(trainer_job_of(args, num_training_steps=args.steps),
                     "--training-args" if getattr(args, "training_args", None) else "TrainingArguments",
                     job.training.loop)
    return job, {"name": args.name, "steps": args.steps, "layers": args.layers, "launch": args.launch, "device": args.device,
                     "timeout_s": float(args.timeout), "out_dir": args.out, "hf": hf,
                     "trace": args.trace}


def run(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """Measure the job the flags describe, write the report, print the table. Returns the exit code; bad input
    raises InputError (memplan.cli prints it as one line, exit 2)."""
    job, opts = job_and_options(args)
    from . import report, runner

    command = ["memplan", *sys.argv[1:]] if argv is None else ["memplan", "verify", *argv]
    row = runner.measure_job(job, command=command, **opts)
    json_path, md_path = report.write_report(row, args.out)
    if args.json:
        print(json.dumps(row, default=str))
    else:
        report.render(row)
        print(f"report: {json_path} and {md_path}")
    return 0 if row["status"] == "ok" else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry (python -m memplan.verify.command ...): `memplan verify` through memplan.cli, so that
    errors are printed the one way."""
    from ..cli import main as cli_main

    return cli_main(["verify", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
