"""The one writer of every output: all files of one command appear together, or none does.

``write_files({path: content, ...}, flag)`` refuses, before writing anything, a target that exists and is not
a regular file (a FIFO, a device such as /dev/full, a socket, a directory) and a folder on the way that is a
file; then stages every file in a hidden folder beside the targets (same filesystem), creates the missing
folders, and moves each file into place with os.replace (atomic per file). If any step fails, the files
already moved are put back as they were (a replaced file is restored from a hard link kept in the staging
folder), the folders it created are removed, and the error names the flag. A reader never sees half a file.

``check_name`` keeps a name given on the command line (``--name``) to one path component, so that it can
never write outside the folder it is meant for (``../../x`` is refused). ``check_folder`` / ``check_file``
are the same refusals for a command to run before it does any work, so that bad output paths fail fast.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

from .errors import InputError, shorten
from .inputs import shown_path

#: the longest file stem taken: NAME_MAX (limits.h: 255 bytes on Linux filesystems) less room for a suffix
MAX_STEM_CHARS = 200
_NAME = re.compile(rf"\A[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_STEM_CHARS - 1}}}\Z")


def check_name(name: str, flag: str) -> str:
    """``name`` as a single path component: letters, digits, '.', '_', '-', starting with a letter or digit
    (so never '..', a folder, a hidden file or an option look-alike), short enough that ``name`` plus a suffix
    stays within NAME_MAX."""
    if not _NAME.match(name or ""):
        raise InputError(flag, f"{shorten(name)} is not a plain file name; allowed: one name of letters, digits, "
                               f"'.', '_', '-' (starting with a letter or digit, at most {MAX_STEM_CHARS} "
                               "characters), no folders")
    return name


def _stat(path: Path) -> os.stat_result | None:
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise InputError("", f"{shown_path(path)}: {getattr(err, 'strerror', None) or err}") from None


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a file" if stat.S_ISREG(mode) else "not a regular file"


def _printable(path: Path, flag: str) -> None:
    """An output path is printed back ("wrote ..."): control characters (a newline, an escape) are refused."""
    text = str(path)
    if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in text):
        raise InputError(flag, f"{shown_path(text)} has control characters; allowed: a path of printable characters")


def _check_parents(path: Path, flag: str) -> None:
    """Every existing folder on the way to ``path`` must be a folder (a file there could not hold it)."""
    for parent in path.parents:
        try:
            st = _stat(parent)
        except InputError as err:
            raise InputError(flag, err.message) from None
        if st is None:
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise InputError(flag, f"{shown_path(parent)} is {_kind(st.st_mode)}, not a folder; allowed: a path "
                                   "inside a writable folder")
        return


def check_folder(path: str | os.PathLike, flag: str) -> Path:
    """An output folder: missing (it will be created) or an existing folder; anything else refused."""
    p = Path(path)
    _printable(p, flag)
    try:
        st = _stat(p)
    except InputError as err:
        raise InputError(flag, err.message) from None
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise InputError(flag, f"{shown_path(p)} is {_kind(st.st_mode)}; allowed: a folder (created if missing)")
    _check_parents(p, flag)
    _probe(p / "x", flag)
    return p


def check_file(path: str | os.PathLike, flag: str) -> Path:
    """An output file: missing or an existing regular file (replaced); a FIFO, device, socket or folder refused."""
    p = Path(path)
    _printable(p, flag)
    try:
        st = _stat(p)
    except InputError as err:
        raise InputError(flag, err.message) from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise InputError(flag, f"{shown_path(p)} is {_kind(st.st_mode)}; allowed: a regular file (replaced) or a "
                               "new path")
    _check_parents(p, flag)
    _probe(p, flag)
    return p


def _probe(path: Path, flag: str) -> None:
    """Whether files can be made where ``path`` would go: a hidden folder made and removed at once in the
    nearest existing folder (permission bits alone do not say: root ignores them, /proc refuses anyway)."""
    anchor = _anchor(path)
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".memplan-probe-", dir=anchor))
    except OSError as err:
        raise InputError(flag, f"cannot write in {shown_path(anchor)} ({err.strerror or err}); allowed: a writable "
                               "folder") from None


def _anchor(path: Path) -> Path:
    """The nearest existing folder at or above ``path``'s folder (where the staging folder goes)."""
    for parent in (path.parent, *path.parent.parents):
        if parent.is_dir():
            return parent
    return Path(".")


def _missing_folders(path: Path) -> list[Path]:
    """Folders above ``path`` that do not exist yet, outermost first."""
    out = []
    for parent in path.parents:
        if parent.exists():
            break
        out.append(parent)
    return out[::-1]


def write_files(files: Mapping[str | os.PathLike, bytes | str], flag: str) -> list[Path]:
    """Write every file of ``files`` (path → content; str is written as UTF-8), all or none (module docstring).

    Returns the paths written, in order. Raises InputError naming ``flag`` when a target is refused or a
    write fails; then nothing was created or changed.
    """
    targets = [(check_file(path, flag), data.encode("utf-8") if isinstance(data, str) else data)
               for path, data in files.items()]
    stages: dict[Path, Path] = {}
    moved: list[tuple[Path, Path | None]] = []
    created: list[Path] = []
    current = targets[0][0] if targets else Path(".")
    try:
        staged = []
        for i, (target, data) in enumerate(targets):
            current = target
            anchor = _anchor(target)
            if anchor not in stages:
                stages[anchor] = Path(tempfile.mkdtemp(prefix=".memplan-staging-", dir=anchor))
            tmp = stages[anchor] / f"new-{i}"
            _write_new(tmp, data)
            staged.append((target, tmp, stages[anchor] / f"old-{i}"))
        for target, tmp, backup in staged:
            current = target
            for folder in _missing_folders(target):
                folder.mkdir()
                created.append(folder)
            kept = None
            if target.exists():
                try:
                    os.link(target, backup)
                except OSError:
                    shutil.copy2(target, backup)
                kept = backup
            os.replace(tmp, target)
            moved.append((target, kept))
    except OSError as err:
        _roll_back(moved, created)
        where = shown_path(err.filename) if getattr(err, "filename", None) else shown_path(current)
        raise InputError(flag, f"cannot write {where} ({err.strerror or err}); nothing was written; allowed: a "
                               "writable folder") from None
    finally:
        for stage in stages.values():
            shutil.rmtree(stage, ignore_errors=True)
    return [target for target, _ in targets]


def _write_new(path: Path, data: bytes) -> None:
    """Create ``path`` (never an existing one) holding ``data``."""
    with open(path, "xb") as fh:
        fh.write(data)


def _roll_back(moved: list[tuple[Path, Path | None]], created: list[Path]) -> None:
    """Put back what write_files had moved into place, and remove the folders it had created."""
    for target, kept in reversed(moved):
        try:
            if kept is not None:
                os.replace(kept, target)
            else:
                os.unlink(target)
        except OSError:
            pass
    for folder in reversed(created):
        try:
            folder.rmdir()
        except OSError:
            pass


__all__ = ["MAX_STEM_CHARS", "check_file", "check_folder", "check_name", "write_files"]
