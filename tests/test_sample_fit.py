"""memplan.verify.sample_fit: the sampler's pinned upper bound of per-GPU memory.

A toy job worked by hand from its parameter counts, the bound held above every committed measurement (and
above the device limit for the rows that ran out of memory), and its monotonicity as a property.
"""

import math
import statistics
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.accuracy import iter_rows, job_of_row
from memplan.params import count_params
from memplan.presets import load_model
from memplan.specs import Job
from memplan.verify import sample
from memplan.verify import sample_fit as fit

ROWS = Path(__file__).resolve().parent.parent / "benchmarks" / "accuracy"


def test_toy_job_worked_by_hand():
    """Llama-3.2-1B, ZeRO-2 over 8 ranks, 2048 tokens, bf16 AdamW, no checkpointing, sdpa, the loss loop."""
    m = load_model("llama-3.2-1b")
    job = Job(model=m, training={"seq_len": 2048, "zero": {"stage": 2}, "loop": "loss"}, layout={"world": 8})
    b = fit.fit_bound(job)
    n, h, q, kv, i, v, t = (count_params(m).total_params, m.hidden_size, m.q_dim, m.kv_dim, m.intermediate_size,
                            m.vocab_size, 2048)
    assert b.params_bytes == 2 * n
    assert b.grads_bytes == 2 * n // 8 + 4 * n // 8
    assert b.optimizer_bytes == 12 * n // 8 + 4 * n // 8
    assert b.buckets_bytes == 2 * (500_000_000 + 500_000_000)  # one reduce bucket (no overlap), one all-gather
    layer = 12 * h * 2 + 2 * 2 * h + 2 * (6 * q + 5 * kv) + 2 * 5 * i  # norms, residual, attention, gated MLP
    assert b.activations_bytes == t * (16 * layer + layer + (12 + 4) * h)  # every layer, one more, the final norm
    assert b.loss_bytes == t * v * (2 * 2 + 8)
    assert b.masks_bytes == 0 and b.host_bytes == 0 == b.nvme_bytes
    assert b.largest_block_bytes == max(4 * t * v, 2 * t * i)
    assert b.init_bytes == 2 * 2 * n + 4 * n // 8 + 12 * n // 8
    summed = b.params_bytes + b.grads_bytes + b.optimizer_bytes + b.buckets_bytes + b.activations_bytes + b.loss_bytes
    assert b.device_bytes == int(max(summed, b.init_bytes) * 1.25) + 2 * b.largest_block_bytes + fit.CONTEXT_BYTES
    off = job.model_copy(update={"training": job.training.model_copy(update={"zero": job.training.zero.model_copy(
        update={"offload_optimizer": "cpu"})})})
    o = fit.fit_bound(off)
    assert o.optimizer_bytes == 0 and o.grads_bytes == 2 * n // 8
    assert o.host_bytes == int((12 + 4 + 2) * n // 8 * 1.25) + fit.HOST_SLACK_BYTES


def _points():
    """(name, job, measured device bytes or None, status) of every committed row that ran or ran out of memory."""
    for row in iter_rows(ROWS):
        if row["status"] not in ("ok", "oom"):
            continue
        job = job_of_row(row)
        if row.get("layers") and row["layers"].get("measured"):
            for m in row["layers"]["measured"]:
                j = job.model_copy(update={"model": job.model.model_copy(update={"num_layers": m["num_layers"]})})
                yield row["name"], j, fit.CONTEXT_BYTES + (m.get("peak_reserved_bytes") or 0), row["status"]
        elif row.get("process_gpu_bytes"):  # the process's whole device use
            yield row["name"], job, row["process_gpu_bytes"], row["status"]
        else:  # torch's reserved, and the bound's own context beside it
            yield row["name"], job, fit.CONTEXT_BYTES + (row.get("peak_reserved_bytes") or 0), row["status"]


def _ratios() -> tuple[dict[str, float], int]:
    """bound / measured per committed row that ran, and the count of OOM rows (each checked above the limit)."""
    ratios, ooms = {}, 0
    for name, job, used, status in _points():
        bound = fit.fit_bound(job).device_bytes
        if status == "oom":  # the H200 could not hold it: the sampler would not draw it
            assert bound > sample.DEVICE_LIMIT_BYTES, name
            ooms += 1
        else:
            ratios[name] = min(ratios.get(name, math.inf), bound / used)
    return ratios, ooms


@pytest.mark.xfail(strict=True, reason="seed 3's first measurement went 37 % above sampler version 2's bound on "
                                       "s3-035 (DeepSeek-V3 4-layer, ZeRO-2 under the Trainer; its trace holds a "
                                       "14 GiB buffer from reduce_independent_p_g_buckets_and_remove_grads for an "
                                       "expert parameter larger than the bucket, which the bound does not count): "
                                       "the bound needs a new SAMPLER_VERSION, and seeds 1-3 stay as drawn")
def test_bound_is_near_or_above_every_committed_measurement():
    ratios, ooms = _ratios()
    assert len(ratios) >= 150 and ooms >= 2
    assert statistics.median(ratios.values()) <= 2.0, statistics.median(ratios.values())  # not a refusal of all
    worst = min(ratios, key=ratios.get)
    assert ratios[worst] >= 0.9, (worst, ratios[worst])


@pytest.mark.xfail(strict=True, reason="seed 2's first measurement went above sampler version 2's bound on 3 rows "
                                       "(fp32 sdpa runs the math kernel, whose scores the bound counts for eager only; "
                                       "a Mixtral fp16 ZeRO-2 row; a Llama-3-8B Trainer ZeRO-2 row, by 2-9 %): the "
                                       "bound needs a new SAMPLER_VERSION, and seeds 1-2 stay as drawn")
def test_bound_is_above_every_committed_measurement():
    ratios, _ = _ratios()
    worst = min(ratios, key=ratios.get)
    assert ratios[worst] >= 1.0, (worst, ratios[worst])


_JOBS = st.fixed_dictionaries({
    "preset": st.sampled_from(["llama-3.2-1b", "qwen3-0.6b", "gemma-2-2b", "tinymixtral", "gpt2-large", "pythia-1b"]),
    "stage": st.sampled_from([0, 1, 2, 3]), "world": st.sampled_from([1, 2, 8, 64]),
    "seq": st.sampled_from([256, 512]), "mb": st.sampled_from([1, 2]),
    "ckpt": st.sampled_from(["none", "full"]), "attention": st.sampled_from(["sdpa", "eager"]),
    "dtype": st.sampled_from(["bf16", "fp32"]), "oo": st.sampled_from(["none", "cpu"]),
})


def _job(d, **over):
    d = {**d, **over}
    zero = {"stage": d["stage"], "offload_optimizer": d["oo"] if d["stage"] else "none"}
    return Job(model=load_model(d["preset"]), layout={"world": d["world"]},
               training={"seq_len": d["seq"], "micro_batch": d["mb"], "checkpointing": d["ckpt"],
                         "attention": d["attention"], "dtype": d["dtype"], "zero": zero})


@settings(max_examples=40, deadline=None)
@given(_JOBS)
def test_bound_grows_with_tokens_and_shrinks_with_partitions(d):
    b = fit.fit_bound(_job(d)).device_bytes
    assert fit.fit_bound(_job(d, seq=2 * d["seq"])).device_bytes >= b
    assert fit.fit_bound(_job(d, mb=2 * d["mb"])).device_bytes >= b
    if d["stage"] >= 1:
        assert fit.fit_bound(_job(d, world=2 * d["world"])).device_bytes <= b
    if d["dtype"] == "bf16":
        assert fit.fit_bound(_job(d, dtype="fp32")).device_bytes >= b
