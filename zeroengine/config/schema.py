"""The whole config: ``Config``, its top-level keys and sections."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from .fields import Auto, option
from .sections import (
    BF16Config,
    CheckpointConfig,
    CompileConfig,
    CSVMonitorConfig,
    FP16Config,
    OptimizerConfig,
    SchedulerConfig,
    TensorBoardConfig,
    WandbConfig,
)
from .zero import AioConfig, ZeroConfig


@dataclass
class Config:
    train_batch_size: Optional[Union[int, Auto]] = option(
        None, "Samples per optimizer step over all ranks: micro batch x accumulation steps x "
        "world size.", lo=1)
    train_micro_batch_size_per_gpu: Optional[Union[int, Auto]] = option(
        None, "Samples per rank per forward/backward.", lo=1)
    gradient_accumulation_steps: Optional[Union[int, Auto]] = option(
        None, "Micro-steps per optimizer step (default 1).", lo=1)
    gradient_clipping: Union[float, Auto] = option(
        0.0, "Clip the global gradient norm to this; 0 disables.", lo=0.0)
    steps_per_print: int = option(10, "Every this many optimizer steps rank 0 logs the step, "
                                  "skipped steps, learning rates and loss scale (logger "
                                  "'zeroengine', INFO; on stderr when logging is not set up), "
                                  "as DeepSpeed does.", lo=1)
    collective_timeout_s: float = option(
        1800.0, "Seconds a collective may wait for the other ranks before this rank fails with "
        "an error naming the operation, the bucket or parameters and the step (a rank that "
        "crashed, hangs or skipped a backward), instead of hanging forever. Applies to the "
        "process group initialize() creates (not to a group created before it: pass a timeout to "
        "init_process_group there).", lo=1.0)
    on_nonfinite: str = option(
        "raise", "What a step does when a gradient holds inf/NaN and no fp16 loss scaler "
        "decides it: 'raise' (an error naming the step and the first such parameter, on every "
        "rank) or 'skip' (the step is skipped on every rank and counted in skipped_steps).",
        choices=("raise", "skip"))
    broadcast_buffers: bool = option(
        True, "Before each forward with gradients enabled, every rank takes rank 0's module "
        "buffers (BatchNorm running statistics), as torch DDP does by default "
        "(DistributedDataParallel(broadcast_buffers=True)); false: each rank keeps its own.")
    optimizer: Optional[OptimizerConfig] = option(None, "Optimizer built by initialize() when "
                                                  "none is passed in.")
    scheduler: Optional[SchedulerConfig] = option(None, "Learning-rate scheduler built by "
                                                  "initialize() when none is passed in.")
    fp16: FP16Config = option(FP16Config(), "float16 mixed precision.")
    bf16: BF16Config = option(BF16Config(), "bfloat16 mixed precision.",
                              deprecated=("bfloat16",))
    zero_optimization: ZeroConfig = option(ZeroConfig(), "What is sharded and how gradients "
                                           "travel.")
    compile: CompileConfig = option(CompileConfig(), "torch.compile of the model (docs/"
                                    "compile.md).")
    aio: AioConfig = option(AioConfig(), "Asynchronous file I/O of NVMe offload (DeepSpeed's "
                            "section; docs/nvme.md).")
    checkpoint: CheckpointConfig = option(CheckpointConfig(), "How engine.save_checkpoint "
                                          "writes.")
    tensorboard: TensorBoardConfig = option(TensorBoardConfig(), "DeepSpeed's TensorBoard "
                                            "monitor.")
    csv_monitor: CSVMonitorConfig = option(CSVMonitorConfig(), "DeepSpeed's CSV monitor.")
    wandb: WandbConfig = option(WandbConfig(), "DeepSpeed's Weights & Biases monitor.")
    communication_data_type: Optional[str] = option(
        None, "dtype gradients are reduced in: 'fp32', 'bf16' or 'fp16'. Default (null): the "
        "compute dtype, which halves the bytes of a bf16/fp16 run and is what the ZeRO paper's "
        "memory and traffic figures assume; 'fp32' sums more accurately over many ranks.",
        choices=("fp32", "bf16", "fp16"), deprecated_values={"bfp16": "bf16"})
    wall_clock_breakdown: bool = option(
        False, "Every steps_per_print optimizer steps rank 0 also logs the mean forward, "
        "backward and optimizer-step milliseconds per step (on CUDA the device is synchronised "
        "at each mark, as DeepSpeed's timers do, which costs some overlap). In a loop of "
        "loss.backward() the backward is timed from the end of the forward.")
    zero_allow_untested_optimizer: bool = option(True, "DeepSpeed's guard for client "
                                                 "optimizers.", no_effect="every optimizer is "
                                                 "supported (tensor-wise ones are probed)")
