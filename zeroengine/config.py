"""The JSON config: a typed schema with DeepSpeed's key names, defaults in one place.

Every field is declared once below, with its default, allowed range and a docstring; parsing,
validation, the "did you mean" suggestions and the generated reference (``make docs`` ->
docs/config.md) all read these declarations. This module imports nothing
from torch, so it can be tested and used (``zeroengine check-config``) without a framework.

Four kinds of keys:
- supported: declared below and acted upon;
- accepted without effect: declared below with ``no_effect`` saying why (e.g. DeepSpeed's
  ``contiguous_gradients``, which is how zeroengine always works);
- DeepSpeed's own spellings of a key (``aliases``; deprecated ones warn once);
- DeepSpeed keys zeroengine does not implement: config_policy.py says which are refused by name
  (they would change results) and which are accepted with no effect (logging, internals).
An unknown key close to a known one is refused with the suggestion; an unknown top-level key
close to nothing is reported once and ignored, as DeepSpeed ignores it.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import json
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from .config_policy import NO_EFFECT, REFUSED, notice
from .errors import ConfigError

AUTO = "auto"
COMMENT_PREFIX = "_comment"  # JSON has no comments: keys starting with this are skipped


def option(default, doc: str, *, lo=None, hi=None, choices=None, auto: bool = False,
           no_effect: str | None = None, aliases: tuple = (), deprecated: tuple = (),
           deprecated_values: dict | None = None):
    """Declare one config key: its default, documentation and allowed values; ``aliases``:
    DeepSpeed's other spellings of it, ``deprecated``: spellings accepted with a warning,
    ``deprecated_values``: old spellings of a value (old -> current), read with a warning."""
    meta = dict(doc=doc, lo=lo, hi=hi, choices=choices, auto=auto, no_effect=no_effect,
                aliases=aliases, deprecated=deprecated,
                deprecated_values=deprecated_values or {})
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    if dataclasses.is_dataclass(default):
        return field(default_factory=type(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class OffloadConfig:
    """offload_optimizer: where the rank's fp32 master and optimizer state live."""
    device: str = option("none", "Where to keep the state: 'none' (on the training device), "
                         "'cpu' (host memory) or 'nvme' (files under nvme_path, streamed "
                         "through host memory one sub_group_size tile at a time).",
                         choices=("none", "cpu", "nvme"))
    nvme_path: Optional[str] = option(None, "device 'nvme': a directory on the fast drive; "
                                      "each rank swaps under <nvme_path>/zeroengine_swap/ "
                                      "(removed at exit; a killed run's is removed by the next "
                                      "start).")
    pin_memory: bool = option(False, "Use page-locked host buffers (faster device<->host "
                              "copies on CUDA; no effect on CPU-only machines).")
    buffer_count: int = option(4, "DeepSpeed: swap buffers per tile (one per swapped tensor).",
                               lo=1, no_effect="each tile's host buffer holds all of its "
                               "swapped tensors (master and every per-element state); the "
                               "tiles in memory are 1 + pipeline_read + pipeline_write")
    pipeline_read: bool = option(False, "device 'nvme': read tile k+1 from the drive while "
                                 "tile k steps (one more tile in host memory).")
    pipeline_write: bool = option(False, "device 'nvme': write tile k back while the next "
                                  "tile steps (one more tile in host memory).")
    fast_init: bool = option(False, "DeepSpeed NVMe option.", no_effect="the swap files are "
                             "preallocated and written once at start, a tile at a time")


@dataclass
class OffloadParamConfig:
    """offload_param (stage 3): where the rank's parameter shard lives."""
    device: str = option("none", "Where to keep the parameter shard: 'none' (on the training "
                         "device), 'cpu' (host memory; copied to the device when gathered) "
                         "or 'nvme' (files under nvme_path, read through a host cache of "
                         "max_in_cpu elements).",
                         choices=("none", "cpu", "nvme"))
    nvme_path: Optional[str] = option(None, "device 'nvme': a directory on the fast drive; "
                                      "each rank swaps under <nvme_path>/zeroengine_swap/ "
                                      "(removed at exit, as offload_optimizer's).")
    pin_memory: bool = option(False, "Use page-locked host buffers (faster device<->host "
                              "copies on CUDA; no effect on CPU-only machines).")
    buffer_count: int = option(5, "device 'nvme': with buffer_size, how far the parameter "
                               "reads run ahead of the forward/backward order "
                               "(buffer_count x buffer_size elements in flight).", lo=1)
    buffer_size: int = option(100_000_000, "device 'nvme': elements per read-ahead buffer "
                              "(see buffer_count).", lo=1)
    max_in_cpu: int = option(1_000_000_000, "device 'nvme': most parameter-shard elements "
                             "kept in host memory (a cache, least recently used out; "
                             "changed chunks are written when they leave it).", lo=0)


