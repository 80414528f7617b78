"""One megatron-core measurement: `python -m memplan.verify.megatron_worker TASK.json`.

TASK.json (written by memplan.verify.megatron_runner): case (memplan.megatron.harness.MegatronCase fields),
device ("cuda" or "cpu"), out (the row's path). Builds megatron-core's GPTModel with the local layer spec
(get_gpt_layer_local_spec: no Transformer Engine, no apex) inside Float16Module, rank 0 of a tp group on
torch's fake process group (as memplan.verify.worker.setup_distributed does), and runs ``micro_steps``
forward + backward micro-steps on random tokens. Per phase: torch.cuda.max_memory_allocated after
reset_peak_memory_stats; per layer: memory_allocated after − before its forward (micro-step 0), and the bytes
of the tensors autograd saved inside it (torch.autograd.graph.saved_tensors_hooks, parameters excluded, each
storage counted once: this also runs on the CPU).

Two substitutions, both named in the row: with flash, the core attention is FlashCoreAttention, which does
what Megatron-DeepSpeed's ParallelAttention + FlashSelfAttention do around the kernel (contiguous
[b, s, np, hn] copies of q, k, v; the kernel; the output back to [s, b, hp]) with torch's FlashAttention
kernel (scaled_dot_product_attention under SDPBackend.FLASH_ATTENTION; the flash-attn package is not on the GPU
machine); with --sequence-parallel the norms are torch.nn.LayerNorm marked sequence_parallel (megatron-core's
WrappedTorchNorm refuses sequence_parallel without apex; the saved tensors are torch LayerNorm's either way).
On the CPU, megatron-core's CUDA-only helpers are replaced: torch.cuda.current_device() names the CPU and the
CUDA RNG tracker's fork is a no-op (cpu_shims).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from typing import Any

from ..megatron.harness import MegatronCase, case_job
from ..megatron.shape import padded_vocab
from .envinfo import environment, write_json_atomic


def megatron_core_version() -> str | None:
    """The installed megatron-core's version (None when absent)."""
    try:
        from importlib.metadata import version

        return version("megatron-core")
    except Exception:  # noqa: BLE001 - absent or unreadable metadata
        return None


def cpu_shims() -> None:
    """Let megatron-core run on the CPU (this process only): its buffers are allocated on
    torch.cuda.current_device() (GlobalMemoryBuffer.get_tensor, the sequence-parallel gathers and scatters in
    tensor_parallel/mappings.py), which then names the CPU, and get_cuda_rng_tracker().fork(), which swaps CUDA
    RNG states, does nothing; a checkpoint stores and restores the CPU RNG state only (random.py
    _get_all_rng_states / _set_all_rng_states)."""
    import megatron.core.tensor_parallel as tp_pkg
    import megatron.core.tensor_parallel.random as tp_random
    import torch

    class _NoFork:
        def fork(self, name: str = ""):
            return contextlib.nullcontext()

    torch.cuda.current_device = lambda: "cpu"
    tp_pkg.get_cuda_rng_tracker = tp_random.get_cuda_rng_tracker = lambda *a, **k: _NoFork()
    tp_random._get_all_rng_states = lambda: (torch.get_rng_state(),)
    tp_random._set_all_rng_states = lambda cpu_state, *cuda_states: torch.set_rng_state(cpu_state)


def setup(case: MegatronCase, device: str) -> None:
    """Fake process group of world tp (this process is rank 0) and megatron-core's parallel state."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(case.tp), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=case.tp)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=case.tp, create_gloo_process_groups=False)
    if device == "cuda":
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    else:
        cpu_shims()
    torch.manual_seed(1234)


def flash_core_attention_class():
    """FlashCoreAttention: megatron-core's core-attention interface around torch's FlashAttention kernel, laid
    out as Megatron-DeepSpeed's ParallelAttention.forward / FlashSelfAttention.forward lay it out."""
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.transformer.module import MegatronModule
    from torch.nn.attention import SDPBackend, sdpa_kernel

    class FlashCoreAttention(MegatronModule):
        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, cp_comm_type=None, pg_collection=None):
            super().__init__(config=config)
            self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
            self.softmax_scale = softmax_scale
            assert config.num_query_groups in (None, config.num_attention_heads), "FlashCoreAttention: MHA only"

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            sq, b, np_, hn = query.shape
            # ParallelAttention: [rearrange(x, 's b ... -> b s ...').contiguous() for x in (q, k, v)]
            q, k, v = [x.permute(1, 0, 2, 3).contiguous() for x in (query, key, value)]
            fork = (contextlib.nullcontext() if self.config.sequence_parallel
                    else tensor_parallel.get_cuda_rng_tracker().fork())
            with fork, sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                    dropout_p=self.dropout_p if self.training else 0.0, scale=self.softmax_scale)
            # rearrange(out, 'b s h d -> s b (h d)').contiguous()
            out = out.transpose(1, 2).permute(1, 0, 2, 3).contiguous()
            return out.view(sq, b, np_ * hn)

    return FlashCoreAttention


