"""NVMe offload's parts, built from the config: the rank's swap directory, the asynchronous
file I/O engine, the optimizer's swap (master and state) and stage 3's parameter swap."""
from __future__ import annotations

import os

from ...config import Config, ConfigError
from ...ops.aio import AsyncFileIO
from .optimizer_swap import OptimizerSwap
from .param_swap import ParamSwap
from .swap_files import SwapDir


def swap_dir(section: str, nvme_path: str, rank: int):
    """This rank's swap directory under ``nvme_path`` (offload_<section>.nvme_path)."""
    if not os.path.isdir(nvme_path):  # a typo must not swap to another drive
        raise ConfigError(f"zero_optimization.{section}.nvme_path {nvme_path!r} is not a "
                          f"directory on rank {rank}; create it on the drive to "
                          "swap to (every rank needs its own or a shared one)")
    return SwapDir(nvme_path, rank)


def file_io(config: Config):
    """An asynchronous I/O engine (the engine makes one, shared by both swaps)."""
    aio = config.aio
    return AsyncFileIO(aio.block_size, aio.queue_depth, aio.thread_count)


def optimizer_swap(config: Config, rank: int, io, pin: bool):
    """NVMe offload of the optimizer: master and state in swap files under nvme_path."""
    off = config.zero_optimization.offload_optimizer
    return OptimizerSwap(swap_dir("offload_optimizer", off.nvme_path, rank), io,
                         pipeline_read=off.pipeline_read, pipeline_write=off.pipeline_write,
                         pin=pin)


def param_swap(config: Config, rank: int, io, pin: bool):
    """NVMe offload of stage-3 parameters: the shard in swap files, a cache of max_in_cpu
    elements in memory, buffer_count x buffer_size elements read ahead."""
    off = config.zero_optimization.offload_param
    return ParamSwap(swap_dir("offload_param", off.nvme_path, rank), io,
                     max_in_cpu=off.max_in_cpu,
                     read_ahead_numel=off.buffer_count * off.buffer_size, pin=pin)
