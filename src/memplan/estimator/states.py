"""Model states on one rank under DeepSpeed 0.19.8: parameters, master weights, optimizer states, gradients.

Symbols: P parameters this rank's model replica holds (after tp / pp), N the ZeRO partition group (dp·sp),
b bytes of the 16-bit (or fp32) training dtype, g bytes of the gradient-accumulation dtype, c bytes of the
communication dtype (fp32 under Ulysses by default), B_r reduce_bucket_size (elements), L the largest
parameter's numel. Sources are DeepSpeed files under deepspeed/runtime/.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..units import round_up
from .flat_groups import NCCL_START_ALIGNMENT_FACTOR
from .optim import fused_fp16_optimizer


@dataclass(frozen=True, slots=True)
class OptimizerKind:
    """Bytes of state per (master) parameter element an optimizer keeps, and where it runs."""

    states_per_param: int  # how many state tensors of the master dtype
    fused: bool  # one multi-tensor kernel (no per-step temporaries)


#: adamw: FusedAdam, exp_avg + exp_avg_sq (ops/adam/fused_adam.py); torch_adamw: torch.optim.AdamW
#: (foreach: temporaries of the size of a parameter group, see step_transient); cpu_adam: DeepSpeedCPUAdam
#: (states on the host); sgd: torch.optim.SGD with momentum (one momentum_buffer; memplan's SGD is
#: momentum SGD, as `verify` configures it); lion: FusedLion, exp_avg only.
OPTIMIZERS = {
    "adamw": OptimizerKind(2, True),
    "torch_adamw": OptimizerKind(2, False),
    "torch_adamw_fused": OptimizerKind(2, True),  # torch.optim.AdamW(fused=True): _fused_adamw_, no foreach temps
    "cpu_adam": OptimizerKind(2, True),
    "sgd": OptimizerKind(1, True),
    "lion": OptimizerKind(1, True),
}


def fp32_accumulation(job) -> bool:
    """16-bit training whose grads DeepSpeed accumulates in fp32 (data_types.grad_accum_dtype fp32; engine.py
    get_data_types): stage_1_and_2.py _use_compact_grad_partition_buffer's condition, and BF16_Optimizer's."""
    t = job.training
    return t.grad_accum_dtype == "fp32" and t.dtype != "fp32"


def picks_bf16_optimizer(job) -> bool:
    """engine.py _do_optimizer_sanity_check picks BF16_Optimizer for bf16 at ZeRO stage 1 with fp32 gradient
    accumulation and no optimizer offload (and for bf16 at stage 0 under pipeline parallelism)."""
    t, z = job.training, job.training.zero
    if t.dtype != "bf16":
        return False
    return (z.stage == 1 and fp32_accumulation(job) and z.offload_optimizer == "none") or (
        z.stage == 0 and job.layout.pp > 1)


@dataclass(frozen=True, slots=True)
class States:
    """Persistent and phase-dependent model-state bytes on the GPU, and host / NVMe bytes per rank."""

    params_16bit: int  # flat 16-bit params (stage 0-2) or 16-bit partitions (stage 3)
    params_persistent: int  # ZeRO-3 params kept gathered (numel <= persistence threshold)
    master_fp32: int  # fp32 master copy on the GPU
    optimizer_states: int  # optimizer states on the GPU (after the first step)
    grads_resident: int  # gradient bytes alive between backward and step on the GPU
    grads_full: int  # full 16-bit grads kept across micro-steps (stage 0; stage 1 with accumulation)
    grad_bucket: int  # IPG bucket(s) alive during backward
    step_transient: int  # extra bytes while the step prepares the grads (norm, flatten, fp32 cast)
    step_grad_fp32: int  # the fp32 grads alive while the optimizer itself runs
    offload_staging: int  # GPU staging buffers for offload
    host_bytes: int  # pinned host RAM for this rank
    nvme_bytes: int  # NVMe bytes for this rank
    grad_accum_buffer: int = 0  # BF16_Optimizer's persistent fp32 gradient buffer (full size)
    full_grads_in_backward: bool = False  # 16-bit param.grad accumulate whole through backward (no hooks)
    states_at_init: bool = False  # the optimizer states exist before any step succeeds (FP16_Optimizer)


def stage0(p: int, b: int, optimizer: str) -> States:
    """No ZeRO. bf16/fp16: runtime/fp16/fused_optimizer.py FP16_Optimizer (DDP_BFLOAT16 for bf16):
    flat 16-bit params, fp32 flat master, optimizer states on the master; grads are param.grad (b·P);
    step() flattens [g.to(fp32)] → per-param fp32 copies (4P) plus the flat fp32 grad (4P), then frees
    the 16-bit grads; its initialize_optimizer_states runs one optimizer step on a zero fp32 grad at init, so the
    states exist even when every fp16 step overflows. fp32 training: the plain torch optimizer, states of 4
    bytes, created at its first step. A basic optimizer other than FusedAdam runs under FP16_UnfusedOptimizer
    (estimator/zero0.py): per-parameter fp32 copies, the step's fp32 grads (4P) beside the 16-bit ones."""
    opt = OPTIMIZERS[optimizer]
    master = 4 * p if b < 4 else 0  # mixed precision keeps fp32 masters (Micikevicius et al. 2018)
    state_bytes = (4 if master else b) * opt.states_per_param * p
    transient = (8 * p if fused_fp16_optimizer(optimizer) else 4 * p) if master else 0
    return States(b * p, 0, master, state_bytes, b * p, b * p, 0, transient, 4 * p if master else 0, 0, 0, 0,
                  states_at_init=bool(master))


