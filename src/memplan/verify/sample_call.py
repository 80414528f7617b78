"""One device call's share of a sampled matrix: `python -m memplan.verify.sample_call MATRIX --first N
--node-gpus G --budget-s S --out FILE`.

Takes MATRIX's first N lines in order, keeps those that run on a node of G GPUs (needs_gpus <= G) and stops
before the first kept line that would take the summed predicted_wall_s (memplan.verify.sample_cost, one job
alone) past S, so FILE is a prefix of what the node can run. S is the call's batch seconds times the batch's
parallelism: the seed-1 run measured 79 rows (3,111 s of wall summed) in two calls of 560 and 470 s deadlines
(benchmarks/accuracy/README.md), about 1,500 s of job wall per ~9-minute call. The lines are copied as they
are (python -m memplan.verify.batch FILE runs them and skips what rows.jsonl already holds).

`--skip-rows ROWS.jsonl` (repeatable) leaves out the lines whose name a committed rows file already holds, so a
later call takes the next unmeasured prefix without re-counting what earlier calls measured.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

#: --first's and --node-gpus' caps
MAX_LINES = 100_000
MAX_GPUS = 1024


def select(lines: list[dict[str, Any]], first: int, node_gpus: int, budget_s: float,
           measured: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """The lines of one call (see the module docstring); names in `measured` are left out."""
    out: list[dict[str, Any]] = []
    spent = 0.0
    for line in lines[:first]:
        if (line.get("needs_gpus") or 1) > node_gpus or line.get("name") in measured:
            continue
        wall = float(line.get("predicted_wall_s") or 0.0)
        if spent + wall > budget_s:
            break
        spent += wall
        out.append(line)
    return out


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (the project's bad-input contract)
        sys.stderr.write(f"memplan: error: {message.splitlines()[0]}\n")
        raise SystemExit(2)


def _bounded(cap: int):
    def parse(text: str) -> int:
        if not text.strip().isdigit() or not 1 <= int(text) <= cap:
            raise argparse.ArgumentTypeError(f"{text[:20]!r}: allowed: an integer 1..{cap}")
        return int(text)
    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < 1e9:
        raise argparse.ArgumentTypeError(f"{text[:20]!r}: allowed: a positive number of seconds")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m memplan.verify.sample_call", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("matrix", metavar="MATRIX.jsonl", help="a sampled matrix (memplan.verify.sample)")
    p.add_argument("--first", type=_bounded(MAX_LINES), required=True, help="look at the first N lines only")
    p.add_argument("--node-gpus", type=_bounded(MAX_GPUS), default=1, help="GPUs of the call's node (1)")
    p.add_argument("--budget-s", type=_seconds, required=True, metavar="S",
                   help="summed predicted wall seconds the call holds")
    p.add_argument("--out", required=True, metavar="FILE.jsonl", help="the call's matrix")
    p.add_argument("--skip-rows", action="append", default=[], metavar="ROWS.jsonl",
                   help="measured rows whose names are left out (repeatable)")
    return p


def _read(path: str, field: str = "matrix") -> list[dict[str, Any]]:
    from ..errors import InputError
    from ..inputs import read_json_lines

    try:
        return [line for _, line in read_json_lines(Path(path), field)]
    except InputError as exc:
        build_parser().error(str(exc))  # exits 2
    return []


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    out = Path(args.out)
    if out.is_dir() or not out.name.endswith(".jsonl") or out.resolve() == Path(args.matrix).resolve():
        build_parser().error(f"--out: {args.out[:60]!r}: allowed: a new FILE.jsonl path (not the matrix)")
    lines = _read(args.matrix)
    if any(not isinstance(x, dict) or not isinstance(x.get("name"), str) for x in lines):
        build_parser().error("matrix: allowed: JSON lines of {\"name\": ..., \"args\": [...]} objects")
    measured = frozenset(str(row.get("name")) for rows in args.skip_rows for row in _read(rows, "--skip-rows")
                         if isinstance(row, dict))
    chosen = select(lines, args.first, args.node_gpus, args.budget_s, measured)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(json.dumps(x, sort_keys=True) + "\n" for x in chosen))
    tmp.replace(out)
    split = Counter(x.get("split", "-") for x in chosen)
    wall = sum(float(x.get("predicted_wall_s") or 0) for x in chosen)
    last = chosen[-1].get("index", "?") if chosen else "-"
    print(f"{len(chosen)} lines (up to index {last}), predicted {wall:.0f} s summed, split "
          + ", ".join(f"{k} {v}" for k, v in sorted(split.items())) + f" -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
