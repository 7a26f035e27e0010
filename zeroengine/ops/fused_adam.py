"""FusedAdam: CPUAdam's one-pass contract on CUDA, through the multi-tensor kernel in csrc/cuda.

Per step and parameter group, one launch per ~36 tensors (fp32 masters; gradients fp32, bf16 or
fp16) that in the same pass
  - multiplies the gradient by ``grad_coef`` (1 / loss scale x the clip coefficient), so neither
    the unscale nor an fp32 copy of a bf16 gradient costs a pass of its own,
  - leaves every element whose gradient is inf/NaN untouched and sets ``found_nonfinite``,
  - writes the bf16/fp16 copy of each updated parameter (``low_precision_copies``).
``grads`` passes gradients beside the parameters (a bf16 gradient cannot be an fp32 tensor's
``.grad``); without it, ``p.grad`` is used.
Tensors elsewhere (CPU, or no kernels) get the same coefficient and non-finite semantics in
PyTorch ops.
"""
from __future__ import annotations

import torch

from .cpu_adam import CPUAdam
from .extensions import load_cuda_kernels
from .torch_adam import adam_torch as _adam_torch


class FusedAdam(CPUAdam):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw_mode: bool = True,
                 bias_correction: bool = True, use_cuda_kernels: bool | None = None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         adamw_mode=adamw_mode, bias_correction=bias_correction)
        kernels = load_cuda_kernels() if use_cuda_kernels is not False else None
        if use_cuda_kernels and kernels is None:
            raise RuntimeError("FusedAdam(use_cuda_kernels=True) but the CUDA kernels are not "
                               "available (no GPU, or neither built nor buildable)")
        self._kernels = kernels
        self.found_nonfinite: torch.Tensor | None = None  # int32 flag on the params' device

    @torch.no_grad()
    def step(self, closure=None, low_precision_copies: dict | None = None,
             grad_coef: float = 1.0, grads: dict | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.found_nonfinite is not None:
            self.found_nonfinite.zero_()  # the flag reports this step
        for group in self.param_groups:
            grad_of = {p: (grads.get(p) if grads is not None and p in grads else p.grad)
                       for p in group["params"]}
            live = [p for p in group["params"] if grad_of[p] is not None]
            if not live:
                continue
            if self.found_nonfinite is None:
                self.found_nonfinite = torch.zeros(1, dtype=torch.int32, device=live[0].device)
            # One launch takes one step count; a group's tensors differ only after a
            # checkpoint or a parameter without a gradient, so group by it.
            by_step: dict[int, list[torch.Tensor]] = {}
            for p in live:
                by_step.setdefault(int(self.state_of(p)["step"]) + 1, []).append(p)
            for step, params in by_step.items():
                self._step_tensors(group, params, [grad_of[p] for p in params], step,
                                   low_precision_copies or {}, grad_coef)
        return loss

    def _step_tensors(self, group, params, grads, step, lows, grad_coef) -> None:
        for p in params:
            self.state[p]["step"] = step
        beta1, beta2 = group["betas"]
        hyper = (group["lr"], beta1, beta2, group["eps"], group["weight_decay"], step,
                 group["adamw_mode"], group["bias_correction"])
        if self._kernels is not None and all(map(_fits_cuda_kernel, params, grads)):
            # the kernel writes low copies for all tensors of a launch or for none, and takes
            # one gradient dtype
            for subset, subset_grads in _launch_sets(params, grads, lows):
                self._kernels.fused_adam(
                    subset, [g.contiguous() for g in subset_grads],
                    [self.state[p]["exp_avg"] for p in subset],
                    [self.state[p]["exp_avg_sq"] for p in subset],
                    [lows[p] for p in subset if p in lows], *hyper, float(grad_coef),
                    self.found_nonfinite)
            return
        for p, g in zip(params, grads):
            state = self.state[p]
            _adam_masked(p, g, state["exp_avg"], state["exp_avg_sq"], hyper, grad_coef,
                         lows.get(p), self.found_nonfinite)


def _fits_cuda_kernel(p: torch.Tensor, g: torch.Tensor) -> bool:
    return p.is_cuda and p.dtype == torch.float32 and p.is_contiguous() and \
        g.device == p.device and g.dtype in (torch.float32, torch.bfloat16, torch.float16)


def _launch_sets(params, grads, lows) -> list[tuple[list, list]]:
    """(params, grads) split by gradient dtype and low-copy dtype (or none): one launch each."""
    sets: dict[tuple, tuple[list, list]] = {}
    for p, g in zip(params, grads):
        ps, gs = sets.setdefault((g.dtype, lows[p].dtype if p in lows else None), ([], []))
        ps.append(p)
        gs.append(g)
    return list(sets.values())


def _adam_masked(p, g, m, v, hyper, grad_coef, low, found) -> None:
    """The kernel's semantics in PyTorch: scaled gradient, non-finite elements left alone."""
    g = g.float() * grad_coef if (grad_coef != 1.0 or g.dtype != torch.float32) else g
    bad = ~torch.isfinite(g)
    if bool(bad.any()):
        found.fill_(1)
        kept = [t[bad].clone() for t in (p, m, v)]
        g = g.masked_fill(bad, 0.0)
        _adam_torch(p, g, m, v, *hyper)
        for t, old in zip((p, m, v), kept):
            t[bad] = old
    else:
        _adam_torch(p, g, m, v, *hyper)
    if low is not None:
        low.copy_(p)
