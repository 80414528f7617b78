"""Megatron's per-layer activation terms, worked by hand (memplan.megatron)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.megatron import layer_terms, outside_terms, selective_terms, stage_activations
from memplan.megatron.layer import (
    attention_path,
    before_scores_bytes_per_token,
    layer_input_bytes_per_token,
    score_peak_bytes_per_token,
)
from memplan.megatron.shape import padded_vocab, tokens_per_rank
from memplan.specs import Job, Layout, MegatronSpec, ModelSpec, TrainingSpec

#: Korthikanti et al. 2022 (arXiv 2205.05198) §4.1 counts the layer norms' inputs but not their fp32 statistics
STATS = ("input_layernorm.stats", "post_attention_layernorm.stats", "input_layernorm.invvar",
         "post_attention_layernorm.invvar")


def gpt(hidden=1024, heads=16, layers=4, vocab=50257, positions=32768) -> ModelSpec:
    return ModelSpec(name="toy", family="gpt2", hidden_size=hidden, num_layers=layers, num_heads=heads,
                     num_kv_heads=heads, head_dim=hidden // heads, intermediate_size=4 * hidden, vocab_size=vocab,
                     max_position_embeddings=positions, tie_word_embeddings=True, attention_bias=True,
                     attention_out_bias=True, mlp_bias=True, norm="layernorm", gated_mlp=False,
                     activation="gelu", position_embedding="learned")


def job(seq=2048, tp=1, sp_tp=False, attention="eager", checkpointing="none", dtype="fp16", sp=1, world=None,
        **meg) -> Job:
    meg = {"codebase": "megatron-core", "pipeline_engine": False, **meg}
    training = TrainingSpec(seq_len=seq, dtype=dtype, attention=attention, checkpointing=checkpointing,
                            model_impl="megatron", megatron=MegatronSpec(**meg))
    return Job(model=gpt(), training=training,
               layout=Layout(world=world or tp * sp, tp=tp, sp=sp, tp_sequence_parallel=sp_tp))


def per_token(j: Job, terms=None) -> int:
    terms = layer_terms(j.model, j) if terms is None else terms
    return sum(t.bytes_per_token for t in terms if t.name not in STATS)


def test_korthikanti_unfused_tp1_is_34_plus_5as_over_h():
    # Korthikanti et al. 2022 eq. (1): a layer keeps s·b·h·(34 + 5·a·s/h) bytes with 16-bit activations, fused
    # softmax, dropout everywhere, tp 1. Per token (s·b = 1): 34·h + 5·a·s. h = 1024, a = 16, s = 2048:
    #   34 · 1024 = 34816;  5 · 16 · 2048 = 163840;  together 198656 bytes.
    # The terms: LN inputs 2·2h, qkv input 2h, fused q|k|v 6h, softmax 2as, its dropout mask as, dropout
    # output 2as, dense input 2h, attention dropout mask h, fc1 input 2h, GeLU input 8h, fc2 input 8h, MLP
    # dropout mask h: 4 + 2 + 6 + 2 + 1 + 2 + 8 + 8 + 1 = 34 (·h) and 2 + 1 + 2 = 5 (·a·s).
    j = job(seq=2048, hidden_dropout=0.1, attention_dropout=0.1)
    assert attention_path(j.model, j) == "fused-softmax"
    assert per_token(j) == 34 * 1024 + 5 * 16 * 2048 == 198656


def test_megatron_deepspeed_without_memory_efficient_layernorm_is_korthikanti_too():
    j = job(seq=2048, hidden_dropout=0.1, attention_dropout=0.1, codebase="megatron-deepspeed",
            mem_efficient_ln=False)
    assert per_token(j) == 34 * 1024 + 5 * 16 * 2048


def test_memory_efficient_layernorm_drops_the_two_layernorm_inputs():
    # apex's memory-efficient LayerNorm saves its output (the next linear's input, already counted) and invvar
    # fp32 [T]: 34h − 2·2h = 30h, plus 2 · 4 bytes of invvar. 30 · 1024 + 163840 + 8 = 194568.
    j = job(seq=2048, hidden_dropout=0.1, attention_dropout=0.1, codebase="megatron-deepspeed")
    terms = layer_terms(j.model, j)
    assert sum(t.bytes_per_token for t in terms) == 30 * 1024 + 5 * 16 * 2048 + 2 * 4 == 194568


def test_korthikanti_tensor_parallel_and_sequence_parallel():
    # eq. (2), tp t without sequence parallelism: s·b·h·(10 + 24/t + 5·a·s/(h·t)); t = 2, per token:
    #   10 · 1024 + 24 · 1024 / 2 + 5 · 16 · 2048 / 2 = 10240 + 12288 + 81920 = 104448
    # eq. (4), with sequence parallelism: s·b·h/t·(34 + 5·a·s/h) = 198656 / 2 = 99328
    tp = job(seq=2048, tp=2, hidden_dropout=0.1, attention_dropout=0.1)
    assert per_token(tp) == 10240 + 12288 + 81920 == 104448
    tsp = job(seq=2048, tp=2, sp_tp=True, hidden_dropout=0.1, attention_dropout=0.1)
    assert per_token(tsp) == 198656 // 2 == 99328


def test_selective_recompute_keeps_34h():
    # Korthikanti §5: recomputing the core attention leaves 34·s·b·h (per token 34 · 1024 = 34816), and
    # 34·s·b·h/t with tensor and sequence parallelism (t = 2: 17408)
    j = job(seq=2048, checkpointing="selective", hidden_dropout=0.1, attention_dropout=0.1)
    assert per_token(j, selective_terms(j.model, j)) == 34 * 1024
    j2 = job(seq=2048, tp=2, sp_tp=True, checkpointing="selective", hidden_dropout=0.1, attention_dropout=0.1)
    assert per_token(j2, selective_terms(j2.model, j2)) == 34 * 1024 // 2


def test_torch_softmax_path_above_the_kernel_limit():
    # s = 8192 > 4096: FusedScaleMaskSoftmax falls back to forward_torch_softmax; in fp32 the softmax output
    # is 4 bytes, the dropout mask 1, the dropout output 2: 7·a·s per token = 7 · 16 · 8192 = 917504
    j = job(seq=8192, hidden_dropout=0.1, attention_dropout=0.1)
    assert attention_path(j.model, j) == "torch-softmax"
    assert per_token(j) == 34 * 1024 + 7 * 16 * 8192
    # no attention dropout: fp32 softmax 4 + its 16-bit cast 2 = 6·a·s; no masks: 32·h
    j0 = job(seq=8192, hidden_dropout=0, attention_dropout=0)
    assert per_token(j0) == 32 * 1024 + 6 * 16 * 8192


def test_core_attention_score_peaks_by_hand():
    # bf16, s = 8192, 16 heads, tp 1 (torch-softmax, softmax in fp32): a·s = 16 · 8192 score elements a token.
    # Forward, at probs.bfloat16(): baddbmm's output 2, input.float() 4, softmax's output 4, the cast 2 = 12.
    # Backward (CUDA): the saved fp32 output, the incoming fp32 grad, the new grad, tmp = grad * output: 16
    j = job(seq=8192, dtype="bf16", hidden_dropout=0, attention_dropout=0)
    assert score_peak_bytes_per_token(j.model, j) == (12 * 16 * 8192, 16 * 16 * 8192)
    # fp32 training: no copy and no cast (4 + 4); the fused kernel (s = 2048): scores and output, 2b both ways
    j32 = job(seq=8192, dtype="fp32", hidden_dropout=0, attention_dropout=0)
    assert score_peak_bytes_per_token(j32.model, j32) == (8 * 16 * 8192, 16 * 16 * 8192)
    jf = job(seq=2048, dtype="bf16", masked_softmax_fusion=True)
    assert attention_path(jf.model, jf) == "fused-softmax"
    assert score_peak_bytes_per_token(jf.model, jf) == (4 * 16 * 2048, 4 * 16 * 2048)
    jflash = job(attention="flash", dtype="bf16")
    assert score_peak_bytes_per_token(jflash.model, jflash) == (0, 0)
    # before the score matmul the layer has saved LN1's input 2h and stats 8, the qkv input 2h, qkv 6h
    assert before_scores_bytes_per_token(layer_terms(j.model, j)) == 10 * 1024 + 8


def test_stage_score_peaks_count_the_other_layers_once():
    # no recompute: the forward peak is in the last layer, beside the three layers before it
    j = job(seq=8192, dtype="bf16", hidden_dropout=0, attention_dropout=0)
    a = stage_activations(j.model, j, layers=4)
    fwd, _ = score_peak_bytes_per_token(j.model, j)
    before = before_scores_bytes_per_token(layer_terms(j.model, j))
    embedding_side = sum(t.bytes_per_token for t in outside_terms(j.model, j, True, False))
    assert a.forward_layer_peak == 3 * a.layer_saved + (embedding_side + before + fwd) * 8192


def test_flash_path_by_hand():
    # FlashSelfAttention, tp 1, b = 1, no dropout (bf16, h = 1024, 16 heads):
    #   LN1 in 2h, qkv in 2h, q/k/v copies 6h, kernel out 2h (the dense input: rearranged without a copy at
    #   b = 1), lse 4·16 = 64, LN2 in 2h, fc1 in 2h, GeLU in 8h, fc2 in 8h: 32h + 64, and 2 · 8 of LN stats
    j = job(seq=8192, attention="flash", dtype="bf16", hidden_dropout=0, attention_dropout=0)
    assert sum(t.bytes_per_token for t in layer_terms(j.model, j)) == 32 * 1024 + 64 + 16


def test_full_recompute_keeps_the_layer_input_and_one_chunk():
    j = job(seq=2048, attention="flash", dtype="bf16", checkpointing="full", recompute_num_layers=2)
    assert layer_input_bytes_per_token(j.model, j) == 2 * 1024
    a = stage_activations(j.model, j, layers=4)
    tokens = 2048
    assert a.saved_layers == 2 * 2 * 1024 * tokens  # two chunks of two layers, each keeps its input
    assert a.recompute == 2 * a.layer_full  # a chunk of two layers is alive while it is recomputed


def test_deepspeed_partition_and_cpu_checkpointing():
    base = {"seq": 2048, "tp": 4, "attention": "flash", "dtype": "bf16", "checkpointing": "full",
                "codebase": "megatron-deepspeed", "deepspeed_activation_checkpointing": True}
    part = job(**base, partition_activations=True)
    assert layer_input_bytes_per_token(part.model, part) == 2 * 1024 // 4
    cpu = job(**base, partition_activations=True, checkpoint_in_cpu=True)
    assert layer_input_bytes_per_token(cpu.model, cpu) == 0


def test_gptmodelpipe_does_not_split_the_sequence_over_ulysses_ranks():
    pipe = job(seq=8192, sp=4, attention="flash", dtype="bf16", codebase="megatron-deepspeed", pipeline_engine=True)
    assert tokens_per_rank(pipe) == 8192
    plain = job(seq=8192, sp=4, attention="flash", dtype="bf16", codebase="megatron-deepspeed",
                pipeline_engine=False)
    assert tokens_per_rank(plain) == 2048


def test_padded_vocab_and_outside_loss():
    # 50257 padded to a multiple of 128 · tp: 50304 at tp 1, 50432 at tp 2
    assert padded_vocab(50257, 1) == 50304 and padded_vocab(50257, 2) == 50432
    j = job(seq=2048, tp=2, attention="flash", dtype="bf16")
    loss = next(t for t in outside_terms(j.model, j) if t.name == "loss.softmax")
    assert loss.bytes_per_token == 4 * 50432 // 2


@settings(max_examples=40, deadline=None)
@given(tp=st.sampled_from([1, 2, 4, 8]), seq=st.sampled_from([1024, 2048, 8192]),
       attention=st.sampled_from(["eager", "flash"]), sp_tp=st.booleans())
def test_more_tp_never_keeps_more(tp, seq, attention, sp_tp):
    sp_tp = sp_tp and tp > 1
    j = job(seq=seq, tp=tp, sp_tp=sp_tp, attention=attention, dtype="bf16")
    one = job(seq=seq, tp=1, attention=attention, dtype="bf16")
    assert per_token(j) <= per_token(one)
    sel = job(seq=seq, tp=tp, sp_tp=sp_tp, attention=attention, dtype="bf16", checkpointing="selective")
    assert per_token(sel, selective_terms(sel.model, sel)) <= per_token(j)
