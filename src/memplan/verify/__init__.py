"""`memplan verify`: measure a Job on a GPU, the definition of what memplan predicts.

Measurement protocol (what "peak" means: torch.cuda.max_memory_allocated over the first steps). One process
per job (per depth, per rank):

1. Ranks. Emulated (default): rank 0 of an N-rank job on one GPU through torch's fake process group
   (FakeStore, ``dist.init_process_group("fake")``, RANK/LOCAL_RANK/WORLD_SIZE/MASTER_* set, then
   ``deepspeed.init_distributed()``; ../shared/docs/emulation.md). Real (``--launch``): the same worker under
   ``torchrun --standalone --nproc_per_node=<world>`` with NCCL on one node; every rank writes its row and the
   most loaded rank is reported. Children get NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
   NVSHMEM_DISABLE_NVLS=1.
2. DeepSpeed config: ``memplan.dsconfig_emit.to_ds_config(job)``, every ZeroSpec field explicit.
3. Model: ``AutoModelForCausalLM.from_config`` of the preset's config.json (``AutoConfig.for_model``), random
   init, nothing downloaded, no remote code, ``use_cache=False``, the training dtype, built directly on the GPU
   (under ``deepspeed.zero.Init(config_dict_or_path=ds_config)`` for ZeRO-3), in training mode. Attention:
   eager → "eager", sdpa → "sdpa", flash → "sdpa" run inside ``sdpa_kernel(SDPBackend.FLASH_ATTENTION)``
   (the flash-attn package is not used; the row records this). Checkpointing full →
   ``model.gradient_checkpointing_enable()`` with transformers' default kwargs; selective → "unsupported".
4. Ulysses (sp > 1): ``UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, micro_batch,
   seq_length=seq, seq_length_is_variable=False)``; its mpu goes to ``deepspeed.initialize``. Each rank's batch
   is micro_batch × seq/sp tokens with the position_ids of its shard. gpt2 and eager → "unsupported".
5. ``engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)``.
6. Train ``--steps`` (3) optimizer steps of grad_accum micro-steps: ``loss = engine(input_ids=ids,
   labels=ids).loss`` (random ids in [0, vocab), shape [micro_batch, seq/sp], made before the phase's counter
   reset), ``engine.backward(loss)``, ``engine.step()`` after every micro-step; only the loss is kept.
7. Phases: "init" (build + initialize), then "step{s}.micro{m}.forward" / ".backward" / ".step". Each starts
   with ``torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()`` and ends reading
   max_memory_allocated, max_memory_reserved, memory_allocated. ``peak_allocated_bytes`` is the maximum over
   the training phases (init excluded; ``init_peak_allocated_bytes`` apart). see_memory_usage and
   memory_breakdown are never used (they reset the peak).
8. Timeline: in step 0, micro 0 only, forward pre/post hooks on every decoder layer, the final norm and the
   lm_head, and full backward pre/post hooks on the layers when checkpointing is off and ZeRO < 3, recording
   memory_allocated (no synchronize) under labels such as "forward, layer 3, after".
9. Meta pass: the full-depth model on the meta device, its parameter count beside memplan.params.count_params.
10. Failures are results: an OOM → status "oom" with its phase ("measured: OOM in step0.micro0.backward"),
    any other exception → "error" with its one-line message, the parent's wall-clock limit → "timeout", what
    the harness cannot run → "unsupported". Tracebacks go to the worker's log file, never the console.
11. ``--layers K``: the full-width model at K and 2K layers (two processes); every peak and phase peak is
    extrapolated to the full depth L by P(L) = P(K) + (L−K)·(P(2K)−P(K))/K; the row keeps both measurements.

Modules: worker (the measuring process), phases (counters, hooks), hfbuild (transformers side), runner
(parent: subprocesses, timeout, assembly), compare (predicted vs measured), report (JSON/Markdown/rich),
batch (a matrix of jobs on one GPU), command (the CLI's add_arguments / run). Only worker, phases and
hfbuild's build functions import torch, deepspeed or transformers, and only inside functions.
"""
