"""The performance model: estimated time of one optimizer step for a Job on given hardware.

Legend: P_mm matmul parameters (attention + active MLP per layer, plus the LM head), Ψ parameters per model
shard (total / (tp·pp)), n ZeRO partition group (dp·sp), L layers, b micro-batch, s sequence, a heads,
q = heads·head_dim, k = kv_heads·head_dim, G sequences per step (global batch), T = G·s tokens per step.

- Compute (Kaplan et al. 2020; PaLM, Chowdhery et al. 2022, App. B): training FLOPs per token 6·P_mm plus
  attention 12·L·q·s (per sequence 12·L·q·s²); full recompute adds one more forward of the layers (the
  brief's ×4/3 for the layer share), selective adds the attention core's forward. Split evenly over the
  tp·pp·sp ranks of one replica, run at `compute_efficiency` of the dense rate.
- Communication, ring algorithms (per rank moves (n−1)/n of the message; all-reduce twice that):
  ZeRO-0 all-reduce of grads per step; ZeRO-1 reduce-scatter of grads + all-gather of params per step;
  ZeRO-2 reduce-scatter per micro-step (stage_1_and_2.py reduces in the backward hooks) + all-gather per step;
  ZeRO-3 all-gather of params in forward and backward (and again in a recomputed forward) + reduce-scatter of
  grads per micro-step. TP (Megatron, Shoeybi et al. 2019): 2 all-reduces of b·s·h per layer forward, 2 in
  backward. Ulysses (Jacobs et al. 2023, §3.2): 4 all-to-alls per layer forward (q, k, v, out), 4 backward.
  PP: one activation send forward and one gradient send backward per micro-step; bubble (pp−1) micro-steps
  per step (1F1B, Narayanan et al. 2021), i.e. a (pp−1)/accum fraction of the micro-steps.
- Offload over PCIe, NVMe and the CPU: gradients to the host, updated 16-bit params back, optimizer states
  swapped through NVMe, DeepSpeedCPUAdam's update rate; ZeRO-3 param offload fetches each partition per gather.
- Overlap: ZeRO collectives with overlap_comm (DeepSpeed's default for stage 3) and param fetches run beside
  compute (only the excess shows); TP / Ulysses / PP traffic is on the critical path.
Every figure is an assumption in PerfAssumptions or hardware.Hardware; docs/performance-model.md explains it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from ..specs import Job, ModelSpec
from ..units import dtype_bytes
from .hardware import Hardware

CATEGORIES = ("compute", "comm", "offload", "bubble")


class PerfAssumptions(BaseModel):
    """The achievable fractions of nominal rates the model runs at (printed with every plan)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    compute_efficiency: float = Field(
        0.5, gt=0, le=1,
        description="share of dense tensor-core FLOP/s reached by training matmuls and flash attention "
                    "(Narayanan et al. 2021, Megatron-LM at scale: 52% of A100 peak)")
    comm_efficiency: float = Field(
        0.8, gt=0, le=1, description="share of NVLink / InfiniBand bandwidth NCCL reaches (nccl-tests busbw)")
    pcie_efficiency: float = Field(0.8, gt=0, le=1, description="share of PCIe bandwidth pinned copies reach")
    eager_score_bytes: int = Field(
        60, gt=0, description="HBM bytes per attention-score element per layer, forward + backward, for eager "
                              "attention (bf16 scores, fp32 softmax, cast, read by AV; backward about twice)")
    gpu_adam_bytes_per_param: int = Field(
        36, gt=0, description="HBM bytes per parameter of the fused Adam step: reads master, m, v, grad; "
                              "writes master, m, v, 16-bit param")
    tight_headroom_fraction: float = Field(
        0.05, ge=0, lt=1, description="memory is the binding constraint when headroom is below this share")


class Term(NamedTuple):
    """One share of the step time, in seconds, and its category (compute / comm / offload / bubble)."""

    name: str
    seconds: float
    category: str