@dataclass
class AioConfig:
    """The asynchronous file I/O of NVMe offload (ops/aio.py), DeepSpeed's ``aio`` section."""
    block_size: int = option(1_048_576, "Bytes per read/write request (a multiple of 4096).",
                             lo=4096)
    queue_depth: int = option(8, "Requests in flight at once (io_uring) per transfer engine.",
                              lo=1)
    thread_count: int = option(1, "Threads issuing requests (the thread-pool backend's "
                               "workers; io_uring uses one submitter).", lo=1)
    single_submit: bool = option(False, "DeepSpeed libaio: submit requests one at a time.",
                                 no_effect="io_uring submits in batches up to queue_depth")
    overlap_events: bool = option(True, "DeepSpeed libaio: overlap submission and completion.",
                                  no_effect="completions are reaped while requests are in "
                                  "flight")


@dataclass
class ZeroConfig:
    stage: int = option(0, "0: plain data parallel (gradients all-reduced). 1: optimizer state "
                        "sharded. 2: + gradients sharded. 3: + parameters sharded.", lo=0, hi=3)
    overlap_comm: bool = option(True, "Launch each gradient bucket's collective as soon as "
                                "backward has produced it, overlapping communication with the "
                                "rest of backward. False: all buckets are sent after backward.")
    reduce_bucket_size: int = option(5_000_000, "Elements per gradient bucket (one "
                                     "reduce-scatter / all-reduce each). Smaller buckets start "
                                     "communicating earlier in backward and, at stage 2, bound "
                                     "the gradient memory in flight (two buckets); larger ones "
                                     "make fewer calls. 0: every parameter a bucket of its own. "
                                     "\"auto\": hidden_size^2 for a model whose config "
                                     "declares a hidden_size (as transformers fills it for "
                                     "DeepSpeed), else the default.",
                                     lo=0, auto=True)
    allgather_bucket_size: int = option(50_000_000, "Most elements in flight at once in the "
                                        "all-gather of updated parameters after a step.", lo=1)
    reduce_scatter: bool = option(True, "Stages 1-2: reduce-scatter gradients to their owners. "
                                  "False: all-reduce them and keep the owned part (twice the "
                                  "bytes; for debugging).")
    contiguous_gradients: bool = option(True, "Copy gradients into a contiguous buffer as they "
                                        "are produced.", no_effect="always on: gradients are "
                                        "always reduced from contiguous flat buffers")
    allgather_partitions: bool = option(True, "All-gather updated partitions after a step.",
                                        no_effect="always on")
    round_robin_gradients: bool = option(False, "DeepSpeed CPU-offload gradient ordering.",
                                         no_effect="partitions are segment-wise already")
    ignore_unused_parameters: bool = option(True, "Tolerate parameters that get no gradient.",
                                            no_effect="always tolerated: they count as zero")
    load_from_fp32_weights: bool = option(True, "Restore master weights from the checkpoint's "
                                          "fp32 copy.", no_effect="checkpoints always hold fp32")
    elastic_checkpoint: bool = option(False, "DeepSpeed elastic checkpoints.",
                                      no_effect="every checkpoint reshards on load")
    sub_group_size: int = option(1_000_000_000, "Elements the optimizer steps at a time "
                                 "(bounds temporary memory of the step; 0: one segment at a "
                                 "time).", lo=0)
    offload_optimizer: OffloadConfig = option(OffloadConfig(), "Keep fp32 master weights and "
                                              "optimizer state in host memory and step on the "
                                              "CPU (stages 1-3); torch Adam/AdamW run as "
                                              "zeroengine.ops.CPUAdam, other optimizers as "
                                              "their own class.")
    offload_param: OffloadParamConfig = option(
        OffloadParamConfig(), "Keep parameter shards in host memory (stage 3); each is copied "
        "to the device when gathered.")
    stage3_prefetch_bucket_size: int = option(
        AUTO, "Stage 3: most elements gathered ahead of their use. \"auto\": sized from the "
        "model - an eighth of the partitioned elements, at least two of its largest segments "
        "(a few layers' worth) - so that stage 3 holds a window of the model, not all of it. "
        "(DeepSpeed's default, 50,000,000, gathers the whole of any smaller model.) Written "
        "as \"auto\" in the config for a model whose config declares a hidden_size: 0.9 x "
        "hidden_size^2, as transformers fills it for DeepSpeed.", lo=0,
        auto=True, aliases=("prefetch_bucket_size",))
    stage3_param_persistence_threshold: int = option(100_000, "Stage 3: parameters with fewer "
                                                     "elements stay whole on every rank. "
                                                     "\"auto\": 10 x hidden_size for a model "
                                                     "whose config declares one, else the "
                                                     "default.", lo=0,
                                                     auto=True,
                                                     aliases=("param_persistence_threshold",))
    stage3_check_gather_order: bool = option(
        True, "Stage 3: beside each parameter all-gather the ranks exchange what they gather and "
        "why (4 integers, asynchronously, on a host-side gloo group), and compare before the "
        "gathered values are used. Ranks that run different code (evaluation or generate() on "
        "rank 0 only, a branch taken on one rank, experts run on some ranks) then fail at once "
        "with an error saying what each rank was doing, instead of a collective size mismatch, "
        "a hang, or - when the sizes happen to agree - silently mixed parameters. The start of "
        "every forward is checked regardless. false: skip the per-gather exchange.")
    mics_shard_size: int = option(
        -1, "Hybrid sharding (stages 1-3): shard the model states over groups of this many "
        "ranks and replicate them across the groups. Gradients are reduce-scattered inside a "
        "group and only each rank's 1/K shard is all-reduced across groups; parameters are "
        "gathered inside the group. With a group per node, inter-node traffic drops to 1/K "
        "of plain ZeRO's, for K/N more memory per rank (docs/hybrid.md). -1: one group of all "
        "ranks (plain ZeRO). \"auto\": the ranks of one node (the launcher's "
        "LOCAL_WORLD_SIZE). DeepSpeed's MiCS key.", lo=-1, auto=True)
    zero_hpz_partition_size: int = option(
        1, "Stage 3 (ZeRO++ hpZ): keep a secondary copy of the parameters sharded over the "
        "ranks of one node (this many): after a segment's first all-gather in a step, the "
        "backward's and later micro-steps' gathers of it stay inside the node. Costs 1/K of "
        "the parameters per rank. 1: off. \"auto\": the ranks of one node.", lo=0, auto=True)
    zero_quantized_weights: bool = option(
        False, "Stage 3 (ZeRO++ qwZ): all-gather the model's parameter segments as blockwise "
        "int8 (256 elements per fp32 scale): 0.51x the bytes of bf16, 0.25x of fp32. Each "
        "weight the forward and backward use is within max|its block|/254 of the master's "
        "value; the fp32 masters and the optimizer stay exact (docs/hybrid.md).")
    zero_quantized_gradients: bool = option(
        False, "Stages 1-3 (ZeRO++ qgZ): reduce-scatter gradient buckets as blockwise int8, "
        "one all-to-all, summed in fp32 by the owner: each rank's contribution within "
        "max|its block|/254 (docs/hybrid.md). With mics_shard_size the all-reduce across "
        "groups stays exact.")
    stage3_leaf_modules: list = option(
        [], "Stage 3: module class names (e.g. \"MixtralSparseMoeBlock\") fetched as one unit: "
        "entering such a module gathers every parameter under it, and its children are not "
        "fetched on their own. For MoE-style blocks whose experts run on some ranks only "
        "(DeepSpeed's set_z3_leaf_modules), so that every rank gathers the same parameters.")
    stage3_fetch_unit_size: int = option(
        AUTO, "Stage 3: consecutive modules (in registration order) are grouped into fetch "
        "units of up to this many elements; a unit is gathered with one all-gather and its "
        "gradient reduce-scattered as one bucket, so a deep model of small modules makes a few "
        "large collectives instead of a latency-bound one per module (FSDP2 groups a "
        "fully_shard unit the same way). A module larger than this is a unit of its own. "
        "0: one unit per module. \"auto\": a sixteenth of the partitioned elements, at most "
        "1,000,000 and reduce_bucket_size (measured in benchmarks/growth_bench.py).",
        lo=0, auto=True)
    return_free_host_memory: bool = option(
        False, "After each optimizer step, give the pages the C allocator (glibc) holds free "
        "back to the system (malloc_trim), where host memory holds the training state (a CPU "
        "device, or offload). A step frees many tensors of many sizes and glibc keeps much of "
        "that memory resident as fragments: on the 25M GPT at stage 3 on CPU this cuts the peak "
        "resident memory per rank by ~15% of DDP's, and costs ~6% of the step time in pages "
        "faulted in again (benchmarks/compare.py; README \"Stage 3's memory\").")
    stage3_max_live_parameters: int = option(1_000_000_000, "Stage 3: most gathered elements "
                                             "alive at once.", lo=0,
                                             aliases=("max_live_parameters",))
    stage3_max_reuse_distance: int = option(
        AUTO, "Stage 3: a segment released after its module's forward is kept instead if the "
        "backward uses it again within this many gathered elements (along the order recorded "
        "in the first step), as long as stage3_max_live_parameters allows: the last layers of "
        "a forward stay gathered for the start of backward instead of being gathered again. "
        "\"auto\": the prefetch window. 0: release every segment after its use. (DeepSpeed's "
        "default, 1,000,000,000, keeps the whole of any smaller model gathered from forward to "
        "backward.)", lo=0, auto=True, aliases=("max_reuse_distance",))
    stage3_gather_16bit_weights_on_model_save: bool = option(
        False, "Stage 3: let engine.save_16bit_model() gather the sharded weights and write "
        "them (without it, it writes nothing at stage 3, as in DeepSpeed).",
        aliases=("gather_16bit_weights_on_model_save",),
        deprecated=("stage3_gather_fp16_weights_on_model_save",))


