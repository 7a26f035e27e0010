"""DeepSpeed's monitor sections under initialize: the events DeepSpeed's engine writes
(train_loss, lr, loss_scale against samples seen) reach the CSV files and TensorBoard, and a
backend whose package is missing is named once while the run goes on."""
from __future__ import annotations

import csv
import sys
import warnings

import pytest
import torch
import torch.nn as nn

import zeroengine
from zeroengine.config import policy as config_policy


@pytest.fixture
def single_process(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(key, raising=False)


def _read_csv(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], [(int(s), float(v)) for s, v in rows[1:]]


def test_monitor_sections_write_deepspeed_events(single_process, tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")  # `make setup` installs it: this never skips in CI
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    config_policy.forget_notices()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "fp16": {"enabled": True, "initial_scale_power": 8},
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0,
                                                         "warmup_max_lr": 0.1,
                                                         "warmup_num_steps": 4,
                                                         "warmup_type": "linear"}},
           "tensorboard": {"enabled": True, "output_path": str(tmp_path / "tb"),
                           "job_name": "run1"},
           "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"),
                           "job_name": "run1"},
           "wandb": {"enabled": True, "project": "p"}}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = zeroengine.initialize(model, cfg)
    said = [str(w.message) for w in caught if issubclass(w.category,
                                                          config_policy.ConfigNotice)]
    assert any("wandb package is not installed" in m for m in said), said
    losses, lrs = [], []
    for _step in range(3):
        micro = []
        for _ in range(2):
            x = torch.randn(2, 4)
            loss = engine(x.half()).float().square().mean()
            micro.append(loss.item())
            engine.backward(loss)
            engine.step()
        losses.append(sum(micro) / 2)
        lrs.append(engine.optimizer.param_groups[0]["lr"])
    scale = engine.loss_scale
    engine.close()
    samples = [4, 8, 12]  # train_batch_size 2 x 2 x world 1, per optimizer step

    header, rows = _read_csv(tmp_path / "csv" / "run1" / "Train_Samples_train_loss.csv")
    assert header == ["step", "train_loss"]
    assert [s for s, _ in rows] == samples
    assert [v for _, v in rows] == pytest.approx(losses, rel=1e-6)
    header, rows = _read_csv(tmp_path / "csv" / "run1" / "Train_Samples_lr.csv")
    assert header == ["step", "lr"] and [v for _, v in rows] == pytest.approx(lrs)
    assert len(set(lrs)) == 3  # the warm-up moved it: the test sees the schedule, not a constant
    _, rows = _read_csv(tmp_path / "csv" / "run1" / "Train_Samples_loss_scale.csv")
    assert [v for _, v in rows][-1] == scale

    board = EventAccumulator(str(tmp_path / "tb" / "run1"))
    board.Reload()
    loss_events = board.Scalars("Train/Samples/train_loss")
    assert [e.step for e in loss_events] == samples
    assert [e.value for e in loss_events] == pytest.approx(losses, rel=1e-5)
    assert [e.value for e in board.Scalars("Train/Samples/lr")] == pytest.approx(lrs, rel=1e-6)


def test_monitor_off_writes_nothing_and_costs_nothing(single_process, tmp_path):
    """No section enabled (the default): no backend, no per-micro-step loss kept."""
    model = nn.Linear(3, 1)
    engine = zeroengine.initialize(model, {"optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                           "csv_monitor": {"enabled": False,
                                                           "output_path": str(tmp_path)}})
    engine.backward(engine(torch.randn(2, 3)).sum())
    assert not engine.monitor.enabled and engine.clock._loss_sum is None
    engine.step()
    engine.close()
    assert list(tmp_path.iterdir()) == []
