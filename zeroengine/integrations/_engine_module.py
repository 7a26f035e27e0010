"""What a framework holds in place of ``DistributedDataParallel(model)`` once the engine exists
(the Hugging Face Trainer, Lightning): an ``nn.Module`` whose forward goes through the engine
(stage 3 gathers, fp16 auto_cast, the forward checks) and whose ``module`` is the user's model,
as under DDP."""
from __future__ import annotations

import torch.nn as nn


class EngineModule(nn.Module):
    def __init__(self, engine):
        super().__init__()
        self.module = engine.module
        self._engine = [engine]  # in a list: not an attribute nn.Module would register

    @property
    def engine(self):
        return self._engine[0]

    def forward(self, *args, **kwargs):
        return self._engine[0](*args, **kwargs)

    def no_sync(self):
        return self._engine[0].no_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the engine cleared its gradients at its own step."""
