"""Keras 3 (torch backend) on zeroengine: ``model.fit()`` as it is, with the engine under it.

    os.environ["KERAS_BACKEND"] = "torch"
    from zeroengine.integrations import keras as zkeras
    model.compile(optimizer=keras.optimizers.AdamW(1e-3), loss="mse")
    engine = zkeras.distribute(model, {"zero_optimization": {"stage": 2}})
    x_mine, y_mine = zkeras.shard(x, global_batch_size=64), zkeras.shard(y, global_batch_size=64)
    model.fit(x_mine, y_mine, batch_size=64 // engine.comm.world_size, shuffle=False)

A Keras model on the torch backend is a ``torch.nn.Module`` whose variables are torch
parameters, and its torch trainer's ``train_step`` calls the model, ``loss.backward()`` and
``optimizer.apply(gradients, variables)``. ``distribute`` builds the engine over the model with
the torch optimizer that computes the compiled Keras optimizer's update (SGD, Adam, AdamW: same
hyperparameters; the learning rate is read from the Keras optimizer before every step, so its
schedules and callbacks such as ReduceLROnPlateau keep working), and makes ``optimizer.apply``
step the engine instead: the forward, loss, metrics and callbacks stay Keras'. The backward's
gradients are reduced by the engine's hooks. ``shard`` gives each rank its part of every global
batch, in order, so the ranks together see the batches of a single-process ``fit`` on the same
data. fp32; Keras' own mixed-precision policies and per-variable ``clipnorm`` / ``clipvalue``
are refused (``global_clipnorm`` becomes the engine's gradient clipping).
"""
from __future__ import annotations

import os

import torch

from ..config import ConfigError, config_dict

try:
    import keras
except ImportError:  # pragma: no cover - the keras extra is installed wherever tests run
    raise ImportError("zeroengine.integrations.keras needs Keras 3: "
                      "pip install 'zeroengine[keras]'") from None

SUPPORTED = "keras >= 3.0, < 4 with the torch backend"  # tested: 3.15


def _check_version() -> None:
    if int(keras.__version__.split(".")[0]) != 3:
        raise ImportError(f"zeroengine's Keras integration supports {SUPPORTED}; found keras "
                          f"{keras.__version__}")
    if keras.backend.backend() != "torch":
        raise ImportError(f"zeroengine's Keras integration needs the torch backend "
                          f"(KERAS_BACKEND=torch); this Keras runs on {keras.backend.backend()}")


def torch_optimizer(optimizer, params) -> torch.optim.Optimizer:
    """The torch optimizer whose update is the Keras optimizer's (constant hyperparameters;
    the learning rate is set before every step from the Keras one)."""
    config = optimizer.get_config()
    name = type(optimizer).__name__
    for key in ("clipnorm", "clipvalue"):
        if config.get(key) is not None:
            raise ConfigError(f"Keras {name}({key}=...) clips each variable on its own, which "
                              "zeroengine's sharded step does not do; use global_clipnorm")
    if config.get("gradient_accumulation_steps"):
        raise ConfigError(f"Keras {name}(gradient_accumulation_steps=...): set "
                          "\"gradient_accumulation_steps\" in the zeroengine config instead")
    if config.get("use_ema"):
        raise ConfigError(f"Keras {name}(use_ema=True) is not supported by zeroengine")
    lr = float(optimizer.learning_rate)
    wd = config.get("weight_decay") or 0.0
    if name == "SGD":
        if wd:
            raise ConfigError("Keras SGD(weight_decay=...) decays the weights decoupled, "
                              "torch's SGD couples it to the gradient; use AdamW, or leave it out")
        return torch.optim.SGD(params, lr=lr, momentum=config["momentum"],
                               nesterov=config["nesterov"])
    if name in ("Adam", "AdamW"):
        if config.get("amsgrad"):
            raise ConfigError(f"Keras {name}(amsgrad=True) is not supported by zeroengine")
        betas = (config["beta_1"], config["beta_2"])
        if name == "Adam" and wd:
            raise ConfigError("Keras Adam(weight_decay=...) is decoupled decay: use AdamW")
        # Keras adds epsilon to sqrt(v) before the bias correction of v, torch after it;
        # distribute() sets torch's eps to epsilon / sqrt(1 - beta_2^t) before step t, which
        # makes the two updates the same
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=config["epsilon"],
                                 weight_decay=wd)
    raise ConfigError(f"Keras optimizer {name} has no zeroengine counterpart yet; use SGD, "
                      "Adam or AdamW")


def distribute(model, config: str | os.PathLike | dict | None = None):
    """Build the engine under a compiled Keras model; returns the ZeroEngine."""
    _check_version()
    import zeroengine
    if getattr(model, "optimizer", None) is None:
        raise ConfigError("zeroengine.integrations.keras.distribute: compile the model first "
                          "(model.compile(optimizer=..., loss=...))")
    policy = keras.config.dtype_policy().name
    if policy != "float32":
        raise ConfigError(f"Keras dtype policy {policy!r}: the Keras integration trains in "
                          "fp32 for now")
    raw = config_dict(config, "distribute(config=...)")
    keras_opt = model.optimizer
    clip = keras_opt.get_config().get("global_clipnorm")
    if clip is not None:
        if raw.get("gradient_clipping") not in (None, "auto", float(clip)):
            raise ConfigError(f"config gradient_clipping={raw['gradient_clipping']} vs Keras "
                              f"global_clipnorm={clip}: give one")
        raw["gradient_clipping"] = float(clip)
    if not model.built:
        raise ConfigError("build the Keras model before distribute() (call it once, or give "
                          "it an Input) so that its variables exist")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch_optimizer(keras_opt, params)
    keras_eps = keras_opt.get_config().get("epsilon") if isinstance(
        opt, torch.optim.AdamW) else None
    engine = zeroengine.initialize(model, raw, optimizer=opt)

    def apply(gradients, variables=None):
        """Keras' train_step hands the gradients it read from the parameters; the engine has
        reduced them itself during loss.backward(): step the shards (the engine's optimizer,
        through the torch optimizer it took over) at Keras' learning rate of this iteration."""
        lr = float(keras_opt.learning_rate)
        step = int(keras_opt.iterations.numpy()) + 1
        for group in opt.param_groups:
            group["lr"] = lr
            if keras_eps is not None:  # Keras' epsilon, in torch's place (torch_optimizer)
                group["eps"] = keras_eps / (1 - group["betas"][1] ** step) ** 0.5
        opt.step()
        opt.zero_grad()
        keras_opt.iterations.assign_add(1)

    keras_opt.apply = apply  # the one call of Keras' train_step that must go to the engine
    model.zero_engine = engine
    return engine


def shard(array, global_batch_size: int, rank: int | None = None, world_size: int | None = None):
    """This rank's rows of ``array`` such that, batch by batch, the ranks' micro-batches of
    ``global_batch_size // world_size`` rows make up the global batches of a single-process
    run in order (``fit(..., shuffle=False)``); a last partial global batch is dropped."""
    if rank is None or world_size is None:
        from ..distributed.bootstrap import process_rank_and_world
        rank, world_size = process_rank_and_world()
    if global_batch_size % world_size:
        raise ValueError(f"global_batch_size {global_batch_size} is not a multiple of the "
                         f"world size {world_size}")
    micro = global_batch_size // world_size
    batches = len(array) // global_batch_size
    rows = [b * global_batch_size + rank * micro + i for b in range(batches)
            for i in range(micro)]
    return array[rows]
