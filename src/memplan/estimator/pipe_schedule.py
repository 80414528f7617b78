"""DeepSpeed 0.19.8's pipeline schedule and stage partition, ported (pure: no deepspeed, no numpy).

``train_instructions(stages, stage, micro_batches)`` is ``TrainSchedule.steps`` (runtime/pipe/schedule.py): the
instructions one stage runs for one ``train_batch``, in order, each as (kind, buffer id). ``num_pipe_buffers`` is
``TrainSchedule.num_pipe_buffers``. ``stage_layers`` is ``PipelineModule._partition_layers`` with the
``"type:<Layer>"`` method memplan.verify's pipeline builder uses: ``ds_utils.partition_balanced`` over binary
weights (1 for a decoder layer, 0 for the embedding, positions, final norm and head specs), so the stage holds
the specs ``parts[stage]:parts[stage + 1]``. tests/test_pipeline_ledger.py compares both with DeepSpeed's own
code where it is installed.
"""

from __future__ import annotations

from functools import lru_cache

LOAD, FORWARD, BACKWARD = "load_micro_batch", "forward_pass", "backward_pass"
SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD = "send_activation", "recv_activation", "send_grad", "recv_grad"
REDUCE_TIED, REDUCE_GRADS, OPTIMIZER_STEP = "reduce_tied_grads", "reduce_grads", "optimizer_step"


def num_pipe_buffers(stages: int, stage: int, micro_batches: int) -> int:
    """TrainSchedule.num_pipe_buffers: the in-flight forward passes of 1F1B, at least 2."""
    return max(2, min(stages - stage, micro_batches))


def _step_to_micro_batch(step: int, stages: int, stage: int) -> tuple[int, bool]:
    """TrainSchedule._step_to_micro_batch: the micro-batch of a schedule step and whether it is a forward."""
    even_step, even_stage = step % 2 == 0, stage % 2 == 0
    if even_step and even_stage:
        return step // 2 - stage // 2, True
    if not even_step and not even_stage:
        return (step - 1) // 2 - stage // 2, True
    if even_step and not even_stage:
        return step // 2 - stages + (stage + 1) // 2, False
    return (step - 1) // 2 - stages + 1 + stage // 2, False


def train_instructions(stages: int, stage: int, micro_batches: int) -> list[tuple[str, int]]:
    """TrainSchedule.steps flattened: (instruction, buffer id) in execution order (-1: no buffer)."""
    buffers = num_pipe_buffers(stages, stage, micro_batches)

    def valid(m: int) -> bool:
        return 0 <= m < micro_batches

    first, last = stage == 0, stage == stages - 1
    out: list[tuple[str, int]] = []
    prev = -1
    total = 2 * (micro_batches + stages - 1)
    for step in range(total):
        micro, forward = _step_to_micro_batch(step, stages, stage)
        prev_buf, cur_buf = prev % buffers, micro % buffers
        if forward:
            if valid(prev) and not first:
                out.append((SEND_GRAD, prev_buf))
            if valid(micro) and not first:
                out.append((RECV_ACT, cur_buf))
        else:
            if valid(micro) and not last:
                out.append((RECV_GRAD, cur_buf))
            if valid(prev) and not last:
                out.append((SEND_ACT, prev_buf))
        if (first or last) and forward and valid(micro):
            out.append((LOAD, cur_buf))
        if valid(micro):
            out.append((FORWARD if forward else BACKWARD, cur_buf))
        if step == total - 1:
            out += [(REDUCE_TIED, -1), (REDUCE_GRADS, -1), (OPTIMIZER_STEP, -1)]
        prev = micro
    return out


def partition_balanced(weights: tuple[int, ...], parts: int) -> list[int]:
    """ds_utils.partition_balanced (runtime/utils.py): the linear-partition dynamic programme, ties broken as
    its ``>=`` breaks them (the last k of equal cost wins); partition_uniform when there are no more items than
    parts."""
    n, m = len(weights), parts
    if n <= m:
        return [min(p, n) for p in range(m + 1)]
    inf = float("inf")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    dp_max[0][0] = 0
    dp_cost[0][0] = 0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                chunk = prefix[i] - prefix[k]
                hi, lo = max(dp_max[k][j - 1], chunk), min(dp_min[k][j - 1], chunk)
                cost = hi - lo
                if dp_cost[i][j] >= cost:
                    dp_cost[i][j], dp_max[i][j], dp_min[i][j], position[i][j] = cost, hi, lo, k
    out = [n]
    for j in range(m, 0, -1):
        out.append(position[out[-1]][j])
    return out[::-1]


@lru_cache(maxsize=256)
def stage_specs(before: int, layers: int, after: int, stages: int) -> tuple[tuple[int, int], ...]:
    """Each stage's [start, stop) over the layer specs: ``before`` specs (embedding, positions), ``layers``
    decoder layers, ``after`` specs (final norm, head), partitioned by ``type:`` (binary weights)."""
    weights = (0,) * before + (1,) * layers + (0,) * after
    parts = partition_balanced(weights, stages)
    return tuple((parts[s], parts[s + 1]) for s in range(stages))
