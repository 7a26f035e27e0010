"""The host pool (csrc/host_pool): buffers that keep their views across resize-to-0-and-back,
blocks reused by size, and never more mapped than was live at once."""
from __future__ import annotations

import threading

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from zeroengine.ops import host_pool

BIG = host_pool.POOLED_MIN_BYTES // 4  # float32 elements that the pool takes


def test_built_and_used():
    assert host_pool.available(), "csrc/host_pool is not built (pip install -e . " \
        "--no-build-isolation)"
    before = host_pool.stats()["live_bytes"]
    t = host_pool.empty(BIG, torch.float32)
    assert host_pool.stats()["live_bytes"] == before + BIG * 4
    del t
    assert host_pool.stats()["live_bytes"] == before


def test_small_buffers_stay_with_malloc():
    before = host_pool.stats()
    small = host_pool.empty(16, torch.float32)
    assert small.numel() == 16 and host_pool.stats() == before


def test_segment_release_and_regather_reuse_the_block():
    """How stage 3 uses it: parameters are views of one tensor whose storage is emptied and
    refilled; the views see the new values and the block comes back, not a new mapping."""
    full = host_pool.empty(BIG * 2, torch.float32)
    weight = full[BIG:BIG + 12].view(3, 4)
    full.untyped_storage().resize_(0)
    mid = host_pool.stats()
    assert mid["cached_bytes"] >= BIG * 8
    full.untyped_storage().resize_(BIG * 2 * 4)
    full.copy_(torch.arange(BIG * 2, dtype=torch.float32))
    after = host_pool.stats()
    assert after["maps"] == mid["maps"] and after["reuses"] == mid["reuses"] + 1
    assert torch.equal(weight, torch.arange(BIG, BIG + 12, dtype=torch.float32).view(3, 4))
    assert full.dtype == torch.float32 and full.is_contiguous()


def test_zeros_and_dtypes():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int16):
        z = host_pool.zeros(BIG * 2, dtype)
        assert z.dtype == dtype and z.numel() == BIG * 2 and not z.any()


def test_freed_on_another_thread():
    t = [host_pool.empty(BIG, torch.float32)]
    before = host_pool.stats()["live_bytes"]
    worker = threading.Thread(target=t.clear)
    worker.start()
    worker.join()
    assert host_pool.stats()["live_bytes"] == before - BIG * 4


def _mapped(s: dict) -> int:
    return s["live_bytes"] + s["cached_bytes"]


@settings(max_examples=examples(100), deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 6), st.integers(0, 7)),
                    min_size=1, max_size=40))
def test_never_maps_more_than_its_live_peak(ops):
    """Any order of takes and frees of a few sizes: what is live is counted exactly, and the
    pool's mappings (live + kept free) stay within the most that was live at one time."""
    host_pool.trim()
    live = {}
    base = host_pool.stats()["live_bytes"]
    for take, pages, slot in ops:
        if take or slot not in live:
            live[slot] = host_pool.empty(pages * host_pool.POOLED_MIN_BYTES, torch.int8)
        else:
            del live[slot]
        s = host_pool.stats()
        assert s["live_bytes"] == base + sum(t.numel() for t in live.values())
        assert _mapped(s) <= s["peak_live_bytes"]
    live.clear()
    host_pool.trim()
    assert host_pool.stats()["cached_bytes"] == 0
