"""What every transformers causal LM shares in the autograd model: shapes, parameters, module hooks, positions
and rotary tables (the embedding lookup, the head and the causal-LM loss: estimator/causal_lm.py).

Each family's forward (estimator/families/<family>.py) mirrors ``*ForCausalLM.forward`` → ``*Model.forward`` →
each ``*DecoderLayer.forward`` of transformers 5.17: where the Python code binds and rebinds variables, the
model takes and drops references, so tensors die where the real ones die. The loss is ``ForCausalLMLoss``
(loss/loss_utils.py): ``logits.float()``, labels padded and shifted, ``cross_entropy`` (log_softmax +
nll_loss). What the training loop keeps of the output object is the caller's business (estimator/program.py).
Modules with parameters are called through ``Net.linear`` / ``Net.module`` so that DeepSpeed's per-module
hooks (ZeRO-3 gathering) can run around them. Symbols as in blocks.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..specs import ModelSpec
from . import blocks as B
from . import blocks_linear as BL
from .autograd import Autograd, Tensor

INT64 = 8


@dataclass(frozen=True, slots=True)
class Shape:
    """Sizes of one micro-step on this rank."""

    batch: int  # sequences per micro-step
    seq: int  # tokens per sequence this rank holds (seq / sp)
    attn_seq: int  # tokens per sequence inside attention (the full sequence under Ulysses)
    b: int  # bytes of the training dtype
    positions_given: bool = False  # the loop passes position_ids (Ulysses shards): [B, S] rows, none made

    @property
    def pos_batch(self) -> int:
        """Rows of position_ids: the batch when the caller passes them, else 1 (arange(S).unsqueeze(0))."""
        return self.batch if self.positions_given else 1

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


class Params:
    """The model's parameters as autograd leaves (their bytes live in the model states, not here). ``adapters``:
    LoRA's A and B weights ((name, bytes), estimator/peft_linear.py), trained, with the adapters' dtype bytes,
    rank and dropout; ``wrapped``: the parameters peft wraps in lora.ParamWrapper (train_set.TrainSet.wrapped)."""

    def __init__(self, ag: Autograd, model: ModelSpec, b: int, trainable, adapters: tuple[tuple[str, int], ...] = (),
                 adapter_bytes: int = 0, lora_rank: int = 0, lora_dropout: float = 0.0, wrapped=None):
        from ..params import parameter_tensors

        self.by_name: dict[str, Tensor] = {}
        for t in parameter_tensors(model):
            self.by_name[t.name] = ag.param(t.name, t.numel * b, trainable(t.name))
        if model.tie_word_embeddings:
            self.by_name["lm_head.weight"] = self.by_name[next(iter(self.by_name))]
        for name, nbytes in adapters:
            self.by_name[name] = ag.param(name, nbytes, True)
        self.adapted = {name.split(".lora_A.")[0] for name, _ in adapters if ".lora_A." in name}
        self.adapter_bytes, self.lora_rank, self.lora_dropout = adapter_bytes, lora_rank, lora_dropout
        #: parameters peft adapts through lora.ParamWrapper (estimator/peft_param.py): name → Wrapped
        self.wrapped = dict(wrapped or {})
        #: the input embeddings (get_input_embeddings: the module of the first parameter)
        self.embedding_module = next(iter(self.by_name)).rsplit(".", 1)[0]

    def __getitem__(self, name: str) -> Tensor:
        return self.by_name[name]

    def get(self, name: str) -> Tensor | None:
        return self.by_name.get(name)


class ModuleHooks:
    """What runs around a module with parameters (nn.Module forward pre/post hooks and, through autograd
    functions on its outputs and inputs, its backward pre/post hooks). The default runs nothing; ZeRO-3's
    parameter coordinator (estimator/zero3.py) gathers and releases parameters here."""

    #: nn.Linear runs DeepSpeed's LinearFunctionForZeroStage3 (ZeRO-3's zero3_linear_wrap, see
    #: lora.zero3_linear_uses_saved_input): its backward returns the weight's grad as a plain matmul result
    #: (runtime/zero/linear.py: grad_output.reshape(-1, out).t().matmul(input)), not F.linear's transposed view
    zero3_linear = False

    def pre_forward(self, ag: Autograd, module: str, params: tuple[Tensor, ...], inputs: tuple[Tensor, ...]
                    ) -> tuple[Tensor, ...]:
        return inputs

    def post_forward(self, ag: Autograd, module: str, params: tuple[Tensor, ...], output: Tensor) -> Tensor:
        return output

    def leaf_backward(self, ag: Autograd, module: str, params: tuple[Tensor, ...], inputs: tuple[Tensor, ...]
                      ) -> tuple[Tensor, ...]:
        """A ZeRO-3 leaf module's full backward hook on its inputs (Net.leaf)."""
        return inputs

    def param_access(self, ag: Autograd, module: str, name: str) -> None:
        """A forward reads parameter ``name`` while ``module`` is the innermost module running, outside the
        parameter's own module (ZeRO-3 gathers it then: Zero3Hooks.param_access)."""


