"""NVMe offload of stage-3 parameters (``offload_param.device: "nvme"``): the rank's partitioned
parameter shard, in the compute dtype, lives in files under ``nvme_path``; host memory holds a
cache of its segments' chunks, at most ``max_in_cpu`` elements, plus the chunks being read ahead.

One file per partitioned flat group, its segments' chunks in order, each starting on a 4096-byte
boundary so a chunk moves with O_DIRECT. FlatParamGroup writes the initial values a segment at
a time (``reserve``, ``put``); from then on:

- reads: ``chunk(gi, s)`` returns the chunk resident (from the cache, from a read started ahead
  by ``read_ahead``, else read now). ParamFetcher reads ahead along the order the first step
  recorded, ``read_ahead_numel`` elements past its all-gather prefetch, so the drive works
  while the modules before compute.
- writes: whoever changes a chunk (the optimizer step's copy-out, a write-back) takes a fresh
  buffer from ``for_overwrite`` (nothing is read into it), fills it whole and hands it back with
  ``written``; the cache then holds it, dirty, in place of the old one, and it goes to the drive
  when evicted. A chunk handed out is never changed in place - a device copy or a gather still
  reading it sees the values it was handed - and a buffer never handed back changes nothing (a
  step cut short leaves the old values, on the drive and in the cache alike).
- eviction (least recently used first, past ``max_in_cpu``) only drops the cache's reference:
  a chunk still in use - a gather reading it - stays alive until its user is done. With ``pin``
  (CUDA) the buffers are page-locked, from torch's caching host allocator, which does not hand
  a freed block out again before the device copies reading it are done; so a gather's copy to
  the device runs asynchronously even from a chunk the cache has let go.

Same-chunk transfers are ordered here, as the I/O engine does not order them: a write waits for
the chunk's previous write, a read for its pending write, and a chunk changed while a read
ahead of it was in flight drops that read.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ...handles import Handle
from ...ops.aio import AsyncFileIO, aligned_empty, aligned_numel
from .swap_files import SwapDir

Key = tuple[int, int]  # (reserved group, segment)


@dataclass
class ParamSwapStats:
    read_bytes: int = 0
    write_bytes: int = 0
    wait_s: float = 0.0  # time callers were blocked on the drive
    hits: int = 0  # chunk() served from the cache
    read_ahead_hits: int = 0  # ... from a read started ahead
    misses: int = 0  # ... read on demand


@dataclass
class _Entry:
    buffer: torch.Tensor  # the aligned whole: what moves to and from the drive
    view: torch.Tensor  # the chunk's elements, handed out
    dirty: bool = False


class ParamSwap:
    def __init__(self, swap_dir: SwapDir, aio: AsyncFileIO, *, max_in_cpu: int,
                 read_ahead_numel: int, pin: bool = False):
        self.dir, self.aio, self.pin = swap_dir, aio, pin
        self.max_in_cpu, self.read_ahead_numel = max_in_cpu, read_ahead_numel
        self.dtypes: list[torch.dtype] = []
        self.numels: list[list[int]] = []
        self.offsets: list[list[int]] = []  # bytes, per group and segment
        self.file_sizes: list[int] = []
        self.cache: OrderedDict[Key, _Entry] = OrderedDict()
        self.cached_numel = 0
        self._reads: dict[Key, tuple[Handle, _Entry]] = {}
        self._writes: dict[Key, tuple[Handle, torch.Tensor]] = {}
        self.stats = ParamSwapStats()

    # -- laying the model out -----------------------------------------------------------------
    def reserve(self, chunk_numels: list[int], dtype: torch.dtype) -> int:
        """A file for the next partitioned group's chunks; returns the group's index here."""
        gi = len(self.numels)
        offsets, at = [], 0
        for numel in chunk_numels:
            offsets.append(at)
            at += aligned_numel(numel, dtype) * dtype.itemsize
        self.dtypes.append(dtype)
        self.numels.append(list(chunk_numels))
        self.offsets.append(offsets)
        self.file_sizes.append(at)
        self.aio.allocate(self._path(gi), max(at, 1))
        return gi

    def put(self, gi: int, s: int, values: torch.Tensor) -> None:
        """The initial values of segment s's chunk (written now; not cached)."""
        if values.numel() != self.numels[gi][s]:
            raise ValueError(f"segment {s} of parameter group {gi}: {values.numel()} values "
                             f"for a chunk of {self.numels[gi][s]}")
        entry = self._new_entry((gi, s))
        entry.view.copy_(values)
        self._write((gi, s), entry.buffer)
        self._wait([self._writes.pop((gi, s))[0]])

    # -- reading --------------------------------------------------------------------------------
    def chunk(self, gi: int, s: int) -> torch.Tensor:
        """Segment s's chunk of group gi, in host memory. Read it, do not change it (see
        ``for_overwrite``); it stays valid while referenced, even once evicted."""
        key = (gi, s)
        entry = self.cache.get(key)
        if entry is not None:
            self.cache.move_to_end(key)
            self.stats.hits += 1
            return entry.view
        if key in self._reads:
            handle, entry = self._reads.pop(key)
            self.stats.read_ahead_hits += 1
        else:
            entry = self._new_entry(key)
            handle = self._read(key, entry)
            self.stats.misses += 1
        self._wait([handle])
        self._insert(key, entry)
        return entry.view

    def read_ahead(self, keys: list[Key]) -> None:
        """Start reading these chunks (those neither cached nor on their way), as far as the
        read-ahead budget of elements in flight allows."""
        budget = self.read_ahead_numel - sum(e.view.numel() for _, e in self._reads.values())
        for key in keys:
            if key in self.cache or key in self._reads:
                continue
            numel = self.numels[key[0]][key[1]]
            if numel > budget:
                break
            budget -= numel
            entry = self._new_entry(key)
            self._reads[key] = (self._read(key, entry), entry)

    # -- writing --------------------------------------------------------------------------------
    def for_overwrite(self, gi: int, s: int) -> torch.Tensor:
        """A fresh buffer for segment s's new values, to be filled whole and handed to
        ``written`` (nothing is read into it)."""
        return self._new_entry((gi, s)).view

    def written(self, gi: int, s: int, view: torch.Tensor) -> None:
        """``view`` (from ``for_overwrite``) holds segment s's new values: cache it, dirty."""
        key = (gi, s)
        self._drop_read(key)  # a read ahead started before the change holds old values
        self._insert(key, _Entry(self._whole(key, view), view, dirty=True))

    def flush(self) -> None:
        """Every changed chunk on the drive (the cache keeps them, clean)."""
        for key, entry in self.cache.items():
            if entry.dirty:
                self._write(key, entry.buffer)
                entry.dirty = False
        self._wait([handle for handle, _ in self._writes.values()])
        self._writes.clear()

    # -- internals ------------------------------------------------------------------------------
    def _path(self, gi: int) -> str:
        return self.dir.file(f"param{gi}.swp")

    def _new_entry(self, key: Key) -> _Entry:
        gi, s = key
        dtype, numel = self.dtypes[gi], self.numels[gi][s]
        buffer = aligned_empty(aligned_numel(numel, dtype), dtype, pin=self.pin)
        buffer[numel:].zero_()
        return _Entry(buffer, buffer[:numel])

    def _whole(self, key: Key, view: torch.Tensor) -> torch.Tensor:
        """The aligned buffer ``view`` (a chunk handed out by this swap) is the start of."""
        gi, s = key
        dtype = self.dtypes[gi]
        numel = aligned_numel(self.numels[gi][s], dtype)
        storage = view.untyped_storage()
        if view.dtype != dtype or view.numel() != self.numels[gi][s] or \
                storage.nbytes() < (view.storage_offset() + numel) * dtype.itemsize:
            raise ValueError(f"ParamSwap.written: segment {s} of group {gi} was not given a "
                             "buffer from for_overwrite (a bug)")
        return view.new_empty(0).set_(storage, view.storage_offset(), (numel,))

    def _insert(self, key: Key, entry: _Entry) -> None:
        old = self.cache.pop(key, None)
        if old is not None:
            self.cached_numel -= old.view.numel()
        self.cache[key] = entry
        self.cached_numel += entry.view.numel()
        self._evict(keep=key)

    def _evict(self, keep: Key) -> None:
        """Least recently used first, down to max_in_cpu elements (``keep``, the chunk just
        used, stays). A dirty chunk's write starts; its buffer stays alive until done."""
        while self.cached_numel > self.max_in_cpu and len(self.cache) > 1:
            key = next(iter(self.cache))
            if key == keep:
                self.cache.move_to_end(key)
                key = next(iter(self.cache))
            entry = self.cache.pop(key)
            self.cached_numel -= entry.view.numel()
            if entry.dirty:
                self._write(key, entry.buffer)
        self._reap()

    def _read(self, key: Key, entry: _Entry) -> Handle:
        self._finish_write(key)  # read after write
        gi, s = key
        self.stats.read_bytes += entry.buffer.numel() * entry.buffer.element_size()
        return self.aio.read(entry.buffer, self._path(gi), self.offsets[gi][s])

    def _write(self, key: Key, buffer: torch.Tensor) -> None:
        self._finish_write(key)  # two writes of one chunk in flight could land in any order
        gi, s = key
        self.stats.write_bytes += buffer.numel() * buffer.element_size()
        self._writes[key] = (self.aio.write(buffer, self._path(gi), self.offsets[gi][s]),
                             buffer)

    def _finish_write(self, key: Key) -> None:
        pending = self._writes.pop(key, None)
        if pending is not None:
            self._wait([pending[0]])

    def _drop_read(self, key: Key) -> None:
        pending = self._reads.pop(key, None)
        if pending is not None:  # the drive still writes into its buffer: let it finish
            self._wait([pending[0]])

    def _reap(self) -> None:
        """Forget finished writes (their buffers are freed with them)."""
        for key in [k for k, (handle, _) in self._writes.items() if handle.done()]:
            self._wait([self._writes.pop(key)[0]])  # raises a failed write's error

    def _wait(self, handles: list[Handle]) -> None:
        t0 = time.perf_counter()
        for handle in handles:
            handle.host_wait()
        self.stats.wait_s += time.perf_counter() - t0

    # -- reports --------------------------------------------------------------------------------
    def file_bytes(self) -> int:
        return sum(self.file_sizes)

    def host_bytes(self) -> int:
        """Host memory the swap holds now: the cache, reads ahead and writes in flight."""
        entries = list(self.cache.values()) + [e for _, e in self._reads.values()]
        return sum(e.buffer.numel() * e.buffer.element_size() for e in entries) + \
            sum(b.numel() * b.element_size() for _, b in self._writes.values())

    def close(self) -> None:
        self._wait([h for h, _ in list(self._reads.values()) + list(self._writes.values())])
        self._reads.clear()
        self._writes.clear()
        self.cache.clear()
        self.cached_numel = 0
        for gi in range(len(self.numels)):
            self.aio.forget(self._path(gi))
        self.dir.remove()
