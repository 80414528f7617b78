"""The `memplan` command: estimate here; verify, check, plan, calibrate and report imported when asked for.

Every failure is exit code 2 and one line on stderr, ``memplan: error: <field>: <what is allowed>``; never a
traceback, never a read from stdin. Every command's help is its docstring. Imports stay lazy so that
``memplan estimate`` starts fast and never imports torch, deepspeed or transformers.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

# pydantic scans every installed distribution's entry points for plugins on its first model
# (pydantic/plugin/_loader.py get_plugins: importlib.metadata.distributions()); the command uses none, and on an
# environment with torch, deepspeed and transformers installed the scan is a visible part of estimate's start
os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")

PROG = "memplan"

#: commands implemented in memplan.<name>.command (add_arguments(parser), run(args) -> int), imported lazily
LAZY_COMMANDS = ("verify", "check", "plan", "calibrate", "report")
COMMANDS = ("estimate", *LAZY_COMMANDS)
DESCRIPTION = "Per-GPU memory of DeepSpeed training: estimate before launch, verify on a GPU, check configs, plan."


class UsageError(Exception):
    """A command-line error: ``field`` (a flag or 'command') and what is allowed."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


class _Parser(argparse.ArgumentParser):
    """argparse without usage dumps: an error raises UsageError, which main prints as one line."""

    def error(self, message: str):
        raise _usage_error(message)


def _usage_error(message: str) -> UsageError:
    """argparse's message as (field, what is allowed), every value in it shortened (memplan.errors.shorten)."""
    from .errors import shorten

    message = " ".join(str(message).split())
    if message.startswith("argument "):
        field, _, rest = message[len("argument "):].partition(": ")
        field = field.split("/")[-1]
        if field in ("command", "{" + ",".join(COMMANDS) + "}"):
            field, rest = "command", rest + f"; allowed: {', '.join(COMMANDS)}"
        choice = re.match(r"invalid choice: (.*) \(choose from (.*)\)$", rest)
        if choice:
            got = choice.group(1)
            got = shorten(got[1:-1]) if len(got) > 2 and got[0] == got[-1] == "'" else shorten(got)
            rest = f"invalid choice {got}; allowed: {choice.group(2).replace(chr(39), '')}"
        invalid = re.match(r"invalid (\S+) value: (.*)$", rest)
        if invalid:
            rest = f"invalid value {shorten(invalid.group(2)[1:-1])}; see --help for what is allowed"
        if rest == "expected one argument":
            rest = "needs a value; see --help for what is allowed"
        return UsageError(field, rest)
    if message.startswith("unrecognized arguments: "):
        first = message[len("unrecognized arguments: "):].split(" ")[0]
        what = "unknown option" if first.startswith("-") else "unexpected argument"
        return UsageError(shorten(first)[1:-1] if len(first) > 60 else first,
                          f"{what}; see memplan <command> --help for the allowed flags")
    if message.startswith("the following arguments are required: "):
        return UsageError(message.split(": ", 1)[1].split(",")[0], "required")
    return UsageError("command line", message)


def cmd_estimate(args: argparse.Namespace) -> int:
    """Predict the per-GPU memory of a DeepSpeed training job before launching it.

    Prints the breakdown at the peak (GiB and share of the peak), the phase that sets the peak, peak
    allocated / reserved / device total, host RAM and NVMe per node for offload, verdicts against --target,
    --gpu and the node's host RAM and NVMe (--host-ram, --nvme; default: the GPU's usual node), and where each
    value of the job came from. With no flags it estimates the article's job (examples/seed-176b): the 176B
    GPT-style model, seq 32768, 8×A100-80GB on one node, ZeRO-3 with the optimizer offloaded to CPU, fp16,
    Ulysses sp 8. Any other --model gets neutral defaults (DeepSpeed's ZeRO defaults, bf16, seq
    min(4096, max positions), one node). --json prints one JSON object.
    """
    from .api import estimate
    from .budget import node_checks, resolve_budget
    from .options import budget_request_of, request_of
    from .resolve import resolve_job

    if args.report is not None:  # refused before any work, so that nothing is printed or written
        from .outputs import check_folder

        check_folder(args.report, "--report")
    if args.trace is not None:
        from .outputs import check_file

        check_file(args.trace, "--trace")
    resolved = resolve_job(request_of(args))
    budget = resolve_budget(budget_request_of(args), resolved.gpu)
    est = estimate(resolved.job, target_bytes=budget.target_bytes, gpu_name=budget.gpu_name,
                   gpu_bytes=budget.gpu_bytes)
    if args.calibration is not None:
        from .calibrate.files import apply_file

        est = apply_file(est, args.calibration)
    if args.report:  # the same page `memplan report` writes (needs the report extra); written first, so that a
        from .report.command import write_estimate_report  # failed write prints nothing

        write_estimate_report(est, args.report, flag="--report")
    if args.trace is not None:
        _write_trace(resolved.job, args.trace)
    checks = node_checks(est.host_bytes_per_node, est.nvme_bytes_per_node, budget)
    sources = resolved.sources
    from . import render

    if args.json:
        import json

        from .budget import node_json
        from .sources import sources_json

        out = {**render.estimate_json(est), "node": node_json(checks, budget), "sources": sources_json(sources)}
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
    else:
        from rich.console import Console

        from .budget import node_lines
        from .sources import source_lines

        console = Console()
        render.render_estimate(est, console)
        for line in node_lines(checks) + source_lines(sources):
            console.print(line, highlight=False, markup=False)
    return 0


