"""The fp32 master kept in 2 bytes beside its bf16 weight (bf16.store_param_remainders).

An fp32 value is its upper 16 bits and its lower 16 bits; the bf16 weight the model computes
with is the upper half rounded to nearest (ties to even, as ``tensor.to(torch.bfloat16)``).
The remainder stored is the lower half as it is: reading it back, a lower half of 0x8000 or
more means the rounding went up, so the upper half is the weight minus one. One case does not
fit 16 bits: a value exactly halfway whose upper half is even rounds *down* to it, and its
0x8000 would read back as rounded up; such a value is stored one fp32 ulp nearer the weight
(lower half 0x7FFF), which rounds to the same weight. So the master is exact except at those
ties (about one element-update in 2**17), where it moves by 2**-24 of its value.

Both directions are one pass of the C++ extension (csrc/adam/cpu_adam.cpp) over CPU tensors;
elsewhere (a GPU, no extension) PyTorch ops on the fp32 value's two 16-bit halves as int16
views (little-endian): no 64-bit temporaries, and no arithmetic that could round.
"""
from __future__ import annotations

import sys

import torch

from ...ops.extensions import load_cpu_extension

if sys.byteorder != "little":  # the halves below are read from a little-endian layout
    raise ImportError("zeroengine's bf16 remainders assume a little-endian machine")

_TIE = -0x8000  # int16 view of a lower half of 0x8000
_ext = load_cpu_extension("_cpu_adam_ext")


def _on_cpu(*tensors) -> bool:
    """Whether the extension can take these (None: an absent weight)."""
    return _ext is not None and hasattr(_ext, "split_master") and all(
        t is None or (t.device.type == "cpu" and t.is_contiguous()) for t in tensors)


def split_master(master: torch.Tensor, weight: torch.Tensor | None,
                 remainder: torch.Tensor) -> None:
    """fp32 ``master`` -> its bf16 ``weight`` (round to nearest even; None: the weight holds
    it already) and int16 ``remainder`` (1-D, same length; ``weight`` may be on another
    device than the others)."""
    if _on_cpu(master, weight, remainder):
        _ext.split_master(master, weight, remainder)
        return
    if weight is not None:
        weight.copy_(master)
    halves = master.view(torch.int16).view(-1, 2)
    lower, upper = halves[:, 0], halves[:, 1]
    remainder.copy_(lower)
    # exactly halfway and rounded down to an even upper half: stored as just below halfway
    remainder.masked_fill_((lower == _TIE) & ((upper & 1) == 0), 0x7FFF)


def join_master(weight: torch.Tensor, remainder: torch.Tensor, out: torch.Tensor) -> None:
    """The inverse: ``out`` (fp32) from the bf16 ``weight`` and its int16 ``remainder``."""
    if _on_cpu(weight, remainder, out):
        _ext.join_master(weight, remainder, out)
        return
    halves = out.view(torch.int16).view(-1, 2)
    halves[:, 0].copy_(remainder)
    rounded_up = (remainder < 0).to(torch.int16)  # a lower half of 0x8000 or more
    torch.sub(weight.to(remainder.device).view(torch.int16), rounded_up, out=halves[:, 1])
