"""The zero_optimization section: what is sharded, how gradients and parameters travel, and
the offload of optimizer state and parameters (with the aio section NVMe offload reads)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from .fields import AUTO, Auto, option


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
    reduce_bucket_size: Union[int, Auto] = option(
        5_000_000, "Elements per gradient bucket (one reduce-scatter / all-reduce each). Smaller "
        "buckets start communicating earlier in backward and, at stage 2, bound the gradient "
        "memory in flight (two buckets); larger ones make fewer calls. 0: every parameter a "
        "bucket of its own. \"auto\": hidden_size^2 for a model whose config declares a "
        "hidden_size (as transformers fills it for DeepSpeed), else the default.", lo=0)
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
    stage3_prefetch_bucket_size: Union[int, Auto] = option(
        AUTO, "Stage 3: most elements gathered ahead of their use. \"auto\": sized from the "
        "model - an eighth of the partitioned elements, at least two of its largest segments "
        "(a few layers' worth) - so that stage 3 holds a window of the model, not all of it. "
        "(DeepSpeed's default, 50,000,000, gathers the whole of any smaller model.) Written "
        "as \"auto\" in the config for a model whose config declares a hidden_size: 0.9 x "
        "hidden_size^2, as transformers fills it for DeepSpeed.", lo=0,
        aliases=("prefetch_bucket_size",))
    stage3_param_persistence_threshold: Union[int, Auto] = option(
        100_000, "Stage 3: parameters with fewer elements stay whole on every rank. \"auto\": "
        "10 x hidden_size for a model whose config declares one, else the default.", lo=0,
        aliases=("param_persistence_threshold",))
    stage3_check_gather_order: bool = option(
        True, "Stage 3: beside each parameter all-gather the ranks exchange what they gather and "
        "why (4 integers, asynchronously, on a host-side gloo group), and compare before the "
        "gathered values are used. Ranks that run different code (evaluation or generate() on "
        "rank 0 only, a branch taken on one rank, experts run on some ranks) then fail at once "
        "with an error saying what each rank was doing, instead of a collective size mismatch, "
        "a hang, or - when the sizes happen to agree - silently mixed parameters. The start of "
        "every forward is checked regardless. false: skip the per-gather exchange.")
    mics_shard_size: Union[int, Auto] = option(
        -1, "Hybrid sharding (stages 1-3): shard the model states over groups of this many "
        "ranks and replicate them across the groups. Gradients are reduce-scattered inside a "
        "group and only each rank's 1/K shard is all-reduced across groups; parameters are "
        "gathered inside the group. With a group per node, inter-node traffic drops to 1/K "
        "of plain ZeRO's, for K/N more memory per rank (docs/hybrid.md). -1: one group of all "
        "ranks (plain ZeRO). \"auto\": the ranks of one node (the launcher's "
        "LOCAL_WORLD_SIZE). DeepSpeed's MiCS key.", lo=-1)
    zero_hpz_partition_size: Union[int, Auto] = option(
        1, "Stage 3 (ZeRO++ hpZ): keep a secondary copy of the parameters sharded over the "
        "ranks of one node (this many): after a segment's first all-gather in a step, the "
        "backward's and later micro-steps' gathers of it stay inside the node. Costs 1/K of "
        "the parameters per rank. 1: off. \"auto\": the ranks of one node.", lo=0)
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
    stage3_fetch_unit_size: Union[int, Auto] = option(
        AUTO, "Stage 3: consecutive modules (in registration order) are grouped into fetch "
        "units of up to this many elements; a unit is gathered with one all-gather and its "
        "gradient reduce-scattered as one bucket, so a deep model of small modules makes a few "
        "large collectives instead of a latency-bound one per module (FSDP2 groups a "
        "fully_shard unit the same way). A module larger than this is a unit of its own. "
        "0: one unit per module. \"auto\": a sixteenth of the partitioned elements, at most "
        "1,000,000 and reduce_bucket_size (measured in benchmarks/growth_bench.py).",
        lo=0)
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
    stage3_max_reuse_distance: Union[int, Auto] = option(
        AUTO, "Stage 3: a segment released after its module's forward is kept instead if the "
        "backward uses it again within this many gathered elements (along the order recorded "
        "in the first step), as long as stage3_max_live_parameters allows: the last layers of "
        "a forward stay gathered for the start of backward instead of being gathered again. "
        "\"auto\": the prefetch window. 0: release every segment after its use. (DeepSpeed's "
        "default, 1,000,000,000, keeps the whole of any smaller model gathered from forward to "
        "backward.)", lo=0, aliases=("max_reuse_distance",))
    stage3_gather_16bit_weights_on_model_save: bool = option(
        False, "Stage 3: let engine.save_16bit_model() gather the sharded weights and write "
        "them (without it, it writes nothing at stage 3, as in DeepSpeed).",
        aliases=("gather_16bit_weights_on_model_save",),
        deprecated=("stage3_gather_fp16_weights_on_model_save",))
