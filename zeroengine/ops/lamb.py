"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning"), with DeepSpeed's Lamb
config keys: Adam's moments, then each parameter's update scaled by its own trust ratio
||w|| / ||update||, clamped to [min_coeff, max_coeff] (1 where either norm is 0).

The trust ratio needs the whole parameter, so LAMB is tensor-wise: zeroengine steps each
parameter whole on one rank (core/optim/owner_step.py). Plain torch ops, any device.
"""
from __future__ import annotations

import torch


class Lamb(torch.optim.Optimizer):
    zeroengine_update = "tensorwise"  # core/optim/kind.py: no probe needed

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, bias_correction: bool = True,
                 max_coeff: float = 10.0, min_coeff: float = 0.01):
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"Lamb: lr, eps and weight_decay must be >= 0, got {lr}, {eps}, "
                             f"{weight_decay}")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"Lamb: betas must be in [0, 1), got {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, bias_correction=bias_correction,
                                      max_coeff=max_coeff, min_coeff=min_coeff))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.float()
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                if group["bias_correction"]:
                    m_hat = m / (1 - beta1 ** state["step"])
                    v_hat = v / (1 - beta2 ** state["step"])
                else:
                    m_hat, v_hat = m, v
                update = m_hat / (v_hat.sqrt() + group["eps"])
                weights = p.float()
                if group["weight_decay"]:
                    update.add_(weights, alpha=group["weight_decay"])
                w_norm = torch.linalg.vector_norm(weights)
                u_norm = torch.linalg.vector_norm(update)
                trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm,
                                    torch.ones_like(w_norm))
                trust = trust.clamp(group["min_coeff"], group["max_coeff"])
                p.add_((update * trust).to(p.dtype), alpha=-group["lr"])
        return loss
