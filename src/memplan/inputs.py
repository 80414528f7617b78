"""The one reader of every input file: a model config.json, a DeepSpeed JSON, a launch file, an
adapter_config.json, a verify report or rows file, a calibration file.

Every read goes through ``read_bytes``: ``os.stat`` first (it never blocks, even on a FIFO), so only a
regular file is opened — a FIFO, /dev/zero, /dev/stdin, a socket or a directory is refused before any open —
then the file is opened non-blocking, checked again with ``fstat`` (it may have been swapped since) and read
up to a size cap. Text must be UTF-8: UTF-16/UTF-32 (a byte-order mark, or NUL bytes) is refused by name.

JSON is parsed the way the program that really reads the file parses it (``Dialect``):

- ``"deepspeed"``: DeepSpeedConfig(path) in deepspeed 0.19.8 (runtime/config.py) reads the file with
  ``hjson.load(open(path), object_pairs_hook=dict_raise_error_on_duplicate_keys)``: hjson's comments (``#``,
  ``//``, ``/* */``) and relaxed syntax are accepted, a duplicate key is refused
  (runtime/config_utils.py: "Duplicate keys in DeepSpeed config"), a UTF-8 BOM is skipped (hjson's decoder
  strips it), an empty or comment-only file is ``{}``, NaN/Infinity and 1e999 are refused (hjson fails on
  them). Plain JSON is tried first (the C parser, fast); hjson only when that fails.
- ``"json"``: Python's json.loads of the UTF-8 text, as transformers reads config.json
  (PretrainedConfig._dict_from_json_file), as HfDeepSpeedConfig reads a DeepSpeed JSON on the Hugging Face
  Trainer path (integrations/deepspeed.py), as peft reads adapter_config.json (PeftConfigMixin.from_json_file)
  and HfArgumentParser.parse_json_file reads TrainingArguments: a UTF-8 BOM is refused (json.loads raises
  "Unexpected UTF-8 BOM"), comments are refused, a duplicate key's last value wins.
- ``"memplan"``: memplan's own files (verify reports and rows, calibration files): JSON, no BOM (memplan
  never writes one), a duplicate key refused (a row that says two things is not guessed at).

In every dialect a number of more than 4300 digits (Python's int-string limit), nesting deeper than
MAX_JSON_DEPTH and anything else malformed is an InputError naming the flag, never a ValueError or a
RecursionError. Nothing read is ever executed (no eval, no pickle, no remote code).
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any, Literal

from .errors import InputError, shorten

#: the largest input file read: a config.json or DeepSpeed JSON is a few KiB, a rows file a few MiB
MAX_INPUT_BYTES = 16 * 2**20
#: the largest launch file or --launch text: ARG_MAX, the most execve passes (Linux's default, _STK_LIM / 4
#: = 2 MiB for arguments and environment together), so a longer command line could never start
MAX_LAUNCH_BYTES = 2 * 2**20
#: the longest word of a launch line: Linux's MAX_ARG_STRLEN (include/uapi/linux/binfmts.h, 32 pages =
#: 128 KiB), the longest single argument execve accepts
MAX_WORD_CHARS = 128 * 2**10
#: the deepest JSON nesting accepted (real configs nest 3 or 4 levels)
MAX_JSON_DEPTH = 64

Dialect = Literal["deepspeed", "json", "memplan"]

_BOM = b"\xef\xbb\xbf"
_WIDE_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
              (b"\xfe\xff", "UTF-16"))
#: why a UTF-8 BOM is refused where it is
_BOM_REASON = {
    "json": "json.loads refuses ('Unexpected UTF-8 BOM'), as transformers and peft read it",
    "memplan": "memplan never writes one (json.loads refuses it)",
    "launch": "bash reads as part of the first word",
}


def shown_path(path: Any) -> str:
    """A path for a message: quoted, one line, shortened."""
    return shorten(os.fspath(path) if isinstance(path, os.PathLike) else str(path), 80)


def path_label(path: Any) -> str:
    """A path inside a field name (``ROWS rows.jsonl:3``): unquoted, control characters escaped, shortened."""
    text = shown_path(path)
    return text[1:-1] if text.startswith(("'", '"')) and text.endswith(("'", '"')) else text


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def check_regular(path: Any, flag: str, what: str = "file", limit: int = MAX_INPUT_BYTES) -> os.stat_result:
    """``os.stat`` of ``path`` (never blocks): a regular file of at most ``limit`` bytes, else InputError."""
    shown = shown_path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise InputError(flag, f"no such file {shown}; allowed: a readable {what}") from None
    except (OSError, ValueError) as err:  # ValueError: a NUL byte in the path
        reason = getattr(err, "strerror", None) or "not a usable path"
        raise InputError(flag, f"cannot read {shown} ({reason}); allowed: a readable {what}") from None
    if not stat.S_ISREG(st.st_mode):
        raise InputError(flag, f"{shown} is {_kind(st.st_mode)}; allowed: a regular {what} (memplan never reads "
                               "pipes, devices or sockets: such a read can block or never end)")
    if st.st_size > limit:
        raise InputError(flag, f"{shown} is {st.st_size} bytes; allowed: a {what} of at most {limit} bytes")
    return st


def read_bytes(path: Any, flag: str, what: str = "file", limit: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes (see the module docstring); InputError otherwise."""
    check_regular(path, flag, what, limit)
    shown = shown_path(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as err:
        raise InputError(flag, f"cannot read {shown} ({err.strerror or err}); allowed: a readable {what}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # swapped between stat and open
            raise InputError(flag, f"{shown} is {_kind(st.st_mode)}; allowed: a regular {what}")
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, min(2**20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as err:
        raise InputError(flag, f"cannot read {shown} ({err.strerror or err}); allowed: a readable {what}") from None
    finally:
        os.close(fd)
    if total > limit:
        raise InputError(flag, f"{shown} is over {limit} bytes; allowed: a {what} of at most {limit} bytes")
    return b"".join(chunks)


def decode_utf8(data: bytes, flag: str, shown: str, bom: Literal["strip", "refuse"], reason: str = "") -> str:
    """UTF-8 text of ``data``; UTF-16/32 and NUL bytes refused by name; a UTF-8 BOM stripped or refused."""
    for mark, name in _WIDE_BOMS:
        if data.startswith(mark):
            raise InputError(flag, f"{shown} is {name} text (it starts with a {name} byte-order mark); allowed: "
                                   "UTF-8 text")
    if b"\x00" in data:
        raise InputError(flag, f"{shown} contains NUL bytes (UTF-16 or binary, not text); allowed: UTF-8 text")
    if data.startswith(_BOM):
        if bom == "refuse":
            raise InputError(flag, f"{shown} starts with a UTF-8 byte-order mark, which {reason}; allowed: UTF-8 "
                                   "without a BOM")
        data = data[len(_BOM):]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputError(flag, f"{shown} is not UTF-8 (byte 0x{data[err.start]:02x} at offset {err.start}); "
                               "allowed: UTF-8 text") from None


def read_text(path: Any, flag: str, *, what: str = "text file", limit: int = MAX_INPUT_BYTES,
              bom: Literal["strip", "refuse"] = "refuse", bom_reason: str = _BOM_REASON["memplan"]) -> str:
    """A regular UTF-8 text file (read_bytes, then decode_utf8)."""
    return decode_utf8(read_bytes(path, flag, what, limit), flag, shown_path(path), bom, bom_reason)


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    """object_pairs_hook refusing a key given twice (as DeepSpeed's dict_raise_error_on_duplicate_keys does)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return out


class _NotFinite(Exception):
    pass


def _refuse_constant(name: str) -> float:
    raise _NotFinite(name)


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _NotFinite(text)
    return value


def _depth(value: Any) -> int:
    """How deeply ``value`` nests (iterative: the check must not itself recurse)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = list(node.values())
        if isinstance(node, list):
            deepest = max(deepest, depth)
            if depth > MAX_JSON_DEPTH:
                return depth
            stack.extend((child, depth + 1) for child in node if isinstance(child, (dict, list)))
    return deepest


def _hjson(text: str):
    """hjson.loads as DeepSpeedConfig uses it (hjson ships with deepspeed), or None when hjson is missing."""
    try:
        import hjson
    except ImportError:
        return None
    return hjson.loads(text, object_pairs_hook=_refuse_duplicates)


def parse_json(text: str, flag: str, shown: str, dialect: Dialect) -> Any:
    """``text`` parsed as ``dialect`` says (module docstring); every failure an InputError naming ``flag``."""
    strict = dialect != "json"
    kwargs: dict[str, Any] = {"object_pairs_hook": _refuse_duplicates} if strict else {}
    if dialect == "deepspeed":
        kwargs.update(parse_constant=_refuse_constant, parse_float=_finite_float)
    try:
        try:
            value = json.loads(text, **kwargs)
        except json.JSONDecodeError as err:
            if dialect != "deepspeed":
                raise InputError(flag, f"{shown} is not valid JSON (line {err.lineno} column {err.colno}: "
                                       f"{err.msg}); allowed: a JSON file") from None
            try:
                value = _hjson(text)
            except ValueError as hjson_err:
                if "digits" in str(hjson_err):
                    raise
                raise InputError(flag, f"{shown} is not valid JSON (line {err.lineno} column {err.colno}: "
                                       f"{err.msg}), nor the hjson DeepSpeed also reads; allowed: a JSON file "
                                       "(hjson comments allowed)") from None
            if value is None:
                raise InputError(flag, f"{shown} is not plain JSON (line {err.lineno} column {err.colno}: "
                                       f"{err.msg}) and hjson, which DeepSpeed reads it with, is not installed; "
                                       "allowed: JSON (or pip install hjson for comments)") from None
    except InputError:
        raise
    except _DuplicateKey as err:
        why = ("DeepSpeed refuses it: dict_raise_error_on_duplicate_keys in runtime/config_utils.py"
               if dialect == "deepspeed" else "memplan does not guess which one is meant")
        raise InputError(f"{flag} {shorten(err.key, 40)}", f"the key appears twice in {shown} ({why}); allowed: "
                                                            "each key once") from None
    except _NotFinite as err:
        raise InputError(flag, f"{shown} has the number {shorten(str(err), 20)}, which DeepSpeed's hjson reader "
                               "refuses; allowed: finite numbers") from None
    except RecursionError:
        raise InputError(flag, f"{shown} is nested too deeply; allowed: JSON nested at most {MAX_JSON_DEPTH} "
                               "levels") from None
    except OverflowError:  # hjson: 1e999
        raise InputError(flag, f"{shown} has a number out of range; allowed: finite numbers") from None
    except ValueError as err:  # the int-string limit (4300 digits), or hjson's own syntax errors
        text_of = " ".join(str(err).split())
        if "digits" in text_of:
            raise InputError(flag, f"{shown} has an integer of more than 4300 digits (Python's int-string limit); "
                                   "allowed: integers of at most 4300 digits") from None
        raise InputError(flag, f"{shown} is not valid JSON ({shorten(text_of, 120)[1:-1]}); allowed: a JSON or "
                               "hjson file as DeepSpeed reads it") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise InputError(flag, f"{shown} is nested too deeply; allowed: JSON nested at most {MAX_JSON_DEPTH} levels")
    return value


def read_json(path: Any, flag: str, dialect: Dialect = "json", what: str = "JSON file") -> Any:
    """A JSON file parsed as ``dialect`` (see the module docstring)."""
    shown = shown_path(path)
    data = read_bytes(path, flag, what)
    text = decode_utf8(data, flag, shown, "strip" if dialect == "deepspeed" else "refuse",
                       _BOM_REASON.get(dialect, ""))
    return parse_json(text, flag, shown, dialect)


def read_json_object(path: Any, flag: str, dialect: Dialect = "json", what: str = "JSON file") -> dict:
    """read_json, required to hold one JSON object ``{...}``."""
    value = read_json(path, flag, dialect, what)
    if not isinstance(value, dict):
        raise InputError(flag, f"{shown_path(path)} must hold a JSON object {{...}} (got {type(value).__name__}); "
                               f"allowed: a {what}")
    return value


def read_json_lines(path: Any, flag: str, what: str = "JSON-lines file") -> list[tuple[int, Any]]:
    """(line number, value) for every non-blank line of a memplan JSON-lines file (verify rows)."""
    text = read_text(path, flag, what=what)
    label = path_label(path)
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            out.append((number, parse_json(line, flag, f"{label}:{number}", "memplan")))
    return out


def launch_text(text: str, flag: str) -> str:
    """A launch line given on the command line (--launch): at most MAX_LAUNCH_BYTES, no NUL."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_LAUNCH_BYTES:
        raise InputError(flag, f"{len(text)} characters; allowed: a command line of at most {MAX_LAUNCH_BYTES} "
                               "bytes (ARG_MAX: a longer one could never be executed)")
    if "\x00" in text:
        raise InputError(flag, "contains a NUL character; allowed: shell text")
    return text


def read_launch_file(path: Any, flag: str = "--launch-file") -> str:
    """A shell file holding a launch line: a regular UTF-8 file of at most MAX_LAUNCH_BYTES, no BOM."""
    return read_text(path, flag, what="shell file", limit=MAX_LAUNCH_BYTES, bom="refuse",
                     bom_reason=_BOM_REASON["launch"])


__all__ = [
    "MAX_INPUT_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_LAUNCH_BYTES",
    "MAX_WORD_CHARS",
    "Dialect",
    "check_regular",
    "decode_utf8",
    "launch_text",
    "parse_json",
    "path_label",
    "read_bytes",
    "read_json",
    "read_json_lines",
    "read_json_object",
    "read_launch_file",
    "read_text",
    "shown_path",
]