@dataclass
class FP16Config:
    enabled: bool = option(False, "Train in float16 with fp32 master weights and loss scaling. "
                           "'auto': on when the model's parameters are float16.", auto=True)
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
    enabled: bool = option(False, "Train in bfloat16 with fp32 master weights. 'auto': on when "
                           "the model's parameters are bfloat16.", auto=True)
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


@dataclass
class Config:
    train_batch_size: Optional[int] = option(None, "Samples per optimizer step over all ranks: "
                                             "micro batch x accumulation steps x world size.",
                                             lo=1, auto=True)
    train_micro_batch_size_per_gpu: Optional[int] = option(None, "Samples per rank per "
                                                           "forward/backward.", lo=1, auto=True)
    gradient_accumulation_steps: Optional[int] = option(None, "Micro-steps per optimizer step "
                                                        "(default 1).", lo=1, auto=True)
    gradient_clipping: float = option(0.0, "Clip the global gradient norm to this; 0 disables.",
                                      lo=0.0, auto=True)
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
    job: dict = option({}, "The built-in `zeroengine train` job: model size, steps, evaluation, "
                       "run name (not a DeepSpeed key; initialize() ignores it). Its keys are "
                       "checked by the job itself: see docs/job.md.")
    zero_allow_untested_optimizer: bool = option(True, "DeepSpeed's guard for client "
                                                 "optimizers.", no_effect="every optimizer is "
                                                 "supported (tensor-wise ones are probed)")


