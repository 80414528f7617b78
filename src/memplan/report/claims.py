"""The seed article's numeric claims, each beside the figure memplan computes (section (b) of the seed report).

Byte figures: GB = 10^9 bytes (the article's unit), GiB = 2^30. P is the preset's parameter count
(memplan.params.count_params, checked against transformers' meta-device model in tests/test_params.py).
"""

from __future__ import annotations

from ..params import count_params
from ..render import component_bytes
from ..result import Estimate
from .doc import Block, Heading, Para, Table
from .page import gb, gib

#: the claim headings, in the article's order (tests check each appears in the report)
CLAIM_HEADINGS = (
    "Claim 1: 176B parameters in fp16 take about 352 GB",
    "Claim 2: ZeRO-3 over 8 GPUs leaves 44 GB of parameters per GPU, not resident",
    "Claim 3: Adam states are 12× the parameters, 105.6 GB per GPU, near 0 with offload",
    "Claim 4: gradients are 44 GB per GPU, far less at peak",
    "Claim 5: activations at 32K are over 100 GB per GPU without Ulysses, 10–15 GB with SP 8",
    "Claim 6: under 24 GB per GPU in total (log: max_memory_allocated 23.7 / 80.0 GB)",
    "Claim 7: TP=2, PP=2, SP=2 may be more efficient than TP=1, PP=2, SP=4",
)
#: bytes per parameter DeepSpeed keeps for mixed-precision Adam on the rank owning the partition: fp32 master
#: (stage3.py fp32_partitioned_groups_flat) + exp_avg + exp_avg_sq (torch / DeepSpeedCPUAdam state), 4 each
ADAM_BYTES_PER_PARAM = 12
#: fp32 gradient partition DeepSpeed keeps on the host under ZeRO-3 offload_optimizer (stage3.py, the CPU
#: fp32 grad partition DeepSpeedCPUAdam reads)
HOST_GRAD_BYTES_PER_PARAM = 4


def _table(rows: list[tuple[str, str, str]]) -> Table:
    return Table(("", "the article", "memplan"), tuple(rows))


def claim_params(est: Estimate) -> list[Block]:
    p = count_params(est.job.model).total_params
    return [Heading(CLAIM_HEADINGS[0], 3), _table([
        ("parameters", "176B", (f"{p:,} ({p / 1e9:.2f}B): GPT-2 blocks at hidden 12288, 96 layers, vocab 50257, "
                               "32768 learned positions, tied embedding")),
        ("fp16 bytes (2 per parameter)", "176B × 2 = 352 GB", f"{gb(2 * p)} ({gib(2 * p)})")]),
        Para(f"**Arithmetic right, count slightly high**: the configuration has {p / 1e9:.2f}B parameters, so "
             f"{gb(2 * p)}, not 352 GB: the shape is GPT-3's (175B); 176B is BLOOM's count, a different shape.")]


def claim_partition(est: Estimate) -> list[Block]:
    p = count_params(est.job.model).total_params
    comp = component_bytes(est)
    return [Heading(CLAIM_HEADINGS[1], 3), _table([
        ("16-bit parameters per GPU", "352 GB / 8 = 44 GB", (f"P × 2 / 8 = {gb(2 * p // 8)}; estimator "
         f"`params_16bit` (padded partitions) {gb(comp.get('params_16bit', 0))} = {gib(comp.get('params_16bit', 0))}")),
        ("resident?", "no: fetched when needed", (f"yes: the partitions stay on the GPU all run (only "
         f"offload_param moves them); what is fetched is the gathered working set, `params_gathered` "
         f"{gib(comp.get('params_gathered', 0))} at the peak"))]),
        Para("**Number right, residency wrong**: a rank's 1/8 partition of the fp16 parameters is allocated for "
             f"the whole run. It alone is {gib(comp.get('params_16bit', 0))}, more than the 24 GB the article "
             "promises for everything.")]


def claim_adam(est: Estimate, plan_host_ram_bytes: int) -> list[Block]:
    p = count_params(est.job.model).total_params
    per_rank = ADAM_BYTES_PER_PARAM * p // 8
    host = est.host_bytes_per_node
    return [Heading(CLAIM_HEADINGS[2], 3), _table([
        ("formula", "(176B × 12 × 4 bytes) / 8", ("12 already counts bytes: fp32 master 4 + exp_avg 4 + exp_avg_sq 4 "
                                                 "per parameter, on the rank owning the partition")),
        ("per GPU without offload", "105.6 GB (the formula gives 1,056 GB)",
         f"P × 12 / 8 = {gb(per_rank)} ({gib(per_rank)}); at a nominal 176B, 264 GB"),
        ("on the GPU with offload_optimizer cpu", "near 0", "0: master and Adam states live in pinned host RAM"),
        ("host RAM per node with offload", "not mentioned",
         (f"{gb(host)} ({gib(host)}): 8 ranks × (12 + {HOST_GRAD_BYTES_PER_PARAM} fp32 grad) bytes × P / 8, "
         f"plus staging buffers; a DGX A100 640GB node has {gb(plan_host_ram_bytes)}"))]),
        Para(f"**Wrong twice, then right**: the formula multiplies bytes by 4 again and its result is misprinted "
             f"by 10× (1,056 GB, not 105.6 GB); the real figure is {gb(per_rank)} per GPU. Offload does move it "
             f"off the GPU, but onto {gb(host)} of pinned host RAM per node, "
             + ("more than" if host > plan_host_ram_bytes else "within")
             + f" the {gb(plan_host_ram_bytes)} of the A100 server the plan assumes.")]


