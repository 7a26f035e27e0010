"""The on-disk checkpoint format: files, checksums, atomic directory swaps and the map from a
parameter's elements to the rank files that hold them. No engine and no process group here, so
``zeroengine consolidate`` can read a checkpoint with nothing but this module.

A checkpoint is a directory ``<save_dir>/<tag>/``:
  meta.json              written last by rank 0: layout of every flat group (per parameter: name,
                         shape, flat offset; per segment: start, length, shard offset), counters,
                         loss scaler, optimizer hyperparameters and scalar state, the size and
                         CRC-32 of every other file (checkpoints before async saves: sha256),
                         and a sha256 of itself
  rank00003.safetensors  rank 3's shards: "<group>.master" (fp32 values of the elements it owns)
                         and "<group>.state.<key>" (elementwise optimizer state, same elements)
  rank00003.pt           rank 3's RNG states; rank 0's also holds the lr scheduler, module buffers
                         and frozen parameters, and the user's client_state (torch.save, loaded
                         with weights_only=True: nothing pickled is ever executed)
``<save_dir>/latest`` names the newest tag and is replaced last, atomically.

Where an element lives: a parameter occupies [offset, offset + numel) of its group's flat buffer,
inside one segment; a segment of length L is split into W equal chunks, chunk r (rank r's) at
``shard_offset`` of rank r's shard. ``locate`` turns a flat range into (rank, shard offset)
pieces; resharding is reading those pieces for every element the new layout gives a rank.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
import zlib
from dataclasses import dataclass

import torch

from ..errors import CheckpointError
from .direct_file import SequentialFile, pwrite_all
from .weights.weight_files import DTYPES as SAFETENSORS_DTYPES
from .weights.weight_files import WeightFiles, WeightsError, read_header

FORMAT_VERSION = 1
META = "meta.json"
LATEST = "latest"


def rank_file(rank: int, ext: str) -> str:
    return f"rank{rank:05d}.{ext}"


# -- writing -------------------------------------------------------------------------------------
def fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_fd(fd: int) -> None:
    os.fsync(fd)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# The checksum every file of a checkpoint carries: CRC-32 (zlib's, ~2 GB/s here and the GIL
# released) detects the truncations and flipped bytes it is for; sha256 (~1 GB/s) made the
# background write of an asynchronous save cost the training loop twice the CPU. Checkpoints
# written before carry sha256 and still verify (meta.json's "checksum" names the kind).
CHECKSUM = "crc32"


class Checksum:
    """An incremental checksum of ``kind`` ("crc32" or "sha256")."""

    def __init__(self, kind: str = CHECKSUM):
        if kind not in ("crc32", "sha256"):
            raise CheckpointError(f"unknown checksum kind {kind!r} in {META}")
        self._sha = hashlib.sha256() if kind == "sha256" else None
        self._crc = 0

    def update(self, data) -> None:
        if self._sha is not None:
            self._sha.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def hexdigest(self) -> str:
        return self._sha.hexdigest() if self._sha is not None else f"{self._crc:08x}"


def file_checksum(path: str, kind: str = CHECKSUM) -> str:
    digest = Checksum(kind)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def write_text_atomic(path: str, text: str) -> None:
    """Write to a temporary name, fsync, rename: readers see the old file or the new one."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_json_atomic(path: str, payload: dict) -> None:
    write_text_atomic(path, json.dumps(payload, indent=1, sort_keys=True))


def seal(meta: dict) -> dict:
    """meta with a checksum over its own canonical JSON, checked by ``read_meta``."""
    body = json.dumps(meta, sort_keys=True).encode()
    return {**meta, "meta_sha256": hashlib.sha256(body).hexdigest()}


def publish_dir(tmp_dir: str, final_dir: str) -> None:
    """Move a complete, fsynced checkpoint directory into place. Replacing an existing tag keeps
    the old one as ``<tag>.old`` until the new one is in place (``resolve`` falls back to it)."""
    parent = os.path.dirname(os.path.abspath(final_dir))
    old = final_dir + ".old"
    if os.path.exists(final_dir):
        if os.path.exists(old):
            shutil.rmtree(old)
        os.replace(final_dir, old)
    os.replace(tmp_dir, final_dir)
    fsync_dir(parent)
    if os.path.exists(old):
        shutil.rmtree(old)


