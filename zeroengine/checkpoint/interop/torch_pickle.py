"""Files written by ``torch.save`` (what DeepSpeed's checkpoints are), read without executing
anything they pickle and without loading their tensors whole.

``torch.save`` writes a zip archive: ``<name>/data.pkl`` (the object tree, pickled, with each
tensor's storage a persistent reference to ``<name>/data/<key>``) and one uncompressed member
per storage. ``load_lazy`` unpickles the tree with an allowlist - containers, the few torch
functions that rebuild tensors, and whatever stand-ins the caller names for foreign record
classes (DeepSpeed's ``LossScaler``, ``fragment_address``) - and gives every tensor as a
``LazyTensor``: its dtype and shape, and ``read(begin, out)`` of an element range by ``pread``
at the storage's offset in the archive. So a reader takes from a multi-gigabyte optimizer
file only the elements it needs, and a pickle naming anything else (``os.system``, a class of
a library not installed) is refused by name, as ``torch.load(weights_only=True)`` refuses it.
"""
from __future__ import annotations

import collections
import math
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass

import torch

from ...errors import UnsafeOrUnreadable

_STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64,
    "HalfStorage": torch.float16, "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64, "IntStorage": torch.int32, "ShortStorage": torch.int16,
    "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
}
# torch dtypes by the name a pickle gives them ("float32"), for allowlists
DTYPE_NAMES = {str(d).split(".")[-1]: d for d in _STORAGE_DTYPES.values()}


@dataclass(frozen=True)
class _Storage:
    member: str  # the zip member holding its bytes
    dtype: torch.dtype
    numel: int


