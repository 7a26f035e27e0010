"""Copy many tensors into / out of one flat buffer at given offsets.

The C++ version (csrc/flatten) does all copies in one call, split across threads by bytes, so
one large tensor does not serialise behind many small ones; on CUDA the multi-tensor kernel of
csrc/cuda copies (and converts between fp32/bf16/fp16) ~36 tensors per launch; the fallback
loops in Python.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .extensions import load_cpu_extension, load_cuda_kernels

_ext = load_cpu_extension("_flatten_ext")


def using_extension() -> bool:
    return _ext is not None


_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _cuda_kernels_for(tensors: Sequence[torch.Tensor], flat: torch.Tensor):
    """The CUDA kernels when they take this call (one dtype per side), else None."""
    if not flat.is_cuda or not tensors or flat.dtype not in _KERNEL_DTYPES:
        return None
    dtype = tensors[0].dtype
    if dtype not in _KERNEL_DTYPES or any(t.dtype != dtype or t.device != flat.device
                                          for t in tensors):
        return None
    return load_cuda_kernels()


def _check(tensors: Sequence[torch.Tensor], flat: torch.Tensor, offsets: Sequence[int]):
    if len(tensors) != len(offsets):
        raise ValueError(f"{len(tensors)} tensors but {len(offsets)} offsets")
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError("flat must be a contiguous 1-D tensor")
    for t, off in zip(tensors, offsets):
        if off < 0 or off + t.numel() > flat.numel():
            raise ValueError(f"tensor of {t.numel()} elements at offset {off} overruns the flat "
                             f"buffer of {flat.numel()}")


def flatten_into(tensors: Sequence[torch.Tensor], flat: torch.Tensor, offsets: Sequence[int],
                 use_extension: bool | None = None) -> None:
    """flat[off:off+t.numel()] = t (converted to flat's dtype), for each tensor."""
    _check(tensors, flat, offsets)
    kernels = _cuda_kernels_for(tensors, flat) if use_extension is not False else None
    if kernels is not None:
        kernels.flatten_into(list(tensors), flat, list(offsets))
        return
    if (use_extension is None and _ext is not None) or use_extension:
        _require_ext()
        _ext.flatten_into(list(tensors), flat, list(offsets))
        return
    with torch.no_grad():
        for t, off in zip(tensors, offsets):
            flat[off:off + t.numel()].copy_(t.reshape(-1))


def unflatten_from(flat: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int],
                   use_extension: bool | None = None) -> None:
    """t.copy_(flat[off:off+t.numel()]) for each tensor (converted to t's dtype)."""
    _check(tensors, flat, offsets)
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("unflatten_from writes into contiguous tensors only")
    kernels = _cuda_kernels_for(tensors, flat) if use_extension is not False else None
    if kernels is not None:
        kernels.unflatten_from(flat, list(tensors), list(offsets))
        return
    if (use_extension is None and _ext is not None) or use_extension:
        _require_ext()
        _ext.unflatten_from(flat, list(tensors), list(offsets))
        return
    with torch.no_grad():
        for t, off in zip(tensors, offsets):
            t.copy_(flat[off:off + t.numel()].view(t.shape))


def _require_ext():
    if _ext is None:
        raise RuntimeError("the flatten extension was requested but is not built")
