"""Writing a report's files atomically: staged in a hidden folder inside the output folder, then each moved
into place with os.replace (atomic on one filesystem), figures first and pages last, so a reader never sees
a half-written file or a page whose figures are missing."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ..errors import InputError
from .doc import Block, Figure, to_html, to_markdown


def page_files(stem: str, title: str, blocks: list[Block]) -> dict[str, bytes]:
    """relative path → content: every figure's PNG and SVG, then ``stem``.md and ``stem``.html."""
    files: dict[str, bytes] = {}
    for b in blocks:
        if isinstance(b, Figure):
            for ext, data in b.files.items():
                files[f"{b.stem}.{ext}"] = data
    files[f"{stem}.md"] = to_markdown(blocks).encode("utf-8")
    files[f"{stem}.html"] = to_html(blocks, title).encode("utf-8")
    return files


def _out_dir(out: str) -> Path:
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise InputError("--out", f"{out[:80]!r} is a file; allowed: a folder (created if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise InputError("--out", f"cannot create {out[:80]!r} ({err.strerror}); allowed: a writable folder") from None
    return path


def write_atomically(out: str, files: dict[str, bytes]) -> list[Path]:
    """Write ``files`` (relative path → bytes, in order) under ``out``; returns the final paths."""
    root = _out_dir(out)
    for rel in files:
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise InputError("--name", f"{rel[:80]!r} leaves the output folder; allowed: a plain name")
    staging = Path(tempfile.mkdtemp(prefix=".memplan-report-", dir=root))
    written = []
    try:
        for rel, data in files.items():
            tmp = staging / rel
            tmp.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(data)
        for rel in files:
            final = root / rel
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / rel, final)
            written.append(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return written
