"""Mixed-precision policy and loss scaling: pure logic, no process group, no tensors needed.

``LossScaler`` decides the fp16 loss scale from one bit per step ("did any rank overflow?");
the engine finds that bit (one all-reduce of the gradient norm, which is inf/NaN when any element
anywhere is) and skips the step when it is set.

Semantics follow DeepSpeed's fp16 section:
- ``loss_scale > 0``: static scale; overflowing steps are skipped, the scale never changes.
- dynamic: start at 2**initial_scale_power. An overflow uses up one unit of hysteresis; when none
  is left the scale halves (never below min_loss_scale) and hysteresis is refilled. A clean step
  refills hysteresis only with consecutive_hysteresis (so by default only consecutive-or-not
  overflows since the last scale change count). After loss_scale_window clean steps in a row the
  scale doubles.
- An overflow that would push the scale below the floor raises LossScaleFloorError: the run
  would otherwise skip every step forever.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ...errors import LossScaleFloorError


@dataclass
class LossScaler:
    # the settings come from the config's fp16 section (its defaults live there only)
    scale: float
    dynamic: bool
    window: int
    hysteresis: int
    min_scale: float
    consecutive_hysteresis: bool
    hysteresis_left: int
    clean_steps: int = 0  # clean steps since the last overflow or growth
    overflows: int = 0  # total overflowing steps seen

    @classmethod
    def from_config(cls, fp16) -> "LossScaler":
        """From the config's fp16 section (zeroengine.config.FP16Config)."""
        static = fp16.loss_scale > 0
        return cls(scale=float(fp16.loss_scale if static else 2 ** fp16.initial_scale_power),
                   dynamic=not static, window=fp16.loss_scale_window,
                   hysteresis=fp16.hysteresis, min_scale=float(fp16.min_loss_scale),
                   consecutive_hysteresis=fp16.consecutive_hysteresis,
                   hysteresis_left=fp16.hysteresis)

    def update(self, overflow: bool, step: int | None = None) -> None:
        """Account for one optimizer step whose gradients did (not) overflow."""
        if not overflow:
            self.clean_steps += 1
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            if self.dynamic and self.clean_steps >= self.window:
                self.scale *= 2.0
                self.clean_steps = 0
                self.hysteresis_left = self.hysteresis
            return
        self.overflows += 1
        self.clean_steps = 0
        if not self.dynamic:
            return
        self.hysteresis_left -= 1
        if self.hysteresis_left > 0:
            return
        if self.scale <= self.min_scale:
            where = f" at step {step}" if step is not None else ""
            raise LossScaleFloorError(
                f"fp16 gradients overflow{where} even at the minimum loss scale "
                f"(fp16.min_loss_scale={self.min_scale:g}): the model produces inf/NaN. Lower "
                "the learning rate, check the inputs, or train in bf16")
        self.scale = max(self.scale / 2.0, self.min_scale)
        self.hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            if not hasattr(self, key):
                raise KeyError(f"unknown loss-scaler state {key!r}")
            setattr(self, key, value)


_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16,
           "float16": torch.float16, "half": torch.float16, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Precision:
    """Which dtype the model computes in and which dtype gradients travel in."""

    compute: torch.dtype
    reduce: torch.dtype

    @classmethod
    def from_config(cls, cfg) -> "Precision":
        compute = torch.float16 if cfg.fp16.enabled else (
            torch.bfloat16 if cfg.bf16.enabled else torch.float32)
        reduce = _DTYPES[cfg.communication_data_type] if cfg.communication_data_type else compute
        return cls(compute, reduce)

    @property
    def mixed(self) -> bool:
        return self.compute != torch.float32


# How the optimizer keeps what it updates (OptimizerPrecision.master)
FP32_MASTER = "fp32"  # a separate fp32 copy (or the fp32 parameters themselves)
LOW_MASTER = "low"  # the bf16/fp16 weights themselves: bf16_master_weights_and_grads
REMAINDER_MASTER = "remainder"  # bf16 weight + its low 16 bits: store_param_remainders


@dataclass(frozen=True)
class OptimizerPrecision:
    """What the optimizer's master weights and per-element states are kept in (the bf16 and
    fp16 sections' master/state keys, resolved and checked against each other)."""

    master: str = FP32_MASTER
    states: torch.dtype = torch.float32  # Adam's exp_avg / exp_avg_sq
    stochastic: bool = False  # bf16 master/states rounded stochastically
    seed: int = 0

    @classmethod
    def from_config(cls, cfg) -> "OptimizerPrecision":
        """From a checked config (config/rules.py) whose fp16/bf16 'auto' is resolved."""
        bf16, fp16 = cfg.bf16, cfg.fp16
        if bf16.store_param_remainders:
            master = REMAINDER_MASTER
        elif bf16.bf16_master_weights_and_grads or fp16.fp16_master_weights_and_grads:
            master = LOW_MASTER
        else:
            master = FP32_MASTER
        return cls(master=master,
                   states=torch.bfloat16 if bf16.bf16_optimizer_states else torch.float32,
                   stochastic=bf16.stochastic_rounding, seed=bf16.stochastic_rounding_seed)

    @property
    def low_master(self) -> bool:
        """The bf16/fp16 weights are the master (no fp32 copy, no remainder)."""
        return self.master == LOW_MASTER

    @property
    def plain(self) -> bool:
        """fp32 master and states: the optimizer runs as the user built it."""
        return self.master == FP32_MASTER and self.states == torch.float32
