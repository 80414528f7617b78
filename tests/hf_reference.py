"""The config transformers' Trainer really hands deepspeed.initialize, for tests (run as a subprocess).

    python tests/hf_reference.py RESULTS.json < cases.json

Each case is {"ds_config": {...}, "training_args": {...}, "hf_config": {...}, "world": N, "max_steps": S}. For
each, a real ``transformers.Trainer`` runs ``train()`` through TrainingArguments.__post_init__
(HfTrainerDeepSpeedConfig.trainer_config_process, DeepSpeedPlugin), the Accelerator (set_mixed_precision),
deepspeed_init (trainer_config_finalize, deepspeed_optim_sched) and Accelerator._prepare_deepspeed, up to
``deepspeed.initialize``, which is replaced by a function that records its keyword arguments and stops.
The model is a one-layer Llama whose ``config`` is the case's model config (only the config is read before
deepspeed.initialize); it is built before TrainingArguments, so no zero.Init runs. ``world`` is the value
of TrainingArguments.world_size (a subclass overrides the property: accelerate on a CPU counts one process,
and nothing else before deepspeed.initialize uses the world). bf16 is allowed on the CPU by replacing
transformers' GPU capability check. Output per case: {"config": ..., "optimizer": class name, "adam_w_mode",
"error": None} or {"error": "ValueError: ..."}.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys


class _Stop(Exception):
    pass


def _one(case: dict) -> dict:
    import deepspeed
    import torch
    import transformers
    from accelerate.state import AcceleratorState, PartialState
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    AcceleratorState._reset_state(True)
    PartialState._reset_state()
    world = case["world"]

    class Args(TrainingArguments):
        @property
        def world_size(self):
            return world

    tiny = AutoConfig.for_model(model_type="llama", hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, intermediate_size=32, vocab_size=64, max_position_embeddings=32)
    model = AutoModelForCausalLM.from_config(tiny)
    model.config = AutoConfig.for_model(**case["hf_config"])

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            ids = torch.randint(0, 64, (8,))
            return {"input_ids": ids, "labels": ids}

    got: dict = {}

    def record(**kwargs):
        got.update(kwargs)
        raise _Stop

    real = deepspeed.initialize
    deepspeed.initialize = record
    try:
        args = Args(output_dir=os.path.join(os.environ.get("TMPDIR", "/tmp"), "memplan-hf-reference"),
                    deepspeed=copy.deepcopy(case["ds_config"]), report_to=[], save_strategy="no",
                    logging_strategy="no", disable_tqdm=True, max_steps=case["max_steps"], **case["training_args"])
        Trainer(model=model, args=args, train_dataset=Tokens()).train()
    except _Stop:
        pass
    except Exception as exc:  # noqa: BLE001 - the reference's own refusal is a result
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        deepspeed.initialize = real
        transformers.integrations.deepspeed.unset_hf_deepspeed_config()
    optimizer = got.get("optimizer")
    config = {k: v for k, v in got["config_params"].items()
              if not (isinstance(v, float) and math.isinf(v))}  # accelerate's steps_per_print = inf
    return {"config": config, "optimizer": type(optimizer).__name__ if optimizer is not None else None,
            "adam_w_mode": getattr(optimizer, "adam_w_mode", None), "error": None}


def main() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29591")
    import transformers.training_args

    transformers.training_args.is_torch_bf16_gpu_available = lambda: True
    cases = json.load(sys.stdin)
    results = [_one(case) for case in cases]
    with open(sys.argv[1], "w") as fh:  # not stdout: DeepSpeed prints there
        json.dump(results, fh)


if __name__ == "__main__":
    main()
