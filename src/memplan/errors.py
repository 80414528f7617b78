"""The one error type user input raises: it names the field and what is allowed."""

from __future__ import annotations


class InputError(ValueError):
    """Invalid user input. ``str(err)`` is one line: ``<field>: <what is wrong>; <what is allowed>``."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


def from_pydantic(err, prefix: str = "") -> InputError:
    """Turn a pydantic ValidationError into an InputError naming the first failing field."""
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()) if p != "__root__")
    field = f"{prefix}{loc}" if loc else (prefix.rstrip(".") or "input")
    msg = first.get("msg", "invalid value")
    msg = msg.removeprefix("Value error, ")
    got = first.get("input")
    if got is not None and not isinstance(got, (dict, list)) and first.get("type") != "missing":
        msg = f"{msg} (got {got!r})"
    return InputError(field, msg.replace("\n", " "))
