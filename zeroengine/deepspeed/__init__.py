"""DeepSpeed's API on zeroengine: a DeepSpeed training script runs with its import changed,

    import zeroengine.deepspeed as deepspeed          # was: import deepspeed
    from zeroengine.deepspeed.accelerator import get_accelerator   # was: deepspeed.accelerator

and the rest as it is: ``deepspeed.initialize(args=args, model=model, model_parameters=...,
training_data=...)`` returning ``(engine, optimizer, training_dataloader, lr_scheduler)``,
``add_config_arguments``, ``init_distributed``, ``zero.Init``, ``zero.GatheredParameters``,
``checkpointing.checkpoint``, ``comm``, ``ops.adam``, ``utils.safe_get_full_*``, and the
engine's DeepSpeed methods (deepspeed/engine.py). Launch with ``zeroengine launch --num_gpus N
script.py ...`` in place of ``deepspeed --num_gpus N script.py ...`` (or torchrun).

Where DeepSpeed and zeroengine's own API differ, this package follows DeepSpeed: a client
optimizer or scheduler wins over the config's section (said once), ``load_checkpoint`` with
nothing saved returns ``(None, None)``. A DeepSpeed name zeroengine does not implement raises
NotInZeroengine naming it and the nearest thing it has.
"""
from __future__ import annotations

import argparse
import copy
from typing import Any

import torch

from .. import build_engine
from ..config import ConfigError, config_dict
from ..config.policy import notice
from . import accelerator, checkpointing, comm, moe, ops, utils, zero
from ._missing import NotInZeroengine, missing
from .comm import init_distributed
from .engine import DeepSpeedEngine

DEEPSPEED_GRADIENT_CLIPPING = 1.0  # DeepSpeed's default when a config leaves it out

__all__ = ["initialize", "add_config_arguments", "init_distributed", "zero", "comm",
           "checkpointing", "ops", "utils", "accelerator", "moe", "DeepSpeedEngine",
           "NotInZeroengine"]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's command-line arguments: ``--deepspeed``, ``--deepspeed_config``, and their
    deprecated ``--deepscale`` spellings."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated enable DeepSpeed (helper flag for user code)")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="Deprecated DeepSpeed json configuration file.")
    return parser


def _config_from(args, config, config_params) -> dict:
    """The config as DeepSpeed finds it: ``config``, else ``config_params``, else
    ``args.deepspeed_config`` (or the deprecated ``args.deepscale_config``)."""
    if config is None and config_params is not None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if from_args is not None:
        if config is not None:
            raise ConfigError("deepspeed.initialize was given a config and args.deepspeed_config "
                              f"({from_args}) too; pass one of them")
        config = from_args
    if config is None:
        raise ConfigError("deepspeed.initialize needs a config: config=<dict or path>, or "
                          "--deepspeed_config <path> on the command line (add_config_arguments)")
    return copy.deepcopy(config) if isinstance(config, dict) else config_dict(config, "config")


def _optimizer(optimizer, model_parameters, model, raw: dict):
    """DeepSpeed's rule: a client optimizer (an object, or a callable of the parameters) wins
    over the config's section; else the section is built over ``model_parameters``."""
    params = list(model_parameters) if model_parameters is not None else \
        [p for p in model.parameters() if p.requires_grad]
    if optimizer is None:
        if raw.get("optimizer") is None:
            raise ConfigError("no optimizer: DeepSpeed scripts without one can only run "
                              "inference, which zeroengine does not wrap; add an \"optimizer\" "
                              "section or pass optimizer=")
        from ..config import parse_config
        from ..core.optim.factory import optimizer_from_config
        section = parse_config({"optimizer": raw.pop("optimizer")}).optimizer
        return optimizer_from_config(section, params)
    if raw.get("optimizer") is not None:
        notice("optimizer", "a client optimizer was passed to deepspeed.initialize: it is used "
               "and the config's section ignored, as DeepSpeed does")
        raw.pop("optimizer")
    if not isinstance(optimizer, torch.optim.Optimizer) and callable(optimizer):
        optimizer = optimizer(params)
    return optimizer


