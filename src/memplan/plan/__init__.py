"""`memplan plan`: the configurations that fit, ranked by estimated step time.

- space.PlanSpace: what is fixed (model, seq, global batch, GPUs, budgets) and what may vary.
- search.search(space) -> search.PlanResult: every valid candidate, its memory (memplan.estimator.quick_peak)
  and its step time (perf.step_time); the feasible ones ranked, the closest misses kept.
- perf: the performance model (docs/performance-model.md); hardware: the figures it runs on.
- command: add_arguments(parser) / run(args) for the CLI; render, emit, user: output, --emit, --ds-config.
"""

from __future__ import annotations

from .search import Candidate, PlanResult, search
from .space import PlanSpace

__all__ = ["Candidate", "PlanResult", "PlanSpace", "search"]
