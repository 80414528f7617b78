"""The autograd model's attention kernels and families, pure (no torch).

The CPU trace (tests/test_ledger_trace.py) cannot see CUDA's kernels; these toy cases hold the CUDA models
(memplan.estimator.blocks_attention) to the allocations their docstrings cite from torch's source, with the
sizes worked out here from the shapes. The property test checks every family, attention path, device and
dtype frees everything it allocates except the parameter gradients .grad keeps.
"""

from __future__ import annotations

import pytest

from memplan.estimator import blocks_attention as A
from memplan.estimator import blocks_kernels as K
from memplan.estimator import model_check
from memplan.hfconfig import model_from_config
from memplan.params import parameter_tensors

B2 = 2  # bytes of bf16 / fp16
F32 = 4


def _ceil(x: int, m: int) -> int:
    return -(-x // m) * m


def _sizes(ledger, suffix: str) -> list[int]:
    """Bytes of every tensor whose name ends with ``suffix``, in allocation order (gradients, named grad.*,
    only when the suffix asks for them)."""
    grads = suffix.startswith("grad.")
    return [ledger.sizes[t] for t in range(len(ledger.sizes))
            if ledger.names[t].endswith(suffix) and ledger.names[t].startswith("grad.") == grads]


def _config(name: str, **over) -> dict:
    return {**model_check.TINY[name], **over}


@pytest.fixture
def no_cudnn(monkeypatch):
    """The dispatch of torch before cuDNN attention went first (or a GPU other than sm90 / sm100)."""
    monkeypatch.setattr(A, "CUDNN_FIRST", False)


class _Net:
    """What sdpa_kernel and grad_copies read of a Net (its shape: one rank holding the whole sequence)."""

    def __init__(self, device="cuda", attention="sdpa", backend=None):
        from memplan.estimator.transformer import Shape

        self.device, self.attention, self.sdpa_backend = device, attention, backend
        self.s = Shape(1, 16, 16, 2)


@pytest.mark.parametrize(("b", "head_dim", "mask", "gqa", "expected"), [
    (2, 64, False, True, "flash"),  # 16-bit, no mask: flash takes grouped-query heads
    (2, 20, False, False, "flash"),  # head_dim padded to 24 (pad_last_dim<8>)
    (2, 64, True, False, "efficient"),  # flash takes no mask
    (2, 20, True, False, "math"),  # efficient needs head_dim % 8 for 16-bit
    (4, 64, False, False, "efficient"),  # fp32: no flash
    (4, 64, False, True, "math"),  # efficient's backward needs equal heads
    (4, 18, False, False, "math"),  # fp32 needs head_dim % 4
    (2, 320, False, False, "efficient"),  # flash takes head_dim <= 256
])
def test_cuda_sdpa_kernel_follows_sdp_utils(no_cudnn, b, head_dim, mask, gqa, expected):
    g = A.Geometry(2, 64, 8, 2 if gqa else 8, head_dim, b)
    assert A.sdpa_kernel(_Net(), g, mask, 0.0, gqa) == expected


@pytest.mark.parametrize(("b", "head_dim", "mask", "dropout", "expected"), [
    (2, 64, False, 0.0, "cudnn"),  # 16-bit, head_dim a multiple of 8 up to 128
    (2, 128, True, 0.0, "cudnn"),  # cuDNN takes a mask
    (2, 64, False, 0.125, "cudnn"),  # dropout 2/16
    (2, 64, False, 0.1, "flash"),  # dropout not in steps of 1/16: the next in line
    (2, 256, False, 0.0, "flash"),  # head_dim over cuDNN 9.19's 128
    (2, 20, False, 0.0, "flash"),  # head_dim not a multiple of 8
    (2, 20, True, 0.0, "math"),
    (4, 64, False, 0.0, "efficient"),  # fp32: no cuDNN
])
def test_cuda_sdpa_kernel_tries_cudnn_first(b, head_dim, mask, dropout, expected):
    g = A.Geometry(2, 64, 8, 8, head_dim, b)
    assert A.CUDNN_FIRST
    assert A.sdpa_kernel(_Net(), g, mask, dropout, False) == expected
    assert A.select_kernel("cuda", "sdpa", None, g, mask, dropout, False) == expected


def test_dispatch_repeats_kv_unless_sdpa_takes_grouped_heads():
    g = A.Geometry(2, 64, 8, 2, 64, B2)
    kernel, seen, gqa = A.dispatch("cuda", "sdpa", None, g, False, 0.0)
    assert (kernel, seen, gqa) == ("cudnn", g, True)  # use_gqa_in_sdpa: no mask, head_dim <= 256
    kernel, seen, gqa = A.dispatch("cuda", "sdpa", None, g, True, 0.0)
    assert (kernel, seen.kv_heads, gqa) == ("cudnn", 8, False)  # a mask: repeat_kv to the query heads
    assert A.dispatch("cpu", "sdpa", None, g, True, 0.0)[0] == "cpu_flash"


def test_legacy_terms_ask_the_same_rule():
    from memplan.estimator.activations import sdpa_backend

    m = model_from_config(_config("llama_gqa"), "tiny", "tiny test config")
    g = A.Geometry(1, 2, m.num_heads, m.num_kv_heads, m.head_dim, B2)
    assert sdpa_backend(m, B2, "sdpa") == A.dispatch("cuda", "sdpa", None, g, False, m.attention_dropout)[0]
    assert sdpa_backend(m, F32, "sdpa") == "math"  # fp32 grouped-query heads: efficient refuses them
    assert sdpa_backend(m, B2, "eager") == "eager"
    masked = model_from_config(_config("mistral"), "tiny", "tiny test config")
    assert sdpa_backend(masked, B2, "sdpa") == "masked"


def test_cpu_and_forced_sdpa_kernels():
    g = A.Geometry(2, 64, 8, 8, 64, 2)
    assert A.sdpa_kernel(_Net("cpu"), g, True, 0.0, False) == "cpu_flash"
    assert A.sdpa_kernel(_Net("cpu"), g, False, 0.1, False) == "math"  # check_for_dropout
    assert A.sdpa_kernel(_Net(attention="flash"), A.Geometry(2, 64, 8, 8, 64, 4), False, 0.0, False) == "flash"
    assert A.sdpa_kernel(_Net(backend="math"), g, False, 0.0, False) == "math"


def test_cuda_cudnn_forward_and_backward_sizes():
    batch, seq = 2, 160
    cfg = _config("llama_gqa")  # 4 heads of 16, 2 key/value heads: enable_gqa, k and v keep their heads
    ledger, _ = model_check.micro_step(cfg, batch, seq, "bf16", "sdpa", "cuda")
    nh, kv, d = 4, 2, 16
    pre = "layers.0.self_attn.attn.cudnn"
    assert _sizes(ledger, f"{pre}.philox_seed") == [8]
    assert _sizes(ledger, f"{pre}.philox_offset") == [8]
    assert _sizes(ledger, f"{pre}.out") == [B2 * batch * seq * nh * d]
    assert _sizes(ledger, f"{pre}.logsumexp") == [F32 * batch * nh * seq]
    rows = F32 * batch * nh * seq
    # forward's workspace, then backward's: fp32 [B, nh, S, 2·d] (grouped-query, no mask), one fp32 row, 256 bytes
    assert _sizes(ledger, f"{pre}.workspace.tmp") == [256, rows * 2 * d + rows + 256]
    assert _sizes(ledger, f"{pre}.grad_out_copy.tmp") == [B2 * batch * seq * nh * d]
    assert _sizes(ledger, f"grad.model.{pre}.k") == [B2 * batch * seq * kv * d]
    assert _sizes(ledger, f"grad.model.{pre}.q") == [B2 * batch * seq * nh * d]
    assert _sizes(ledger, "layers.0.self_attn.attn.k_repeated") == []
    # the grads come back in the inputs' [B, S, nh, d] memory: the heads views' backward copies nothing
    assert A.grad_copies(_Net(), A.Geometry(batch, seq, nh, kv, d, B2), False, 0.0) == (False, False, False)


def test_cuda_flash_forward_and_backward_sizes(no_cudnn):
    batch, seq = 2, 160
    cfg = _config("llama_gqa")  # 4 heads of 16, 2 key/value heads
    ledger, _ = model_check.micro_step(cfg, batch, seq, "bf16", "sdpa", "cuda")
    nh, d = 4, 16
    assert _sizes(ledger, "layers.0.self_attn.attn.flash.out") == [B2 * batch * seq * nh * d]
    assert _sizes(ledger, "layers.0.self_attn.attn.flash.logsumexp") == [F32 * batch * nh * seq]
    s128, d32 = _ceil(seq, 128), _ceil(d, 32)
    assert _sizes(ledger, "layers.0.self_attn.attn.flash.softmax_d.tmp") == [F32 * batch * nh * s128]
    assert _sizes(ledger, "layers.0.self_attn.attn.flash.dq_accum.tmp") == [F32 * batch * s128 * nh * d32]
    # grouped-query heads: dk, dv are accumulated over the expanded heads first
    assert _sizes(ledger, "layers.0.self_attn.attn.flash.dk_expanded.tmp") == [B2 * batch * seq * nh * d]
    assert _sizes(ledger, "layers.0.self_attn.attn.k_repeated") == []  # no repeat_kv: enable_gqa
    assert _sizes(ledger, "grad.model.layers.0.self_attn.attn.flash.k") == [B2 * batch * seq * 2 * d]


def test_cuda_flash_pads_head_dim_to_eight():
    batch, seq = 2, 32
    ledger, _ = model_check.micro_step(_config("llama_head_dim_20"), batch, seq, "bf16", "sdpa", "cuda")
    nh, kv, d8 = 4, 2, 24
    pre = "layers.0.self_attn.attn.flash"
    assert _sizes(ledger, f"{pre}.q_padded") == [B2 * batch * nh * seq * d8]
    assert _sizes(ledger, f"{pre}.k_padded") == [B2 * batch * kv * seq * d8]
    assert _sizes(ledger, f"{pre}.out") == [B2 * batch * nh * seq * d8]
    # the sliced output is not [B, S, nh, d] in memory: transformers' .contiguous() copies it
    assert _sizes(ledger, "layers.0.self_attn.attn.out_contiguous") == [B2 * batch * nh * seq * 20]
    assert _sizes(ledger, f"grad.model.{pre}.q_unpadded") == [B2 * batch * nh * seq * 20]


def test_cuda_efficient_pads_logsumexp_and_mask(no_cudnn):
    batch, seq = 2, 40  # not a multiple of 16 or 32
    cfg = _config("mistral", num_key_value_heads=4)  # sliding window 16 <= seq: a mask; MHA
    ledger, _ = model_check.micro_step(cfg, batch, seq, "bf16", "sdpa", "cuda")
    nh, d = 4, 16
    pre = "layers.0.self_attn.attn.efficient"
    assert _sizes(ledger, f"{pre}.out") == [B2 * batch * seq * nh * d]
    assert _sizes(ledger, f"{pre}.logsumexp") == [F32 * batch * nh * _ceil(seq, 32)]
    assert _sizes(ledger, "layers.0.self_attn.attn.mask.float_mask") == [B2 * batch * seq * seq]
    assert _sizes(ledger, f"{pre}.mask_padded") == [B2 * batch * nh * seq * _ceil(seq, 16)]
    assert _sizes(ledger, f"{pre}.delta.tmp") == [F32 * batch * nh * seq]
    # kernel 64x64 (kMaxK 32 >= d): gq only, ⌈S/64⌉·⌈d/64⌉ tiles of 64·64 floats + a 16-byte lock
    tiles = _ceil(seq, 64) // 64 * (_ceil(d, 64) // 64)
    assert _sizes(ledger, f"{pre}.workspace.tmp") == [F32 * batch * nh * _ceil(tiles * (64 * 64 + 4), 4)]


def test_efficient_workspace_adds_gk_gv_when_the_output_leaves_registers():
    g = A.Geometry(1, 256, 2, 2, 128, B2)  # kernel 128x128, kMaxK 128 <= 128: kOutputInRF
    assert K.efficient_workspace_bytes(g, 0.0) == F32 * 2 * 2 * (128 * 128 + 4)
    g = A.Geometry(1, 256, 2, 2, 160, B2)  # kernel 64x64 k65536: gk, gv accumulate in gmem
    gq = 4 * 3 * (64 * 64 + 4)
    gkv = 2 * 4 * 64 * 192
    assert K.efficient_workspace_bytes(g, 0.0) == F32 * 2 * (gq + gkv)


def test_cuda_math_fallback_for_fp32_grouped_query_heads():
    batch, seq = 2, 32
    ledger, _ = model_check.micro_step(_config("llama_gqa"), batch, seq, "fp32", "sdpa", "cuda")
    nh, d = 4, 16
    pre = "layers.0.self_attn.attn.math"
    assert _sizes(ledger, f"{pre}.q_fp32") == []  # already fp32: .to returns q itself
    assert _sizes(ledger, f"{pre}.k_repeated") == [F32 * batch * nh * seq * d]  # repeat_interleave
    assert _sizes(ledger, f"{pre}.scores") == [F32 * batch * nh * seq * seq]
    assert _sizes(ledger, f"{pre}.causal_mask") == [F32 * seq * seq]


def test_cuda_dropout_keeps_a_bool_mask():
    batch, seq = 2, 32
    ledger, _ = model_check.micro_step(_config("gpt2"), batch, seq, "bf16", "eager", "cuda")
    numel = batch * seq * 64
    assert _sizes(ledger, "h.0.attn.resid_dropout.mask") == [numel]  # native_dropout: bool
    assert _sizes(ledger, "h.0.attn.resid_dropout.noise") == []  # the CPU's _dropout keeps a dtype noise


def test_cuda_layernorm_stats_are_fp32():
    ledger, _ = model_check.micro_step(_config("gpt2_nodrop"), 2, 32, "bf16", "sdpa", "cuda")
    assert _sizes(ledger, "h.0.ln_1.mean") == [F32 * 64]
    ledger, _ = model_check.micro_step(_config("gpt2_nodrop"), 2, 32, "bf16", "sdpa", "cpu")
    assert _sizes(ledger, "h.0.ln_1.mean") == [B2 * 64]


_PROPERTY_CASES = [(name, attention, device, dtype) for name in model_check.TINY if name != "llama"
                   for attention in ("sdpa", "eager") for device in ("cpu", "cuda") for dtype in ("bf16", "fp32")
                   if not (name.startswith("bloom") and attention == "sdpa")]


@pytest.mark.parametrize(("name", "attention", "device", "dtype"), _PROPERTY_CASES)
def test_micro_step_frees_everything_but_parameter_grads(name, attention, device, dtype):
    cfg = model_check.TINY[name]
    ledger, grads = model_check.micro_step(cfg, 2, 32, dtype, attention, device)
    spec = model_from_config(dict(cfg), "tiny", "tiny test config")
    params = {t.name: t.numel * model_check.DTYPE_BYTES[dtype] for t in parameter_tensors(spec)}
    assert sorted(grads) == sorted(params)  # a tied lm_head is the embedding: one grad, the sum of both
    assert ledger.live() == {g.storage.tid for g in grads.values()}
    for pname, g in grads.items():
        assert g.storage.nbytes == params[pname], pname


def test_cuda_trace_events_pair_frees_with_allocations():
    from memplan.verify import cudatrace

    entries = [{"action": "free_requested", "addr": 1, "size": 512},  # allocated before the recording
               {"action": "alloc", "addr": 7, "size": 1024}, {"action": "segment_alloc", "addr": 0, "size": 4096},
               {"action": "alloc", "addr": 9, "size": 512}, {"action": "free_requested", "addr": 7, "size": 1024},
               {"action": "free_completed", "addr": 7, "size": 1024}, {"action": "alloc", "addr": 7, "size": 1536}]
    assert cudatrace.net_events(entries) == [(1024, -1), (512, -1), (-1024, 0), (1536, -1)]


def test_model_events_in_blocks_keep_kernel_temporaries():
    cfg = model_check.TINY["llama_gqa"]
    plain = model_check.model_events(cfg, 2, 32, device="cuda")
    blocks = model_check.model_events(cfg, 2, 32, device="cuda", kernel_temporaries=True, blocks=True)
    assert len(blocks) > len(plain)
    assert all(abs(size) % 512 == 0 for size, _, _ in blocks)
    assert any(name.endswith(".tmp") for _, name, _ in blocks)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_softmax_backward_makes_cudas_grad_times_output_temporary(device):
    # F.softmax(x, -1, dtype=fp32) of a bf16 [1024] input (2 KiB): the fp32 copy 4 KiB, the output 4 KiB; in
    # backward _softmax_backward_data's grad of the copy 4 KiB, and on CUDA (SoftMax.cu
    # softmax_backward_cuda_out) tmp = grad * output 4 KiB, allocated after it and freed at once
    from memplan.estimator import blocks as B
    from memplan.estimator.autograd import Autograd
    from memplan.ledger import Ledger

    L = Ledger()
    ag = Autograd(L)
    x = ag.empty("x", 2048, requires_grad=True)
    x.node = None
    y = B.softmax(ag, x, 4096, "sm", device=device)
    ag.backward(y, 4096)
    events = [(L.names[e if e >= 0 else ~e], e >= 0) for e in L.events]
    grads = [ev for ev in events if ev[0].startswith("grad.sm")]
    assert grads[0] == ("grad.sm", True)
    tmp = [ev for ev in grads if ev[0] == "grad.sm.grad_times_output"]
    assert tmp == ([("grad.sm.grad_times_output", True), ("grad.sm.grad_times_output", False)]
                   if device == "cuda" else [])
    if device == "cuda":  # right after the grad it serves
        assert grads[1:3] == tmp