def stage12(stage: int, p: int, n: int, b: int, c: int, bucket: int, overlap: bool, largest: int,
            grad_buffer: int, grad_piece: int, grad_accum: int, optimizer: str, offload: str,
            compact_fp32: bool = False) -> States:
    """ZeRO-1/2: runtime/zero/stage_1_and_2.py DeepSpeedZeroOptimizer.

    - bit16_groups_flat: b·P padded to 2N elements; the fp32 partition 4·P/N (a clone, also when training
      in fp32: single_partition_of_fp32_groups); optimizer states on it.
    - gradients: grads_in_partition, in the training dtype, holds the whole of every parameter that
      overlaps the rank's partition (``grad_buffer`` elements; copy_grads_in_partition), allocated at the
      first reduction and freed at the step. Stage 1 with gradient accumulation keeps the full 16-bit
      grads (b·P) and the IPG bucket across non-boundary micro-steps, and reduces at the boundary.
    - IPG bucket B_r·c (×2 with overlap_comm) from the first gradient hook to the end of backward.
    - step: first the gradient norm upcasts each gradient piece to fp64 one at a time
      (get_grad_norm_direct: g.to(get_norm_dtype())), 8 bytes × the largest piece; then the partition is
      flattened (b·P/N) and cast to fp32 (4·P/N) while the 16-bit grads still live. The larger of the two.
    - offload_optimizer: master, fp32 grads and optimizer states on the host; a b·L GPU staging buffer
      (temp_grad_buffer_for_gpu_offload) and the bucket stay. With fp32 gradient accumulation of 16-bit
      training (``compact_fp32``: _use_compact_grad_partition_buffer) the reduced grads are added into an fp32
      partition on the GPU (_build_compact_grad_partition_buffer: zeros of 4·P/N, built at the first reduction,
      alive into the step), which copy_grads_in_partition copies to the host at the boundary.
    """
    opt = OPTIMIZERS[optimizer]
    p_pad = round_up(p, NCCL_START_ALIGNMENT_FACTOR * n)
    part = p_pad // n
    buckets = bucket * c * (2 if overlap else 1)
    grads = b * grad_buffer
    full_grads = b * p_pad if stage == 1 and grad_accum > 1 else 0
    master = 4 * part
    states = 4 * opt.states_per_param * part
    transient = max(8 * grad_piece, (b + 4) * part)
    if offload == "none":
        return States(b * p_pad, 0, master, states, grads, full_grads, buckets, transient, 4 * part, 0, 0, 0)
    # stage_1_and_2.py under cpu_offload, pinned (pin_memory on): the fp32 partition, its fp32 grad
    # (initialize_optimizer_states), the 16-bit buffer (param_buffer_of_bit16_for_cpu_offload_groups) and
    # temp_grad_buffer_for_cpu_offload (the largest parameter); the host optimizer's states are pageable
    nvme = master + states if offload == "nvme" else 0
    host = _pinned(4 * part) + _pinned(b * part) + _pinned(b * largest) + (0 if nvme else states + _pinned(master))
    compact = 4 * part if compact_fp32 else 0
    return States(b * p_pad, 0, 0, 0, compact, full_grads, buckets, 0, 0, b * largest, host, nvme)


#: DeepSpeedZeroOffloadOptimizerConfig.buffer_count (runtime/zero/offload_config.py): the NVMe optimizer swapper's
#: page-locked buffers of the largest sub-group (swap_tensor/optimizer_utils.py SwapBufferManager; DeepNVMe's own
#: allocator, exact sizes)
OPTIMIZER_SWAP_BUFFERS = 4
#: DeepSpeedZeroOffloadParamConfig buffer_count, buffer_size and max_in_cpu: the parameter swapper's pinned
#: buffers, and the partition elements NVMe offload keeps in host memory anyway (_create_param_groups_fp16_flat_cpu_memory)
PARAM_SWAP_BUFFERS, PARAM_SWAP_BUFFER_ELEMENTS, PARAM_MAX_IN_CPU = 5, 100_000_000, 1_000_000_000


@lru_cache(maxsize=4096)  # the body's import runs once per size: plan screens thousands of jobs
def _pinned(nbytes: int) -> int:
    """A pinned host tensor's block (CachingHostAllocator: the next power of two; estimator/places.py)."""
    from .places import pinned_block_bytes

    return pinned_block_bytes(nbytes)


