"""``deepspeed.checkpointing``: activation checkpointing. ``checkpoint(fn, *args)`` recomputes
``fn``'s activations in backward (torch.utils.checkpoint, non-reentrant: the same gradients as
DeepSpeed's reentrant function, and it works with stage 3's gather hooks). DeepSpeed's memory
options (partitioned or CPU-held activations) change no number and are accepted without
effect, said once."""
from __future__ import annotations

import torch
import torch.utils.checkpoint

from ..config.policy import notice
from ._missing import missing

_configured = False


def checkpoint(function, *args):
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


def configure(mpu_=None, deepspeed_config=None, partition_activations=None,
              contiguous_checkpointing=None, num_checkpoints=None, checkpoint_in_cpu=None,
              synchronize=None, profile=None) -> None:
    global _configured
    if mpu_ is not None:
        raise ValueError("deepspeed.checkpointing.configure(mpu_=...): zeroengine has no model "
                         "parallelism; pass None")
    for name, value in (("partition_activations", partition_activations),
                        ("contiguous_memory_optimization", contiguous_checkpointing),
                        ("cpu_checkpointing", checkpoint_in_cpu)):
        if value:
            notice(f"activation_checkpointing.{name}", "activations are recomputed by "
                   "torch.utils.checkpoint; this memory layout option has no effect (the "
                   "numbers are the same)")
    _configured = True


def is_configured() -> bool:
    return _configured


def reset() -> None:
    """DeepSpeed frees its checkpoint buffers here; torch's checkpoint keeps none."""


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """With no model parallelism this seeds the device generator, as DeepSpeed's does for
    model-parallel rank 0."""
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


def __getattr__(name: str):
    raise missing("deepspeed.checkpointing", name, {
        "get_cuda_rng_tracker": "no model-parallel RNG tracker: torch's generator is used",
        "CheckpointFunction": "checkpoint(fn, *args)"},
        ["checkpoint", "configure", "is_configured", "reset", "model_parallel_cuda_manual_seed"])
