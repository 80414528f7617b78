"""The sampler's own, pinned test of "can this job run on one H200": a closed-form upper bound of per-GPU memory.

memplan.verify.sample keeps or redraws a line by this bound, never by memplan's estimator: the estimator keeps
changing (it is what the sampled matrix measures), and a randomized benchmark whose draw moved with it could
neither be reproduced nor stay independent of the model it judges. A change here changes what a seed draws,
so it needs a new SAMPLER_VERSION (sample_space.py). The bound reads only the job's flags and the model's
parameter tensors (memplan.params.parameter_tensors: shapes from each family's modeling_<family>.py).

It is deliberately generous: every term below counts what the code keeps at its worst and then some, so that
a job it accepts is no likely OOM on a 141 GB H200 (the test holds it above every committed measurement,
tests/test_sample_fit.py, which finds it below three seed-2 rows by 2-9 %: a known gap for the next SAMPLER_VERSION). Per GPU (the emulated rank 0, or
the most loaded real rank), in bytes, with w the training dtype's bytes (2 for bf16 / fp16, 4 for fp32):

- model states (Rajbhandari et al. 2020, ZeRO §3): w·N 16-bit parameters (/ the ZeRO group under ZeRO-3, none
  on the GPU under parameter offload); gradients w·N_t (/ the group from ZeRO-2) and their fp32 copy 4·N_t
  (/ the group from ZeRO-1: DeepSpeed's BF16_Optimizer and ZeRO's fp32 partitions); optimizer states K·N_t
  (/ the group from ZeRO-1; on the host under optimizer offload) with K = 12 for AdamW (fp32 master, m, v),
  8 for Lion and SGD with momentum (master and one state), 4 less in fp32 (the parameter is the master);
  a step's fp32 temporaries 4·N_t (/ the group); N_t: trainable parameters (LoRA's adapters, else all).
- buckets: ZeRO-1/2 twice the reduce bucket and once the all-gather bucket (elements, bounded by N), w bytes
  each (engine.py / stage_1_and_2.py ipg buckets); ZeRO-3 (stage3.py, partitioned_param_coordinator.py):
  the gathered working set min(N, max_live + prefetch bucket + 2 × the largest module) in w bytes, counted
  twice (freed gathers stay cached in blocks that other tensors cannot reuse), the persistent parameters
  (at most the persistence threshold each) whole, and the w gradients of the largest module before their
  reduce-scatter, beside a reduce bucket of them.
- activations per token (tokens per rank T = micro-batch · seq / sp), per decoder layer on the device:
  12·h bytes per norm (RMSNorm / LayerNorm compute in fp32: the input and normalised copies beside the
  output), w·(6·q + 5·kv) of attention (q, rotate_half(q) and q after RoPE, the same for k, v, the output and
  its contiguous copy), 2·q more where transformers repeats k and v for a masked sdpa or eager call
  (repeat_kv), w·(5·I) of a gated MLP (gate, act, up, product, slack) or w·6·I ungated (GPT-2's gelu_new
  keeps x³ and tanh), MoE: 12·E router bytes and top_k·(2·h + 5·I_e) expert elements plus the shared experts;
  MLA: the latents (q_lora, kv_lora) with their norms; eager attention: (4 + w) bytes per score (the fp32
  softmax and its w cast), more with dropout or soft-capping; dropout: a mask byte and a copy per
  element it drops; LoRA: 2·r·w per adapted module and, with LoRA dropout, (w + 1) bytes per input element
  (peft copies the input through its dropout); Ulysses: the all-to-all's inputs and outputs of q, k, v in
  fp32 twice. Without checkpointing every layer keeps its own and the backward adds one more layer's; with
  full checkpointing each layer keeps its input (w·h) and the backward recomputes one layer and holds its
  gradients (2 × one layer). A pipeline stage keeps pp micro-batches in flight (1F1B's warm-up).
- the loss: (2·w + 16)·V bytes per token (the w logits, their fp32 copy, log-softmax, its gradient and the w
  gradient; + 3·w·V under Gemma's final soft-capping), and the previous step's w logits on the "outputs"
  loop (its outputs object lives until the next forward returns).
- masks: a 4-D mask of mb·seq² (w bytes for eager, 1 for sdpa's bool mask, per kind of layer) when
  transformers builds one (masking_utils.sdpa_mask: sliding-window layers once seq >= the window).
- on top: a quarter of all that for the caching allocator's fragmentation, twice the largest single block,
  and CONTEXT_BYTES outside torch's allocator (the CUDA context, cuBLAS / NCCL workspaces).

Host (rank 0's pinned share): (K + 4 + w)·N_t / group under optimizer offload (DeepSpeedCPUAdam's master,
states and fp32 gradients, the w staging copy) plus w·N / group under parameter offload, a quarter more and
HOST_SLACK_BYTES; the same bytes go to NVMe where the offload device is nvme.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..specs import Job
from ..units import GiB

#: outside torch's allocator: CUDA context and library workspaces (committed rows: process_gpu_bytes minus
#: peak_reserved_bytes is 0.75-0.8 GiB on the H200)
CONTEXT_BYTES = 3 * GiB // 2
#: the caching allocator's fragmentation, as a share of the summed terms (committed rows: reserved / allocated
#: up to 2.5 under ZeRO-3 with multi-GB gathers, which the doubled working set and largest block carry)
FRAGMENTATION = 0.25
HOST_SLACK_BYTES = 2 * GiB
#: bytes per norm element and token: fp32 input, fp32 normalised, the output (torch RMSNorm / LayerNorm in fp32)
NORM_BYTES = 12
#: optimizer bytes per trainable parameter beside a 16-bit parameter: fp32 master + states
OPTIMIZER_BYTES = {"adamw": 12, "torch_adamw": 12, "torch_adamw_fused": 12, "cpu_adam": 12, "lion": 8, "sgd": 8}


@dataclass(frozen=True)
class Bound:
    """The bound's terms (bytes, per GPU unless named host / nvme)."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    buckets_bytes: int
    activations_bytes: int
    loss_bytes: int
    masks_bytes: int
    largest_block_bytes: int
    init_bytes: int
    host_bytes: int
    nvme_bytes: int

    @property
    def summed_bytes(self) -> int:
        """The training step's terms summed, or the engine's initialisation where that is more."""
        return max(self.init_bytes, self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.buckets_bytes
                   + self.activations_bytes + self.loss_bytes + self.masks_bytes)

    @property
    def device_bytes(self) -> int:
        """The device total the sampler holds against its limit."""
        return int(self.summed_bytes * (1 + FRAGMENTATION)) + 2 * self.largest_block_bytes + CONTEXT_BYTES


