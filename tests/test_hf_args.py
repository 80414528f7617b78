"""memplan.hf.args and memplan.hf.flags: TrainingArguments as data, from a JSON file and from a launch line.

The defaults, the field list and the flag parsing are compared with transformers' own TrainingArguments and
HfArgumentParser where transformers is installed; the rest are toy cases.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.check.launch import parse_launch
from memplan.errors import InputError
from memplan.hf.args import MODELED, TrainingArgs, fields_table, load_training_args, training_args_from_dict
from memplan.hf.flags import has_trainer_flags, read_flags


def test_every_modelled_default_is_the_tables():
    table = fields_table()["fields"]
    defaults = TrainingArgs().model_dump()
    assert set(MODELED) <= set(table)
    assert {k: defaults[k] for k in MODELED} == {k: table[k]["default"] for k in MODELED}


def test_the_table_is_the_installed_transformers():
    transformers = pytest.importorskip("transformers")
    from memplan.hf.gen_fields import build

    if transformers.__version__ != fields_table()["transformers_version"]:
        pytest.skip(f"fields.json is for transformers {fields_table()['transformers_version']}")
    assert build() == fields_table()


@pytest.fixture
def bf16_on_cpu(monkeypatch):
    """transformers refuses bf16 without a bf16 GPU; the arguments themselves are what is tested."""
    pytest.importorskip("transformers")
    import transformers.training_args

    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda: True)


def test_reads_what_to_json_string_writes(tmp_path, bf16_on_cpu):
    from transformers import TrainingArguments

    real = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=3, gradient_accumulation_steps=5,
                             bf16=True, gradient_checkpointing=True, warmup_steps=0.2, optim="adamw_torch",
                             gradient_checkpointing_kwargs={"use_reentrant": True}, report_to=[])
    path = tmp_path / "args.json"
    path.write_text(real.to_json_string())
    mine = load_training_args(str(path))
    assert {k: getattr(mine, k) for k in MODELED if k != "optim"} == {k: getattr(real, k) for k in MODELED
                                                                      if k != "optim"}
    assert mine.optim == real.optim.value


def test_a_file_that_is_not_training_arguments_names_the_key(tmp_path):
    for text, field in (('{"zero_optimization": {"stage": 2}}', "--training-args zero_optimization"),
                        ("[1, 2]", "--training-args"), ('{"per_device_train_batch_size": 0}',
                                                        "--training-args per_device_train_batch_size"),
                        ('{"optim": "adam"}', "--training-args optim"), ("{nope", "--training-args")):
        path = tmp_path / "args.json"
        path.write_text(text)
        with pytest.raises(InputError) as err:
            load_training_args(str(path))
        assert err.value.field == field


def test_known_keys_memplan_does_not_model_are_ignored():
    args = training_args_from_dict({"logging_steps": 7, "seed": 3, "bf16": True, "output_dir": "x"})
    assert args.bf16 and args == TrainingArgs(bf16=True)


def test_checkpointing_kwargs_as_the_trainer_passes_them():
    assert TrainingArgs().checkpoint_kwargs() == ({"use_reentrant": False}, 1, False)
    assert TrainingArgs(gradient_checkpointing_kwargs={"every_n_layers": 3, "offload": True}).checkpoint_kwargs() \
        == ({"use_reentrant": False}, 3, True)
    as_string = training_args_from_dict({"gradient_checkpointing_kwargs": '{"use_reentrant": "true"}'})
    assert as_string.gradient_checkpointing_kwargs == {"use_reentrant": True}  # _convert_str_dict


@settings(max_examples=60)
@given(st.one_of(st.integers(0, 50), st.floats(0, 0.99)), st.integers(1, 10_000))
def test_warmup_steps_as_transformers_counts_them(warmup, total):
    transformers = pytest.importorskip("transformers")
    assert transformers
    from transformers.training_args import TrainingArguments

    assert TrainingArgs(warmup_steps=warmup).warmup_steps_for(total) == \
        TrainingArguments.get_warmup_steps(type("A", (), {"warmup_steps": warmup})(), total)


# --- the launch line ----------------------------------------------------------------------------------------

LINES = {
    "deepspeed": "deepspeed --num_gpus 8 train.py --deepspeed ds.json --model_name_or_path m "
                 "--per_device_train_batch_size 2 --gradient_accumulation_steps 4 --bf16 --gradient_checkpointing "
                 "--gradient_checkpointing_kwargs '{\"use_reentrant\":false}' --logging_steps 10",
    "torchrun": "torchrun --nproc_per_node 8 train.py --deepspeed ds.json --model_name_or_path m "
                "--per-device-train-batch-size 2 --gradient_accumulation_steps=4 --bf16 True --gradient_checkpointing "
                "true --gradient_checkpointing_kwargs '{\"use_reentrant\":false}' --logging_steps 10",
    "accelerate": "accelerate launch --num_processes 8 train.py --deepspeed ds.json --model_name_or_path m "
                  "--per_device_train_batch_size 2 --gradient_accumulation_steps 4 --bf16 yes --gradient_checkpointing "
                  "--gradient_checkpointing_kwargs '{\"use_reentrant\":false}' --logging_steps 10",
}


@pytest.mark.parametrize("launcher", list(LINES))
def test_the_three_launch_forms_read_the_same_arguments(launcher):
    launch = parse_launch(LINES[launcher])
    reading = read_flags(launch.script_args)
    args = reading.args
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.bf16,
            args.gradient_checkpointing, args.gradient_checkpointing_kwargs) == (2, 4, True, True,
                                                                                 {"use_reentrant": False})
    assert reading.deepspeed == "ds.json"
    assert reading.not_trainer == ["--model_name_or_path"] and reading.not_memory == ["--logging_steps"]
    assert has_trainer_flags(launch.script_args)


LINE_VALUES = [
    ["--per_device_train_batch_size", "3"], ["--bf16"], ["--fp16", "True"], ["--bf16", "false"],
    ["--no_dataloader_pin_memory"], ["--no-dataloader-pin-memory"], ["--warmup_steps", "0.1"],
    ["--warmup-steps", "4"], ["--optim", "adamw_torch"], ["--gradient_checkpointing"], ["--max_grad_norm", "0.5"],
    ["--learning_rate", "2e-5"], ["--torch_empty_cache_steps", "5"], ["--auto_find_batch_size", "1"],
    ["--gradient_checkpointing_kwargs", '{"every_n_layers": 2, "offload": "true"}'],
]


@pytest.mark.parametrize("words", LINE_VALUES, ids=[" ".join(w) for w in LINE_VALUES])
def test_flags_read_as_hf_argument_parser_reads_them(words, bf16_on_cpu, tmp_path):
    from transformers import HfArgumentParser, TrainingArguments

    (real,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--report_to", "none", *words])
    launch = parse_launch("python train.py " + " ".join(f"'{w}'" for w in words))
    mine = read_flags(launch.script_args).args
    for name in MODELED:
        theirs = getattr(real, name)
        assert getattr(mine, name) == getattr(theirs, "value", theirs), name


def test_bad_flag_values_name_the_flag():
    for line, flag in (("--per_device_train_batch_size 0", "--per_device_train_batch_size"),
                       ("--gradient_accumulation_steps x", "--gradient_accumulation_steps"),
                       ("--bf16 maybe", "--bf16"), ("--bf16 --fp16", "--bf16"),
                       ("--optim adam_nope", "--optim"),
                       ("--gradient_checkpointing_kwargs '{\"every_n_layers\": 0}'",
                        "--gradient_checkpointing_kwargs.every_n_layers")):
        with pytest.raises(InputError) as err:
            read_flags(parse_launch(f"deepspeed train.py {line}").script_args)
        assert err.value.field == flag, (line, err.value)


def test_lines_that_are_not_trainer_lines():
    for line in ("deepspeed train.py --deepspeed --deepspeed_config ds.json --local_rank 0",
                 "python train.py --seed 3 --epochs 2"):
        assert not has_trainer_flags(parse_launch(line).script_args), line
    assert json.dumps(read_flags(()).args.model_dump()) == json.dumps(TrainingArgs().model_dump())