# -- parsing ---------------------------------------------------------------------------------
def _type_name(t) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            dict: "an object", list: "a list of strings"}.get(t, getattr(t, "__name__", str(t)))


def _range_text(meta, t) -> str:
    if meta["choices"]:
        return "one of " + ", ".join(repr(c) for c in meta["choices"])
    lo, hi = meta["lo"], meta["hi"]
    if lo is not None and hi is not None:
        return f"{lo}..{hi}"
    if lo is not None:
        return f">= {lo}"
    return _type_name(t)


def _coerce(value, t, path: str, meta) -> Any:
    """Check one leaf value against its declared type and range."""
    if value == AUTO and isinstance(value, str):
        if meta["auto"]:
            return AUTO
        raise ConfigError(f"{path}: 'auto' is not accepted here; give {_range_text(meta, t)}")
    if isinstance(value, str) and value in meta["deprecated_values"]:
        notice(path, f"{value!r} is an old DeepSpeed spelling; read as "
               f"{meta['deprecated_values'][value]!r}")
        value = meta["deprecated_values"][value]
    if t is bool and isinstance(value, str) and value.lower() in ("true", "false"):
        # DeepSpeed's config models read the strings "true"/"false" as booleans
        notice(path, f"the string {json.dumps(value)} read as the boolean {value.lower()}")
        value = value.lower() == "true"
    if t is bool:
        ok = isinstance(value, bool)
    elif t is int:
        # JSON configs often spell sizes like 5e8: accept integral floats.
        ok = (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer())
        value = int(value) if ok else value
    elif t is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif t is str:
        ok = isinstance(value, str)
    elif t is dict:
        ok = isinstance(value, dict)
    elif t is list:
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    else:
        raise TypeError(f"schema type {t} at {path}")
    if not ok:
        raise ConfigError(f"{path}: expected {_type_name(t)} ({_range_text(meta, t)}), got "
                          f"{json.dumps(value)} ({type(value).__name__})")
    if meta["choices"] and value not in meta["choices"]:
        raise ConfigError(f"{path}: {value!r} is not allowed; use {_range_text(meta, t)}")
    if (meta["lo"] is not None and value < meta["lo"]) or (
            meta["hi"] is not None and value > meta["hi"]):
        raise ConfigError(f"{path}: {value} is out of range; allowed: {_range_text(meta, t)}")
    return value


