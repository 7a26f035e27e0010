"""One rank's part of a checkpoint save, in two halves: ``capture`` takes everything the rank
writes from the engine at the call (tensors, RNG states, counters, rank 0's metadata), and
``Snapshot.write`` writes, fsyncs and commits it without touching the engine again, so an
asynchronous save can write it from a background thread while training goes on.

The write follows the commit protocol (commit.py) in three rounds, each ending in one report
from every rank: (1) the ``<tag>.tmp`` directory exists and every rank names the same tag;
(2) every rank's files are written and fsynced, with their sizes and checksums; (3) rank 0 wrote
meta.json,
renamed the directory into place and replaced ``latest`` (node-local saves: every rank
published its own directory). A failure in any round raises the same CheckpointError on every
rank, after the failed save's files are removed; ``latest`` is only replaced in round 3, so it
still names the previous checkpoint.
"""
from __future__ import annotations

import copy
import io
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import format as fmt
from .commit import agree, attempt
from .format import CheckpointError
from .staging import StagingPool


@dataclass
class Snapshot:
    save_dir: str
    tag: str
    rank: int
    node_local: bool
    save_latest: bool
    tensors: dict[str, torch.Tensor]  # this rank's safetensors file, in file order
    extras: dict  # this rank's .pt file (torch.save, read back with weights_only=True)
    meta: dict | None  # rank 0: meta.json without "files"
    # NVMe offload (synchronous only): writes the master and state a tile at a time
    stream: Callable | None = None
    stream_specs: list = field(default_factory=list)

    @property
    def final(self) -> str:
        return os.path.join(self.save_dir, self.tag)

    @property
    def tmp(self) -> str:
        return self.final + ".tmp"

    @property
    def owns_dir(self) -> bool:
        """Whether this rank makes, publishes (or removes) the directory."""
        return self.rank == 0 or self.node_local

    # -- the three rounds -----------------------------------------------------------------
    def write(self, comm) -> str:
        """Collective (over ``comm``, the checkpoint group): write, fsync and publish this
        rank's part; the checkpoint's path, or the same CheckpointError on every rank."""
        action = f"save_checkpoint of {self.final}"
        left = "nothing of it was kept; 'latest' names the checkpoint it named before"
        _, err = attempt(self._make_dir)
        try:
            tags = agree(comm, action, err, self.tag, left)
            if len(set(tags)) > 1:
                given = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags))
                raise CheckpointError(f"{action}: the ranks passed different tags ({given}); "
                                      "pass the same tag on every rank (or none: "
                                      "global_step<N>)")
            digests, err = attempt(self._write_files)
            rows = agree(comm, action, err, digests, left)
            _, err = attempt(self._publish, rows)
            agree(comm, action, err, outcome=left)
        except CheckpointError:
            self._remove_tmp()
            raise
        return self.final

    def _make_dir(self) -> None:
        if not self.owns_dir:
            return
        os.makedirs(self.save_dir, exist_ok=True)
        if os.path.exists(self.tmp):  # left by a save that died
            shutil.rmtree(self.tmp)
        os.makedirs(self.tmp)

    def _write_files(self) -> list[list]:
        """[[checksum, size]] of this rank's .safetensors and .pt files."""
        st_path = os.path.join(self.tmp, fmt.rank_file(self.rank, "safetensors"))
        if self.stream is not None:
            st_digest = fmt.write_streamed(st_path, self.stream_specs, self.stream)
        else:
            st_digest = fmt.write_safetensors(st_path, self.tensors)
        buffer = io.BytesIO()
        torch.save(self.extras, buffer)
        pt_digest = fmt.write_bytes(os.path.join(self.tmp, fmt.rank_file(self.rank, "pt")),
                                    buffer.getbuffer())
        return [[st_digest, os.path.getsize(st_path)], [pt_digest, len(buffer.getbuffer())]]

    def _publish(self, digests: list[list[str]]) -> None:
        if self.rank == 0:
            files, sizes = {}, {}
            for rank, written in enumerate(digests):
                for ext, (digest, size) in zip(("safetensors", "pt"), written):
                    files[fmt.rank_file(rank, ext)] = digest
                    sizes[fmt.rank_file(rank, ext)] = size
            fmt.write_json_atomic(os.path.join(self.tmp, fmt.META), fmt.seal(
                {**self.meta, "files": files, "file_bytes": sizes, "checksum": fmt.CHECKSUM}))
        if self.owns_dir:
            fmt.fsync_dir(self.tmp)
            replaced = os.path.exists(self.final)
            fmt.publish_dir(self.tmp, self.final)
            try:
                if self.rank == 0 and self.save_latest:
                    fmt.write_text_atomic(os.path.join(self.save_dir, fmt.LATEST), self.tag)
            except BaseException:
                if not replaced:  # a new tag 'latest' does not name is not kept either
                    shutil.rmtree(self.final, ignore_errors=True)
                raise

    def _remove_tmp(self) -> None:
        """A failed save's files go (every rank has reported, so none is still writing)."""
        if self.owns_dir and os.path.isdir(self.tmp):
            shutil.rmtree(self.tmp, ignore_errors=True)


