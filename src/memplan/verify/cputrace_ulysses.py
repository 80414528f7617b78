"""The real allocation order of a micro-step under DeepSpeed's Ulysses sequence parallelism, on the CPU: torch's
fake process group (world = sp, this process rank 0, collectives filled from the rank's own shard:
memplan.verify.emulation), UlyssesSPAttentionHF.register_with_transformers on a tiny model, then one forward
(this rank's S/sp tokens, position_ids passed as the loop passes them) and backward, recorded as
memplan.verify.cputrace records a plain micro-step.

register_with_transformers replaces transformers' attention function for the whole process and the process
group is global, so each recording runs in its own interpreter: ``python -m memplan.verify.cputrace_ulysses
'<json args>'`` prints ``{"real": events, "predicted": events}`` as JSON, the estimator's
(memplan.estimator.model_check.model_events) computed in the same interpreter, since Gemma 3's RoPE tables are
made in set(layer_types)'s order, which string hashing makes per-interpreter (tests/test_ledger_trace.py).
Imports torch inside functions only.
"""

from __future__ import annotations

import json
import os
import sys


def record_ulysses(config: dict, batch: int, seq: int, sp: int, attention: str = "sdpa",
                   checkpointing: bool = False, port: int = 29517) -> list:
    """net_events of one Ulysses micro-step of ``config`` (see the module docstring)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(sp), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=sp)
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    from . import cputrace
    from .emulation import keep_collectives_finite

    deepspeed.init_distributed()
    keep_collectives_finite()
    torch.set_num_threads(1)
    model = cputrace.tiny_causal_lm(config, "bf16", attention)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation=attention, sequence_parallel_size=sp,
        micro_batch_size=batch, seq_length=seq, seq_length_is_variable=False)
    local = seq // sp
    ids = torch.randint(0, config["vocab_size"], (batch, local))
    positions = torch.arange(local).unsqueeze(0).expand(batch, -1)  # memplan.verify.worker's shard positions

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids, position_ids=positions).loss
        loss.backward()
        del loss

    return cputrace.net_events(cputrace.record(step))


def main(argv: list[str] | None = None) -> int:
    from ..estimator import model_check

    args = json.loads((argv or sys.argv[1:])[0])
    real = record_ulysses(**args)
    predicted = model_check.model_events(args["config"], batch=args["batch"], seq=args["seq"], dtype="bf16",
                                         attention=args.get("attention", "sdpa"), device="cpu",
                                         checkpointing=args.get("checkpointing", False), sp=args["sp"])
    print(json.dumps({"real": real, "predicted": predicted}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
