"""verify and the terminal: verify without CUDA, progress lines, report names; tables within 100 columns, one size
rule and one unit convention across commands; the commands' library layer (no import of the CLI, typed calls)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from memplan.cli import main
from memplan.resolve import JobRequest, resolve_job

SEED = Path(__file__).resolve().parents[1] / "examples" / "seed-176b"


def run(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_verify_without_cuda_says_so_in_one_line(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    rc, out, err = run(capsys, "verify", "--model", "llama-3.2-1b", "--seq", "128", "--gpus", "1", "--out",
                       str(tmp_path / "out"))
    assert rc == 2 and out == ""
    assert err.count("\n") == 1
    assert err.startswith("memplan: error: --device cuda: needs a CUDA GPU") and "--device cpu runs a smoke test" in err
    assert not (tmp_path / "out" / "work").exists()  # nothing ran, nothing written


@pytest.mark.parametrize("model", ["qwen2.5-0.5b", "llama-3.2-1b"])
def test_report_names_keep_the_model_name_whole(model):
    from memplan.report.command import default_stem
    from memplan.verify.runner import default_name

    job = resolve_job(JobRequest(model=model)).job
    assert default_name(job).startswith(f"{model}-seq") and default_stem(job).startswith(f"{model}-seq")


def test_a_config_files_name_is_its_stem():
    from memplan.presets import model_label

    assert model_label(str(SEED / "176b_config.json")) == "176b_config" and model_label("qwen2.5-0.5b") == "qwen2.5-0.5b"


def test_progress_names_the_job_the_ranks_the_depth_and_the_workers_last_line(tmp_path):
    from memplan.verify.progress import Progress

    job = resolve_job(JobRequest(model="llama-3.2-1b", gpus=8)).job
    stream = io.StringIO()
    opts = {"out_dir": str(tmp_path), "layers": 1, "steps": 3, "device": "cpu", "launch": False}
    work = tmp_path / "work" / "job" / "layers1"
    with Progress("job", job, opts, stream=stream, heartbeat_s=0.05) as progress:
        work.mkdir(parents=True)
        (work / "worker.log").write_text("step1.micro0.backward\n")
        (work / "rank0.json").write_text("{}")
        import time

        time.sleep(0.3)
        assert "layers1" in progress._where()
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("memplan verify: job: rank 0 of 8 emulated on one GPU, 3 optimizer steps")
    assert "at 1 and 2 layers" in lines[0]
    assert any("layers1, rank0 written; log: step1.micro0.backward" in x for x in lines[1:-1])
    assert lines[-1].startswith("memplan verify: job: finished in")


def test_tables_fit_100_columns(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    for argv in (["estimate", "--model", "llama-3.2-1b"],
                 ["plan", "--model", "llama-3.2-1b", "--seq", "2048", "--zero-stages", "3", "--max-micro-batch", "2"],
                 ["check", "--ds-config", str(SEED / "ds_config_ulysses.json"), "--launch-file", str(SEED / "launch.sh"),
                  "--model", "176b", "--gpu", "a100-80g"]):
        rc, out, _ = run(capsys, *argv)
        assert rc in (0, 1)
        wide = [line for line in out.splitlines() if len(line) > 100]
        assert not wide, (argv[0], wide[:3])


@pytest.mark.parametrize("command", [
    ["estimate"], ["plan"], ["report", "--out", "r"],
    ["check", "--ds-config", str(SEED / "ds_config_ulysses.json")],
])
def test_a_bare_number_is_no_size_in_any_command(command, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, err = run(capsys, *command, "--target", "24")
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("memplan: error: --target: '24' has no unit")


def test_plan_shows_needs_in_gib(capsys):
    """One unit convention: what a job needs is GiB (the JSON's bytes / 2**30); GB/TB only for a vendor's node."""
    argv = ["plan", "--model", "176b", "--seq", "32768", "--gpus", "8", "--gpu", "a100-80g", "--target", "24GiB"]
    rc = main([*argv, "--json"])
    row = json.loads(capsys.readouterr().out)["candidates"][0]
    assert rc == 0
    _, out, _ = run(capsys, *argv)
    first = next(line for line in out.splitlines() if line.startswith("1 "))
    cells = first.split()
    assert f"{row['device_total_bytes'] / 2**30:,.1f}" in cells
    assert f"{row['host_bytes_per_node'] / 2**30:,.0f}" in cells
    assert "GiB (2.00 TB)" in " ".join(out.split())  # the DGX A100's memory: GiB, and the vendor's TB beside it


def test_the_commands_library_layer_does_not_import_the_cli():
    code = ("import sys; import memplan.check.command, memplan.plan.command, memplan.report.command, "
            "memplan.verify.command; from memplan.report import seed_data; print('memplan.cli' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_check_is_a_typed_library_call():
    """check(CheckRequest) needs no argparse Namespace and no command line; its result carries the verdict."""
    from memplan.budget import BudgetRequest
    from memplan.check.command import CheckRequest, check
    from memplan.check.launch import parse_launch, read_launch_file

    launch = parse_launch(read_launch_file(str(SEED / "launch.sh")), "--launch-file")
    result = check(CheckRequest(ds_config=str(SEED / "ds_config_ulysses.json"), launch=launch, model="176b", gpus=8,
                                budget=BudgetRequest(target_bytes=24 * 2**30)))
    assert result.errors > 0 and result.estimate is not None and result.sources
    assert not any(isinstance(v, SimpleNamespace) for v in vars(result).values())
