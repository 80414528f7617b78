"""The estimator's allocation sequence for a bare forward + backward (no DeepSpeed), in the form the CPU trace
comparison uses (memplan.verify.cputrace, tests/test_ledger_trace.py): (±bytes, name) per event, with the
CUDA kernels' internal temporaries (names ending in ".tmp") left out. Pure."""

from __future__ import annotations

from ..hfconfig import model_from_config
from ..ledger import Ledger
from .autograd import Autograd
from .families import forward
from .transformer import Net, Params, Shape

#: the CPU trace drops tensors this small (wrapped scalars; memplan.verify.cputrace.SCALAR_BYTES)
SCALAR_BYTES = 8

#: tiny configs of each family for the comparison (transformers config kwargs)
TINY = {
    "llama": {"model_type": "llama", "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
              "max_position_embeddings": 512},
}


def model_events(config: dict, batch: int, seq: int, b: int = 2, checkpointing: bool = False
                 ) -> list[tuple[int, str]]:
    """(±bytes, name) of one loss-loop micro-step of ``config`` as the autograd model issues it
    (``checkpointing``: every decoder layer checkpointed the non-reentrant way, transformers' default)."""
    from .checkpoint import nonreentrant

    spec = model_from_config(dict(config), "tiny", "tiny test config")
    ledger = Ledger()
    ag = Autograd(ledger, on_param_grad=lambda param, grad: None)  # param.grad keeps the stolen grad
    params = Params(ag, spec, b, lambda name: True)
    layer_fn = nonreentrant(ag) if checkpointing else None
    out = forward(Net(ag, spec, Shape(batch, seq, seq, b), params, layer_fn=layer_fn))
    ag.release(out.logits)
    loss = out.loss
    ag.backward(loss, 4)
    ag.release(loss)
    events = []
    for ev in ledger.events:
        tid = ev if ev >= 0 else ~ev
        if ledger.names[tid].endswith(".tmp") or ledger.sizes[tid] <= SCALAR_BYTES:
            continue
        events.append((ledger.sizes[tid] if ev >= 0 else -ledger.sizes[tid], ledger.names[tid]))
    return events