# -- reading -------------------------------------------------------------------------------------
def resolve(load_dir: str, tag: str | None, missing_ok: bool = False) -> str | None:
    """The checkpoint directory for ``tag`` (None: what ``latest`` names). With ``missing_ok``,
    None where nothing was saved yet (no directory, or no ``latest`` in it); otherwise that, a
    missing directory or a missing tag raise."""
    if not os.path.isdir(load_dir):
        if missing_ok and tag is None:
            return None
        raise CheckpointError(f"checkpoint directory {load_dir} does not exist")
    if tag is None:
        latest = os.path.join(load_dir, LATEST)
        if not os.path.exists(latest):
            if missing_ok:
                return None
            raise CheckpointError(f"{latest} does not exist: no checkpoint was completed there "
                                  "(name one with tag=, or pass missing_ok=True to start fresh)")
        with open(latest) as f:
            tag = f.read().strip()
        if not tag:
            raise CheckpointError(f"{latest} is empty; pass tag= explicitly")
    path = os.path.join(load_dir, tag)
    if not os.path.isdir(path) and os.path.isdir(path + ".old"):
        path += ".old"  # a save replacing this tag died between its two renames
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist (tag {tag!r})")
    return path


def read_meta(ckpt_dir: str) -> dict:
    path = os.path.join(ckpt_dir, META)
    try:
        with open(path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: {ckpt_dir} is not a complete zeroengine "
                              "checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is corrupt (not valid JSON: {err})") from None
    if not isinstance(meta, dict) or "meta_sha256" not in meta:
        raise CheckpointError(f"{path} is not zeroengine checkpoint metadata")
    claimed = meta.pop("meta_sha256")
    actual = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()
    if claimed != actual:
        raise CheckpointError(f"{path} is corrupt: its checksum does not match its contents")
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path} has checkpoint format {meta.get('format')!r}; this "
                              f"zeroengine reads format {FORMAT_VERSION}")
    return meta


def verify(ckpt_dir: str, name: str, meta: dict) -> str:
    """Path of a checkpoint file whose size and checksum match what meta.json recorded."""
    path = os.path.join(ckpt_dir, name)
    expected = meta["files"].get(name)
    if expected is None:
        raise CheckpointError(f"{path} is not listed in {META}")
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing")
    size = meta.get("file_bytes", {}).get(name)
    if size is not None and os.path.getsize(path) != size:
        raise CheckpointError(f"{path} is corrupt: {os.path.getsize(path)} bytes where {META} "
                              f"recorded {size} (a truncated or partial copy?)")
    kind = meta.get("checksum", "sha256")
    if file_checksum(path, kind) != expected:
        raise CheckpointError(f"{path} is corrupt or was modified: its {kind} does not match "
                              f"{META} (truncated copy or altered bytes?)")
    return path


def load_extras(path: str) -> dict:
    """A rank's .pt file, without executing any pickled code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - weights_only's refusals
        raise CheckpointError(f"{path} could not be loaded safely (weights_only=True refused "
                              f"it: {type(err).__name__}: {str(err).splitlines()[0]})") from None


@dataclass(frozen=True)
class Piece:
    rank: int  # which rank's file
    shard_offset: int  # where in that rank's shard tensor
    numel: int
    out_offset: int  # where in the requested range


def locate(group: dict, flat_begin: int, numel: int) -> list[Piece]:
    """Split the flat range [flat_begin, flat_begin + numel) of a saved group (which lies in one
    segment, as every parameter does) into per-rank pieces of the saved shards."""
    world = group["shard_world"]
    for start, length, shard_offset in group["segments"]:  # noqa: B007 - the found one, below
        if start <= flat_begin < start + length:
            break
    else:
        raise CheckpointError(f"flat offset {flat_begin} is outside every saved segment")
    if flat_begin + numel > start + length:
        raise CheckpointError("a parameter spans two saved segments; metadata is inconsistent")
    chunk = length // world
    pieces, done = [], 0
    while done < numel:
        local = flat_begin + done - start
        rank, within = divmod(local, chunk)
        n = min(chunk - within, numel - done)
        pieces.append(Piece(rank, shard_offset + within, n, done))
        done += n
    return pieces


def safetensors_head(specs: list[tuple[str, torch.dtype, int | tuple]],
                     metadata: dict[str, str] | None = None) -> tuple[bytes, dict, int]:
    """(the file's first bytes - length and JSON header -, {name: (data offset, itemsize,
    dtype)}, bytes of data) of a safetensors file of ``specs``, in their order."""
    header, where, end = {}, {}, 0
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape in specs:
        shape = [shape] if isinstance(shape, int) else list(shape)
        numel = math.prod(shape)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        header[name] = {"dtype": StreamedSafetensors._DTYPES[dtype], "shape": shape,
                        "data_offsets": [end, end + numel * itemsize]}
        where[name] = (end, itemsize, dtype)
        end += numel * itemsize
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text, where, end


def tensor_bytes(values: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The bytes of ``values`` (in ``dtype``), on the host, as a flat uint8 tensor."""
    return values.detach().to("cpu", dtype or values.dtype).contiguous().reshape(-1) \
        .view(torch.uint8)


