"""Parsing a launch line: `deepspeed [runner opts] script [script args]`, torchrun, `accelerate launch`, python.

Launcher options are matched as each launcher's argparse matches them: the deepspeed runner
(deepspeed/launcher/runner.py) and torchrun (torch/distributed/run.py) use argparse's default
allow_abbrev=True, so a unique prefix is accepted; accelerate and Megatron-DeepSpeed set allow_abbrev=False.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from ..bounds import MAX_COUNT, MAX_RANKS, int_argument
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
    #: (flag, every word after it up to the next flag), in order: argparse's nargs="+" lists
    script_lists: tuple[tuple[str, tuple[str, ...]], ...] = ()
    source: str = "--launch"  # the flag the line came from (--launch or --launch-file), for error messages

    def script_list(self, flag: str) -> tuple[str, ...] | None:
        """The words the last ``flag`` was given (an nargs="+" list as argparse keeps the last), None if absent."""
        out = None
        for f, words in self.script_lists:
            if f == flag:
                out = words
        return out

    def script_value(self, *flags: str) -> str | None:
        """The last value given for any of ``flags`` (as argparse keeps the last)."""
        out = None
        for flag, value in self.script_args:
            if flag in flags:
                out = value if value is not None else ""
        return out

    def has(self, flag: str) -> bool:
        return any(f == flag for f, _ in self.script_args)


def read_launch_file(path: str, flag: str = "--launch-file") -> str:
    """The text of a shell file holding the launch line (memplan.inputs.read_launch_file: a regular UTF-8
    file of at most ARG_MAX bytes; FIFOs, devices, huge files refused)."""
    from ..inputs import read_launch_file as read

    return read(path, flag)


#: words that start a command without being the command (skipped when looking for the launch)
_PREFIXES = ("exec", "nohup", "time", "env")
_NOT_LAUNCH = ("export", "set", "cd", "source", ".", "ulimit", "unset", "echo", "mkdir", "module", "conda",
               "printf", "true", ":")
_LAUNCHERS = ("deepspeed", "torchrun", "accelerate")


def _tokens(text: str, flag: str = "--launch") -> list[str]:
    """The launch command's words: the first command whose program is a launcher (deepspeed, torchrun,
    accelerate launch, python), else the first that is not a shell set-up command (export, cd, ...);
    VAR=value and exec/nohup/env prefixes dropped."""
    candidates = []
    from .shell import shell_commands

    for words in shell_commands(text, flag):
        while words and ("=" in words[0] and not words[0].startswith(("-", "=")) or words[0] in _PREFIXES):
            words = words[1:]
        if words and words[0] not in _NOT_LAUNCH:
            candidates.append(words)
    for words in candidates:
        head = Path(words[0]).name
        if head in _LAUNCHERS or head.startswith("python"):
            return words
    if candidates:
        return candidates[0]
    raise InputError(flag, "no command found; allowed: a deepspeed, torchrun, accelerate launch or python line")


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


def _script_lists(words: list[str]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Each script flag with the words after it up to the next flag (``--f=a b`` gives a, b)."""
    out: list[tuple[str, list[str]]] = []
    for word in words:
        if word.startswith("--"):
            flag, eq, value = word.partition("=")
            out.append((flag, [value] if eq else []))
        elif out and not (word.startswith("-") and not _is_number(word)):
            out[-1][1].append(word)
    return tuple((f, tuple(v)) for f, v in out)


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def parse_launch(text: str, flag: str = "--launch") -> Launch:
    """Parse a launch line (shell text: continuations, comments and several commands allowed; the launch is
    the command memplan.check.launch._tokens picks). ``flag`` (--launch or --launch-file) names the input in
    errors; empty or comment-only text is refused."""
    from ..inputs import launch_text

    launcher, rest = _launcher_of(_tokens(launch_text(text, flag), flag))
    options, unknown, tail = _split_launcher(launcher, rest)
    script = tail[0] if tail else None
    args, positionals = _script_args(tail[1:]) if tail else ([], [])
    launch = Launch(launcher=launcher, launcher_options=options, launcher_unknown=tuple(unknown), script=script,
                    script_args=tuple(args), positionals=tuple(positionals),
                    script_lists=_script_lists(tail[1:]) if tail else (), source=flag)
    from .rules_job import is_megatron

    check_counts(launch, is_megatron(launch))
    return launch


