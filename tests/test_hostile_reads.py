"""Hostile input, reads (issue 15): every file every command reads, given a file that must be refused.

Each example draws a command and one of its file inputs (a flag, or calibrate's ROWS), and a kind of bad
file: a FIFO (a read would block), /dev/zero (never ends), /dev/null, a folder, a huge file, JSON nested too
deep, an integer of more digits than Python's int-string limit, a duplicate key (where the real reader refuses
it), UTF-16 (with and without a byte-order mark), a UTF-8 BOM (where the real reader refuses it), invalid
UTF-8; launch files also a word over MAX_ARG_STRLEN, an empty and a comment-only file. Every run must end
with exit 2, one line naming the input, empty stdout, and nothing written (tests/_hostile.py).
Then the other side: what DeepSpeed / transformers accept is accepted (hjson comments, a BOM in a DeepSpeed
JSON, "stage": "3", a duplicate key in a config.json, whose last value wins).
"""

from __future__ import annotations

import json
import os

import pytest
from _hostile import assert_refused, line, run_main, workdir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memplan.inputs import MAX_INPUT_BYTES, MAX_LAUNCH_BYTES, MAX_WORD_CHARS

#: (command, flag, how the real reader parses it) for every file a command reads
SLOTS = [
    ("estimate", "--model", "json"), ("estimate", "--ds-config", "deepspeed"),
    ("estimate", "--calibration", "memplan"), ("estimate", "--peft-config", "json"),
    ("verify", "--model", "json"), ("verify", "--ds-config", "deepspeed"), ("verify", "--peft-config", "json"),
    ("check", "--ds-config", "deepspeed"), ("check", "--model", "json"), ("check", "--launch-file", "launch"),
    ("plan", "--model", "json"), ("plan", "--ds-config", "deepspeed"), ("plan", "--launch-file", "launch"),
    ("report", "--verify", "memplan"), ("report", "--model", "json"), ("report", "--ds-config", "deepspeed"),
    ("report", "--peft-config", "json"), ("calibrate", "ROWS", "memplan"),
]
COMMON_KINDS = ("fifo", "devzero", "devnull", "folder", "huge", "utf16_bom", "utf16_no_bom", "invalid_utf8")
JSON_KINDS = ("deep", "digits", "not_json")
KINDS = {
    "json": (*COMMON_KINDS, *JSON_KINDS, "bom"),  # transformers / peft: json.loads refuses a BOM
    "memplan": (*COMMON_KINDS, *JSON_KINDS, "bom", "duplicate"),
    "deepspeed": (*COMMON_KINDS, *JSON_KINDS, "duplicate"),  # hjson skips a BOM: accepted (below)
    "launch": (*COMMON_KINDS, "bom", "long_word", "empty", "comments"),
}
READ_SETTINGS = settings(max_examples=3, deadline=None,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def _bad_file(root, kind: str, dialect: str, draw) -> str:
    """The path of a bad input of ``kind`` (made under ``root`` unless it is a device)."""
    path = root / "input.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind in ("devzero", "devnull"):
        return {"devzero": "/dev/zero", "devnull": "/dev/null"}[kind]
    elif kind == "folder":
        path.mkdir()
    elif kind == "huge":
        with open(path, "wb") as fh:  # sparse: no disk used
            fh.truncate((MAX_LAUNCH_BYTES if dialect == "launch" else MAX_INPUT_BYTES) + draw(st.integers(1, 4096)))
    else:
        path.write_bytes(_bad_bytes(kind, draw))
    return str(path)


def _bad_bytes(kind: str, draw) -> bytes:
    if kind == "deep":
        depth = draw(st.integers(65, 3000))
        return ('{"a": ' + "[" * depth + "]" * depth + "}").encode()
    if kind == "digits":
        return ('{"train_micro_batch_size_per_gpu": ' + "7" * draw(st.integers(4301, 20000)) + "}").encode()
    if kind == "duplicate":
        key = draw(st.sampled_from(["train_micro_batch_size_per_gpu", "name", "zero_optimization", "x"]))
        return json.dumps({"train_micro_batch_size_per_gpu": 1})[:-1].encode() + f', "{key}": 1, "{key}": 2}}'.encode()
    if kind == "not_json":  # nor hjson ({'a': 1} is hjson, so DeepSpeed reads it), nor a JSON object
        return draw(st.sampled_from([b"{", b'{"a": 1,', b"[1, 2", b'{"a": 1} trailing', b"[1, 2]", b'"text"']))
    if kind == "utf16_bom":
        return '{"train_micro_batch_size_per_gpu": 1}'.encode("utf-16")
    if kind == "utf16_no_bom":
        return '{"train_micro_batch_size_per_gpu": 1}'.encode("utf-16-le")
    if kind == "invalid_utf8":
        return b'{"name": "' + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80abc"])) + b'"}'
    if kind == "bom":
        return b"\xef\xbb\xbf" + draw(st.sampled_from([b'{"train_micro_batch_size_per_gpu": 1}',
                                                        b"deepspeed train.py --x 1\n"]))
    if kind == "long_word":
        return b"deepspeed train.py --name " + b"w" * draw(st.integers(MAX_WORD_CHARS + 1, MAX_WORD_CHARS + 5000))
    if kind == "empty":
        return draw(st.sampled_from([b"", b"\n", b"   \n\t\n"]))
    if kind == "comments":
        return draw(st.sampled_from([b"# only a comment\n", b"#!/bin/bash\n# train\n", b"export X=1\ncd /tmp\n"]))
    raise AssertionError(kind)