class Net:
    """One forward's context: the autograd model, the model spec, the shape, the parameters and the hooks."""

    def __init__(self, ag: Autograd, m: ModelSpec, s: Shape, p: Params, hooks: ModuleHooks | None = None,
                 layer_fn=None, attention: str = "sdpa", device: str = "cuda", dtype: str = "bf16",
                 sdpa_backend: str | None = None):
        self.ag, self.m, self.s, self.p = ag, m, s, p
        self.hooks = hooks or ModuleHooks()
        self.layer_fn = layer_fn  # (i, x, run) → output: wraps each decoder layer (checkpointing)
        self.attention = attention  # TrainingSpec.attention: flash, sdpa or eager
        self.device = device  # whose kernels run: "cuda" (the estimate), "cpu" (the CPU trace comparison)
        self.dtype = dtype  # TrainingSpec.dtype (bf16 and fp16 differ in CUDA's softmax)
        self.sdpa_backend = sdpa_backend  # a kernel forced as torch.nn.attention.sdpa_kernel does (None: dispatch)
        self.in_leaf = False  # inside a ZeRO-3 leaf module: its children carry no hooks
        #: transformers' enable_input_require_grads (gradient_checkpointing_enable calls it): a forward hook on
        #: the input embeddings, ``output.requires_grad_(True)`` (a leaf when the embedding is frozen)
        self.input_require_grads = False
        #: full backward hooks on every decoder layer (estimator/layer_hooks.py), or None
        self.layer_hooks = None

    def module(self, name: str, fn, *inputs: Tensor, params: tuple[Tensor | None, ...] = (), hooked: int = 0):
        """Call module ``name`` (``fn(*inputs)``; ``params``: its own parameters, module.parameters(recurse=False)
        in registration order, None entries skipped) between its hooks. ``fn`` may return a tuple of tensors;
        ``hooked`` is the one gradients reach, which carries the module's pre-backward hook."""
        ag = self.ag
        if self.in_leaf:
            return fn(*inputs)
        params = tuple(t for t in params if t is not None)
        wrapped = self.hooks.pre_forward(ag, name, params, inputs)
        out = fn(*wrapped)
        if self.input_require_grads and name == self.p.embedding_module and not out.requires_grad:
            ag.input_leaf(out)  # transformers' hook, registered before DeepSpeed's, runs first
        for w, x in zip(wrapped, inputs):
            if w is not x:
                ag.release(w)
        many = isinstance(out, tuple)
        first = out[hooked] if many else out
        hooked_t = self.hooks.post_forward(ag, name, params, first)
        if hooked_t is not first:
            ag.release(first)
        return (*out[:hooked], hooked_t, *out[hooked + 1:]) if many else hooked_t

    def container(self, name: str, fn, *inputs: Tensor, hooked: int = 0):
        """A module without parameters of its own (a decoder layer, an attention or MLP block, an activation or
        dropout module): DeepSpeedZeRoOffload hooks it like any other (parameter_offload.py
        _register_hooks_recursively), so under ZeRO-3 its forward and backward pre-hooks are fetch_sub_module
        calls with nothing to gather, each a step of the trace and, once the trace is complete, a prefetch.
        ``inputs``: its positional tensor arguments (the ones its PostBackwardFunctionModule wraps; keyword
        arguments are not wrapped)."""
        return self.module(name, fn, *inputs, params=(), hooked=hooked)

    def base_model_output(self, name: str, x: Tensor) -> Tensor:
        """The base model's (``*ForCausalLM.model``) post-forward hook on its output's last_hidden_state: its
        PreBackwardFunctionForModule, a fetch with nothing to gather once the grad reaches it (its forward
        fetch is the engine's, estimator/zero3.py start_forward)."""
        if self.in_leaf:
            return x
        out = self.hooks.post_forward(self.ag, name, (), x)
        if out is not x:
            self.ag.release(x)
        return out

    def leaf(self, name: str, fn, x: Tensor, params: tuple[Tensor, ...]) -> Tensor:
        """A ZeRO-3 leaf module (DeepSpeedEngine._configure_distributed_model → apply_zero_leaf_module_config,
        zero_optimization.leaf_module, whose default classes are transformers' MixtralSparseMoeBlock,
        Qwen2MoeSparseMoeBlock and Qwen3MoeSparseMoeBlock: runtime/zero/leaf_module_config.py): its hooks fetch
        and release all its parameters (parameter_offload.py: iter_params(module, recurse=z3_leaf_module)),
        its children run without hooks, and its parameters' grads wait for its full backward hook
        (stage3.py create_reduce_and_remove_grad_hooks: reduce_leaf_module_grads). torch's Module._call_impl
        wraps the inputs for that hook after the forward pre-hooks, so in backward it fires before DeepSpeed's
        release (PostBackwardFunctionModule). ``x``: the one input; ``params``: all of them, model order."""
        ag = self.ag
        (outer,) = self.hooks.pre_forward(ag, name, params, (x,))
        (inner,) = self.hooks.leaf_backward(ag, name, params, (outer,))
        self.in_leaf = True
        try:
            out = fn(inner)
        finally:
            self.in_leaf = False
        for w, under in ((inner, outer), (outer, x)):
            if w is not under:
                ag.release(w)
        hooked = self.hooks.post_forward(ag, name, params, out)
        if hooked is not out:
            ag.release(out)
        return hooked

    def linear(self, x: Tensor, name: str, out_features: int, bias: bool = False) -> Tensor:
        """nn.Linear ``name`` (weight ``name.weight``, bias ``name.bias`` when ``bias``) on x: [T, out]; with a
        LoRA adapter on it, peft's lora.Linear around it (estimator/peft_linear.py)."""
        s, p = self.s, self.p
        w = p[f"{name}.weight"]
        b_t = p[f"{name}.bias"] if bias else None
        z3 = self.hooks.zero3_linear  # ZeRO-3's linear multiplies by the weight itself and always saves x
        cuda = s.b if self.device == "cuda" else None
        return self._adaptable(name, out_features, x, (w, b_t), lambda z: BL.linear(
            self.ag, z, w, s.b * s.tokens * out_features, name, b_t, transposed=not z3, keeps_input=z3,
            cuda_bytes=cuda))

    def conv1d(self, x: Tensor, name: str, out_features: int) -> Tensor:
        """transformers' Conv1D ``name`` (GPT-2): addmm(bias, x, weight) with weight [in, out], no transpose."""
        s, p = self.s, self.p
        w, b_t = p[f"{name}.weight"], p[f"{name}.bias"]
        cuda = s.b if self.device == "cuda" else None
        return self._adaptable(name, out_features, x, (w, b_t), lambda z: BL.linear(
            self.ag, z, w, s.b * s.tokens * out_features, name, b_t, transposed=False, cuda_bytes=cuda))

    def _adaptable(self, name: str, out_features: int, x: Tensor, params: tuple, run) -> Tensor:
        """Module ``name`` running ``run``, or, when peft adapted it, its lora.Linear wrapper with ``run`` as the
        base_layer."""
        if name not in self.p.adapted:
            return self.module(name, run, x, params=params)
        from .peft_linear import lora_linear

        # lora.Linear has no parameters of its own: a container around its base layer and adapters
        return self.container(name, lambda z: lora_linear(self, z, name, out_features, lambda zz: self.module(
            f"{name}.base_layer", run, zz, params=params)), x)

    def layernorm(self, x: Tensor, name: str) -> Tensor:
        """nn.LayerNorm ``name`` (weight and bias) over the hidden size of x [T, h]."""
        from .blocks_gpt import layernorm
        w, b_t = self.p[f"{name}.weight"], self.p[f"{name}.bias"]
        return self.module(name, lambda z: layernorm(self.ag, z, w, b_t, self.s.tokens, self.s.b, name, self.device),
                           x, params=(w, b_t))

    def rmsnorm(self, x: Tensor, name: str) -> Tensor:
        """The family's RMSNorm module ``name`` on x."""
        w = self.p[f"{name}.weight"]
        return self.module(name, lambda z: B.rmsnorm(self.ag, z, w, self.s.b, name, self.device == "cuda"), x,
                           params=(w,))

    def layer(self, i: int, x: Tensor, run, extras: tuple[Tensor, ...] = ()) -> Tensor:
        """Decoder layer i: ``run(x)`` itself, or wrapped by the checkpointing layer function. ``extras``: the
        layer's other tensor arguments (a checkpoint frame keeps them too: rotary tables, masks)."""
        if self.layer_hooks is not None:
            run = self.layer_hooks.wrap(self.ag, i, run)
        return self.layer_fn(i, x, run, extras) if self.layer_fn else run(x)