def _write_trace(job, path: str) -> None:
    """estimate --trace FILE: the predicted ledger as Chrome trace-event JSON (written whole or not at all)."""
    import json

    from .errors import InputError
    from .estimator import ledger_trace
    from .outputs import write_files

    trace = ledger_trace(job)
    if trace is None:
        raise InputError("--trace", "this job is estimated by the phase lists, not an allocation ledger, so there is "
                                    "no event trace to write; allowed: jobs the ledger models (see the docs)")
    write_files({path: json.dumps(trace)}, "--trace")


def _add_estimate(sub) -> None:
    from .options import add_budget_arguments, add_job_arguments

    doc = cmd_estimate.__doc__
    p = sub.add_parser("estimate", help=doc.splitlines()[0], description=doc, allow_abbrev=False,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_job_arguments(p)
    add_budget_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--calibration", metavar="FILE",
                   help="scale the estimate by a file from `memplan calibrate` (default: the uncalibrated model)")
    p.add_argument("--report", metavar="DIR", help="also write memplan report's Markdown/HTML page and plots to DIR")
    p.add_argument("--trace", metavar="FILE", help="also write the predicted allocation ledger and its simulated "
                                                    "reserved memory as Chrome trace-event JSON (Perfetto)")
    p.set_defaults(func=cmd_estimate)


def command_module(name: str):
    """memplan.<name>.command, or None when this build does not have it."""
    try:
        module = importlib.import_module(f"memplan.{name}.command")
    except ImportError:
        return None
    return module if hasattr(module, "add_arguments") and hasattr(module, "run") else None


def command_doc(module) -> str:
    """A lazy command's help: its module docstring, else its run() docstring ('' when neither exists)."""
    return (module.__doc__ or getattr(module.run, "__doc__", None) or "").strip()


def _add_lazy(sub, name: str, module) -> None:
    doc = command_doc(module)
    p = sub.add_parser(name, help=doc.splitlines()[0] if doc else "", description=doc, allow_abbrev=False,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(p)
    p.set_defaults(func=module.run)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s own module is imported (all of them when command is None, for --help)."""
    from . import __version__

    parser = _Parser(prog=PROG, description=DESCRIPTION, allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"memplan {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    for name in COMMANDS:
        if command is not None and name != command:
            continue
        if name == "estimate":
            _add_estimate(sub)
            continue
        module = command_module(name)
        if module is not None:
            _add_lazy(sub, name, module)
        elif command is None:
            sub.add_parser(name, help="(not available in this build)")
    return parser


def _command_of(argv: list[str]) -> str | None:
    """The subcommand named in argv (its first non-option word), if any."""
    for word in argv:
        if not word.startswith("-"):
            return word
    return None


def _dispatch(argv: list[str]) -> int:
    command = _command_of(argv)
    if command is None:
        if any(w in ("-h", "--help", "--version") for w in argv):
            build_parser().parse_args(argv)
        raise UsageError("command", f"missing; allowed: {', '.join(COMMANDS)}")
    if command not in COMMANDS:
        from .errors import shorten

        raise UsageError("command", f"unknown command {shorten(command)}; allowed: {', '.join(COMMANDS)}")
    if command in LAZY_COMMANDS and command_module(command) is None:
        raise UsageError(command, "not available in this build")
    try:
        args = build_parser(command).parse_args(argv)
    except UsageError as err:
        raise UsageError(err.field, err.message.replace("memplan <command>", f"memplan {command}")) from None
    return int(args.func(args) or 0)


def _error_line(exc: BaseException) -> str:
    """One line for any failure main catches (memplan.errors.one_line: values and the line cut)."""
    from .errors import InputError, one_line, shorten

    if isinstance(exc, (UsageError, InputError)):
        return one_line(f"{exc.field}: {exc.message}")
    if isinstance(exc, OSError):
        name = shorten(str(exc.filename), 80) if exc.filename is not None else "file"
        return one_line(f"{name}: cannot read or write ({exc.strerror or exc}); allowed: a readable file")
    if isinstance(exc, UnicodeError):
        return one_line(f"input: not UTF-8 text ({exc}); allowed: a UTF-8 JSON file")
    if isinstance(exc, RecursionError):
        return "input: nested too deeply; allowed: an ordinary JSON object"
    if type(exc).__name__ == "ValidationError":
        from .errors import from_pydantic

        err = from_pydantic(exc)
        return one_line(f"{err.field}: {err.message}")
    if type(exc).__name__ == "JSONDecodeError":
        return one_line(f"input: invalid JSON ({exc}); allowed: a JSON object")
    return one_line(f"internal: {type(exc).__name__}: {exc} (a memplan bug; please report it)")


def main(argv: list[str] | None = None) -> int:
    """Run the memplan command line; returns the exit code (2 and one stderr line on any error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(argv)
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else 0
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG}: error: interrupted\n")
        return 130
    except Exception as exc:  # noqa: BLE001 - every other failure: one line, exit 2, never a traceback
        sys.stderr.write(f"{PROG}: error: {_error_line(exc)}\n")
        return 2

if __name__ == "__main__":
    sys.exit(main())
