"""memplan.allocator's replay of the CUDA caching allocator: toy cases worked by hand.

Each case gives the arithmetic in comments; the same op sequences were run on an H200 under torch 2.11
(benchmarks/allocator/gpu/scenarios.json.gz) and test_allocator_gpu.py checks the replay against those
measurements op by op.
"""

from __future__ import annotations

import dataclasses

import pytest

from memplan.allocator import AllocatorConfig, allocation_size, replay_series, round_size, simulate, simulate_events
from memplan.allocator.sim import ledger_from_events

MiB = 2**20
EXP = AllocatorConfig(expandable_segments=True)


def alloc(key, nbytes, stream=0):
    return ("alloc", key, nbytes, stream)


def free(key):
    return ("free", key, 0, 0)


def series(events, config=None):
    """(allocated MiB, reserved MiB) after every event."""
    _, s = replay_series(ledger_from_events(events), config)
    return [(a / MiB, r / MiB) for a, r in s]


def test_order_matters_eight_16_then_four_32_reserve_256_the_reverse_128():
    # 16 MiB requests (>= 10 MiB) get segments of their own size: 8 x 16 = 128 MiB. Freed, they cannot hold
    # 32 MiB (segments never merge), so four new 32 MiB segments follow: 128 + 128 = 256 MiB.
    ev = [alloc(k, 16 * MiB) for k in range(8)] + [free(k) for k in range(8)] + [alloc(10 + k, 32 * MiB) for k in range(4)]
    assert simulate_events(ev).peak_reserved_bytes == 256 * MiB
    # Reverse: each cached 32 MiB block takes two 16 MiB requests (remainder 16 MiB > 1 MiB: split): 128 MiB.
    ev = [alloc(k, 32 * MiB) for k in range(4)] + [free(k) for k in range(4)] + [alloc(10 + k, 16 * MiB) for k in range(8)]
    r = simulate_events(ev)
    assert (r.peak_reserved_bytes, r.segments_end) == (128 * MiB, 4)


def test_one_mib_is_small_pool_one_mib_plus_one_is_large():
    # 1 MiB rounds to 1 MiB <= kSmallSize: a 2 MiB small segment. 1 MiB + 1 rounds to 1 MiB + 512 > kSmallSize:
    # the large pool, under kMinLargeAlloc, so a 20 MiB segment: 2 + 20 = 22 MiB reserved.
    assert series([alloc(0, MiB), alloc(1, MiB + 1)]) == [(1, 2), (1 + (MiB + 512) / MiB, 22)]


def test_5mib_takes_a_20mib_segment_and_the_next_5mib_its_remainder():
    # 5 MiB < 10 MiB: a 20 MiB segment, split (remainder 15 MiB > 1 MiB); the second 5 MiB fits the remainder.
    r = simulate_events([alloc(0, 5 * MiB), alloc(1, 5 * MiB)])
    assert (r.peak_reserved_bytes, r.peak_allocated_bytes, r.segments_end) == (20 * MiB, 10 * MiB, 1)
    # the split-off 10 MiB is free inside a segment that holds live blocks
    assert r.fragmentation_at_peak_bytes == r.inactive_split_at_peak_bytes == 15 * MiB


