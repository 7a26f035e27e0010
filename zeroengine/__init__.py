"""zeroengine: ZeRO-style sharding of model states for any nn.Module and torch optimizer.

    engine = zeroengine.initialize(model, "config.json")
    for batch in data:
        loss = loss_fn(engine(batch))
        engine.backward(loss)
        engine.step()
"""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from ._version import __version__
from .config import Config, model_hidden_size, parse_config, resolve_auto, to_dict
from .config.policy import notice
from .core.compat.compiled import check_compile_args
from .core.engine import ZeroEngine
from .core.layout import deferred_params
from .core.optim.chain import OptimizerChain
from .core.optim.factory import optimizer_from_config
from .core.optim.kind import declare_optimizer, optimizer_kind
from .core.optim.schedulers import scheduler_from_config
from .core.sharding import Sharding
from .core.stage3.gathered import gathered_parameters
from .core.stage3.zero_init import zero_init
from .distributed.bootstrap import init_distributed
from .distributed.comm import Comm
from .distributed.consistency import check_rank_consistency
from .distributed.topology import (
    build_topology,
    check_same_sizes,
    ranks_per_node,
    resolve_hpz_size,
    resolve_shard_size,
)
from .errors import (  # every exception the package raises (errors.py)
    CheckpointError,
    CollectiveError,
    ConfigError,
    ConfigNotice,
    LaunchError,
    LossScaleFloorError,
    MixedStepError,
    NonFiniteGradientError,
    NotInZeroengine,
    OptimizerKindError,
    ParameterReplacedError,
    RankDivergenceError,
    RankMismatchError,
    ShardedParameterAccessError,
    UnsafeOrUnreadable,
    WeightsError,
    ZeroEngineError,
)

__all__ = ["initialize", "init_distributed", "gathered_parameters", "zero_init", "ZeroEngine",
           "Config", "parse_config", "declare_optimizer", "OptimizerChain", "__version__",
           "CheckpointError", "CollectiveError", "ConfigError", "ConfigNotice", "LaunchError",
           "LossScaleFloorError", "MixedStepError", "NonFiniteGradientError", "NotInZeroengine",
           "OptimizerKindError", "ParameterReplacedError", "RankDivergenceError",
           "RankMismatchError", "ShardedParameterAccessError", "UnsafeOrUnreadable",
           "WeightsError", "ZeroEngineError"]


def _passed_and_configured(section: str, what: str, passed, configured) -> None:
    """An object passed to initialize() and a config section for the same thing: refused,
    unless the section's params are all "auto" (HF style), which the object resolves."""
    if passed is None or configured is None:
        return
    params = configured.params
    if not (params and all(value == "auto" for value in params.values())):
        raise ConfigError(f"{what} was passed to initialize() and the config has a '{section}' "
                          "section too; keep one of them (a section whose params are all "
                          "\"auto\" defers to the one passed)")
    notice(section, f"the section's \"auto\" params are resolved from the "
           f"{type(passed).__name__} passed to initialize()")


def _device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _prepare_optimizer(model: nn.Module, cfg: Config, optimizer) -> torch.optim.Optimizer:
    _passed_and_configured("optimizer", "an optimizer", optimizer, cfg.optimizer)
    if optimizer is None:
        if cfg.optimizer is None:
            raise ConfigError("no optimizer: pass one to initialize(model, config, optimizer=...) "
                              "or add an 'optimizer' section to the config, e.g. "
                              '{"type": "AdamW", "params": {"lr": 1e-3}}')
        return optimizer_from_config(cfg.optimizer, model.parameters())
    if isinstance(optimizer, (list, tuple)):  # e.g. [Muon(matrices), AdamW(the rest)]
        optimizer = OptimizerChain(list(optimizer)) if len(optimizer) != 1 else optimizer[0]
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__} (or a list of optimizers over disjoint "
                        "parameters)")
    members = optimizer.member_of_group() if isinstance(optimizer, OptimizerChain) \
        else [optimizer] * len(optimizer.param_groups)
    for member, group in zip(members, optimizer.param_groups):
        optimizer_kind(member, group)  # refuses, by name, what cannot be sharded
    seen: dict[int, int] = {}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) in seen:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} is in param group "
                                 f"{seen[id(p)]} and {gi} (of the optimizers given): each "
                                 "parameter must be stepped by exactly one optimizer")
            seen[id(p)] = gi
    names = {id(p): n for n, p in model.named_parameters()}
    in_optimizer = set()
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(f"optimizer param_groups[{gi}] holds a parameter of shape "
                                 f"{tuple(p.shape)} that is not a parameter of the model; build "
                                 "the optimizer over model.parameters()")
            in_optimizer.add(id(p))
    left_out = [n for n, p in model.named_parameters() if p.requires_grad
                and id(p) not in in_optimizer]
    if left_out:
        warnings.warn(f"{len(left_out)} trainable parameters are not in the optimizer and will "
                      f"not be updated or reduced (first: {left_out[0]})", stacklevel=4)
    if any(optimizer.state.values()):
        warnings.warn("the optimizer already has state; zeroengine re-creates it on the shards "
                      "(load a checkpoint to restore state)", stacklevel=4)
    return optimizer