def _unwrap_optional(t):
    if typing.get_origin(t) is typing.Union:
        args = [a for a in typing.get_args(t) if a is not type(None)]
        return args[0], True
    return t, False


# check-config's per-key report: (key, how zeroengine reads it), while collect_report() is open
_report: list[tuple[str, str]] | None = None


@contextlib.contextmanager
def collect_report():
    """Within the block, parsing records how each key of the config is read; yields the list
    of (key, verdict) rows: used as DeepSpeed means it / accepted, no effect here / refused."""
    global _report
    before, _report = _report, []
    try:
        yield _report
    finally:
        _report = before


def _say(key: str, verdict: str) -> None:
    if _report is not None:
        _report.append((key, verdict))


# paths of the keys the config itself sets to "auto", while parse_config reads it: a default of
# "auto" (zeroengine's own sizing) and a written "auto" (the HF integration's meaning) differ
_written_auto: list[str] | None = None


def parse_section(cls, raw, path: str):
    """A dataclass of ``option`` fields from a JSON object, every key and value checked; the
    engine's sections and the job's (tools/job_config.py) are read with it."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{path or 'config'}: expected an object, got {json.dumps(raw)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    spelling = {name: name for name in fields}  # any accepted spelling -> field name
    for name, f in fields.items():
        for alias in f.metadata.get("aliases", ()) + f.metadata.get("deprecated", ()):
            spelling[alias] = name
    values, given_as = {}, {}
    for key, value in raw.items():
        full = f"{path}.{key}" if path else key
        if key.startswith(COMMENT_PREFIX):
            continue
        if key not in spelling:
            _not_a_field(full, key, value, list(spelling), top_level=not path)
            continue
        name = spelling[key]
        if name in given_as:
            raise ConfigError(f"'{full}' and '{path + '.' if path else ''}{given_as[name]}' "
                              "are the same setting, given twice; keep one")
        given_as[name] = key
        meta = fields[name].metadata
        if key in meta.get("deprecated", ()):
            notice(full, f"deprecated by DeepSpeed; read as '{name}'")
        t, optional = _unwrap_optional(hints[name])
        if not dataclasses.is_dataclass(t):
            _say(full, f"accepted, no effect here: {meta['no_effect']}" if meta["no_effect"]
                 else "used" + ("" if key == name else f" (as {name})"))
        if value is None and optional:
            values[name] = None
        elif dataclasses.is_dataclass(t):
            values[name] = parse_section(t, value, f"{path}.{name}" if path else name)
        else:
            values[name] = _coerce(value, t, full, fields[name].metadata)
            if values[name] is AUTO and _written_auto is not None:  # under the schema's name
                _written_auto.append(f"{path}.{name}" if path else name)
    return cls(**values)


def _not_a_field(full: str, key: str, value, known: list[str], top_level: bool) -> None:
    """A key that is not in the schema: refused (a feature that would change results, or a
    typo), or accepted and reported once (a DeepSpeed knob with no effect here, or an unknown
    top-level key close to nothing, which DeepSpeed ignores too)."""
    if full in REFUSED:
        why, is_off = REFUSED[full]
        if is_off(value):
            _say(full, "accepted: the feature is off")
            return  # the feature's off value: nothing to implement
        _say(full, f"refused: {why}")
        raise ConfigError(f"'{full}': {why}; remove it from the config (or turn the feature "
                          "off)")
    if full in NO_EFFECT:
        notice(full, f"accepted, no effect in zeroengine: {NO_EFFECT[full]}")
        _say(full, f"accepted, no effect here: {NO_EFFECT[full]}")
        return
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    if close:
        raise ConfigError(f"unknown config key '{full}'; did you mean "
                          f"{' or '.join(repr(c) for c in close)}?")
    if top_level:
        notice(full, "unknown to zeroengine and ignored (DeepSpeed ignores unknown top-level "
               "keys too)")
        _say(full, "ignored: unknown top-level key")
        return
    raise ConfigError(f"unknown config key '{full}'; valid keys here: {', '.join(sorted(known))}")


def load_json(path: str | os.PathLike) -> dict:
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not valid JSON: {err.msg} at line {err.lineno}, "
                          f"column {err.colno}") from None


def config_dict(source, what: str = "config") -> dict:
    """A config given as a JSON path, a dict or None, as a dict of its own (the caller may
    change it: the user's dict is left alone). ``what`` names the argument in the error."""
    if isinstance(source, (str, os.PathLike)):
        raw = load_json(source)
    else:
        raw = copy.deepcopy(source) if source is not None else {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{what}: a JSON object (a path to one, or a dict), got "
                          f"{type(raw).__name__}")
    return raw


def _deprecated_offload(raw: dict) -> dict:
    """DeepSpeed's deprecated zero_optimization.cpu_offload / cpu_offload_param(s) /
    cpu_offload_use_pin_memory, read as DeepSpeed reads them: offload_optimizer / offload_param
    {"device": "cpu"} (and their pin_memory). A copy; the caller's dict is left alone."""
    zero = raw.get("zero_optimization")
    old = ("cpu_offload", "cpu_offload_param", "cpu_offload_params", "cpu_offload_use_pin_memory")
    if not isinstance(zero, dict) or not any(k in zero for k in old):
        return raw
    zero = dict(zero)
    pin = zero.pop("cpu_offload_use_pin_memory", None)
    for key, section in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param",
                                                                  "offload_param"),
                         ("cpu_offload_params", "offload_param")):
        if key not in zero:
            continue
        on = zero.pop(key)
        notice(f"zero_optimization.{key}", f"deprecated by DeepSpeed; read as "
               f"zero_optimization.{section}" + (' {"device": "cpu"}' if on is True else ""))
        if on is True:
            if section in zero:
                raise ConfigError(f"zero_optimization.{key} and zero_optimization.{section} "
                                  "both given; keep the second")
            zero[section] = {"device": "cpu", **({"pin_memory": pin} if pin is not None
                                                 else {})}
        elif on is not False:
            raise ConfigError(f"zero_optimization.{key}: expected a boolean, got "
                              f"{json.dumps(on)}")
    return {**raw, "zero_optimization": zero}