class StepTime(NamedTuple):
    """The estimated step time as terms that sum to it."""

    terms: tuple[Term, ...]

    @property
    def seconds(self) -> float:
        return sum(t.seconds for t in self.terms)

    def by_category(self) -> dict[str, float]:
        out = dict.fromkeys(CATEGORIES, 0.0)
        for t in self.terms:
            out[t.category] += t.seconds
        return out

    def dominant(self) -> str:
        """The category with the most seconds."""
        cats = self.by_category()
        return max(CATEGORIES, key=lambda c: cats[c])


@dataclass(frozen=True, slots=True)
class ModelCosts:
    """The model's per-sequence costs, computed once per model and sequence length."""

    matmul_params: int  # P_mm: weights that take part in a matmul per token (MoE: active experts)
    layer_matmul_params: int  # the share of P_mm inside the transformer layers
    total_params: int  # all parameters (what ZeRO partitions and moves)
    attention_flops_fwd: int  # 4·L·q·s² per sequence: QKᵀ and AV, forward
    score_elements: int  # L·a·s² attention-score elements per sequence (eager materializes them)
    hidden: int
    a2a_width: int  # 2·q + 2·k: widths of q, k, v and the attention output that Ulysses exchanges
    num_layers: int


def layer_matmul_params(m: ModelSpec) -> int:
    """Matmul weights of one layer a token passes through: q, k, v, o; the (active) MLP; the MoE router."""
    h = m.hidden_size
    attention = 2 * h * m.q_dim + 2 * h * m.kv_dim
    mlp = (3 if m.gated_mlp else 2) * h * m.intermediate_size
    if m.num_experts:
        return attention + m.num_experts_per_tok * mlp + h * m.num_experts
    return attention + mlp


@lru_cache(maxsize=64)
def model_costs(m: ModelSpec, seq_len: int) -> ModelCosts:
    """ModelCosts of ``m`` at ``seq_len`` (the LM head h·V counts; embedding lookups do no matmul)."""
    from ..params import count_params  # parameter counts as transformers builds them

    per_layer = layer_matmul_params(m)
    layers = m.num_layers * per_layer
    return ModelCosts(
        matmul_params=layers + m.hidden_size * m.vocab_size,
        layer_matmul_params=layers,
        total_params=count_params(m).total_params,
        attention_flops_fwd=4 * m.num_layers * m.q_dim * seq_len * seq_len,
        score_elements=m.num_layers * m.num_heads * seq_len * seq_len,
        hidden=m.hidden_size,
        a2a_width=2 * m.q_dim + 2 * m.kv_dim,
        num_layers=m.num_layers,
    )


def micro_step_flops(c: ModelCosts, seq_len: int, micro_batch: int, checkpointing: str) -> int:
    """Training FLOPs of one micro-step of one model replica: 3× forward, plus what recompute repeats."""
    tokens = micro_batch * seq_len
    forward = 2 * c.matmul_params * tokens + c.attention_flops_fwd * micro_batch
    recompute = 0
    if checkpointing == "full":  # transformers re-runs every layer's forward (not the LM head)
        recompute = 2 * c.layer_matmul_params * tokens + c.attention_flops_fwd * micro_batch
    elif checkpointing == "selective":  # Korthikanti et al. 2022: only the attention core is recomputed
        recompute = c.attention_flops_fwd * micro_batch
    return 3 * forward + recompute


def ring_bytes(message_bytes: float, group: int, all_reduce: bool = False) -> float:
    """Bytes one rank sends in a ring all-gather / reduce-scatter (×2 for all-reduce) of ``message_bytes``."""
    if group <= 1:
        return 0.0
    return (2.0 if all_reduce else 1.0) * (group - 1) / group * message_bytes


def link_bytes_per_s(hw: Hardware, span_ranks: int, gpus_per_node: int, a: PerfAssumptions) -> float:
    """Achievable bandwidth of a group whose ranks span ``span_ranks`` consecutive ranks: NVLink inside a
    node, InfiniBand when the span leaves it (tp innermost, then sp/dp, then pp: Megatron's rank order)."""
    raw = hw.nvlink_bytes_per_s if span_ranks <= gpus_per_node else hw.inter_node_bytes_per_s
    return raw * a.comm_efficiency


