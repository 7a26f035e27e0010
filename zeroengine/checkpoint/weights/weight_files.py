"""Model weights in safetensors files, read a byte range at a time: a stage-3 rank reads from
disk only the elements of each tensor it will own, straight into its shard.

``WeightFiles.open(path)`` takes what users have on disk: one ``*.safetensors`` file, a
directory holding ``model.safetensors`` (``save_pretrained``, ``zeroengine consolidate``), or a
sharded one (``model.safetensors.index.json`` naming a file per key). Only the files' JSON
headers are read when opening; values are read by ``read`` (a flat element range of one tensor,
exactly its bytes, through ``os.preadv`` into the destination's memory where the dtypes agree).

The safetensors format is small enough to read directly (8-byte little-endian header length,
a JSON header ``{key: {"dtype", "shape", "data_offsets": [begin, end]}}``, then the data):
doing so gives exact byte ranges inside a tensor, which the safetensors library's slicing (by
whole rows) does not.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import torch

from ...errors import WeightsError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_MAX_HEADER = 100 * 1024 * 1024  # the format's own limit

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
          "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)


@dataclass(frozen=True)
class TensorEntry:
    key: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the tensor's data in ``file``

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def check_shape(self, shape, owner: str) -> None:
        """Refuse to load this tensor into ``owner`` (e.g. "LlamaForCausalLM's 'lm_head.weight'")
        of another shape, naming both."""
        if tuple(self.shape) != tuple(shape):
            raise WeightsError(
                f"{self.file}: {self.key!r} has shape {list(self.shape)} but {owner} has shape "
                f"{list(shape)}: the checkpoint is for another configuration of the model "
                "(check the config the model was built from)")


def read_header(file: str) -> dict[str, TensorEntry]:
    """The tensors one safetensors file holds (its header only), checked against its size."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise WeightsError(f"{file}: not a safetensors file (shorter than its 8-byte header "
                               "length)")
        (length,) = struct.unpack("<Q", raw)
        if length > min(_MAX_HEADER, size - 8):
            raise WeightsError(f"{file}: not a safetensors file (header length {length} "
                               f"does not fit the file's {size} bytes)")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise WeightsError(f"{file}: not a safetensors file (its header is not JSON: "
                               f"{e})") from None
    base = 8 + length
    entries = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        dtype = DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise WeightsError(f"{file}: tensor {key!r} has dtype {info.get('dtype')!r}, which "
                               f"zeroengine does not read (known: {', '.join(DTYPES)})")
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(x) for x in info["data_offsets"])
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if end - begin != math.prod(shape) * itemsize or base + end > size:
            raise WeightsError(f"{file}: tensor {key!r} (shape {list(shape)}, {dtype}) does "
                               f"not match its byte range {begin}-{end} of a {size}-byte file "
                               "(a truncated or damaged file)")
        entries[key] = TensorEntry(key, file, dtype, shape, base + begin)
    return entries


class WeightFiles:
    """Every tensor a checkpoint holds, by key, and exact reads of element ranges of them."""

    def __init__(self, path: str, entries: dict[str, TensorEntry]):
        self.path = path
        self.entries = entries
        self._fds: dict[str, int] = {}
        self.bytes_read = 0  # tensor bytes read so far (what the load benchmark reports)

    @classmethod
    def open(cls, path: str) -> "WeightFiles":
        path = os.fspath(path)
        if os.path.isfile(path):
            return cls(path, read_header(path))
        if not os.path.isdir(path):
            raise WeightsError(f"weights={path!r}: no such file or directory (give a "
                               "*.safetensors file or a directory holding model.safetensors "
                               f"or {INDEX})")
        index = os.path.join(path, INDEX)
        if os.path.isfile(index):
            return cls(path, _indexed(path, index))
        single = os.path.join(path, SINGLE)
        if os.path.isfile(single):
            return cls(path, read_header(single))
        found = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        if len(found) == 1:
            return cls(path, read_header(os.path.join(path, found[0])))
        raise WeightsError(
            f"weights={path!r}: the directory holds neither {SINGLE} nor {INDEX}"
            + (f" (it has {len(found)} *.safetensors files and no index naming which key is "
               "in which)" if found else " nor any *.safetensors file")
            + "; PyTorch .bin checkpoints are not read: save with safetensors")

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def entry(self, key: str) -> TensorEntry:
        return self.entries[key]

    def read(self, key: str, begin: int, out: torch.Tensor) -> torch.Tensor:
        """Elements ``[begin, begin + out.numel())`` of the flattened tensor ``key`` into the
        contiguous CPU tensor ``out`` (cast to its dtype), reading only their bytes."""
        e = self.entries[key]
        n = out.numel()
        if begin < 0 or begin + n > e.numel:
            raise IndexError(f"{key}: elements {begin}-{begin + n} of {e.numel}")
        target = out if out.dtype == e.dtype else torch.empty(n, dtype=e.dtype)
        if n:
            fd = self._fd(e.file)
            itemsize = target.element_size()
            view = memoryview(target.view(torch.uint8).reshape(-1).numpy())
            done = 0
            while done < len(view):  # preadv may return short on large reads
                got = os.preadv(fd, [view[done:]], e.offset + begin * itemsize + done)
                if got <= 0:
                    raise WeightsError(f"{e.file}: {key!r} ends early (the file was cut "
                                       "short while reading)")
                done += got
            self.bytes_read += done
        if target is not out:
            out.copy_(target.view(out.shape))
        return out

    def read_full(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        e = self.entries[key]
        out = torch.empty(e.numel, dtype=dtype or e.dtype)
        return self.read(key, 0, out).view(e.shape)

    def _fd(self, file: str) -> int:
        fd = self._fds.get(file)
        if fd is None:
            fd = self._fds[file] = os.open(file, os.O_RDONLY)
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - best effort while closing
            pass


def _indexed(path: str, index: str) -> dict[str, TensorEntry]:
    with open(index) as f:
        try:
            weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise WeightsError(f"{index}: not a safetensors index (no 'weight_map': "
                               f"{e})") from None
    entries: dict[str, TensorEntry] = {}
    headers: dict[str, dict[str, TensorEntry]] = {}
    for key, name in weight_map.items():
        file = os.path.join(path, name)
        if name not in headers:
            if not os.path.isfile(file):
                raise WeightsError(f"{index} names {name!r} (for {key!r}), which {path} "
                                   "lacks: copy the missing shard file into the directory")
            headers[name] = read_header(file)
        if key not in headers[name]:
            raise WeightsError(f"{index} puts {key!r} in {name!r}, which does not hold it")
        entries[key] = headers[name][key]
    return entries
