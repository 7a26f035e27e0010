"""CPUAdam: Adam/AdamW as a torch.optim.Optimizer whose step is one pass of the C++ kernel in
csrc/adam over each fp32 CPU parameter (p, g, m, v read once, p, m, v written once), optionally
writing the bf16/fp16 copy of the parameter in the same pass (offload's copy-out).

AdamW semantics by default (decoupled weight decay); ``adamw_mode=False`` gives Adam's L2 decay.
Without the extension (or for tensors it does not take: not fp32, not CPU, not contiguous) the
same arithmetic runs in PyTorch.
"""
from __future__ import annotations

import math

import torch

from .extensions import load_cpu_extension

_ext = load_cpu_extension("_cpu_adam_ext")


def using_extension() -> bool:
    return _ext is not None


class CPUAdam(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw_mode: bool = True,
                 bias_correction: bool = True, use_extension: bool | None = None):
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"lr, eps and weight_decay must be >= 0 (got {lr}, {eps}, "
                             f"{weight_decay})")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        adamw_mode=adamw_mode, bias_correction=bias_correction)
        super().__init__(params, defaults)
        self.use_extension = _ext is not None if use_extension is None else use_extension
        if self.use_extension and _ext is None:
            raise RuntimeError("the CPU Adam extension was requested but is not built")

    @torch.no_grad()
    def step(self, closure=None, low_precision_copies: dict | None = None):
        """One update. ``low_precision_copies`` maps a parameter to a bf16/fp16 tensor that
        receives the updated values in the same pass."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state_of(p)
                state["step"] = int(state["step"]) + 1  # torch-format state holds a tensor
                low = low_precision_copies.get(p) if low_precision_copies else None
                args = (group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                        state["step"], group["adamw_mode"], group["bias_correction"])
                if self.use_extension and _fits_kernel(p, p.grad):
                    _ext.adam_step(p, p.grad.contiguous(), state["exp_avg"],
                                   state["exp_avg_sq"], *args, low)
                else:
                    _adam_torch(p, p.grad, state["exp_avg"], state["exp_avg_sq"], *args, low)
        return loss

    def state_of(self, p: torch.Tensor) -> dict:
        """p's state, created (step 0, zero moments) on first use."""
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        return state


def _fits_kernel(p: torch.Tensor, g: torch.Tensor) -> bool:
    return (p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous()
            and g.dtype == torch.float32)


def _adam_torch(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step, adamw, bias_correction,
                low=None) -> None:
    """The same update in PyTorch ops, in torch.optim.AdamW's order, and the reference the
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
