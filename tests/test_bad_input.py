"""Hostile input: `memplan estimate` with generated bad input exits 2 with one line naming the field.

Each strategy yields (argv, files, flag): argv may contain "{FILE}", replaced by the path of a file holding
``files``' text; ``flag`` is what the error line must name. Runs in-process through memplan.cli.main.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memplan import cli
from memplan.presets import list_presets

PRESETS = set(list_presets())
SIZE_FLAGS = ("--seq", "--micro-batch", "--grad-accum", "--gpus", "--gpus-per-node", "--tp", "--pp", "--sp")
CHOICE_FLAGS = {
    "--zero": ("0", "1", "2", "3"), "--offload-optimizer": ("none", "cpu", "nvme"),
    "--offload-param": ("none", "cpu", "nvme"), "--dtype": ("bf16", "fp16", "fp32"),
    "--checkpointing": ("none", "selective", "full"), "--attention": ("flash", "sdpa", "eager"),
    "--optimizer": ("adamw", "torch_adamw", "cpu_adam", "sgd", "lion"),
    "--layer-backward-hooks": ("none", "first", "every"),
}
KNOWN_FLAGS = {"--model", "--ds-config", "--gpu", "--target", "--json", "--help", *SIZE_FLAGS, *CHOICE_FLAGS}
#: the 176b preset's attention heads (the default model); sp must divide them
HEADS_176B = 96


def _not_json_object(text: str) -> bool:
    try:
        return not isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return True


def _not_positive_int(text: str) -> bool:
    try:
        return int(text.strip()) < 1
    except ValueError:
        return True


unknown_preset = st.from_regex(r"\A[a-z][a-z0-9.-]{0,15}\Z").filter(
    lambda s: s not in PRESETS and not s.endswith(".json") and not Path(s).exists()
).map(lambda s: (["--model", s], None, "--model"))

bad_json_text = st.one_of(
    st.text(max_size=40).filter(_not_json_object),
    st.sampled_from(['{"model_type": "llama", ', "[1, 2]", "null", '"x"', "{'a': 1}", "\ufeff{", "{" * 5000]),
)
bad_model_json = st.one_of(
    bad_json_text,
    st.sampled_from([
        "{}", '{"model_type": "nonesuch"}', '{"model_type": "llama", "hidden_size": "big"}',
        '{"model_type": "llama", "hidden_size": -4}', '{"model_type": "llama", "num_attention_heads": 0}',
        '{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 5}', '{"model_type": 7}',
    ]),
).map(lambda text: (["--model", "{FILE}"], text, "--model"))

bad_ds_json = st.one_of(
    bad_json_text,
    st.sampled_from([
        '{"zero_optimization": {"stage": 9}}', '{"zero_optimization": []}',
        '{"train_micro_batch_size_per_gpu": 0}', '{"train_micro_batch_size_per_gpu": -2}',
        '{"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": "yes"}}',
        '{"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": true}, "fp16": {"enabled": true}}',
        '{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}}}',
        '{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"reduce_bucket_size": 0}}',
        '{"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Frob"}}',
    ]),
).map(lambda text: (["--ds-config", "{FILE}"], text, "--ds-config"))

missing_file = st.sampled_from(["--model", "--ds-config"]).map(lambda f: ([f, "{MISSING}/x.json"], None, f))

bad_size_value = st.one_of(
    st.integers(-10**6, 0).map(str),
    st.from_regex(r"\A[a-zA-Z_.%]{1,8}\Z"),
    st.sampled_from(["1.5", "1e3", "", " ", "0x10", "8GiB", "½"]),
).filter(_not_positive_int)
bad_size = st.tuples(st.sampled_from(SIZE_FLAGS), bad_size_value).map(lambda t: ([t[0], t[1]], None, t[0]))

bad_target = st.sampled_from(["0GiB", "-1GB", "abc", "24", "1e999GiB", "GiB", "24 parsecs", ""]).map(
    lambda v: (["--target", v], None, "--target"))
bad_gpu = st.one_of(
    st.sampled_from(["x100", "0GiB", "-80GiB", "80", "", "h100-40g"]),
    st.from_regex(r"\A[xyz][a-z0-9]{0,6}\Z"),
).map(lambda v: (["--gpu", v], None, "--gpu"))


@st.composite
def indivisible_gpus(draw):
    """gpus not divisible by tp·pp (sp 1): the layout error names --gpus and shows the product."""
    tp, pp = draw(st.sampled_from([2, 3, 4, 6])), draw(st.sampled_from([1, 2, 3]))
    gpus = draw(st.integers(1, 96).filter(lambda g: g % (tp * pp)))
    return ["--sp", "1", "--tp", str(tp), "--pp", str(pp), "--gpus", str(gpus), "--zero", "1"], None, "--gpus"


@st.composite
def heads_not_divisible_by_sp(draw):
    sp = draw(st.integers(2, 200).filter(lambda s: HEADS_176B % s))
    return ["--sp", str(sp), "--gpus", str(sp), "--seq", str(sp * 1024)], None, "--sp"


@st.composite
def seq_not_divisible_by_sp(draw):
    sp = draw(st.sampled_from([2, 4, 8]))
    seq = draw(st.integers(1, 10**6).filter(lambda n: n % sp))
    return ["--sp", str(sp), "--gpus", str(sp), "--seq", str(seq)], None, "--seq"


offload_param_below_zero3 = st.tuples(st.sampled_from(["0", "1", "2"]), st.sampled_from(["cpu", "nvme"])).map(
    lambda t: (["--zero", t[0], "--offload-param", t[1]], None, "--offload-param"))

unknown_flag = st.from_regex(r"\A--[a-z][a-z-]{0,12}\Z").filter(lambda f: f not in KNOWN_FLAGS).map(
    lambda f: ([f], None, f))

bad_choice = st.sampled_from(sorted(CHOICE_FLAGS)).flatmap(
    lambda flag: st.from_regex(r"\A[a-z0-9_]{1,8}\Z").filter(lambda v: v not in CHOICE_FLAGS[flag]).map(
        lambda v: ([flag, v], None, flag)))

BAD_INPUT = st.one_of(
    unknown_preset, bad_model_json, bad_ds_json, missing_file, bad_size, bad_target, bad_gpu, indivisible_gpus(),
    heads_not_divisible_by_sp(), seq_not_divisible_by_sp(), offload_param_below_zero3, unknown_flag, bad_choice,
)


def run_main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    old_stdin, sys.stdin = sys.stdin, io.StringIO("")  # the CLI must not wait on stdin
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(argv)
    finally:
        sys.stdin = old_stdin
    return rc, out.getvalue(), err.getvalue()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(case=BAD_INPUT, as_json=st.booleans())
def test_bad_input_exits_2_with_one_line_naming_the_field(case, as_json):
    argv, text, flag = case
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "input.json"
        if text is not None:
            path.write_text(text, encoding="utf-8", errors="surrogatepass")
        argv = [a.replace("{FILE}", str(path)).replace("{MISSING}", tmp + "/missing") for a in argv]
        full = ["estimate", *argv, *(["--json"] if as_json else [])]
        rc, out, err = run_main(full)
    assert rc == 2, (full, out, err)
    assert out == ""
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), err
    assert lines[0].startswith(f"memplan: error: {flag}"), (full, lines[0])
    assert "internal:" not in lines[0]


def _special_path(kind: str, tmp: Path) -> str:
    if kind == "fifo":
        fifo = tmp / "fifo"
        os.mkfifo(fifo)
        return str(fifo)
    if kind == "huge":
        huge = tmp / "huge.json"
        with open(huge, "wb") as f:
            f.truncate(64 * 2**20)  # sparse: 64 MiB of NULs
        return str(huge)
    return {"dir": str(tmp), "zero": "/dev/zero", "stdin": "/dev/stdin"}[kind]


@pytest.mark.parametrize("flag", ["--model", "--ds-config"])
@pytest.mark.parametrize("kind", ["fifo", "zero", "stdin", "dir", "huge"])
def test_files_that_could_hang_or_flood_are_refused(flag, kind, tmp_path):
    """A FIFO, /dev/zero, /dev/stdin, a directory or a huge file: one line, exit 2, no hang (own process,
    so a regression times out instead of hanging the suite)."""
    if kind in ("fifo", "zero", "stdin") and sys.platform == "win32":
        pytest.skip("POSIX special files")
    path = _special_path(kind, tmp_path)
    code = f"import sys; from memplan.cli import main; sys.exit(main(['estimate', {flag!r}, {path!r}]))"
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60,
                          stdin=subprocess.PIPE)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"memplan: error: {flag}")
