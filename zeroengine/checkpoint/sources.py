"""Which kind of checkpoint a directory holds, opened behind one interface.

``open_checkpoint(path)`` gives ``meta`` (zeroengine's checkpoint metadata: parameter groups,
state keys, counters, optimizer hyperparameters), ``reader`` (``read`` of a flat element range,
``full_parameter``) and ``extras(rank)`` (module entries outside the flat groups, the lr
scheduler, client_state, RNG states) for zeroengine's own checkpoints, DeepSpeed's ZeRO ones
and torch.distributed.checkpoint (FSDP2, torchtitan) directories alike, so loading and
consolidation are written once.
"""
from __future__ import annotations

import os

from . import format as fmt
from .interop.dcp_format import DcpCheckpoint, is_dcp_checkpoint
from .interop.deepspeed_format import DeepSpeedCheckpoint, is_deepspeed_checkpoint


class ZeroengineCheckpoint:
    def __init__(self, path: str):
        self.dir = path
        self.meta = fmt.read_meta(path)
        self.reader = fmt.ShardReader(path, self.meta)

    def extras(self, rank: int) -> dict:
        name = fmt.rank_file(rank, "pt")
        if name not in self.meta["files"]:
            return {}
        return fmt.load_extras(fmt.verify(self.dir, name, self.meta))


def open_checkpoint(path: str):
    """The checkpoint in directory ``path`` (one tag), whichever writer made it."""
    if os.path.exists(os.path.join(path, fmt.META)):
        return ZeroengineCheckpoint(path)
    if is_deepspeed_checkpoint(path):
        return DeepSpeedCheckpoint(path)
    if is_dcp_checkpoint(path):
        return DcpCheckpoint(path)
    return ZeroengineCheckpoint(path)  # raises naming the missing meta.json


def is_checkpoint(path: str) -> bool:
    """Whether ``path`` is one checkpoint (a tag directory) rather than a save_dir."""
    return (os.path.exists(os.path.join(path, fmt.META)) or is_deepspeed_checkpoint(path)
            or is_dcp_checkpoint(path))