def sp_layer_norm_class():
    """torch.nn.LayerNorm with megatron-core's norm signature, its parameters marked sequence_parallel."""
    import torch

    class SequenceParallelTorchLayerNorm(torch.nn.LayerNorm):
        def __init__(self, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
                     normalization="LayerNorm"):
            super().__init__(hidden_size, eps=eps)
            for p in self.parameters():
                p.sequence_parallel = True

    return SequenceParallelTorchLayerNorm


def config_of(case: MegatronCase, device: str):
    """megatron-core's TransformerConfig for the case (fusions on where the local spec has them; the fused
    softmax kernel needs apex or Transformer Engine, so masked_softmax_fusion is off)."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if case.dtype == "bf16" else torch.float16
    recompute = {} if case.checkpointing == "none" else {"recompute_granularity": case.checkpointing}
    if case.checkpointing == "full":
        recompute.update(recompute_method=case.recompute_method, recompute_num_layers=case.recompute_num_layers)
    return TransformerConfig(
        num_layers=case.layers, hidden_size=case.hidden, num_attention_heads=case.heads,
        ffn_hidden_size=case.ffn or 4 * case.hidden, tensor_model_parallel_size=case.tp,
        sequence_parallel=case.sequence_parallel, hidden_dropout=case.hidden_dropout,
        attention_dropout=case.attention_dropout, bf16=case.dtype == "bf16", fp16=case.dtype == "fp16",
        params_dtype=dtype, pipeline_dtype=dtype, use_cpu_initialization=device == "cpu",
        masked_softmax_fusion=False, bias_activation_fusion=True, bias_dropout_fusion=True,
        apply_query_key_layer_scaling=False, attention_softmax_in_fp32=True, **recompute)


def build(case: MegatronCase, device: str):
    """GPTModel (local spec, learned positions, tied output layer) inside Float16Module."""
    import megatron.core.transformer.transformer_block as block
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module

    config = config_of(case, device)
    spec = get_gpt_layer_local_spec()
    if case.sequence_parallel:
        norm = sp_layer_norm_class()
        spec.submodules.input_layernorm = norm
        spec.submodules.pre_mlp_layernorm = norm
        block.LayerNormImpl = norm
    if case.flash:
        spec.submodules.self_attention.submodules.core_attention = flash_core_attention_class()
    model = GPTModel(config, spec, vocab_size=padded_vocab(case.vocab, case.tp), max_sequence_length=case.seq,
                     position_embedding_type="learned_absolute", parallel_output=True,
                     share_embeddings_and_output_weights=True)
    model = Float16Module(config, model)
    # megatron-core builds its parallel layers on the current CUDA device, but the learned position embedding
    # (LanguageModelEmbedding.position_embeddings, a torch.nn.Embedding) on the CPU: Megatron's trainer moves
    # every module afterwards (megatron/training/training.py get_model: model_module.cuda(...)), and so do we
    # (the first GPU run failed in F.embedding with the index on cuda:0 and the weight on the CPU).
    return model.to(device)


class Meter:
    """Peak and current allocated bytes (CUDA); None on the CPU."""

    def __init__(self, device: str):
        import torch

        self.cuda = device == "cuda"
        self.torch = torch

    def now(self) -> int | None:
        return self.torch.cuda.memory_allocated() if self.cuda else None

    def reset(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int | None:
        if not self.cuda:
            return None
        self.torch.cuda.synchronize()
        return self.torch.cuda.max_memory_allocated()


class LayerProbe:
    """Forward hooks on each decoder layer (memory_allocated before/after) and a saved-tensors hook that
    charges each saved storage, once, to the layer running when autograd saved it ('outside' otherwise)."""

    def __init__(self, model, meter: Meter):
        import torch

        self.meter = meter
        self.current = "outside"
        self.saved: dict[int, tuple[str, int]] = {}
        self.deltas: list[int | None] = []
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        inner = model.module
        self.handles = []
        for i, layer in enumerate(inner.decoder.layers):
            self.handles.append(layer.register_forward_pre_hook(self._pre(i)))
            self.handles.append(layer.register_forward_hook(self._post(i)))
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._before: int | None = None

    def _pre(self, i):
        def hook(module, args):
            self.current = f"layer{i}"
            self._before = self.meter.now()
        return hook

    def _post(self, i):
        def hook(module, args, output):
            after = self.meter.now()
            self.deltas.append(None if after is None else after - self._before)
            self.current = "outside"
        return hook

    def _pack(self, t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.params and ptr not in self.saved:
            self.saved[ptr] = (self.current, storage.nbytes())
        return t

    def saved_bytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for where, nbytes in self.saved.values():
            out[where] = out.get(where, 0) + nbytes
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def run(case: MegatronCase, device: str, trace: str | None = None) -> dict[str, Any]:
    """Build, then micro-steps; the row's phases, per-layer figures and status. ``trace`` (CUDA only): record
    the caching allocator's trace of the micro-steps there (memplan.allocator.trace's compact format, the
    phases marked as verify marks them)."""
    import torch

    from .phases import memplan_phase_marker, start_allocation_trace, write_allocation_trace

    meter = Meter(device)
    phases: list[dict[str, Any]] = []
    labels: list[str] = []

    def phase(name, fn):
        if trace and name != "init":
            labels.append(name)
            memplan_phase_marker(torch, device)
        meter.reset()
        t0 = time.perf_counter()
        out = fn()
        phases.append({"name": name, "peak_allocated_bytes": meter.peak(), "allocated_end_bytes": meter.now(),
                       "wall_s": round(time.perf_counter() - t0, 3)})
        return out

    setup(case, device)
    model = phase("init", lambda: build(case, device))
    model.train()
    vocab = padded_vocab(case.vocab, case.tp)
    # GPTModel takes the whole sequence; under --sequence-parallel its embedding scatters it over tp
    ids = torch.randint(0, case.vocab, (case.micro, case.seq), device=device)
    positions = torch.arange(case.seq, device=device).unsqueeze(0).expand(case.micro, -1)
    mask = None if case.flash else torch.triu(
        torch.ones(case.seq, case.seq, dtype=torch.bool, device=device), diagonal=1).view(1, 1, case.seq, case.seq)
    probe = None
    if trace:
        start_allocation_trace(torch)
    for i in range(case.micro_steps):
        if i == 0:
            probe = LayerProbe(model, meter)
            with probe.hooks:
                loss = phase(f"micro{i}.forward", lambda: model(ids, positions, mask, labels=ids))
            probe.remove()
        else:
            loss = phase(f"micro{i}.forward", lambda: model(ids, positions, mask, labels=ids))
        phase(f"micro{i}.backward", lambda loss=loss: loss.mean().backward())
        del loss
    extra = write_allocation_trace(torch, trace, labels) if trace else {}
    peaks = [p["peak_allocated_bytes"] for p in phases if p["peak_allocated_bytes"] is not None]
    return {"phases": phases, "peak_allocated_bytes": max(peaks) if peaks else None,
            "layer_forward_delta_bytes": probe.deltas, "saved_bytes": probe.saved_bytes(), "vocab_padded": vocab,
            **extra}


def substitutions(case: MegatronCase) -> list[str]:
    """What the harness puts in place of megatron-core's own modules for this case."""
    out = []
    if case.flash:
        out.append("core_attention: FlashCoreAttention (Megatron-DeepSpeed FlashSelfAttention's layout, torch "
                   "FlashAttention kernel)")
    if case.sequence_parallel:
        out.append("norms: torch.nn.LayerNorm marked sequence_parallel (WrappedTorchNorm refuses it)")
    return out


