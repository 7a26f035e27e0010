"""What makes a loop written for plain PyTorch / DDP run unchanged on the engine.

A user who replaces ``DDP(model)`` by ``zeroengine.initialize(model, config, optimizer=opt)``
keeps calling ``opt.step()``, ``opt.zero_grad()`` and
``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)``. Those read ``param.grad``,
which at stages 1-3 is not the reduced gradient (it lives sharded in the engine), so each
would be silently wrong. This module routes them to the engine:

- ``redirect_optimizer``: the user's optimizer object forwards step / zero_grad /
  state_dict / load_state_dict to the ShardedOptimizer that replaced it.
- ``clip_grad_norm_``: installed over torch's at import; for the engine's parameters it
  returns the true global norm (a collective: every rank calls it, as under DDP) and the
  clip coefficient is applied by the next optimizer step, on the shards. Any other
  parameters go to torch's own function. A copy of torch's function bound before zeroengine
  was imported is caught where it hands the parameters to ``_clip_grads_with_norm_``, and
  refused there by name (its norm was computed from the wrong gradients).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad as _clip_module

# id(parameter) -> the ShardedOptimizer stepping it; filled by the engine, emptied by close().
_OPTIMIZER_OF: dict[int, object] = {}


def register_parameters(params, optimizer) -> None:
    for p in params:
        _OPTIMIZER_OF[id(p)] = optimizer


def unregister_parameters(params) -> None:
    for p in params:
        _OPTIMIZER_OF.pop(id(p), None)


def redirect_optimizer(user_optimizer: torch.optim.Optimizer, sharded) -> None:
    """Make the object the user built (and still holds) act as the engine's optimizer."""
    if user_optimizer is sharded:
        return

    @functools.wraps(sharded.step)
    def step(closure=None):
        user_optimizer._opt_called = True  # torch lr schedulers built on this object check it
        return sharded.step(closure)

    step._wrapped_by_lr_sched = True
    user_optimizer.step = step
    for name in ("zero_grad", "state_dict", "load_state_dict", "add_param_group"):
        setattr(user_optimizer, name, getattr(sharded, name))
    user_optimizer._zeroengine_optimizer = sharded


_torch_clip_grad_norm_ = _clip_module.clip_grad_norm_
_torch_clip_grads_with_norm_ = _clip_module._clip_grads_with_norm_


def _engine_parameters(params: list) -> tuple[object | None, list]:
    """(the one ShardedOptimizer owning any of ``params`` or None, the others)."""
    owners = {id(_OPTIMIZER_OF[id(p)]): _OPTIMIZER_OF[id(p)] for p in params
              if id(p) in _OPTIMIZER_OF}
    if len(owners) > 1:
        raise RuntimeError("clip_grad_norm_ was given the parameters of several zeroengine "
                           "engines at once; clip each engine's parameters separately")
    others = [p for p in params if id(p) not in _OPTIMIZER_OF]
    return (next(iter(owners.values())) if owners else None), others


@functools.wraps(_torch_clip_grad_norm_)
def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False,
                    foreach=None):
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    optimizer, others = _engine_parameters(params)
    if optimizer is None:
        return _torch_clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
    stray = [p for p in others if p.requires_grad and p.grad is not None]
    if stray:
        raise RuntimeError(
            f"clip_grad_norm_ was given {len(stray)} parameters with gradients that the "
            "zeroengine engine does not manage beside its own; their norms cannot be combined "
            "with the engine's sharded gradients. Clip the engine's parameters on their own")
    return optimizer.clip_grad_norm_(params, float(max_norm), float(norm_type),
                                     error_if_nonfinite)


@functools.wraps(_torch_clip_grads_with_norm_)
def _clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    optimizer, _ = _engine_parameters(params)
    if optimizer is not None:
        raise RuntimeError(
            "torch's clip_grad_norm_ / clip_grads_with_norm_ was called on parameters that "
            "zeroengine shards: param.grad is not their reduced gradient there, so the norm "
            "torch computed is wrong. Call torch.nn.utils.clip_grad_norm_ through the module "
            "attribute (zeroengine replaces it; a `from torch.nn.utils import clip_grad_norm_` "
            "made before `import zeroengine` keeps torch's own), or set \"gradient_clipping\" "
            "in the config")
    return _torch_clip_grads_with_norm_(params, max_norm, total_norm, foreach)


def install() -> None:
    """Put the engine-aware functions where torch code looks them up (idempotent)."""
    for module in (torch.nn.utils, _clip_module):
        module.clip_grad_norm_ = clip_grad_norm_
    _clip_module._clip_grads_with_norm_ = _clip_grads_with_norm_
    torch.nn.utils.clip_grads_with_norm_ = _clip_grads_with_norm_
