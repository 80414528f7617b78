import json
import os
import sys
import tempfile

os.environ["DS_ACCELERATOR"]="cpu"
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

stage=int(sys.argv[1]); world=int(sys.argv[2]); extra=json.loads(sys.argv[3]) if len(sys.argv)>3 else {}
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29513")
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
import deepspeed

deepspeed.init_distributed()
from memplan.verify.cputrace import tiny_causal_lm

cfg = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
              "max_position_embeddings": 512}
zero = {"stage": stage, "reduce_bucket_size": 500000, "contiguous_gradients": True}
zero.update(extra.get("zero", {}))
ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": extra.get("ga",1), "train_batch_size": world*extra.get("ga",1),
      "bf16": {"enabled": not extra.get("fp16")}, "fp16": {"enabled": bool(extra.get("fp16")), "initial_scale_power": 1},
      "zero_optimization": zero,
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": True}} if not extra.get("offload") else
                   {"type": "AdamW", "params": {"lr": 1e-5}}, "gradient_clipping": 1.0, "steps_per_print": 10**9}
import functools
import inspect

from torch.profiler import ProfilerActivity, profile, record_function


def annotate(cls, prefix):
    for name, fn in list(vars(cls).items()):
        if inspect.isfunction(fn) and not name.startswith("__"):
            def wrap(fn=fn, name=name):
                @functools.wraps(fn)
                def w(*a, **k):
                    with record_function(f"{prefix}.{name}"):
                        return fn(*a, **k)
                return w
            setattr(cls, name, wrap())
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

for c, p in ((DeepSpeedZeroOptimizer, "z12"), (DeepSpeedZeroOptimizer_Stage3, "z3"), (PartitionedParameterCoordinator, "coord"), (DeepSpeedEngine, "engine")):
    annotate(c, p)
import deepspeed.runtime.bf16_optimizer as bfo

annotate(bfo.BF16_Optimizer, "bf16opt")
def run_all():
    global engine
    if stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=ds):
            model = tiny_causal_lm(cfg, "fp16" if extra.get("fp16") else "bf16", attention="sdpa")
    else:
        model = tiny_causal_lm(cfg, "fp16" if extra.get("fp16") else "bf16", attention="sdpa")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    ids = torch.randint(0, 1000, (1, 128))
    for s in range(2):
        for m in range(extra.get("ga",1)):
            with record_function(f"MARK.step{s}.micro{m}.forward"): pass
            loss = engine(input_ids=ids, labels=ids).loss
            with record_function(f"MARK.step{s}.micro{m}.backward"): pass
            engine.backward(loss)
            del loss
            with record_function(f"MARK.step{s}.micro{m}.step"): pass
            engine.step()
with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
    run_all()
fd, path = tempfile.mkstemp(suffix=".json"); os.close(fd)
prof.export_chrome_trace(path)
tr = json.load(open(path))["traceEvents"]
ops = sorted([(e["ts"], e["ts"]+e["dur"], e["name"]) for e in tr if e.get("ph")=="X" and e.get("cat") in ("cpu_op","user_annotation")])
marks = sorted([(e["ts"], e["name"]) for e in tr if e.get("name","").startswith("MARK.")])
mem = sorted([e for e in tr if e.get("name")=="[memory]"], key=lambda e:e["ts"])
out=[]
for e in mem:
    b=e["args"]["Bytes"]
    if abs(b)<=8: continue
    ts=e["ts"]
    inner=[o for o in ops if o[0]<=ts<=o[1]]
    ds_frames=[o[2] for o in sorted(inner, key=lambda o:o[0]) if o[2].split(".")[0] in ("z12","z3","coord","engine","bf16opt")]
    top = "/".join(ds_frames[-3:]) if ds_frames else "?"
    ph = [m[1] for m in marks if m[0] <= ts]
    top = (ph[-1][5:] if ph else "init") + " " + top
    cop = min(inner, key=lambda o:o[1]-o[0])[2] if inner else "?"
    out.append((b, e["args"]["Addr"], cop, top))
json.dump(out, open(sys.argv[4] if len(sys.argv)>4 else "/tmp/dst/out.json","w"))
print("events", len(out))