class _Ctx(NamedTuple):
    """What every term of one job needs, resolved once."""

    job: Job
    c: ModelCosts
    hw: Hardware
    a: PerfAssumptions
    full: bool  # full recompute
    param_bytes: int  # 16-bit (or fp32) parameter element
    grad_comm_bytes: int  # gradient reduction element (fp32 under Ulysses unless configured)
    shard_params: float  # Ψ = total / (tp·pp)
    optimizer_part_params: float  # what one rank's optimizer updates: Ψ/n under ZeRO ≥ 1, Ψ under ZeRO-0
    ranks_per_node: int


def _ctx(job: Job, c: ModelCosts, hw: Hardware, a: PerfAssumptions) -> _Ctx:
    t, lay = job.training, job.layout
    dt = dtype_bytes(t.dtype)
    shard = c.total_params / (lay.tp * lay.pp)
    part = shard / lay.zero_group if t.zero.stage >= 1 else shard
    return _Ctx(job, c, hw, a, t.checkpointing == "full", dt,
                dtype_bytes(t.sp_comm_dtype) if lay.sp > 1 else dt, shard, part, min(lay.world, lay.gpus_per_node))


def _compute_micro(x: _Ctx) -> tuple[float, float]:
    """Seconds per micro-step per rank: matmuls + attention (incl. recompute), and eager's score traffic."""
    t, lay = x.job.training, x.job.layout
    ranks = lay.tp * lay.pp * lay.sp
    flops = micro_step_flops(x.c, t.seq_len, t.micro_batch, t.checkpointing) / ranks
    compute = flops / (x.a.compute_efficiency * x.hw.dense_flops)
    eager = 0.0
    if t.attention == "eager":
        rerun = 4 / 3 if t.checkpointing != "none" else 1.0
        eager = rerun * x.c.score_elements * t.micro_batch / ranks * x.a.eager_score_bytes / x.hw.hbm_bytes_per_s
    return compute, eager


def _critical_comm_micro(x: _Ctx) -> tuple[float, float, float]:
    """Seconds per micro-step of TP all-reduces, Ulysses all-to-alls and PP sends (not overlapped)."""
    t, lay = x.job.training, x.job.layout
    gpn, tokens = lay.gpus_per_node, t.micro_batch * t.seq_len
    tp = sp = pp = 0.0
    if lay.tp > 1:
        count = (4 + (2 if x.full else 0)) * x.c.num_layers / lay.pp
        message = tokens * x.c.hidden * x.param_bytes
        tp = count * ring_bytes(message, lay.tp, all_reduce=True) / link_bytes_per_s(x.hw, lay.tp, gpn, x.a)
    if lay.sp > 1:
        passes = 2 + (1 if x.full else 0)  # forward, backward, recomputed forward: 4 all-to-alls each
        per_layer = (lay.sp - 1) / lay.sp * tokens / lay.sp * x.c.a2a_width * x.param_bytes
        sp = passes * x.c.num_layers * per_layer / link_bytes_per_s(x.hw, lay.sp, gpn, x.a)
    if lay.pp > 1:
        pp = 2 * tokens * x.c.hidden * x.param_bytes / link_bytes_per_s(x.hw, lay.world, gpn, x.a)
    return tp, sp, pp


