"""The summary JSON beside a sampled matrix (memplan.verify.sample): counts per dimension, the summed predicted
wall time, every rejection by reason, the sampler version and what it changed, and a digest of the presets the
draw read.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any

from . import sample_space as space


def summary(lines: list[dict[str, Any]], sampler) -> dict[str, Any]:
    """Counts per dimension, predicted wall time, rejections by reason (the job's facts from each line's meta,
    which the sampler took from the job it validated)."""
    c: dict[str, Counter] = {k: Counter() for k in ("family", "loop", "zero", "split", "regime", "sp", "offload",
                                                     "lora", "needs_gpus")}
    for line in lines:
        m = line["meta"]
        c["split"][line["split"]] += 1
        c["needs_gpus"][str(line.get("needs_gpus", 1))] += 1
        for key in ("family", "loop", "regime", "lora", "zero", "sp", "offload"):
            c[key][str(m[key])] += 1
    from .. import __version__

    return {"command": sampler.command, "seed": sampler.seed, "sampler_version": space.SAMPLER_VERSION,
            "sampler_version_note": space.VERSION_NOTES[space.SAMPLER_VERSION], "memplan_version": __version__,
            "fit": "memplan.verify.sample_fit.fit_bound (pinned; the estimator is not consulted)",
            "presets_sha256": presets_digest(),
            "lines": len(lines), "predicted_wall_s": round(sum(x["predicted_wall_s"] for x in lines), 1),
            "counts": {k: dict(sorted(v.items())) for k, v in c.items()},
            "rejections": dict(sorted(sampler.rejections.items(), key=lambda kv: -kv[1])),
            "relaxed": sampler.relaxed}


def presets_digest() -> str:
    """sha256 of the pinned presets' config files (what the draw reads from models/), to tell a changed input."""
    from ..presets import PRESETS_DIR

    h = hashlib.sha256()
    for name in space.SAMPLER_PRESETS:
        h.update(name.encode() + b"\0" + (PRESETS_DIR / f"{name}.json").read_bytes())
    return h.hexdigest()


__all__ = ["presets_digest", "summary"]
