"""The Trainer flags of a launch line, read as transformers' HfArgumentParser reads them.

HfArgumentParser (transformers/hf_argparser.py, ``_parse_dataclass_field``) adds one option per
TrainingArguments field: ``--name`` and, for names with underscores, ``--name-with-dashes``; a bool field takes
an optional value (``nargs="?"``, ``const=True``, ``string_to_bool``: yes/no, true/false, t/f, y/n, 1/0) and, when
its default is True, a ``--no_name`` complement; an int or float field takes one value converted by ``int`` or
``float``; a ``dict | str`` field takes a string that TrainingArguments.__post_init__ json-loads when it starts
with "{". HfArgumentParser is an argparse parser with allow_abbrev=True, so a unique prefix also selects a
field. The flags of the script's own dataclasses (``--model_name_or_path`` ...) are not TrainingArguments:
they are reported as not used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from ..errors import InputError
from .args import MODELED, TrainingArgs, build_args, fields_table

#: TrainingArguments flags that also appear on launch lines that are not Trainer scripts (DeepSpeed's own
#: add_config_arguments has --deepspeed as a switch; --local_rank and --seed are everyone's)
GENERIC_FLAGS = ("local_rank", "seed", "deepspeed")

_TRUE = ("yes", "true", "t", "y", "1")
_FALSE = ("no", "false", "f", "n", "0")


@dataclass
class FlagReading:
    """What a launch line's flags say about TrainingArguments."""

    args: TrainingArgs
    used: list[str] = field(default_factory=list)  # flags that set a modelled field
    not_memory: list[str] = field(default_factory=list)  # TrainingArguments flags memplan does not model
    not_trainer: list[str] = field(default_factory=list)  # flags that are not TrainingArguments'
    notes: list[str] = field(default_factory=list)
    deepspeed: str | None = None  # the --deepspeed value (a DeepSpeed JSON path)


@lru_cache(maxsize=1)
def _options() -> dict[str, tuple[str, bool]]:
    """option string → (field, negated): --name, --name-with-dashes, and --no_name for default-True bools."""
    out: dict[str, tuple[str, bool]] = {}
    for name, info in fields_table()["fields"].items():
        out[f"--{name}"] = (name, False)
        out[f"--{name.replace('_', '-')}"] = (name, False)
        if info["kind"] == "bool" and info["default"] is True:
            out[f"--no_{name}"] = (name, True)
            out[f"--no-{name.replace('_', '-')}"] = (name, True)
    return out


def resolve(flag: str) -> tuple[str, bool, str | None] | None:
    """(field, negated, note) the option selects, or None when it is not a TrainingArguments option."""
    options = _options()
    if flag in options:
        return (*options[flag], None)
    if flag.startswith("--") and len(flag) > 3:
        hits = {options[o] for o in options if o.startswith(flag)}
        if len(hits) == 1:
            name, negated = hits.pop()
            return name, negated, (f"{flag} read as --{name}: HfArgumentParser (argparse, allow_abbrev) accepts a "
                                   "unique prefix, unless the script's own flags share it")
    return None


def parse_value(name: str, value: str | None, flag: str) -> Any:
    """The value HfArgumentParser gives the field ``name`` from ``value`` (None: the flag alone)."""
    kind = fields_table()["fields"][name]["kind"]
    if kind == "bool":
        if value is None:
            return True
        if value.lower() in _TRUE:
            return True
        if value.lower() in _FALSE:
            return False
        raise InputError(flag, f"{value[:40]!r}: truthy value expected; allowed: yes/no, true/false, t/f, y/n, 1/0 "
                         "(hf_argparser.string_to_bool)")
    if value is None:
        raise InputError(flag, "expected one argument")
    if kind == "int":
        try:
            return int(value)
        except ValueError:
            raise InputError(flag, f"{value[:40]!r} is not an integer (argparse type=int)") from None
    if kind == "float":
        try:
            return float(value)
        except ValueError:
            raise InputError(flag, f"{value[:40]!r} is not a number (argparse type=float)") from None
    return value


def read_flags(script_args, base: TrainingArgs | None = None) -> FlagReading:
    """TrainingArgs from ``base`` (or the defaults) with the line's Trainer flags laid over it, in order (argparse
    keeps the last); every flag of the line is either used or listed as not used."""
    values: dict[str, Any] = (base or TrainingArgs()).model_dump(exclude_unset=base is None)
    flag_of: dict[str, str] = {}
    reading = FlagReading(args=base or TrainingArgs())
    for flag, value in script_args:
        hit = resolve(flag)
        if hit is None:
            reading.not_trainer.append(flag)
            continue
        name, negated, note = hit
        if note:
            reading.notes.append(note)
        parsed = False if negated else parse_value(name, value, flag)
        if name == "deepspeed":
            reading.deepspeed = parsed if isinstance(parsed, str) else None
        if name in MODELED:
            values[name] = parsed
            flag_of[name] = flag
            reading.used.append(flag)
        else:
            reading.not_memory.append(flag)
    reading.args = build_args(values, lambda f: flag_of.get(f, f"--{f}"))
    return reading


def has_trainer_flags(script_args) -> bool:
    """Whether a (non-Megatron) line passes TrainingArguments flags: any besides --local_rank / --seed, or
    --deepspeed with a JSON path (the Trainer's --deepspeed takes the config; DeepSpeed's own is a switch)."""
    for flag, value in script_args:
        hit = resolve(flag)
        if hit is None:
            continue
        if hit[0] not in GENERIC_FLAGS:
            return True
        if hit[0] == "deepspeed" and value is not None and (value.endswith(".json") or value.startswith("{")):
            return True
    return False


__all__ = ["FlagReading", "has_trainer_flags", "parse_value", "read_flags", "resolve"]
