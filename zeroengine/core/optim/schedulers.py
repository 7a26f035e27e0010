"""Learning-rate schedules from the config's "scheduler" section.

DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR, written as torch LRScheduler subclasses
(so they step, save and load like any torch scheduler), plus any torch.optim.lr_scheduler class
by name. Iteration t is DeepSpeed's ``last_batch_iteration`` (-1 at construction, +1 per
optimizer step): torch's ``last_epoch`` - 1.
"""
from __future__ import annotations

import inspect
import math

import torch
from torch.optim.lr_scheduler import LRScheduler

from ...config import AUTO, ConfigError, SchedulerConfig


def _warmup_gamma(t: int, warmup_steps: int, warmup_type: str) -> float:
    """Fraction of the warm-up done at iteration t: log-shaped or linear, 1 after warm-up."""
    if t >= warmup_steps:
        return 1.0
    if warmup_type == "log":
        return math.log(t + 1) / math.log(warmup_steps)
    return t / warmup_steps


class _DeepSpeedIteration(LRScheduler):
    """DeepSpeed's schedules count ``last_batch_iteration`` from -1 at construction (the
    lr is the start value then, and again after the first step, at iteration 0); torch's
    last_epoch counts from 0. ``iteration`` is DeepSpeed's count, so the lr of every step is
    DeepSpeed's (tests/test_ds_scripts.py runs DeepSpeed beside us)."""

    @property
    def iteration(self) -> int:
        return self.last_epoch - 1

    def take_deepspeed_position(self, last_batch_iteration: int) -> None:
        """Continue from a DeepSpeed checkpoint's scheduler state (its iteration t is torch's
        last_epoch t + 1); the lr of each group comes with the optimizer's param groups."""
        self.last_epoch = int(last_batch_iteration) + 1
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]


class WarmupLR(_DeepSpeedIteration):
    """lr rises from warmup_min_lr to warmup_max_lr (default: the group's lr, as DeepSpeed's)
    over warmup_num_steps, then stays."""

    def __init__(self, optimizer, warmup_min_lr: float = 0.0, warmup_max_lr: float | None = None,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_epoch: int = -1):
        if warmup_type not in ("log", "linear"):
            raise ConfigError(f"scheduler.params.warmup_type must be 'log' or 'linear', got "
                              f"{warmup_type!r}")
        self.min_lr = warmup_min_lr
        self.max_lrs = [g["lr"] for g in optimizer.param_groups] if warmup_max_lr is None \
            else [warmup_max_lr] * len(optimizer.param_groups)
        self.warmup_num_steps = max(2, int(warmup_num_steps))  # log(1) would divide by zero
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_epoch)

    def _gamma(self) -> float:
        return _warmup_gamma(self.iteration, self.warmup_num_steps, self.warmup_type)

    def get_lr(self):
        if self.iteration < 0:
            return [self.min_lr for _ in self.optimizer.param_groups]
        gamma = self._gamma()
        return [self.min_lr + (top - self.min_lr) * gamma for top in self.max_lrs]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at total_num_steps."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_epoch: int = -1):
        if total_num_steps < warmup_num_steps:
            raise ConfigError(f"scheduler.params.total_num_steps ({total_num_steps}) is less than "
                              f"warmup_num_steps ({warmup_num_steps})")
        self.total_num_steps = int(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_epoch)

    def _gamma(self) -> float:
        if self.iteration < self.warmup_num_steps:
            return super()._gamma()
        return max(0.0, (self.total_num_steps - self.iteration) /
                   max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_DeepSpeedIteration):
    """Ratio of each group's own lr: warm up from warmup_min_ratio to 1, then cosine-decay to
    cos_min_ratio at total_num_steps (0 before the first step, as DeepSpeed's)."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                 warmup_type: str = "log", last_epoch: int = -1):
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio, self.cos_min_ratio = warmup_min_ratio, cos_min_ratio
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        t = self.iteration
        if t < 0:
            ratio = 0.0
        elif t < self.warmup_num_steps:
            g = _warmup_gamma(t, self.warmup_num_steps, self.warmup_type)
            ratio = self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * g
        else:
            span = max(1, self.total_num_steps - self.warmup_num_steps)
            progress = min(1.0, (t - self.warmup_num_steps + 1) / span)
            ratio = max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * 0.5 * (
                1.0 + math.cos(math.pi * progress)))
        return [base * ratio for base in self.base_lrs]


DEEPSPEED_SCHEDULERS = {c.__name__: c for c in (WarmupLR, WarmupDecayLR, WarmupCosineLR)}
_NOT_SUPPORTED = {"OneCycle": "use torch's OneCycleLR by name instead",
                  "LRRangeTest": "run a range test outside the engine"}


def scheduler_from_config(cfg: SchedulerConfig | None, optimizer):
    if cfg is None:
        return None
    if cfg.type in _NOT_SUPPORTED:
        raise ConfigError(f"scheduler.type {cfg.type!r} is not supported: "
                          f"{_NOT_SUPPORTED[cfg.type]}")
    cls = DEEPSPEED_SCHEDULERS.get(cfg.type) or getattr(torch.optim.lr_scheduler, cfg.type, None)
    if not (isinstance(cls, type) and issubclass(cls, LRScheduler)):
        raise ConfigError(f"scheduler.type {cfg.type!r} is neither one of "
                          f"{', '.join(DEEPSPEED_SCHEDULERS)} nor a torch.optim.lr_scheduler class")
    params = dict(cfg.params)
    accepted = inspect.signature(cls.__init__).parameters
    for key, value in params.items():
        if key not in accepted or key == "optimizer":
            raise ConfigError(f"scheduler.params.{key} is not an argument of {cfg.type}; accepted:"
                              " " + ", ".join(k for k in accepted
                                              if k not in ("self", "optimizer")))
        if value == AUTO:
            if key == "warmup_max_lr":
                params[key] = optimizer.param_groups[0]["lr"]
            elif key in ("warmup_min_lr", "warmup_min_ratio"):
                params[key] = 0.0
            else:
                raise ConfigError(f"scheduler.params.{key}: 'auto' cannot be resolved by the "
                                  "engine (it does not know the length of the run); give a "
                                  "value, or pass lr_scheduler= to initialize()")
    try:
        return cls(optimizer, **params)
    except TypeError as err:
        raise ConfigError(f"scheduler {cfg.type}: {err}") from None
