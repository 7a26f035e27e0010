"""Weights written in the Hugging Face layout, a file at a time: ``model.safetensors``, or
``model-0000k-of-0000N.safetensors`` plus ``model.safetensors.index.json`` (``metadata.total_size``,
``weight_map``) when they need several files, as ``save_pretrained`` writes them and
``from_pretrained`` reads them.

``ShardedWriter`` takes tensors one by one and writes a file as soon as the next tensor would
overflow ``max_shard_size``, so what it holds is at most one output file; the files get their
``-of-N`` names once N is known (renamed at ``close``), and the index is written last: a
directory without its index (or ``model.safetensors``) is a write that did not finish.
"""
from __future__ import annotations

import os
import re

import torch

from ..format import fsync_dir, fsync_file, write_json_atomic

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
_OURS = re.compile(r"model-\d{5}-of-\d{5}\.safetensors|\.part-\d{5}\.safetensors")
_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


def parse_size(size) -> int:
    """Bytes in ``size``: an int, or "5GB" (10^9, as transformers reads it), "500MiB" (2^20)."""
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"max_shard_size={size}: must be positive")
        return size
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(size))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"max_shard_size={size!r}: give bytes as an int or a size such as "
                         "'5GB', '500MB' or '2GiB'")
    return int(float(match.group(1)) * _UNITS[unit])


def parse_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if str(dtype).lower() not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: one of {', '.join(sorted(DTYPES))}")
    return DTYPES[str(dtype).lower()]


def file_names(count: int) -> list[str]:
    """The names of ``count`` weight files, as save_pretrained names them."""
    return [SINGLE] if count == 1 else \
        [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]


def write_index(out_dir: str, total_size: int, weight_map: dict[str, str]) -> str:
    """``model.safetensors.index.json`` (written atomically, last: it names finished files)."""
    index = os.path.join(out_dir, INDEX)
    write_json_atomic(index, {"metadata": {"total_size": total_size}, "weight_map": weight_map})
    return index


def owning(value: torch.Tensor) -> torch.Tensor:
    """``value`` as a tensor owning its whole storage: safetensors writes a tensor's storage
    whole, so a view (a slice, a tied or transposed weight) gets its own copy."""
    if not value.is_contiguous() or value.storage_offset() != 0 or \
            value.untyped_storage().nbytes() != value.numel() * value.element_size():
        value = value.contiguous().clone()
    return value


class ShardedWriter:
    """Tensors in, Hugging Face layout out, at most one output file held."""

    def __init__(self, out_dir: str, max_shard_size="5GB", metadata: dict | None = None):
        self.out_dir = out_dir
        self.limit = parse_size(max_shard_size)
        self.metadata = {"format": "pt", **(metadata or {})}
        os.makedirs(out_dir, exist_ok=True)
        for stale in os.listdir(out_dir):  # an earlier export here is replaced, not mixed
            if stale in (INDEX, SINGLE) or _OURS.fullmatch(stale):
                os.remove(os.path.join(out_dir, stale))
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._parts: list[tuple[str, list[str]]] = []  # (temporary file, its keys)
        self.total_size = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.limit:
            self._flush()
        self._pending[name] = owning(tensor.detach().to("cpu"))
        self._pending_bytes += nbytes
        self.total_size += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file
        part = os.path.join(self.out_dir, f".part-{len(self._parts):05d}.safetensors")
        save_file(self._pending, part, metadata=self.metadata)
        fsync_file(part)  # on the disk before the index names it
        self._parts.append((part, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Write what is left, name the files, write the index; returns the files written."""
        if self._pending or not self._parts:
            self._flush()
        names = file_names(len(self._parts))
        weight_map, written = {}, []
        for name, (part, keys) in zip(names, self._parts):
            os.replace(part, os.path.join(self.out_dir, name))
            weight_map.update({key: name for key in keys})
            written.append(os.path.join(self.out_dir, name))
        if len(names) > 1:
            written.append(write_index(self.out_dir, self.total_size, weight_map))
        else:
            fsync_dir(self.out_dir)  # the rename to model.safetensors is on the disk too
        return written
