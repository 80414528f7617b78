"""Parsing a launch line: `deepspeed [runner opts] script [script args]`, torchrun, `accelerate launch`, python.

Launcher options are matched as each launcher's argparse matches them: the deepspeed runner
(deepspeed/launcher/runner.py) and torchrun (torch/distributed/run.py) use argparse's default
allow_abbrev=True, so a unique prefix is accepted; accelerate and Megatron-DeepSpeed set allow_abbrev=False.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from ..errors import InputError
from .tables import launcher_flags


class Launch(BaseModel):
    """A parsed launch line."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    launcher: str  # deepspeed | torchrun | accelerate | python
    launcher_options: dict[str, str | None] = {}  # canonical flag → value (None for a switch)
    launcher_unknown: tuple[str, ...] = ()
    script: str | None = None
    script_args: tuple[tuple[str, str | None], ...] = ()  # (flag as written, value or None), in order
    positionals: tuple[str, ...] = ()

    def script_value(self, *flags: str) -> str | None:
        """The last value given for any of ``flags`` (as argparse keeps the last)."""
        out = None
        for flag, value in self.script_args:
            if flag in flags:
                out = value if value is not None else ""
        return out

    def has(self, flag: str) -> bool:
        return any(f == flag for f, _ in self.script_args)


def read_launch_file(path: str) -> str:
    """The launch line from a shell file; unreadable → InputError('--launch-file', ...)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise InputError("--launch-file", f"{path}: cannot read ({getattr(err, 'strerror', None) or 'not text'})") \
            from None


def _tokens(text: str) -> list[str]:
    """The command's words: comments and line continuations removed; the first command line only."""
    lines = [ln for ln in text.replace("\\\r\n", " ").replace("\\\n", " ").splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    for line in lines:
        try:
            words = shlex.split(line, comments=True)
        except ValueError as err:
            raise InputError("--launch", f"cannot split the command line ({err})") from None
        while words and "=" in words[0] and not words[0].startswith("-"):  # VAR=value prefixes
            words = words[1:]
        if words and words[0] not in ("export", "set", "cd"):
            return words
    raise InputError("--launch", "no command found; give a deepspeed, torchrun, accelerate launch or python line")


def resolve_flag(flag: str, table: dict[str, bool], allow_abbrev: bool) -> str | None:
    """The canonical option ``flag`` selects in ``table`` (exact, or a unique prefix when allowed)."""
    name = flag.split("=", 1)[0]
    if name in table:
        return name
    if allow_abbrev and name.startswith("--"):
        hits = [k for k in table if k.startswith(name)]
        if len(hits) == 1:
            return hits[0]
    return None


def _launcher_of(words: list[str]) -> tuple[str, list[str]]:
    head = Path(words[0]).name
    if head == "deepspeed":
        return "deepspeed", words[1:]
    if head == "torchrun":
        return "torchrun", words[1:]
    if head == "accelerate" and len(words) > 1 and words[1] == "launch":
        return "accelerate", words[2:]
    if head.startswith("python") and len(words) > 2 and words[1] == "-m" and words[2] in (
            "torch.distributed.run", "torch.distributed.launch"):
        return "torchrun", words[3:]
    if head.startswith("python"):
        return "python", words[1:]
    return "python", words  # a bare script


def _split_launcher(launcher: str, rest: list[str]) -> tuple[dict, list[str], list[str]]:
    """(options, unknown options, the words from the script on)."""
    if launcher == "python":
        return {}, [], rest
    table = launcher_flags(launcher)
    options: dict[str, str | None] = {}
    unknown: list[str] = []
    i = 0
    while i < len(rest) and rest[i].startswith("-"):
        word = rest[i]
        canon = resolve_flag(word, table, allow_abbrev=launcher != "accelerate")
        if canon is None and launcher == "accelerate":
            canon = resolve_flag(word.replace("-", "_").replace("__", "--", 1), table, False)
        takes = table.get(canon, False) if canon else (i + 1 < len(rest) and not rest[i + 1].startswith("-")
                                                      and not rest[i + 1].endswith(".py"))
        value = word.split("=", 1)[1] if "=" in word else None
        if value is None and takes and i + 1 < len(rest):
            value, i = rest[i + 1], i + 1
        if canon is None:
            unknown.append(word.split("=", 1)[0])
        else:
            options[canon] = value
        i += 1
    return options, unknown, rest[i:]


def _script_args(words: list[str]) -> tuple[list[tuple[str, str | None]], list[str]]:
    """Script flags as (flag, value): ``--f v``, ``--f=v`` or a switch; leftover positionals."""
    args: list[tuple[str, str | None]] = []
    positionals: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        if word.startswith("--") or (word.startswith("-") and len(word) == 2 and not word[1].isdigit()):
            if "=" in word:
                flag, value = word.split("=", 1)
                args.append((flag, value))
            elif i + 1 < len(words) and not (words[i + 1].startswith("-") and not _is_number(words[i + 1])):
                args.append((word, words[i + 1]))
                i += 1
            else:
                args.append((word, None))
        else:
            positionals.append(word)
        i += 1
    return args, positionals


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def parse_launch(text: str) -> Launch:
    """Parse a launch line (shell text: continuations and comments allowed)."""
    launcher, rest = _launcher_of(_tokens(text))
    options, unknown, tail = _split_launcher(launcher, rest)
    script = tail[0] if tail else None
    args, positionals = _script_args(tail[1:]) if tail else ([], [])
    return Launch(launcher=launcher, launcher_options=options, launcher_unknown=tuple(unknown), script=script,
                  script_args=tuple(args), positionals=tuple(positionals))


def _count_include(spec: str) -> int | None:
    """Slots named by deepspeed's --include NODE[:SLOT,...][@NODE...]; None when a node takes all its slots."""
    total = 0
    for node in spec.split("@"):
        if ":" not in node:
            return None
        total += len([s for s in node.split(":", 1)[1].split(",") if s])
    return total


def launch_world(launch: Launch) -> int | None:
    """The world size the launch line asks for, when it says (None: decided by the hosts' GPUs)."""
    o = launch.launcher_options
    try:
        if launch.launcher == "deepspeed":
            if o.get("--include"):
                return _count_include(o["--include"])
            gpus = o.get("--num_gpus") or o.get("--num_accelerators")
            nodes = int(o.get("--num_nodes") or 1)
            return int(gpus) * nodes if gpus and int(gpus) > 0 else None
        if launch.launcher == "torchrun":
            per_node = o.get("--nproc-per-node") or o.get("--nproc_per_node")
            nodes = str(o.get("--nnodes") or "1").split(":")[-1]
            return int(per_node) * int(nodes) if per_node and per_node.isdigit() else None
        if launch.launcher == "accelerate":
            n = o.get("--num_processes")
            return int(n) if n else None
    except ValueError:
        return None
    return 1 if launch.launcher == "python" else None
