"""Hostile input, launch lines and what is never run (issue 15).

A launch line is shell text: memplan.check.shell splits it as bash does (quotes, escapes, comments, and the
control operators ; && || | & and newline that end a command), in one linear pass, running nothing. So
``--micro-batch-size 1;`` is 1, a line's gaps are never filled from the seed's scenario, and neither $(...) nor
backticks in a launch line nor auto_map in a config.json is ever executed. Counts follow their own parser's
rule: Megatron-DeepSpeed's argparse ``type=int``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

import pytest
from _hostile import assert_refused, line, run_main, workdir
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from memplan.bounds import MAX_RANKS, int_argument
from memplan.check.launch import parse_launch
from memplan.check.shell import shell_commands
from memplan.errors import InputError

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SEPARATORS = (";", " ;", "; ", "&&", " && ", "||", " | ", "|", "&", " & ", "\n", "|&")
flags = st.sampled_from(["--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--micro-batch-size",
                         "--ds-sequence-parallel-size", "--seq-length", "--num-layers"])
megatron_args = st.lists(st.tuples(flags, st.integers(1, 64)), min_size=1, max_size=5, unique_by=lambda t: t[0])


@SETTINGS
@given(args=megatron_args, sep=st.sampled_from(SEPARATORS),
       after=st.sampled_from(["echo done", "tee log.txt", "exit 1", "--seq-length 99", "rm -rf /", ""]))
def test_a_shell_separator_ends_the_command(args, sep, after):
    """Whatever follows ; && || | & or a newline is another command: the launch's values are its own
    (``--micro-batch-size 1;`` was read as "1;")."""
    command = "deepspeed --num_gpus 8 pretrain_gpt.py " + " ".join(f"{f} {v}" for f, v in args)
    launch = parse_launch(command + sep + after)
    assert launch.script_args == tuple((f, str(v)) for f, v in args)
    assert launch.script_args == parse_launch(command).script_args


words = st.lists(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=0,
                         max_size=12), min_size=1, max_size=8)


@SETTINGS
@given(words=words)
def test_quoted_words_come_back_as_written(words):
    """shlex.join quotes each word for a POSIX shell: memplan's splitter gives the same words back (quotes,
    spaces, $, backticks, ;, # and newlines inside them all literal)."""
    assert shell_commands(shlex.join(words)) == [words]


@SETTINGS
@given(text=st.text(st.characters(blacklist_categories=("Cs",)), max_size=300))
def test_any_text_splits_or_is_refused_in_one_line(text):
    """Arbitrary text: a list of commands, or an InputError (an open quote), never another exception."""
    try:
        commands = shell_commands(text)
    except InputError as err:
        assert "\n" not in str(err)
        return
    assert all(words and all(isinstance(w, str) for w in words) for words in commands)


@pytest.mark.parametrize("text, expected", [
    ("deepspeed t.py --micro-batch-size 1;", ["deepspeed", "t.py", "--micro-batch-size", "1"]),
    ("A=1 deepspeed t.py --a 'b c' 2>&1 | tee log", ["A=1", "deepspeed", "t.py", "--a", "b c"]),
    ('deepspeed t.py --x "a\\"b" --y \\$HOME > out.log', ["deepspeed", "t.py", "--x", 'a"b', "--y", "$HOME"]),
    ("deepspeed t.py \\\n  --x 1 # a comment\n", ["deepspeed", "t.py", "--x", "1"]),
    ("deepspeed t.py --x $(nproc) --y `date`", ["deepspeed", "t.py", "--x", "$(nproc)", "--y", "`date`"]),
])
def test_shell_words_worked_by_hand(text, expected):
    assert shell_commands(text)[0] == expected


def test_the_launch_is_the_launcher_command_not_the_set_up_around_it():
    text = "#!/bin/bash\nset -e\nexport X=1\ncd /work && mkdir -p logs\nnohup deepspeed t.py --x 2 > logs/a 2>&1 &\n"
    launch = parse_launch(text)
    assert launch.launcher == "deepspeed" and launch.script == "t.py" and launch.script_args == (("--x", "2"),)


@SETTINGS
@given(value=st.one_of(st.integers(-10**6, 10**6).map(str), st.text(max_size=12),
                       st.sampled_from(["2.5", "inf", "nan", "1e3", " 8 ", "+8", "0_8", "٣", "0x10", "8.0"])))
def test_launch_counts_follow_argparse_type_int(value):
    """Megatron-DeepSpeed's layout flags are add_argument(..., type=int): memplan accepts a value iff that
    argparse does and it is within bounds (1 to MAX_RANKS for a layout size)."""
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--tensor-model-parallel-size", type=int)
    try:
        parsed = parser.parse_args([f"--tensor-model-parallel-size={value}"]).tensor_model_parallel_size
    except argparse.ArgumentError:
        parsed = None
    assume("$" not in value and "`" not in value)
    try:
        ours = int_argument(value, "--launch --tensor-model-parallel-size", maximum=MAX_RANKS)
    except InputError as err:
        assert parsed is None or not 1 <= parsed <= MAX_RANKS, (value, parsed, err)
        return
    assert ours == parsed


