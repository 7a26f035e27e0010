"""DeepSpeed's engine queries, with DeepSpeed's names, signatures and return values, so that a
script written for ``DeepSpeedEngine`` reads the same things from a ZeroEngine.

These read the config (batch sizes, precision, stage), the step clock (compat/step_clock.py)
and the process group; beside them, nn.Module's train/eval/parameters pass to the wrapped
module. The training verbs stay on ZeroEngine (engine.py), the checkpoint verbs are
engine_checkpoints.py's."""
from __future__ import annotations


class EngineQueries:
    """Mixed into ZeroEngine; reads ``self.config``, ``self.clock``, ``self.comm``,
    ``self.optimizer``, ``self.module``."""

    # -- batch sizes and accumulation ----------------------------------------------------------
    def train_batch_size(self) -> int | None:
        """Samples per optimizer step over all ranks (None when the config gives no batch size)."""
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int | None:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.accumulation_steps

    # -- precision and sharding ------------------------------------------------------------------
    def zero_optimization_stage(self) -> int:
        return self.stage

    def fp16_enabled(self) -> bool:
        return bool(self.config.fp16.enabled)

    def bfloat16_enabled(self) -> bool:
        return bool(self.config.bf16.enabled)

    def gradient_clipping(self) -> float:
        return float(self.config.gradient_clipping)

    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    # -- the wrapped module, as nn.Module's verbs -----------------------------------------------
    def train(self, mode: bool = True) -> "EngineQueries":
        self.module.train(mode)
        return self

    def eval(self) -> "EngineQueries":
        return self.train(False)

    def parameters(self):
        return self.module.parameters()

    def named_parameters(self):
        return self.module.named_parameters()

    # -- the step clock's counters and scheduler (step_clock.py), under DeepSpeed's names ---------
    @property
    def loss_scale(self) -> float:
        return self.clock.loss_scale()

    @property
    def global_steps(self) -> int:
        return self.clock.global_steps

    @property
    def global_samples(self) -> int:
        return self.clock.global_samples

    @property
    def micro_steps(self) -> int:
        return self.clock.micro_steps

    @property
    def skipped_steps(self) -> int:
        return self.clock.skipped_steps

    @property
    def lr_scheduler(self):
        return self.clock.scheduler

    # -- the last step ---------------------------------------------------------------------------
    def get_lr(self) -> list[float]:
        """Each parameter group's learning rate (DeepSpeed returns the list)."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_mom(self) -> list:
        """Each group's momentum (SGD, RMSprop) or betas (Adam and the rest), as DeepSpeed."""
        key = "momentum" if "momentum" in self.optimizer.param_groups[0] else "betas"
        return [group.get(key) for group in self.optimizer.param_groups]

    def was_step_applied(self) -> bool:
        """Whether the latest step() updated the parameters (False between accumulation
        boundaries and for a step skipped on an overflow)."""
        return self.clock.last_step_applied

    # -- where this rank is ----------------------------------------------------------------------
    @property
    def global_rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def local_rank(self) -> int:
        return self._local_rank

    def get_data_parallel_rank(self) -> int:
        return self.comm.rank

    def get_data_parallel_world_size(self) -> int:
        return self.comm.world_size
