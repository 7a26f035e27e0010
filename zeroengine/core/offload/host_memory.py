"""Large zero-filled host buffers whose memory is taken when written, not when made."""
from __future__ import annotations

import ctypes
import ctypes.util
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


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _glibc():
    """The C library when it is glibc (malloc_trim and mallinfo2 exist), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
        if hasattr(libc, "mallinfo2"):  # glibc >= 2.33
            libc.mallinfo2.restype = _MallInfo2
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _glibc()


def return_free_heap() -> bool:
    """Give the pages malloc holds free back to the system (glibc's malloc_trim(0), which
    also releases whole free pages inside the heap). Why: a training step frees many tensors
    of many sizes - activations, the gradients autograd makes - and glibc, once a large block
    has been freed, serves blocks up to 32 MB from its heap instead of fresh mappings, so
    freed memory stays resident as fragments (stage 3's gathered segments and gradient
    staging are kept apart in ops/host_pool for that reason). Called once per optimizer
    step where host memory holds the training state (~10-20 ms a call on that heap).
    False where the C library is not glibc."""
    if _LIBC is None:
        return False
    _LIBC.malloc_trim(0)
    return True


def heap_free_bytes() -> int:
    """Bytes malloc holds free in its heaps (resident or not): the allocator slack visible
    from inside the process (glibc's mallinfo2 fordblks; 0 where unavailable)."""
    if _LIBC is None or not hasattr(_LIBC, "mallinfo2"):
        return 0
    return int(_LIBC.mallinfo2().fordblks)
