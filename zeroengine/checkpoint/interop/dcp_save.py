"""``engine.save_checkpoint(dir, format="dcp")``: a torch.distributed.checkpoint directory that
FSDP2 and torchtitan load, written by every rank through DCP itself.

The state dict is FSDP2's recipe: ``{"model": model.state_dict() names -> fp32 values,
"optim": get_optimizer_state_dict's shape ({"state": {fqn: {exp_avg, exp_avg_sq, step}},
"param_groups": [{..., "params": [fqn, ...]}]})}``, plus ``"zeroengine"`` (counters, the lr
scheduler, client_state) that FSDP2 leaves alone. A rank's flat shard holds arbitrary element
ranges of each parameter, which DCP (rectangular chunks) cannot name directly: each range is cut
into at most a few rectangles in row-major order - a partial first row, whole rows, a partial
last row, recursively for more dimensions - and written as chunks of the parameter's global
shape. DCP's load planner reads whatever overlaps the loader's own shards, so FSDP2 at any world
size takes them; ``load_checkpoint`` reads it back here at any world size and stage.
"""
from __future__ import annotations

import io
import math
import os
import shutil

import torch

from .. import format as fmt
from ..format import CheckpointError
from .dcp_format import ZEROENGINE_KEY


def rectangles(shape, begin: int, end: int) -> list[tuple[tuple, tuple]]:
    """(offsets, sizes) of rectangles covering the flat range [begin, end) of ``shape`` in
    row-major order, each contiguous there, in order."""
    shape = tuple(shape)
    if begin >= end:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    first_full, last_full = -(-begin // inner), end // inner
    if first_full > last_full:  # inside one row
        row = begin // inner
        return [((row,) + o, (1,) + s)
                for o, s in rectangles(shape[1:], begin - row * inner, end - row * inner)]
    out = []
    if begin % inner:
        row = begin // inner
        out += [((row,) + o, (1,) + s)
                for o, s in rectangles(shape[1:], begin - row * inner, inner)]
    if last_full > first_full:
        out.append(((first_full,) + (0,) * (len(shape) - 1),
                    (last_full - first_full,) + shape[1:]))
    if end % inner:
        out += [((last_full,) + o, (1,) + s)
                for o, s in rectangles(shape[1:], 0, end - last_full * inner)]
    return out


class _Pieces:
    """This rank's pieces of one tensor of global ``shape``: flat ranges of it, each a flat
    tensor, given to DCP as rectangular chunks (its ``__create_write_items__`` protocol)."""

    def __init__(self, shape, ranges: list[tuple[int, torch.Tensor]]):
        self.shape = tuple(shape)
        self.dtype = torch.float32
        self._chunks: dict[tuple, torch.Tensor] = {}
        for begin, values in ranges:
            at = 0
            for offsets, sizes in rectangles(self.shape, begin, begin + values.numel()):
                n = math.prod(sizes)
                self._chunks[tuple(offsets)] = values[at:at + n].reshape(sizes)
                at += n

    def __create_write_items__(self, fqn: str, obj):
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import (
            TensorWriteData,
            WriteItem,
            WriteItemType,
        )
        items = []
        for offsets, value in self._chunks.items():
            items.append(WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets),
                                               sizes=torch.Size(value.shape)),
                    properties=TensorProperties(dtype=value.dtype),
                    size=torch.Size(self.shape))))
        return items

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        return self._chunks[tuple(index.offset)]


