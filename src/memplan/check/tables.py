"""The committed tables (tables.json, written by gen_tables.py from the sources they describe)."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

#: accelerate launch flags (huggingface/accelerate src/accelerate/commands/launch.py, launch_command_parser,
#: commit 00785cd): a partial list, so unknown accelerate flags are reported as info, not errors.
ACCELERATE_FLAGS: dict[str, bool] = {
    "--config_file": True, "--quiet": False, "-q": False, "--cpu": False, "--multi_gpu": False, "--tpu": False,
    "--ipex": False, "--mixed_precision": True, "--num_processes": True, "--num_machines": True,
    "--num_cpu_threads_per_process": True, "--enable_cpu_affinity": False, "--dynamo_backend": True,
    "--dynamo_mode": True, "--dynamo_use_fullgraph": False, "--dynamo_use_dynamic": False,
    "--use_deepspeed": False, "--use_fsdp": False, "--use_megatron_lm": False, "--use_xpu": False,
    "--gpu_ids": True, "--same_network": False, "--machine_rank": True, "--main_process_ip": True,
    "--main_process_port": True, "--tee": True, "-t": True, "--log_dir": True, "--role": True,
    "--rdzv_backend": True, "--rdzv_conf": True, "--max_restarts": True, "--monitor_interval": True,
    "--module": False, "-m": False, "--no_python": False, "--deepspeed_config_file": True, "--zero_stage": True,
    "--offload_optimizer_device": True, "--offload_param_device": True, "--offload_optimizer_nvme_path": True,
    "--offload_param_nvme_path": True, "--gradient_accumulation_steps": True, "--gradient_clipping": True,
    "--zero3_init_flag": True, "--zero3_save_16bit_model": True, "--deepspeed_hostfile": True,
    "--deepspeed_exclusion_filter": True, "--deepspeed_inclusion_filter": True,
    "--deepspeed_multinode_launcher": True, "--deepspeed_moe_layer_cls_names": True,
}


@lru_cache(maxsize=1)
def tables() -> dict:
    """tables.json as a dict (see gen_tables.py for what each key holds and where it comes from)."""
    return json.loads(Path(__file__).with_name("tables.json").read_text())


def launcher_flags(launcher: str) -> dict[str, bool]:
    """option → takes a value, for 'deepspeed', 'torchrun' or 'accelerate'."""
    if launcher == "accelerate":
        return ACCELERATE_FLAGS
    return tables()["launchers"][launcher]


def megatron_flags() -> dict[str, bool]:
    """Megatron-DeepSpeed's flags (megatron/arguments.py + deepspeed.add_config_arguments) → takes a value."""
    return tables()["megatron_deepspeed"]["flags"]