def frame_extras(*kwargs) -> tuple[Tensor, ...]:
    """A decoder layer's tensor keyword arguments, in the order a checkpoint frame drops them (Net.layer's
    ``extras``): its partial's kwargs dict releases its values in insertion order (the order the model passes
    them; pass them so), a tuple (position_embeddings) its items last first; None entries are skipped."""
    out = []
    for k in kwargs:
        out.extend(reversed(k) if isinstance(k, tuple) else (k,))
    return tuple(t for t in out if t is not None)


@dataclass
class Output:
    """What ``*ForCausalLM.forward`` returns: the loss and the logits (the CausalLMOutputWithPast); ``leaves``:
    the graph's input leaves (Autograd.input_leaf), which die with it (the caller releases them)."""

    loss: Tensor
    logits: Tensor
    leaves: list = field(default_factory=list)


def positions(ag: Autograd, s: Shape) -> Tensor | None:
    """position_ids and the packed-sequence check of create_causal_mask (``position_ids`` then
    ``packed_sequence_check``). Returns the tensor the model allocated (None when the caller passed them)."""
    made = position_ids(ag, s)
    packed_sequence_check(ag, s)
    return made


def position_ids(ag: Autograd, s: Shape) -> Tensor | None:
    """Without position_ids given, *Model.forward makes them: arange(S) + past_seen_tokens → [1, S] int64
    (None when the caller passed them)."""
    if s.positions_given:
        return None
    arange = ag.empty("position_ids.arange", INT64 * s.seq)
    made = ag.empty("position_ids", INT64 * s.seq)
    ag.release(arange)
    return made


