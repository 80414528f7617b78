"""memplan.verify.sample: the seeded draw of verify jobs (issue 13), its split, quotas, budget and cost model.

No GPU: the lines are checked by the code the batch and `memplan check` run on them.
"""

import contextlib
import json
import os
import statistics
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memplan.accuracy import iter_rows, job_of_row
from memplan.api import estimate
from memplan.presets import load_model
from memplan.verify import batch, sample, sample_space
from memplan.verify.sample_cost import predicted_wall_s
from memplan.verify.worker import check_supported

ROWS = Path(__file__).resolve().parent.parent / "benchmarks" / "accuracy"


@contextlib.contextmanager
def _cwd(path):
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def _draw(folder, *argv):
    """Run the CLI in ``folder`` (lines name their files relative to it); the lines it wrote."""
    with _cwd(folder):
        assert sample.main(["--out", "sampled/draw.jsonl", *argv]) == 0
        return [json.loads(x) for x in Path("sampled/draw.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def seed1(tmp_path_factory):
    folder = tmp_path_factory.mktemp("seed1")
    return folder, _draw(folder, "--seed", "1", "--count", "120")


def _flags(line):
    a = line["args"]
    return {a[i]: a[i + 1] for i in range(len(a) - 1) if a[i].startswith("--") and not a[i + 1].startswith("--")}


def _stage(line):
    f = _flags(line)
    return int(f["--zero"]) if "--zero" in f else (3 if f["--ds-config"].endswith("zero3.json") else 2)


def test_same_seed_same_file(tmp_path, seed1):
    folder, lines = seed1
    again = _draw(tmp_path, "--seed", "1", "--count", "120")
    assert again == lines
    named = {Path(_flags(x)["--ds-config"]).name for x in lines if "requires" not in x}
    assert {p.name for p in (folder / "sampled" / "ds").iterdir()} == named  # no file of a rejected draw
    for sub in ("ds", "configs"):
        a = {p.name: p.read_text() for p in (folder / "sampled" / sub).iterdir()}
        b = {p.name: p.read_text() for p in (tmp_path / "sampled" / sub).iterdir()}
        assert a == b and a
    (tmp_path / "other").mkdir()
    other = _draw(tmp_path / "other", "--seed", "2", "--count", "20")
    assert [x["args"] for x in other] != [x["args"] for x in lines[:20]]


def test_every_line_parses_passes_check_and_fits(seed1):
    folder, lines = seed1
    assert len({x["name"] for x in lines}) == len(lines)
    with _cwd(folder):
        for line in lines:
            assert line["sampler_version"] == sample_space.SAMPLER_VERSION and line["seed"] == 1
            assert line["sampler_command"] == ("python -m memplan.verify.sample --out sampled/draw.jsonl --seed 1 "
                                               "--count 120")
            missing = [p for p in line.get("requires", []) if not Path(p).is_file()]
            item = batch.parse_item(line, os.devnull)
            if missing:  # a Trainer template this checkout lacks: the batch skips the line and says why
                assert item.error and missing[0] in item.error
                assert missing[0] in batch.skip_reason(line, node_gpus=8)
                continue
            assert item.error is None, (line["name"], item.error)
            job = item.job
            check_supported(job, "real" if line.get("needs_gpus", 1) > 1 else "emulated")
            from memplan.dsconfig_emit import to_ds_config

            errors = [f for f in sample.check_findings(to_ds_config(job), job) if f.severity == "error"]
            assert not errors, (line["name"], errors)
            assert line["predicted_total_bytes"] == estimate(job).device_total_bytes <= sample.DEVICE_LIMIT_BYTES
            assert line["meta"]["predicted_host_bytes_rank0"] <= sample.HOST_LIMIT_BYTES
            if line.get("needs_gpus", 1) > 1:
                assert "--launch" in line["args"] and line["needs_gpus"] == job.layout.world
                assert "needs 2" in batch.skip_reason({**line, "needs_gpus": 2}, node_gpus=1)


def test_split_is_half_and_half_in_every_even_prefix(seed1):
    _, lines = seed1
    splits = [x["split"] for x in lines]
    for n in range(2, len(splits) + 1, 2):
        assert Counter(splits[:n]) == {"fit": n // 2, "check": n // 2}
    assert [x["index"] for x in lines] == list(range(len(lines)))
    for seed in range(5):  # odd counts: one over
        c = Counter(sample.split_of(seed, i) for i in range(7))
        assert abs(c["fit"] - c["check"]) == 1


def _quotas(lines, fams):
    loops = Counter(x["meta"]["loop"] for x in lines)
    assert all(loops[loop] >= 15 for loop in ("outputs", "loss", "hf-trainer")), loops
    lora = [x for x in lines if x["meta"]["lora"]]
    assert len(lora) >= 12
    assert {0, 2, 3} <= {_stage(x) for x in lora}
    assert {_flags(x)["--checkpointing"] for x in lora} == {"none", "full"}
    assert len({x["meta"]["family"] for x in lora}) >= 2
    assert {_flags(x)["--lora-targets"] == "all-linear" for x in lora} == {True, False}
    assert {int(_flags(x)["--lora-rank"]) for x in lora} == {8, 16, 32, 64}
    assert any(x["meta"]["loop"] == "hf-trainer" for x in lora)
    families = Counter(x["meta"]["family"] for x in lines)
    assert all(families[f] >= 4 for f in fams), families
    # the regimes issue 13 names, on purpose
    by_preset = {p.name: p for p in sample_space.catalog()}
    f = [(_flags(x), x) for x in lines]
    assert any(int(g.get("--sp", 1)) >= 4 and int(g["--seq"]) >= 32768
               and sample_space._is_7b(by_preset[x["meta"]["preset"]]) for g, x in f)
    assert any(by_preset[x["meta"]["preset"]].spec.hidden_size >= 12288 and _stage(x) == 3
               and g["--checkpointing"] == "full" for g, x in f)
    assert any(by_preset[x["meta"]["preset"]].spec.num_experts and _stage(x) == 3 for g, x in f)
    assert any(g["--dtype"] == "fp16" for g, x in f)
    assert any(x["meta"]["regime"] == "z3_small_knobs" for g, x in f)
    assert any(x["meta"]["cut_layers"] for g, x in f)
    assert any("--alloc-conf" in g for g, x in f)


def _below_one_layer(folder, lines):
    """Lines whose own DeepSpeed JSON sets stage3_max_live_parameters or the prefetch bucket below one layer."""
    by_preset = {p.name: p for p in sample_space.catalog()}
    out = []
    for line in lines:
        path = _flags(line).get("--ds-config", "")
        if "sampled/ds/" not in path:
            continue
        zero = json.loads((folder / path).read_text()).get("zero_optimization", {})
        layer = by_preset[line["meta"]["preset"]].layer_params
        if any(zero.get(k, 2**62) < layer for k in ("stage3_max_live_parameters", "stage3_prefetch_bucket_size")):
            out.append(line)
    return out


def test_seed1_covers_the_quotas(seed1):
    folder, lines = seed1
    _quotas(lines, sample_space.families())
    assert len(_below_one_layer(folder, lines)) >= 4


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(min_value=0, max_value=10**9))
def test_any_seed_covers_the_quotas(seed):
    with tempfile.TemporaryDirectory() as folder:
        lines = _draw(folder, "--seed", str(seed), "--count", "120")
        assert len(lines) == 120
        _quotas(lines, sample_space.families())


def test_budget_stops_at_the_first_line_past_it(tmp_path, seed1):
    _, lines = seed1
    budget = 0.3 * sum(x["predicted_wall_s"] for x in lines)
    capped = _draw(tmp_path, "--seed", "1", "--count", "120", "--budget-s", str(budget))
    assert sum(x["predicted_wall_s"] for x in capped) <= budget
    n = len(capped)
    assert [x["name"] for x in capped] == [x["name"] for x in lines[:n]]  # a prefix: nothing skipped
    assert sum(x["predicted_wall_s"] for x in lines[:n + 1]) > budget
    (tmp_path / "b").mkdir()
    only = _draw(tmp_path / "b", "--seed", "1", "--budget-s", str(budget))
    assert [x["name"] for x in only] == [x["name"] for x in capped]
    assert not [p for p in (tmp_path / "sampled" / "ds").iterdir()
                if int(p.stem.split("-")[1]) >= n]  # no file of a line past the budget is left


def test_cut_configs_name_their_source_and_keep_moe_layers(seed1):
    folder, _ = seed1
    for path in (folder / "sampled" / "configs").iterdir():
        raw = json.loads(path.read_text())
        src = load_model(raw["_memplan_cut_of"])
        cut = load_model(str(path))
        assert f"models/{raw['_memplan_cut_of']}.json cut to {cut.num_layers}" in raw["_memplan_source"]
        assert cut.num_layers in sample_space.CUT_LAYERS and cut.hidden_size == src.hidden_size
        assert cut.model_copy(update={"num_layers": src.num_layers, "name": src.name, "source": src.source}) == src
    toy = {"model_type": "x", "num_hidden_layers": 61, "first_k_dense_replace": 3, "layer_types": ["a"] * 61,
           "architectures": ["X"]}
    out = sample.cut_raw(toy, "toy", 2)
    assert out["num_hidden_layers"] == 2 and out["layer_types"] == ["a", "a"] and out["first_k_dense_replace"] == 1
    assert out["architectures"] == ["X"] and out["_memplan_cut_of"] == "toy"


def test_cost_model_tracks_committed_wall_times():
    """The wall-time model against every committed row's measured wall_s (one job of a shared batch)."""
    ratios = []
    for row in iter_rows(ROWS):
        job = job_of_row(row)
        depths = [m["num_layers"] for m in row["layers"]["measured"]] if row.get("layers") else [None]
        wall = 0.0
        for depth in depths:
            j = job if depth is None else job.model_copy(
                update={"model": job.model.model_copy(update={"num_layers": depth})})
            est = estimate(j)
            host = est.host_bytes_per_node // min(j.layout.world, j.layout.gpus_per_node)
            wall += predicted_wall_s(j, launch=row["mode"] == "real", steps=row["steps"], host_bytes=host)[0]
        ratios.append(wall / row["wall_s"])
    assert len(ratios) >= 40
    assert 0.75 <= statistics.median(ratios) <= 1.33, statistics.median(ratios)
    assert 0.4 <= min(ratios) and max(ratios) <= 2.5, (min(ratios), max(ratios))


def test_cost_model_terms_worked_by_hand():
    from memplan.specs import Job
    from memplan.verify import sample_cost as c

    m = load_model("llama-3.2-1b")
    job = Job(model=m, training={"seq_len": 2048, "zero": {"stage": 2}}, layout={"world": 8})
    wall, terms = predicted_wall_s(job)
    total, matmul, _ = c._matmul_params(job)
    assert terms["init_s"] == pytest.approx(c.INIT_BASE_S + c.BUILD_S_PER_GPARAM * total / 1e9, abs=0.01)
    flops = 6 * matmul * 2048 + 3 * 2048**2 * m.q_dim * m.num_layers
    assert terms["compute_s"] == pytest.approx(c.FIRST_STEP_S + 3 * flops / c.TFLOPS["bf16"], abs=0.01)
    assert terms["optimizer_s"] == pytest.approx(3 * c.GPU_OPT_STEP_S)
    assert wall == pytest.approx(sum(terms.values()), abs=0.1)
    pp = job.model_copy(update={"layout": job.layout.model_copy(update={"pp": 2}),
                                "training": job.training.model_copy(update={"zero": job.training.zero.model_copy(
                                    update={"stage": 1}), "grad_accum": 2})})
    assert predicted_wall_s(pp)[1]["start_s"] == 2 * c.START_S  # two stages, one after the other


@pytest.mark.parametrize("argv, field", [
    (["--seed", "1", "--count", "0"], "--count"), (["--seed", "x", "--count", "3"], "--seed"),
    (["--seed", "1", "--budget-s", "-5"], "--budget-s"), (["--seed", "1"], "--count"),
    (["--seed", "1", "--count", "3", "--out", "x.txt"], "--out"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, argv, field):
    with _cwd(tmp_path):
        full = argv if "--out" in argv else [*argv, "--out", "s.jsonl"]
        with pytest.raises(SystemExit) as exc:
            sample.main(full)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memplan: error:") and field in err[0]
    assert not list(tmp_path.iterdir())


def test_batch_copies_sample_keys_and_skips_what_this_node_cannot_run(tmp_path, seed1, monkeypatch, capsys):
    folder, lines = seed1
    from memplan.verify import runner

    seen = []

    def fake_measure(job, *, name, **opts):
        seen.append(name)
        return {"name": name, "status": "ok", "error": None, "job": job.model_dump(mode="json"), "wall_s": 1.0,
                "peak_allocated_bytes": 1, "comparison": [], "predicted": {}}

    monkeypatch.setattr(runner, "measure_job", fake_measure)
    monkeypatch.setattr(batch.report, "write_report", lambda row, out: None)
    plain = next(x for x in lines if "requires" not in x and "needs_gpus" not in x)
    tp = next(x for x in lines if x.get("needs_gpus", 1) > 1)
    hf = {**next(x for x in lines if "requires" in x), "requires": ["no/such/template.json"]}
    matrix = tmp_path / "m.jsonl"
    matrix.write_text("".join(json.dumps(x) + "\n" for x in (plain, tp, hf)))
    out = tmp_path / "out"
    with _cwd(folder):
        assert batch.main([str(matrix), "--out", str(out), "--node-gpus", "1", "--no-prebuild", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert f"{tp['name']}: skipped: needs {tp['needs_gpus']} GPUs" in printed
    assert f"{hf['name']}: skipped: needs no/such/template.json" in printed
    assert seen == [plain["name"]]
    row = json.loads((out / "rows.jsonl").read_text())
    assert {k: row[k] for k in batch.SAMPLE_KEYS if k in plain} == {k: plain[k] for k in batch.SAMPLE_KEYS
                                                                   if k in plain}
    assert row["split"] == plain["split"] and row["meta"]["regime"] == plain["meta"]["regime"]


def test_batch_keeps_rank0_host_memory_within_its_budget(tmp_path, monkeypatch):
    import argparse
    import threading
    import time

    from memplan.specs import Job
    from memplan.units import GiB
    from memplan.verify import runner

    running, peak = set(), [0]
    lock = threading.Lock()

    def fake_measure(job, *, name, **opts):
        with lock:
            running.add(name)
            peak[0] = max(peak[0], len(running))
        time.sleep(0.05)
        with lock:
            running.discard(name)
        return {"name": name, "status": "ok", "error": None, "wall_s": 0.1}

    monkeypatch.setattr(runner, "measure_job", fake_measure)
    monkeypatch.setattr(batch.report, "write_report", lambda row, out: None)
    job = Job(model=load_model("llama-3.2-1b"), training={"seq_len": 128})
    items = [batch.Item(name=n, args=[], job=job, opts={"timeout_s": 60.0, "steps": 1, "device": "cpu"},
                        need_bytes=GiB, host_bytes=60 * GiB) for n in "abc"]
    args = argparse.Namespace(out=str(tmp_path), workers=8, gpu_budget_gib=130.0, host_budget_gib=100.0,
                              deadline=None, steps=None, device=None)
    batch.Scheduler(items, args).run()
    assert peak[0] == 1  # 60 + 60 GiB of pinned host memory would pass 100 GiB


def test_batch_skips_nvme_lines_when_async_io_does_not_load(tmp_path, seed1, monkeypatch, capsys):
    folder, lines = seed1
    from memplan.verify import runner

    nvme = next((x for x in lines if _flags(x).get("--offload-param") == "nvme"
                 or _flags(x).get("--offload-optimizer") == "nvme"), None)
    plain = next(x for x in lines if "requires" not in x and "needs_gpus" not in x and "nvme" not in x["args"])
    if nvme is None:
        pytest.skip("seed 1 drew no NVMe line")
    seen = []
    monkeypatch.setattr(runner, "measure_job", lambda job, *, name, **o: seen.append(name) or {
        "name": name, "status": "ok", "error": None, "wall_s": 0.1})
    monkeypatch.setattr(batch.report, "write_report", lambda row, out: None)
    monkeypatch.setattr(batch, "prebuild_ops", lambda items, device: {"FusedAdamBuilder": "ok",
                                                                      "AsyncIOBuilder": "RuntimeError: no libaio"})
    matrix = tmp_path / "m.jsonl"
    matrix.write_text("".join(json.dumps(x) + "\n" for x in (nvme, plain)))
    with _cwd(folder):
        assert batch.main([str(matrix), "--out", str(tmp_path / "o"), "--node-gpus", "1", "--device", "cpu"]) == 0
    assert f"{nvme['name']}: skipped: NVMe offload needs DeepSpeed's async_io op" in capsys.readouterr().out
    assert seen == [plain["name"]]
