"""DeepSpeed's batch arithmetic: the missing batch sizes derived from the data-parallel size, and the identity
train = micro × accum × dp checked (DeepSpeedConfig._set_batch_related_parameters and _batch_assertion,
runtime/config.py in deepspeed 0.19.8). Re-exported by memplan.dsconfig.
"""

from __future__ import annotations

from typing import Any

from .errors import InputError


def derive_batch(train: int | None, micro: int | None, accum: int | None, dp: int) -> dict:
    """DeepSpeedConfig._set_batch_related_parameters: fill the missing batch sizes (integer division).

    Returns {"train_batch_size", "micro_batch", "grad_accum"}; raises InputError when neither
    train_batch_size nor train_micro_batch_size_per_gpu is given (DeepSpeed's assertion).
    """
    if train is not None and micro is not None and accum is not None:
        pass
    elif train is not None and micro is not None:
        accum = train // micro // dp
    elif train is not None and accum is not None:
        micro = train // dp // accum
    elif micro is not None and accum is not None:
        train = micro * accum * dp
    elif train is not None:
        accum, micro = 1, train // dp
    elif micro is not None:
        train, accum = micro * dp, 1
    else:
        raise InputError("train_batch_size", "set train_batch_size or train_micro_batch_size_per_gpu "
                                             "(DeepSpeedConfig._set_batch_related_parameters)")
    return {"train_batch_size": train, "micro_batch": micro, "grad_accum": accum}


def batch_problem(batch: dict, dp: int) -> str | None:
    """DeepSpeedConfig._batch_assertion, as a sentence showing the arithmetic; None when it holds."""
    train, micro, accum = batch["train_batch_size"], batch["micro_batch"], batch["grad_accum"]
    if micro < 1:
        return f"train_micro_batch_size_per_gpu derives to {micro} (train_batch_size {train} // dp {dp} // {accum})"
    if accum < 1:
        return f"gradient_accumulation_steps derives to {accum} (train_batch_size {train} // micro {micro} // dp {dp})"
    if train != micro * accum * dp:
        return (f"train_batch_size ({train}) != micro-batch ({micro}) × gradient accumulation ({accum})"
                f" × data-parallel size ({dp}) = {micro * accum * dp}")
    return None


def resolve_batch(settings: Any, dp: int) -> dict:
    """Derived batch sizes for ``dp`` of a memplan.dsconfig.DsSettings; InputError (as DeepSpeed's assertion)
    when they do not add up."""
    batch = derive_batch(settings.train_batch_size, settings.micro_batch, settings.grad_accum, dp)
    problem = batch_problem(batch, dp)
    if problem:
        raise InputError("train_batch_size", problem)
    return batch
