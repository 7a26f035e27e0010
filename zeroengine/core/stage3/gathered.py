"""``gathered_parameters``: the full values of chosen parameters inside a block, on every rank,
with an optional write-back of one rank's changes. It finds a parameter's engine in the registry
(registry.py): a stage-3 ParamFetcher for partitioned ones, the flat group and Comm of whole
ones at any stage.
"""
from __future__ import annotations

import contextlib

import torch

from ...distributed.comm import Comm
from .. import registry
from ..layout.flat_param_group import FlatParamGroup
from .param_fetcher import Key, ParamFetcher


@contextlib.contextmanager
def gathered_parameters(params, modifier_rank: int | None = None):
    """Inside the block the full values of ``params`` are visible on every rank (a collective:
    every rank must enter it). With ``modifier_rank=r``, changes made on rank r are written to
    every rank's shard (and fp32 master) on exit. Parameters not partitioned by stage 3 are
    already whole; for them only the write-back applies. A loss computed inside the block can
    be backpropagated after it: the segments then stay gathered until that backward ends."""
    if isinstance(params, torch.Tensor):
        params = [params]
    params = list(params)
    by_fetcher: dict[int, tuple[ParamFetcher, list[Key]]] = {}
    for p in params:
        fetcher = registry.held_by(p, "fetcher")
        if fetcher is not None:
            keys = by_fetcher.setdefault(id(fetcher), (fetcher, []))[1]
            if fetcher.where[id(p)] not in keys:
                keys.append(fetcher.where[id(p)])
    passes = {}
    for fetcher, keys in by_fetcher.values():
        keys.sort()
        fetcher.acquire(keys, user=True)
        passes[id(fetcher)] = fetcher.passes
    try:
        yield
    finally:
        for fetcher, keys in by_fetcher.values():
            if modifier_rank is not None:
                with torch.no_grad():
                    fetcher.write_back(keys, modifier_rank)
            # Kept for a backward still to come only if none ran inside the block.
            pending = torch.is_grad_enabled() and fetcher.passes == passes[id(fetcher)]
            fetcher.release(keys, user=True, keep_for_backward=pending)
        if modifier_rank is not None:
            whole = [p for p in params if registry.held_by(p, "fetcher") is None]
            if whole:
                _write_back_whole(whole, modifier_rank)


def _write_back_whole(params, src: int) -> None:
    """Stages 0-2 (or persistent stage-3 parameters): broadcast rank src's values and refresh
    each rank's fp32 master chunks from them."""
    touched: dict[int, FlatParamGroup] = {}
    for p in params:
        held = registry.held_by(p, "whole")
        if held is None:
            raise ValueError(f"parameter of shape {tuple(p.shape)} is not managed by a "
                             "zeroengine engine")
        group, comm = held
        comm.broadcast(p.data, src)
        touched[id(group)] = group
    for group in touched.values():
        group.refresh_master()


def register(groups: list[FlatParamGroup], comm: Comm, fetcher: ParamFetcher | None) -> None:
    """An engine's parameters: partitioned ones through its fetcher, the rest whole."""
    for g in groups:
        for p in g.params:
            if fetcher is not None and id(p) in fetcher.where:
                registry.hold(p, fetcher=fetcher)
            else:
                registry.hold(p, whole=(g, comm))


def unregister(groups: list[FlatParamGroup]) -> None:
    for g in groups:
        for p in g.params:
            registry.let_go(p, "whole", "fetcher")
