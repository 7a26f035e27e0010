"""Learning-rate schedules from the config's "scheduler" section.

DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR, written as torch LRScheduler subclasses
(so they step, save and load like any torch scheduler), plus any torch.optim.lr_scheduler class
by name. Iteration t is the scheduler's ``last_epoch`` (0 at construction, +1 per optimizer step).
"""
from __future__ import annotations

import inspect
import math

import torch
from torch.optim.lr_scheduler import LRScheduler

from ..config import AUTO, ConfigError, SchedulerConfig


def _warmup_gamma(t: int, warmup_steps: int, warmup_type: str) -> float:
    """Fraction of the warm-up done at iteration t: log-shaped or linear, 1 after warm-up."""
    if t >= warmup_steps:
        return 1.0
    if warmup_type == "log":
        return math.log(t + 1) / math.log(warmup_steps)
    return t / warmup_steps


class WarmupLR(LRScheduler):
    """lr rises from warmup_min_lr to warmup_max_lr over warmup_num_steps, then stays."""

    def __init__(self, optimizer, warmup_min_lr: float = 0.0, warmup_max_lr: float = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_epoch: int = -1):
        if warmup_type not in ("log", "linear"):
            raise ConfigError(f"scheduler.params.warmup_type must be 'log' or 'linear', got "
                              f"{warmup_type!r}")
        self.min_lr, self.max_lr = warmup_min_lr, warmup_max_lr
        self.warmup_num_steps = max(2, int(warmup_num_steps))  # log(1) would divide by zero
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_epoch)

    def _gamma(self) -> float:
        return _warmup_gamma(self.last_epoch, self.warmup_num_steps, self.warmup_type)

    def get_lr(self):
        lr = self.min_lr + (self.max_lr - self.min_lr) * self._gamma()
        return [lr for _ in self.optimizer.param_groups]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at total_num_steps."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_epoch: int = -1):
        if total_num_steps < warmup_num_steps:
            raise ConfigError(f"scheduler.params.total_num_steps ({total_num_steps}) is less than "
                              f"warmup_num_steps ({warmup_num_steps})")
        self.total_num_steps = int(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_epoch)

    def _gamma(self) -> float:
        if self.last_epoch < self.warmup_num_steps:
            return super()._gamma()
        return max(0.0, (self.total_num_steps - self.last_epoch) /
                   max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(LRScheduler):
    """Ratio of each group's own lr: warm up from warmup_min_ratio to 1, then cosine-decay to
    cos_min_ratio at total_num_steps."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                 warmup_type: str = "log", last_epoch: int = -1):
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio, self.cos_min_ratio = warmup_min_ratio, cos_min_ratio
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        t = self.last_epoch
        if t < self.warmup_num_steps:
            g = _warmup_gamma(t, self.warmup_num_steps, self.warmup_type)
            ratio = self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * g
        else:
            span = max(1, self.total_num_steps - self.warmup_num_steps)
            progress = min(1.0, (t - self.warmup_num_steps) / span)
            ratio = self.cos_min_ratio + (1.0 - self.cos_min_ratio) * 0.5 * (
                1.0 + math.cos(math.pi * progress))
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
                              f" {', '.join(k for k in accepted if k not in ('self', 'optimizer'))}")
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
