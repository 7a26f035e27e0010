"""A checkpoint's full model, from its files alone (``zeroengine consolidate``): every name of
model.state_dict() in fp32, a tensor at a time, kept as a dict or written in the Hugging Face
layout. Reads zeroengine's, DeepSpeed's and DCP's checkpoints alike (sources.py)."""
from __future__ import annotations

import os

import torch

from ..errors import CheckpointError
from .sources import open_checkpoint
from .weights.hf_layout import ShardedWriter


def iter_consolidated(checkpoint):
    """(name, fp32 value) for every name of model.state_dict() a checkpoint holds (tied
    parameters under each of their names), from the files alone, one tensor at a time (each
    a tensor of its own). ``checkpoint``: a directory (zeroengine's, DeepSpeed's or DCP's) or
    what ``sources.open_checkpoint`` opened."""
    source = open_checkpoint(checkpoint) if isinstance(checkpoint, (str, os.PathLike)) \
        else checkpoint
    rest = source.extras(0).get("module_rest", {})
    for key, canonical in source.meta["state_dict_keys"].items():
        if canonical is not None:
            yield key, source.reader.full_parameter(canonical)
        elif key in rest:
            value = rest[key]
            yield key, value.float() if value.is_floating_point() else value
        else:
            raise CheckpointError(f"{source.dir} lacks the module entry {key!r} (neither a "
                                  "trained parameter nor a saved buffer or frozen one)")


def consolidated_state_dict(checkpoint) -> dict[str, torch.Tensor]:
    """The full fp32 model state dict a checkpoint holds (``iter_consolidated``, kept)."""
    return dict(iter_consolidated(checkpoint))


def write_consolidated(checkpoint, out_dir: str, max_shard_size="5GB",
                       dtype: torch.dtype | None = None) -> list[str]:
    """``consolidated_state_dict`` written in the Hugging Face layout a tensor at a time (peak:
    about one output file plus one tensor, whatever the model's size). Every name of
    model.state_dict() is written, tied parameters under each of theirs (a plain
    load_state_dict(strict=True) accepts the result; from_pretrained ties them again).
    ``dtype``: floating-point tensors cast to it (default: fp32 as saved)."""
    writer = ShardedWriter(out_dir, max_shard_size)
    for key, value in iter_consolidated(checkpoint):
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        writer.add(key, value)
    return writer.close()
