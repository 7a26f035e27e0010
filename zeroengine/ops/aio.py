"""Asynchronous file I/O for NVMe offload: tensors to and from files, in the background.

``AsyncFileIO(block_size, queue_depth, thread_count, o_direct)`` reads and writes the bytes of
contiguous CPU tensors at file offsets; each call returns a ``Handle`` (zeroengine/handles.py,
the vocabulary of everything asynchronous), whose ``wait()`` blocks until the whole transfer
is done and raises the first failure naming the file and offset. The knobs are DeepSpeed's
``aio`` section's (``block_size``, ``queue_depth``, ``thread_count``).

Backends (``AsyncFileIO.backend``): "io_uring" or "threads" - csrc/aio, chosen when it was built
(setup.py: io_uring where liburing-dev is installed) - or "python", a thread pool of
os.pread/os.pwrite where the extension is not built. O_DIRECT (no page cache, as DeepSpeed's
aio) applies when the buffer, offset and length are 4096-aligned: ``aligned_empty`` gives such
buffers.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from ..handles import Handle
from .extensions import load_cpu_extension

_ext = load_cpu_extension("_aio_ext")
ALIGN = 4096


def aligned_empty(numel: int, dtype: torch.dtype = torch.uint8, pin: bool = False) -> torch.Tensor:
    """An uninitialised CPU tensor whose data starts on a 4096-byte boundary (O_DIRECT);
    ``pin``: page-locked (fast copies to a CUDA device)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.empty(numel * itemsize + ALIGN, dtype=torch.uint8, pin_memory=pin)
    start = (-raw.data_ptr()) % ALIGN
    return raw[start:start + numel * itemsize].view(dtype)


def aligned_numel(numel: int, dtype: torch.dtype) -> int:
    """``numel`` rounded up so the bytes are a multiple of 4096 (an O_DIRECT transfer)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    per = ALIGN // itemsize if ALIGN % itemsize == 0 else ALIGN
    return -(-numel // per) * per


class _Work:
    """A transfer in flight, shaped like a torch Work for Handle."""

    def __init__(self, wait, done):
        self.wait, self.is_completed = wait, done


class AsyncFileIO:
    def __init__(self, block_size: int = 1 << 20, queue_depth: int = 32, thread_count: int = 4,
                 o_direct: bool = True, backend: str | None = None):
        """``backend``: None for the best available; "python" forces the fallback."""
        if block_size <= 0 or block_size % ALIGN:
            raise ValueError(f"aio block_size must be a positive multiple of {ALIGN}, got "
                             f"{block_size}")
        self.block_size, self.queue_depth = block_size, queue_depth
        self.thread_count, self.o_direct = thread_count, o_direct
        if _ext is not None and backend != "python":
            self._engine = _ext.Engine(block_size, queue_depth, thread_count, o_direct)
            self.backend = _ext.Engine.backend()
            self._pool = None
        else:
            self._engine = None
            self.backend = "python"
            self._pool = ThreadPoolExecutor(max(1, thread_count), "zeroengine-aio")
            self._fds: dict[tuple[str, bool], int] = {}

    # -- transfers ------------------------------------------------------------------------
    def read(self, tensor: torch.Tensor, path: str, offset: int = 0) -> Handle:
        """Fill ``tensor`` with the bytes at ``offset`` of ``path``."""
        return self._submit(tensor, path, offset, write=False)

    def write(self, tensor: torch.Tensor, path: str, offset: int = 0) -> Handle:
        """Write ``tensor``'s bytes at ``offset`` of ``path`` (created if missing)."""
        return self._submit(tensor, path, offset, write=True)

    def _submit(self, tensor: torch.Tensor, path: str, offset: int, write: bool) -> Handle:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("aio transfers take contiguous CPU tensors")
        if self._engine is not None:
            engine = self._engine
            rid = engine.submit(tensor, os.fspath(path), offset, write)
            return Handle(_Work(lambda: engine.wait(rid), lambda: engine.done(rid)))
        future = self._pool.submit(self._transfer, tensor, os.fspath(path), offset, write)
        return Handle(_Work(future.result, future.done))

    def _transfer(self, tensor, path, offset, write) -> None:
        view = memoryview(tensor.view(torch.uint8).reshape(-1).numpy())
        key = (path, write)
        fd = self._fds.get(key)
        if fd is None:
            fd = self._fds[key] = os.open(path, os.O_WRONLY | os.O_CREAT if write
                                          else os.O_RDONLY, 0o600)
        done = 0
        while done < len(view):
            chunk = view[done:done + self.block_size]
            n = os.pwrite(fd, chunk, offset + done) if write else \
                os.preadv(fd, [chunk], offset + done)
            if n <= 0:
                raise OSError(f"{'write to' if write else 'read from'} {path} at offset "
                              f"{offset + done} failed: short transfer (file too short?)")
            done += n

    @staticmethod
    def allocate(path: str, nbytes: int) -> None:
        """Reserve ``nbytes`` for ``path`` up front (posix_fallocate), as fio lays out its
        file: O_DIRECT writes into allocated extents need no allocation on the way."""
        fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        finally:
            os.close(fd)

    def sync(self) -> None:
        """fsync every file written: the bytes are on the device after this."""
        if self._engine is not None:
            self._engine.sync_files()
            return
        for (_, write), fd in self._fds.items():
            if write:
                os.fsync(fd)

    def forget(self, path: str) -> None:
        """Close ``path``'s descriptors (before removing or replacing the file)."""
        path = os.fspath(path)
        if self._engine is not None:
            self._engine.forget(path)
            return
        for key in [k for k in self._fds if k[0] == path]:
            os.close(self._fds.pop(key))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
        self._engine = None
