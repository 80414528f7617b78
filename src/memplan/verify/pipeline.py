"""Pipeline parallelism in the worker: a transformers causal LM as a DeepSpeed PipelineModule (pp > 1).

The stack is built from transformers' own modules, one LayerSpec each, so every rank builds only its stage
(deepspeed.runtime.pipe.module.PipelineModule._build):

- Llama style (llama, mistral, qwen2, qwen3: ``model.layers``): token embedding → positions (emits
  (hidden, position_ids)) → decoder layers → final norm → lm_head. Each stage computes the rotary (cos, sin)
  once per forward from the int64 position_ids it received, as transformers' model does once per forward:
  float tensors passed between stages would get requires_grad on the receiving stage
  (PipelineEngine._exec_recv_activations) and so make every layer save q and k for cos/sin's gradient.
- GPT-2 (``transformer.h``): token embedding → position embedding + dropout → blocks → ln_f → lm_head.

Tied input/output embeddings (llama-3.2-1b, qwen2.5-0.5b, gpt2) are a TiedLayerSpec: the first and the last
stage each hold the whole embedding and DeepSpeed all-reduces its gradient between them
(PipelineEngine._exec_reduce_tied_grads). The loss is transformers' ForCausalLMLoss (logits upcast to fp32),
the PipelineModule's ``loss_fn``. Stages are balanced on the decoder layers (partition_method "type:...").

Emulation (the fake process group): p2p send/recv are no-ops. The first stage needs nothing back that it did
not allocate itself (gradient buffers take its outputs' shapes), so rank 0 runs as is. A later stage first
receives the shapes of what it will receive (PipelineEngine._recv_tensor_meta); `emulate_recv_meta` allocates
those buffers from the known shapes instead. Runs with torch, transformers and deepspeed imported lazily.
"""

from __future__ import annotations

from typing import Any

from ..specs import Job

#: transformers families whose decoder layers take (hidden, position_embeddings=(cos, sin))
LLAMA_STYLE = ("llama", "mistral", "qwen2", "qwen3")
#: families the pipeline builder supports
SUPPORTED_FAMILIES = (*LLAMA_STYLE, "gpt2")


def unsupported_reason(job: Job) -> str | None:
    """Why this harness cannot run ``job`` under pipeline parallelism, or None."""
    t = job.training
    if job.model.family not in SUPPORTED_FAMILIES:
        return f"pp > 1 on {job.model.family}: the pipeline builder knows {', '.join(SUPPORTED_FAMILIES)}"
    if t.zero.stage > 1:
        # deepspeed/runtime/pipe/engine.py PipelineEngine.__init__:
        # assert zero_optimization_stage() < ZeroStageEnum.gradients, "ZeRO-2 and ZeRO-3 are incompatible ..."
        return f"pp > 1 with ZeRO {t.zero.stage}: DeepSpeed's pipeline engine allows ZeRO 0 and 1 only"
    if t.attention == "eager":
        return "pp > 1 with eager attention: the stages pass no attention mask (sdpa/flash use is_causal)"
    if t.checkpointing != "none":
        return "pp > 1 with checkpointing: not wired (PipelineModule.activation_checkpoint_interval)"
    if job.layout.sp > 1 or job.layout.tp > 1:
        return "pp > 1 combined with tp or sp: not measured by this harness"
    if t.grad_accum < job.layout.pp:
        return f"pp {job.layout.pp} needs --grad-accum >= pp (micro-batches per step); got {t.grad_accum}"
    return None


