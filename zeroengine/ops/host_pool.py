"""Host buffers the engine frees and takes again every step - stage 3's gathered segments, the
gradient staging of stages 2-3 - from csrc/host_pool's pool where it is built, plain
``torch.empty`` elsewhere (a GPU, a small buffer, ZEROENGINE_NO_EXT=1).

Through malloc those buffers fragment the heap: a freed segment's hole is taken by activations
and its next gather extends the heap (host_pool.cpp says what was measured). The pool keeps each
size's blocks mapped between uses, never more than its peak of live bytes.
"""
from __future__ import annotations

import torch

from .extensions import load_cpu_extension

_ext = load_cpu_extension("_host_pool_ext")

# Below this a buffer stays with malloc: its bins reuse small chunks well, and a block here takes
# whole pages.
POOLED_MIN_BYTES = 256 * 1024


def available() -> bool:
    return _ext is not None


def empty(numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialised 1-D tensor of ``numel`` elements; its storage may be resized to 0 and
    back (that is how a segment is released and gathered again), and stays in the pool."""
    device = torch.device(device)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if _ext is None or device.type != "cpu" or numel * itemsize < POOLED_MIN_BYTES:
        return torch.empty(numel, dtype=dtype, device=device)
    return _ext.empty(numel, dtype)


def zeros(numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    return empty(numel, dtype, device).zero_()


def stats() -> dict[str, int]:
    """live_bytes, cached_bytes (free blocks kept mapped), peak_live_bytes, maps, reuses; all
    zero where the pool is not built."""
    if _ext is None:
        return dict.fromkeys(("live_bytes", "cached_bytes", "peak_live_bytes", "maps", "reuses"),
                             0)
    return dict(_ext.stats())


def trim() -> None:
    """Unmap every free block of the pool (what is live stays)."""
    if _ext is not None:
        _ext.trim()
