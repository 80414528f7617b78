"""What one rank holds of the model under tp / pp, resolved once per job (parameters and layers)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..params import ParamTensor
from ..specs import Job, LoraSpec, ModelSpec
from .train_set import train_set

#: Megatron-style tensor parallelism (Shoeybi et al. 2019, §3) and AutoTP shard these roles (params.Role):
#: column-parallel attn_in / mlp_in (weight and bias), row-parallel attn_out / mlp_out (weight; bias whole),
#: the vocabulary of the word embedding and lm_head. Norms, position tables and routers stay whole.
_TP_SHARDED_ROLES = ("attn_in", "attn_out", "mlp_in", "mlp_out", "embedding", "lm_head")
_ROW_PARALLEL = ("attn_out", "mlp_out")


@dataclass(frozen=True, slots=True)
class RankShare:
    """Parameters of the most loaded rank's replica, in elements. With frozen parameters (LoRA's base,
    --freeze) the fields the optimizer and ZeRO's gradient groups are built from count the trainable ones
    only (deepspeed.initialize gets them alone, estimator/train_set.py): ``params``, ``per_layer``, ``head``,
    ``largest``, ``largest_layer_module``, ``zero3_partition`` and the ZeRO-1/2 buffers; ``frozen`` and
    ``zero3_frozen_partition`` hold the rest; ``modules`` (what ZeRO-3 gathers) all of them."""

    params: int  # P: the trainable parameters this rank's replica holds (all of them in full training)
    per_layer: int  # one transformer layer's trainable parameters on this rank
    layers: int  # transformer layers on this rank (num_layers / pp, the first stage rounded up)
    head: int  # trainable lm_head (or the tied embedding) on this rank
    largest: int  # L: largest trainable parameter tensor on this rank
    zero3_partition: int  # Σ ceil(numel / N) over this rank's trainable parameters (ZeRO-3 pads each param)
    zero3_persistent: int  # numel of params at or under stage3_param_persistence_threshold
    embedding: int  # word / position embeddings on this rank
    largest_layer_module: int  # numel of the largest module (linear) inside a transformer layer
    modules: tuple[int, ...]  # numel of each module's non-persistent params, in forward order (ZeRO-3 fetches)
    zero2_grad_buffer: int  # Σ numel of params overlapping the most loaded rank's ZeRO-1/2 partition
    zero2_grad_buffer_rank0: int  # the same for rank 0 (what an emulated run measures)
    zero2_largest_piece: int  # largest single param ∩ partition on the most loaded rank (fp64 norm scratch)
    zero2_largest_piece_rank0: int
    frozen: int = 0  # frozen parameters on this rank (16-bit model parameters outside the optimizer)
    zero3_frozen_partition: int = 0  # Σ ceil(numel / N) over the frozen ones (zero.Init partitions them too)
    #: indices into ``modules`` of the fused MoE experts (a module holding 3-D parameters: gate_up_proj, down_proj)
    expert_modules: tuple[int, ...] = ()


def _sharded(t: ParamTensor) -> bool:
    """Whether tensor parallelism splits ``t`` over the tp ranks."""
    return t.role in _TP_SHARDED_ROLES and not (t.is_bias and t.role in _ROW_PARALLEL)


_EMBEDDINGS = ("wte.weight", "embed_tokens.weight", "word_embeddings.weight", "embed_in.weight", "wpe.weight",
               "word_embeddings_layernorm.weight", "word_embeddings_layernorm.bias")


def _on_stage(name: str, layer: int | None, layers_here: int, pp: int, last: bool, tied: bool) -> bool:
    """Whether a tensor lives on this pipeline stage (the first, or with ``last`` the last): layers are split
    evenly; embeddings on the first stage, final norm and lm_head on the last, and a tied word embedding on
    both (DeepSpeed TiedLayerSpec keeps a copy on each and all-reduces its gradient)."""
    if layer is not None:
        return layer < layers_here
    if pp == 1:
        return True
    is_embedding = name.endswith(_EMBEDDINGS)
    if not last:
        return is_embedding
    return not is_embedding or (tied and name.endswith(("wte.weight", "embed_tokens.weight",
                                                        "word_embeddings.weight", "embed_in.weight")))


@lru_cache(maxsize=1024)
def _share(model: ModelSpec, tp: int, pp: int, n: int, persist: int, last: bool = False, lora: LoraSpec | None = None,
           freeze: tuple[str, ...] = ()) -> RankShare:
    tensors = train_set(model, lora, freeze).tensors
    layers_here = -(-model.num_layers // pp)
    numels = []
    frozen: list[int] = []
    module_numels: dict[str, int] = {}
    expert_names: set[str] = set()
    trained_modules: dict[str, int] = {}  # a layer's trainable modules (lora_A / lora_B count as their own)
    per_layer = head = embedding = 0
    tied_trains = False
    for t, trains in tensors:
        if not _on_stage(t.name, t.layer, layers_here, pp, last, model.tie_word_embeddings):
            continue
        numel = t.numel // tp if tp > 1 and _sharded(t) else t.numel
        (numels if trains else frozen).append(numel)
        if numel > persist:  # ZeRO-3 gathers frozen parameters too
            module = t.name.rsplit(".", 1)[0]
            module_numels[module] = module_numels.get(module, 0) + numel
            if len(t.shape) == 3:
                expert_names.add(module)
        if t.layer is None and t.name.endswith(_EMBEDDINGS[:5]):
            embedding += numel
            tied_trains = tied_trains or (trains and t.role == "embedding")
        if not trains:
            continue
        if t.layer is not None and numel > persist:
            module = t.name.rsplit(".", 1)[0]
            trained_modules[module] = trained_modules.get(module, 0) + numel
        if t.layer == 0:
            per_layer += numel
        if "lm_head" in t.name or "embed_out" in t.name:
            head += numel
    buffers, pieces = _zero2_buffers(numels, n)
    modules = list(module_numels.values())
    if model.tie_word_embeddings and (pp == 1 or last):  # tied: lm_head is the word embedding, fetched again
        tied = next(t.numel for t, _ in tensors) // max(1, tp)  # after the final norm
        head = tied if tied_trains else 0
        if pp == 1:
            modules.append(tied)
    return RankShare(
        params=sum(numels), per_layer=per_layer, layers=layers_here, head=head, largest=max(numels, default=0),
        zero3_partition=sum(-(-x // n) for x in numels),
        zero3_persistent=sum(x for x in numels + frozen if x <= persist), embedding=embedding,
        largest_layer_module=max(trained_modules.values(), default=0),
        modules=tuple(modules), zero2_grad_buffer=max(buffers), zero2_grad_buffer_rank0=buffers[0],
        zero2_largest_piece=pieces[buffers.index(max(buffers))], zero2_largest_piece_rank0=pieces[0],
        frozen=sum(frozen), zero3_frozen_partition=sum(-(-x // n) for x in frozen),
        expert_modules=tuple(i for i, name in enumerate(module_numels) if name in expert_names),
    )


def _zero2_buffers(numels: list[int], n: int) -> tuple[list[int], list[int]]:
    """Per rank: ZeRO-1/2 grads_in_partition, the whole of every parameter that overlaps the rank's partition
    (stage_1_and_2.py copy_grads_in_partition: Σ param.numel() over params_in_partition), and the largest
    overlap of one parameter with the partition (the biggest gradient piece the grad norm upcasts).
    Partitions cut the flat buffer, padded to 2N elements, in N equal parts."""
    size = -(-sum(numels) // (2 * n)) * 2
    per_rank, piece = [0] * n, [0] * n
    start = 0
    for x in numels:
        if x:
            for r in range(start // size, min(n - 1, (start + x - 1) // size) + 1):
                per_rank[r] += x
                overlap = min(start + x, (r + 1) * size) - max(start, r * size)
                piece[r] = max(piece[r], overlap)
        start += x
    return per_rank, piece


def rank_share(job: Job, last: bool = False) -> RankShare:
    """One rank's share of the model: under pp the first stage's, or with ``last`` the last stage's."""
    lay, z = job.layout, job.training.zero
    t = job.training
    return _share(job.model, lay.tp, lay.pp, lay.zero_group, z.stage3_param_persistence_threshold, last, t.lora,
                  tuple(t.freeze))