def parse_config(source: "str | os.PathLike | dict | Config") -> Config:
    """Validate a config given as a path to a JSON file, a dict, or an already-parsed Config."""
    if isinstance(source, Config):
        return source
    raw = load_json(source) if isinstance(source, (str, os.PathLike)) else source
    if not isinstance(raw, dict):
        raise ConfigError(f"a config must be a JSON object or dict, got {type(raw).__name__}")
    global _written_auto
    before, _written_auto = _written_auto, []
    try:
        cfg = parse_section(Config, _deprecated_offload(raw), "")
        cfg.written_auto = frozenset(_written_auto)  # read by resolve_auto
    finally:
        _written_auto = before
    if cfg.fp16.enabled is True and cfg.bf16.enabled is True:
        raise ConfigError("fp16.enabled and bf16.enabled are both true; enable at most one")
    zero = cfg.zero_optimization
    if zero.offload_optimizer.device != "none" and zero.stage == 0:
        raise ConfigError("zero_optimization.offload_optimizer needs stage 1, 2 or 3 (it offloads "
                          "the rank's shard of the optimizer state); set zero_optimization.stage "
                          "or offload_optimizer.device 'none'")
    if zero.offload_param.device != "none" and zero.stage != 3:
        # DeepSpeed reads offload_param at stage 3 only and ignores it below: so does zeroengine
        notice("zero_optimization.offload_param", f"no effect at stage {zero.stage}: only "
               "stage 3 shards (and so offloads) parameters; DeepSpeed ignores it too")
        zero.offload_param = OffloadParamConfig()
    if zero.offload_param.device == "nvme":
        if not zero.offload_param.nvme_path:
            raise ConfigError("zero_optimization.offload_param.device 'nvme' needs "
                              "offload_param.nvme_path: a directory on the drive to swap to")
    if zero.offload_optimizer.device == "nvme" and not zero.offload_optimizer.nvme_path:
        raise ConfigError("zero_optimization.offload_optimizer.device 'nvme' needs "
                          "offload_optimizer.nvme_path: a directory on the drive to swap to")
    if cfg.aio.block_size % 4096:
        raise ConfigError(f"aio.block_size must be a multiple of 4096 (O_DIRECT), got "
                          f"{cfg.aio.block_size}")
    return cfg


