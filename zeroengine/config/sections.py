"""The config's other sections: fp16 / bf16, the monitors, optimizer and scheduler, compile
and checkpoint."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from .fields import Auto, option


@dataclass
class FP16Config:
    enabled: Union[bool, Auto] = option(
        False, "Train in float16 with fp32 master weights and loss scaling. 'auto': on when "
        "the model's parameters are float16.")
    loss_scale: float = option(0.0, "0: dynamic loss scaling; > 0: this static scale.", lo=0.0)
    initial_scale_power: int = option(16, "Dynamic scaling starts at 2**initial_scale_power.",
                                      lo=0, hi=64)
    loss_scale_window: int = option(1000, "Clean steps before the scale doubles.", lo=1)
    hysteresis: int = option(2, "Consecutive overflows before the scale halves.", lo=1)
    consecutive_hysteresis: bool = option(False, "Refill hysteresis after each clean step.")
    min_loss_scale: float = option(1.0, "The scale never drops below this; overflowing at the "
                                   "floor is an error.", lo=0.0)
    auto_cast: bool = option(False, "As in DeepSpeed: engine(...) casts the floating-point "
                             "tensors among its inputs (in lists, tuples and dicts too) to "
                             "float16 before the model sees them.")
    fp16_master_weights_and_grads: bool = option(
        False, "The optimizer's master weights are the float16 weights themselves (no fp32 "
        "copy: 2 bytes per parameter instead of 4); each Adam update is computed in fp32 and "
        "rounded to nearest. Adam/AdamW only.")


@dataclass
class BF16Config:
    enabled: Union[bool, Auto] = option(
        False, "Train in bfloat16 with fp32 master weights. 'auto': on when the model's "
        "parameters are bfloat16.")
    bf16_master_weights_and_grads: bool = option(
        False, "The optimizer's master weights are the bfloat16 weights themselves (no fp32 "
        "copy: 0 extra bytes per parameter on the device, 2 in host memory with CPU offload); "
        "each update is computed in fp32 and rounded (to nearest, or stochastic_rounding). "
        "Updates smaller than half a bfloat16 step are lost with nearest rounding. Adam/AdamW "
        "only.")
    bf16_optimizer_states: bool = option(
        False, "Adam's exp_avg and exp_avg_sq in bfloat16 (4 bytes per parameter instead of 8), "
        "read and written by the fused step, which computes in fp32. Adam/AdamW only.")
    store_param_remainders: bool = option(
        False, "Keep the fp32 master as the bfloat16 weight plus its low 16 bits (Megatron's "
        "name): 2 bytes per parameter instead of 4 and the fp32-master run's numbers (exact "
        "except that an update landing exactly halfway between two bfloat16 values with an even "
        "upper half moves the master by one fp32 ulp toward the weight). Any optimizer.")
    stochastic_rounding: bool = option(
        False, "Round the bfloat16 master weights and optimizer states stochastically "
        "(zeroengine's key), with random bits from (stochastic_rounding_seed, step, the "
        "element's index in the model): small updates survive on average, and a run is "
        "reproducible bit for bit at any world size and stage.")
    stochastic_rounding_seed: int = option(0, "The seed of stochastic_rounding's random bits.",
                                           lo=0, hi=2 ** 63 - 1)


@dataclass
class TensorBoardConfig:
    enabled: bool = option(False, "Rank 0 writes Train/Samples/train_loss, lr and (fp16) "
                           "loss_scale at each optimizer step, against the samples seen, as "
                           "TensorBoard scalars (needs the tensorboard package).")
    output_path: str = option("", "Directory the run's directory goes under.")
    job_name: str = option("DeepSpeedJobName", "The run's directory: output_path/job_name.")


@dataclass
class CSVMonitorConfig:
    enabled: bool = option(False, "Rank 0 appends the same events as tensorboard to one CSV "
                           "file per event (output_path/job_name/Train_Samples_lr.csv, ...; "
                           "columns step,<name>), as DeepSpeed's csv_monitor. No package needed.")
    output_path: str = option("", "Directory the run's directory goes under.")
    job_name: str = option("DeepSpeedJobName", "The run's directory: output_path/job_name.")


@dataclass
class WandbConfig:
    enabled: bool = option(False, "Rank 0 logs the same events to Weights & Biases (needs the "
                           "wandb package; without it the run says so once and goes on).")
    group: Optional[str] = option(None, "W&B group.")
    team: Optional[str] = option(None, "W&B entity (team).")
    project: str = option("deepspeed", "W&B project.")


@dataclass
class OptimizerConfig:
    type: str = option("AdamW", "Adam, AdamW, SGD, Lamb (zeroengine's, DeepSpeed's keys), or "
                       "the name of any torch.optim optimizer: elementwise ones (Adagrad, "
                       "RMSprop, NAdam, ...) step flat shards, tensor-wise ones (Adafactor; "
                       "Lamb) whole parameters on their owner rank. 'Adam' and 'AdamW' follow "
                       "DeepSpeed: weight_decay 0.0 unless given, decoupled unless "
                       "params.adam_w_mode is false; params.bias_correction false runs "
                       "zeroengine's Adam without the moments' bias correction; torch_adam is "
                       "accepted (one implementation serves both).")
    params: dict = option({}, "Keyword arguments of the optimizer (lr, betas, eps, "
                          "weight_decay, ...). 'auto' values take the optimizer's own defaults.")


@dataclass
class SchedulerConfig:
    type: str = option("WarmupLR", "WarmupLR, WarmupDecayLR, WarmupCosineLR (DeepSpeed's), or "
                       "the name of a torch.optim.lr_scheduler class.")
    params: dict = option({}, "Keyword arguments of the scheduler.")


@dataclass
class CompileConfig:
    enabled: bool = option(False, "torch.compile the model's forward at initialize() (as "
                           "engine.compile() does; the engine's hooks stay outside the graph). "
                           "DeepSpeed 0.13's key; \"disable\": false turns it on too.")
    disable: Optional[bool] = option(None, "DeepSpeed's other spelling: false compiles, true "
                                     "does not (wins over enabled).")
    backend: str = option("inductor", "The torch.compile backend (inductor, aot_eager, eager, "
                          "or any registered one).")
    kwargs: dict = option({}, "torch.compile's other keyword arguments: mode, dynamic, "
                          "fullgraph, options.")
    split_at_buckets: Optional[bool] = option(
        None, "zeroengine's own: at stages 0-2 cut the compiled graph at the gradient buckets "
        "(as torch does for compiled DDP), so each bucket's reduction starts while backward "
        "still runs. null: on CUDA devices, off on CPUs, where the cut measured slower "
        "(docs/compile.md).")

    @property
    def on(self) -> bool:
        return not self.disable if self.disable is not None else self.enabled


@dataclass
class CheckpointWriterConfig:
    """DeepSpeed's checkpoint writer; only ``decoupled`` (write in the background) applies."""
    decoupled: bool = option(False, "Write checkpoints in the background (DeepSpeed's "
                             "decoupled checkpoint engine): the same as checkpoint.async_save.")
    type: str = option("fast", "DeepSpeed's writer implementation.", no_effect="each rank "
                       "writes its own files with pwrite, hashing them on the way")
    io_buffer_size: int = option(64 * 1024 ** 2, "DeepSpeed's writer buffer.", lo=0,
                                 no_effect="files are written straight from the states (or "
                                 "their staging copy)")
    io_buffer_double: bool = option(True, "DeepSpeed's writer double buffering.",
                                    no_effect="see io_buffer_size")
    show_statistics: bool = option(False, "DeepSpeed's writer statistics.", no_effect="see "
                                   "benchmarks/ckpt_bench.py")
    data_parallel: Optional[str] = option(None, "DeepSpeed: which data-parallel ranks write.",
                                          no_effect="every rank writes what it owns")
    io_multiplier: int = option(1, "DeepSpeed's writer I/O multiplier.", lo=1,
                                no_effect="see io_buffer_size")


@dataclass
class CheckpointConfig:
    """How engine.save_checkpoint writes (DeepSpeed's ``checkpoint`` section)."""
    async_save: bool = option(False, "Default of save_checkpoint(async_save=...): true returns "
                              "a Future once the rank's states are copied to host staging "
                              "memory and writes, fsyncs and commits in the background "
                              "(docs: README, 'Checkpoints').")
    tag_validation: str = option("Warn", "DeepSpeed: compare the save's tag across ranks.",
                                 no_effect="tags are always compared; a save whose ranks pass "
                                 "different tags fails on every rank",
                                 choices=("Warn", "Ignore", "Fail", "WARN", "IGNORE", "FAIL",
                                          "warn", "ignore", "fail"))
    writer: Optional[CheckpointWriterConfig] = option(None, "DeepSpeed's checkpoint writer "
                                                      "(only decoupled applies).")

    @property
    def background(self) -> bool:
        """Whether saves default to asynchronous (ours, or DeepSpeed's decoupled writer)."""
        return self.async_save or (self.writer is not None and self.writer.decoupled)