def _planner():
    """DCP's default save planner, resolving our pieces by chunk offset (its own lookup asks
    only torch.Tensor subclasses for a shard)."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    class PiecesPlanner(DefaultSavePlanner):
        def resolve_data(self, write_item):
            obj = self.state_dict.get(write_item.index.fqn)
            if isinstance(obj, _Pieces):
                return obj.__get_tensor_shard__(write_item.index)
            return super().resolve_data(write_item)
    return PiecesPlanner()


def _refuse(engine) -> None:
    from ..sharded import refuse_unsupported_layouts
    instead = "save in zeroengine's format, which loads at any world size or stage"
    refuse_unsupported_layouts(engine, "save_checkpoint(format='dcp')", instead)
    if engine.optimizer.owned:
        raise NotImplementedError(
            "save_checkpoint(format='dcp') with a tensor-wise optimizer (Muon) is not "
            f"supported yet: {instead}")


def _state_dict(engine, names: dict, client_state: dict | None) -> dict:
    from ..sharded import _managed, counters
    module = engine.plain_module
    model: dict = {}
    state: dict = {}
    scalars_of: dict = {}
    rank = engine.comm.rank
    managed = _managed(engine)
    pieces: dict[int, list] = {}  # id(param) -> [(begin, master piece, {key: state piece})]
    for fg in engine.flat_groups:
        writes = fg.layout.world_size > 1 or rank == 0
        elementwise, scalars = engine.optimizer.shard_state(fg) if writes else ({}, {})
        master = fg.master_shard() if writes else None
        for piece in (fg.layout.shard_pieces(fg.rank if fg.layout.world_size > 1 else 0)
                      if writes else ()):
            p = fg.params[piece.param]
            pieces.setdefault(id(p), []).append(
                (piece.param_offset, piece.of_shard(master).float(),
                 {k: piece.of_shard(v).float() for k, v in elementwise.items()}))
        for p in fg.params:
            scalars_of[id(p)] = scalars
    for key, t in module.state_dict(keep_vars=True).items():
        if id(t) in managed:
            model[key] = _Pieces(t.shape, [(b, m) for b, m, _ in pieces.get(id(t), [])])
        else:
            model[key] = t.detach().cpu().clone()
    groups = []
    opt = engine.optimizer
    for group in opt.param_groups:
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": [names[id(p)] for p in group["params"]]})
        for p in group["params"]:
            if id(p) not in managed:
                continue
            entry = pieces.get(id(p), [])
            keys = sorted({k for _, _, s in entry for k in s})  # none: all on other ranks
            st = {k: _Pieces(p.shape, [(b, s[k]) for b, _, s in entry]) for k in keys}
            step = scalars_of.get(id(p), {}).get("step")
            if step is not None:
                st["step"] = torch.tensor(float(step))
            if st:
                state[names[id(p)]] = st
    ours = {"meta": counters(engine), "client_state": client_state or {}}
    if engine.lr_scheduler is not None:
        ours["lr_scheduler"] = engine.lr_scheduler.state_dict()
    # one opaque value (DCP would flatten a dict into a key per number): the bytes of a
    # torch.save, read back with weights_only=True
    blob = io.BytesIO()
    torch.save(ours, blob)
    return {"model": model, "optim": {"state": state, "param_groups": groups},
            ZEROENGINE_KEY: blob.getvalue()}


def save_dcp(engine, save_dir: str, tag: str, client_state: dict | None,
             save_latest: bool) -> str:
    """Collective. ``<save_dir>/<tag>`` written in a temporary directory and renamed into
    place by rank 0 once every rank's files are written (a crash leaves the previous one).
    Under the commit protocol (commit.py): a failure on any rank - building its state, DCP's
    write, the publish - raises the same CheckpointError on every rank and removes the
    temporary directory; ``latest`` is left alone."""
    import torch.distributed.checkpoint as dcp

    from ..commit import agree, attempt
    from ..sharded import _names
    _refuse(engine)
    engine.checkpoints.wait()  # an asynchronous save of our own format still being written
    comm, reports = engine.comm, engine.checkpoints.comm()
    final = os.path.join(save_dir, tag)
    tmp = final + ".tmp"
    action = f"save_checkpoint(format='dcp') of {final}"
    left = "nothing of it was kept; 'latest' names the checkpoint it named before"

    def make_dir():
        if comm.rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            if os.path.exists(tmp):
                shutil.rmtree(tmp)
            os.makedirs(tmp)

    def write(state):
        try:
            dcp.save(state, checkpoint_id=tmp, planner=_planner(),
                     process_group=getattr(comm, "group", None))
        except Exception as err:
            raise CheckpointError(f"torch.distributed.checkpoint's save failed: "
                                  f"{type(err).__name__}: {err}") from err

    def publish():
        if comm.rank == 0:
            for name in os.listdir(tmp):
                fmt.fsync_file(os.path.join(tmp, name))
            fmt.fsync_dir(tmp)
            fmt.publish_dir(tmp, final)
            if save_latest:
                fmt.write_text_atomic(os.path.join(save_dir, fmt.LATEST), tag)
    try:
        agree(reports, action, attempt(make_dir)[1], outcome=left)
        state, err = attempt(_state_dict, engine, _names(engine), client_state)
        agree(reports, action, err, outcome=left)  # every rank enters DCP's collectives
        agree(reports, action, attempt(write, state)[1], outcome=left)
        agree(reports, action, attempt(publish)[1], outcome=left)
    except CheckpointError:
        if comm.rank == 0 and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
