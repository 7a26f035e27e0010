"""Loading a sharded checkpoint into a ZeroEngine (saved by sharded.py, or DeepSpeed's or
DCP's: sources.py): every rank reads meta.json, then for each element the *new* layout gives it
the saved values from whichever rank files hold them (by parameter name, so the stage, world
size, bucket sizes and offload may all differ), verifying each file's checksum, into staging;
only when every rank has read its part is it applied (commit.py). Whole parameters are then
all-gathered as after an optimizer step."""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field

import torch

from . import format as fmt
from .commit import agree, attempt
from .format import CheckpointError
from .sharded import EXACT_MASTERS, _managed, _names, _precision_meta, _set_rng_state
from .sources import is_checkpoint, open_checkpoint

# Optimizer classes whose per-element state means the same thing under both names.
_SAME_STATE = {"AdamW": "Adam", "Adam": "Adam", "CPUAdam": "Adam", "FusedAdam": "Adam"}


def _warn_narrowing(engine, meta: dict, path: str) -> None:
    """A checkpoint with fp32 masters or moments loaded where they are kept in 16 bits: they
    are rounded to nearest, which the user should know (the other way is exact)."""
    saved = meta.get("optimizer_precision") or {"master": "fp32", "states": "float32"}
    mine = _precision_meta(engine)
    narrowed = []
    if saved["master"] in EXACT_MASTERS and mine["master"] not in EXACT_MASTERS:
        narrowed.append(f"the fp32 master weights to {mine['master']}")
    if saved["states"] == "float32" and mine["states"] != "float32":
        narrowed.append(f"the fp32 optimizer states to {mine['states']}")
    if narrowed and engine.comm.rank == 0:
        warnings.warn(f"{path}: loading rounds {' and '.join(narrowed)} (to nearest), as this "
                      "run's bf16/fp16 master keys ask", stacklevel=3)


def load_checkpoint(engine, load_dir: str, tag: str | None = None, *,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False, missing_ok: bool = False,
                    load_rng_states: bool = True):
    """Collective: restore ``engine`` from ``<load_dir>/<tag>`` (None: ``latest``). Returns
    (path, client_state), or (None, None) with ``missing_ok`` when nothing was saved yet (no
    directory, or no ``latest`` in it). ``load_rng_states``: each rank's torch, numpy and
    Python generators as they were at the save (a resume draws what the run straight through
    would have drawn); False leaves them as they are (DeepSpeed's load_checkpoint).

    Two phases (commit.py): every rank reads and verifies all it needs into staging memory,
    then reports; only when every rank succeeded is anything applied to the engine. Otherwise
    every rank raises the same CheckpointError and the engine holds what it held before."""
    engine.checkpoints.wait()  # a save still being written
    comm = engine.checkpoints.comm()
    options = dict(load_optimizer_states=load_optimizer_states,
                   load_lr_scheduler_states=load_lr_scheduler_states,
                   load_module_only=load_module_only, load_rng_states=load_rng_states)
    staged, err = attempt(_read, engine, load_dir, tag, missing_ok, options)
    where = os.path.join(load_dir, tag) if tag is not None else load_dir
    paths = agree(comm, f"load_checkpoint of {where}", err,
                  None if staged is None else staged.path,
                  "nothing was loaded: the engine holds what it held before")
    if len(set(paths)) > 1:
        raise CheckpointError(
            f"load_checkpoint of {where}: the ranks found different checkpoints ("
            + ", ".join(f"rank {r}: {p}" for r, p in enumerate(paths))
            + "): is load_dir a directory every rank sees the same way?")
    if staged.path is None:
        return None, None
    return _apply(engine, staged, options)


@dataclass
class _Staged:
    """What one rank read for a load, before any of it reaches the engine."""
    path: str | None
    meta: dict | None = None
    reader: object = None
    extras: dict = field(default_factory=dict)  # rank 0's: module_rest, scheduler, client
    rng: dict | None = None  # this rank's
    groups: list = field(default_factory=list)  # per flat group: (master, shards, scalars)
    owned: dict = field(default_factory=dict)  # tensor-wise flat group -> states
    foreign_schedule: dict | None = None