def packed_sequence_check(ag: Autograd, s: Shape) -> None:
    """The packed-sequence check of create_causal_mask (masking_utils find_packed_sequence_indices on
    position_ids expanded to the batch: diff with a prepended value, != 1, cumsum; all temporaries)."""
    rows = s.batch
    first = ag.empty("mask.first_position", INT64 * rows)  # position_ids[:, :1] - 1
    prepended = ag.empty("mask.positions_prepended", INT64 * rows * (s.seq + 1))
    diff = ag.empty("mask.positions_diff", INT64 * rows * s.seq)
    ag.release(prepended)
    ne = ag.empty("mask.positions_ne", rows * s.seq)
    packed = ag.empty("mask.packed_sequences", INT64 * rows * s.seq)
    ag.release(ne)
    last_zero = ag.empty("mask.last_is_zero", rows)  # (packed_sequence_mask[:, -1] == 0).all(): bool [B], 0-d
    every = ag.empty("mask.all", 1)
    ag.release(last_zero)
    ag.release(every)
    for t in (first, diff, packed):
        ag.release(t)


def causal_mask(net: Net, sliding: bool | None = None) -> Tensor | None:
    """create_causal_mask / create_sliding_window_causal_mask (masking_utils) after the packed-sequence check:
    what the attention implementation gets. sdpa and flash skip it (None: is_causal) unless a sliding window
    is not shorter than the sequence (_ignore_causal_mask_sdpa); then sdpa_mask builds a bool [1, 1, S, S]
    (expanded to [B, 1, S, S], a view) and eager_mask turns it into the dtype's 0 / min [B, 1, S, S]
    (torch.where). sdpa_mask's index tensors: arange(B), arange(1), arange(S) + q_offset,
    arange(S) + kv_offset (int64), freed as it returns; the mask function is kv <= q, and with a window
    and_masks(kv > q - window, kv <= q) (new_ones((), bool) & each, left to right)."""
    ag, m, s = net.ag, net.m, net.s
    windowed = m.sliding_window is not None if sliding is None else sliding  # Gemma builds both kinds
    # sdpa skips a window no shorter than the sequence (_ignore_causal_mask_sdpa); eager always builds it
    # the model builds its masks over its own tokens (this rank's shard under Ulysses, whose wrapper drops them)
    window = (m.sliding_window if windowed and (net.attention == "eager" or s.seq >= m.sliding_window)
              else None)
    if net.attention != "eager" and window is None:
        return None
    S = s.seq
    idx = [ag.empty("mask.batch_arange", INT64 * s.batch), ag.empty("mask.head_arange", INT64)]
    for which in ("q", "kv"):
        raw = ag.empty(f"mask.{which}_arange_raw", INT64 * S)
        idx.append(ag.empty(f"mask.{which}_arange", INT64 * S))
        ag.release(raw)
    if window is None:
        mask = ag.empty("mask.causal", S * S)  # kv_idx <= q_idx: bool [1, 1, S, S]
    else:
        result = ag.empty("mask.and_start", 1)  # q_idx.new_ones((), dtype=torch.bool)
        shifted = ag.empty("mask.q_minus_window", INT64 * S)
        inside = ag.empty("mask.in_window", S * S)
        ag.release(shifted)
        both = ag.empty("mask.and_window", S * S)
        ag.release(inside)
        ag.release(result)
        causal = ag.empty("mask.causal", S * S)
        mask = ag.empty("mask.and_causal", S * S)
        ag.release(causal)
        ag.release(both)
    for t in idx:
        ag.release(t)
    if net.attention != "eager":
        return mask
    zero = ag.empty("mask.zero", s.b)  # torch.tensor(0.0, device=mask.device, dtype=dtype)
    out = ag.empty("mask.eager", s.b * s.batch * S * S)  # torch.where(mask, 0, min): [B, 1, S, S]
    ag.release(zero)
    ag.release(mask)
    return out