def _zero_comm(x: _Ctx) -> tuple[float, float]:
    """ZeRO / data-parallel collectives: (seconds per micro-step, seconds per step)."""
    t, lay = x.job.training, x.job.layout
    n, stage = lay.zero_group, t.zero.stage
    bw = link_bytes_per_s(x.hw, lay.world // lay.pp, lay.gpus_per_node, x.a)
    grads = ring_bytes(x.shard_params * x.grad_comm_bytes, n)
    params = ring_bytes(x.shard_params * x.param_bytes, n)
    if stage == 0:  # engine.allreduce_gradients at the accumulation boundary
        return 0.0, 2 * grads / bw
    if stage == 1:  # full grads kept across micro-steps, reduced once; updated params all-gathered
        return 0.0, (grads + params) / bw
    if stage == 2:  # reduce_ipg_grads in every backward; all-gather of updated params per step
        return grads / bw, params / bw
    gathers = 2 + (1 if x.full else 0)  # forward, backward, recomputed forward
    return (gathers * params + grads) / bw, 0.0


def _offload(x: _Ctx) -> tuple[float, dict[str, float]]:
    """Offload traffic: (PCIe/NVMe seconds per micro-step, {term name: seconds per step})."""
    z = x.job.training.zero
    pcie = x.hw.pcie_bytes_per_s * x.a.pcie_efficiency
    nvme = x.hw.nvme_bytes_per_s_per_node / x.ranks_per_node  # a node's drives serve all its ranks
    part = x.optimizer_part_params
    micro = 0.0
    step: dict[str, float] = {}
    if z.offload_param != "none":
        gathers = 2 + (1 if x.full else 0)
        fetched = gathers * part * x.param_bytes
        micro += fetched / pcie + (fetched / nvme if z.offload_param == "nvme" else 0.0)
    if z.offload_optimizer != "none":
        grads_to_host = part * x.param_bytes / pcie
        if z.stage == 1:
            step["pcie_grads"] = grads_to_host
        else:
            micro += grads_to_host
        step["pcie_params"] = part * x.param_bytes / pcie
        step["cpu_adam"] = part * x.ranks_per_node / x.hw.cpu_adam_params_per_s_per_node
        if z.offload_optimizer == "nvme":  # fp32 master, exp_avg, exp_avg_sq read and written back
            step["nvme_optimizer"] = 2 * 12 * part / nvme
    elif z.offload_param != "none":  # updated partitions go back to the host (and the drives)
        written = part * x.param_bytes
        step["pcie_params"] = written / pcie + (written / nvme if z.offload_param == "nvme" else 0.0)
    return micro, step


def step_time(job: Job, costs: ModelCosts, hw: Hardware, a: PerfAssumptions) -> StepTime:
    """Seconds of one optimizer step of ``job``: micro-steps (with the pipeline bubble) plus the step's end."""
    x = _ctx(job, costs, hw, a)
    t, lay, z = job.training, job.layout, job.training.zero
    compute, eager = _compute_micro(x)
    tp, sp, pp = _critical_comm_micro(x)
    zero_micro, zero_step = _zero_comm(x)
    offload_micro, offload_step = _offload(x)
    busy = compute + eager
    zero_hidden, fetch_hidden = (zero_micro, offload_micro) if z.overlap else (0.0, 0.0)
    zero_crit, fetch_crit = zero_micro - zero_hidden, offload_micro - fetch_hidden
    exposed = max(0.0, max(zero_hidden, fetch_hidden) - busy)
    exposed_cat = "comm" if zero_hidden >= fetch_hidden else "offload"
    micro_terms = [
        Term("compute", compute, "compute"), Term("eager_attention_scores", eager, "compute"),
        Term("tp_allreduce", tp, "comm"), Term("ulysses_alltoall", sp, "comm"), Term("pp_send", pp, "comm"),
        Term("zero_comm", zero_crit, "comm"), Term("offload_fetch", fetch_crit, "offload"),
        Term(f"{exposed_cat}_not_overlapped", exposed, exposed_cat),
    ]
    per_micro = sum(m.seconds for m in micro_terms)
    terms = [Term(m.name, m.seconds * t.grad_accum, m.category) for m in micro_terms if m.seconds > 0]
    if lay.pp > 1:
        terms.append(Term("pipeline_bubble", (lay.pp - 1) * per_micro, "bubble"))
    if zero_step:
        terms.append(Term("zero_step_comm", zero_step, "comm"))
    if z.offload_optimizer == "none":
        seconds = x.optimizer_part_params * a.gpu_adam_bytes_per_param / hw.hbm_bytes_per_s
        terms.append(Term("optimizer_gpu", seconds, "compute"))
    terms += [Term(name, s, "offload") for name, s in offload_step.items() if s > 0]
    return StepTime(tuple(terms))


def tokens_per_step(job: Job) -> int:
    """T = micro-batch · grad_accum · dp · seq: tokens of one optimizer step over all replicas."""
    t = job.training
    return t.micro_batch * t.grad_accum * job.layout.dp * t.seq_len
