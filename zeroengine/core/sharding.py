"""What a ZeRO stage shards, named once: code branches on these names, not on stage numbers.

    stage 0: nothing (plain data parallel)      stage 2: + gradients
    stage 1: optimizer state (and fp32 master)  stage 3: + parameters
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sharding:
    optimizer_state: bool  # each rank steps (and keeps state for) only its chunks
    gradients: bool  # no full gradient buffer: each bucket's reduced chunk is all that is kept
    parameters: bool  # parameters live in shards and are gathered around their use

    @classmethod
    def of_stage(cls, stage: int) -> "Sharding":
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0-3, got {stage}")
        return cls(optimizer_state=stage >= 1, gradients=stage >= 2, parameters=stage == 3)

    @property
    def stage(self) -> int:
        """The ZeRO stage number, for reports and saved metadata only."""
        return 3 if self.parameters else 2 if self.gradients else 1 if self.optimizer_state else 0

    @property
    def full_gradient_buffer(self) -> bool:
        """Gradients accumulate in a full-size flat buffer (``param.grad`` are views of it)."""
        return not self.gradients
