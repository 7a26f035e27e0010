"""DeepSpeed's monitor sections (``tensorboard``, ``csv_monitor``, ``wandb``) under initialize:
rank 0 writes the events DeepSpeed's engine writes, at each optimizer step, against the number
of samples seen so far (DeepSpeed's x axis):

    Train/Samples/train_loss   mean of the micro-steps' losses given to engine.backward (rank 0)
    Train/Samples/lr           the first parameter group's learning rate
    Train/Samples/loss_scale   fp16 only

A backend whose package is missing is reported once (ConfigNotice) and skipped; the run goes on
and the other backends still write.
"""
from __future__ import annotations

import csv
import os
from typing import Protocol

from .config import Config
from .config.policy import notice

Event = tuple[str, float, int]  # (name, value, samples seen)


class _Backend(Protocol):
    def write(self, events: list[Event]) -> None: ...

    def close(self) -> None: ...


def _run_dir(output_path: str, job_name: str) -> str:
    path = os.path.join(output_path, job_name) or "."  # both empty: the working directory
    try:
        os.makedirs(path, exist_ok=True)
    except (OSError, ValueError) as err:
        from .config import ConfigError
        raise ConfigError(f"monitor output_path {output_path!r} / job_name {job_name!r}: "
                          f"cannot make the directory {path!r} ({err})") from None
    return path


class _TensorBoard:
    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter  # ImportError without tensorboard
        self.writer = SummaryWriter(log_dir=log_dir)

    def write(self, events: list[Event]) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()  # a run that crashes later still has its curve

    def close(self) -> None:
        self.writer.close()


class _CSV:
    """One file per event, ``Train/Samples/lr`` -> ``Train_Samples_lr.csv``, header
    ``step,<last part of the name>``: the layout DeepSpeed's csv_monitor writes, so scripts
    that read those files read these."""

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.started: set[str] = set()

    def write(self, events: list[Event]) -> None:
        for name, value, step in events:
            stem = name.replace("/", "_").replace(" ", "_")
            with open(os.path.join(self.log_dir, stem + ".csv"), "a", newline="") as f:
                out = csv.writer(f)
                if stem not in self.started:
                    self.started.add(stem)
                    out.writerow(["step", name.rsplit("/", 1)[-1]])
                out.writerow([step, value])

    def close(self) -> None:
        pass


class _Wandb:
    def __init__(self, project: str, group: str | None, team: str | None):
        import wandb  # ImportError without wandb
        self.wandb = wandb
        self.run = wandb.init(project=project, group=group, entity=team)

    def write(self, events: list[Event]) -> None:
        for name, value, step in events:
            self.run.log({name: value}, step=step)

    def close(self) -> None:
        self.run.finish()


class Monitor:
    """The enabled backends of a config; on ranks other than 0 (and with none enabled) it
    holds none and ``enabled`` is False, so the engine does no monitor work at all."""

    def __init__(self, backends: list[_Backend]):
        self.backends = backends

    @property
    def enabled(self) -> bool:
        return bool(self.backends)

    @classmethod
    def from_config(cls, config: Config, rank: int) -> "Monitor":
        if rank != 0:
            return cls([])
        backends: list[_Backend] = []
        tb, csv_cfg, wb = config.tensorboard, config.csv_monitor, config.wandb
        if tb.enabled:
            try:
                backends.append(_TensorBoard(_run_dir(tb.output_path, tb.job_name)))
            except ImportError:
                notice("tensorboard", "enabled, but the tensorboard package is not installed: "
                       "nothing is written to TensorBoard (pip install tensorboard)")
        if csv_cfg.enabled:
            backends.append(_CSV(_run_dir(csv_cfg.output_path, csv_cfg.job_name)))
        if wb.enabled:
            try:
                backends.append(_Wandb(wb.project, wb.group, wb.team))
            except ImportError:
                notice("wandb", "enabled, but the wandb package is not installed: nothing is "
                       "logged to Weights & Biases (pip install wandb)")
        return cls(backends)

    def write(self, events: list[Event]) -> None:
        for backend in self.backends:
            backend.write(events)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
        self.backends = []