def _modules(job: Job) -> tuple[int, int]:
    """(the largest module's parameters, the largest tensor's) on this GPU (tp: decoder layers split)."""
    from ..params import parameter_tensors

    out: dict[str, int] = {}
    tp = job.layout.tp
    largest = 0
    for t in parameter_tensors(job.model):
        module = t.name.rsplit(".", 1)[0]
        numel = t.numel // tp if t.layer is not None else t.numel
        out[module] = out.get(module, 0) + numel
        largest = max(largest, numel)
    return max(out.values()), largest


def _device_params(job: Job) -> tuple[int, int]:
    """(parameters on the most loaded GPU, its decoder layers' count)."""
    from ..params import parameter_tensors

    lay, m = job.layout, job.model
    per_layer = [0] * m.num_layers
    outside = 0
    for t in parameter_tensors(m):
        if t.layer is None:
            outside += t.numel  # embeddings, final norm, lm_head: whole (AutoTP and pipelines: bound)
        else:
            per_layer[t.layer] += t.numel // lay.tp
    layers = sorted(per_layer, reverse=True)[:math.ceil(m.num_layers / lay.pp)]  # pp: the heaviest stage
    return outside + sum(layers), len(layers)


def _trainable(job: Job, total: int) -> int:
    from .sample_cost import trainable_params

    return min(total, trainable_params(job, total))  # LoRA's adapters; frozen groups still count (a bound)


