"""The model's own state around the engine's flat groups, as DDP handles it: rank 0's
parameters and buffers broadcast at initialize(); frozen parameters and buffers cast to the
compute dtype; fp16.auto_cast's inputs."""
from __future__ import annotations

import torch
import torch.nn as nn

from ..distributed.comm import Comm
from .layout.deferred_params import is_deferred
from .stage3.zero_init import is_sharded


def broadcast_module_state(module: nn.Module, comm: Comm) -> None:
    """Rank 0's parameters and buffers to every rank."""
    # zero_init parameters already hold rank 0's values, sharded; deferred ones (weights
    # files, reset_parameters) get the same values on every rank when they are read
    comm.broadcast_many([t.data for t in list(module.parameters()) + list(module.buffers())
                         if not is_sharded(t) and not is_deferred(t)], src=0)


def cast_rest_of_module(module: nn.Module, managed: list[nn.Parameter],
                        dtype: torch.dtype) -> None:
    """Frozen parameters and floating-point buffers follow the compute dtype, as they
    would under module.to(dtype); ``managed`` parameters already live in it."""
    managed_ids = {id(p) for p in managed}
    with torch.no_grad():
        for p in module.parameters():
            if id(p) not in managed_ids and p.is_floating_point():
                p.data = p.data.to(dtype)
        for mod in module.modules():
            for name, buf in mod._buffers.items():
                if buf is not None and buf.is_floating_point():
                    mod._buffers[name] = buf.to(dtype)


def cast_floating(value, dtype: torch.dtype):
    """``value`` with every floating-point tensor in it (through lists, tuples and dicts) cast
    to ``dtype``."""
    if torch.is_tensor(value):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floating(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: cast_floating(v, dtype) for k, v in value.items()}
    return value
