"""Lightning on zeroengine (zeroengine.integrations.lightning.ZeroStrategy), checked against
Lightning's own "ddp" strategy (2 processes, gloo) on the same module and data: stages 0-3 end
with its parameters (AdamW and SGD, accumulate_grad_batches with a short last group per epoch,
gradient_clip_val, a per-step scheduler, validation), bf16 tracks it, a model built in
configure_model is sharded at stage 3, and ModelCheckpoint + fit(ckpt_path=) resume to the
uninterrupted numbers, at another world size too. Needs the `lightning` extra."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

L = pytest.importorskip("lightning.pytorch", reason="the optional `lightning` extra is not "
                        "installed (pip install 'zeroengine[lightning]')")

from harness import TOLERANCE, max_relative_error  # noqa: E402 - after the importorskip

from zeroengine.testing import run_ranks  # noqa: E402

STEPS = 5
# small parameters are sharded too, and several buckets per backward
SHARD_ALL = {"zero_optimization": {"stage3_param_persistence_threshold": 0,
                                   "reduce_bucket_size": 64}}


class Regressor(L.LightningModule):
    def __init__(self, optim: str = "adamw", build_in_configure_model: bool = False):
        super().__init__()
        self.optim = optim
        self.net = None if build_in_configure_model else self._build()
        self.sharded_at_setup = None

    @staticmethod
    def _build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 1))

    def configure_model(self) -> None:
        if self.net is None:
            self.net = self._build()
            self.sharded_at_setup = any(hasattr(p, "_ze_slice") for p in self.net.parameters())

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x).float(), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x).float(), y), sync_dist=True)

    def configure_optimizers(self):
        if self.optim == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loaders(n: int = 56):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 8, generator=g)  # 56: 7 batches of 4 per rank, a short last group
    y = x.sum(dim=1, keepdim=True).sin()
    data = torch.utils.data.TensorDataset(x, y)
    return (torch.utils.data.DataLoader(data, batch_size=4),
            torch.utils.data.DataLoader(data, batch_size=8))


def trainer(strategy, devices: int = 2, **kw):
    args = dict(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS,
                accumulate_grad_batches=2, gradient_clip_val=0.5, logger=False,
                enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=2,
                val_check_interval=4)
    args.update(kw)
    return L.Trainer(**args)


def fit(kind, optim: str, precision: str = "32-true") -> dict:
    """One run on every rank: Lightning's "ddp" (kind None) or ZeroStrategy at stage ``kind``."""
    from zeroengine.integrations.lightning import ZeroStrategy
    model = Regressor(optim)
    strategy = "ddp" if kind is None else ZeroStrategy(stage=kind, config=SHARD_ALL)
    t = trainer(strategy, precision=precision)
    train, val = loaders()
    t.fit(model, train, val)
    engine_steps = None
    if kind is None:
        state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    else:
        state = t.strategy.engine.consolidated_state_dict()
        engine_steps = t.strategy.engine.global_steps
        t.strategy.engine.close()
    return dict(state=state, steps=t.global_step, val_loss=float(t.callback_metrics["val_loss"]),
                dtype=str(next(model.parameters()).dtype), engine_steps=engine_steps)


CASES = [(None, "adamw"), (0, "adamw"), (1, "adamw"), (2, "adamw"), (3, "adamw"),
         (None, "sgd"), (0, "sgd"), (1, "sgd"), (2, "sgd"), (3, "sgd")]


def fit_cases(cases) -> list:
    return [fit(*case) for case in cases] + [fit(2, "adamw", "bf16-mixed")]


@pytest.fixture(scope="module")
def results():
    per_rank = run_ranks(2, fit_cases, CASES, timeout=600)
    out = {case: [r[i] for r in per_rank] for i, case in enumerate(CASES)}
    out["bf16"] = [r[len(CASES)] for r in per_rank]
    return out


@pytest.mark.parametrize("optim,tol", [("adamw", 2e-4), ("sgd", 1e-5)])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_strategy_ends_with_lightning_ddp_parameters(results, stage, optim, tol):
    ddp = results[(None, optim)][0]
    for r in results[(stage, optim)]:
        err, where = max_relative_error(r["state"], ddp["state"])
        assert err <= tol, (err, where)
        assert r["steps"] == ddp["steps"] == STEPS
        assert r["engine_steps"] == STEPS  # the engine's clock counts Lightning's steps once
        assert r["val_loss"] == pytest.approx(ddp["val_loss"], rel=1e-4)


def test_bf16_mixed_tracks_fp32(results):
    ddp = results[(None, "adamw")][0]
    initial = {k: v.float() for k, v in Regressor()._build().state_dict().items()}
    for r in results["bf16"]:
        assert r["dtype"] == "torch.bfloat16"
        num = sum((r["state"][k] - v).double().pow(2).sum() for k, v in ddp["state"].items())
        den = sum((v - initial[k.removeprefix("net.")]).double().pow(2).sum()
                  for k, v in ddp["state"].items())
        assert (num / den).sqrt().item() < TOLERANCE


