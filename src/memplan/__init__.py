"""memplan: per-GPU memory of DeepSpeed training, estimated before launch and verified on a GPU.

Glossary (one vocabulary, used everywhere in the package):

- rank: one training process, one GPU. world: all ranks (``--gpus``).
- tp / pp / sp: tensor-, pipeline- and Ulysses sequence-parallel sizes. dp = world / (tp·pp·sp).
- partition group (N): the ranks ZeRO shards model states over, dp·sp (DeepSpeed's sequence-data-parallel group).
- micro-batch: sequences one rank runs per forward/backward. micro-step: one forward + backward.
- step: one optimizer step, after ``grad_accum`` micro-steps.
- phase: a moment of a step the estimator models (e.g. "forward, loss", "backward, layer 0", "optimizer step").
- peak allocated: ``torch.cuda.max_memory_allocated()`` over the first three steps on the most loaded rank.

The core (specs, estimator) is pure: frozen pydantic specs in, typed breakdowns in integer bytes out.
It imports neither torch, deepspeed nor transformers.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "estimate"]


def estimate(*args, **kwargs):
    """Estimate per-GPU memory for a job: see memplan.api.estimate."""
    from .api import estimate as _estimate

    return _estimate(*args, **kwargs)
