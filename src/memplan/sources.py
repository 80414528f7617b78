"""Where each value of a resolved job came from, for every command's output (table lines and ``"sources"`` in
--json): the article, DeepSpeed's default, memplan's default, a file (which key), a flag, or derived (by which
rule)."""

from __future__ import annotations

from typing import Any

from .jobbuild import DS_KEY_OF_FIELD, FLAG_OF_FIELD
from .resolve import ARTICLE, JobRequest, Source

#: the ZeroSpec knobs beyond stage and offload, listed after them
_ZERO_KNOBS = ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "contiguous_gradients",
               "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_live_parameters",
               "stage3_max_reuse_distance", "sub_group_size", "pin_memory")
_TRAINING = ("seq_len", "micro_batch", "grad_accum", "dtype", "optimizer", "checkpointing", "attention", "loop",
             "model_impl")
_LAYOUT = ("world", "gpus_per_node", "tp", "pp", "sp")
#: what memplan assumes for a field nobody set (the specs' defaults), and why
_MEMPLAN_WHY = {
    "checkpointing": "transformers' default", "attention": "transformers' default attn_implementation",
    "loop": "DeepSpeed's tutorial loop", "sp": "DeepSpeed's sequence_parallel_size default",
    "optimizer": "DeepSpeed's FusedAdam", "dtype": "DeepSpeed without an fp16/bf16 section",
}
_ZERO_WHY = "DeepSpeed 0.19.8's default (runtime/zero/config.py DeepSpeedZeroConfig)"


def _kind_origin(field: str, label: str | None, origin: str) -> tuple[str, str]:
    key = field.rsplit(".", 1)[-1]
    if label == "flag":
        return "flag", origin or FLAG_OF_FIELD.get(key, key)
    if label == "ds":
        return "file", f"--ds-config {DS_KEY_OF_FIELD.get(key, f'zero_optimization.{key}')}"
    if label in ("launch", "trainer", "file"):
        return "file", origin
    if label == "article":
        return "article", origin or ARTICLE
    if label in ("memplan", "derived", "deepspeed"):
        return label, origin
    if ".zero." in field:
        return "deepspeed", _ZERO_WHY
    return "memplan", _MEMPLAN_WHY.get(key, "")


def job_sources(job, req: JobRequest, source: dict[str, str], origin: dict[str, str]) -> tuple[Source, ...]:
    """One Source per value of ``job`` that a user may want to know the origin of (model, tokens, layout, dtype,
    optimizer, recompute, attention, loop, ZeRO stage, offload and knobs, adapters)."""
    t, lay, z = job.training, job.layout, job.training.zero
    out = [Source(field="model", value=job.model.name, source="flag" if req.model else "article",
                  origin="--model" if req.model else ARTICLE)]
    values: list[tuple[str, Any, str]] = [(f"layout.{f}", getattr(lay, f), f) for f in _LAYOUT]
    values += [(f"training.{f}", getattr(t, f), f) for f in _TRAINING]
    values += [(f"training.zero.{k}", getattr(z, k), k)
               for k in ("stage", "offload_optimizer", "offload_param", *_ZERO_KNOBS)]
    if lay.tp_sequence_parallel:
        values.append(("layout.tp_sequence_parallel", True, "tp_sequence_parallel"))
    for name in ("lora", "freeze", "allocator", "megatron"):
        if name in source:
            value = getattr(t, name)
            values.append((f"training.{name}", value.model_dump(mode="json") if hasattr(value, "model_dump")
                           else value, name))
    for field, value, key in values:
        kind, why = _kind_origin(field, source.get(key), origin.get(key, ""))
        if key == "overlap_comm" and value is None:
            value, why = z.overlap, f"{why}: on for stage 3, off for 1 and 2"
        out.append(Source(field=field, value=value, source=kind, origin=why))
    return tuple(out)


def fact_sources(model, req: JobRequest, facts: dict[str, Any], source: dict[str, str],
                 origin: dict[str, str]) -> tuple[Source, ...]:
    """Sources of the job facts a plan fixes (memplan.resolve.resolve_facts)."""
    out = [Source(field="model", value=model.name, source="flag" if req.model else "article",
                  origin="--model" if req.model else ARTICLE)]
    for key, value in facts.items():
        field = f"layout.{key}" if key in _LAYOUT else f"training.{key}"
        kind, why = _kind_origin(field, source.get(key), origin.get(key, ""))
        out.append(Source(field=field, value=value, source=kind, origin=why))
    return tuple(out)


def sources_json(sources) -> list[dict[str, Any]]:
    """The ``"sources"`` list of every command's --json."""
    return [s.model_dump(mode="json") for s in sources]


_HEAD = {"article": f"assumed from {ARTICLE}", "deepspeed": "assumed, DeepSpeed's defaults",
         "memplan": "assumed, memplan's defaults", "derived": "derived", "file": "from files", "flag": "from flags"}
#: short names of the fields in table lines
_SHORT = {"layout.world": "gpus", "layout.gpus_per_node": "gpus/node", "training.seq_len": "seq",
          "training.micro_batch": "micro-batch", "training.grad_accum": "accum", "training.zero.stage": "ZeRO stage",
          "training.model_impl": "model-impl"}


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int) or value < 10**6:
        return "…" if isinstance(value, (dict, list, tuple)) else str(value)
    digits = str(value).rstrip("0")
    return f"{digits}e{len(str(value)) - len(digits)}" if len(digits) <= 2 else str(value)


def _short(s: Source) -> str:
    return f"{_SHORT.get(s.field, s.field.rsplit('.', 1)[-1])} {_fmt(s.value)}"


def source_lines(sources, kinds: tuple[str, ...] = ("article", "deepspeed", "memplan", "derived", "file")) -> list[str]:
    """One line per kind of source, for the values that were not written on the command line: the value, and
    where it came from when that says more than the kind (a flag's values are the user's own)."""
    lines = []
    for kind in kinds:
        group = [s for s in sources if s.source == kind]
        if not group:
            continue
        shown = kind in ("memplan", "derived", "file")
        items = ", ".join(f"{_short(s)} ({s.origin})" if shown and s.origin else _short(s) for s in group)
        lines.append(f"{_HEAD[kind]}: {items}")
    return lines


__all__ = ["fact_sources", "job_sources", "source_lines", "sources_json"]
