"""The Adam update in PyTorch ops on flat tensors: the fallback where no kernel runs, and the
reference every kernel (CPUAdam, FusedAdam, the 16-bit step) is tested against."""
from __future__ import annotations

import math


def adam_torch(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step, adamw, bias_correction,
               low=None) -> None:
    """CPUAdam's update in PyTorch ops, in torch.optim.AdamW's order, and the reference the
    kernels (csrc/common/adam_coefficients.h) agree with to one ulp: they multiply v's square
    root by 1/sqrt(bc2) where torch divides by sqrt(bc2), and so does this. On the CPU the
    square root is taken in float64: torch's vectorised float32 sqrt (Sleef) may be one ulp off
    the correctly rounded value the kernels' sqrt gives, which grows to several ulps of the
    update (a float64 sqrt rounded to float32 is the correctly rounded float32 sqrt)."""
    if adamw:
        p.mul_(1 - lr * weight_decay)
    elif weight_decay != 0:
        g = g.add(p, alpha=weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc1 = 1 - beta1 ** step if bias_correction else 1.0
    bc2 = 1 - beta2 ** step if bias_correction else 1.0
    root = v.sqrt() if v.is_cuda else v.double().sqrt_().float()
    denom = root.mul_(1 / math.sqrt(bc2)).add_(eps)
    p.addcdiv_(m, denom, value=-lr / bc1)
    if low is not None:
        low.copy_(p)
