"""The real allocation order of a transformers model's forward and backward, recorded on the CPU.

torch's profiler (``profile_memory=True``) reports every CPU allocation and free with its address and bytes;
the innermost op around each event names it. Autograd, transformers' modeling code and their refcounting are
device-independent, so the order and sizes of the model's own tensors match CUDA's; what differs is inside
device kernels (attention kernels, cuBLAS) and CPU-only scalar tensors (wrapped numbers, 8 bytes or less),
which ``record`` marks and drops. Used by the tests that hold the estimator's ledger (memplan.estimator) to
the real code. Imports torch and transformers inside functions only.
"""

from __future__ import annotations

import gc
import json
import os
import tempfile
from dataclasses import dataclass

from ..ledger import Ledger

#: CPU allocations of this size or less are wrapped scalars and 0-d temporaries CUDA does not allocate
SCALAR_BYTES = 8
#: torch.get_rng_state() (the CPU generator's mt19937 state, a uint8 tensor): torch.utils.checkpoint saves it with
#: preserve_rng_state; on a CUDA job it lives in host memory, not on the GPU
CPU_RNG_STATE_BYTES = 5056


@dataclass(frozen=True)
class Event:
    """One allocation (+bytes) or free (−bytes), the innermost op it happened in, and the outermost enclosing
    device kernel (an index into the trace's ops, -1 when none; see DEVICE_KERNELS)."""

    delta_bytes: int
    op: str
    addr: int
    kernel: int = -1



def profiler_events(prof) -> list[dict]:
    """A finished torch.profiler run's Chrome trace events (exported to a temporary file, read, removed)."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as fh:
            return json.load(fh)["traceEvents"]
    finally:
        os.unlink(path)


def record(fn, *, warmup: bool = True) -> list[Event]:
    """Run ``fn()`` under the profiler and return its allocation events (scalars dropped), in order."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if warmup:
        fn()
    gc.collect()  # garbage of earlier models is not freed inside the recording
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    trace = profiler_events(prof)
    del torch
    ops = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in trace if e.get("ph") == "X"
                 and e.get("cat") == "cpu_op")
    mem = sorted((e for e in trace if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    out = []
    for e in mem:
        a = e["args"]
        if abs(a["Bytes"]) <= SCALAR_BYTES or abs(a["Bytes"]) == CPU_RNG_STATE_BYTES:
            continue
        ts = e["ts"]
        inner = [(k, o) for k, o in enumerate(ops) if o[0] <= ts <= o[1]]
        name = min(inner, key=lambda ko: ko[1][1] - ko[1][0])[1][2] if inner else "?"
        kernels = [k for k, o in inner if any(d in o[2] for d in DEVICE_KERNELS)]
        if any(o[2] in COMPOSITE_KERNELS for _, o in inner):
            kernels = []
        kernel = max(kernels, key=lambda k: ops[k][1] - ops[k][0]) if kernels else -1
        out.append(Event(int(a["Bytes"]), name, int(a["Addr"]), kernel))
    return out


def to_ledger(events: list[Event]) -> Ledger:
    """The events as a Ledger (frees matched to allocations by address; frees of earlier blocks dropped)."""
    ledger = Ledger()
    live: dict[int, int] = {}
    for e in events:
        if e.delta_bytes > 0:
            live[e.addr] = ledger.alloc(e.op, e.delta_bytes, "cpu")
        elif e.addr in live:
            ledger.free(live.pop(e.addr))
    return ledger


def tiny_causal_lm(config: dict, dtype: str = "bf16", attention: str = "eager"):
    """A random-init transformers causal LM of ``config`` on the CPU, in training mode, without cache."""
    import torch
    import transformers

    cfg = transformers.AutoConfig.for_model(**config)
    cfg.use_cache = False
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype, attn_implementation=attention)
    model.train()
    return model


#: kernels whose internal temporaries differ between the CPU and CUDA (the estimator models CUDA's). aten::add
#: and the matmuls: the CPU's TensorIterator casts an input of another dtype to a temporary first (a bf16 base
#: output plus peft's fp32 adapter output; TensorIteratorBase::compute_types on the CPU), and the CPU's bf16
#: gemms (oneDNN on CPUs with bf16 units) pack operands into temporaries, where CUDA's kernels cast in registers
#: and cuBLAS takes its workspace once
DEVICE_KERNELS = ("scaled_dot_product", "embedding_dense_backward", "embedding_backward", "aten::cumsum",
                  "aten::sort", "aten::histc", "aten::_grouped_mm", "aten::native_layer_norm_backward", "aten::add",
                  "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
#: composite kernels inside those: the same aten ops on every device, so everything in them is compared
COMPOSITE_KERNELS = ("aten::_scaled_dot_product_attention_math",)


def net_events(events: list[Event]) -> list[tuple[int, str, int]]:
    """(±bytes, op, partner) of every event, except temporaries allocated and freed inside one device kernel
    and frees of blocks allocated before the recording (a previous model's garbage collected meanwhile).
    ``partner`` is, for a free, the index (in the returned list) of the allocation it frees; -1 for an
    allocation."""
    freed_inside = set()
    stray = set()
    open_at: dict[int, int] = {}
    partner: dict[int, int] = {}
    for i, e in enumerate(events):
        if e.delta_bytes > 0:
            open_at[e.addr] = i
        elif e.addr in open_at:
            j = open_at.pop(e.addr)
            partner[i] = j
            if e.kernel >= 0 and events[j].kernel == e.kernel:
                freed_inside.update((i, j))
        else:
            stray.add(i)
    kept = [i for i in range(len(events)) if i not in freed_inside and i not in stray]
    index = {i: k for k, i in enumerate(kept)}
    return [(events[i].delta_bytes, events[i].op, index[partner[i]] if i in partner else -1) for i in kept]


#: memplan's sdpa kernel names → torch.nn.attention.SDPBackend members
SDPA_BACKENDS = {"math": "MATH", "cpu_flash": "FLASH_ATTENTION"}


def micro_step(model, batch: int, seq: int, vocab: int, keep_outputs: bool = False, sdpa_backend: str | None = None):
    """One forward + backward as the loss loop (or, ``keep_outputs``, the outputs loop) runs it; parameter
    grads are reset to None first, so every grad is stolen fresh (AccumulateGrad's first-grad path).
    ``sdpa_backend`` (a key of SDPA_BACKENDS) restricts F.scaled_dot_product_attention to that kernel."""
    import contextlib

    import torch

    ids = torch.randint(0, vocab, (batch, seq))

    def context():
        if sdpa_backend is None:
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[sdpa_backend])])

    def run():
        with context():
            step()

    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        if keep_outputs:
            out.loss.backward()
        else:
            loss = out.loss
            del out
            loss.backward()
            del loss
    return run