class StreamedSafetensors:
    """A safetensors file written in place a range at a time: the header (every tensor's name,
    dtype and length) first, then each range where it belongs, so no tensor has to be whole in
    memory (NVMe offload saves a rank's master and state a tile at a time). Ranges never
    written read as zeros."""

    _DTYPES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}

    def __init__(self, path: str, specs: list[tuple[str, torch.dtype, int | tuple]],
                 metadata: dict[str, str] | None = None, checksum: str | None = None):
        """``specs``: (name, dtype, numel or shape) of every tensor (a numel: 1-D);
        ``metadata``: the header's ``__metadata__`` (transformers wants {"format": "pt"});
        ``checksum``: a kind to compute while writing (``digest()``)."""
        head, self._where, end = safetensors_head(specs, metadata)
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._start = len(head)
        self._end = self._start + end
        # written front to back (every whole save), the file's checksum is computed on the way
        # instead of reading the file back; any other order falls back to reading it
        self._hash = Checksum(checksum) if checksum else None
        self._next = 0
        try:
            self._pwrite(memoryview(head), 0)
            os.ftruncate(self._fd, self._end)
        except BaseException:
            os.close(self._fd)
            raise

    def _pwrite(self, data: memoryview, at: int) -> None:
        if self._hash is not None and at == self._next:
            self._hash.update(data)
            self._next += len(data)
        elif len(data):
            self._hash = None
        pwrite_all(self._fd, data, at)

    def write(self, name: str, element_offset: int, values: torch.Tensor) -> None:
        begin, itemsize, dtype = self._where[name]
        self._pwrite(memoryview(tensor_bytes(values, dtype).numpy()),
                     self._start + begin + element_offset * itemsize)

    def digest(self) -> str | None:
        """The file's checksum when every byte was written in order, else None."""
        if self._hash is None or self._next != self._end:
            return None
        return self._hash.hexdigest()

    def close(self) -> None:
        os.close(self._fd)


def _named(path: str, err: OSError) -> CheckpointError:
    """An OSError while writing ``path`` (disk full, file-size limit) as a CheckpointError
    naming the file."""
    return CheckpointError(f"writing {path}: {os.strerror(err.errno) if err.errno else err}"
                           f" (errno {err.errno})")


def write_streamed(path: str, specs: list, fill) -> str:
    """A safetensors file of ``specs`` (as StreamedSafetensors takes them) whose values
    ``fill(writer)`` writes, fsynced; returns its checksum (computed while writing when
    ``fill`` writes front to back, else read back)."""
    try:
        writer = StreamedSafetensors(path, specs, checksum=CHECKSUM)
        try:
            fill(writer)
            fsync_fd(writer._fd)
        finally:
            writer.close()
    except OSError as err:
        raise _named(path, err) from None
    return writer.digest() or file_checksum(path)