def _modules():
    """The nn.Module classes of the stages (defined lazily: torch is imported only in the worker)."""
    import torch
    from torch import nn

    class TokenEmbedding(nn.Module):
        def __init__(self, vocab: int, hidden: int):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(vocab, hidden))
            nn.init.normal_(self.weight, std=0.02)

        def forward(self, ids):
            return nn.functional.embedding(ids, self.weight)

    class LlamaPositions(nn.Module):
        def forward(self, hidden):
            pos = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0).expand(hidden.shape[0], -1)
            return hidden, pos.contiguous()

    class LlamaLayer(nn.Module):
        """One transformers decoder layer; (cos, sin) computed once per stage forward (shared `rotary`)."""

        def __init__(self, layer_cls, rotary, config, index: int):
            super().__init__()
            self.layer = layer_cls(config, index)
            self.rotary = rotary  # a plain holder, not a submodule: shared by the stage's layers

        def forward(self, inputs):
            hidden, pos = inputs
            out = self.layer(hidden, position_ids=pos, position_embeddings=self.rotary(hidden, pos))
            return (out[0] if isinstance(out, tuple) else out), pos

    class LlamaFinalNorm(nn.Module):
        def __init__(self, norm_cls, config):
            super().__init__()
            self.norm = norm_cls(config.hidden_size, eps=config.rms_norm_eps)

        def forward(self, inputs):
            return self.norm(inputs[0])

    class GPT2Positions(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
            self.drop = nn.Dropout(config.embd_pdrop)

        def forward(self, hidden):
            pos = torch.arange(hidden.shape[1], device=hidden.device)
            return self.drop(hidden + self.wpe(pos).unsqueeze(0))

    class GPT2Layer(nn.Module):
        def __init__(self, layer_cls, config, index: int):
            super().__init__()
            self.layer = layer_cls(config, layer_idx=index)

        def forward(self, hidden):
            out = self.layer(hidden)
            return out[0] if isinstance(out, tuple) else out

    class GPT2FinalNorm(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

        def forward(self, hidden):
            return self.norm(hidden)

    class LMHead(nn.Module):
        def __init__(self, vocab: int, hidden: int):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(vocab, hidden))
            nn.init.normal_(self.weight, std=0.02)

        def forward(self, hidden):
            return nn.functional.linear(hidden, self.weight)

    return {k: v for k, v in locals().items() if isinstance(v, type)}


class StageRotary:
    """The rotary embedding of one stage: (cos, sin) computed once per forward, reused by its layers."""

    def __init__(self, rotary_cls, config):
        self.rotary_cls, self.config = rotary_cls, config
        self.module = None
        self._key: Any = None
        self._value: Any = None

    def __call__(self, hidden, pos):
        if self.module is None:
            import torch

            with torch.device(hidden.device):
                self.module = self.rotary_cls(self.config)
        if self._key is not pos:  # a new forward: the stage's layers pass the same position_ids object on
            self._key, self._value = pos, self.module(hidden, pos)
        return self._value


def _layer_classes(config):
    """transformers' decoder layer, norm and rotary classes of ``config`` (from a meta-device model)."""
    import torch
    import transformers

    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    if config.model_type == "gpt2":
        return type(meta.transformer.h[0]), None, None
    inner = meta.model
    return type(inner.layers[0]), type(inner.norm), type(inner.rotary_emb)


def layer_specs(config) -> tuple[list, str]:
    """The PipelineModule layers of ``config`` and the partition method that balances decoder layers."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    mods = _modules()
    layer_cls, norm_cls, rotary_cls = _layer_classes(config)
    vocab, hidden = config.vocab_size, config.hidden_size
    tied = bool(getattr(config, "tie_word_embeddings", False))
    embed = (TiedLayerSpec("embed", mods["TokenEmbedding"], vocab, hidden) if tied
             else LayerSpec(mods["TokenEmbedding"], vocab, hidden))
    head = (TiedLayerSpec("embed", mods["TokenEmbedding"], vocab, hidden, forward_fn=_tied_head) if tied
            else LayerSpec(mods["LMHead"], vocab, hidden))
    n = config.num_hidden_layers
    if config.model_type == "gpt2":
        body = [LayerSpec(mods["GPT2Layer"], layer_cls, config, i) for i in range(n)]
        return [embed, LayerSpec(mods["GPT2Positions"], config), *body,
                LayerSpec(mods["GPT2FinalNorm"], config), head], "type:GPT2Layer"
    rotary = StageRotary(rotary_cls, config)
    body = [LayerSpec(mods["LlamaLayer"], layer_cls, rotary, config, i) for i in range(n)]
    return [embed, LayerSpec(mods["LlamaPositions"]), *body,
            LayerSpec(mods["LlamaFinalNorm"], norm_cls, config), head], "type:LlamaLayer"


def _tied_head(module, hidden):
    """The output projection through the tied token embedding (the last stage's TiedLayerSpec)."""
    import torch

    return torch.nn.functional.linear(hidden, module.weight)


def causal_lm_loss(vocab: int):
    """transformers' ForCausalLMLoss(logits, labels, vocab_size) as a PipelineModule loss_fn."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    def loss_fn(logits, labels):
        return ForCausalLMLoss(logits, labels, vocab)

    return loss_fn


def build_pipeline(config, job: Job, device: str):
    """The PipelineModule of this rank's stage, parameters built directly on ``device`` in the train dtype."""
    import torch
    from deepspeed.pipe import PipelineModule

    from . import hfbuild

    config._attn_implementation = hfbuild.ATTN_IMPLEMENTATION[job.training.attention]
    layers, method = layer_specs(config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(hfbuild.torch_dtype(job))
    try:
        with torch.device(device):
            module = PipelineModule(layers=layers, num_stages=job.layout.pp, loss_fn=causal_lm_loss(config.vocab_size),
                                    partition_method=method)
    finally:
        torch.set_default_dtype(previous)
    module.train()
    return module


def emulate_recv_meta(engine, job: Job, config) -> None:
    """On the fake group, allocate what a later stage receives from the known activation shapes."""
    import torch

    from . import hfbuild

    t = job.training
    shape = [t.micro_batch, t.seq_len, config.hidden_size]
    dtype = hfbuild.torch_dtype(job)

    def recv_meta(_send_stage):
        hidden = engine._allocate_or_extend_buffers(0, shape, dtype)
        if config.model_type == "gpt2":
            return hidden
        pos = engine._allocate_or_extend_buffers(1, shape[:2], torch.int64)
        torch.arange(t.seq_len, out=pos[0])
        pos.copy_(pos[0:1].expand_as(pos))
        return hidden, pos

    engine._recv_tensor_meta = recv_meta


def initialize(task: dict[str, Any], job: Job, device: str):
    """deepspeed.initialize of the stage's PipelineModule: (engine, module)."""
    import deepspeed

    from ..dsconfig_emit import to_ds_config
    from . import hfbuild

    config = hfbuild.make_config(task["hf_config"], task.get("num_layers"))
    module = build_pipeline(config, job, device)
    engine, *_ = deepspeed.initialize(model=module, model_parameters=[p for p in module.parameters()
                                                                       if p.requires_grad], config=to_ds_config(job))
    if task["mode"] == "emulated" and not engine.is_first_stage():
        emulate_recv_meta(engine, job, config)
    return engine, module, config


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")


class InstructionPhases:
    """One recorder phase per pipeline instruction of train_batch (PipelineEngine._exec_schedule runs them).

    Phases are gap-free: "step{s}.setup" from train_batch's start to its first instruction, then
    "step{s}.micro{m}.forward" / ".backward" (m counts this stage's micro-batches), "step{s}.step" for the
    optimizer step and "step{s}.i{k}.<instruction>" for loads, sends, receives and gradient reductions; the
    last phase stays open until train_batch returns (its loss aggregation included).
    """

    def __init__(self, engine, rec):
        self.rec, self.step, self.k = rec, 0, 0
        self.counts: dict[str, int] = {}
        wrapped = {cmd: self._wrap(cmd.__name__, fn) for cmd, fn in type(engine)._INSTRUCTION_MAP.items()}
        engine._INSTRUCTION_MAP = wrapped  # an instance attribute: _exec_schedule looks it up on self

    def _wrap(self, cmd_name: str, fn):
        def run(engine, **kwargs):
            self._next(_snake(cmd_name))
            return fn(engine, **kwargs)

        return run

    def _next(self, kind: str) -> None:
        if kind in ("forward_pass", "backward_pass"):
            m = self.counts.get(kind, 0)
            self.counts[kind] = m + 1
            name = f"step{self.step}.micro{m}.{kind.split('_')[0]}"
        elif kind == "optimizer_step":
            name = f"step{self.step}.step"
        else:
            name = f"step{self.step}.i{self.k:02d}.{kind}"
        self.k += 1
        self.rec.end()
        self.rec.begin(name)

    def train_batch(self, engine, data, step: int) -> None:
        self.step, self.k, self.counts = step, 0, {}
        self.rec.begin(f"step{step}.setup")
        engine.train_batch(data_iter=data)
        self.rec.end()


def train(engine, config, job: Job, rec, steps: int, device: str) -> None:
    """`steps` calls of engine.train_batch (1F1B over grad_accum micro-batches), one phase per instruction."""
    import torch

    t = job.training

    def batches():
        while True:
            ids = torch.randint(0, config.vocab_size, (t.micro_batch, t.seq_len), device=device)
            yield ids, ids

    data = batches()
    phases = InstructionPhases(engine, rec)
    for s in range(steps):
        phases.train_batch(engine, data, s)


def stage_note(engine) -> dict[str, Any]:
    """This rank's stage, for the row."""
    return {"pp_stage": int(engine.stage_id), "pp_stages": int(engine.num_stages),
            "stage_params": sum(p.numel() for p in engine.module.parameters())}
