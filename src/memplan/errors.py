"""The one error type user input raises, and the one helper that shortens a value for a message.

Every message memplan prints about bad input is one line, ``memplan: error: <field>: <what is allowed>``
(memplan.cli formats it); a value echoed back goes through ``shorten`` first, so a 20,000-character flag
value or a control character in a path never breaks the line.
"""

from __future__ import annotations

from typing import Any

#: characters of a value shown in a message before it is cut (the rest is counted, not shown)
SHOWN_CHARS = 60


def shorten(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``value`` for an error message: quoted like repr (control characters escaped, so always one line), cut
    to about ``limit`` characters with the full length said (``'aaaa…' (20000 characters)``)."""
    text = value if isinstance(value, str) else repr(value)
    if not isinstance(value, str):
        return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"
    if len(text) <= limit:
        return repr(text)
    return f"{repr(text[:limit])[:-1]}…{repr(text[:limit])[-1]} ({len(text)} characters)"


def one_line(text: str, limit: int = 600) -> str:
    """``text`` on one line (runs of whitespace as one space), any run of over 200 non-space characters and
    the whole line cut: the last guard before memplan.cli prints a message."""
    words = []
    for word in str(text).split():
        words.append(word if len(word) <= 200 else f"{word[:80]}…({len(word)} characters)")
    line = " ".join(words)
    return line if len(line) <= limit else line[:limit] + "…"


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
        msg = f"{msg} (got {shorten(got)})"
    return InputError(field, msg.replace("\n", " "))
