"""ZeRO-3's gathered working set at the forward→backward turn, for the phase lists (estimator/phases.py).

Which parameters are gathered when backward starts: the modules PartitionedParameterCoordinator keeps for reuse
and prefetches (zero3_turn_gathered), and the MoE experts grouped_mm's saved weight views keep beyond them
(zero3_saved_experts). In elements; the ledger (zero3_params.py) replays the same rules event by event.
"""

from __future__ import annotations

from functools import lru_cache

from ..specs import Job
from .layout import RankShare


def _modules(job: Job, share: RankShare) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the modules ZeRO-3 fetches in forward order, indices of the experts among them): a tied word embedding
    is the first module and lm_head the last, one parameter gathered once, so it is counted at the end only."""
    if job.model.tie_word_embeddings:
        return share.modules[1:], tuple(i - 1 for i in share.expert_modules if i > 0)
    return share.modules, share.expert_modules


def zero3_turn_gathered(job: Job, share: RankShare) -> int:
    """ZeRO-3 parameters gathered at the forward→backward turn, in elements.

    PartitionedParameterCoordinator.__params_to_release (runtime/zero/partitioned_param_coordinator.py)
    keeps a module's params when, walking the trace onward, they reappear before stage3_max_reuse_distance
    elements have gone by: measured, a module is kept when the modules after it in forward hold fewer than
    that many elements. The prefetch may then add modules up to min(stage3_prefetch_bucket_size,
    stage3_max_live_parameters − available), overshooting by the last module it takes.
    """
    z = job.training.zero
    return _turn_gathered(_modules(job, share)[0], z.stage3_max_reuse_distance, z.stage3_prefetch_bucket_size,
                          z.stage3_max_live_parameters)


#: families whose experts run through transformers 5.17's grouped_mm_experts_forward (integrations/moe.py,
#: @use_experts_implementation): torch._grouped_mm saves ``weight.transpose(-2, -1)``, a view of the gathered
#: 3-D parameter, which keeps ZeRO-3's gathered storage alive when the partition swaps param.data back
#: (the ledger's rule: estimator/autograd.py saved_param_views, zero3_params.py)
GROUPED_MM_FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")


def zero3_saved_experts(job: Job, share: RankShare) -> int:
    """Elements of gathered experts that grouped_mm's saved weight views keep beyond the forward→backward turn
    set (zero3_turn_gathered): every MoE layer's experts on this stage, from its forward to its backward, less
    those the turn set holds anyway. 0 without grad-mode saving (checkpointed layers save nothing in forward)
    or outside ZeRO-3."""
    t, m = job.training, job.model
    if t.zero.stage != 3 or t.checkpointing != "none" or m.family not in GROUPED_MM_FAMILIES:
        return 0
    modules, experts = _modules(job, share)
    if not experts:
        return 0
    z = t.zero
    others = tuple(x for i, x in enumerate(modules) if i not in experts)
    in_turn = zero3_turn_gathered(job, share) - _turn_gathered(
        others, z.stage3_max_reuse_distance, z.stage3_prefetch_bucket_size, z.stage3_max_live_parameters)
    return max(0, sum(modules[i] for i in experts) - max(0, in_turn))


@lru_cache(maxsize=4096)
def _turn_gathered(modules: tuple[int, ...], reuse: int, prefetch: int, max_live: int) -> int:
    kept = after = 0
    i = len(modules)
    while i and after < reuse:  # modules from the end while fewer than `reuse` elements follow them
        i -= 1
        kept += modules[i]
        after += modules[i]
    budget = min(prefetch, max_live - kept)
    fetched = 0
    while i and fetched < budget:  # the prefetch walks on into the modules not kept
        i -= 1
        fetched += modules[i]
    return kept + fetched
