"""``deepspeed.utils``: whole values of one parameter, its gradient and its optimizer state,
read from (and written into) the shards. Each is a collective - every rank calls it with the
same parameter, as in DeepSpeed - and returns the full fp32 tensor on every rank.

The values come from the fp32 master (not the bf16/fp16 copy the model computes with); the
gradient is the reduced one of the current accumulation (between the last backward and
step()), unscaled from fp16's loss scale; the state is the inner optimizer's per-element state
(Adam's ``exp_avg`` / ``exp_avg_sq``, SGD's ``momentum_buffer``).
"""
from __future__ import annotations

import torch

from ..core import registry
from ._missing import missing


def _locate(param: torch.Tensor):
    """(the ShardedOptimizer stepping ``param``, its flat group, its index there)."""
    opt = registry.held_by(param, "optimizer")
    if opt is None:
        raise ValueError("this tensor is not a parameter of a zeroengine engine (trainable, "
                         "in the optimizer); safe_get_full_* reads engine parameters only")
    for fg in opt.flat_groups:
        for i, p in enumerate(fg.params):
            if p is param:
                return opt, fg, i
    raise ValueError("parameter not found in the engine's flat groups")


def _full(fg, comm, shard: torch.Tensor) -> torch.Tensor:
    """A tensor laid out like the rank's shard, gathered into the whole flat buffer."""
    full = torch.empty(fg.layout.numel, dtype=shard.dtype, device=fg.device)
    for seg in fg.layout.segments:
        out, piece = seg.of_full(full), seg.of_shard(shard).to(fg.device)
        if fg.sharded:
            comm.all_gather(out, piece.contiguous())
        else:
            out.copy_(piece)
    return full


def _param_of(full: torch.Tensor, fg, index: int) -> torch.Tensor:
    slot = fg.layout.slots[index]
    return full[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()


def _refuse_tensorwise(opt, fg, what: str) -> None:
    if opt.flat_groups.index(fg) in opt.owned:
        raise ValueError(f"{what}: this parameter is stepped whole by a tensor-wise optimizer "
                         "on its owner rank; read it with engine.consolidated_state_dict() or "
                         "a checkpoint")


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor:
    opt, fg, i = _locate(param)
    return _param_of(fg.full_fp32(opt.comm), fg, i)


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the parameter's fp32 master (and so its model values) to ``value``, the same tensor
    on every rank."""
    opt, fg, i = _locate(param)
    _refuse_tensorwise(opt, fg, "safe_set_full_fp32_param")
    full = fg.full_fp32(opt.comm)
    slot = fg.layout.slots[i]
    full[slot.offset:slot.offset + slot.numel].copy_(value.reshape(-1).to(full))
    rank = opt.comm.rank if fg.sharded else 0
    for s in fg.resident_masters(write_back=True):
        seg = fg.layout.segments[s]
        fg.master_segments[s].copy_(seg.of_full(full)[seg.own_chunk_local(rank)])
    opt.republish()


def _state_of(param: torch.Tensor, key: str, what: str):
    """(optimizer, flat group, index, the group's per-element state shards, its scalars),
    refusing a state the optimizer does not keep per element."""
    opt, fg, i = _locate(param)
    _refuse_tensorwise(opt, fg, what)
    elementwise, scalars = opt.shard_state(fg)
    if key not in elementwise:
        raise KeyError(f"optimizer state {key!r} is not kept per element by {opt.inner_name}; "
                       f"it keeps: {', '.join(sorted(elementwise)) or 'none yet'}")
    return opt, fg, i, elementwise, scalars


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor:
    opt, fg, i, elementwise, _ = _state_of(param, optim_state_key,
                                           "safe_get_full_optimizer_state")
    return _param_of(_full(fg, opt.comm, elementwise[optim_state_key]), fg, i)


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor,
                                  optim_state_key: str) -> None:
    opt, fg, i, elementwise, scalars = _state_of(param, optim_state_key,
                                                 "safe_set_full_optimizer_state")
    full = _full(fg, opt.comm, elementwise[optim_state_key])
    slot = fg.layout.slots[i]
    full[slot.offset:slot.offset + slot.numel].copy_(value.reshape(-1).to(full))
    rank = opt.comm.rank if fg.sharded else 0
    shard = elementwise[optim_state_key]
    for seg in fg.layout.segments:
        seg.of_shard(shard).copy_(seg.of_full(full)[seg.own_chunk_local(rank)])
    opt.load_shard_state(fg, elementwise, scalars)


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The reduced gradient of the accumulation under way (None before any backward)."""
    opt, fg, i = _locate(param)
    opt.reducer.flush()
    segments = opt.reducer.owned_grad_segments(fg)
    if not segments:
        return None
    shard = torch.zeros(fg.layout.shard_numel, dtype=torch.float32, device=fg.device)
    for seg, grad in zip(fg.layout.segments, segments):
        seg.of_shard(shard).copy_(grad.float())
    scale = opt.loss_scaler.scale if opt.loss_scaler is not None else 1.0
    return _param_of(_full(fg, opt.comm, shard), fg, i) / scale


def __getattr__(name: str):
    raise missing("deepspeed.utils", name, {
        "safe_get_local_fp32_param": "safe_get_full_fp32_param (collective, whole tensor)",
        "safe_get_local_grad": "safe_get_full_grad (collective, whole tensor)",
        "safe_get_local_optimizer_state": "safe_get_full_optimizer_state (collective)",
        "logger": "logging.getLogger('zeroengine')",
        "groups": "zeroengine is data-parallel only; deepspeed.comm for the group"},
        ["safe_get_full_fp32_param", "safe_set_full_fp32_param", "safe_get_full_grad",
         "safe_get_full_optimizer_state", "safe_set_full_optimizer_state"])