def write_safetensors(path: str, tensors: dict[str, torch.Tensor]) -> str:
    """``tensors`` as a safetensors file at ``path`` (in dict order), written front to back
    around the page cache where the filesystem allows (direct_file.py: the least CPU, which a
    save in the background takes from training) and fsynced; returns its checksum."""
    head, _, _ = safetensors_head([(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()])
    digest = Checksum()
    try:
        out = SequentialFile(path)
        try:
            digest.update(head)
            out.write(head)
            for t in tensors.values():
                data = tensor_bytes(t)
                digest.update(memoryview(data.numpy()))  # zlib lets go of the GIL
                out.write(data)
            out.finish()
            fsync_fd(out.fileno())
        finally:
            out.close()
    except OSError as err:
        raise _named(path, err) from None
    return digest.hexdigest()


def write_bytes(path: str, data: bytes) -> str:
    """``data`` as the file ``path`` (fsynced); its checksum. OSError as for
    write_safetensors."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view, done = memoryview(data), 0
            while done < len(view):
                done += os.write(fd, view[done:])
            fsync_fd(fd)
        finally:
            os.close(fd)
    except OSError as err:
        raise _named(path, err) from None
    digest = Checksum()
    digest.update(data)
    return digest.hexdigest()


class ShardReader:
    """Reads ranges of the saved shards, opening (and verifying) each rank file once. Reads go
    through ``WeightFiles`` (pread of exact element ranges) rather than a memory map, so reading
    a model a tensor at a time does not leave the rank files' pages counted in this process's
    resident set: ``consolidate``'s peak stays about one output file plus one tensor."""

    def __init__(self, ckpt_dir: str, meta: dict):
        self.dir = ckpt_dir
        self.meta = meta
        self._open: dict[int, object] = {}

    def _file(self, rank: int):
        files = self._open.get(rank)
        if files is None:
            path = verify(self.dir, rank_file(rank, "safetensors"), self.meta)
            try:
                files = WeightFiles(path, read_header(path))
            except WeightsError as err:
                raise CheckpointError(f"{path} is not a readable safetensors file: "
                                      f"{err}") from None
            self._open[rank] = files
        return files

    def _checked(self, rank: int, name: str):
        files = self._file(rank)
        if name not in files:
            path = os.path.join(self.dir, rank_file(rank, "safetensors"))
            raise CheckpointError(f"{path} has no tensor {name!r}")
        return files

    def read(self, group_index: int, key: str, flat_begin: int, numel: int,
             out: torch.Tensor) -> None:
        """Fill ``out`` (numel elements) with saved ``key`` ("master" or "state.<name>") values
        of flat range [flat_begin, +numel) of saved group ``group_index``."""
        group = self.meta["groups"][group_index]
        name = f"{group_index}.{key}"
        for piece in locate(group, flat_begin, numel):
            files = self._checked(piece.rank, name)
            target = out[piece.out_offset:piece.out_offset + piece.numel]
            if target.device.type == "cpu" and target.is_contiguous():
                files.read(name, piece.shard_offset, target)  # straight into place
            else:
                staged = torch.empty(piece.numel, dtype=target.dtype)
                target.copy_(files.read(name, piece.shard_offset, staged))

    def verify_range(self, group_index: int, key: str, flat_begin: int, numel: int) -> None:
        """Open (checking its checksum) every rank file ``read`` of this range would read, and
        that it holds the tensor: a load's first phase, where the values are read later."""
        group = self.meta["groups"][group_index]
        for piece in locate(group, flat_begin, numel):
            self._checked(piece.rank, f"{group_index}.{key}")

    def tensors_with_prefix(self, rank: int, prefix: str) -> dict[str, torch.Tensor]:
        """Every tensor of ``rank``'s file whose name starts with ``prefix``, by the rest of
        its name (tensor-wise optimizer state: one parameter's keys)."""
        files = self._file(rank)
        return {n[len(prefix):]: files.read_full(n) for n in sorted(files.entries)
                if n.startswith(prefix)}

    def full_parameter(self, name: str, key: str = "master") -> torch.Tensor:
        """One parameter's whole saved value (fp32), by name."""
        gi, entry = self.meta["index"][name]
        group = self.meta["groups"][gi]
        _, shape, offset = group["params"][entry]
        numel = 1
        for s in shape:
            numel *= s
        out = torch.empty(numel, dtype=torch.float32)
        self.read(gi, key, offset, numel, out)
        return out.view(shape)
