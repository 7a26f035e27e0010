"""Laying a model's trainable parameters out in flat groups (FlatParamGroup), once, at
initialize(): which flat buffer each parameter joins, in which order, and at stage 3 which ones
are partitioned (and along which module boundaries) and which stay whole."""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from ...config import AUTO, ZeroConfig, auto_fetch_unit
from ...distributed.comm import Comm
from ..optim.precision import FP32_MASTER, Precision
from ..sharding import Sharding
from ..stage3.zero_init import is_sharded, make_whole, materialize
from . import deferred_params
from .flat_param_group import FlatParamGroup
from .partition import bucket_params


def lay_out_parameters(module: nn.Module, optimizer: torch.optim.Optimizer,
                       order: dict[int, int], sharding: Sharding, comm: Comm, zero: ZeroConfig,
                       precision: Precision, device: torch.device,
                       pin: bool, shard: Comm | None = None,
                       master_sink=None, param_sink=None,
                       master_format: str = FP32_MASTER) -> list[FlatParamGroup]:
    """One FlatParamGroup per (optimizer group, dtype); at stage 3 split further into
    parameters kept whole (below stage3_param_persistence_threshold elements) and
    partitioned ones, whose segments follow the modules that hold them. ``shard``: the ranks
    the states are sharded over (hybrid sharding: a group of ``comm``; default ``comm``).
    ``master_sink``: NVMe offload's OptimizerSwap, which takes each group's master;
    ``param_sink``: its ParamSwap, which takes the partitioned groups' parameter shards.
    ``master_format``: how the masters of the compute-dtype groups are kept (precision.py)."""
    shard = shard or comm
    shard_world = shard.world_size if sharding.optimizer_state else 1
    bucket = max(1, zero.reduce_bucket_size)  # 0 (DeepSpeed accepts it): one parameter each
    offload_master = zero.offload_optimizer.device in ("cpu", "nvme")
    # stage 3's fetching module of each parameter: partitioned segments follow them
    owner = parameter_owners(module, zero.stage3_leaf_modules) if sharding.parameters else {}
    limit = zero.stage3_param_persistence_threshold
    to_partition = {id(p) for group in optimizer.param_groups for p in group["params"]
                    if sharding.parameters and p.requires_grad
                    and p.numel() >= limit}
    grouped = {id(p) for group in optimizer.param_groups for p in group["params"]
               if p.requires_grad}
    unit_numel = zero.stage3_fetch_unit_size
    if unit_numel == AUTO:
        unit_numel = auto_fetch_unit(sum(p.numel() for group in optimizer.param_groups
                                         for p in group["params"] if id(p) in to_partition),
                                     bucket)
    for p in module.parameters():  # zero_init: whatever stays whole is made whole
        if is_sharded(p) and id(p) not in to_partition:
            make_whole(p, comm)
        elif deferred_params.is_deferred(p) and id(p) not in grouped:
            deferred_params.load_whole(p)  # frozen, or outside the optimizer: kept as it is

    def value_of(p):  # a collective for zero_init parameters, called in the same order
        if deferred_params.is_deferred(p):  # read from files / reset: this rank's pieces only
            return lambda begin, numel, out=None: deferred_params.read_piece(p, begin, numel,
                                                                             out)
        if not is_sharded(p):
            return p.detach()
        full = materialize(p, comm)
        del p._ze_slice  # its values go into the group's shard now: freed as the shard fills
        return full

    groups: list[FlatParamGroup] = []
    for gi, group in enumerate(optimizer.param_groups):
        trainable = [p for p in group["params"] if p.requires_grad]
        # Reverse registration order: the first segments are the first finished in backward.
        params = sorted(trainable, key=lambda p: -order[id(p)])
        if precision.mixed:  # one flat buffer in the compute dtype
            by_dtype = [(precision.compute, params)] if params else []
        else:  # each dtype keeps its own buffer
            by_dtype = bucket_params(params)
        for dtype, same in by_dtype:
            whole = same
            if sharding.parameters:
                whole = [p for p in same if id(p) not in to_partition]
                split = sorted((p for p in same if id(p) in to_partition),
                               key=lambda p: (-owner[id(p)], -order[id(p)]))
                if split:
                    groups.append(FlatParamGroup(
                        split, gi, shard.rank, shard_world, bucket,
                        device, compute_dtype=dtype, partitioned=True,
                        units=fetch_units([owner[id(p)] for p in split],
                                          [p.numel() for p in split], unit_numel),
                        value_of=value_of,
                        offload_master=offload_master,
                        offload_shard=zero.offload_param.device in ("cpu", "nvme"),
                        pin=pin, master_sink=master_sink, param_sink=param_sink,
                        master_format=master_format if precision.mixed else FP32_MASTER))
                    for p in split:
                        if deferred_params.is_deferred(p):
                            deferred_params.done(p)
            if whole:  # deferred parameters are read straight into the flat buffer
                groups.append(FlatParamGroup(whole, gi, shard.rank, shard_world,
                                             bucket, device,
                                             compute_dtype=dtype, value_of=value_of,
                                             offload_master=offload_master, pin=pin,
                                             master_sink=master_sink,
                                             master_format=master_format
                                             if precision.mixed else FP32_MASTER))
                for p in whole:
                    if deferred_params.is_deferred(p):
                        deferred_params.done(p)
    deferred_params.finish()
    return groups