def _lora_bytes_per_token(job: Job, w: int) -> list[int]:
    """LoRA's activations per token of each layer: 2·r·w per adapted Linear (A's output, B's input) and, with
    dropout, (w + 1) bytes per input element (peft's lora_dropout(x) is a new tensor and its mask)."""
    m, lora = job.model, job.training.lora
    out = [0] * m.num_layers
    if lora is None:
        return out
    from ..params import linear_modules, parameter_tensors
    from ..peftconfig import resolve_targets

    try:
        adapted = set(resolve_targets(m.family, tuple(lora.targets), linear_modules(m)))
    except ValueError:
        adapted = set(linear_modules(m))
    for t in parameter_tensors(m):
        module = t.name.removesuffix(".weight")
        if t.layer is not None and module in adapted and len(t.shape) == 2:
            fan_in = t.shape[0] if m.family == "gpt2" else t.shape[1]  # GPT-2's Conv1D is (in, out)
            out[t.layer] += 2 * lora.rank * w + ((w + 1) * fan_in if lora.dropout > 0 else 0)
    return out


def _layer_bytes_per_token(job: Job, i: int, w: int, masked: bool) -> int:
    """Bytes decoder layer ``i`` keeps per token for its backward, LoRA aside (see the module docstring)."""
    m = job.model
    h, q, kv = m.hidden_size, m.q_dim, m.kv_dim
    norms = 2 + (2 if m.norm_placement == "sandwich" else 0) + (1 if m.norm_placement == "post" else 0)
    b = NORM_BYTES * h * norms + 2 * w * h  # norms, the residual stream
    if m.qk_norm:
        b += NORM_BYTES * (q + kv)
    b += w * (6 * q + 5 * kv + (2 * q if masked else 0))
    if m.kv_lora_rank is not None:  # MLA: q_a / kv_a latents and their norms, the expanded values
        latents = (m.q_lora_rank or 0) + m.kv_lora_rank + (m.qk_rope_head_dim or 0)
        b += (2 * w + NORM_BYTES) * latents + 3 * w * m.num_heads * (m.v_head_dim or m.head_dim)
    if m.is_moe_layer(i):
        ie = m.expert_intermediate_size
        b += 12 * m.num_experts + w * m.num_experts_per_tok * (2 * h + 5 * ie) + w * (5 * ie * m.n_shared_experts
                                                                                    + 2 * h)
    else:  # gated: gate, act, up, product, slack; ungated: fc, act, slack (GPT-2's python gelu_new keeps x³, tanh)
        b += w * (5 if m.gated_mlp else 6 if m.activation == "gelu_new" else 3) * m.intermediate_size
    if m.hidden_dropout > 0:
        b += 2 * (1 + w) * h
    if job.layout.sp > 1:
        b += 2 * 4 * (q + 2 * kv)
    return b


def _attention_scores_bytes(job: Job, w: int) -> int:
    """Eager attention's saved scores per layer and token: heads · seq · bytes per score."""
    m, t = job.model, job.training
    if t.attention != "eager":
        return 0
    # the fp32 softmax output and its w cast (LlamaAttention / BloomAttention: softmax(..., dtype=float32).to(dtype)),
    # dropout's mask and output, Gemma 2's soft-capped scores (tanh keeps its output)
    per_score = 4 + w + (1 + w if m.attention_dropout > 0 else 0) + (2 * w if m.attn_logit_softcapping else 0)
    return m.num_heads // job.layout.tp * t.seq_len * per_score


def _masked(job: Job) -> tuple[bool, int]:
    """(whether transformers hands attention a materialised mask, how many kinds of mask per forward)."""
    m, t = job.model, job.training
    if t.attention == "eager":
        return True, 2 if m.layer_types else 1
    sliding = m.sliding_window is not None and t.seq_len >= m.sliding_window and job.layout.sp == 1
    return sliding, (1 if sliding else 0)


