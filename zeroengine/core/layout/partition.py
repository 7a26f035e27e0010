"""Flat buffers and the partition math behind them (no communication here).

Layout. The trainable parameters of one (param group, dtype) are laid end to end in one flat
buffer, in the order the caller gives (the engine passes them in reverse registration order, so
the first buffer region is the first to receive gradients in backward). The buffer is cut into
*segments*: contiguous runs of whole parameters, at most ``bucket_numel`` elements each (a larger
parameter gets a segment of its own). A segment is the unit of communication: one reduce-scatter
(or all-reduce) of its gradient, one all-gather of its values. Each segment is zero-padded to a
multiple of ``world_size * align`` and split into ``world_size`` equal *chunks*: rank r owns chunk
r of every segment.

A rank's *shard* is the concatenation of its chunks of every segment, so every rank owns the same
number of elements and its optimizer state, master weights and reduced gradients are each one
contiguous tensor. Stage 0 is the same layout with ``world_size=1``: one rank owns everything.

Why segment-wise chunks rather than one contiguous 1/N of the whole buffer: a bucket's reduce-
scatter then has equal-sized outputs on every rank, which is what ``reduce_scatter_tensor`` (and
gloo) need, and the bucket can be sent the moment its gradients exist. Stage 3 reuses this with
segments cut along module boundaries.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from ..offload.host_memory import zeros_on_demand


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter's elements live in its flat buffer."""

    offset: int  # first element in the flat buffer
    numel: int
    shape: tuple[int, ...]
    segment: int  # index of the segment that holds it


@dataclass(frozen=True)
class Segment:
    """A contiguous, padded run of the flat buffer communicated as one unit."""

    start: int  # first element in the flat buffer
    numel: int  # padded length: a multiple of world_size * align
    used: int  # elements that belong to parameters (numel - used is padding)
    params: tuple[int, ...]  # indices into FlatLayout.slots
    shard_offset: int  # where this segment's chunk starts inside every rank's shard
    world_size: int

    @property
    def chunk_numel(self) -> int:
        return self.numel // self.world_size

    def chunk_range(self, rank: int) -> tuple[int, int]:
        """[begin, end) of rank's chunk, in flat-buffer coordinates."""
        begin = self.start + rank * self.chunk_numel
        return begin, begin + self.chunk_numel

    def of_shard(self, shard: torch.Tensor) -> torch.Tensor:
        """This segment's chunk inside a rank's shard tensor (or any tensor laid out like one)."""
        return shard[self.shard_offset:self.shard_offset + self.chunk_numel]

    def of_full(self, full: torch.Tensor) -> torch.Tensor:
        """This segment inside a tensor laid out like the whole flat buffer."""
        return full[self.start:self.start + self.numel]

    def local(self, slot: "ParamSlot") -> slice:
        """Where a parameter of this segment lies inside a tensor holding just the segment."""
        begin = slot.offset - self.start
        return slice(begin, begin + slot.numel)

    def own_chunk_local(self, rank: int) -> slice:
        """Rank's chunk inside a tensor holding just the segment."""
        return slice(rank * self.chunk_numel, (rank + 1) * self.chunk_numel)


@dataclass(frozen=True)
class ShardPiece:
    """The part of one parameter that lies in one rank's shard."""

    param: int  # index into FlatLayout.slots
    param_offset: int  # first element within the (flattened) parameter
    shard_offset: int  # first element within the rank's shard
    numel: int

    def of_shard(self, shard: torch.Tensor) -> torch.Tensor:
        return shard[self.shard_offset:self.shard_offset + self.numel]


class FlatLayout:
    """Pure partition math for one flat buffer: which element lives where, who owns it."""

    def __init__(self, shapes: Sequence[Sequence[int]], world_size: int, bucket_numel: int,
                 align: int = 1, units: Sequence[int] | None = None):
        """``units``: optional unit id per parameter (stage 3: the module that fetches it); a
        segment never spans two units, so a module's parameters are gathered in whole segments."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if bucket_numel < 1:
            raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
        self.world_size = world_size
        self.align = align
        quantum = world_size * align
        slots: list[ParamSlot] = []
        segments: list[Segment] = []
        current: list[int] = []
        current_used = 0
        cursor = 0  # flat offset where the open segment starts
        shard_cursor = 0

        def close_segment():
            nonlocal cursor, shard_cursor, current, current_used
            if not current:
                return
            padded = max(quantum, math.ceil(current_used / quantum) * quantum)
            segments.append(Segment(cursor, padded, current_used, tuple(current), shard_cursor,
                                    world_size))
            cursor += padded
            shard_cursor += padded // world_size
            current, current_used = [], 0

        for index, shape in enumerate(shapes):
            shape = tuple(int(s) for s in shape)
            numel = math.prod(shape)
            new_unit = units is not None and current and units[index] != units[index - 1]
            if current and (current_used + numel > bucket_numel or new_unit):
                close_segment()
            slots.append(ParamSlot(cursor + current_used, numel, shape, len(segments)))
            current.append(len(slots) - 1)
            current_used += numel
        close_segment()
        self.slots: tuple[ParamSlot, ...] = tuple(slots)
        self.segments: tuple[Segment, ...] = tuple(segments)
        self.numel = cursor  # padded length of the whole buffer
        self.shard_numel = shard_cursor  # elements every rank owns
        self.used_numel = sum(s.numel for s in slots)

    def shard_pieces(self, rank: int) -> list[ShardPiece]:
        """Every (parameter, range) that lies in rank's shard, in shard order."""
        pieces = []
        for seg in self.segments:
            begin, end = seg.chunk_range(rank)
            for index in seg.params:
                slot = self.slots[index]
                lo, hi = max(begin, slot.offset), min(end, slot.offset + slot.numel)
                if lo < hi:
                    pieces.append(ShardPiece(index, lo - slot.offset,
                                             seg.shard_offset + lo - begin, hi - lo))
        return pieces


class FlatBuffer:
    """A flat tensor laid out by a FlatLayout, with views by parameter, segment and chunk."""

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device | str):
        self.layout = layout
        # zero pages taken as written: a buffer filled a parameter at a time (or a gradient
        # buffer first written by backward) does not count whole from the start
        self.data = zeros_on_demand(layout.numel, dtype, torch.device(device))

    def param_view(self, index: int) -> torch.Tensor:
        slot = self.layout.slots[index]
        return self.data[slot.offset:slot.offset + slot.numel].view(slot.shape)

    def segment_view(self, seg: int) -> torch.Tensor:
        return self.layout.segments[seg].of_full(self.data)

    def chunk_view(self, seg: int, rank: int) -> torch.Tensor:
        begin, end = self.layout.segments[seg].chunk_range(rank)
        return self.data[begin:end]


def shard_segment_views(shard: torch.Tensor, layout: FlatLayout) -> list[torch.Tensor]:
    """Views of a rank's shard tensor, one per segment (its chunk of that segment)."""
    return [s.of_shard(shard) for s in layout.segments]


def bucket_params(params: Iterable[torch.nn.Parameter]) -> list[tuple[torch.dtype, list]]:
    """Split params by dtype, keeping order: one flat buffer per dtype."""
    by_dtype: dict[torch.dtype, list] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    return list(by_dtype.items())