def _read(engine, load_dir: str, tag: str | None, missing_ok: bool, options) -> _Staged:
    """Phase 1: resolve, verify and read everything this rank will load; the engine is not
    touched (with NVMe offload the masters are read in phase 2, straight into the swap, from
    files verified here)."""
    path = load_dir if tag is None and is_checkpoint(load_dir) else \
        fmt.resolve(load_dir, tag, missing_ok)
    if path is None:
        return _Staged(None)
    source = open_checkpoint(path)  # zeroengine's own, DeepSpeed's or a DCP directory
    staged = _Staged(path, source.meta, source.reader)
    names = _names(engine)
    load_states = options["load_optimizer_states"] and not options["load_module_only"]
    if load_states:
        _check_optimizer_compatible(engine, staged.meta, path)
        _warn_narrowing(engine, staged.meta, path)
    staged.extras = source.extras(0)
    if options["load_lr_scheduler_states"] and not options["load_module_only"]:
        staged.foreign_schedule = staged.extras.get("deepspeed_lr_scheduler")
        if staged.foreign_schedule:
            _check_deepspeed_scheduler(engine, staged.foreign_schedule, path)
    for fi, fg in enumerate(engine.flat_groups):
        staged.groups.append(_read_group(engine, fg, names, staged.meta, staged.reader,
                                         load_states, path))
        if load_states and fi in engine.optimizer.owned:
            staged.owned[fi] = _read_owned_state(engine, fi, fg, names, staged.meta,
                                                 staged.reader, path)
    _check_module_rest(engine, staged.extras.get("module_rest", {}), path)
    rank = engine.comm.rank
    mine = staged.extras if rank == 0 else source.extras(rank)
    staged.rng = mine.get("rng")  # DeepSpeed saves none
    return staged


def _apply(engine, staged: _Staged, options) -> tuple[str, dict | None]:
    """Phase 2, after every rank read its part: the staged values into the engine."""
    meta, path = staged.meta, staged.path
    load_states = options["load_optimizer_states"] and not options["load_module_only"]
    for fi, fg in enumerate(engine.flat_groups):
        entry = staged.groups[fi]
        if engine.optimizer.swap is not None:
            _load_group_streamed(engine, fg, entry["located"], meta, staged.reader,
                                 entry["state_keys"] if load_states else set(),
                                 entry["scalars"])
        else:
            fg.load_master_shard(entry["master"])
            if entry["shards"]:
                engine.optimizer.load_shard_state(fg, entry["shards"], entry["scalars"])
        if fi in staged.owned:
            engine.optimizer.load_owned_state(fi, staged.owned[fi])
    engine.optimizer.republish()
    _load_module_rest(engine, staged.extras.get("module_rest", {}), path)
    client_state = staged.extras.get("client_state")
    if options["load_module_only"]:
        return path, client_state
    opt = engine.optimizer
    engine.clock.load(meta)
    opt.steps = meta["optimizer_steps"]
    if opt.loss_scaler is not None and meta["loss_scaler"] is not None:
        opt.loss_scaler.load_state_dict(meta["loss_scaler"])
    if load_states:
        for group, saved in zip(opt.param_groups, meta["optimizer"]["param_groups"]):
            for key, value in saved.items():
                if key in group and key not in ("foreach", "fused", "capturable"):
                    group[key] = tuple(value) if isinstance(group[key], tuple) else value
    if options["load_lr_scheduler_states"] and engine.lr_scheduler is not None and \
            "lr_scheduler" in staged.extras:
        engine.lr_scheduler.load_state_dict(staged.extras["lr_scheduler"])
    if staged.foreign_schedule and engine.lr_scheduler is not None:
        engine.lr_scheduler.take_deepspeed_position(
            staged.foreign_schedule["last_batch_iteration"])
    if options["load_rng_states"] and staged.rng is not None:
        _set_rng_state(staged.rng)
    engine.optimizer.zero_grad()
    return path, client_state


