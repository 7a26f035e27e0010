"""``deepspeed.comm``: DeepSpeed's names for torch.distributed, over the group zeroengine joins.

Everything here is torch.distributed itself (no logging layer): the same tensors, groups and
async handles. With no process group (a single process without a launcher) the queries answer
rank 0 of 1 and the collectives leave their tensors as they are, as a group of one would."""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ._missing import missing

ReduceOp = dist.ReduceOp


def is_available() -> bool:
    return dist.is_available()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True,
                     timeout: timedelta = timedelta(minutes=30), init_method=None,
                     dist_init_required: bool | None = None, config=None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Join the process group from the launcher's environment (torchrun, ``zeroengine
    launch``, SLURM, MPI, PyTorchJob: zeroengine.init_distributed reads them all). A backend
    other than the one zeroengine picks for the device (NCCL on CUDA, gloo on CPU) is refused
    by name rather than ignored."""
    from ..distributed.bootstrap import init_distributed as join
    if dist_init_required is False or is_initialized():
        return
    if dist_backend is not None:
        # DeepSpeed's CPU accelerator names oneCCL ("ccl") and falls back to gloo, as we do
        usable = ("nccl",) if torch.cuda.is_available() else ("gloo", "ccl")
        if dist_backend.lower() not in usable:
            raise ValueError(f"init_distributed(dist_backend={dist_backend!r}): zeroengine uses "
                             f"{usable[0]!r} on this machine; drop the argument")
    if rank >= 0 and world_size > 0:  # given here instead of by the launcher
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world_size))
    if "RANK" in os.environ:
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    join(timeout_s=timeout.total_seconds())


def get_rank(group=None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group=None, group_rank: int = 0) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def get_world_group():
    return dist.group.WORLD


def new_group(ranks):
    return dist.new_group(ranks)


def barrier(group=None, async_op: bool = False, device_ids=None):
    if is_initialized():
        return dist.barrier(group=group, async_op=async_op)
    return None


def _one(fn):
    """A collective that leaves its tensor as it is in a single process without a group."""

    def call(*args, **kwargs):
        if not is_initialized():
            return None
        return fn(*args, **kwargs)

    call.__name__, call.__doc__ = fn.__name__, fn.__doc__
    return call


all_reduce = _one(dist.all_reduce)
broadcast = _one(dist.broadcast)
reduce = _one(dist.reduce)
all_to_all_single = _one(dist.all_to_all_single)
send = _one(dist.send)
recv = _one(dist.recv)
isend = _one(dist.isend)
irecv = _one(dist.irecv)
broadcast_object_list = _one(dist.broadcast_object_list)


def all_gather(tensor_list, tensor, group=None, async_op: bool = False):
    if not is_initialized():
        tensor_list[0].copy_(tensor)
        return None
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_object(object_list, obj, group=None):
    if not is_initialized():
        object_list[0] = obj
        return None
    return dist.all_gather_object(object_list, obj, group=group)


def all_gather_into_tensor(output_tensor, tensor, group=None, async_op: bool = False):
    if not is_initialized():
        output_tensor.copy_(tensor.reshape(output_tensor.shape))
        return None
    return dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor, tensor, op=ReduceOp.SUM, group=None,
                          async_op: bool = False):
    if not is_initialized():
        output_tensor.copy_(tensor.reshape(output_tensor.shape))
        return None
    return dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group,
                                      async_op=async_op)


def log_summary(show_straggler: bool = False, return_dict: bool = False):
    """DeepSpeed's comms logger summary: zeroengine keeps per-kind byte counts on the engine
    instead (``engine.comm_report()``)."""
    return {} if return_dict else None


def configure(*args, **kwargs) -> None:
    """DeepSpeed's comms-logger settings: no logger to configure (engine.comm_report())."""


_NEAREST = {
    "mpi_discovery": "zeroengine reads OpenMPI's environment itself (init_distributed)",
    "initialize_mesh_device": "zeroengine is data-parallel only: no device mesh",
    "inference_all_reduce": "use all_reduce",
}


def __getattr__(name: str):
    raise missing("deepspeed.comm", name, _NEAREST, [n for n in globals() if n[0] != "_"])