def claim_grads(est: Estimate) -> list[Block]:
    p = count_params(est.job.model).total_params
    comp = component_bytes(est)
    inflight = sum(comp.get(k, 0) for k in ("grad_bucket", "layer_backward_transient", "tied_embedding_grad"))
    return [Heading(CLAIM_HEADINGS[3], 3), _table([
        ("fp16 gradient partition", "176B × 2 / 8 = 44 GB", f"P × 2 / 8 = {gb(2 * p // 8)} if it stayed on the GPU"),
        ("on the GPU at the peak", "far less", (f"{gib(comp.get('gradients', 0))} partition (ZeRO-3 offload_optimizer "
         f"keeps the fp32 gradient partition on the host) + {gib(inflight)} in flight (reduce bucket, the layer's "
         "weight grads, the tied embedding's full grad)"))]),
        Para(f"**Right**: with offload_optimizer the gradient partition lives on the host; at the peak "
             f"{gib(inflight)} of gradients are on the GPU.")]


def claim_activations(no_sp: Estimate, sp8: Estimate, sp8_full: Estimate, no_sp_full: Estimate,
                      eager: Estimate | None) -> list[Block]:
    def act(e: Estimate) -> str:
        return gib(component_bytes(e).get("activations", 0))

    rows = [("no Ulysses (sp 1, dp 8), no checkpointing", "over 100 GB", act(no_sp)),
            ("Ulysses sp 8, no checkpointing (the seed's config)", "10–15 GB", act(sp8)),
            ("sp 1, full checkpointing", "—", act(no_sp_full)),
            ("sp 8, full checkpointing", "—", act(sp8_full))]
    if eager is not None:
        rows.append(("sp 8, eager attention (the launch has no flash flag)", "—", act(eager)))
    return [Heading(CLAIM_HEADINGS[4], 3), Table(("activations per GPU at seq 32768 (sdpa unless said)",
                                                  "the article", "memplan"), tuple(rows)),
            Para("**Right only with full activation checkpointing**, which neither the DeepSpeed config nor the "
                 f"launch line turns on: without it, 96 layers at 4096 tokens per rank keep {act(sp8)}. Ulysses "
                 "does divide the activations by 8 (all but attention's all-to-all buffers). The article's "
                 "O(batch·seq²·hidden) is also off: materialised scores are batch·heads·seq² (eager), and sdpa / "
                 "flash attention keep nothing quadratic.")]


def claim_total(sp8: Estimate, sp8_full: Estimate, measured_full_bytes: int) -> list[Block]:
    part = component_bytes(sp8).get("params_16bit", 0)
    return [Heading(CLAIM_HEADINGS[5], 3), _table([
        ("peak per GPU", "under 24 GB", (f"device total {gib(sp8.device_total_bytes)} "
         f"({'fits' if sp8.fits_gpu else 'does not fit'} an A100-80GB); with full checkpointing "
         f"{gib(sp8_full.device_total_bytes)} ({'fits' if sp8_full.fits_gpu else 'does not fit'} an A100-80GB)")),
        ("max_memory_allocated", "23.7 GB", (f"{gb(sp8.peak_allocated_bytes)} predicted; {gb(measured_full_bytes)} "
         "measured-and-extrapolated on an H200 (evidence below)")),
        ("floor", "—", (f"the 16-bit partition alone is {gb(part)}, above 23.7 GB whatever else is done, "
                       "short of offload_param"))]),
        Para(f"**Wrong**: {'not even full checkpointing gets' if not sp8_full.fits_target else 'only full checkpointing gets'}"
             f" the article's configuration under 24 GiB; the log line cannot "
             f"come from it (max_memory_allocated includes the resident {gb(part)} partition). Section (c) "
             "lists what does reach 24 GiB.")]


def claim_layouts(problems: dict[str, str]) -> list[Block]:
    rows = tuple((layout, "may be more efficient" if i == 0 else "the baseline", why)
                 for i, (layout, why) in enumerate(problems.items()))
    return [Heading(CLAIM_HEADINGS[6], 3), Table(("layout (ZeRO-3, 8 GPUs)", "the article", "memplan check rules"),
                                                 rows),
            Para("**Moot**: neither layout starts. Megatron-DeepSpeed's DeepSpeed sequence parallelism asserts "
                 "tp = pp = 1, and DeepSpeed refuses ZeRO-2/3 with pipeline parallelism; the launch's "
                 "`--sequence-parallel-size` is not even a Megatron-DeepSpeed flag (it is "
                 "`--ds-sequence-parallel-size`). On 8 GPUs with ZeRO-3 the Ulysses choices are sp 1, 2, 4, 8 "
                 "with tp = pp = 1.")]
