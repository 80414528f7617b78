"""The article's job under both implementations: transformers' GPT-2 and Megatron-DeepSpeed's GPT.

The article launches Megatron-DeepSpeed's pretrain_gpt.py; memplan's other figures count transformers'
GPT-2 (modeling_gpt2.py). Same job (the nearest valid variant: ZeRO-3, sp 8, fp16, optimizer offloaded to the
CPU, seq 32768, 8 GPUs), both implementations, per GPU; then what one layer keeps per token under each, term
by term (memplan.estimator.activations and memplan.megatron).
"""

from __future__ import annotations

from ..estimator.activations import layer_terms as transformers_layer_terms
from ..megatron import layer_terms as megatron_layer_terms
from ..megatron import tokens_per_rank
from ..result import Estimate
from ..specs import Job, MegatronSpec
from ..units import dtype_bytes
from .doc import Block, Bullets, Heading, Para, Table
from .page import gib, verdict
from .seed_data import estimate_on_a100
from .series import variant

#: the launch as written: --deepspeed without --no-pipeline-parallel (GPTModelPipe), no flash flag
AS_LAUNCHED = MegatronSpec()
#: as Megatron-DeepSpeed's Ulysses examples run it (examples_deepspeed/sequence_parallel/
#: ds_pretrain_gpt_1.3B_seq_parallel_32k.sh: --no-pipeline-parallel, a flash-attention flag)
AS_EXAMPLES = MegatronSpec(pipeline_engine=False)


def megatron_job(job: Job, spec: MegatronSpec, attention: str, checkpointing: str | None = None) -> Job | None:
    """``job`` built by Megatron-DeepSpeed with ``spec``."""
    training = {"model_impl": "megatron", "megatron": spec.model_dump(), "attention": attention}
    if checkpointing:
        training["checkpointing"] = checkpointing
    return variant(job, training=training)


def _activations(e: Estimate) -> int:
    return sum(p.bytes for p in e.components if p.name == "activations")


def _row(label: str, impl: str, e: Estimate) -> tuple[str, ...]:
    return (label, impl, gib(e.peak_allocated_bytes), gib(_activations(e)), gib(e.device_total_bytes),
            verdict(e.fits_target, e.target_bytes, e.device_total_bytes),
            verdict(e.fits_gpu, e.gpu_bytes, e.device_total_bytes))


def _per_token(terms) -> int:
    return sum(t.bytes_per_token for t in terms)


def section_megatron(sp8: Job) -> list[Block]:
    """(e) the verdict for Megatron's GPT beside transformers' GPT-2, and the per-layer difference."""
    flash_tf = variant(sp8, training={"attention": "flash"})
    full_tf = variant(sp8, training={"attention": "flash", "checkpointing": "full"})
    cases = [
        ("as launched (GPTModelPipe, no flash flag: CoreAttention)", None, megatron_job(sp8, AS_LAUNCHED, "eager")),
        ("--no-pipeline-parallel, no flash flag", variant(sp8, training={"attention": "eager"}),
         megatron_job(sp8, AS_EXAMPLES, "eager")),
        ("--no-pipeline-parallel --use-flash-attn-v2", flash_tf, megatron_job(sp8, AS_EXAMPLES, "flash")),
        ("… and --checkpoint-activations", full_tf, megatron_job(sp8, AS_EXAMPLES, "flash", "full")),
    ]
    rows = []
    for label, tf, meg in cases:
        if tf is not None:
            rows.append(_row(label, "transformers GPT-2", estimate_on_a100(tf)))
        if meg is not None:
            rows.append(_row(label, "Megatron-DeepSpeed GPT", estimate_on_a100(meg)))
    blocks: list[Block] = [
        Heading("(e) The same job under Megatron-DeepSpeed's GPT", 2),
        Para("The article runs Megatron-DeepSpeed's pretrain_gpt.py, not transformers' GPT-2. Per GPU, the "
             "nearest valid variant (ZeRO-3, sp 8, fp16, optimizer offloaded to the CPU, seq 32768, 8 GPUs) under "
             "both implementations (`memplan estimate --model-impl transformers|megatron`):"),
        Table(("launch", "implementation", "peak allocated", "activations", "device total", "vs 24 GiB",
               "vs A100-80GB"), tuple(rows), align_right=(2, 3, 4)),
    ]
    return blocks + _why(flash_tf, megatron_job(sp8, AS_EXAMPLES, "flash"), megatron_job(sp8, AS_LAUNCHED, "eager"))


def _why(tf: Job | None, meg: Job | None, launched: Job | None) -> list[Block]:
    """What one layer keeps per token under each implementation, and why."""
    if tf is None or meg is None:
        return []
    m, t = tf.model, tf.training
    b = dtype_bytes(t.dtype)
    tf_terms = transformers_layer_terms(m, b, t.attention, t.seq_len, tf.layout.sp > 1)
    meg_terms = megatron_layer_terms(meg.model, meg)
    h = m.hidden_size
    gelu_tf = sum(x.bytes_per_token for x in tf_terms if x.name.startswith(("mlp.gelu", "mlp.act")))
    gelu_meg = sum(x.bytes_per_token for x in meg_terms if x.name == "mlp.gelu_input")
    lines = [
        (f"One layer with flash attention keeps {_per_token(tf_terms) / h:.1f} bytes per token·hidden under "
         f"transformers' GPT-2 and {_per_token(meg_terms) / h:.1f} under Megatron-DeepSpeed's GPT "
         "(estimator/activations.py, memplan.megatron.layer)."),
        (f"The activation: GPT-2's Python NewGELU keeps x, tanh(·), 0.5·x and 1 + tanh(·), "
         f"{gelu_tf / h:.0f} bytes per token·hidden; Megatron's fused bias-GeLU (fused_bias_gelu.py GeLUFunction) "
         f"keeps its input only, {gelu_meg / h:.0f}."),
        ("Megatron-DeepSpeed's apex LayerNorm is memory-efficient by default: it keeps its output (already the "
         "next linear's input) and not its input, 2·2 bytes per token·hidden less per layer."),
        ("Megatron makes contiguous q, k, v copies for flash-attn ([b, s, np, hn]) where transformers' GPT-2 "
         "keeps the fused c_attn output; both keep the kernel's output and log-sum-exp."),
    ]
    if launched is not None:
        lines.append(
            f"As launched, pretrain_gpt.py builds GPTModelPipe (no --no-pipeline-parallel), whose get_batch_pipe "
            f"does not cut the sequence over the sp ranks: each rank runs {tokens_per_rank(launched):,} tokens, "
            "and without a flash flag CoreAttention materialises [b, heads/sp, sp·s, sp·s] scores after the "
            "all-to-all. This is read from the code, not measured.")
    return [Para("What differs, per layer:"), Bullets(tuple(lines))]
