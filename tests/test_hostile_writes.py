"""Hostile input, writes (issue 15): names that leave their folder, output paths that are not files or folders,
folders that cannot be written, and outputs that must appear together or not at all.

Every command that writes (verify, report, calibrate, plan --emit, estimate --report) checks its output
paths before any work (memplan.outputs.check_folder / check_file / check_name) and writes through
memplan.outputs.write_files, which stages everything beside the targets and moves it into place only when all
of it is ready. Device nodes are made inside the test folder (mknod, as root): a real /dev/full is never
risked.
"""

from __future__ import annotations

import os
import socket
import stat

import pytest
from _hostile import JOB, assert_refused, line, workdir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memplan.errors import InputError

SETTINGS = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])

bad_names = st.one_of(
    st.sampled_from(["../x", "../../x", "..", ".", "a/b", "/tmp/x", ".hidden", "-x", "", "a\\b", "a b", "naïve",
                     "x\x00y", "x" * 300, "../" * 40 + "etc"]),
    st.from_regex(r"\A[a-z]{0,5}[/\\][a-z.]{0,8}\Z"),
    st.from_regex(r"\A\.\.?\Z"),
)


@pytest.mark.parametrize("command", ["verify", "report"])
@SETTINGS
@given(name=bad_names)
def test_a_name_is_one_path_component(command, name):
    """verify --name ../../x wrote outside --out: a name is now one plain file name."""
    with workdir() as root:
        assert_refused(line(command, root, "--name", name), "--name", root)


def _node(root, kind: str):
    """An existing path of ``kind`` under ``root``: a FIFO, a character device (a copy of /dev/null's
    numbers), a socket, a folder or a regular file."""
    path = root / f"target-{kind}"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        try:
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("mknod needs root")
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.close()
    elif kind == "folder":
        path.mkdir()
    else:
        path.write_text("not a folder\n")
    return str(path)


#: (command, output flag, what it must be, the extra flags it needs)
OUTPUTS = [
    ("calibrate", "--out", "file", ()), ("estimate", "--report", "folder", ()), ("report", "--out", "folder", ()),
    ("verify", "--out", "folder", ()), ("plan", "--emit-dir", "folder", ("--emit", "1")),
]
KINDS = {"file": ("fifo", "device", "socket", "folder"), "folder": ("fifo", "device", "socket", "file")}


@pytest.mark.parametrize("command, flag, kind", [(c, f, k) for c, f, what, _ in OUTPUTS for k in KINDS[what]])
def test_an_output_path_that_is_not_a_regular_file_or_folder_is_refused(command, flag, kind):
    """As root, `calibrate --out /dev/full` replaced the device: anything at an output path that is not what
    the command writes there is refused before any work."""
    extra = next(e for c, f, _, e in OUTPUTS if (c, f) == (command, flag))
    with workdir() as root:
        target = _node(root, kind)
        assert_refused(line(command, root, *extra, flag, target), flag, root)
        assert stat.S_IFMT(os.lstat(target).st_mode) != stat.S_IFREG or kind == "file"


@pytest.mark.parametrize("command, flag", [(c, f) for c, f, _, _ in OUTPUTS])
@pytest.mark.parametrize("where", ["/proc/memplan-hostile/out", "{FILE}/inside"])
def test_an_output_folder_that_cannot_be_written_is_refused(command, flag, where):
    """/proc refuses new entries whatever the permissions say (root ignores mode bits); a path under a file
    cannot exist. Both are refused before any work, naming the flag."""
    extra = next(e for c, f, _, e in OUTPUTS if (c, f) == (command, flag))
    with workdir() as root:
        path = where.replace("{FILE}", _node(root, "file"))
        assert_refused(line(command, root, *extra, flag, path), flag, root)


def test_estimate_report_errors_name_report_not_out():
    with workdir() as root:
        text = assert_refused(line("estimate", root, "--report", _node(root, "file")), "--report", root)
        assert "--out" not in text


# --- all or nothing -------------------------------------------------------------------------------------------

def test_plan_emit_writes_all_three_files_or_none():
    """`plan --emit` left ds_config.json when launch.sh could not be written: now nothing is written, and the
    --json output is not printed either."""
    with workdir() as root:
        emit = root / "emit"
        (emit / "launch.sh").mkdir(parents=True)  # the second file cannot be written
        argv = ["plan", "--model", "llama-3.2-1b", "--seq", "1024", "--gpus", "8", "--zero-stages", "1",
                "--no-offload", "--checkpointing", "full", "--attention", "flash", "--max-micro-batch", "1",
                "--emit", "1", "--emit-dir", str(emit), "--json"]
        assert_refused(argv, "--emit-dir", root)
        assert sorted(p.name for p in emit.iterdir()) == ["launch.sh"]


@pytest.mark.parametrize("command", ["report", "estimate"])
def test_report_pages_and_figures_appear_together_or_not_at_all(command):
    """`report` left its Markdown and figures when the HTML could not be written; so did estimate --report."""
    pytest.importorskip("matplotlib")
    with workdir() as root:
        out = root / "out"
        (out / "llama-3.2-1b-seq256-1gpu.html").mkdir(parents=True)  # the page's HTML path is a folder
        argv = (line("report", root) if command == "report" else line("estimate", root, "--report", str(out)))
        assert_refused(argv, "--out" if command == "report" else "--report", root)
        assert sorted(p.name for p in out.iterdir()) == ["llama-3.2-1b-seq256-1gpu.html"]


def test_verify_writes_its_json_and_markdown_together(tmp_path):
    from memplan.verify import report

    (tmp_path / "run.md").mkdir()
    with pytest.raises(InputError, match="--out"):
        report.write_report({"name": "run", "status": "ok"}, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.md"]
    with pytest.raises(InputError, match="--name"):
        report.write_report({"name": "../run", "status": "ok"}, str(tmp_path))


def test_a_replaced_output_is_complete_and_the_folder_clean(tmp_path):
    """A successful write replaces the old file whole and leaves no staging folder behind."""
    from memplan.outputs import write_files

    (tmp_path / "a.json").write_text("old")
    write_files({tmp_path / "a.json": "new", tmp_path / "sub" / "b.json": b"b"}, "--out")
    assert (tmp_path / "a.json").read_text() == "new" and (tmp_path / "sub" / "b.json").read_bytes() == b"b"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "sub"]


@pytest.mark.parametrize("argv", [["verify", *JOB, "--gpus=0"], ["report", *JOB, "--gpus=0"],
                                  ["calibrate", "missing.jsonl"]])
def test_nothing_is_written_by_a_command_given_bad_input(argv):
    """The default outputs (reports/verify, report/, calibration.json) land in the working folder: a refused
    run leaves it as it was."""
    with workdir() as root:
        assert_refused(argv, "--gpus" if argv[0] != "calibrate" else "ROWS", root)