class LazyTensor:
    """A tensor of a torch.save archive, not yet read: dtype, shape and ranged reads."""

    def __init__(self, archive: "_Archive", storage: _Storage, offset: int, shape, stride):
        self._archive = archive
        self._storage = storage
        self._offset = offset
        self.dtype = storage.dtype
        self.shape = tuple(int(s) for s in shape)
        contiguous = []
        step = 1
        for size in reversed(self.shape):
            contiguous.append(step)
            step *= size
        if self.numel > 1 and tuple(stride) != tuple(reversed(contiguous)):
            # DeepSpeed saves flat fp32 partitions and contiguous state; a strided view would
            # need a gather this reader does not do
            raise UnsafeOrUnreadable(f"{archive.path}: a tensor of shape {list(self.shape)} is "
                                     f"saved as a strided view (stride {list(stride)})")
        if offset + self.numel > storage.numel:
            raise UnsafeOrUnreadable(f"{archive.path}: a tensor runs past its storage (a "
                                     "damaged file)")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def read(self, begin: int, out: torch.Tensor) -> torch.Tensor:
        """Elements ``[begin, begin + out.numel())`` of the flattened tensor into ``out`` (a
        contiguous CPU tensor; cast to its dtype)."""
        n = out.numel()
        if begin < 0 or begin + n > self.numel:
            raise IndexError(f"elements {begin}-{begin + n} of {self.numel}")
        target = out if out.dtype == self.dtype else torch.empty(n, dtype=self.dtype)
        itemsize = target.element_size()
        self._archive.pread(self._storage.member, (self._offset + begin) * itemsize,
                            target.view(torch.uint8).reshape(-1))
        if target is not out:
            out.copy_(target.view(out.shape))
        return out

    def load(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor."""
        out = torch.empty(self.numel, dtype=dtype or self.dtype)
        return self.read(0, out).view(self.shape)

    def __repr__(self) -> str:
        return f"LazyTensor({list(self.shape)}, {self.dtype})"


class _Window:
    """Bytes [base, base + length) of a file as a seekable file of their own (a torch.save
    archive inside a torch.distributed.checkpoint .distcp file)."""

    def __init__(self, path: str, base: int, length: int):
        self._f = open(path, "rb")
        self._base, self._length, self._at = base, length, 0

    def seek(self, offset: int, whence: int = 0) -> int:
        self._at = {0: offset, 1: self._at + offset, 2: self._length + offset}[whence]
        return self._at

    def tell(self) -> int:
        return self._at

    def read(self, n: int = -1) -> bytes:
        n = self._length - self._at if n is None or n < 0 else min(n, self._length - self._at)
        self._f.seek(self._base + self._at)
        data = self._f.read(max(n, 0))
        self._at += len(data)
        return data

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        self._f.close()


class _Archive:
    """The zip members of one torch.save file (or of one archive at ``base``, ``length``
    bytes long, inside a larger file), read by pread at their data offsets."""

    def __init__(self, path: str, base: int = 0, length: int | None = None):
        self.path = path
        self._fd = None
        size = os.path.getsize(path)
        length = size - base if length is None else length
        if base + length > size:
            raise UnsafeOrUnreadable(f"{path}: bytes {base}-{base + length} lie past its end "
                                     f"({size} bytes; a truncated copy)")
        window = _Window(path, base, length)
        try:
            with zipfile.ZipFile(window) as z:
                infos = z.infolist()
        except (zipfile.BadZipFile, OSError, ValueError) as err:
            raise UnsafeOrUnreadable(
                f"{path}: not a torch.save zip archive ({err}); files saved with "
                "_use_new_zipfile_serialization=False are not read") from None
        finally:
            window.close()
        self._fd = os.open(path, os.O_RDONLY)
        self._base = base
        self._size = base + length
        self._members = {}
        for info in infos:
            self._members[info.filename] = info
        pkl = [n for n in self._members if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pkl) != 1:
            raise UnsafeOrUnreadable(f"{path}: a zip archive without one data.pkl: not written "
                                     "by torch.save")
        self.prefix = pkl[0][:-len("data.pkl")]
        self._where: dict[str, tuple[int, int]] = {}
        for member in self._members:  # every member whole on disk, or refused now
            self._span(member)

    def _span(self, member: str) -> tuple[int, int]:
        """(offset of the member's data in the file, its length)."""
        span = self._where.get(member)
        if span is None:
            info = self._members.get(member)
            if info is None:
                raise UnsafeOrUnreadable(f"{self.path}: storage {member!r} is missing (a "
                                         "truncated or damaged file)")
            if info.compress_type != zipfile.ZIP_STORED:
                raise UnsafeOrUnreadable(f"{self.path}: {member!r} is compressed; torch.save "
                                         "stores tensors uncompressed")
            header = os.pread(self._fd, 30, self._base + info.header_offset)
            if len(header) < 30 or header[:4] != b"PK\x03\x04":
                raise UnsafeOrUnreadable(f"{self.path}: damaged zip entry for {member!r}")
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            start = self._base + info.header_offset + 30 + name_len + extra_len
            if start + info.file_size > self._size:
                raise UnsafeOrUnreadable(f"{self.path}: {member!r} runs past the end of the "
                                         "file (a truncated copy)")
            span = self._where[member] = (start, info.file_size)
        return span

    def pread(self, member: str, byte_offset: int, out: torch.Tensor) -> None:
        start, length = self._span(member)
        view = memoryview(out.numpy())
        if byte_offset + len(view) > length:
            raise UnsafeOrUnreadable(f"{self.path}: read past the end of {member!r}")
        done = 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], start + byte_offset + done)
            if got <= 0:
                raise UnsafeOrUnreadable(f"{self.path}: {member!r} ends early")
            done += got

    def read_member(self, member: str) -> bytes:
        start, length = self._span(member)
        data = os.pread(self._fd, length, start)
        if len(data) != length:
            raise UnsafeOrUnreadable(f"{self.path}: {member!r} ends early")
        return data

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - best effort while closing
            pass


class _TensorType:
    """Stands for torch.Tensor / nn.Parameter where a pickle names the type of a tensor."""


def _rebuild_tensor(archive):
    def rebuild(storage, storage_offset, size, stride, requires_grad=False, hooks=None,
                metadata=None):
        if not isinstance(storage, _Storage):
            raise UnsafeOrUnreadable(f"{archive.path}: a tensor without a storage")
        return LazyTensor(archive, storage, int(storage_offset), size, stride)
    return rebuild


def _rebuild_parameter(data, requires_grad=False, hooks=None, state=None):
    return data


def _rebuild_from_type(func, new_type, args, state):
    return func(*args)