# -- resolution of batch sizes and 'auto' ----------------------------------------------------
def resolve_batch(cfg: Config, world_size: int) -> None:
    """Fill in the batch triple from any two (or one) of its members; refuse inconsistency.

    train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size
    """
    tbs, mbs, gas = (None if v == AUTO else v for v in (
        cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps))
    triple = (f"train_batch_size={tbs}, train_micro_batch_size_per_gpu={mbs}, "
              f"gradient_accumulation_steps={gas}, world size {world_size}")
    if tbs is not None and mbs is not None and gas is not None:
        if tbs != mbs * gas * world_size:
            raise ConfigError(f"inconsistent batch sizes: {triple}; train_batch_size must equal "
                              f"micro batch x accumulation steps x world size = "
                              f"{mbs * gas * world_size}")
    elif tbs is not None and mbs is not None:
        gas, rem = divmod(tbs, mbs * world_size)
        if rem or gas < 1:
            raise ConfigError(f"train_batch_size {tbs} is not a multiple of "
                              f"train_micro_batch_size_per_gpu x world size = {mbs * world_size}")
    elif tbs is not None:
        gas = gas or 1
        mbs, rem = divmod(tbs, gas * world_size)
        if rem or mbs < 1:
            raise ConfigError(f"train_batch_size {tbs} is not a multiple of "
                              f"gradient_accumulation_steps x world size = {gas * world_size}")
    else:
        gas = gas or 1
        tbs = mbs * gas * world_size if mbs is not None else None
    cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu = tbs, mbs
    cfg.gradient_accumulation_steps = gas