def test_a_line_without_ulysses_flags_gets_sp_1_in_plan_not_the_seeds_8():
    """plan's --launch-file: nothing from the seed's scenario (sp 8, fp16, ZeRO-3 offload) fills a gap the
    line leaves; Megatron-DeepSpeed's own default --ds-sequence-parallel-size is 1."""
    with workdir() as root:
        (root / "launch.sh").write_text("deepspeed --num_gpus 8 pretrain_gpt.py --tensor-model-parallel-size 2 "
                                        "--micro-batch-size 1; echo done\n")
        rc, out, err = run_main(["plan", "--model", "llama-3.2-1b", "--seq", "1024", "--gpus", "8", "--zero-stages",
                                 "1", "--no-offload", "--max-micro-batch", "1", "--launch-file",
                                 str(root / "launch.sh"), "--json"])
        assert rc in (0, 1), err
        user = json.loads(out)["user_config"]
        assert user["runs"], user
        got = user["candidate"]
        assert (got["tp"], got["sp"], got["micro_batch"], got["offload_optimizer"]) == (2, 1, 1, "none")


# --- nothing from an input is ever run -----------------------------------------------------------------------

@pytest.mark.parametrize("via", ["--launch", "--launch-file"])
@pytest.mark.parametrize("command", ["check", "plan"])
def test_command_substitution_in_a_launch_line_is_never_run(via, command):
    with workdir() as root:
        text = (f"deepspeed --num_gpus 8 pretrain_gpt.py --num-layers 2 --tokenizer $(touch {root}/PWNED1) "
                f"--data `touch {root}/PWNED2` --save \"$(touch {root}/PWNED3)\"; touch {root}/PWNED4\n")
        if via == "--launch-file":
            (root / "launch.sh").write_text(text)
        if command == "plan" and via == "--launch":
            return  # plan reads launch files only
        value = str(root / "launch.sh") if via == "--launch-file" else text
        argv = (line("check", root, via, value) if command == "check" else
                ["plan", "--model", "llama-3.2-1b", "--seq", "1024", "--gpus", "8", "--zero-stages", "1",
                 "--no-offload", "--max-micro-batch", "1", via, value, "--json"])
        rc, _, err = run_main(argv)
        assert rc in (0, 1), err
        assert not list(root.glob("PWNED*"))
        if command == "check":
            assert parse_launch(text).script_value("--tokenizer") == f"$(touch {root}/PWNED1)"


def test_auto_map_in_a_config_json_is_never_imported(tmp_path, monkeypatch):
    """A config.json's auto_map names remote code (transformers imports it only with trust_remote_code=True):
    memplan reads the numbers and nothing else; verify's HF config drops auto_map."""
    (tmp_path / "evil.py").write_text(f"open({str(tmp_path / 'PWNED')!r}, 'w').close()\nclass EvilConfig: pass\n")
    config = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
              "intermediate_size": 128, "vocab_size": 1000, "auto_map": {"AutoConfig": "evil.EvilConfig",
              "AutoModelForCausalLM": "evil.EvilModel"}, "trust_remote_code": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    for argv in (["estimate", "--model", "config.json", "--seq", "128", "--gpus", "1", "--sp", "1", "--json"],
                 ["check", "--ds-config", str(_ds(tmp_path)), "--model", "config.json", "--json"]):
        rc, _, err = run_main(argv)
        assert rc in (0, 1), err
    from memplan.presets import load_model
    from memplan.verify.hfbuild import hf_config_dict

    assert "auto_map" not in hf_config_dict(load_model(str(tmp_path / "config.json")))
    assert "evil" not in sys.modules and not (tmp_path / "PWNED").exists()


def _ds(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 1}')
    return path


# --- every message one line, values shortened ------------------------------------------------------------------

LONG = "x" * 20_000
#: (command, flag) taking free text, with a value that is bad when 20,000 characters long
TEXT_FLAGS = [("estimate", f) for f in ("--model", "--gpu", "--target", "--dtype", "--zero", "--alloc-conf",
                                         "--freeze", "--ds-config", "--calibration", "--peft-config")] + \
    [("verify", f) for f in ("--name", "--out", "--device")] + \
    [("check", f) for f in ("--model", "--launch-file", "--gpus", "--target")] + \
    [("plan", f) for f in ("--zero-stages", "--checkpointing", "--attention", "--gpu", "--model", "--launch-file")] + \
    [("report", f) for f in ("--name", "--out", "--verify")] + [("calibrate", "--out"), ("calibrate", "ROWS")]


@pytest.mark.parametrize("command, flag", TEXT_FLAGS)
@pytest.mark.parametrize("value", [LONG, "a\nb\rc\x1b[31m" + LONG[:100], "/" + "y" * 5000 + "/z.json"])
def test_every_message_is_one_short_line_naming_the_flag(command, flag, value):
    """Four commands echoed a 20,000-character value back whole: every value is shortened
    (memplan.errors.shorten), control characters escaped, and the line names the flag as typed."""
    with workdir() as root:
        argv = line(command, root, rows=value) if flag == "ROWS" else line(command, root, f"{flag}={value}")
        text = assert_refused(argv, flag, root)
        assert "\x1b" not in text and "\r" not in text


def test_an_unclosed_quote_in_a_long_launch_is_one_line():
    with workdir() as root:
        assert_refused(line("check", root, "--launch", "deepspeed t.py --x '" + LONG), "--launch", root)
