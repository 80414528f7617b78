"""Tensor parallelism in the worker: DeepSpeed's training AutoTP (tp > 1).

DeepSpeed 0.19.8 shards a transformers model inside deepspeed.initialize when the config carries
``"tensor_parallel": {"autotp_size": tp}`` (runtime/engine.py DeepSpeedEngine.__init__: ``if
self.autotp_size() > 1: self._configure_tensor_parallel(model, ...)``): it builds the (dp, tp) device mesh
(utils/groups.py _init_tp_mesh_device: TP groups are consecutive ranks), replaces the attention and MLP
projections by column/row-parallel linears after the model's HF tp_plan or AutoTP's own parser
(_apply_autotp_partitioning), and, for a tied vocabulary head under an ``embedding_rowwise`` plan, a
vocabulary-parallel lm_head with a distributed cross-entropy (configure_vocab_parallel_loss). So the harness
builds the whole model on every rank as usual and lets deepspeed.initialize shard it.

Why real ranks only: the engine registers a forward pre-hook (check_dataloader_inputs_same_across_ranks)
that broadcasts the first batch inside the TP group and asserts all ranks hold equal values; on the fake
process group the broadcast leaves garbage and the vocabulary-parallel loss all-reduces partial sums that never
arrive. Every rank of a TP group must therefore draw the same token batch: `seed_batches` seeds the batch
RNG with the data-parallel rank after initialize (ranks of one TP group share it).
"""

from __future__ import annotations

from ..specs import Job

#: the fixed part of the batch seed; the data-parallel rank is added to it
BATCH_SEED = 1234


def unsupported_reason(job: Job, mode: str) -> str | None:
    """Why this harness cannot run ``job`` with AutoTP, or None."""
    t, lay = job.training, job.layout
    if mode != "real":
        return (f"tp {lay.tp} (AutoTP) needs real ranks (--launch): its first-batch consistency check and "
                "vocabulary-parallel loss exchange real values, which the fake process group does not")
    if t.zero.stage > 2:
        return f"tp > 1 with ZeRO {t.zero.stage}: the harness measures AutoTP with ZeRO 0-2"
    if lay.sp > 1 or lay.pp > 1:
        return "tp > 1 combined with sp or pp: not measured by this harness"
    return None


def seed_batches() -> int:
    """Seed torch's RNGs with BATCH_SEED + the data-parallel rank; returns that rank."""
    import torch
    from deepspeed.utils import groups

    dp_rank = groups.get_data_parallel_rank()
    torch.manual_seed(BATCH_SEED + dp_rank)
    return dp_rank


def tp_note(engine) -> dict[str, int]:
    """This rank's place in the (dp, tp) mesh and the parameters it holds after AutoTP's sharding."""
    from deepspeed.utils import groups

    return {"tp_rank": groups.get_tensor_model_parallel_rank(), "tp_size": groups.get_tensor_model_parallel_world_size(),
            "dp_rank": groups.get_data_parallel_rank(),
            "rank_params": sum(p.numel() for p in engine.module.parameters())}
