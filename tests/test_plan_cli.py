"""`memplan plan` end to end (real estimator): the JSON contract, --emit, the user's config, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.cli import main

pytest.importorskip("memplan.estimator")

REQUIRED = {"zero", "tp", "pp", "sp", "offload_optimizer", "offload_param", "checkpointing", "micro_batch",
            "grad_accum", "peak_allocated_bytes", "peak_reserved_bytes", "host_bytes_per_node", "nvme_bytes_per_node",
            "step_time_s", "tokens_per_s", "device_total_bytes", "attention"}
SMALL = ["plan", "--model", "qwen2.5-0.5b", "--seq", "4096", "--gpus", "8", "--gpu", "a100-80g", "--top", "3"]
SEED_DIR = Path(__file__).resolve().parents[1] / "examples" / "seed-176b"


def run_json(capsys, argv):
    rc = main(argv + ["--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_json_contract(capsys):
    rc, out = run_json(capsys, SMALL)
    assert rc == 0
    assert {"candidates", "assumptions", "searched", "feasible"} <= set(out)
    assert 0 < len(out["candidates"]) <= 3 and out["feasible"] <= out["searched"]
    for row in out["candidates"]:
        assert REQUIRED <= set(row)
        assert all(isinstance(row[k], int) for k in REQUIRED if k.endswith("_bytes"))
        assert row["micro_batch"] * row["grad_accum"] * row["dp"] == out["assumptions"]["global_batch"]
    assert out["assumptions"]["performance"]["compute_efficiency"] > 0


def test_seed_answers_either_way(capsys):
    """The seed: rc 1 with the closest misses when nothing fits 24 GiB, rc 0 with rows when something does."""
    rc, out = run_json(capsys, ["plan", "--model", "176b", "--seq", "32768", "--gpus", "8", "--gpu", "a100-80g",
                                "--target", "24GiB"])
    assert rc == (0 if out["feasible"] else 1)
    rows = out["candidates"] or out["closest"]
    assert rows
    if not out["feasible"]:
        assert all(r["misses"] for r in rows)


def test_table_output_names_the_binding_constraint(capsys):
    assert main(SMALL) == 0
    text = capsys.readouterr().out
    assert "tokens/s" in text and "assumption:" in text


def test_emit_round_trips_through_dsconfig(tmp_path, capsys):
    from memplan.dsconfig import ds_settings, load_ds_config

    # --emit writes a Megatron-DeepSpeed pretrain_gpt.py line, so the plan is of a model Megatron's GPT builds
    argv = ["plan", "--model", "llama-3.2-1b", "--seq", "4096", "--gpus", "8", "--gpu", "a100-80g", "--top", "3",
            "--model-impl", "megatron", "--emit", "2", "--emit-dir", str(tmp_path)]
    rc, out = run_json(capsys, argv)
    assert rc == 0
    row = out["candidates"][1]
    cfg = load_ds_config(tmp_path / "ds_config.json")
    settings = ds_settings(cfg, dp=row["dp"])
    assert settings.zero_stage == row["zero"]
    assert (settings.micro_batch, settings.grad_accum) == (row["micro_batch"], row["grad_accum"])
    assert (settings.offload_optimizer or "none") == row["offload_optimizer"]
    assert (settings.offload_param or "none") == row["offload_param"]
    assert (settings.sequence_parallel_size or 1) == row["sp"]
    launch = (tmp_path / "launch.sh").read_text()
    assert f"--tensor-model-parallel-size {row['tp']}" in launch
    assert json.loads((tmp_path / "candidate.json").read_text()) == row


def test_user_config_is_placed_or_refused(capsys):
    _rc, out = run_json(capsys, ["plan", "--gpus", "8", "--target", "24GiB",
                                "--ds-config", str(SEED_DIR / "ds_config_ulysses.json"),
                                "--launch-file", str(SEED_DIR / "launch.sh")])
    user = out["user_config"]
    assert "runs" in user
    if user["runs"]:
        assert REQUIRED <= set(user["candidate"])
    else:
        assert user["problem"]


@pytest.mark.parametrize("argv, field", [
    (["--global-tokens", "5000"], "--global-tokens"),
    (["--gpu", "abacus"], "--gpu"),
    (["--model", "no-such-model"], "model"),
    (["--zero-stages", "4"], "--zero-stages"),
    (["--target", "-3GiB"], "--target"),
    (["--emit", "100000"], "--emit"),
    (["--ds-config", "/no/such/file.json"], "ds-config"),
    (["--global-batch", "7", "--max-sp", "1", "--max-tp", "1", "--max-pp", "1"], "plan"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, field):
    assert main(SMALL + argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and field in err
