"""Megatron's GPT: the activations it keeps, from its code (pure; no torch).

What the article launches is Megatron-DeepSpeed's pretrain_gpt.py (microsoft/Megatron-DeepSpeed at the commit
check's tables name, f4157bea69f3df8c6cb66f2ebcda66ba03d1288e); what memplan can run on a GPU is megatron-core
0.16.1 (the newest the registry here serves) with its local layer spec. ``TrainingSpec.megatron.codebase`` says
which one a job means; where the two differ the terms say so.

- ``layer_terms(model, job)``: one layer's saved tensors per token of this rank (layer.py);
  ``selective_terms`` under --recompute-granularity selective; ``layer_input_bytes_per_token`` under full.
- ``outside_terms(model, job, first, last)``, ``buffers``: embeddings, final norm, logits, the
  vocabulary-parallel loss, the global memory buffer and the causal masks (outside.py).
- ``stage_activations(model, job, layers)``: a pipeline stage's totals under the recompute flags (stage.py).
- ``measurement_notes(job)``: which figures rest on reading the code and which on a measurement (notes.py).
- ``harness``: the megatron-core measurement case and its prediction (memplan.verify.megatron_worker runs it).

Symbols are in shape.py; every term names the function it models.
"""

from __future__ import annotations

from .layer import attention_path, layer_input_bytes_per_token, layer_terms, selective_terms
from .notes import measurement_notes
from .outside import buffers, outside_terms
from .shape import padded_vocab, tokens_per_rank
from .stage import StageActivations, backward_transient_per_token, stage_activations

#: the Megatron-DeepSpeed commit the terms were read at (src/memplan/check/tables.json megatron_deepspeed)
MEGATRON_DEEPSPEED_COMMIT = "f4157bea69f3df8c6cb66f2ebcda66ba03d1288e"
#: the megatron-core version the harness measures (issue 17 names 0.19.2; the registry here serves 0.16.1)
MEGATRON_CORE_VERSION = "0.16.1"

__all__ = ["MEGATRON_CORE_VERSION", "MEGATRON_DEEPSPEED_COMMIT", "StageActivations", "attention_path",
           "backward_transient_per_token", "buffers", "layer_input_bytes_per_token", "layer_terms",
           "measurement_notes", "outside_terms", "padded_vocab", "selective_terms", "stage_activations",
           "tokens_per_rank"]
