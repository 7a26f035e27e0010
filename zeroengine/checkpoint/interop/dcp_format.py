"""torch.distributed.checkpoint (DCP) directories - what FSDP2 and torchtitan save - read as
zeroengine reads its own checkpoints.

A DCP directory holds ``.metadata`` (a pickled ``Metadata``: for every flattened key its
global shape and dtype and the chunks - offsets and sizes per dimension - it was saved in; where
each chunk lies, file, offset and length; and ``planner_data``, the nesting path each key came
from) and ``__<rank>_<n>.distcp`` files, each a run of ``torch.save`` archives, one per chunk
or non-tensor value. The usual state dicts are

  {"model": model_sd, "optim": get_optimizer_state_dict(...)}  (FSDP2's recipes; any two
                                                               names, nested deeper or not)
  model keys at the top level, the optimizer under "optimizer"   (torchtitan)

so keys are classified by their path: ``(*P, "state", fqn, key)`` (or ``"state.fqn.key"``) is
optimizer state, ``(*P, "param_groups", i, key)`` hyperparameters, and the model's entries are
the tensors one level under the most common remaining prefix. ``.metadata`` is read with an
allowlisted unpickler and the chunks with ``torch_pickle``: nothing pickled runs, and a rank
reads only the chunk elements it owns. Chunks must be contiguous in the tensor's flat order
(whole rows, as FSDP2 shards dim 0); a layout sharded on another dimension (tensor
parallelism) is refused by name.
"""
from __future__ import annotations

import bisect
import collections
import io
import math
import os
from collections.abc import Mapping

import torch

from ..format import CheckpointError
from .torch_pickle import (
    DTYPE_NAMES,
    AllowlistUnpickler,
    Record,
    UnsafeOrUnreadable,
    load_lazy,
    materialize,
)

METADATA = ".metadata"
ZEROENGINE_KEY = "zeroengine"  # our counters, scheduler and client_state, when we wrote it
_DCP = "torch.distributed.checkpoint.metadata"



def is_dcp_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA))


class _TensorProperties(Record):
    """DCP pickles TensorProperties as a tuple: (dtype, layout, requires_grad, memory
    format, pin_memory)."""

    def __setstate__(self, state):
        if isinstance(state, tuple):
            self.dtype = state[0]
        else:
            super().__setstate__(state)


def _metadata_allowlist() -> dict:
    """DCP's metadata classes as plain records; anything else is refused by name."""
    records = {(_DCP, n): Record for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "MetadataIndex", "StorageMeta")}
    return {
        **records,
        (_DCP, "TensorProperties"): _TensorProperties,
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): Record,
        (_DCP, "_MEM_FORMAT_ENCODING"): int,
        ("torch.serialization", "_get_layout"): str,
        ("pathlib", "PosixPath"): lambda *parts: os.path.join(*parts) if parts else "",
        ("pathlib", "WindowsPath"): lambda *parts: "\\".join(parts),
        ("torch", "Size"): tuple,
        ("collections", "OrderedDict"): collections.OrderedDict,
        **{("torch", name): dtype for name, dtype in DTYPE_NAMES.items()},
    }


def _read_metadata(path: str) -> Record:
    file = os.path.join(path, METADATA)
    try:
        with open(file, "rb") as f:
            metadata = AllowlistUnpickler(io.BytesIO(f.read()), file,
                                          _metadata_allowlist()).load()
    except UnsafeOrUnreadable as err:
        raise CheckpointError(str(err)) from None
    except Exception as err:  # noqa: BLE001 - raised again as a named error
        raise CheckpointError(f"{file} is not readable DCP metadata ({type(err).__name__}: "
                              f"{err}): a truncated or damaged file") from None
    if not isinstance(metadata, Record) or not hasattr(metadata, "state_dict_metadata"):
        raise CheckpointError(f"{file} is not torch.distributed.checkpoint metadata")
    return metadata


class _Chunk:
    """One saved chunk of a tensor: the flat element range it covers and where it lies."""

    def __init__(self, begin: int, numel: int, file: str, offset: int, length: int):
        self.begin, self.numel = begin, numel
        self.file, self.offset, self.length = file, offset, length


def _flat_range(path: str, fqn: str, shape, offsets, sizes) -> tuple[int, int]:
    """The flat [begin, begin + numel) a rectangular chunk covers. It is one range in row-major
    order when, past its first dimension of more than one element, it spans every dimension
    whole (FSDP2's row shards are); otherwise (tensor-parallel column shards) refused."""
    shape, offsets, sizes = list(shape), list(offsets), list(sizes)
    numel = math.prod(sizes)
    first = next((d for d, size in enumerate(sizes) if size != 1), len(sizes))
    if any(sizes[d] != shape[d] for d in range(first + 1, len(shape))):
        raise CheckpointError(f"{path}: {fqn!r} is saved in chunks of {sizes} of {shape}, "
                              "not whole rows (a tensor-parallel layout): zeroengine reads "
                              "layouts sharded on dimension 0 only")
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    return sum(o * s for o, s in zip(offsets, strides)), numel