def _scheduler(lr_scheduler, optimizer, raw: dict):
    """A client scheduler (object, or callable of the optimizer) wins over the config's."""
    if lr_scheduler is None:
        return None  # the config's section (if any) is built by the engine
    if raw.get("scheduler") is not None:
        notice("scheduler", "a client lr_scheduler was passed to deepspeed.initialize: it is "
               "used and the config's section ignored, as DeepSpeed does")
        raw.pop("scheduler")
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        lr_scheduler = lr_scheduler(optimizer)
    return lr_scheduler


def _data_loader(training_data, engine, collate_fn, drop_last: bool):
    """DeepSpeed's training loader: the config's micro batch per rank, a DistributedSampler
    over the data-parallel ranks (shuffled with seed 0 and, as DeepSpeed's, the same order every
    epoch unless the script calls ``loader.data_sampler.set_epoch``)."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler
    micro = engine.train_micro_batch_size_per_gpu()
    if micro is None:
        raise ConfigError("deepspeed.initialize(training_data=...) needs the batch size: set "
                          "train_micro_batch_size_per_gpu (or train_batch_size) in the config")
    sampler = DistributedSampler(training_data, num_replicas=engine.comm.world_size,
                                 rank=engine.comm.rank)
    loader = DataLoader(training_data, batch_size=micro, sampler=sampler,
                        collate_fn=collate_fn, drop_last=drop_last)
    loader.data_sampler = sampler  # DeepSpeedDataLoader's name for it
    return loader


def initialize(args: Any = None, model: torch.nn.Module | None = None, optimizer=None,
               model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port: int = 29500, mpu=None, dist_init_required: bool | None = None,
               collate_fn=None, config=None, mesh_param=None, config_params=None):
    """DeepSpeed's ``initialize``: returns ``(engine, optimizer, training_dataloader,
    lr_scheduler)``; the optimizer is the engine's sharded one, the loader None unless
    ``training_data`` was given, the scheduler the client's or the config's (or None)."""
    if model is None:
        raise ValueError("deepspeed.initialize requires a model")
    if mpu is not None or mesh_param is not None:
        raise ValueError("deepspeed.initialize(mpu=/mesh_param=): zeroengine is data-parallel "
                         "only (no tensor, pipeline or sequence parallelism)")
    raw = _config_from(args, config, config_params)
    # DeepSpeed (0.19: GRADIENT_CLIPPING_DEFAULT = 1.0) clips at norm 1 when the config says
    # nothing; zeroengine.initialize does not clip unless asked. A DeepSpeed script keeps
    # DeepSpeed's numbers.
    raw.setdefault("gradient_clipping", DEEPSPEED_GRADIENT_CLIPPING)
    if dist_init_required is not False:
        init_distributed(distributed_port=distributed_port)
    optimizer = _optimizer(optimizer, model_parameters, model, raw)
    lr_scheduler = _scheduler(lr_scheduler, optimizer, raw)
    drop_last = bool(raw.get("dataloader_drop_last", False))
    engine = build_engine(model, raw, optimizer, lr_scheduler, engine_class=DeepSpeedEngine)
    if training_data is not None:
        engine.training_dataloader = _data_loader(training_data, engine, collate_fn, drop_last)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


_NEAREST = {
    "init_inference": "zeroengine trains; for inference load the model with transformers or "
    "torch (zeroengine consolidate writes the weights)",
    "PipelineModule": "no pipeline parallelism: zeroengine shards data-parallel model states",
    "pipe": "no pipeline parallelism",
    "DeepSpeedConfig": "zeroengine.parse_config(config)",
    "add_tuning_arguments": "no autotuner: `zeroengine estimate --recommend`",
    "runtime": "zeroengine.core (the engine) and zeroengine.config",
    "profiling": "config wall_clock_breakdown; benchmarks/step_bench.py",
    "monitor": "the config's tensorboard / csv_monitor / wandb sections",
    "launcher": "`zeroengine launch` (the deepspeed command's flags)",
}


def __getattr__(name: str):
    raise missing("deepspeed", name, _NEAREST, [n for n in __all__])