#: every (command, input, kind of bad file): each pair is tried, hypothesis drawing the details of the file
CASES = [(command, flag, dialect, kind) for command, flag, dialect in SLOTS for kind in KINDS[dialect]]


@pytest.mark.parametrize("command, flag, dialect, kind", CASES)
@READ_SETTINGS
@given(data=st.data())
def test_every_bad_file_is_refused_by_every_command(command, flag, dialect, kind, data):
    with workdir() as root:
        path = _bad_file(root, kind, dialect, data.draw)
        argv = line(command, root, rows=path) if flag == "ROWS" else line(command, root, flag, path)
        assert_refused(argv, flag, root)


@pytest.mark.parametrize("command, flag", [(c, f) for c, f, d in SLOTS if d != "launch" and f != "ROWS"])
def test_a_missing_file_names_the_flag(command, flag):
    with workdir() as root:
        assert_refused(line(command, root, flag, str(root / "missing" / "x.json")), flag, root)


# --- what the real readers accept is accepted -----------------------------------------------------------------

def _estimate_json(argv):
    rc, out, err = run_main(["estimate", "--model", "llama-3.2-1b", "--seq", "256", "--gpus", "2", "--sp", "1", *argv,
                             "--json"])
    assert rc == 0, err
    return json.loads(out)


@pytest.mark.parametrize("text", [
    ('// DeepSpeed reads hjson\n{"train_micro_batch_size_per_gpu": 1, /* here too */ "zero_optimization": '
     '{"stage": 2}, # and here\n}'),
    '\ufeff{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}',  # hjson skips the BOM
    '{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": "2"}}',  # pydantic's lax int
])
def test_what_deepspeed_accepts_is_accepted(tmp_path, text):
    """DeepSpeedConfig(path): hjson.load(..., object_pairs_hook=dict_raise_error_on_duplicate_keys), then
    DeepSpeedZeroConfig (pydantic): each of these loads, with ZeRO stage 2."""
    path = tmp_path / "ds.json"
    path.write_text(text, encoding="utf-8")
    assert _estimate_json(["--ds-config", str(path)])["job"]["training"]["zero"]["stage"] == 2
    dsconfig = pytest.importorskip("deepspeed.runtime.config")
    import hjson

    with open(path) as fh:  # as DeepSpeedConfig.__init__ reads a path
        cfg = hjson.load(fh, object_pairs_hook=dsconfig.dict_raise_error_on_duplicate_keys)
    assert int(dsconfig.get_zero_config(cfg).stage) == 2


def test_a_config_json_with_a_duplicate_key_reads_as_transformers_reads_it(tmp_path):
    """transformers (PretrainedConfig._dict_from_json_file: json.loads) keeps the last value: memplan too."""
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3, '
                    '"num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 1000}')
    assert _estimate_json(["--model", str(path)])["job"]["model"]["num_layers"] == 2
    configuration_utils = pytest.importorskip("transformers.configuration_utils")
    assert configuration_utils.PretrainedConfig._dict_from_json_file(str(path))["num_hidden_layers"] == 2


def test_hf_trainer_path_reads_the_ds_config_as_json_load_does(tmp_path):
    """--loop hf-trainer: HfDeepSpeedConfig reads the file with json.load (comments refused) and fills "auto"
    from TrainingArguments, so "auto" in fp16.enabled and the batch sizes is accepted there."""
    auto = tmp_path / "auto.json"
    auto.write_text('{"train_micro_batch_size_per_gpu": "auto", "fp16": {"enabled": "auto"}, '
                    '"zero_optimization": {"stage": 1}}')
    with workdir() as root:
        assert_refused(line("estimate", root, "--ds-config", str(auto)), "--ds-config train_micro_batch_size_per_gpu",
                       root)
    assert _estimate_json(["--ds-config", str(auto), "--loop", "hf-trainer"])["job"]["training"]["zero"]["stage"] == 1
    commented = tmp_path / "commented.json"
    commented.write_text('// a comment\n{"train_micro_batch_size_per_gpu": 1}')
    with workdir() as root:
        assert_refused(line("estimate", root, "--ds-config", str(commented), "--loop", "hf-trainer"), "--ds-config",
                       root)