def fetching_modules(root: nn.Module, leaf_names=()):
    """(module, is_leaf) for every module that fetches parameters: all of them, except that
    a module whose class is named in ``leaf_names`` fetches its whole subtree and its
    descendants fetch nothing."""
    leaf_names = set(leaf_names)
    found, seen = set(), set()
    stack = [root]
    while stack:
        mod = stack.pop()
        if id(mod) in seen:  # a module reachable twice fetches once
            continue
        seen.add(id(mod))
        leaf = type(mod).__name__ in leaf_names
        if leaf:
            found.add(type(mod).__name__)
        yield mod, leaf
        if not leaf:
            stack.extend(reversed(list(mod.children())))
    missing = leaf_names - found
    if missing:
        raise ValueError(f"zero_optimization.stage3_leaf_modules names {sorted(missing)}, but "
                         "the model has no module of such a class")


def parameter_owners(module: nn.Module, leaf_names=()) -> dict[int, int]:
    """id(parameter) -> index (in ``module.modules()`` order) of the module that fetches it at
    stage 3 (``fetching_modules``): the first module holding it directly, or the module of a
    class named in stage3_leaf_modules whose subtree holds it."""
    index = {id(m): i for i, m in enumerate(module.modules())}
    owner: dict[int, int] = {}
    for mod, leaf in fetching_modules(module, leaf_names):
        for p in mod.parameters(recurse=leaf):
            owner.setdefault(id(p), index[id(mod)])
    return owner


def fetch_units(owners: list[int], numels: list[int], unit_numel: int) -> list[int]:
    """Stage 3's fetch unit of each parameter: consecutive owning modules grouped until the
    next would take the unit past ``unit_numel`` elements (a module larger than that is a unit
    of its own; 0: one unit per module). A unit's segments are gathered as one all-gather and
    reduced as one bucket, so a deep model of small modules makes a few large collectives
    instead of a latency-bound one per module."""
    size: dict[int, int] = {}
    for o, n in zip(owners, numels):
        size[o] = size.get(o, 0) + n
    unit_of: dict[int, int] = {}
    unit, filled = -1, 0
    for o in sorted(size):  # module order: the order forward usually runs them in
        if unit < 0 or filled + size[o] > unit_numel:
            unit, filled = unit + 1, 0
        unit_of[o] = unit
        filled += size[o]
    return [unit_of[o] for o in owners]


def report_persistence(groups: list[FlatParamGroup], limit: int, comm: Comm) -> None:
    """Stage 3 keeps parameters under stage3_param_persistence_threshold whole on every
    rank: say so when that is most of the model, which a small model hits by default."""
    whole = sum(fg.layout.used_numel for fg in groups if not fg.partitioned)
    split = sum(fg.layout.used_numel for fg in groups if fg.partitioned)
    if whole > split and comm.rank == 0:
        warnings.warn(
            f"stage 3 partitions {split:,} of the model's {whole + split:,} trainable "
            f"elements: parameters under stage3_param_persistence_threshold={limit:,} "
            f"elements ({whole:,} elements) stay whole on every rank, so this run holds "
            "more parameter memory per rank than stage 3 promises. Lower the threshold "
            "(e.g. 0) to partition them too", stacklevel=4)


def element_index(module: nn.Module) -> dict[int, int]:
    """id(param) -> the index of its first element in the model: its parameters' elements
    counted in ``module.parameters()`` order. The same at every world size and stage, so what
    is drawn per element from it (stochastic rounding's bits) does not depend on the layout."""
    index, out = 0, {}
    for p in module.parameters():
        out[id(p)] = index
        index += p.numel()
    return out
