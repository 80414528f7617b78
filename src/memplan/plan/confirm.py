"""Confirming a plan: the rows `plan` shows carry the estimator's own figures, not the screen's.

`search` screens every candidate with the phase-list model (estimator.screen_peak: fast enough for 10,000+
candidates a second) and ranks them; the allocation ledger (estimator.quick_peak: tenths of a second per job)
then confirms candidates in rank order until ``top`` of them fit. The screen can be wrong both ways, so:
- a screened fit that the ledger refuses becomes a miss (with the ledger's figures);
- a screened miss on the target alone within SCREEN_BAND of it is a maybe: ranked with the fits and
  confirmed the same way (the screen's reserved figure was below the measured one on most jobs, issue 12);
- at most CONFIRM_LIMIT × top jobs are confirmed; rows past the limit are not shown (PlanResult.notes says).
Candidates not confirmed are counted but their screened figures are never shown as the estimate.
"""

from __future__ import annotations

from collections.abc import Callable

from .candidate import Candidate, make_candidate
from .space import PlanSpace

#: a screened device total up to this factor over the target may still fit by the ledger
SCREEN_BAND = 1.5
#: ledger runs per shown row at most (each refused maybe costs one)
CONFIRM_LIMIT = 4


def is_maybe(space: PlanSpace, c: Candidate) -> bool:
    """A screened miss on the target alone, within SCREEN_BAND of it."""
    return c.misses == ("target",) and c.device_total_bytes <= SCREEN_BAND * space.target_bytes


def confirm(space: PlanSpace, ranked: list[Candidate], exact: Callable, top: int, costs=None,
            rows: Callable[[list[Candidate]], int] = len) -> tuple[list[Candidate], list[Candidate], int, bool]:
    """(confirmed fits in rank order, until ``rows(fits)`` — the rows they make once merged — reaches ``top``;
    refused ones with the ledger's figures; ledger runs; whether the limit stopped it) over ``ranked``
    (screened fits and maybes, fastest first)."""
    fits: list[Candidate] = []
    refused: list[Candidate] = []
    runs = 0
    for c in ranked:
        if rows(fits) >= top:
            break
        if runs >= CONFIRM_LIMIT * top:
            return fits, refused, runs, True
        runs += 1
        checked = make_candidate(space, c.job, exact(c.job), costs)
        (fits if checked.fits else refused).append(checked)
    return fits, refused, runs, False
