"""`memplan plan`: the configurations that fit, ranked by estimated step time.

- space.PlanSpace: what is fixed (model, seq, global batch, GPUs, budgets) and what may vary.
- search.search(space) -> candidate.PlanResult: every valid candidate (candidate.Candidate), its memory (the
  screen, confirmed by memplan.estimator.quick_peak: confirm) and its step time (perf.step_time); the feasible
  ones ranked, the closest misses kept.
- perf: the performance model (docs/performance-model.md); hardware: the figures it runs on.
- command: add_arguments(parser) / run(args) for the CLI; render, emit, user: output, --emit, --ds-config.
"""

from __future__ import annotations

from .candidate import Candidate, PlanResult
from .search import search
from .space import PlanSpace

__all__ = ["Candidate", "PlanResult", "PlanSpace", "search"]
