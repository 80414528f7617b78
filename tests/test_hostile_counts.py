"""Hostile input, counts and sizes (issue 15): every count and size every command reads, out of bounds.

Counts come from flags, from launch lines (check and plan read Megatron-DeepSpeed and launcher flags), from
DeepSpeed JSON and from verify rows; sizes from --target, --host-ram, --nvme and --gpu. Each is drawn as 0, a
negative, a float, inf / nan, 10**23 and longer digit strings, a shell expansion, and must end in exit 2, one
line naming where it came from, empty stdout and no file written (tests/_hostile.py). `memplan check` reports
a value DeepSpeed refuses inside a DeepSpeed JSON as an error finding instead (exit 1: that is its job).
"""

from __future__ import annotations

import json

import pytest
from _hostile import assert_refused, line, run_main, workdir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memplan.bounds import MAX_COUNT, MAX_RANKS
from memplan.check.launch import MEGATRON_COUNTS

SETTINGS = settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])

RANK_FLAGS = ("--gpus", "--gpus-per-node", "--tp", "--pp", "--sp")
JOB_COUNTS = {**dict.fromkeys(("--seq", "--micro-batch", "--grad-accum", "--lora-rank"), MAX_COUNT),
              **dict.fromkeys(RANK_FLAGS, MAX_RANKS)}
#: every count flag of every command → its largest value
COUNT_FLAGS = {
    "estimate": JOB_COUNTS, "report": JOB_COUNTS,
    "verify": {**JOB_COUNTS, "--steps": MAX_COUNT, "--layers": MAX_COUNT, "--timeout": MAX_COUNT},
    "check": {"--gpus": MAX_RANKS, "--nodes": MAX_RANKS, "--seq": MAX_COUNT},
    "plan": {"--seq": MAX_COUNT, "--global-batch": MAX_COUNT, "--global-tokens": MAX_COUNT, "--gpus": MAX_RANKS,
             "--gpus-per-node": MAX_RANKS, "--max-tp": MAX_RANKS, "--max-pp": MAX_RANKS, "--max-sp": MAX_RANKS,
             "--max-micro-batch": MAX_COUNT, "--top": MAX_COUNT, "--emit": MAX_COUNT},
}
COUNT_CASES = [(command, flag) for command, flags in COUNT_FLAGS.items() for flag in flags]


def bad_counts(maximum: int):
    """Strings a count flag must refuse: 0 and negatives, floats, inf/nan, too large (10**23 among them)."""
    return st.one_of(
        st.integers(-10**6, 0).map(str),
        st.integers(maximum + 1, 10**30).map(str),
        st.just(str(10**23)),
        st.from_regex(r"\A[1-9][0-9]{40,300}\Z"),
        st.sampled_from(["2.5", "1e3", "inf", "-inf", "nan", "", " ", "0x10", "1_000", "8GiB", "½", "٣", "$GPUS"]),
    )


@pytest.mark.parametrize("command, flag", COUNT_CASES)
@SETTINGS
@given(data=st.data())
def test_every_count_flag_refuses_what_is_out_of_bounds(command, flag, data):
    value = data.draw(bad_counts(COUNT_FLAGS[command][flag]))
    with workdir() as root:
        assert_refused(line(command, root, f"{flag}={value}"), flag, root)


#: launcher options that are counts, and a line to put each in
LAUNCHER_COUNTS = {
    "--num_gpus": "deepspeed {flag} {value} pretrain_gpt.py --num-layers 2",
    "--num_nodes": "deepspeed --num_gpus 8 {flag} {value} pretrain_gpt.py --num-layers 2",
    "--nproc-per-node": "torchrun {flag} {value} pretrain_gpt.py --num-layers 2",
    "--nnodes": "torchrun --nproc-per-node 8 {flag} {value} pretrain_gpt.py --num-layers 2",
    "--num_processes": "accelerate launch {flag} {value} pretrain_gpt.py --num-layers 2",
}


def launch_count_values(flag: str):
    least, most = MEGATRON_COUNTS.get(flag, (1, MAX_RANKS))
    small = [st.integers(-10**6, least - 1).map(str)] if least >= 1 and flag not in ("--num_gpus", "--num_nodes") \
        else []
    return st.one_of(*small, st.integers(most + 1, 10**30).map(str), st.just(str(10**23)),
                     st.sampled_from(["2.5", "inf", "nan", "1e3", "$TP", "$(nproc)", "`nproc`", "0x8"]))


@pytest.mark.parametrize("command", ["check", "plan"])
@pytest.mark.parametrize("flag", [*[f for f in MEGATRON_COUNTS if f != "--zero-stage"], *LAUNCHER_COUNTS])
@SETTINGS
@given(data=st.data())
def test_every_count_of_a_launch_line_is_bounded(command, flag, data):
    """Megatron-DeepSpeed's flags are type=int (its argparse refuses 2.5 and inf) and the layout sizes must be
    at least 1 (validate_args divides by them); the world the launcher options make is at most MAX_RANKS."""
    value = data.draw(launch_count_values(flag))
    template = LAUNCHER_COUNTS.get(flag, "deepspeed --num_gpus 8 pretrain_gpt.py --num-layers 2 {flag} {value}")
    with workdir() as root:
        (root / "launch.sh").write_text(template.format(flag=flag, value=value) + "\n")
        assert_refused(line(command, root, "--launch-file", str(root / "launch.sh")), f"--launch-file {flag}", root)