def auto_stage3_window(partitioned_numel: float, largest_segment_numel: float) -> int:
    """What "auto" means for stage3_prefetch_bucket_size and stage3_max_reuse_distance, in
    elements: an eighth of the partitioned model and at least two of its largest segments (the
    next module is then always on its way) - a few layers of a transformer, so the gathered part
    stays a fraction of the model at any size. The engine resolves it from the model it lays
    out (ParamFetcher), the scale model from the job it predicts."""
    return int(max(2 * largest_segment_numel, partitioned_numel // 8))


# Past this many elements a unit gains little from more grouping: a gloo all-gather's fixed
# cost (~0.3 ms) is then under 15% of its transfer (~2.3 ns an element), and larger transient
# segments cost resident memory (benchmarks/growth_bench.py, README "Many modules").
AUTO_FETCH_UNIT_MAX = 1_000_000


def auto_fetch_unit(partitioned_numel: int, bucket_numel: int) -> int:
    """What "auto" means for stage3_fetch_unit_size, in elements: a sixteenth of the
    partitioned model, at most AUTO_FETCH_UNIT_MAX and a gradient bucket (reduce_bucket_size;
    a segment never spans more). A deep model of small modules then makes one collective per
    ~1M elements rather than one per module; a model of large modules (a transformer's
    matrices past ~1M elements each) keeps a unit per module, as before grouping."""
    return int(min(bucket_numel, AUTO_FETCH_UNIT_MAX, partitioned_numel // 16))


def model_hidden_size(module) -> int | None:
    """The hidden size a Hugging Face model's config declares (hidden_size, the largest of
    hidden_sizes, or the same under text_config), as transformers' DeepSpeed integration reads
    it to fill in "auto" bucket sizes; None for a model without such a config."""
    config = getattr(module, "config", None)
    for source in (config, getattr(config, "text_config", None)):
        size = getattr(source, "hidden_size", None)
        if isinstance(size, int) and size > 0:
            return size
        sizes = getattr(source, "hidden_sizes", None)
        if isinstance(sizes, (list, tuple)) and sizes and all(isinstance(v, int) for v in sizes):
            return max(sizes)
    return None


def _resolve_bucket_autos(cfg: Config, hidden_size: int | None) -> None:
    """The bucket sizes a config sets to "auto": from the model's hidden size h as transformers
    fills them for DeepSpeed (reduce h*h; stage 3: prefetch 0.9*h*h, persistence 10*h), else
    zeroengine's own values. Each chosen value is said once."""
    zero = cfg.zero_optimization
    written = getattr(cfg, "written_auto", frozenset())
    stage3 = zero.stage == 3
    rules = {"reduce_bucket_size": (lambda h: h * h, "hidden_size^2"),
             "stage3_param_persistence_threshold": (lambda h: 10 * h, "10 x hidden_size"),
             "stage3_prefetch_bucket_size": (lambda h: int(0.9 * h * h), "0.9 x hidden_size^2")}
    defaults = ZeroConfig()
    for name, (rule, text) in rules.items():
        path = f"zero_optimization.{name}"
        if getattr(zero, name) != AUTO or (name == "stage3_prefetch_bucket_size"
                                           and path not in written):
            continue  # the prefetch default is "auto" too: the engine's window
        if not stage3 and name != "reduce_bucket_size":
            setattr(zero, name, getattr(defaults, name))  # a stage-3 key: unused below stage 3
            continue
        if hidden_size is not None:
            value = rule(hidden_size)
            why = f"{text} with the model's config.hidden_size {hidden_size}, as the Hugging " \
                  "Face DeepSpeed integration fills it"
        elif name == "stage3_prefetch_bucket_size":
            notice(path, "'auto': sized by the engine from the model it partitions (a window of "
                   "a few layers; the model has no config.hidden_size to size it from)")
            continue
        else:
            value = getattr(defaults, name)
            why = "zeroengine's default" + ("" if hidden_size is not None else
                                            " (the model has no config.hidden_size)")
        setattr(zero, name, value)
        notice(path, f"'auto' resolved to {value:,} ({why})")


def resolve_auto(cfg: Config, world_size: int, param_dtype_name: str | None = None,
                 hidden_size: int | None = None) -> Config:
    """Replace 'auto' values with what the engine knows; refuse the ones it cannot know.
    ``hidden_size``: the model's (model_hidden_size), which sizes "auto" buckets."""
    resolve_batch(cfg, world_size)
    if cfg.gradient_clipping == AUTO:
        cfg.gradient_clipping = 1.0
        notice("gradient_clipping", "'auto' resolved to 1.0, the Hugging Face Trainer's default "
               "max_grad_norm")
    if cfg.fp16.enabled == AUTO:
        cfg.fp16.enabled = param_dtype_name == "float16"
    if cfg.bf16.enabled == AUTO:
        cfg.bf16.enabled = param_dtype_name == "bfloat16"
    _resolve_bucket_autos(cfg, hidden_size)
    # what stays "auto" (stage3_prefetch_bucket_size and stage3_max_reuse_distance by default)
    # the engine sizes from the model it partitions
    return cfg


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
