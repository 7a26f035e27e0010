"""The PyTorch path of CPUAdam's 16-bit step (csrc/adam/cpu_adam.cpp, adam_step_mixed), where
the kernel does not run (another device, no extension): the update computed in fp32 on widened
copies, then rounded into the master's and moments' own dtypes - to nearest, or stochastically
with the same random bits as the kernel (csrc/common/stochastic_rounding.h, here in int64 ops:
a 32-bit product fits 64 bits, and its low half survives int64 wrap-around).
"""
from __future__ import annotations

import torch

from .torch_adam import adam_torch

_M32 = 0xFFFFFFFF


def fmix32(h):
    """MurmurHash3's finaliser on a Python int or an int64 tensor of values below 2**32."""
    if isinstance(h, int):
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & _M32
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & _M32
        return h ^ (h >> 16)
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def rounding_key(seed: int, step: int, stream: int) -> int:
    """Per (seed, step, stream): 0 the master, 1 exp_avg, 2 exp_avg_sq."""
    k = fmix32((seed & _M32) ^ 0x9E3779B9)
    k = fmix32(k ^ ((seed >> 32) & _M32))
    k = fmix32(k ^ (step & _M32))
    k = fmix32(k ^ ((step >> 32) & _M32))
    return fmix32(k ^ ((stream * 0x27D4EB2F + 1) & _M32))


def rounding_bits(key: int, index: torch.Tensor) -> torch.Tensor:
    """32 random bits per element of ``index`` (int64 model indices)."""
    return fmix32((index & _M32) ^ fmix32(key ^ (index >> 32)))


def bf16_stochastic(values: torch.Tensor, random: torch.Tensor) -> torch.Tensor:
    """fp32 ``values`` rounded to bf16 up with probability (dropped bits) / 2**16."""
    bits = values.view(torch.int32).to(torch.int64) & _M32
    rounded = ((bits + (random & 0xFFFF)) >> 16) & 0xFFFF
    rounded = torch.where(torch.isnan(values), 0x7FC0, rounded)
    signed = rounded - ((rounded >> 15) << 16)  # as int16's two's complement
    return signed.to(torch.int16).view(torch.bfloat16)


def run_indices(runs: torch.Tensor | None, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions in the buffer, their indices in the model) of the elements ``runs`` names
    ([k, 3]: first, count, model index of the first); all n from 0 without it."""
    if runs is None:
        positions = torch.arange(n, device=device)
        return positions, positions
    positions, indices = [], []
    for first, count, index in runs.tolist():
        positions.append(torch.arange(first, first + count, device=device))
        indices.append(torch.arange(index, index + count, device=device))
    if not positions:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return empty, empty
    return torch.cat(positions), torch.cat(indices)


def adam_step_lowp(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step, adamw,
                   bias_correction, grad_coef=1.0, stochastic=False, seed=0, runs=None,
                   low=None) -> None:
    """adam_step_mixed's semantics in PyTorch ops (see the kernel for the arguments)."""
    p32, m32, v32 = p.float(), m.float(), v.float()
    g32 = g.float() * grad_coef if grad_coef != 1.0 or g.dtype != torch.float32 else g
    adam_torch(p32, g32, m32, v32, lr, beta1, beta2, eps, weight_decay, step, adamw,
               bias_correction)
    positions, indices = run_indices(runs, p.numel(), p.device) if (stochastic or runs is not
                                                                    None) else (None, None)
    for stream, (target, values) in enumerate(((p, p32), (m, m32), (v, v32))):
        if positions is None:
            target.copy_(values)  # to nearest, ties to even (as the kernel's converters)
            continue
        chosen = values[positions]
        if stochastic and target.dtype == torch.bfloat16:
            rounded = bf16_stochastic(chosen, rounding_bits(rounding_key(seed, step, stream),
                                                            indices))
        else:
            rounded = chosen.to(target.dtype)
        target[positions] = rounded
    if low is not None:  # (an fp32 master: its values as stored)
        low.copy_(p)
