"""Large zero-filled host buffers whose memory is taken when written, not when made."""
from __future__ import annotations

import mmap

import torch

_ON_DEMAND_BYTES = 1 << 20  # below this the page-granular mapping is not worth it


def zeros_on_demand(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros(numel, dtype=dtype, device=device)``; on the CPU, for large buffers, an
    anonymous mapping the kernel fills with zero pages as they are first touched. torch.zeros
    writes every page at once, so a buffer only needed later (the reduced-gradient shard,
    first written by the first backward) would count in the resident memory of a process
    that has only loaded its model so far."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    nbytes = numel * itemsize
    if torch.device(device).type != "cpu" or nbytes < _ON_DEMAND_BYTES:
        return torch.zeros(numel, dtype=dtype, device=device)
    # private (copy-on-write across a fork, as malloc'd memory is); the tensor keeps the
    # mapping alive (frombuffer holds a reference to it)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(mapping, dtype=dtype, count=numel)
