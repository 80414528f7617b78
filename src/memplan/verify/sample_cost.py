"""A rough model of how long one `memplan verify` job takes on one H200 (seconds), for batch budgets.

wall = process start + model build + DeepSpeed init + optimizer steps, each term a constant fitted by eye to
the committed rows (benchmarks/accuracy/rows*.jsonl record wall_s and each phase's wall_s; the test
tests/test_sample.py::test_cost_model_tracks_committed_wall_times holds the model to them within a factor).

- start: the interpreter importing torch, deepspeed and transformers, the meta-device parameter count, the
  report (committed rows: wall_s minus the summed phase walls is 6-10 s).
- init: CUDA context, deepspeed.initialize, the JIT ops loading (committed: the init phase takes 9-18 s on
  <= 2B models), plus the random initialisation of every parameter on the GPU (ZeRO-3 materialises each
  module once before partitioning it), plus for optimizer offload the CPU optimizer's setup and the pinning of
  rank 0's host partition (committed 7B ZeRO-3 offload rows: init 27-32 s).
- steps: steps × accumulation micro-steps of 6·N·T matmul FLOPs (fwd 2, bwd 4; 4 for a frozen base), the
  causal attention term 3·b·s²·q_dim·L/sp (doubled for eager attention), a recomputed forward under
  checkpointing, at TFLOPS of the dtype (a few hundred TFLOP/s: these are small, short jobs), plus a
  fixed first-step warm-up; per optimizer step the GPU optimizer, or CPU-Adam over rank 0's partition of the
  trainable parameters (committed offload rows: ~1 s per billion parameters per step on the shared host).
- ZeRO-3 fetches and releases every parameter tensor module by module in each forward, backward and
  recomputed forward: a fixed cost per tensor and pass (committed: the deep gpt2-xl / qwen3-0.6b ZeRO-3
  checkpointed rows spend 4 s per micro-step where a 16-layer Llama spends 1).
- ZeRO-3 parameter offload streams the 16-bit parameters in for every forward and backward.
- a pipeline emulated on one GPU runs two workers (its first and last stage) one after the other; real ranks
  (--launch) add torchrun's start; the Trainer loop adds the Trainer's own setup (a guess: no row yet).

The batch runs several jobs at once on one GPU; this model is one job alone (their GPU work serialises, their
start and init overlap).
"""

from __future__ import annotations

from ..specs import Job

START_S = 8.0
INIT_BASE_S = 10.0
BUILD_S_PER_GPARAM = 0.4
OFFLOAD_INIT_S = 6.0
PIN_BYTES_PER_S = 3e9
TFLOPS = {"bf16": 250e12, "fp16": 250e12, "fp32": 40e12}
FIRST_STEP_S = 1.5
GPU_OPT_STEP_S = 0.1
CPU_ADAM_S_PER_GPARAM = 1.2
#: host-to-device bandwidth of pinned copies (PCIe Gen5 x16, well below its 64 GB/s peak in practice)
H2D_BYTES_PER_S = 20e9
NVME_BYTES_PER_S = 2e9
Z3_S_PER_TENSOR_PASS = 1.5e-3
LAUNCH_S = 8.0
HF_TRAINER_S = 10.0


def _matmul_params(job: Job) -> tuple[int, int, int]:
    """(all parameters, parameters a token multiplies through, decoder-layer parameters)."""
    from ..params import parameter_tensors

    m = job.model
    tensors = parameter_tensors(m)
    total = sum(t.numel for t in tensors)
    embeddings = sum(t.numel for t in tensors if t.role in ("embedding", "position"))
    layers = sum(t.numel for t in tensors if t.layer is not None)
    tied_head = m.vocab_size * m.hidden_size if m.tie_word_embeddings else 0
    matmul = total - embeddings + tied_head
    if m.num_experts:
        routed = sum(t.numel for t in tensors if t.layer is not None and ".experts." in t.name)
        active = routed * m.num_experts_per_tok // m.num_experts
        matmul -= routed - active
        layers -= routed - active
    return total, matmul, layers


def _tensor_count(job: Job) -> int:
    from ..params import parameter_tensors

    return len(parameter_tensors(job.model))


def _trainable_params(job: Job, total: int) -> int:
    """Parameters the optimizer steps: LoRA's adapters, else all (frozen groups ignored: an upper bound)."""
    lora = job.training.lora
    if lora is None:
        return total
    from ..params import linear_modules, parameter_tensors
    from ..peftconfig import resolve_targets

    try:
        chosen = set(resolve_targets(job.model.family, tuple(lora.targets), linear_modules(job.model)))
    except ValueError:
        return total
    shapes = {t.name.removesuffix(".weight"): t.shape for t in parameter_tensors(job.model)}
    return sum(lora.rank * sum(shapes[name]) for name in chosen if name in shapes)


def predicted_wall_s(job: Job, *, launch: bool = False, hf_trainer: bool = False, steps: int = 3,
                     host_bytes: int = 0) -> tuple[float, dict[str, float]]:
    """(seconds, the terms) for one verify job; ``host_bytes``: rank 0's pinned host bytes (offload)."""
    t, lay, z = job.training, job.layout, job.training.zero
    total, matmul, layer_params = _matmul_params(job)
    trainable = _trainable_params(job, total)
    init = INIT_BASE_S + BUILD_S_PER_GPARAM * total / 1e9
    if z.offload_optimizer != "none" or z.offload_param != "none":
        init += OFFLOAD_INIT_S + host_bytes / PIN_BYTES_PER_S
    tokens = t.micro_batch * t.seq_len // lay.sp
    train_factor = 6 if trainable == total else 4
    flops = train_factor * matmul * tokens
    attention = 3 * t.micro_batch * t.seq_len**2 * job.model.q_dim * job.model.num_layers / lay.sp
    if t.attention == "eager":
        attention *= 2
    flops += attention
    if t.checkpointing != "none":
        flops += 2 * layer_params * tokens + attention / 3
    flops /= lay.tp * lay.pp
    micro = steps * t.grad_accum
    compute = FIRST_STEP_S + micro * flops / TFLOPS[t.dtype]
    passes = 3 if t.checkpointing != "none" else 2
    if z.stage == 3:
        compute += micro * passes * _tensor_count(job) * Z3_S_PER_TENSOR_PASS
    if z.offload_param != "none":
        compute += micro * passes * 2 * total / max(1, lay.zero_group if z.stage == 3 else 1) / H2D_BYTES_PER_S
    part = trainable / (lay.zero_group if z.stage >= 1 else 1)
    if z.offload_optimizer != "none":
        step = steps * (CPU_ADAM_S_PER_GPARAM * part / 1e9 + 4 * part / H2D_BYTES_PER_S)
        if z.offload_optimizer == "nvme":
            step += steps * 2 * 12 * part / NVME_BYTES_PER_S
    else:
        step = steps * GPU_OPT_STEP_S
    terms = {"start_s": START_S, "init_s": init, "compute_s": compute, "optimizer_s": step}
    if launch:
        terms["launch_s"] = LAUNCH_S
    if hf_trainer:
        terms["hf_trainer_s"] = HF_TRAINER_S
    if lay.pp > 1 and not launch:
        terms = {k: 2 * v for k, v in terms.items()}  # the first and the last stage, one after the other
    terms = {k: round(v, 2) for k, v in terms.items()}
    return round(sum(terms.values()), 1), terms


__all__ = ["predicted_wall_s"]
