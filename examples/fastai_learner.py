"""fastai on zeroengine: a regression MLP trained with fit_one_cycle at ZeRO stage 2.

    torchrun --nproc_per_node 2 examples/fastai_learner.py     # or: python examples/...

The one change from fastai's distributed training: ``with learn.distrib_ctx():`` becomes
``with learn.zero_ctx(config):``. Needs ``pip install 'zeroengine[fastai]'``.
"""
from __future__ import annotations

from functools import partial

import fastai.callback.schedule  # noqa: F401  (Learner.fit_one_cycle)
import torch
import torch.nn as nn
import torch.nn.functional as F
from fastai.data.core import DataLoaders
from fastai.data.load import DataLoader
from fastai.learner import Learner
from fastai.optimizer import OptimWrapper

import zeroengine.integrations.fastai  # noqa: F401  (Learner.zero_ctx)


def main() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 16, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    data = list(zip(x, y))
    dls = DataLoaders(DataLoader(data[:896], bs=32, shuffle=True),
                      DataLoader(data[896:], bs=64), device="cpu")
    model = nn.Sequential(nn.Linear(16, 256), nn.GELU(), nn.Linear(256, 1))
    learn = Learner(dls, model, loss_func=F.mse_loss,
                    opt_func=partial(OptimWrapper, opt=torch.optim.AdamW))
    with learn.zero_ctx({"zero_optimization": {"stage": 2}}):
        learn.fit_one_cycle(3, 3e-3)


if __name__ == "__main__":
    main()