def test_a_world_beyond_the_bound_from_a_product_is_refused():
    """Each option in bounds, their product not (an --include list cannot get there: one word is at most
    MAX_ARG_STRLEN characters, under MAX_RANKS slots)."""
    lines = ["deepspeed --num_gpus 262144 --num_nodes 2 pretrain_gpt.py --num-layers 2",
             "torchrun --nproc-per-node 512 --nnodes 1:1024 pretrain_gpt.py --num-layers 2"]
    for text in lines:
        with workdir() as root:
            assert_refused(line("check", root, "--launch", text), "--launch --", root)


#: DeepSpeed JSON counts: key path → a config holding the value
DS_COUNTS = {
    "train_micro_batch_size_per_gpu": lambda v: {"train_micro_batch_size_per_gpu": v},
    "gradient_accumulation_steps": lambda v: {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": v},
    "train_batch_size": lambda v: {"train_batch_size": v},
    "sequence_parallel_size": lambda v: {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": v},
    "zero_optimization.reduce_bucket_size": lambda v: {"train_micro_batch_size_per_gpu": 1,
                                                       "zero_optimization": {"reduce_bucket_size": v}},
    "tensor_parallel.autotp_size": lambda v: {"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": v}},
}
ds_count_values = st.one_of(st.integers(-10**6, 0), st.just(10**23), st.integers(2**53 + 1, 10**40),
                            st.sampled_from([2.5, 1e23, -1.0, "inf", "nan", "1e3", True, "x", [], {}]))


@pytest.mark.parametrize("command", ["estimate", "verify", "report", "plan", "check"])
@pytest.mark.parametrize("key", DS_COUNTS)
@SETTINGS
@given(value=ds_count_values)
def test_every_count_of_a_ds_config_is_bounded(command, key, value):
    if key == "tensor_parallel.autotp_size" and value == 0:
        return  # TPTrainingConfig.autotp_size: 0 is DeepSpeed's default, AutoTP off
    with workdir() as root:
        (root / "ds.json").write_text(json.dumps(DS_COUNTS[key](value)))
        argv = line(command, root, "--ds-config", str(root / "ds.json"))
        if command != "check":
            assert_refused(argv, f"--ds-config {key}", root)
            return
        rc, out, err = run_main(argv)  # check reports it: an error finding naming the key, exit 1
        assert rc == 1 and err == "", err
        assert any(f["severity"] == "error" and f["subject"] == key for f in json.loads(out)["findings"])


SIZE_FLAGS = {"estimate": ("--target", "--gpu"), "report": ("--target", "--gpu"), "check": ("--target", "--gpu"),
              "plan": ("--target", "--gpu", "--host-ram", "--nvme")}
bad_sizes = st.one_of(
    st.integers(0, 10**6).map(str),  # a bare number has no unit, in every command (issue 18)
    st.sampled_from(["0GiB", "-1GB", "1e999GiB", "1e999TB", "1e-999GiB", "2000000PiB", "nanGiB", "infGiB", "",
                     "GiB", "24 parsecs", "24EiB", "0x10GB", "1e3"]),
    st.from_regex(r"\A[0-9]{400,600}GiB\Z"),
)


@pytest.mark.parametrize("command, flag", [(c, f) for c, flags in SIZE_FLAGS.items() for f in flags])
@SETTINGS
@given(value=bad_sizes)
def test_every_size_needs_a_unit_and_bounds(command, flag, value):
    with workdir() as root:
        assert_refused(line(command, root, f"{flag}={value}"), flag, root)


def _row(job: dict, **extra) -> dict:
    return {"name": "r", "status": "ok", "mode": "emulated", "steps": 3, "job": job, "peak_allocated_bytes": 2**30,
            "phases": [{"name": "step0.forward", "peak_allocated_bytes": 2**30}],
            "env": {"torch": "2", "deepspeed": "0", "transformers": "5", "gpu": "x"}, **extra}


@pytest.mark.parametrize("where, value", [("layout.world", 10**23), ("layout.world", MAX_RANKS * 2),
                                          ("layout.tp", 0), ("training.seq_len", 10**30),
                                          ("model.num_layers", 10**8), ("peak_allocated_bytes", 2**70)])
@pytest.mark.parametrize("command", ["calibrate", "report"])
def test_a_verify_row_out_of_bounds_is_refused(command, where, value):
    """A row's Job is bounded as flags are (memplan.bounds.check_job) before the estimator sees it: a world of
    10**23 never becomes a list, a tp of 0 never a divisor."""
    from memplan.jobbuild import build_job
    from memplan.resolve import model_from_arg

    job = build_job(model_from_arg("llama-3.2-1b"), {"seq_len": 256, "world": 1, "gpus_per_node": 1},
                    {}).model_dump(mode="json")
    row = _row(job)
    section, _, key = where.rpartition(".")
    (row["job"][section] if section else row)[key] = value
    if key == "peak_allocated_bytes":
        row["phases"][0][key] = value
    with workdir() as root:
        (root / "rows.jsonl").write_text(json.dumps(row) + "\n")
        if command == "calibrate":
            assert_refused(line("calibrate", root, rows=str(root / "rows.jsonl")), "ROWS", root)
        else:  # without job flags, the report's job is the row's
            assert_refused(["report", "--verify", str(root / "rows.jsonl"), "--out", "out"], "--verify", root)


def test_the_largest_world_allowed_is_estimated(capsys):
    """At MAX_RANKS ranks under ZeRO-2 (whose gradient partitions the estimator lays out per rank) estimate
    still answers: the bound keeps every list the estimator builds small."""
    rc, out, err = run_main(["estimate", "--model", "llama-3.2-1b", "--seq", "256", "--gpus", str(MAX_RANKS), "--sp",
                             "1", "--zero", "2", "--offload-optimizer", "none", "--json"])
    assert rc == 0, err
    assert json.loads(out)["job"]["layout"]["world"] == MAX_RANKS