# -- what a rank writes, taken from the engine -------------------------------------------------
def _master(fg, staging: StagingPool | None, name: str) -> torch.Tensor:
    """The group's master shard as it is kept (fp32; bf16/fp16 for a low-precision master;
    the exact fp32 values for remainders); staged, each segment copied straight into its
    place in the staging buffer (no concatenated temporary: that would double the copy)."""
    if staging is None or fg.remainder is not None:
        values = fg.master_shard()
        return values if staging is None else staging.copy(name, values)
    if fg.master is not None:
        return staging.copy(name, fg.master)
    out = staging.buffer(name, fg.master_dtype, (fg.layout.shard_numel,))
    for seg, master in zip(fg.layout.segments, fg.master_segments):
        seg.of_shard(out).copy_(master.detach().reshape(-1), non_blocking=staging.pinned)
    return out


def capture(engine, save_dir: str, tag: str, client_state: dict | None, node_local: bool,
            save_latest: bool, staging: StagingPool | None) -> Snapshot:
    """This rank's part of the checkpoint, taken now. With ``staging`` (an asynchronous save)
    every tensor is copied into its reused host buffers and every Python object deep-copied,
    so the training that goes on while it is written changes nothing in it."""
    from .sharded import (
        _jsonable,
        _meta,
        _module_rest,
        _names,
        _owned_state_tensors,
        _rng_state,
    )
    comm = engine.comm
    names = _names(engine)
    tensors: dict[str, torch.Tensor] = {}
    groups_meta = []
    streamed = engine.optimizer.swap is not None  # (refused with staging, by the saver)
    specs, to_stream = [], []

    def stage(name: str, value: torch.Tensor) -> torch.Tensor:
        return value if staging is None else staging.copy(name, value)

    # hybrid sharding: every shard group holds the same states; the first one writes them
    # (its ranks are world ranks 0..K-1, so the files read as a K-rank checkpoint's)
    writes_states = engine.topology.shard_group_index == 0
    for gi, fg in enumerate(engine.flat_groups):
        if (fg.layout.world_size == 1 and comm.rank != 0) or not writes_states:
            continue  # stage 0: one owner, rank 0 writes for all
        owned = engine.optimizer.owned.get(gi)
        if streamed:  # (tensor-wise optimizers are refused with NVMe offload)
            elementwise, scalars = engine.optimizer.shard_state_kinds(fg)
            numel = fg.layout.shard_numel
            specs += [(f"{gi}.master", torch.float32, numel)] + \
                [(f"{gi}.state.{key}", dtype, numel) for key, dtype in elementwise.items()]
            to_stream.append((gi, fg, elementwise))
        elif owned is None:
            tensors[f"{gi}.master"] = _master(fg, staging, f"{gi}.master")
            buffer = None if staging is None else \
                lambda key, dtype, n, gi=gi: staging.buffer(f"{gi}.state.{key}", dtype, (n,))
            elementwise, scalars = engine.optimizer.shard_state(fg, buffer)
            for key, value in elementwise.items():
                tensors[f"{gi}.state.{key}"] = value
        else:  # tensor-wise: each owner saves its parameters' whole state, by name
            elementwise, scalars = {}, {}
            tensors[f"{gi}.master"] = stage(f"{gi}.master", fg.master_shard())
            for name, value in _owned_state_tensors(engine, gi, fg, names).items():
                tensors[name] = stage(name, value)
        groups_meta.append({  # used by rank 0, which owns a part of every group
            "optimizer_group": fg.group_index, "dtype": str(fg.dtype).replace("torch.", ""),
            "shard_world": fg.layout.world_size, "partitioned": fg.partitioned,
            "params": [[names[id(p)], list(slot.shape), slot.offset]
                       for p, slot in zip(fg.params, fg.layout.slots)],
            "segments": [[s.start, s.numel, s.shard_offset] for s in fg.layout.segments],
            "state_keys": sorted(elementwise), "scalar_state": _jsonable(scalars),
            # tensor-wise: the rank file holding each parameter's whole optimizer state
            "owners": None if owned is None else list(owned.partition.owner)})
    if staging is not None:
        if staging.pinned:
            torch.cuda.synchronize()  # the non_blocking device-to-host copies landed
        staging.keep_only(tensors)
    extras = {"rng": _rng_state()}  # (new tensors: nothing to copy)
    if comm.rank == 0:
        # the user's objects may change while an asynchronous save is written: copied then
        own = copy.deepcopy if staging is not None else (lambda value: value)
        extras["client_state"] = own(client_state or {})
        extras["module_rest"] = _module_rest(engine)  # (cloned)
        if engine.lr_scheduler is not None:
            extras["lr_scheduler"] = own(engine.lr_scheduler.state_dict())
    meta = _meta(engine, names, groups_meta, None, tag) if comm.rank == 0 else None
    snapshot = Snapshot(save_dir, tag, comm.rank, node_local, save_latest, tensors, extras,
                        meta)
    if streamed:
        def stream(writer, to_stream=to_stream):
            for gi, fg, kinds in to_stream:
                engine.optimizer.stream_shard_state(
                    fg, kinds, lambda key, seg, values, gi=gi: writer.write(
                        f"{gi}.master" if key == "master" else f"{gi}.state.{key}",
                        seg.shard_offset, values))
        snapshot.stream, snapshot.stream_specs = stream, specs
    return snapshot
