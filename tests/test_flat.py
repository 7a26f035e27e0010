"""Partition math (hypothesis) and the C++ flatten against its PyTorch fallback."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from zeroengine.core.layout.partition import FlatBuffer, FlatLayout
from zeroengine.ops import flatten as flatten_ops

shapes_st = st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=3), min_size=1,
                     max_size=12)


@settings(max_examples=examples(300), deadline=None)
@given(shapes=shapes_st, world=st.integers(1, 8), bucket=st.integers(1, 400),
       align=st.sampled_from([1, 4, 16]))
def test_every_element_owned_exactly_once(shapes, world, bucket, align):
    layout = FlatLayout(shapes, world, bucket, align)
    owned = {}  # (param, element) -> rank
    for rank in range(world):
        shard_positions = set()
        for piece in layout.shard_pieces(rank):
            for k in range(piece.numel):
                key = (piece.param, piece.param_offset + k)
                assert key not in owned, f"{key} owned by ranks {owned[key]} and {rank}"
                owned[key] = rank
                shard_positions.add(piece.shard_offset + k)
        assert all(0 <= p < layout.shard_numel for p in shard_positions)
    expected = {(i, k) for i, s in enumerate(shapes) for k in range(math.prod(s))}
    assert set(owned) == expected
    # equal shards, padded segments, no segment over budget unless it holds one big parameter
    assert layout.numel == layout.shard_numel * world
    for seg in layout.segments:
        assert seg.numel % (world * align) == 0 and seg.used <= seg.numel
        assert seg.used <= bucket or len(seg.params) == 1


@settings(max_examples=examples(100), deadline=None)
@given(shapes=shapes_st, world=st.integers(1, 8), bucket=st.integers(1, 400))
def test_flat_buffer_views_round_trip(shapes, world, bucket):
    layout = FlatLayout(shapes, world, bucket)
    tensors = [torch.randn(tuple(s)) for s in shapes]
    buf = FlatBuffer(layout, torch.float32, "cpu")
    flatten_ops.flatten_into(tensors, buf.data, [s.offset for s in layout.slots])
    for i, t in enumerate(tensors):
        assert torch.equal(buf.param_view(i), t)
    # segments and chunks tile the buffer
    pieces = [buf.chunk_view(s, r) for s in range(len(layout.segments)) for r in range(world)]
    assert sum(p.numel() for p in pieces) == layout.numel
    out = [torch.empty_like(t) for t in tensors]
    flatten_ops.unflatten_from(buf.data, out, [s.offset for s in layout.slots])
    assert all(torch.equal(a, b) for a, b in zip(out, tensors))


def test_extension_is_built():
    """`make test` builds the extension; the fallback is for installs without a compiler."""
    assert flatten_ops.using_extension()


@settings(max_examples=examples(60), deadline=None)
@given(sizes=st.lists(st.integers(0, 70_000), min_size=0, max_size=6),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
       gap=st.integers(0, 5))
def test_extension_matches_fallback(sizes, dtype, gap):
    tensors = [torch.randn(n).to(dtype) for n in sizes]
    offsets, pos = [], gap
    for n in sizes:
        offsets.append(pos)
        pos += n + gap
    results = []
    for use_ext in (True, False):
        flat = torch.full((pos,), -7.0)  # fp32 flat: conversion from other dtypes included
        flatten_ops.flatten_into(tensors, flat, offsets, use_extension=use_ext)
        back = [torch.zeros(n, dtype=dtype) for n in sizes]
        flatten_ops.unflatten_from(flat, back, offsets, use_extension=use_ext)
        results.append((flat, back))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


@pytest.mark.parametrize("use_ext", [True, False])
def test_flatten_rejects_overrun(use_ext):
    with pytest.raises((ValueError, RuntimeError), match="overruns"):
        flatten_ops.flatten_into([torch.ones(5)], torch.zeros(4), [0], use_extension=use_ext)


def test_layout_rejects_bad_world_size():
    with pytest.raises(ValueError, match="world_size"):
        FlatLayout([(3,)], 0, 10)


@settings(max_examples=examples(100), deadline=None)
@given(units=st.lists(st.integers(0, 3), min_size=1, max_size=12), world=st.integers(1, 5),
       bucket=st.integers(1, 60))
def test_segments_never_span_two_units(units, world, bucket):
    units = sorted(units)
    shapes = [(1 + i % 4, 3) for i in range(len(units))]
    layout = FlatLayout(shapes, world, bucket, units=units)
    for seg in layout.segments:
        assert len({units[i] for i in seg.params}) == 1
    assert sum(len(seg.params) for seg in layout.segments) == len(units)


@given(shapes=shapes_st, world=st.integers(1, 6), bucket=st.integers(1, 200),
       align=st.sampled_from([1, 4]), data=st.data())
@settings(deadline=None)
def test_checkpoint_locate_finds_every_element_where_the_layout_put_it(shapes, world, bucket,
                                                                         align, data):
    """ckpt_format.locate (what loading a resharded checkpoint reads) agrees with the layout's
    own shard_pieces about which rank and shard offset hold each element of each parameter."""
    from zeroengine.checkpoint.format import locate
    layout = FlatLayout(shapes, world, bucket, align)
    group = {"shard_world": world,
             "segments": [[s.start, s.numel, s.shard_offset] for s in layout.segments]}
    holder = {}  # (param, element) -> (rank, shard offset)
    for rank in range(world):
        for piece in layout.shard_pieces(rank):
            for k in range(piece.numel):
                holder[(piece.param, piece.param_offset + k)] = (rank, piece.shard_offset + k)
    for index, slot in enumerate(layout.slots):
        if slot.numel == 0:
            continue
        begin = data.draw(st.integers(0, slot.numel - 1))
        count = data.draw(st.integers(1, slot.numel - begin))
        covered = 0
        for piece in locate(group, slot.offset + begin, count):
            assert piece.out_offset == covered
            for k in range(piece.numel):
                assert holder[(index, begin + covered + k)] == (piece.rank, piece.shard_offset + k)
            covered += piece.numel
        assert covered == count


@settings(max_examples=examples(200), deadline=None)
@given(sizes=st.lists(st.integers(1, 50), min_size=1, max_size=15), target=st.integers(0, 120),
       data=st.data())
def test_fetch_units_group_consecutive_modules_up_to_the_target(sizes, target, data):
    """stage3_fetch_unit_size: owners (module indices) grouped in order, each unit within the
    target unless it is one module, no unit that could have taken its successor, 0 = one unit
    per module; parameters of one module always share a unit."""
    from zeroengine.core.layout.param_layout import fetch_units
    # parameters in reverse module order, as the engine lays them out; 1-3 per module
    counts = [data.draw(st.integers(1, 3)) for _ in sizes]
    owners = [m for m in reversed(range(len(sizes))) for _ in range(counts[m])]
    numels = [max(1, sizes[m] // counts[m]) for m in owners]
    units = fetch_units(owners, numels, target)
    unit_of = {}
    for o, u in zip(owners, units):
        assert unit_of.setdefault(o, u) == u  # a module is never split
    total = {m: sum(n for o, n in zip(owners, numels) if o == m) for m in unit_of}
    ordered = [unit_of[m] for m in sorted(unit_of)]
    assert ordered == sorted(ordered) and ordered[0] == 0  # contiguous, in module order
    assert set(ordered) == set(range(ordered[-1] + 1))
    members: dict[int, list[int]] = {}
    for m in sorted(unit_of):
        members.setdefault(unit_of[m], []).append(m)
    for u, ms in members.items():
        size = sum(total[m] for m in ms)
        assert len(ms) == 1 or size <= target
        nxt = members.get(u + 1)
        if nxt:  # greedy: the next module did not fit
            assert size + total[nxt[0]] > target
    if target == 0:
        assert len(members) == len(sizes)
