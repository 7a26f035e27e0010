"""NVMe offload of the optimizer (``offload_optimizer.device: "nvme"``): the rank's fp32 master
and the optimizer's per-element state live in files under ``nvme_path`` and come into host
memory one tile at a time (a tile is one sub-group of the step: ``sub_group_size`` elements).

Files: one per swapped kind - "master", then every state tensor the optimizer keeps per element
(Adam's exp_avg and exp_avg_sq) - preallocated, laid out like the rank's segments in step
order. Each segment's region starts on a 4096-element boundary, so a tile (a contiguous range
of every file) and a single segment both move with O_DIRECT.

The step brackets each tile (ShardedOptimizer._step): ``acquire(k)`` waits for tile k's reads,
points its master chunks and state tensors into the tile's host slot and, with pipeline_read,
starts reading tile k+1 into the next slot; ``release(k)`` starts writing tile k back (with
pipeline_write the write stays in flight while the next tile steps) and points the tensors at
nothing. A swapped-out tensor is empty, so code that touches one fails loudly instead of
reading stale values. Host memory: 1 + pipeline_read + pipeline_write tile slots.

Tensors keep their identity: the inner optimizer's ``state[master]`` holds the same tensor
objects every step, re-pointed (Tensor.set_) at each tile's slot. Scalars (Adam's step count)
stay in memory. An optimizer creates its state in its first step as ordinary tensors;
``release`` adopts every tensor the size of its parameter into the files, so any elementwise
optimizer swaps, not only Adam.

The master never exists whole in memory: FlatParamGroup writes it a segment at a time while
the model is laid out (``reserve``, ``put``), before the step's tiles are known
(``attach``); the files' layout depends on the groups alone, and a tile is a contiguous range.

Cold paths (checkpoints, write-backs, consolidation) go through ``visit``: the tiles holding
the wanted segments, one at a time, read synchronously and (when changed) written back.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ...handles import Handle
from ...ops.aio import AsyncFileIO, aligned_empty
from ..layout.flat_param_group import FlatParamGroup
from .swap_files import SwapDir

SEGMENT_ALIGN = 4096  # elements: a segment's region is 4096-byte aligned for any dtype
MASTER = "master"


def _aligned(numel: int) -> int:
    return -(-numel // SEGMENT_ALIGN) * SEGMENT_ALIGN


@dataclass
class _Slot:
    """Host memory for one tile: a byte buffer per swapped kind, sized for the largest tile."""
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    tile: int | None = None  # the tile whose values the buffers hold (or are being read)
    reads: list[Handle] = field(default_factory=list)
    writes: list[Handle] = field(default_factory=list)
    uses: list[Handle] = field(default_factory=list)  # copies that read the buffers
    staging: torch.Tensor | None = None  # the tile's low-precision values bound for the device


@dataclass
class SwapStats:
    read_bytes: int = 0
    write_bytes: int = 0
    wait_s: float = 0.0  # time the step was blocked on the drive


class OptimizerSwap:
    """Built before the flat groups: each group ``reserve``s its regions and writes its master
    straight to the drive a segment at a time (``put``), so no rank ever holds its whole
    master in memory, not even while the model is laid out; ``attach`` then hands over the
    groups and the step's tiles."""

    def __init__(self, swap_dir: SwapDir, aio: AsyncFileIO, *, pipeline_read: bool,
                 pipeline_write: bool, pin: bool = False):
        self.dir, self.aio = swap_dir, aio
        self.pipeline_read, self.pipeline_write, self.pin = pipeline_read, pipeline_write, pin
        self.groups: list[FlatParamGroup] = []
        self.tiles: list[list[tuple[int, int]]] = []
        self._numels: list[list[int]] = []  # reserved group -> its segments' chunk sizes
        self.offset: dict[tuple[int, int], int] = {}  # element offset in every file
        self.total = 0
        self.tile_of: dict[tuple[int, int], int] = {}
        self.extent: list[tuple[int, int]] = []  # tile -> [start, end) elements
        self.tile_capacity = 0
        self.kinds: dict[str, torch.dtype] = {MASTER: torch.float32}  # master first
        self.keys_of: dict[tuple[int, int], tuple[str, ...]] = {}  # state kinds in the files
        self.slots = [_Slot() for _ in range(1 + pipeline_read + pipeline_write)]
        self.stats = SwapStats()
        self._states = lambda fi: {}  # flat group -> its inner optimizer's state (attach())
        self._index: dict[int, int] = {}
        self._pointed: set[int] = set()
        self._staging = torch.empty(0)

    # -- laying the model out -----------------------------------------------------------------
    def reserve(self, chunk_numels: list[int]) -> int:
        """Regions for the next flat group's segments (this rank's chunk sizes); returns the
        group's index, which must be its index among the engine's flat groups."""
        gi = len(self._numels)
        self._numels.append(list(chunk_numels))
        for s, numel in enumerate(chunk_numels):
            self.offset[(gi, s)] = self.total
            self.total += _aligned(numel)
        self.aio.allocate(self._path(MASTER), max(self.total * 4, 1))
        return gi

    def put(self, gi: int, s: int, values: torch.Tensor) -> None:
        """Write the initial fp32 master of group gi's segment s (its chunk on this rank)."""
        numel = self._numels[gi][s]
        if values.numel() != numel:
            raise ValueError(f"segment {s} of group {gi}: {values.numel()} values for a chunk "
                             f"of {numel}")
        size = _aligned(numel)
        if self._staging.numel() < size:
            self._staging = aligned_empty(size, torch.float32)
        self._staging[:numel].copy_(values)
        self._staging[numel:size].zero_()
        self._wait([self.aio.write(self._staging[:size], self._path(MASTER),
                                   self.offset[(gi, s)] * 4)])
        self.stats.write_bytes += size * 4

    def attach(self, groups: list[FlatParamGroup], tiles: list[list[tuple[int, int]]],
               states_of) -> None:
        """The flat groups (as reserved, in order) and the step's sub-groups, which become the
        tiles; ``states_of(fi)``: the state mapping of the optimizer stepping flat group fi."""
        if [[seg.chunk_numel for seg in g.layout.segments] for g in groups] != self._numels:
            raise RuntimeError("OptimizerSwap.attach: the flat groups are not the ones that "
                               "reserved swap space (a bug)")
        self.groups, self.tiles, self._states = groups, tiles, states_of
        self._index = {id(g): i for i, g in enumerate(groups)}
        self._staging = torch.empty(0)
        end = 0
        for k, tile in enumerate(tiles):
            start = self.offset[tile[0]]
            for pair in tile:
                if self.offset[pair] != end:
                    raise RuntimeError(f"tile {k} is not contiguous in the swap files (a bug)")
                self.tile_of[pair] = k
                end += _aligned(self._numels[pair[0]][pair[1]])
            self.extent.append((start, end))
        self.tile_capacity = max((e - s for s, e in self.extent), default=0)

    # -- files and buffers ----------------------------------------------------------------
    def _register(self, kind: str, dtype: torch.dtype) -> None:
        """A new kind of per-element state: its file, the size of the master's."""
        itemsize = dtype.itemsize
        if itemsize > 4:
            raise ValueError(f"offload_optimizer nvme: optimizer state {kind!r} is {dtype}; "
                             "swapped state must be 4 bytes per element or fewer")
        self.kinds[kind] = dtype
        self.aio.allocate(self._path(kind), max(self.total * itemsize, 1))

    def _path(self, kind: str) -> str:
        return self.dir.file(f"{kind}.swp")

    def _buffer(self, slot: _Slot, kind: str) -> torch.Tensor:
        if kind not in slot.buffers:
            slot.buffers[kind] = aligned_empty(self.tile_capacity * 4, torch.uint8, pin=self.pin)
        return slot.buffers[kind]

    def _tile_bytes(self, k: int, kind: str) -> tuple[int, int]:
        start, end = self.extent[k]
        itemsize = self.kinds[kind].itemsize
        return start * itemsize, (end - start) * itemsize

    def _view(self, slot: _Slot, k: int, pair: tuple[int, int], kind: str) -> torch.Tensor:
        """Where ``pair``'s values of ``kind`` lie in the slot holding tile k."""
        return self._in_tile(self._buffer(slot, kind), k, pair, self.kinds[kind])

    def _in_tile(self, buffer: torch.Tensor, k: int, pair: tuple[int, int],
                 dtype: torch.dtype) -> torch.Tensor:
        """``pair``'s elements in ``buffer``, a byte buffer laid out like tile k in ``dtype``."""
        itemsize = dtype.itemsize
        at = (self.offset[pair] - self.extent[k][0]) * itemsize
        numel = self._numels[pair[0]][pair[1]]
        return buffer[at:at + numel * itemsize].view(dtype)

    def staging(self, pair: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """Host room in the slot of ``pair``'s tile (resident) for its updated low-precision
        values on their way to the device; the copies reading it are ``release``'s ``uses``,
        finished before the slot holds another tile. Not swapped: nothing goes to the drive."""
        k = self.tile_of[pair]
        slot = self._slot(k)
        if slot.tile != k or k not in self._pointed:
            raise RuntimeError(f"OptimizerSwap.staging: tile {k} is not resident (a bug)")
        itemsize = dtype.itemsize
        if slot.staging is None or slot.staging.numel() < self.tile_capacity * itemsize:
            slot.staging = aligned_empty(self.tile_capacity * itemsize, torch.uint8,
                                         pin=self.pin)
        return self._in_tile(slot.staging, k, pair, dtype)

    def _kinds_in(self, k: int) -> list[str]:
        present = {MASTER}
        for pair in self.tiles[k]:
            present.update(self.keys_of.get(pair, ()))
        return [kind for kind in self.kinds if kind in present]

    # -- transfers ----------------------------------------------------------------------------
    def _read(self, slot: _Slot, k: int) -> None:
        self._wait(slot.writes + slot.uses)
        slot.writes, slot.uses = [], []
        slot.tile = k
        for kind in self._kinds_in(k):
            offset, nbytes = self._tile_bytes(k, kind)
            slot.reads.append(self.aio.read(self._buffer(slot, kind)[:nbytes], self._path(kind),
                                            offset))
            self.stats.read_bytes += nbytes

    def _write(self, slot: _Slot, k: int, kinds: list[str]) -> None:
        for kind in kinds:
            offset, nbytes = self._tile_bytes(k, kind)
            slot.writes.append(self.aio.write(self._buffer(slot, kind)[:nbytes],
                                              self._path(kind), offset))
            self.stats.write_bytes += nbytes

    def _wait(self, handles: list[Handle]) -> None:
        if not handles:
            return
        t0 = time.perf_counter()
        for handle in handles:
            # host_wait: a device copy reading a slot must be done before the CPU refills it
            handle.host_wait()
        self.stats.wait_s += time.perf_counter() - t0

    def _slot(self, k: int) -> _Slot:
        return self.slots[k % len(self.slots)]

    # -- pointing tensors at a slot -----------------------------------------------------------
    def _master(self, pair: tuple[int, int]) -> torch.Tensor:
        return self.groups[pair[0]].master_segments[pair[1]]

    def _point(self, k: int, slot: _Slot) -> None:
        for pair in self.tiles[k]:
            master = self._master(pair)
            master.set_(self._view(slot, k, pair, MASTER))
            state = self._states(pair[0]).get(master, {})
            for kind in self.keys_of.get(pair, ()):
                value = state.get(kind)
                if torch.is_tensor(value):
                    value.set_(self._view(slot, k, pair, kind))
        self._pointed.add(k)

    def _unpoint(self, k: int) -> None:
        for pair in self.tiles[k]:
            master = self._master(pair)
            master.set_()
            for kind, value in self._states(pair[0]).get(master, {}).items():
                if kind in self.keys_of.get(pair, ()) and torch.is_tensor(value):
                    value.set_()
        self._pointed.discard(k)

    def _adopt(self, k: int, slot: _Slot) -> None:
        """State tensors the optimizer created (its first step, a checkpoint load) become
        views of the slot, so they are written with the tile and swapped from now on."""
        for pair in self.tiles[k]:
            master = self._master(pair)
            state = self._states(pair[0]).get(master, {})
            keys = set(self.keys_of.get(pair, ()))
            for kind, value in state.items():
                if not (torch.is_tensor(value) and value.dim() > 0
                        and value.numel() == master.numel()):
                    continue  # scalars and factored state stay in memory
                if kind not in self.kinds:
                    self._register(kind, value.dtype)
                elif self.kinds[kind] != value.dtype:
                    raise ValueError(f"offload_optimizer nvme: optimizer state {kind!r} "
                                     f"changed dtype ({self.kinds[kind]} -> {value.dtype})")
                view = self._view(slot, k, pair, kind)
                if value.data_ptr() != view.data_ptr():  # not pointed at the slot yet
                    view.copy_(value.reshape(-1))
                    value.set_(view)
                keys.add(kind)
            self.keys_of[pair] = tuple(kind for kind in self.kinds if kind in keys)

    def _bring_in(self, k: int) -> _Slot:
        """Tile k resident (read now unless already on its way) and pointed at."""
        slot = self._slot(k)
        if slot.tile != k:  # not read ahead (pipeline_read) by the previous acquire
            self._read(slot, k)
        self._wait(slot.reads)
        slot.reads = []
        self._point(k, slot)
        return slot

    def _write_back(self, k: int, slot: _Slot) -> None:
        """Start writing tile k (state the optimizer created adopted first)."""
        self._adopt(k, slot)
        self._write(slot, k, self._kinds_in(k))

    # -- the step ---------------------------------------------------------------------------
    def acquire(self, k: int) -> None:
        """Tile k's master and state, in host memory and pointed at, for the step."""
        self._bring_in(k)
        if self.pipeline_read and k + 1 < len(self.tiles):
            self._read(self._slot(k + 1), k + 1)

    def release(self, k: int, uses: list[Handle] = (), changed: bool = True) -> None:
        """Tile k stepped: write it back (unless not ``changed``). ``uses``: copies still
        reading its buffers (the device copies of its updated values), finished before the
        slot is refilled."""
        slot = self._slot(k)
        if changed:
            self._write_back(k, slot)
        slot.uses = list(uses)
        self._unpoint(k)
        if not self.pipeline_write:
            self._wait(slot.writes + slot.uses)
            slot.writes, slot.uses = [], []

    def finish(self) -> None:
        """After a step (also one cut short by an error): every tile swapped out, every write
        on the drive; the slots hold nothing a later step could mistake for current."""
        for k in list(self._pointed):
            self._unpoint(k)
        for slot in self.slots:
            self._wait(slot.reads + slot.writes + slot.uses)
            slot.reads, slot.writes, slot.uses = [], [], []
            slot.tile = None

    # -- cold paths -------------------------------------------------------------------------
    def visit(self, fg: FlatParamGroup, segments, write_back: bool):
        """Yield lists of ``segments`` of ``fg`` whose master (and state) is resident, tile by
        tile; with ``write_back`` each tile is written back after the caller is done with it."""
        fi = self._index[id(fg)]
        by_tile: dict[int, list[int]] = {}
        for s in segments:
            by_tile.setdefault(self.tile_of[(fi, s)], []).append(s)
        self.finish()
        for k in sorted(by_tile):
            slot = self._bring_in(k)
            try:
                yield by_tile[k]
                if write_back:
                    self._write_back(k, slot)
            finally:
                self._unpoint(k)
                self._wait(slot.writes)
                slot.writes, slot.tile = [], None

    def file_bytes(self) -> int:
        """Bytes this rank keeps on the drive."""
        return sum(self.total * d.itemsize for d in self.kinds.values())

    def host_bytes(self) -> int:
        return sum(b.numel() for slot in self.slots for b in slot.buffers.values()) + \
            sum(slot.staging.numel() for slot in self.slots if slot.staging is not None)

    def close(self) -> None:
        self.finish()
        for kind in self.kinds:
            self.aio.forget(self._path(kind))
        self.dir.remove()
