"""What one Megatron GPT layer saves for backward, tensor by tensor, per token of this rank (T).

Megatron-DeepSpeed (microsoft/Megatron-DeepSpeed f4157bea) megatron/model/transformer.py:
ParallelTransformerLayer.forward = input_layernorm → ParallelAttention (query_key_value ColumnParallelLinear →
CoreAttention or FlashSelfAttention, inside DeepSpeed's DistributedAttention under Ulysses → dense
RowParallelLinear) → bias_dropout_add → post_attention_layernorm → ParallelMLP (dense_h_to_4h → bias_gelu_impl
→ dense_4h_to_h) → bias_dropout_add. megatron-core 0.16.1's TransformerLayer with get_gpt_layer_local_spec is
the same chain (SelfAttention, DotProductAttention, MLP, get_bias_dropout_add). A linear saves its input
(megatron/core/tensor_parallel/layers.py LinearWithGradAccumulationAndAsyncCommunication.forward:
ctx.save_for_backward(input, weight); with --sequence-parallel the input is this rank's T/t shard and the
all-gathered [T, h] lives in the global memory buffer, outside.py). Symbols in shape.py.
"""

from __future__ import annotations

from ..estimator.activations import DROPOUT_MASK_BYTES, LN_STATS_BYTES, Term
from ..specs import Job, ModelSpec
from .shape import Shape, resolve, split

#: apex's fused LayerNorm / RMSNorm save invvar (and mean unless memory-efficient) as fp32 [T]
#: (apex csrc/layer_norm_cuda.cpp: U = float for half inputs)
INVVAR_BYTES = 4
#: FlashAttention's softmax_lse is fp32 [b, heads, S] (flash_attn_interface.py _flash_attn_varlen_forward;
#: torch's _scaled_dot_product_flash_attention returns the same logsumexp)
LSE_BYTES = 4
#: megatron's scaled_upper_triang_masked_softmax kernel takes sk up to 4096 (fused_softmax.py
#: FusedScaleMaskSoftmax.is_kernel_available: 16 < sk <= 4096, sq and sk and b·np multiples of 4)
FUSED_SOFTMAX_MAX_SK = 4096


def attention_path(model: ModelSpec, job: Job) -> str:
    """Which attention code runs: 'flash' (FlashSelfAttention / -Triton, --use-flash-attn*), 'fused-softmax'
    (CoreAttention with the fused scale-mask-softmax kernel) or 'torch-softmax' (CoreAttention's
    forward_torch_softmax fallback). Megatron has no sdpa path: eager and sdpa both mean CoreAttention."""
    t = job.training
    if t.attention == "flash":
        return "flash"
    s = resolve(model, job)
    heads_here = s.nh // (s.tp * s.sp)
    if (t.megatron.masked_softmax_fusion and s.b == 2 and 16 < s.seq_in <= FUSED_SOFTMAX_MAX_SK
            and s.seq_in % 4 == 0 and (s.micro * heads_here) % 4 == 0):
        return "fused-softmax"
    return "torch-softmax"


def _norm(s: Shape, job: Job, name: str, input_owned: bool) -> list[Term]:
    """A layer norm's saved tensors. Megatron-DeepSpeed on CUDA: apex MixedFusedLayerNorm
    (fused_layer_norm.py, FusedLayerNormAffineFunction with memory_efficient=mem_efficient_ln) saves its
    output (shared with the next linear's input) and invvar, or its input, mean and invvar; apex
    MixedFusedRMSNorm saves input and invvar. megatron-core's local spec: torch.nn.LayerNorm (WrappedTorchNorm;
    aten native_layer_norm saves input, mean, rstd fp32). ``input_owned``: the input is a tensor only this
    norm keeps (the residual stream), so saving it costs bytes."""
    meg = job.training.megatron
    apex = meg.codebase == "megatron-deepspeed"
    if s.rmsnorm:
        terms = [Term(f"{name}.invvar", split(INVVAR_BYTES, s.r), f"[T/r] fp32 ({name})")]
        return ([Term(f"{name}.input", split(s.b * s.h, s.r), "[T/r, h]")] if input_owned else []) + terms
    if apex and meg.mem_efficient_ln:
        return [Term(f"{name}.invvar", split(INVVAR_BYTES, s.r), "[T/r] fp32; the output is saved as the next "
                     "linear's input (memory-efficient LayerNorm)")]
    terms = [Term(f"{name}.stats", split(LN_STATS_BYTES, s.r), "mean, invvar [T/r] fp32")]
    return ([Term(f"{name}.input", split(s.b * s.h, s.r), "[T/r, h] (the residual stream)")] if input_owned
            else []) + terms


