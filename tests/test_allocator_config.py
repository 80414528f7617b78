"""AllocatorConfig and the PYTORCH_CUDA_ALLOC_CONF parser: toy cases, and the answers torch 2.11 gave on an H200
to the same strings (benchmarks/allocator/gpu/env.json, gpu_validate.py probe_confs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.allocator import AllocatorConfig, parse_alloc_conf

MiB = 2**20
ENV = Path(__file__).resolve().parents[1] / "benchmarks" / "allocator" / "gpu" / "env.json"


def test_defaults_are_torchs():
    c = AllocatorConfig()
    assert (c.expandable_segments, c.max_split_size_bytes, c.divisions_table, c.card_bytes) == (False, None, None, None)
    assert c.large_segment_size_bytes == c.non_split_rounding_bytes == 20 * MiB


def test_from_alloc_conf_reads_the_modelled_keys():
    c = AllocatorConfig.from_alloc_conf(" expandable_segments:True , max_split_size_mb:128,max_non_split_rounding_mb:30",
                                        card_bytes=80 * 2**30)
    assert (c.expandable_segments, c.max_split_size_bytes, c.non_split_rounding_bytes, c.card_bytes) == (
        True, 128 * MiB, 30 * MiB, 80 * 2**30)
    assert AllocatorConfig.from_alloc_conf("roundup_power2_divisions:4").divisions_table == (4,) * 16
    assert AllocatorConfig.from_alloc_conf("large_segment_size_mb:40").large_segment_size_bytes == 40 * MiB
    c = AllocatorConfig.from_alloc_conf("per_process_memory_fraction:0.5,garbage_collection_threshold:0.6",
                                        total_memory_bytes=1000 * MiB)
    assert (c.allowed_bytes, c.garbage_collection_threshold) == (500 * MiB, 0.6)
    # accepted by torch, no effect on device memory: ignored
    assert parse_alloc_conf("release_lock_on_cudamalloc:True,pinned_num_register_threads:8,backend:native") == {}


def test_divisions_list_follows_parseRoundUpPower2Divisions():
    # [64:8,256:4,>:1]: intervals below and at 64 MiB (indices 0..6) get 8; 128 MiB stays 0; 256 MiB gets 4; '>'
    # fills the intervals after the last one named (512 MiB and up) with 1
    t = AllocatorConfig.from_alloc_conf("roundup_power2_divisions:[64:8,256:4,>:1]").roundup_power2_divisions
    assert t == (8,) * 7 + (0, 4) + (1,) * 7


@pytest.mark.parametrize(("text", "match"), [
    ("expandable_segments:true", "True or False"),
    ("max_split_size_mb:19", "too small, must be >= 20"),
    ("large_segment_size_mb:40,max_split_size_mb:20", "must be >= 40"),
    ("max_non_split_rounding_mb:10", "too small"),
    ("large_segment_size_mb:10", "must be > 10"),
    ("roundup_power2_divisions:3", "power of 2"),
    ("roundup_power2_divisions:[64:3]", "power of 2"),
    ("roundup_power2_divisions:[64:8", "closing"),
    ("garbage_collection_threshold:1.5", r"\(0.0, 1.0\)"),
    ("per_process_memory_fraction:0.5", "total_memory_bytes"),
    ("backend:cudaMallocAsync", "not modelled"),
    ("backend:jemalloc", "unknown allocator backend"),
    ("foo:1", "unrecognized key 'foo'"),
    ("throw_on_cudamalloc_oom:True", "unrecognized key"),  # a key of later torch versions
    ("pinned_num_register_threads:3", "power of 2"),
    ("max_split_size_mb", "expected 'max_split_size_mb:VALUE'"),
    ("max_split_size_mb:64 expandable_segments:True", "expected ',' after max_split_size_mb"),  # spaces are dropped
    ("max_split_size_mb:64MB", "needs a non-negative integer"),  # stricter than torch's stoull, which reads 64
])
def test_bad_settings_raise_naming_the_key(text, match):
    with pytest.raises(ValueError, match=match):
        AllocatorConfig.from_alloc_conf(text)


def test_field_checks():
    with pytest.raises(ValueError, match="max_split_size_bytes"):
        AllocatorConfig(max_split_size_bytes=10 * MiB)
    with pytest.raises(ValueError, match="roundup_power2_divisions"):
        AllocatorConfig(roundup_power2_divisions=(4, 4))
    with pytest.raises(ValueError, match="card_bytes"):
        AllocatorConfig(card_bytes=0)
    with pytest.raises(ValueError, match="garbage_collection_threshold"):
        AllocatorConfig(garbage_collection_threshold=1.0)


def test_parser_agrees_with_torch_2_11_on_the_probed_strings():
    """gpu_validate.py handed each string to torch.cuda.memory._set_allocator_settings in one process. torch keeps
    large_segment_size_mb across calls, so after the first probe (large_segment_size_mb:40) its minimum for
    max_split_size_mb and max_non_split_rounding_mb was 40 MiB: the parser is given that prefix too."""
    env = json.loads(ENV.read_text())
    assert env["torch"].startswith("2.11.0")
    probes = env["conf_probes"]
    first = next(iter(probes))
    for text, answer in probes.items():
        prefixed = text if text == first or "max_" not in text else f"large_segment_size_mb:40,{text}"
        try:
            AllocatorConfig.from_alloc_conf(prefixed, total_memory_bytes=env["total_memory"])
            ours = True
        except ValueError:
            ours = False
        assert ours == answer["accepted"], (text, answer)
    rp = probes["roundup_power2_divisions:[64:8,256:4,>:1]"]["settings"]["roundup_power2_divisions"]
    ours = AllocatorConfig.from_alloc_conf("roundup_power2_divisions:[64:8,256:4,>:1]").roundup_power2_divisions
    assert tuple(rp[k] for k in sorted(rp, key=int)) == ours
