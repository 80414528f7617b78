"""memplan.cli: help from docstrings, one-line errors, estimate's table and JSON.

The rendering tests use a hand-built Estimate (monkeypatched into memplan.api) so they do not depend on the
estimator; the end-to-end tests use the real one (xfail only while memplan.estimator lacks estimate_job).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import subprocess
import sys

import pytest

from memplan import api, cli
from memplan.result import Estimate, Part, Phase
from memplan.specs import Job
from memplan.units import GiB


def _has_estimator() -> bool:
    try:
        from memplan.estimator import estimate_job  # noqa: F401
    except ImportError:
        return False
    return True


needs_estimator = pytest.mark.xfail(not _has_estimator(), reason="memplan.estimator.estimate_job not landed yet",
                                    strict=False)


class _NoStdin(io.StringIO):
    def read(self, *a):  # pragma: no cover - reaching it is the failure
        raise AssertionError("the CLI read stdin")

    readline = read


def run_cli(*argv: str) -> tuple[int, str, str]:
    """main(argv) in-process: (exit code, stdout, stderr); stdin reads fail the test."""
    out, err = io.StringIO(), io.StringIO()
    old_stdin = sys.stdin
    sys.stdin = _NoStdin()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(list(argv))
    finally:
        sys.stdin = old_stdin
    return rc, out.getvalue(), err.getvalue()


def toy_estimate(job: Job) -> Estimate:
    """A hand-built Estimate: 3 GiB + 1 GiB + 2 GiB at the peak (6 GiB), reserved 7 GiB, 1 GiB beyond torch."""
    parts = (Part(name="params_16bit", bytes=3 * GiB, detail="P·2"), Part(name="optimizer_states", bytes=GiB),
             Part(name="activations", bytes=2 * GiB, detail="per layer"))
    timeline = (Phase(name="forward, layer 0", parts=parts[:2]), Phase(name="backward, layer 0", parts=parts))
    return Estimate(job=job, peak_phase="backward, layer 0", components=parts, timeline=timeline,
                    peak_reserved_bytes=7 * GiB, non_torch_bytes=GiB, host_bytes_per_node=5 * GiB,
                    nvme_bytes_per_node=0, notes=("toy",))


@pytest.fixture
def fake_estimator(monkeypatch):
    """memplan.api.estimate → the toy Estimate, with the verdict fields set as api.estimate sets them."""

    def fake(job, *, target_bytes=None, gpu_name=None, gpu_bytes=None):
        est = toy_estimate(job)
        return est.model_copy(update={"target_bytes": target_bytes, "gpu_name": gpu_name, "gpu_bytes": gpu_bytes})

    monkeypatch.setattr(api, "estimate", fake)


# --- help -----------------------------------------------------------------------------------------------------


def test_every_available_command_has_a_docstring_as_its_help():
    assert cli.cmd_estimate.__doc__ and cli.cmd_estimate.__doc__.strip()
    for name in cli.LAZY_COMMANDS:
        module = cli.command_module(name)
        if module is not None:
            assert cli.command_doc(module), f"memplan {name} has no docstring"


@pytest.mark.parametrize("name", cli.COMMANDS)
def test_command_help_shows_its_docstring(name):
    if name != "estimate" and cli.command_module(name) is None:
        pytest.skip(f"memplan.{name}.command not in this build")
    doc = cli.cmd_estimate.__doc__ if name == "estimate" else cli.command_doc(cli.command_module(name))
    rc, out, err = run_cli(name, "--help")
    assert rc == 0 and err == ""
    assert " ".join(doc.split()[:6]) in " ".join(out.split())


def test_top_level_help_lists_the_commands():
    rc, out, _ = run_cli("--help")
    assert rc == 0
    assert all(name in out for name in cli.COMMANDS)


def test_estimate_has_the_issue_flags():
    flags = {s for a in cli.build_parser("estimate")._subparsers._group_actions[0].choices["estimate"]._actions
             for s in a.option_strings}
    assert {"--gpu", "--target", "--json", "--model", "--seq", "--sp", "--ds-config"} <= flags


# --- errors -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        ((), "command"),
        (("frobnicate",), "command"),
        (("estimate", "--bogus"), "--bogus"),
        (("estimate", "--zero", "4"), "--zero"),
        (("estimate", "--dtype", "fp8"), "--dtype"),
        (("estimate", "--seq"), "--seq"),
        (("estimate", "--seq", "-1"), "--seq"),
        (("estimate", "--target", "24"), "--target"),
        (("estimate", "--target", "lots"), "--target"),
        (("estimate", "--gpu", "x100"), "--gpu"),
        (("estimate", "--mod", "176b"), "--mod"),  # no abbreviations: scripts must spell flags out
        (("estimate", "stray"), "stray"),
    ],
)
def test_usage_errors_are_one_line_exit_2(argv, field):
    rc, out, err = run_cli(*argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"memplan: error: {field}: ")


def test_missing_lazy_command_is_not_available(monkeypatch):
    monkeypatch.setattr(cli, "command_module", lambda name: None)
    rc, _, err = run_cli("verify", "--layers", "2")
    assert rc == 2 and err == "memplan: error: verify: not available in this build\n"


def test_a_bug_is_one_line_too(monkeypatch):
    def boom(*a, **k):
        raise ZeroDivisionError("oops")

    monkeypatch.setattr(api, "estimate", boom)
    rc, _, err = run_cli("estimate", "--model", "llama-3.2-1b", "--sp", "1")
    assert rc == 2 and err.count("\n") == 1 and "internal: ZeroDivisionError" in err and "Traceback" not in err


# --- estimate output with a hand-built Estimate ---------------------------------------------------------------------


def test_json_has_the_issue_keys_as_integers(fake_estimator):
    rc, out, err = run_cli("estimate", "--model", "llama-3.2-1b", "--sp", "1", "--json", "--target", "24GiB",
                           "--gpu", "a100-80g")
    assert rc == 0 and err == ""
    obj = json.loads(out)
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "device_total_bytes", "host_bytes_per_node",
                "nvme_bytes_per_node"):
        assert type(obj[key]) is int, key
    assert obj["components"] == {"params_16bit": 3 * GiB, "optimizer_states": GiB, "activations": 2 * GiB}
    assert sum(obj["components"].values()) == obj["peak_allocated_bytes"] == 6 * GiB
    assert obj["device_total_bytes"] == 8 * GiB and obj["peak_phase"] == "backward, layer 0"
    assert (obj["target_bytes"], obj["fits_target"]) == (24 * GiB, True)
    assert (obj["gpu_name"], obj["gpu_bytes"], obj["fits_gpu"]) == ("a100-80g", 80 * GiB, True)
    assert obj["job"]["model"]["name"] == "llama-3.2-1b" and obj["job"]["layout"]["dp"] == 8


def test_json_verdicts_are_null_without_target_or_gpu(fake_estimator):
    obj = json.loads(run_cli("estimate", "--model", "llama-3.2-1b", "--sp", "1", "--json")[1])
    assert obj["fits_target"] is None and obj["fits_gpu"] is None


def test_table_shows_components_shares_phase_and_verdict(fake_estimator):
    rc, out, err = run_cli("estimate", "--model", "llama-3.2-1b", "--sp", "1", "--target", "7GiB", "--gpu", "h100")
    assert rc == 0 and err == ""
    text = " ".join(out.split())
    for words in ("params_16bit", "50.0%", "peak phase: backward, layer 0", "host RAM 5.00 GiB",
                  "target (7.00 GiB): does not fit, 1.00 GiB over", "GPU h100-80g", "fits"):
        assert words in text, words


# --- end to end (the real estimator) --------------------------------------------------------------------------------


@needs_estimator
def test_readme_example_json():
    rc, out, err = run_cli("estimate", "--model", "176b", "--seq", "32768", "--sp", "8", "--json")
    assert rc == 0 and err == ""
    obj = json.loads(out)
    assert sum(obj["components"].values()) == obj["peak_allocated_bytes"] > 0
    assert obj["peak_reserved_bytes"] >= obj["peak_allocated_bytes"]
    assert obj["device_total_bytes"] >= obj["peak_reserved_bytes"]


@needs_estimator
def test_bare_estimate_is_the_seed_scenario():
    rc, out, _ = run_cli("estimate", "--json")
    assert rc == 0
    job = json.loads(out)["job"]
    assert job["model"]["name"] == "176b" and job["training"]["seq_len"] == 32768
    assert (job["layout"]["world"], job["layout"]["sp"]) == (8, 8)
    zero = job["training"]["zero"]
    assert (zero["stage"], zero["offload_optimizer"], job["training"]["dtype"]) == (3, "cpu", "fp16")


@needs_estimator
def test_bare_estimate_table_renders():
    rc, out, err = run_cli("estimate", "--target", "24GiB", "--gpu", "a100-80g")
    assert rc == 0 and err == "" and "peak phase" in out


@needs_estimator
def test_estimate_process_imports_no_torch():
    code = ("import sys; from memplan.cli import main; rc = main(['estimate', '--json']); "
            "bad = [m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules]; "
            "sys.exit(3 if bad else rc)")
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_entry_point_is_declared():
    if importlib.util.find_spec("tomllib") is None:
        pytest.skip("tomllib needs python 3.11")
    from pathlib import Path

    import tomllib

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    scripts = tomllib.loads(pyproject.read_text())["project"]["scripts"]
    assert scripts["memplan"] == "memplan.cli:main"


def test_ci_runs_the_readme_test_command():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    commands = [line.strip() for line in readme.splitlines() if line.startswith("    pip install")]
    # the install compiles src: an editable install under PYTHONDONTWRITEBYTECODE never caches its bytecode
    assert commands[0] == "pip install -e . && python -m compileall -q src && memplan estimate --model 176b --seq 32768 --sp 8"
    test_command = next(c for c in commands if "pytest" in c)
    ci_lines = [line.strip() for line in (root / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines and "set -euo pipefail" in ci_lines