#: Megatron-DeepSpeed's integer flags memplan reads (megatron/arguments.py at the commit in tables.json: each is
#: type=int, so its argparse refuses '2.5' or 'inf'): flag → (least, most). The layout sizes must be at least
#: 1 (validate_args divides the world by them: 0 is a ZeroDivisionError there); --zero-stage takes any int
#: (pretrain_gpt.py only compares it with 3). --sequence-parallel-size is not a Megatron flag (rules_job
#: reports it) but memplan reads it as the sp the line means.
MEGATRON_COUNTS: dict[str, tuple[int, int]] = {
    "--tensor-model-parallel-size": (1, MAX_RANKS), "--pipeline-model-parallel-size": (1, MAX_RANKS),
    "--ds-sequence-parallel-size": (1, MAX_RANKS), "--sequence-parallel-size": (1, MAX_RANKS),
    "--micro-batch-size": (1, MAX_COUNT), "--global-batch-size": (1, MAX_COUNT), "--seq-length": (1, MAX_COUNT),
    "--num-layers": (1, MAX_COUNT), "--hidden-size": (1, MAX_COUNT), "--num-attention-heads": (1, MAX_COUNT),
    "--max-position-embeddings": (1, MAX_COUNT), "--zero-stage": (-(2**63), 2**63 - 1),
}
#: launcher options that are counts (deepspeed launcher/runner.py: --num_gpus/--num_nodes type=int, <= 0 means
#: "all"; accelerate launch: --num_processes/--num_machines type=int), and torchrun's (torch/distributed/run.py:
#: --nproc-per-node str, an int or auto/cpu/gpu/xpu; --nnodes str, N or MIN:MAX)
LAUNCHER_COUNTS: dict[str, dict[str, tuple[int, int]]] = {
    "deepspeed": {"--num_gpus": (-(2**31), MAX_RANKS), "--num_accelerators": (-(2**31), MAX_RANKS),
                  "--num_nodes": (-(2**31), MAX_RANKS)},
    "accelerate": {"--num_processes": (1, MAX_RANKS), "--num_machines": (1, MAX_RANKS)},
}
_TORCHRUN_DEVICES = ("auto", "cpu", "gpu", "xpu")


def _field(launch: Launch, flag: str) -> str:
    return f"{launch.source} {flag}"


def script_int(launch: Launch, flag: str) -> int | None:
    """The script flag's value as its argparse (type=int) reads it, bounded as MEGATRON_COUNTS says; None when
    the flag is not given. InputError naming ``<--launch or --launch-file> <flag>`` otherwise."""
    value = launch.script_value(flag)
    if value is None:
        return None
    if value == "":
        raise InputError(_field(launch, flag), "expected one argument (its argparse stops there); allowed: the flag "
                                               "followed by an integer")
    least, most = MEGATRON_COUNTS.get(flag, (1, MAX_COUNT))
    return int_argument(value, _field(launch, flag), minimum=least, maximum=most)


def launcher_int(launch: Launch, flag: str) -> int | None:
    """A launcher option's count (LAUNCHER_COUNTS), None when not given; InputError when its argparse refuses it
    or it is out of bounds."""
    value = launch.launcher_options.get(flag)
    if value is None:
        return None
    least, most = LAUNCHER_COUNTS.get(launch.launcher, {}).get(flag, (1, MAX_RANKS))
    return int_argument(value, _field(launch, flag), minimum=least, maximum=most)


def check_counts(launch: Launch, megatron: bool) -> None:
    """Every count memplan reads from the line, checked once when it is parsed (the same bounds for every
    command): the launcher's options, the world they make, and (Megatron-DeepSpeed lines) the script's flags."""
    for flag in LAUNCHER_COUNTS.get(launch.launcher, {}):
        launcher_int(launch, flag)
    if megatron:
        for flag in MEGATRON_COUNTS:
            script_int(launch, flag)
    launch_world(launch)


def _count_include(launch: Launch, spec: str) -> int | None:
    """Slots named by deepspeed's --include NODE[:SLOT,...][@NODE...]; None when a node takes all its slots."""
    total = 0
    for node in spec.split("@"):
        if ":" not in node:
            return None
        total += len([s for s in node.split(":", 1)[1].split(",") if s])
    return _world(launch, "--include", total)


def _world(launch: Launch, flags: str, world: int) -> int:
    if world > MAX_RANKS:
        raise InputError(_field(launch, flags), f"asks for {world} ranks; allowed: at most {MAX_RANKS} ranks")
    return world


def _torchrun_int(launch: Launch, flag: str, text: str) -> int:
    return int_argument(text, _field(launch, flag), maximum=MAX_RANKS, unit="ranks")


def launch_world(launch: Launch) -> int | None:
    """The world size the launch line asks for, when it says (None: decided by the hosts' GPUs)."""
    o = launch.launcher_options
    if launch.launcher == "deepspeed":
        if o.get("--include"):
            return _count_include(launch, o["--include"])
        gpus = launcher_int(launch, "--num_gpus")
        gpus = gpus if gpus is not None else launcher_int(launch, "--num_accelerators")
        nodes = launcher_int(launch, "--num_nodes") or 1
        if gpus is None or gpus <= 0:
            return None  # <= 0: every GPU of each host (apply_num_nodes_and_gpus)
        return _world(launch, "--num_gpus", gpus * max(nodes, 1))
    if launch.launcher == "torchrun":
        flag = "--nproc-per-node" if "--nproc-per-node" in o else "--nproc_per_node"
        per_node = o.get(flag)
        nodes_text = o.get("--nnodes") or "1"
        nodes = [_torchrun_int(launch, "--nnodes", part) for part in str(nodes_text).split(":", 1)][-1]
        if per_node is None or per_node.strip() in _TORCHRUN_DEVICES:
            return None
        return _world(launch, flag, _torchrun_int(launch, flag, per_node) * nodes)
    if launch.launcher == "accelerate":
        return launcher_int(launch, "--num_processes")
    return 1 if launch.launcher == "python" else None