def initialize(model: nn.Module, config, optimizer: torch.optim.Optimizer | None = None,
               lr_scheduler=None, weights=None) -> ZeroEngine:
    """Wrap ``model`` for sharded data-parallel training as ``config`` describes.

    ``config``: path to a JSON file, a dict, or a parsed Config. ``optimizer``: one built over
    ``model.parameters()`` (its class and hyperparameters are kept, its state re-created on the
    shards), a list of them over disjoint parameters (e.g. ``[Muon(matrices), AdamW(rest)]``),
    or None to build the config's. Elementwise optimizers step flat shards; tensor-wise ones
    (Muon, Adafactor, LAMB, ...) step whole parameters, each on one rank (optim/kind.py).
    ``lr_scheduler``: a torch scheduler over that
    optimizer, or None to build the config's "scheduler" (if any).
    ``weights``: safetensors weights to start from (a file, a directory holding
    model.safetensors or a sharded model.safetensors.index.json, a `zeroengine consolidate`
    output), read by parameter name straight into each rank's shard (at stage 3 only the
    elements the rank keeps). A model built on the meta device is materialised from
    ``weights`` where they hold a parameter, else by its module's reset_parameters().
    """
    return build_engine(model, config, optimizer, lr_scheduler, weights=weights)


def build_engine(model: nn.Module, config, optimizer=None, lr_scheduler=None,
                 engine_class: type = ZeroEngine, weights=None) -> ZeroEngine:
    """``initialize`` building an ``engine_class`` (zeroengine.deepspeed's DeepSpeedEngine,
    a ZeroEngine with DeepSpeed's return conventions)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    cfg = parse_config(config)  # all validation that needs no peers happens before any collective
    if cfg.compile.on:
        check_compile_args(cfg.compile.backend, cfg.compile.kwargs)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("the model has no trainable parameters (requires_grad=True); nothing "
                         "to train")
    config_as_built = to_dict(cfg)  # before 'auto' values are resolved from the world size
    env = init_distributed(timeout_s=cfg.collective_timeout_s)
    comm = Comm(timeout_s=cfg.collective_timeout_s if env.launcher != "existing" else None)
    device = _device(env.local_rank)
    # the first collective: ranks that built different things stop here, all with the reason
    check_rank_consistency(model, config_as_built, __version__, comm, device)
    if weights is not None or deferred_params.has_meta(model):
        # before anything reads a value: a failed check raises on every rank, nothing loaded
        replaced = deferred_params.bind(model, weights, device, comm)
        if optimizer is not None and replaced:
            deferred_params.remap_optimizer(optimizer, replaced)
        for buf in model.buffers():
            if deferred_params.is_deferred(buf):
                deferred_params.load_whole(buf)
    first = next(model.parameters())
    resolve_auto(cfg, comm.world_size, str(first.dtype).replace("torch.", ""),
                 model_hidden_size(model))
    if not Sharding.of_stage(cfg.zero_optimization.stage).parameters and \
            any(hasattr(p, "_ze_slice") for p in model.parameters()):
        warnings.warn("the model was built under zero_init but the config's stage is "
                      f"{cfg.zero_optimization.stage}: its parameters are made whole again",
                      stacklevel=3)
    model.to(device)
    optimizer = _prepare_optimizer(model, cfg, optimizer)
    from_config = lr_scheduler is None and cfg.scheduler is not None
    if lr_scheduler is None:
        lr_scheduler = scheduler_from_config(cfg.scheduler, optimizer)
    else:
        _passed_and_configured("scheduler", "an lr_scheduler", lr_scheduler, cfg.scheduler)
    zero = cfg.zero_optimization
    shard_size = resolve_shard_size(zero.mics_shard_size, comm.world_size, zero.stage)
    hpz_size = resolve_hpz_size(zero.zero_hpz_partition_size, comm.world_size, zero.stage,
                                shard_size)
    # qgZ exchanges in two hops (inside the node, then across) where the node size is known
    per_node = ranks_per_node() if zero.zero_quantized_gradients else None
    if per_node is not None and comm.world_size % per_node:
        per_node = None
    # "auto" sizes come from each rank's own environment: the groups exist only if all agree
    check_same_sizes(comm, {"zero_optimization.mics_shard_size": shard_size,
                            "zero_optimization.zero_hpz_partition_size": hpz_size,
                            "ranks per node (LOCAL_WORLD_SIZE, for qgZ)": per_node or 0})
    engine = engine_class(model, optimizer, cfg, comm, device, lr_scheduler,
                        topology=build_topology(comm, shard_size, hpz_size, per_node),
                        scheduler_from_config=from_config, local_rank=env.local_rank)
    if cfg.compile.on:
        engine.compile(cfg.compile.backend, cfg.compile.kwargs)
    return engine