def _flash(s: Shape, job: Job) -> list[Term]:
    """FlashSelfAttention (transformer.py): ParallelAttention.forward makes q, k, v contiguous [b, s, np, hn]
    copies of the fused projection's slices (rearrange(...).contiguous(); k, v after repeat_kv), the kernel
    saves q, k, v, out and softmax_lse; out is rearranged to [s, b, hp] (.contiguous() copies only when b > 1)
    for the dense projection. Under Ulysses, DistributedAttention (deepspeed/sequence/layer.py _SeqAllToAll,
    which saves nothing) hands the kernel the all-to-all outputs and the dense projection the reverse
    all-to-all's output; the fused projection and the copies are freed."""
    q, b, t = s.q, s.b, s.tp
    terms = [Term("attn.q_k_v", 3 * b * q // t, "q, k, v [T, q/t] each (contiguous copies / all-to-all outputs)"),
             Term("attn.flash_out", b * q // t, "kernel output [T, q/t]"),
             Term("attn.softmax_lse", LSE_BYTES * s.nh // t, "[nh/t, S_in] fp32 (per token: nh/t)")]
    if s.sp > 1 or s.micro > 1:
        why = "reverse all-to-all output" if s.sp > 1 else "rearrange(...).contiguous() copy (b > 1)"
        terms.append(Term("attn.dense_input", b * q // t, f"[T, q/t] {why}"))
    return terms


def _softmax_region(s: Shape, job: Job, path: str) -> list[Term]:
    """CoreAttention's score-sized tensors [b, np, S_in, S_in] (per token: nh·S_in/t elements).

    fused: ScaledUpperTriangMaskedSoftmax saves its output in the training dtype. torch fallback
    (forward_torch_softmax): input.float(), masked_fill_ (saves the shared mask, outside.py), softmax saves its
    fp32 output, .half()/.bfloat16() makes the probabilities. Attention dropout > 0: native_dropout saves a bool
    mask and bmm saves its output; at p = 0 dropout returns its input and bmm saves the probabilities."""
    meg, b = job.training.megatron, s.b
    elems = s.nh * s.seq_in // s.tp
    terms = []
    if path == "fused-softmax":
        # at p = 0 the kernel's output is also bmm's input: one tensor
        terms.append(Term("attn.softmax_out", b * elems, "fused kernel output [b, np, S_in, S_in]"))
    elif meg.attention_softmax_in_fp32 and b != 4:
        terms.append(Term("attn.softmax_out_fp32", 4 * elems, "softmax output [b, np, S_in, S_in] fp32"))
        if meg.attention_dropout == 0:
            terms.append(Term("attn.probs", b * elems, "softmax cast to the training dtype (bmm's input)"))
    else:
        terms.append(Term("attn.softmax_out", b * elems, "softmax output [b, np, S_in, S_in]"))
    if meg.attention_dropout > 0:
        terms += [Term("attn.dropout_mask", DROPOUT_MASK_BYTES * elems, "bool [b, np, S_in, S_in]"),
                  Term("attn.probs_dropped", b * elems, "dropout output (bmm's input)")]
    return terms


def _core(s: Shape, job: Job, path: str) -> list[Term]:
    """CoreAttention / DotProductAttention: baddbmm saves q and k, bmm saves v and the probabilities; q, k, v
    are views of the fused projection output [T, (q+2kv)/t] (Megatron-DeepSpeed slices it into q|k|v,
    megatron-core splits per query group), so its whole storage stays; repeat_kv / repeat_interleave copies k
    and v for grouped-query attention; rotary embeddings make new q and k. The context is made contiguous
    ([b, np, sq, hn] → [sq, b, hp]) for the dense projection. Under Ulysses the all-to-all outputs replace
    the fused projection."""
    b, t, q, kv = s.b, s.tp, s.q, s.kv
    if s.sp > 1:
        qkv = [Term("attn.q_k_v", 3 * b * q // t, "all-to-all outputs q, k, v [T, q] (DistributedAttention)")]
    else:
        qkv = [Term("attn.qkv_fused", b * (q + 2 * kv) // t, "fused projection output [T, (q+2kv)/t]; q, k, v "
                    "are views")]
        if kv != q:
            qkv.append(Term("attn.kv_repeated", 2 * b * q // t, "repeat_kv(k), repeat_kv(v) [T, q/t]"))
        if s.rope:
            qkv.append(Term("attn.qk_rotary", 2 * b * q // t, "apply_rotary_pos_emb(q), (k) [T, q/t]"))
    return qkv + _softmax_region(s, job, path) + [
        Term("attn.dense_input", b * q // t, "context.permute(2, 0, 1, 3).contiguous() [T, q/t]")]


def _mlp(s: Shape) -> list[Term]:
    """ParallelMLP / megatron-core MLP: dense_h_to_4h's output goes to bias_gelu_impl (fused_bias_gelu.py
    GeLUFunction.forward: ctx.save_for_backward(input, bias)) or, with --no-bias-gelu-fusion, bias add then
    F.gelu (saves its input): either way one [T, I/t] tensor; dense_4h_to_h saves the GeLU output. --swiglu
    (gated): chunk views of [T, 2I/t], F.silu saves x[0] (the whole fc1 output stays), the product saves
    silu(x[0]) and x[1]."""
    b, t, i = s.b, s.tp, s.ffn
    if s.gated:
        act = [Term("mlp.fc1_out", 2 * b * i // t, "dense_h_to_4h output [T, 2I/t] (chunk views saved)"),
               Term("mlp.silu_out", b * i // t, "silu(x[0]) [T, I/t]")]
    else:
        act = [Term("mlp.gelu_input", b * i // t, "bias_gelu_impl / F.gelu input [T, I/t]")]
    return act + [Term("mlp.fc2_input", b * i // t, "GeLU output, dense_4h_to_h's input [T, I/t]")]


def layer_terms(model: ModelSpec, job: Job) -> tuple[Term, ...]:
    """Every tensor one Megatron GPT layer keeps for backward, per token of this rank (T)."""
    s = resolve(model, job)
    meg = job.training.megatron
    path = attention_path(model, job)
    # the norm's output is the next linear's input; the memory-efficient LayerNorm saves exactly that tensor
    ln_saves_input = not (meg.codebase == "megatron-deepspeed" and meg.mem_efficient_ln and not s.rmsnorm)
    mask = ([Term("dropout_mask", DROPOUT_MASK_BYTES * s.h // s.r, "bias_dropout_add bool [T/r, h]")]
            if meg.hidden_dropout > 0 else [])
    attn = _flash(s, job) if path == "flash" else _core(s, job, path)
    return tuple(
        _norm(s, job, "input_layernorm", ln_saves_input)
        + [Term("attn.qkv_input", split(s.b * s.h, s.r), "input_layernorm output [T/r, h] (query_key_value)")]
        + attn + mask
        + _norm(s, job, "post_attention_layernorm", ln_saves_input)
        + [Term("mlp.fc1_input", split(s.b * s.h, s.r), "post_attention_layernorm output [T/r, h]")]
        + _mlp(s) + [Term(f"{t.name}.mlp", t.bytes_per_token, t.detail) for t in mask]
    )


#: what selective recompute drops: Megatron-DeepSpeed checkpoints CoreAttention only (ParallelAttention:
#: checkpoint_core_attention, not on the flash or Ulysses paths); megatron-core checkpoints core_attention
#: (recompute_modules ["core_attn"]) whatever module it is
SELECTIVE_DROPPED = ("attn.softmax_out", "attn.softmax_out_fp32", "attn.probs", "attn.dropout_mask",
                     "attn.probs_dropped")


def selective_terms(model: ModelSpec, job: Job) -> tuple[Term, ...]:
    """layer_terms under --recompute-granularity selective: the core attention is recomputed in backward, so
    only its inputs (q, k, v) and its output (the dense projection's input) stay."""
    terms = layer_terms(model, job)
    meg = job.training.megatron
    path = attention_path(model, job)
    if path != "flash":
        if job.layout.sp > 1 and meg.codebase == "megatron-deepspeed":
            return terms  # DistributedAttention replaces the checkpointed call (transformer.py)
        return tuple(x for x in terms if x.name not in SELECTIVE_DROPPED)
    if meg.codebase == "megatron-deepspeed":
        return terms  # FlashSelfAttention is never checkpointed there
    # megatron-core: tensor_parallel.checkpoint(core_attention, q, k, v, ...) keeps its inputs, the views of the
    # fused projection, instead of the kernel's copies, output and lse
    s = resolve(model, job)
    kept = [x for x in terms if x.name not in ("attn.q_k_v", "attn.flash_out", "attn.softmax_lse")]
    at = next(i for i, x in enumerate(kept) if x.name == "attn.qkv_input") + 1
    kept.insert(at, Term("attn.qkv_fused", s.b * (s.q + 2 * s.kv) // s.tp,
                         "fused projection output [T, (q+2kv)/t], the checkpoint's saved inputs"))
    if not any(x.name == "attn.dense_input" for x in kept):
        kept.insert(at + 1, Term("attn.dense_input", s.b * s.q // s.tp, "the checkpoint's output [T, q/t]"))
    return tuple(kept)


def layer_input_bytes_per_token(model: ModelSpec, job: Job) -> int:
    """What a fully recomputed layer keeps: its input [T/r, h] (split over tp by --distribute-saved-activations
    or DeepSpeed's --partition-activations; on the host with --checkpoint-in-cpu)."""
    s = resolve(model, job)
    meg = job.training.megatron
    if meg.deepspeed_activation_checkpointing and meg.checkpoint_in_cpu:
        return 0
    parts = s.r
    if meg.distribute_saved_activations or (meg.deepspeed_activation_checkpointing and meg.partition_activations):
        parts = s.tp * s.r
    return split(s.b * s.h, parts)


#: the score-sized tensors CoreAttention saves (forward order: they follow what the layer saved before the score
#: matmul, and precede the dense projection's input)
SCORE_TERMS = ("attn.softmax_out", "attn.softmax_out_fp32", "attn.probs", "attn.dropout_mask", "attn.probs_dropped")


def before_scores_bytes_per_token(terms: tuple[Term, ...]) -> int:
    """What a layer has saved when CoreAttention's score matmul runs: the terms before the first score term
    (layer_terms' order is the forward's)."""
    out = 0
    for x in terms:
        if x.name in SCORE_TERMS or x.name == "attn.dense_input":
            break
        out += x.bytes_per_token
    return out


def score_peak_bytes_per_token(model: ModelSpec, job: Job) -> tuple[int, int]:
    """(forward, backward) score-sized bytes alive at once at CoreAttention's peaks, per token of this rank, from
    megatron-core 0.16.1 dot_product_attention.py DotProductAttention.forward and fused_softmax.py
    forward_torch_softmax; 0 on the flash path.

    Forward, at ``probs.bfloat16()`` (grad mode or not): baddbmm's output (its ``beta=0`` input is the global
    memory buffer, outside.py; matmul_result / attention_scores stay referenced until forward returns), the fp32
    copy ``input.float()`` (forward_torch_softmax's ``input`` until it returns; masked_fill_ works in place),
    softmax's fp32 output and the 16-bit probabilities: b + 4 + 4 + b. Under no_grad (a fully recomputed
    layer's first forward, selective's checkpointed core attention) the same four are alive. fp32 training: no
    copy, no cast (4 + 4); 16-bit softmax or the fused kernel: scores and output (2b).

    Backward, in _softmax_backward_data on CUDA (SoftMax.cu softmax_backward_cuda_out): the saved fp32 output,
    the incoming fp32 grad (ToCopyBackward of the cast), the new grad and ``tmp = grad * output``: 4 · 4 (the
    16-bit probabilities are freed with bmm's backward; measured: benchmarks/megatron/traces/); 16-bit: 4b;
    the fused kernel's backward writes in place: 2b. (The CPU kernel has no tmp: tools/megatron_cpu_peaks.py
    reads 4 bytes an element less there.)"""
    path = attention_path(model, job)
    if path == "flash":
        return 0, 0
    s = resolve(model, job)
    meg, b = job.training.megatron, s.b
    elems = s.nh * s.seq_in // s.tp
    if path == "fused-softmax":
        return 2 * b * elems, 2 * b * elems
    if meg.attention_softmax_in_fp32 or b == 4:
        fwd = (4 + 4) if b == 4 else (b + 4 + 4 + b)
        return fwd * elems, 16 * elems
    return 2 * b * elems, 4 * b * elems
