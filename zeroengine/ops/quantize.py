"""Blockwise symmetric int8 quantization: the wire format of the quantized collectives.

A tensor is cut into blocks of ``block`` elements; each block keeps one fp32 scale
``s = max|x| / 127`` and its elements as ``round(x / s)`` in [-127, 127]. Dequantized, every
element is within ``s / 2 = max|block| / 254`` of its value (``error_bound``): 0.39% of the
block's largest magnitude, whatever the dtype. On the wire a block costs ``block + 4`` bytes
instead of ``2 * block`` (bf16) or ``4 * block`` (fp32): with 256-element blocks, 0.51x of
bf16 and 0.25x of fp32.

Kernels: csrc/quant (CPU, threads over blocks) and csrc/cuda/quantize.cu; elsewhere PyTorch
ops. All three compute ``x / s``, round half to even and ``q * s`` exactly as here, so they
give the same bytes (tests/test_quantize.py compares them).
"""
from __future__ import annotations

import torch

from .extensions import load_cpu_extension, load_cuda_kernels

_ext = load_cpu_extension("_quant_ext")
_TINY = torch.finfo(torch.float32).tiny  # the divisor of an all-zero block (its scale is 0)
DEFAULT_BLOCK = 256


def using_extension() -> bool:
    return _ext is not None


def num_blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def wire_bytes(numel: int, block: int) -> int:
    """Bytes one quantized tensor of ``numel`` elements takes (int8 values + fp32 scales)."""
    return numel + 4 * num_blocks(numel, block)


def _scales_offset(numel: int) -> int:
    return -(-numel // 4) * 4  # the int8 values, padded so the fp32 scales are 4-byte aligned


def piece_bytes(numel: int, block: int) -> int:
    """Bytes of one packed tensor in a collective's buffer (``pack``): its int8 values, padded
    to 4 bytes, then its fp32 scales."""
    return _scales_offset(numel) + 4 * num_blocks(numel, block)


def pack(x: torch.Tensor, block: int, piece: torch.Tensor) -> None:
    """Quantize ``x`` into ``piece``, a uint8 slot of ``piece_bytes(x.numel(), block)``."""
    n = x.numel()
    quantize(x, block, piece[:n].view(torch.int8), piece[_scales_offset(n):].view(torch.float32))


def unpack(piece: torch.Tensor, numel: int, block: int, out: torch.Tensor,
           accumulate: bool = False) -> torch.Tensor:
    """``dequantize`` what ``pack`` wrote into ``piece`` (of a ``numel``-element tensor)."""
    return dequantize(piece[:numel].view(torch.int8),
                      piece[_scales_offset(numel):].view(torch.float32), out, block, accumulate)


def error_bound(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per element, the largest |dequantize(quantize(x)) - x|: max|its block| / 254."""
    flat = x.detach().reshape(-1).float()
    pad = num_blocks(flat.numel(), block) * block - flat.numel()
    amax = torch.nn.functional.pad(flat, (0, pad)).view(-1, block).abs().amax(1)
    return (amax / 254).repeat_interleave(block)[:flat.numel()].view(x.shape)


def _kernels(t: torch.Tensor):
    if t.is_cuda:
        kernels = load_cuda_kernels()
        return kernels if kernels is not None and hasattr(kernels, "quantize_int8") else None
    return _ext if t.device.type == "cpu" else None


def quantize(x: torch.Tensor, block: int = DEFAULT_BLOCK, q: torch.Tensor | None = None,
             scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values with x's numel, fp32 scales one per block); into ``q`` / ``scales`` when
    given (1-D, contiguous: e.g. slots of a collective's send buffer)."""
    x = x.detach().reshape(-1)
    if not x.is_contiguous():
        x = x.contiguous()
    n = x.numel()
    q = torch.empty(n, dtype=torch.int8, device=x.device) if q is None else q
    scales = torch.empty(num_blocks(n, block), dtype=torch.float32, device=x.device) \
        if scales is None else scales
    kernels = _kernels(x)
    if kernels is not None and x.dtype in (torch.float32, torch.bfloat16, torch.float16):
        kernels.quantize_int8(x, q, scales, block)
        return q, scales
    full = n // block * block
    # whole blocks as one 2-D op; the short last block (if any) on its own
    for lo, hi, rows in ((0, full, n // block), (full, n, 1)):
        if hi == lo:
            continue
        part = x[lo:hi].float().view(rows, -1)
        s = part.abs().amax(1) / 127
        scales[lo // block:lo // block + rows] = s
        q[lo:hi] = torch.round(part / s.clamp_min(_TINY)[:, None]).clamp_(-127, 127) \
            .to(torch.int8).view(-1)
    return q, scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
               block: int = DEFAULT_BLOCK, accumulate: bool = False) -> torch.Tensor:
    """``out`` (1-D, contiguous, q's numel) = q * scale of its block, or += with
    ``accumulate`` (summed in fp32, then stored in out's dtype)."""
    kernels = _kernels(out)
    if kernels is not None and out.dtype in (torch.float32, torch.bfloat16, torch.float16) \
            and out.is_contiguous():
        kernels.dequantize_int8(q, scales, out, block, accumulate)
        return out
    n = q.numel()
    values = q.float()
    full = n // block * block
    if full:
        values[:full].view(-1, block).mul_(scales[:full // block, None])
    if n > full:
        values[full:].mul_(scales[-1])
    if accumulate:
        out.copy_(out.float().add_(values))
    else:
        out.copy_(values)
    return out