def _latin1(text: str, encoding: str = "latin1") -> bytes:
    if encoding not in ("latin1", "latin-1"):
        raise UnsafeOrUnreadable(f"bytes pickled through encoding {encoding!r}")
    return text.encode("latin1")


class AllowlistUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the (module, name) pairs of ``allowed`` (to the objects
    given there) and refuses any other global by name: nothing a file names is imported."""

    def __init__(self, file, path: str, allowed: dict):
        super().__init__(file)
        self.path = path
        self.allowed = allowed

    def find_class(self, module: str, name: str):
        found = self.allowed.get((module, name))
        if found is None:
            raise UnsafeOrUnreadable(
                f"{self.path} pickles {module}.{name}, which zeroengine does not execute or "
                "import when reading a checkpoint (only tensors, containers and known record "
                "types are read)")
        return found


class _Unpickler(AllowlistUnpickler):
    def __init__(self, file, archive: _Archive, records: dict):
        self._archive = archive
        rebuild = _rebuild_tensor(archive)
        super().__init__(file, archive.path, {
            ("collections", "OrderedDict"): collections.OrderedDict,
            ("builtins", "set"): set, ("builtins", "frozenset"): frozenset,
            ("builtins", "slice"): slice, ("builtins", "complex"): complex,
            ("torch._utils", "_rebuild_tensor_v2"): rebuild,
            ("torch._utils", "_rebuild_tensor"): lambda s, o, size, stride: rebuild(s, o, size,
                                                                                    stride),
            ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
            ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
            ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
            ("_codecs", "encode"): _latin1,  # how protocol 2 pickles bytes
            ("torch", "Size"): tuple, ("torch", "Tensor"): _TensorType,
            ("torch.nn.parameter", "Parameter"): _TensorType,
            ("torch", "device"): str,
            **{("torch", name): name for name in _STORAGE_DTYPES},
            **{("torch", name): dtype for name, dtype in DTYPE_NAMES.items()},
            **records,
        })

    def persistent_load(self, saved_id):
        if not (isinstance(saved_id, tuple) and saved_id and saved_id[0] == "storage"):
            raise UnsafeOrUnreadable(f"{self._archive.path}: unknown persistent reference "
                                     f"{saved_id!r:.80}")
        _, storage_type, key, _location, numel = saved_id
        if isinstance(storage_type, torch.dtype):  # torch >= 2.0 writes the dtype itself
            dtype = storage_type
        else:
            dtype = _STORAGE_DTYPES.get(storage_type)
        if dtype is None:
            raise UnsafeOrUnreadable(f"{self._archive.path}: storage of type "
                                     f"{storage_type!r} is not read")
        return _Storage(f"{self._archive.prefix}data/{key}", dtype, int(numel))


def load_lazy(path: str, records: dict[tuple[str, str], object] | None = None,
              base: int = 0, length: int | None = None):
    """The object tree a torch.save file holds (or the archive at ``base`` of it), tensors as
    ``LazyTensor``. ``records``: (module, name) -> stand-in, for foreign classes the caller
    accepts as plain records."""
    import io
    archive = _Archive(path, base, length)
    try:
        data = archive.read_member(archive.prefix + "data.pkl")
        return _Unpickler(io.BytesIO(data), archive, records or {}).load()
    except UnsafeOrUnreadable:
        raise
    except Exception as err:  # noqa: BLE001 - a damaged pickle stream
        raise UnsafeOrUnreadable(f"{path}: its pickled contents are unreadable "
                                 f"({type(err).__name__}: {err})") from None


class Record:
    """A foreign class's instance kept as its attributes (``record.cur_scale``), nothing run."""

    def __init__(self, *args, **kwargs):
        self.args = args
        self.__dict__.update(kwargs)

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"Record({self.__dict__})"


def materialize(tree):
    """``tree`` with every LazyTensor read whole (for small entries: counters, buffers)."""
    if isinstance(tree, LazyTensor):
        return tree.load()
    if isinstance(tree, dict):
        return type(tree)((k, materialize(v)) for k, v in tree.items()) \
            if isinstance(tree, collections.OrderedDict) else \
            {k: materialize(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [materialize(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(materialize(v) for v in tree)
    return tree