def rotary(ag: Autograd, m: ModelSpec, s: Shape, dim: int | None = None, cast: bool = True) -> tuple[Tensor, Tensor]:
    """LlamaRotaryEmbedding.forward under no_grad: positions as fp32 [P, 1, S] (P rows of position_ids),
    freqs = inv_freq [P, d/2, 1] @ positions [P, d/2, S], emb = cat(freqs, freqs) [P, S, d], cos and sin in
    fp32 times attention_scaling, cast to the training dtype. Returns (cos, sin) [P, S, d]; every layer's
    RoPE saves them. ``dim``: the rotated dims when not all of head_dim (GPTNeoXRotaryEmbedding's
    head_dim · partial_rotary_factor). ``cast=False``: the fp32 tables themselves (Olmo2RotaryEmbedding returns
    them uncast)."""
    d, rows = dim or m.head_dim, s.pos_batch
    with_grad, ag.grad_enabled = ag.grad_enabled, False
    pos = ag.empty("rope.positions", B.FP32 * rows * s.seq)
    freqs = ag.empty("rope.freqs", B.FP32 * rows * (d // 2) * s.seq)
    ag.first_matmul()  # inv_freq @ positions: a bmm, the forward's first cuBLAS call in a rotary model
    emb = ag.empty("rope.emb", B.FP32 * rows * s.seq * d)
    out = []
    for which in ("cos", "sin"):
        raw = ag.empty(f"rope.{which}_fp32", B.FP32 * rows * s.seq * d)
        out.append(ag.empty(f"rope.{which}_scaled", B.FP32 * rows * s.seq * d))
        ag.release(raw)
    width = s.b if cast else B.FP32
    cos = B.to_dtype(ag, out[0], width * rows * s.seq * d, "rope.cos")
    sin = B.to_dtype(ag, out[1], width * rows * s.seq * d, "rope.sin")
    for t in (pos, freqs, emb, *out):
        ag.release(t)
    ag.grad_enabled = with_grad
    return cos, sin
