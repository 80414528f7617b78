"""Writing a report's files: all of them or none (memplan.outputs.write_files: staged in a hidden folder
beside them, then moved into place, figures first and pages last), so a reader never sees a half-written
file, a page whose figures are missing, or the Markdown without the HTML."""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError, shorten
from ..outputs import check_folder, write_files
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


def write_atomically(out: str, files: dict[str, bytes], flag: str = "--out") -> list[Path]:
    """Write ``files`` (relative path → bytes, in order) under the folder ``out``, all or none
    (memplan.outputs.write_files); returns the final paths. Errors name ``flag`` (--out, or estimate's
    --report)."""
    root = check_folder(out, flag)
    for rel in files:
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise InputError("--name", f"{shorten(rel)} leaves the output folder; allowed: a plain name")
    return write_files({root / rel: data for rel, data in files.items()}, flag)