def _check_deepspeed_scheduler(engine, state: dict, path: str) -> None:
    """A DeepSpeed config scheduler's position (``last_batch_iteration``) goes into the same
    schedule here (the lr of each group comes with the optimizer's param groups); another
    scheduler cannot take it."""
    sched = engine.lr_scheduler
    if sched is None:
        return
    # the DeepSpeed schedules (core/optim/schedulers.py) can; a torch scheduler cannot
    if not hasattr(sched, "take_deepspeed_position") or "last_batch_iteration" not in state:
        raise CheckpointError(
            f"{path} holds a DeepSpeed lr scheduler's state ({sorted(state)}), which "
            f"{type(sched).__name__} cannot take: configure the same scheduler in the config's "
            "'scheduler' section (WarmupLR, WarmupDecayLR, WarmupCosineLR), or pass "
            "load_lr_scheduler_states=False")


def _check_optimizer_compatible(engine, meta: dict, path: str) -> None:
    if meta["optimizer"] is None:
        raise CheckpointError(f"{path} holds no optimizer state (a model-only save): load it "
                              "with load_checkpoint(..., load_optimizer_states=False)")
    saved = meta["optimizer"]["inner_class"]
    current = engine.optimizer.inner_name
    def same(names: str) -> list[str]:  # "Muon+AdamW": one inner optimizer per part
        return [_SAME_STATE.get(n, n) for n in names.split("+")]
    if same(saved) != same(current):
        raise CheckpointError(
            f"{path} holds {saved} optimizer state but this engine's "
            f"optimizer is {current}; use the same optimizer, or load_checkpoint(..., "
            "load_optimizer_states=False) to take the weights only")
    if len(meta["optimizer"]["param_groups"]) != len(engine.optimizer.param_groups):
        raise CheckpointError(
            f"{path} has {len(meta['optimizer']['param_groups'])} "
            f"optimizer param groups, this optimizer {len(engine.optimizer.param_groups)}")


def _read_group(engine, fg, names, meta, reader, load_states: bool, path: str) -> dict:
    """Read the rank's master (and optimizer state) for every element the new layout gives
    it: {"master", "shards", "scalars", "located", "state_keys"}. With NVMe offload only the
    files are verified here; phase 2 streams them into the swap."""
    state_keys: set[str] = set()
    scalars: dict = {}
    located = []
    for piece in fg.layout.shard_pieces(fg.rank):
        name = names[id(fg.params[piece.param])]
        if name not in meta["index"]:
            raise CheckpointError(f"{path} has no parameter {name!r}; "
                                  "was it saved from another model?")
        gi, entry = meta["index"][name]
        saved_name, shape, offset = meta["groups"][gi]["params"][entry]
        expected = list(fg.layout.slots[piece.param].shape)
        if shape != expected:
            raise CheckpointError(f"parameter {name!r} has shape {tuple(expected)} but "
                                  f"{path} saved {tuple(shape)}")
        located.append((piece, gi, offset))
    # the group's scalar state (Adam's step) and state keys, from every parameter of it: a
    # rank whose chunk holds only padding has no pieces but steps the same as the others
    for p in fg.params:
        if names[id(p)] in meta["index"]:
            saved = meta["groups"][meta["index"][names[id(p)]][0]]
            state_keys.update(saved["state_keys"])
            scalars.update(saved["scalar_state"])
    out = {"master": None, "shards": {}, "scalars": scalars, "located": located,
           "state_keys": state_keys}
    if engine.optimizer.swap is not None:
        verify = getattr(reader, "verify_range", None)  # (DeepSpeed's and DCP's: no checksums)
        for piece, gi, offset in located if verify is not None else ():
            for key in ["master"] + [f"state.{k}" for k in meta["groups"][gi]["state_keys"]
                                     if load_states]:
                verify(gi, key, offset + piece.param_offset, piece.numel)
        return out
    master = torch.zeros(fg.layout.shard_numel, dtype=torch.float32)
    for piece, gi, offset in located:
        reader.read(gi, "master", offset + piece.param_offset, piece.numel,
                    piece.of_shard(master))
    out["master"] = master
    if not load_states or not state_keys:
        return out
    shards = {key: torch.zeros(fg.layout.shard_numel, dtype=torch.float32) for key in state_keys}
    for piece, gi, offset in located:
        for key in meta["groups"][gi]["state_keys"]:
            reader.read(gi, f"state.{key}", offset + piece.param_offset, piece.numel,
                        piece.of_shard(shards[key]))
    out["shards"] = shards
    return out