class DcpCheckpoint:
    """One DCP directory as zeroengine checkpoint metadata + reader."""

    def __init__(self, path: str):
        self.dir = path
        md = _read_metadata(path)
        self._entries = md.state_dict_metadata
        planner = getattr(md, "planner_data", None) or {}
        chunks: dict[str, list[_Chunk]] = {}
        self._bytes: dict[str, tuple[str, int, int]] = {}
        for index, info in (md.storage_data or {}).items():
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(f"{path}: {index.fqn!r} was saved through storage "
                                      f"transforms {info.transform_descriptors} (compression "
                                      "or encryption extensions), which zeroengine does not read")
            file = os.path.join(path, info.relative_path)
            meta = self._entries.get(index.fqn)
            if meta is None:
                raise CheckpointError(f"{path}/{METADATA} places {index.fqn!r} in a file but "
                                      "does not describe it: damaged metadata")
            if not hasattr(meta, "chunks"):
                self._bytes[index.fqn] = (file, int(info.offset), int(info.length))
                continue
            chunk = next((c for c in meta.chunks if tuple(c.offsets) == tuple(index.offset)),
                         None)
            if chunk is None:
                raise CheckpointError(f"{path}/{METADATA}: no chunk of {index.fqn!r} at "
                                      f"{list(index.offset)}: damaged metadata")
            begin, numel = _flat_range(path, index.fqn, meta.size, chunk.offsets, chunk.sizes)
            chunks.setdefault(index.fqn, []).append(
                _Chunk(begin, numel, file, int(info.offset), int(info.length)))
        for fqn, found in chunks.items():
            found.sort(key=lambda c: c.begin)
            total = math.prod(self._entries[fqn].size)
            covered = sum(c.numel for c in found)
            if covered < total:
                raise CheckpointError(f"{path}: the files hold {covered} of {fqn!r}'s {total} "
                                      "elements: a rank's .distcp file is missing from the "
                                      "metadata or the save did not finish")
        self._chunks = chunks
        self._archives: dict = {}
        for fqn, found in chunks.items():  # every file there, and long enough
            for c in found:
                if not os.path.isfile(c.file):
                    raise CheckpointError(f"{c.file} is missing (it holds {fqn!r})")
                if c.offset + c.length > os.path.getsize(c.file):
                    raise CheckpointError(f"{c.file} is shorter than {METADATA} says (a "
                                          f"truncated copy; {fqn!r} runs past its end)")
        self._classify({fqn: tuple(planner.get(fqn) or (fqn,)) for fqn in self._entries})
        # what save_checkpoint(format="dcp") adds: counters, scheduler, client_state
        self._ours = self._read_ours() if ZEROENGINE_KEY in self._bytes else {}
        self.meta = self._meta()

    # -- which key is what -------------------------------------------------------------------------
    def _classify(self, paths: dict[str, tuple]) -> None:
        self.state: dict[str, dict[str, str]] = {}  # param fqn -> state key -> DCP key
        groups: dict[int, dict[str, str]] = {}  # group index -> hyperparameter -> DCP key
        rest: dict[str, tuple] = {}
        for fqn, p in paths.items():
            if "state" in p[:-2] and p.index("state") == len(p) - 3:
                self.state.setdefault(str(p[-2]), {})[str(p[-1])] = fqn
            elif isinstance(p[-1], str) and p[-1].startswith("state.") and len(p) > 1:
                param, _, key = p[-1][len("state."):].rpartition(".")
                self.state.setdefault(param, {})[key] = fqn
            elif "param_groups" in p[:-2] and p.index("param_groups") == len(p) - 3:
                groups.setdefault(int(p[-2]), {})[str(p[-1])] = fqn
            elif isinstance(p[-1], str) and p[-1].startswith("param_groups."):
                groups.setdefault(0, {}).setdefault(p[-1].rpartition(".")[2], fqn)
            elif p == (ZEROENGINE_KEY,):
                pass
            elif fqn in self._chunks:
                rest[fqn] = p
        prefixes = collections.Counter(p[:-1] for p in rest.values())
        prefix = prefixes.most_common(1)[0][0] if prefixes else ()
        self.prefix = prefix
        self.model = {str(p[-1]): fqn for fqn, p in rest.items() if p[:-1] == prefix}
        self._groups = [groups[i] for i in sorted(groups)]

    def _value(self, fqn: str):
        """A non-tensor entry (torch.save'd bytes), read without running anything."""
        file, offset, length = self._bytes[fqn]
        try:
            return materialize(load_lazy(file, None, offset, length))
        except UnsafeOrUnreadable as err:
            raise CheckpointError(str(err)) from None

    def _read_ours(self) -> dict:
        blob = self._value(ZEROENGINE_KEY)
        try:
            return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - raised again as a named error
            raise CheckpointError(f"{self.dir}: its {ZEROENGINE_KEY!r} entry could not be "
                                  f"loaded safely ({type(err).__name__}: {err})") from None

    def _meta(self) -> dict:
        params, offset, index, keys = [], 0, {}, {}
        for entry, (name, fqn) in enumerate(self.model.items()):
            shape = list(self._entries[fqn].size)
            params.append([name, shape, offset])
            index[name] = [0, entry]
            offset += math.prod(shape)
            dtype = self._entries[fqn].properties.dtype
            keys[name] = name if dtype.is_floating_point else None
        state_keys = sorted({k for s in self.state.values() for k, fqn in s.items()
                             if fqn in self._chunks and math.prod(self._entries[fqn].size) > 1})
        steps = [self._full(s["step"]).item() for s in self.state.values() if "step" in s]
        step = max(steps) if steps else None
        groups_hp = [{k: self._value(fqn) for k, fqn in g.items() if k != "params"}
                     for g in self._groups]
        kind = "Adam" if {"exp_avg", "exp_avg_sq"} <= set(state_keys) else "+".join(state_keys)
        steps_done = int(step or 0)
        return {
            "format": "dcp", "tag": os.path.basename(os.path.normpath(self.dir)),
            "global_steps": steps_done, "micro_steps": steps_done, "skipped_steps": 0,
            "optimizer_steps": steps_done, "loss_scaler": None,
            **self._ours.get("meta", {}),
            "optimizer": None if not self.state else {
                "class": kind, "inner_class": kind, "param_groups": groups_hp},
            "groups": [{"params": params, "state_keys": state_keys,
                        "scalar_state": {} if step is None else {"step": float(step)}}],
            "index": index, "state_dict_keys": keys, "files": {}, "hf_config": None,
        }

    def _full(self, fqn: str, dtype=None) -> torch.Tensor:
        shape = tuple(self._entries[fqn].size)
        out = torch.empty(math.prod(shape), dtype=dtype or self._entries[fqn].properties.dtype)
        self._read_fqn(fqn, 0, out)
        return out.view(shape)

    def _archive_tensor(self, chunk: _Chunk):
        key = (chunk.file, chunk.offset)
        found = self._archives.get(key)
        if found is None:
            try:
                found = load_lazy(chunk.file, None, chunk.offset, chunk.length)
            except UnsafeOrUnreadable as err:
                raise CheckpointError(str(err)) from None
            if not hasattr(found, "read") or found.numel != chunk.numel:
                raise CheckpointError(f"{chunk.file} at byte {chunk.offset} does not hold the "
                                      f"{chunk.numel}-element chunk {METADATA} describes")
            self._archives[key] = found
        return found

    def _read_fqn(self, fqn: str, begin: int, out: torch.Tensor) -> None:
        chunks = self._chunks[fqn]
        starts = [c.begin for c in chunks]
        done, n = 0, out.numel()
        while done < n:
            at = begin + done
            k = bisect.bisect_right(starts, at) - 1
            chunk = chunks[k]
            take = min(n - done, chunk.begin + chunk.numel - at)
            self._archive_tensor(chunk).read(at - chunk.begin, out[done:done + take])
            done += take

    # -- ShardReader's methods ---------------------------------------------------------------------
    @property
    def reader(self):
        return self

    def read(self, group_index: int, key: str, flat_begin: int, numel: int,
             out: torch.Tensor) -> None:
        params = self.meta["groups"][group_index]["params"]
        entry = bisect.bisect_right([p[2] for p in params], flat_begin) - 1
        name, _, offset = params[entry]
        if key == "master":
            fqn = self.model[name]
        else:
            fqn = self.state.get(name, {}).get(key[len("state."):])
            if fqn is None:  # a parameter the optimizer never stepped: no state yet
                out.zero_()
                return
        if out.is_contiguous():
            self._read_fqn(fqn, flat_begin - offset, out)
        else:
            staged = torch.empty(numel, dtype=out.dtype)
            self._read_fqn(fqn, flat_begin - offset, staged)
            out.copy_(staged)

    def full_parameter(self, name: str, key: str = "master") -> torch.Tensor:
        return self._full(self.model[name], torch.float32)

    def extras(self, rank: int) -> dict:
        ours = self._ours
        return {"module_rest": _LazyEntries(self), "client_state": ours.get("client_state"),
                **({"lr_scheduler": ours["lr_scheduler"]} if "lr_scheduler" in ours else {})}


class _LazyEntries(Mapping):
    """The model's entries by name, each read when asked for (buffers, frozen parameters)."""

    def __init__(self, source: DcpCheckpoint):
        self._source = source

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._source._full(self._source.model[name])

    def __contains__(self, name) -> bool:  # without reading it
        return name in self._source.model

    def __iter__(self):
        return iter(self._source.model)

    def __len__(self) -> int:
        return len(self._source.model)
