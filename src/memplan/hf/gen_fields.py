"""Regenerate fields.json from transformers' TrainingArguments (a developer tool; needs transformers and torch).

    python -m memplan.hf.gen_fields

What it records, all read from the installed transformers (5.17.0 when committed):

- every init field of ``transformers.TrainingArguments`` (training_args.py): its name, the kind of value
  HfArgumentParser parses for it (hf_argparser.py ``_parse_dataclass_field``: bool → ``string_to_bool`` with
  ``nargs="?"``, ``const=True``; a list → ``nargs="+"``; ``dict | str`` → a string that
  ``TrainingArguments.__post_init__`` json-loads when it starts with "{"), and its default;
- ``OptimizerNames`` (training_args.py) and ``SchedulerType`` (trainer_utils.py): the values ``optim`` and
  ``lr_scheduler_type`` accept (``__post_init__`` converts them to the enums, refusing anything else).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import typing
from pathlib import Path

FIELDS = Path(__file__).with_name("fields.json")


def _kind(tp) -> tuple[str, bool]:
    """(bool | int | float | str | dict | list | other, optional) of a field's annotation, as HfArgumentParser
    treats it."""
    import types

    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    args = typing.get_args(tp) if union else (tp,)
    optional = type(None) in args
    members = [a for a in args if a is not type(None)] or [tp]
    origins = [typing.get_origin(a) or a for a in members]
    if set(origins) == {bool}:
        return "bool", optional
    if dict in origins:
        return "dict", optional
    if origins == [list]:
        return "list", optional
    for name, kind in (("int", int), ("float", float)):
        if origins == [kind]:
            return name, optional
    if str in origins or any(isinstance(o, type) and issubclass(o, enum.Enum) for o in origins):
        return "str", optional
    return "other", optional


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return None
    if isinstance(value, enum.Enum):
        return value.value
    return value if isinstance(value, (bool, int, float, str, list, dict, type(None))) else repr(value)


def build() -> dict:
    """The table, read from the installed transformers."""
    import transformers
    from transformers import TrainingArguments
    from transformers.trainer_utils import SchedulerType
    from transformers.training_args import OptimizerNames

    hints = typing.get_type_hints(TrainingArguments)
    fields = {}
    for field in dataclasses.fields(TrainingArguments):
        if not field.init:
            continue
        kind, optional = _kind(hints[field.name])
        fields[field.name] = {"kind": kind, "optional": optional, "default": _default(field)}
    return {
        "transformers_version": transformers.__version__,
        "source": "transformers/training_args.py TrainingArguments (init fields), OptimizerNames; "
                  "transformers/trainer_utils.py SchedulerType",
        "fields": fields,
        "optim_names": [o.value for o in OptimizerNames],
        "scheduler_types": [s.value for s in SchedulerType],
    }


def main() -> None:
    FIELDS.write_text(json.dumps(build(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {FIELDS}")


if __name__ == "__main__":
    main()