def test_split_thresholds_and_unsplit_blocks_counting_whole():
    ev = [alloc(0, 19 * MiB),  # own segment rounded to 2 MiB: 20 MiB; remainder 1 MiB is not > 1 MiB: unsplit,
          #                      so memory_allocated counts the whole 20 MiB
          alloc(1, 18 * MiB + MiB // 2),  # 20 MiB segment, remainder 1.5 MiB > 1 MiB: split: 20 + 18.5 = 38.5
          alloc(2, 12 * MiB),  # exact 12 MiB segment: 50.5 allocated, 52 reserved
          free(2),  # 38.5
          alloc(3, 11 * MiB + MiB // 2),  # takes the cached 12 MiB whole (remainder 0.5 MiB): 50.5
          alloc(4, MiB - 512),  # small pool, 2 MiB segment, split (remainder 1 MiB + 512 >= 512): 54 reserved
          alloc(5, 1)]  # 512 bytes from the small segment's remainder
    assert series(ev) == [(20, 20), (38.5, 40), (50.5, 52), (38.5, 52), (50.5, 52),
                          (50.5 + (MiB - 512) / MiB, 54), (51.5, 54)]
    r = simulate_events(ev)
    # rounded requests: 19 + 18.5 + 11.5 + (1 MiB - 512) + 512 = 50 MiB; allocated counts 20 and 12 whole: 51.5
    assert (r.peak_rounded_bytes, r.peak_allocated_bytes) == (50 * MiB, 51.5 * MiB)
    # with expandable segments every block is split at 512 bytes: allocated == rounded
    assert simulate_events(ev, EXP).peak_allocated_bytes == 50 * MiB


def test_small_pool_splits_down_to_512_bytes():
    # 1 MiB + (1 MiB - 512) fill a 2 MiB segment but for 512 bytes, which are split off and take a 512 B request
    r = simulate_events([alloc(0, MiB), alloc(1, MiB - 512), alloc(2, 512)])
    assert (r.peak_reserved_bytes, r.segments_end, r.peak_allocated_bytes) == (2 * MiB, 1, 2 * MiB)
    assert simulate_events([alloc(0, MiB), alloc(1, MiB - 512), alloc(2, 513)]).segments_end == 2


def test_two_streams_do_not_share_cached_blocks():
    ev = [alloc(0, 16 * MiB), free(0), alloc(1, 16 * MiB, stream=1), free(1), alloc(2, 16 * MiB)]
    # stream 1 cannot take stream 0's cached 16 MiB block: 32 MiB; the last request reuses stream 0's block
    assert series(ev) == [(16, 16), (0, 16), (16, 32), (0, 32), (16, 32)]
    # expandable: one 20 MiB page per stream's large pool
    assert simulate_events(ev, EXP).peak_reserved_bytes == 40 * MiB


GROWTH = [alloc(0, 4096), alloc(1, 5 * MiB), alloc(2, 30 * MiB), free(1), alloc(3, 4 * MiB), alloc(4, 50 * MiB),
          free(2), ("empty_cache", None, 0, 0), alloc(5, 8 * MiB)]


def test_expandable_segments_grow_by_pages_and_reuse_holes():
    # small pool: one 2 MiB page. Large pool, 20 MiB pages: 5 MiB -> 1 page; 30 MiB at [5, 35) -> 2 pages (42 MiB
    # in all); free the 5 MiB: a hole at [0, 5); 4 MiB takes the hole (best fit by address: [0, 5) before the
    # tail block [35, 40), whose expandable size also counts the unmapped tail); 50 MiB at [35, 85) maps 3 more
    # pages (102). Freeing the 30 MiB leaves [4, 35) free: empty_cache finds no whole free page in it or in
    # [85, 100), so nothing is unmapped; 8 MiB then takes [4, 12) rather than the tail block.
    assert [r for _, r in series(GROWTH, EXP)] == [2, 22, 42, 42, 42, 102, 102, 102]
    # cudaMalloc'd segments: 2, 20, 30 (its own), 50 (its own); empty_cache frees the 30 MiB segment: 72
    assert [r for _, r in series(GROWTH)] == [2, 22, 52, 52, 52, 102, 102, 72]


def test_expandable_empty_cache_unmaps_whole_free_pages_only():
    # 45 MiB at [0, 45) maps 3 pages; freed, all 3 pages are free and unmapped, and the segment goes
    ev = [alloc(0, 45 * MiB), alloc(1, 4 * MiB), free(0), ("empty_cache", None, 0, 0), alloc(2, MiB + 512)]
    # 4 MiB sits at [45, 49) in the third page: empty_cache unmaps pages [0, 40) only, keeping [40, 60)
    assert [r for _, r in series(ev, EXP)] == [60, 60, 60, 20]


def test_max_split_size_refuses_to_split_big_blocks():
    cfg = AllocatorConfig(max_split_size_bytes=64 * MiB)
    ev = [alloc(0, 64 * MiB), free(0),  # a cached 64 MiB block is oversize (>= 64 MiB)
          alloc(1, 30 * MiB),  # 30 < 64 may not take an oversize block: new 30 MiB segment (94)
          alloc(2, 50 * MiB), free(2),  # likewise: new 50 MiB segment (144), cached
          alloc(3, 40 * MiB)]  # takes the cached 50 MiB (not oversize) and splits it (remainder 10 > 1 MiB)
    assert series(ev, cfg) == [(64, 64), (0, 64), (30, 94), (80, 144), (30, 144), (70, 144)]
    # an oversize request takes an oversize block unsplit when it is less than max_non_split_rounding (20 MiB)
    # bigger: 50 + 20 = 70 > 64 -> the whole 64 MiB; 40 + 20 = 60 <= 64 -> refused, a new 40 MiB segment
    cfg = AllocatorConfig(max_split_size_bytes=40 * MiB)
    assert series([alloc(0, 64 * MiB), free(0), alloc(1, 50 * MiB)], cfg)[-1] == (64, 64)
    assert series([alloc(0, 64 * MiB), free(0), alloc(1, 40 * MiB)], cfg)[-1] == (40, 104)


def test_empty_cache_releases_only_fully_free_segments():
    ev = [alloc(0, 5 * MiB), alloc(1, 15 * MiB), alloc(2, 5 * MiB), free(0), free(2),
          ("empty_cache", None, 0, 0), alloc(3, 2 * MiB)]
    # 5 and 15 fill one 20 MiB segment; the second 5 MiB opens another (40). After both 5 MiB are freed the
    # second segment is whole and free: empty_cache releases it (20); the first keeps its 15 MiB tenant.
    r, s = replay_series(ledger_from_events(ev))
    assert [x / MiB for _, x in s] == [20, 20, 40, 40, 40, 20]
    assert (r.num_device_free, r.reserved_timeline[-1]) == (1, (5, 20 * MiB))


def test_card_bytes_force_a_retry_then_an_oom():
    cfg = AllocatorConfig(card_bytes=62 * MiB)
    ev = [alloc(0, 30 * MiB), free(0),
          alloc(1, 40 * MiB),  # 30 cached + 40 new = 70 > 62: cudaMalloc fails; release_cached_blocks frees the 30,
          #                      the retry fits (40): num_alloc_retries 1
          alloc(2, 30 * MiB)]  # 40 + 30 = 70 > 62 and nothing cached to free: retry 2 fails: OOM at event 3
    r = simulate_events(ev, cfg)
    assert (r.num_alloc_retries, r.oom.event, r.oom.requested_bytes, r.oom.reserved_bytes) == (2, 3, 30 * MiB, 40 * MiB)
    assert (r.events_replayed, r.peak_reserved_bytes) == (3, 40 * MiB)


def test_fraction_limit_checks_the_segment_size_even_for_expandable_segments():
    ev = [alloc(0, 5 * MiB), alloc(1, 25 * MiB), free(1), alloc(2, 45 * MiB)]
    # expandable, 40 MiB mapped, [5, 40) free: 45 MiB needs one more page (60 <= 62 on the card) ...
    assert simulate_events(ev, dataclasses.replace(EXP, card_bytes=62 * MiB)).oom is None
    # ... but set_per_process_memory_fraction's check adds get_allocation_size (46 MiB): 40 + 46 > 61, and after
    # unmapping the free pages [20, 40), 20 + 46 > 61 still: OOM
    assert simulate_events(ev, dataclasses.replace(EXP, allowed_bytes=61 * MiB)).oom.event == 3


def test_garbage_collection_frees_the_oldest_cached_segments_under_a_fraction():
    cfg = AllocatorConfig(allowed_bytes=201 * MiB, garbage_collection_threshold=0.5)
    ev = [alloc(0, 30 * MiB), free(0), alloc(1, 32 * MiB), free(1), alloc(2, 34 * MiB), free(2),
          alloc(3, 36 * MiB),  # 96 reserved <= 100.5 (0.5 x 201): no collection; 132
          alloc(4, 38 * MiB)]  # 132 > 100.5: reclaim 31.5. Ages (get_free_block calls since cached) 4, 3, 2, mean 3:
    #                          the 30 and 32 MiB segments go (62 >= 31.5); then the 38 MiB segment: 132 - 62 + 38
    assert [r for _, r in series(ev, cfg)] == [30, 30, 62, 62, 96, 96, 132, 108]
    assert [r for _, r in series(ev, dataclasses.replace(cfg, garbage_collection_threshold=None))][-1] == 170


def test_phase_marks_reset_the_peaks():
    led = ledger_from_events([("phase", "a", 0, 0), alloc(0, 8 * MiB), alloc(1, 8 * MiB), free(1),
                              ("phase", "b", 0, 0), alloc(2, MiB)])
    r = simulate(led)
    # phase a: 16 MiB allocated at most, one 20 MiB segment. Phase b starts at the current 8 MiB / 20 MiB and
    # adds a small segment: 9 MiB, 22 MiB
    assert [(p.label, p.peak_allocated_bytes / MiB, p.peak_reserved_bytes / MiB) for p in r.phases] == [
        ("a", 16, 20), ("b", 9, 22)]
    assert (r.phases[1].start, r.phases[1].stop) == (3, 4)


def test_rounding_and_segment_sizes():
    assert [round_size(n) for n in (1, 512, 513, MiB + 1)] == [512, 512, 1024, MiB + 512]
    # roundup_power2_divisions:4: 1200 MiB lies between 1024 and 2048 MiB, quarters of 256 MiB: 1280 MiB;
    # powers of two stay; sizes up to 512 x 4 bytes keep 512-byte rounding
    cfg = AllocatorConfig(roundup_power2_divisions=4)
    assert [round_size(n, cfg) for n in (1200 * MiB, 1024 * MiB, 2000)] == [1280 * MiB, 1024 * MiB, 2048]
    d = AllocatorConfig()
    assert [allocation_size(n, d) for n in (MiB, MiB + 512, 10 * MiB - 512, 10 * MiB, 10 * MiB + 512)] == [
        2 * MiB, 20 * MiB, 20 * MiB, 10 * MiB, 12 * MiB]


def test_zero_byte_tensors_are_not_allocated():
    r = simulate_events([alloc(0, 0), alloc(1, 100), free(0), free(1)])
    assert (r.peak_allocated_bytes, r.peak_reserved_bytes, r.allocated_end_bytes) == (512, 2 * MiB, 0)


def test_peak_rounded_is_the_ledgers_peak():
    ev = [alloc(0, 19 * MiB), alloc(1, 3), free(0), alloc(2, 7 * MiB)]
    led = ledger_from_events(ev)
    r = simulate(led)
    assert r.peak_rounded_bytes == led.peak()[0] == 19 * MiB + 512
    assert r.peak_allocated_bytes == 20 * MiB + 512  # the unsplit 20 MiB block counts whole


def test_ledger_from_events_refuses_bad_sequences():
    with pytest.raises(ValueError, match="not live"):
        ledger_from_events([free("x")])
    with pytest.raises(ValueError, match="live already"):
        ledger_from_events([alloc("x", 1), alloc("x", 1)])
    with pytest.raises(ValueError, match="event kind"):
        ledger_from_events([("malloc", "x", 1, 0)])