def measure(task: dict[str, Any]) -> dict[str, Any]:
    """The row for one task (never raises: a failure is a status)."""
    from ..megatron import harness

    t0 = time.perf_counter()
    case = MegatronCase.model_validate(task["case"])
    row: dict[str, Any] = {
        "schema": 1, "name": case.name, "case": case.model_dump(), "job": case_job(case).model_dump(),
        "command": task.get("command"), "device": task["device"], "mode": "emulated",
        "megatron_core": megatron_core_version(), "substitutions": substitutions(case), "status": "ok",
        "error": None, "phases": []}
    try:
        row.update(run(case, task["device"], task.get("trace")))
    except Exception as exc:  # noqa: BLE001 - every failure is a result, logged in full to stderr
        traceback.print_exc()
        oom = "out of memory" in str(exc).lower()
        row.update(status="oom" if oom else "error", error=f"{type(exc).__name__}: {str(exc)[:400]}")
    try:
        row["env"] = environment(task["device"])
    except Exception as exc:  # noqa: BLE001 - a broken CUDA must not lose the row
        row["env"] = {"error": str(exc)[:200]}
    row["env"]["megatron_core"] = row["megatron_core"]
    row["predicted"] = harness.predict(case)
    row["predicted_layer_bytes"] = harness.per_layer_bytes(case)
    row["wall_s"] = round(time.perf_counter() - t0, 3)
    return row


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as fh:
        task = json.load(fh)
    write_json_atomic(task["out"], measure(task))
    return 0


if __name__ == "__main__":
    sys.exit(main())
