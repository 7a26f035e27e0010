"""fastai on zeroengine (zeroengine.integrations.fastai: ZeroCallback / Learner.zero_ctx),
checked against fastai's own distributed training (``learn.distrib_ctx()``: accelerate's DDP,
2 processes, gloo) on the same Learner: stages 0-3 end with its parameters, with fit_one_cycle
driving the learning rate and momentum, GradientClip, and fastai's weight decay. Needs the
`fastai` extra."""
from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytest.importorskip("fastai", reason="the optional `fastai` extra is not installed "
                    "(pip install 'zeroengine[fastai]')")

from harness import max_relative_error

from zeroengine.testing import run_ranks


def learner():
    import fastai.callback.progress
    import fastai.callback.schedule  # noqa: F401  (Learner.fit_one_cycle)
    from fastai.callback.training import GradientClip
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from fastai.learner import Learner
    from fastai.optimizer import OptimWrapper
    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 8, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    data = list(zip(x, y))
    dls = DataLoaders(DataLoader(data[:40], bs=4, shuffle=False),
                      DataLoader(data[40:], bs=4), device="cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 1))
    return Learner(dls, model, loss_func=F.mse_loss, cbs=[GradientClip(0.5)],
                   opt_func=partial(OptimWrapper, opt=torch.optim.AdamW))


def fit(stage) -> dict:
    """fastai's own distributed training (stage None) or ZeroCallback at ``stage``."""
    import fastai.distributed as fd

    import zeroengine.integrations.fastai
    learn = learner()
    if stage is None:
        # fastai moves the index broadcast of DistributedDL to CUDA for NCCL; on CPUs (gloo)
        # it stays on the host - the only change to fastai's own distributed run
        fd.DistributedDL._broadcast = zeroengine.integrations.fastai._DistributedDL._broadcast
        context = learn.distrib_ctx(cpu=True)  # accelerate: DDP over gloo on CPUs
    else:
        context = learn.zero_ctx({"zero_optimization": {
            "stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 64}})
    with learn.no_bar(), learn.no_logging(), context:
        learn.fit_one_cycle(2, 1e-2)
    lrs = [float(v) for v in learn.recorder.lrs]
    engine_steps = None
    if stage is None:
        state = {k: v.detach().clone() for k, v in learn.model.state_dict().items()}
    else:
        state = learn.zero_engine.consolidated_state_dict()
        engine_steps = learn.zero_engine.global_steps
        learn.zero_engine.close()
    return dict(state=state, lrs=lrs, iters=learn.train_iter, engine_steps=engine_steps)


CASES = [None, 0, 1, 2, 3]


@pytest.fixture(scope="module")
def results():
    per_rank = run_ranks(2, lambda_cases, CASES, timeout=600)
    return {case: [r[i] for r in per_rank] for i, case in enumerate(CASES)}


def lambda_cases(cases):
    return [fit(case) for case in cases]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_callback_ends_with_fastais_own_distributed_parameters(results, stage):
    reference = results[None][0]
    assert reference["iters"] == 10  # 40 samples / 4 per batch / 2 ranks, 2 epochs
    assert len(set(reference["lrs"])) > 5  # one-cycle: the schedule moved the lr
    for r in results[stage]:
        err, where = max_relative_error(r["state"], reference["state"])
        assert err <= 2e-4, (err, where)
        assert r["lrs"] == pytest.approx(reference["lrs"], rel=1e-6)
        assert r["iters"] == reference["iters"] == r["engine_steps"]  # one clock tick each


def test_fastai_optimizer_is_refused_by_name():
    from fastai.learner import Learner
    from fastai.optimizer import Adam

    from zeroengine import ConfigError
    from zeroengine.integrations.fastai import ZeroCallback
    learn = learner()
    learn = Learner(learn.dls, learn.model, loss_func=F.mse_loss, opt_func=Adam)
    with pytest.raises(ConfigError, match="OptimWrapper"), learn.no_bar(), learn.no_logging():
        learn.fit(1, cbs=[ZeroCallback()])
