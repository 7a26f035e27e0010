"""``DeepSpeedEngine``: the engine ``zeroengine.deepspeed.initialize`` returns - a ZeroEngine
with DeepSpeed's conventions where they differ from zeroengine's own:

- ``load_checkpoint`` with nothing saved yet returns ``(None, None)`` with a warning (zeroengine
  raises unless ``missing_ok``), and takes DeepSpeed's arguments;
- ``save_checkpoint(..., client_state={}, save_latest=True)`` and ``save_16bit_model(...,
  save_filename="pytorch_model.bin")`` (torch.save format for that name, as DeepSpeed writes);
- ``zero_grad()`` and ``destroy()``;
- a DeepSpeed engine attribute zeroengine does not implement raises NotInZeroengine naming it
  and what to use instead, never a bare AttributeError.
"""
from __future__ import annotations

import warnings

from ..core.engine import ZeroEngine
from ._missing import missing

_NEAREST = {
    "optimizer_name": "engine.optimizer.base_class.__name__",
    "get_type": "engine.optimizer.base_class.__name__",
    "set_train_batch_size": "set the batch sizes in the config before initialize",
    "module_state_dict": "engine.consolidated_state_dict() (full fp32 values, collective)",
    "load_module_state_dict": "engine.load_checkpoint(dir, load_module_only=True)",
    "get_model_parallel_rank": "zeroengine has no model parallelism: 0",
    "mpu": "zeroengine has no model parallelism",
    "tput_timer": "config wall_clock_breakdown (logged every steps_per_print steps)",
    "timers": "config wall_clock_breakdown (logged every steps_per_print steps)",
    "offload_states": "zero_optimization.offload_optimizer / offload_param in the config",
    "reload_states": "zero_optimization.offload_optimizer / offload_param in the config",
    "empty_partition_cache": "stage 3 releases gathered parameters after each module itself",
    "gradient_average": "gradients are always averaged over ranks (DeepSpeed's default)",
    "sparse_gradients_enabled": "sparse gradients are not supported",
    "flops_profiler_enabled": "no flops profiler; see benchmarks/step_bench.py",
    "autotuning_enabled": "no autotuner; `zeroengine estimate --recommend`",
    "is_pipe_parallel": "no pipeline parallelism",
    "curriculum_learning_enabled": "no curriculum learning (data_efficiency)",
}


class DeepSpeedEngine(ZeroEngine):
    training_dataloader = None  # initialize(training_data=...) sets the data loader it built

    def load_checkpoint(self, load_dir: str, tag: str | None = None,
                        load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        custom_load_fn=None):
        if not load_module_strict:
            raise ValueError("load_checkpoint(load_module_strict=False): zeroengine loads "
                             "every parameter by name and refuses a checkpoint that lacks one; "
                             "load with load_module_strict=True")
        if custom_load_fn is not None:
            raise ValueError("load_checkpoint(custom_load_fn=...): not supported; the "
                             "checkpoint's tensors load by parameter name")
        path, client_state = super().load_checkpoint(
            load_dir, tag, load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only, missing_ok=True,
            # DeepSpeed's load_checkpoint leaves the generators alone: a script that seeds at
            # the start and resumes draws the same dropout masks and data under either engine
            load_rng_states=False)
        if path is None:  # DeepSpeed's answer when nothing was saved there yet
            warnings.warn(f"Unable to find a checkpoint in {load_dir} (no 'latest' file"
                          f"{'' if tag is None else ' and no tag ' + repr(tag)}); nothing "
                          "was loaded", stacklevel=2)
        return path, client_state

    def save_checkpoint(self, save_dir: str, tag=None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False):
        if exclude_frozen_parameters:
            raise ValueError("save_checkpoint(exclude_frozen_parameters=True): zeroengine's "
                             "checkpoint keeps every parameter; leave the argument out")
        if tag is not None:
            tag = str(tag)  # DeepSpeed scripts pass step numbers as tags
        super().save_checkpoint(save_dir, tag, client_state=client_state or {},
                                save_latest=save_latest)
        return True  # DeepSpeed returns True once saved

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        if exclude_frozen_parameters:
            raise ValueError("save_16bit_model(exclude_frozen_parameters=True): not supported; "
                             "every parameter is saved")
        return super().save_16bit_model(save_dir, save_filename)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def destroy(self) -> None:
        self.close()

    def __getattr__(self, name: str):
        # only reached for names neither ZeroEngine nor this class has
        raise missing("DeepSpeedEngine", name, _NEAREST,
                      [n for n in dir(type(self)) if not n.startswith("_")])