def stage3(p3_part: int, persistent: int, b: int, g: int, c: int, bucket: int, optimizer: str,
           offload_optimizer: str, offload_param: str, sub_group: int) -> States:
    """ZeRO-3: runtime/zero/stage3.py DeepSpeedZeroOptimizer_Stage3 (the ledger's model: estimator/zero3.py).

    - 16-bit partitions b·P₃/N (each parameter padded to a multiple of N), persistent params gathered.
    - fp32 master 4·P₃/N and optimizer states; grad partitions g·P₃/N (grad_partitions_flat_buffer);
      the IPG bucket B_r·c (__ipg_bucket_flat_buffer, not doubled).
    - step per sub-group: flatten of its 16-bit grads and an fp32 copy (b + 4 per partition element of the
      largest sub-group, sub_group_size elements at most).
    - host memory (pinned buffers at their CachingHostAllocator block, the next power of two; pin_memory on):
      offload_optimizer cpu keeps the fp32 master (a pageable clone), the optimizer's states (DeepSpeedCPUAdam,
      pageable), each sub-group's fp32 grad (pinned) and grad_partitions_flat_buffer (pinned, g·P₃/N); the step's
      fp32 → 16-bit copy to the GPU converts on the host (b per element of the largest sub-group). nvme: master,
      states and fp32 grads on NVMe, the swapper's buffers and the grad buffer on the host. offload_param: the
      16-bit flat buffer pinned, plus zero.Init's per-parameter pinned partitions, which the host allocator keeps
      cached after _move_to_flat_buffer frees them (counted at their size: a lower bound of their blocks).
    """
    opt = OPTIMIZERS[optimizer]
    master = 4 * p3_part
    states = 4 * opt.states_per_param * p3_part
    grads = g * p3_part  # on the host with offload_optimizer (stage3.py: grads go to the CPU partition)
    largest = min(p3_part, sub_group)  # _create_fp16_sub_groups: sub_group_size elements or more each
    groups = max(1, -(-p3_part // sub_group))
    step = (b + 4) * largest
    params = 0 if offload_param != "none" else b * p3_part
    host = nvme = 0
    if offload_param != "none":  # kept from the model build on: the flat buffer, the cached partitions
        in_cpu = p3_part if offload_param == "cpu" else min(p3_part, PARAM_MAX_IN_CPU)
        host += _pinned(b * in_cpu) + b * p3_part
        if offload_param == "nvme":
            nvme += b * (p3_part - in_cpu)
            host += PARAM_SWAP_BUFFERS * PARAM_SWAP_BUFFER_ELEMENTS * b
        if offload_optimizer == "none":
            host += 4 * largest  # the step's GPU fp32 → host 16-bit copy converts on the host
    if offload_optimizer == "nvme":
        nvme += master + states + 4 * p3_part
        host += OPTIMIZER_SWAP_BUFFERS * 4 * largest + _pinned(g * p3_part)
    elif offload_optimizer == "cpu":
        fp32_grads = groups * _pinned(4 * largest)
        # initialize_optimizer_states pins the first fp32 grad next to its pageable original and the zero
        # buffer of the largest sub-group; grad_partitions_flat_buffer is pinned next to its original; from
        # the first step on the optimizer's states exist and the step converts each sub-group on the host
        first_pin = master + 8 * largest + _pinned(4 * largest)
        grad_pin = master + fp32_grads + g * p3_part + _pinned(g * p3_part)
        steady = master + states + fp32_grads + _pinned(g * p3_part) + (b * largest if offload_param == "none" else 0)
        host += max(first_pin, grad_pin, steady)
    if offload_optimizer != "none":
        master = states = grads = 0
        step = 0
    return States(params, persistent, master, states, grads, 0, bucket * c, step,
                  4 * min(p3_part, sub_group) if step else 0, 0, host, nvme)


def bf16_optimizer(p: int, n: int, optimizer: str, grad_accum_bytes: int = 4) -> States:
    """bf16 training, ZeRO-1, data_types.grad_accum_dtype fp32: engine._do_optimizer_sanity_check picks
    runtime/bf16_optimizer.py BF16_Optimizer. It keeps the flat bf16 params (2·P padded to 2N), an fp32
    master partition (4·P/N, fp32_groups_flat_partition), a FULL fp32 gradient buffer allocated at
    initialize (4·P padded, fp32_groups_gradients_flat, in the grad-accumulation dtype), and optimizer states
    on the partition; the bf16 param.grad accumulate whole during backward and are added into that buffer
    after it. The pipeline engine also takes this path for bf16 at ZeRO-0, accumulating in bf16."""
    opt = OPTIMIZERS[optimizer]
    p_pad = round_up(p, NCCL_START_ALIGNMENT_FACTOR * n)
    part = p_pad // n
    return States(2 * p_pad, 0, 4 * part, 4 * opt.states_per_param * part, 2 * p_pad, 2 * p_pad, 0, 0, 0, 0,
                  0, 0, grad_accum_buffer=grad_accum_bytes * p_pad, full_grads_in_backward=True)
