"""The harness of the hostile-input tests (issue 15): run a command in-process, and check the one way every
bad input must end — exit 2, one line on stderr naming the flag, nothing on stdout, no file created or
changed under the working folder."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from memplan import cli

#: the small job every command's base line uses (fast to estimate, valid everywhere)
JOB = ["--model", "llama-3.2-1b", "--seq", "256", "--gpus", "1", "--sp", "1", "--zero", "0",
       "--offload-optimizer", "none"]
#: each command's line with nothing wrong in it (--json where the command has it: stdout must stay empty)
BASE: dict[str, list[str]] = {
    "estimate": ["estimate", *JOB, "--json"],
    "verify": ["verify", *JOB, "--device", "cpu", "--steps", "1", "--json"],
    "check": ["check", "--ds-config", "{GOOD_DS}", "--json"],
    "plan": ["plan", "--model", "llama-3.2-1b", "--seq", "1024", "--gpus", "8", "--json"],
    "report": ["report", *JOB, "--out", "out"],
    "calibrate": ["calibrate", "{ROWS}", "--out", "calibration.json", "--json"],
}
COMMANDS = tuple(BASE)
GOOD_DS = '{"train_micro_batch_size_per_gpu": 1}'


class Hung(BaseException):
    """A command ran past the harness' alarm (a read that blocks, a loop over 10**23)."""


def _hung(signum, frame):
    raise Hung("the command did not finish")


def run_main(argv: list[str], timeout_s: int = 60) -> tuple[int, str, str]:
    """memplan.cli.main(argv) in this process: (exit code, stdout, stderr); stdin is empty, and a command that
    runs past ``timeout_s`` raises Hung instead of hanging the suite."""
    out, err = io.StringIO(), io.StringIO()
    old_handler = signal.signal(signal.SIGALRM, _hung)
    old_stdin, sys.stdin = sys.stdin, io.StringIO("")
    signal.alarm(timeout_s)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(argv)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old_handler)
        sys.stdin = old_stdin
    return rc, out.getvalue(), err.getvalue()


def snapshot(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under ``root``: (type, size, mtime) of files, the type of anything else (folders' own
    times are left out: a staging folder made and removed again changes them)."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            st = os.lstat(path)
            regular = stat.S_ISREG(st.st_mode)
            out[os.path.relpath(path, root)] = (stat.S_IFMT(st.st_mode), st.st_size if regular else 0,
                                                st.st_mtime_ns if regular else 0)
    return out


@contextlib.contextmanager
def workdir() -> Iterator[Path]:
    """A fresh temporary folder as the working folder (where default outputs would land), with a valid
    DeepSpeed JSON in it."""
    with tempfile.TemporaryDirectory() as tmp:
        old = os.getcwd()
        os.chdir(tmp)
        try:
            root = Path(tmp).resolve()
            (root / "good_ds.json").write_text(GOOD_DS)
            yield root
        finally:
            os.chdir(old)


def line(command: str, root: Path, *extra: str, rows: str | None = None) -> list[str]:
    """The command's base line with ``extra`` after it (argparse keeps the last of a repeated flag)."""
    base = [a.replace("{GOOD_DS}", str(root / "good_ds.json")) for a in BASE[command]]
    if command == "calibrate":
        base = [rows or str(root / "good_ds.json") if a == "{ROWS}" else a for a in base]
    return [*base, *extra]


def assert_refused(argv: list[str], flag: str, root: Path, code: int = 2) -> str:
    """Run ``argv``: exit ``code``, one line on stderr starting ``memplan: error: <flag>``, nothing on stdout,
    nothing under ``root`` created or changed. Returns the line."""
    before = snapshot(root)
    rc, out, err = run_main(argv)
    shown = [a if len(a) <= 100 else f"{a[:100]}...({len(a)})" for a in argv]
    assert rc == code, (shown, rc, out[:300], err[:500])
    assert out == "", (shown, out[:300])
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), (shown, err[:1000])
    assert lines[0].startswith(f"memplan: error: {flag}"), (shown, lines[0][:300])
    assert "internal:" not in lines[0] and len(lines[0]) <= 800, lines[0][:300]
    assert snapshot(root) == before, (shown, set(snapshot(root)) ^ set(before))
    return lines[0]
