"""CPUAdam: Adam/AdamW as a torch.optim.Optimizer whose step is one pass of the C++ kernel in
csrc/adam over each fp32 CPU parameter (p, g, m, v read once, p, m, v written once), optionally
writing the bf16/fp16 copy of the parameter in the same pass (offload's copy-out).

AdamW semantics by default (decoupled weight decay); ``adamw_mode=False`` gives Adam's L2 decay.
Without the extension (or for tensors it does not take: not fp32, not CPU, not contiguous) the
same arithmetic runs in PyTorch.
"""
from __future__ import annotations

import torch

from .extensions import load_cpu_extension
from .lowp_adam import adam_step_lowp
from .torch_adam import adam_torch as _adam_torch

_ext = load_cpu_extension("_cpu_adam_ext")


def using_extension() -> bool:
    return _ext is not None


class CPUAdam(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw_mode: bool = True,
                 bias_correction: bool = True, use_extension: bool | None = None,
                 state_dtype: torch.dtype = torch.float32, stochastic_rounding: bool = False,
                 rounding_seed: int = 0):
        """``state_dtype``: exp_avg / exp_avg_sq kept in float32 or bfloat16. Parameters may be
        float32, bfloat16 or float16 (a 16-bit master); each update is computed in float32
        and rounded into the storage dtypes: to nearest, or with ``stochastic_rounding``
        (bf16 results) from random bits of (``rounding_seed``, step, the element's index in
        the model: ``step(index_runs=...)``)."""
        if state_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"state_dtype must be float32 or bfloat16, got {state_dtype}")
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
        self.state_dtype = state_dtype
        self.stochastic_rounding = stochastic_rounding
        self.rounding_seed = rounding_seed

    @torch.no_grad()
    def step(self, closure=None, low_precision_copies: dict | None = None,
             grads: dict | None = None, grad_coef: float = 1.0,
             index_runs: dict | None = None):
        """One update. ``low_precision_copies`` maps a parameter to a bf16/fp16 tensor that
        receives the updated values in the same pass. ``grads``: gradients beside the
        parameters (fp32, or the parameter's 16-bit dtype; a bf16 master cannot hold an fp32
        ``.grad``), multiplied by ``grad_coef`` in the pass. ``index_runs``: per parameter, the
        int64 [k, 3] runs (first element, count, index in the model) stochastic rounding draws
        its bits for (and the only elements updated); without it, indices from 0."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                grad = grads.get(p) if grads is not None else p.grad
                if grad is None:
                    continue
                state = self.state_of(p)
                state["step"] = int(state["step"]) + 1  # torch-format state holds a tensor
                low = low_precision_copies.get(p) if low_precision_copies else None
                args = (group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                        state["step"], group["adamw_mode"], group["bias_correction"])
                m, v = state["exp_avg"], state["exp_avg_sq"]
                runs = index_runs.get(p) if index_runs else None
                if p.dtype == m.dtype == grad.dtype == torch.float32 and grad_coef == 1.0 \
                        and runs is None:
                    if self.use_extension and _fits_kernel(p, grad):
                        _ext.adam_step(p, grad.contiguous(), m, v, *args, low)
                    else:
                        _adam_torch(p, grad, m, v, *args, low)
                    continue
                if grad.dtype not in (torch.float32, p.dtype):
                    grad = grad.float()
                mixed = (*args, float(grad_coef), self.stochastic_rounding,
                         self.rounding_seed, runs, low)
                if p.is_cuda:
                    if not _cuda_mixed(p, grad, m, v, *mixed):
                        adam_step_lowp(p, grad, m, v, *mixed)
                elif not (self.use_extension and p.is_contiguous()
                          and _ext.adam_step_mixed(p, grad.contiguous(), m, v, *mixed)):
                    adam_step_lowp(p, grad, m, v, *mixed)
        return loss

    def state_of(self, p: torch.Tensor) -> dict:
        """p's state, created (step 0, zero moments) on first use."""
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros(p.shape, dtype=self.state_dtype, device=p.device)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=self.state_dtype, device=p.device)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, except that the moments keep ``state_dtype`` whatever the parameters' dtype
        (torch would cast them to it: bf16 moments of an fp32 master, or fp32 moments of a
        bf16 one). Moments saved in another dtype are converted (rounded to nearest when
        narrowed)."""
        params = [p for group in self.param_groups for p in group["params"]]
        if self.state_dtype == torch.float32 and all(p.dtype == torch.float32 for p in params):
            super().load_state_dict(state_dict)
            return
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
                len(s["params"]) != len(g["params"])
                for s, g in zip(saved_groups, self.param_groups)):
            raise ValueError("loaded state dict's parameter groups do not match this "
                             "optimizer's")
        by_id = {}
        for saved, group in zip(saved_groups, self.param_groups):
            by_id.update(zip(saved["params"], group["params"]))
            group.update({k: v for k, v in saved.items() if k != "params"})
        self.state.clear()
        for key, entry in state_dict["state"].items():
            p = by_id[key]
            state = {}
            for name, value in entry.items():
                if name in ("exp_avg", "exp_avg_sq") and torch.is_tensor(value):
                    state[name] = value.to(device=p.device, dtype=self.state_dtype,
                                           copy=True).reshape(p.shape)
                elif name == "step":
                    state[name] = int(value)
                else:
                    state[name] = value
            self.state[p] = state


def _cuda_mixed(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step, adamw, bias_correction,
                grad_coef, stochastic, seed, runs, low) -> bool:
    """The 16-bit step on CUDA in one launch of csrc/cuda/mixed_adam.cu (each run a tensor of
    the launch, tagged with its model index); False where the kernels are not there or do not
    take these dtypes (the caller then runs the PyTorch path)."""
    from .extensions import load_cuda_kernels
    kernels = load_cuda_kernels()
    tensors = (p, g.contiguous(), m, v) + ((low,) if low is not None else ())
    if kernels is None or not all(t.is_contiguous() and t.device == p.device for t in tensors):
        return False
    spans = [(0, p.numel(), 0)] if runs is None else [tuple(r) for r in runs.tolist()]
    lists = [[t.view(-1)[a:a + n] for a, n, _ in spans] for t in tensors]
    return kernels.mixed_adam(*lists[:4], lists[4] if low is not None else [],
                              [index for _, _, index in spans], lr, beta1, beta2, eps,
                              weight_decay, step, adamw, bias_correction, grad_coef,
                              stochastic, seed)


def _fits_kernel(p: torch.Tensor, g: torch.Tensor) -> bool:
    return (p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous()
            and g.dtype == torch.float32)