def _load_group_streamed(engine, fg, located, meta, reader, state_keys: set,
                         scalars: dict) -> None:
    """NVMe offload: the same, read a tile at a time straight into the swapped master and
    state (written back to the drive after each tile), so nothing is whole in memory."""
    by_segment: dict[int, list] = {}
    for entry in located:
        piece = entry[0]
        s = next(i for i, seg in enumerate(fg.layout.segments)
                 if seg.shard_offset <= piece.shard_offset < seg.shard_offset + seg.chunk_numel)
        by_segment.setdefault(s, []).append(entry)
    for s in fg.resident_masters(write_back=True):
        start = fg.layout.segments[s].shard_offset
        master = fg.master_segments[s]
        master.zero_()
        targets = engine.optimizer.segment_state_targets(fg, s, sorted(state_keys), scalars) \
            if state_keys else {}
        for piece, gi, offset in by_segment.get(s, ()):
            at = slice(piece.shard_offset - start, piece.shard_offset - start + piece.numel)
            reader.read(gi, "master", offset + piece.param_offset, piece.numel, master[at])
            for key in meta["groups"][gi]["state_keys"] if state_keys else ():
                reader.read(gi, f"state.{key}", offset + piece.param_offset, piece.numel,
                            targets[key][at])


def _read_owned_state(engine, fi: int, fg, names, meta, reader, path: str) -> dict:
    """A tensor-wise group: the whole state of each parameter this rank now owns, from the
    file of the rank that owned it when saved (any world size or stage)."""
    states = {}
    for i in engine.optimizer.owned[fi].names:
        name = names[id(fg.params[i])]
        gi, entry = meta["index"][name]
        owners = meta["groups"][gi].get("owners")
        if owners is None:
            raise CheckpointError(f"{os.path.join(path, fmt.META)} saved {name!r} with a flat "
                                  "(elementwise) optimizer state; this engine's optimizer "
                                  "steps it whole. Load with load_optimizer_states=False")
        state = {}
        for kind in ("pstate", "pscalar"):
            prefix = f"{gi}.{kind}.{name}."
            for key, value in reader.tensors_with_prefix(owners[entry], prefix).items():
                state[key] = value if kind == "pstate" else value.item()
        if state:
            states[i] = state
    return states


def _check_module_rest(engine, rest: dict, path: str) -> None:
    """Phase 1: every saved buffer or frozen parameter fits the one it would replace."""
    managed = _managed(engine)
    for key, value in engine.plain_module.state_dict(keep_vars=True).items():
        if id(value) in managed or key not in rest:
            continue
        saved = rest[key]
        if not torch.is_tensor(saved) or saved.shape != value.shape:
            raise CheckpointError(f"{path}: {key!r} was saved with shape "
                                  f"{tuple(getattr(saved, 'shape', ()))}, the model's is "
                                  f"{tuple(value.shape)}")


def _load_module_rest(engine, rest: dict, path: str) -> None:
    own = engine.plain_module.state_dict(keep_vars=True)
    managed = _managed(engine)
    with torch.no_grad():
        for key, value in own.items():
            if id(value) in managed:
                continue
            if key not in rest:
                warnings.warn(f"{path}: no saved value for {key!r}; it keeps its current value",
                              stacklevel=3)
                continue
            value.copy_(rest[key])
