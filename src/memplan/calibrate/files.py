"""The files of calibration: verify rows in (JSON lines), the calibration file out and back in.

Every bad input is an InputError naming the file, the line and the field: a malformed line, a row without the
keys a comparison needs, a calibration file with an unknown key, another schema version or a factor out of
bounds. Predictions come from memplan.accuracy.compare_rows, so a row is compared exactly as the accuracy test
compares it (an emulated row at rank 0, a reduced-depth row at each depth it was measured at).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..errors import InputError, from_pydantic, shorten
from .fit import MIN_ROWS, Calibration, Environment, Point

#: what a directory argument contributes (as in memplan.accuracy.iter_rows)
ROWS_GLOB = "rows*.jsonl"
_ENV_KEYS = ("torch", "deepspeed", "transformers", "gpu")
#: the largest measured peak a row may claim (1 EiB: far beyond any device; keeps ratios finite floats)
MAX_BYTES = 2**60


def row_files(paths: list[str]) -> list[Path]:
    """Each path as given, a directory as every rows*.jsonl in it (sorted); each must be a regular file
    (memplan.inputs.check_regular: a FIFO or a device is refused before anything is opened)."""
    from ..inputs import check_regular, shown_path

    out: list[Path] = []
    for text in paths:
        path = Path(text)
        try:
            is_dir = path.is_dir()
        except (OSError, ValueError):  # a name too long, a NUL byte: check_regular names the problem
            is_dir = False
        if is_dir:
            found = sorted(path.glob(ROWS_GLOB))
            if not found:
                raise InputError("ROWS", f"{shown_path(text)}: no {ROWS_GLOB} in this directory; allowed: a folder "
                                         "of verify rows")
            out += found
        else:
            out.append(path)
    for path in out:
        check_regular(path, "ROWS", "rows .jsonl file")
    return out


def read_rows(paths: list[str]) -> list[tuple[str, Any]]:
    """(``file:line``, parsed JSON) for every non-blank line of every rows file (memplan.inputs: UTF-8,
    duplicate keys refused, nesting and number sizes bounded)."""
    from ..inputs import path_label, read_json_lines

    rows = []
    for path in row_files(paths):
        rows += [(f"ROWS {path_label(path)}:{number}", value) for number, value in read_json_lines(path, "ROWS")]
    return rows


def _need(where: str, row: dict, key: str, kind: type | tuple[type, ...], allowed: str) -> Any:
    value = row.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        got = "missing" if key not in row else f"got {type(value).__name__}"
        raise InputError(f"{where}: {key}", f"{got}; allowed: {allowed}")
    return value


def _measured_bytes(where: str, obj: dict, key: str) -> None:
    value = _need(where, obj, key, int, f"bytes, an integer in 1..2**{MAX_BYTES.bit_length() - 1}")
    if not 0 < value <= MAX_BYTES:
        raise InputError(f"{where}: {key}", f"got {value}; allowed: bytes in 1..2**{MAX_BYTES.bit_length() - 1}")


def _check_measured(where: str, row: dict) -> None:
    layers = row.get("layers")
    if not layers:
        _measured_bytes(where, row, "peak_allocated_bytes")
        return
    if not isinstance(layers, dict) or not isinstance(layers.get("measured"), list) or not layers["measured"]:
        raise InputError(f"{where}: layers.measured", "allowed: a non-empty list of measured depths")
    for i, m in enumerate(layers["measured"]):
        at = f"{where}: layers.measured.{i}"
        if not isinstance(m, dict):
            raise InputError(at, "allowed: an object with num_layers and peak_allocated_bytes")
        if _need(at, m, "num_layers", int, "a positive integer") < 1:
            raise InputError(f"{at}.num_layers", "allowed: a positive integer")
        _measured_bytes(at, m, "peak_allocated_bytes")


def _environment(where: str, row: dict) -> Environment:
    env = _need(where, row, "env", dict, "the row's environment (torch, deepspeed, transformers, gpu)")
    for key in _ENV_KEYS:
        if env.get(key) is not None and not isinstance(env[key], str):
            raise InputError(f"{where}: env.{key}", f"got {type(env[key]).__name__}; allowed: a version string")
    return Environment(**{key: env.get(key) for key in _ENV_KEYS})


def _check_row(where: str, row: Any) -> bool:
    """True for a measured row (status ok) that compare_rows can use; InputError when it cannot be read."""
    from ..specs import Job

    if not isinstance(row, dict):
        raise InputError(where, f"got {type(row).__name__}; allowed: one verify row (a JSON object) a line")
    _need(where, row, "name", str, "the row's name")
    if _need(where, row, "status", str, "ok, oom, error, timeout or unsupported") != "ok":
        return False
    if row.get("mode", "emulated") not in ("emulated", "real"):
        raise InputError(f"{where}: mode", f"got {shorten(row['mode'])}; allowed: emulated, real")
    for key in ("steps", "skipped_steps"):
        if key in row and (not isinstance(row[key], int) or isinstance(row[key], bool) or row[key] < 0):
            raise InputError(f"{where}: {key}", "allowed: a non-negative integer")
    from ..bounds import check_job

    try:
        job = Job.model_validate(_need(where, row, "job", dict, "the row's Job (model, training, layout)"))
    except ValidationError as exc:
        raise from_pydantic(exc, prefix=f"{where}: job.") from None
    check_job(job, f"{where}: job.")
    _check_measured(where, row)
    return True


def points_of(rows: list[tuple[str, Any]]) -> tuple[list[Point], list[Environment]]:
    """The measured points of the usable rows and their environments; InputError under MIN_ROWS rows."""
    from ..accuracy import compare_rows

    points, envs, used = [], [], 0
    for where, row in rows:
        if not _check_row(where, row):
            continue
        try:
            comparisons = compare_rows([row])
        except InputError as exc:
            raise InputError(f"{where}: {exc.field}", exc.message) from None
        used += 1
        envs.append(_environment(where, row))
        points += [Point(name=c.name, row=row["name"], measured_bytes=c.measured_bytes,
                         predicted_bytes=c.predicted_bytes, predicted_phase=c.predicted_phase) for c in comparisons]
    if used < MIN_ROWS:
        raise InputError("ROWS", f"{used} measured rows (status ok) among {len(rows)}; allowed: at least {MIN_ROWS} "
                                 "to fit a calibration")
    return points, envs


def load_calibration(path: str, flag: str = "--calibration") -> Calibration:
    """The calibration file at ``path`` (memplan.inputs, memplan's own JSON); InputError naming ``flag`` and
    the key on anything else."""
    from ..inputs import read_json_object, shown_path

    data = read_json_object(path, flag, "memplan", "calibration file from memplan calibrate")
    try:
        return Calibration.model_validate(data)
    except ValidationError as exc:
        err = from_pydantic(exc)
        field = flag if err.field == "input" else f"{flag} {err.field}"
        raise InputError(field, f"{err.message} (in {shown_path(path)})") from None


def write_calibration(cal: Calibration, path: str, flag: str = "--out") -> None:
    """Write ``cal`` as JSON to ``path``, atomically, never over a device, FIFO or folder
    (memplan.outputs.write_files)."""
    from ..outputs import write_files

    write_files({path: json.dumps(cal.model_dump(mode="json"), indent=1) + "\n"}, flag)


def apply_file(est, path: str):
    """``est`` calibrated with the file at ``path`` (what `memplan estimate --calibration FILE` does)."""
    from .fit import apply

    return apply(est, load_calibration(path), source=path)