# -- registered names, configure_model under zero_init, checkpoints ----------------------------
def checkpointed(out: str, first, second) -> dict:
    """Fit to step 4 checkpointing every epoch (2 steps), then fit a fresh module resumed from
    the step-2 checkpoint; ``first`` / ``second``: the strategies of the two fits."""
    # 4 batches per rank: an epoch is 2 steps, checkpointed at its end
    train, val = loaders(32)
    model = Regressor(build_in_configure_model=True)
    t = trainer(first, max_steps=4, enable_checkpointing=True,
                callbacks=[L.callbacks.ModelCheckpoint(dirpath=out, every_n_epochs=1,
                                                       save_top_k=-1,
                                                       save_on_train_epoch_end=True)])
    t.fit(model, train, val)
    engine = getattr(t.strategy, "engine", None)
    result = dict(sharded=model.sharded_at_setup, stage=engine.stage if engine else None,
                  files=sorted(os.listdir(out)))
    result["uninterrupted"] = engine.consolidated_state_dict() if engine else \
        {k: v.detach().clone() for k, v in model.state_dict().items()}
    model = Regressor(build_in_configure_model=True)
    t = trainer(second, max_steps=4)
    t.fit(model, train, val, ckpt_path=os.path.join(out, "epoch=0-step=2.ckpt"))
    engine = getattr(t.strategy, "engine", None)
    result["resumed"] = engine.consolidated_state_dict() if engine else \
        {k: v.detach().clone() for k, v in model.state_dict().items()}
    result["steps"] = t.global_step
    return result


def named_and_checkpointed(out: str) -> dict:
    import zeroengine.integrations.lightning  # noqa: F401  (registers the names)
    from zeroengine.integrations.lightning import ZeroStrategy
    # ours: the registered name, the model built sharded in configure_model; Lightning's DDP
    # beside it (its own resume is the reference: Lightning re-runs what it re-runs)
    return dict(ours=checkpointed(os.path.join(out, "ours"), "zeroengine_stage_3",
                                  ZeroStrategy(stage=3)),
                ddp=checkpointed(os.path.join(out, "ddp"), "ddp", "ddp"))


def resume_at_world_1(checkpoint: str) -> dict:
    from zeroengine.integrations.lightning import ZeroStrategy
    seen = {}

    class Capture(L.Callback):
        def on_train_start(self, trainer, module):
            seen["state"] = trainer.strategy.engine.consolidated_state_dict()
            seen["step"] = trainer.global_step

    train, val = loaders(32)
    t = trainer(ZeroStrategy(stage=2), devices=1, max_steps=3, callbacks=[Capture()])
    t.fit(Regressor(), train, val, ckpt_path=checkpoint)
    seen["steps"] = t.global_step
    return seen


def test_registered_names_configure_model_and_checkpoints(tmp_path):
    out = str(tmp_path / "ckpt")
    results = run_ranks(2, named_and_checkpointed, out, timeout=600)
    for r in results:
        ours, ddp = r["ours"], r["ddp"]
        assert ours["stage"] == 3 and ours["sharded"] is True and ddp["sharded"] is False
        assert ours["steps"] == ddp["steps"] == 4
        assert ours["files"] == ddp["files"] == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"]
        for run in ("uninterrupted", "resumed"):
            err, where = max_relative_error(ours[run], ddp[run])
            assert err <= 2e-4, (run, err, where)
    out = os.path.join(out, "ours")
    # the 2-process checkpoint at world size 1: the engine starts from exactly what was saved
    from zeroengine.tools.cli import main as cli
    whole = str(tmp_path / "whole")
    assert cli(["consolidate", os.path.join(out, "epoch=0-step=2.ckpt"), whole, "--pt"]) == 0
    saved = torch.load(os.path.join(whole, "pytorch_model.pt"), weights_only=True)
    seen = run_ranks(1, resume_at_world_1, os.path.join(out, "epoch=0-step=2.ckpt"))[0]
    assert seen["step"] == 2 and seen["steps"] == 3
    err, where = max_relative_error(seen["state"], saved)
    assert err == 0.0, (err, where)


def test_conflicting_flags_stop_before_training():
    from zeroengine import ConfigError
    from zeroengine.integrations.lightning import ZeroStrategy
    strategy = ZeroStrategy(stage=2, config={"gradient_accumulation_steps": 4,
                                             "gradient_clipping": 1.0})

    class FakeTrainer:
        precision, accumulate_grad_batches = "32-true", 2
        gradient_clip_val, gradient_clip_algorithm = 0.5, "norm"

    with pytest.raises(ConfigError) as info:
        strategy._resolved_config(FakeTrainer())
    for both in ("gradient_accumulation_steps=4 vs Trainer accumulate_grad_batches=2",
                 "gradient_clipping=1.0 vs Trainer gradient_clip_val=0.5"):
        assert both in str(info.value)
    FakeTrainer.precision = "bf16-true"
    with pytest.raises(ConfigError, match="bf16-mixed"):
        ZeroStrategy(stage=2)._resolved_config(FakeTrainer())


def test_offload_arguments_are_deepspeed_strategys():
    """Lightning's DeepSpeedStrategy offload arguments, NVMe included, become the config."""
    from zeroengine import ConfigError
    from zeroengine.config import parse_config
    from zeroengine.integrations.lightning import ZeroStrategy
    strategy = ZeroStrategy(stage=3, offload_optimizer=True, offload_parameters=True,
                            offload_optimizer_device="nvme", offload_params_device="nvme",
                            nvme_path="/fast", params_buffer_size=150_000_000,
                            max_in_cpu=10**8, queue_depth=16)
    cfg = parse_config(strategy._zero_raw)
    zero = cfg.zero_optimization
    assert (zero.offload_optimizer.device, zero.offload_optimizer.nvme_path) == ("nvme", "/fast")
    assert (zero.offload_param.device, zero.offload_param.nvme_path) == ("nvme", "/fast")
    assert (zero.offload_param.buffer_count, zero.offload_param.buffer_size,
            zero.offload_param.max_in_cpu) == (5, 150_000_000, 10**8)
    assert (cfg.aio.block_size, cfg.aio.queue_depth) == (1_048_576, 16)
    zero = ZeroStrategy(stage=2, offload_optimizer=True)._zero_raw["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert "offload_param" not in zero
    with pytest.raises(ConfigError, match="offload_params_device='disk'"):
        ZeroStrategy(stage=3, offload_parameters=True, offload_params_device="disk")