def fit_bound(job: Job) -> Bound:
    """The pinned upper bound of ``job``'s per-GPU memory (and rank 0's host / NVMe share)."""
    m, t, lay, z = job.model, job.training, job.layout, job.training.zero
    w = 4 if t.dtype == "fp32" else 2
    n, n_layers = _device_params(job)
    nt = _trainable(job, n)
    zg = lay.zero_group
    opt = OPTIMIZER_BYTES.get(t.optimizer, 12) - (4 if w == 4 else 0)
    largest_module, largest_tensor = _modules(job)
    # model states
    on_gpu = z.offload_optimizer == "none"
    params = 0 if z.stage == 3 and z.offload_param != "none" else w * n // (zg if z.stage == 3 else 1)
    fp32 = 4 * nt // (zg if z.stage >= 1 else 1)  # one fp32 copy of the (partitioned) trainable parameters
    grads = w * nt // (zg if z.stage >= 2 else 1) + (fp32 if on_gpu else 0)
    optimizer = (opt * nt // (zg if z.stage >= 1 else 1) + fp32) if on_gpu else 0  # states, a step's temporaries
    # buckets and ZeRO-3's working set
    if z.stage in (1, 2):
        buckets = w * ((2 if z.overlap else 1) * min(z.reduce_bucket_size, nt) + min(z.allgather_bucket_size, n))
    elif z.stage == 3:
        from ..params import parameter_tensors

        working = min(n, z.stage3_max_live_parameters + z.stage3_prefetch_bucket_size + largest_module)
        persistent = sum(x.numel for x in parameter_tensors(m) if x.numel <= z.stage3_param_persistence_threshold)
        buckets = w * (2 * working + persistent + largest_module + min(z.reduce_bucket_size, nt))
    else:
        buckets = 0
    # activations
    tokens = t.micro_batch * t.seq_len // lay.sp
    masked, mask_kinds = _masked(job)
    scores = _attention_scores_bytes(job, w)
    every = [_layer_bytes_per_token(job, i, w, masked) + scores + lora
             for i, lora in enumerate(_lora_bytes_per_token(job, w))]
    per_layer = sorted(every, reverse=True)[:n_layers]  # a pipeline stage: its heaviest layers (a bound)
    top = per_layer[0]
    if t.checkpointing == "none":
        kept = sum(per_layer) + top
    else:
        kept = n_layers * w * m.hidden_size + 2 * top
    in_flight = min(lay.pp, t.grad_accum)  # 1F1B: stage 0 holds pp micro-batches before its first backward
    activations = in_flight * tokens * (kept + (NORM_BYTES + 2 * w) * m.hidden_size)
    v = m.vocab_size
    loss = tokens * v * (2 * w + 8 + (2 * w if m.final_logit_softcapping else 0) + (w if t.loop == "outputs" else 0))
    masks = mask_kinds * t.micro_batch * t.seq_len ** 2 * (w if t.attention == "eager" else 1)
    # the largest transient blocks: a gathered module, the fp32 logits, eager scores, an MLP intermediate
    largest = max(w * largest_tensor if z.stage == 3 else 0, 4 * tokens * v,
                  4 * t.micro_batch * m.num_heads * t.seq_len ** 2 if t.attention == "eager" else 0,
                  w * tokens * max(m.intermediate_size, m.expert_intermediate_size * m.num_experts_per_tok))
    # deepspeed.initialize under ZeRO 0-2 flattens the 16-bit parameters into a new buffer while the model's own
    # tensors still exist (stage_1_and_2.py / bf16_optimizer.py flatten_dense_tensors_aligned), then the fp32 copy
    init = 2 * w * n + (fp32 + opt * nt // (zg if z.stage >= 1 else 1) if on_gpu else 0) if z.stage < 3 else 0
    # host / NVMe: rank 0's share
    offloaded = 0
    if z.offload_optimizer != "none":
        offloaded += (opt + 4 + w) * nt // (zg if z.stage >= 1 else 1)
    off_params = w * n // zg if z.offload_param != "none" else 0
    host = nvme = 0
    if z.offload_optimizer == "cpu":
        host += offloaded
    elif z.offload_optimizer == "nvme":
        nvme += offloaded
    if z.offload_param == "cpu":
        host += off_params
    elif z.offload_param == "nvme":
        nvme += off_params
    host = int(host * 1.25) + (HOST_SLACK_BYTES if host else 0)
    return Bound(params_bytes=params, grads_bytes=grads, optimizer_bytes=optimizer, buckets_bytes=buckets,
                 activations_bytes=activations, loss_bytes=loss, masks_bytes=masks, largest_block_bytes=largest,
                 init_bytes=init, host_bytes=host, nvme_bytes=int(nvme * 1.25))


__all__ = ["CONTEXT_BYTES", "Bound", "fit_bound"]
