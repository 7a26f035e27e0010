"""Sharded checkpoints of a ZeroEngine: every rank writes only what it owns, in parallel, and
any world size and stage can load any checkpoint (format: format.py).

Save: all ranks write into ``<save_dir>/<tag>.tmp/`` and fsync; one all-gather brings every
file's sha256 to rank 0, which writes meta.json (fsynced), renames the directory into place and
only then replaces ``latest``. A process killed at any point leaves ``latest`` naming the
previous complete checkpoint.

Load: every rank reads meta.json, then for each element the *new* layout gives it, the saved
values from whichever rank files hold them (by parameter name, so the stage, world size, bucket
sizes and offload may all differ), verifying each file's checksum before use. Whole parameters
are then all-gathered as after an optimizer step.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import warnings

import numpy as np
import torch

from ..core.compiled import uncompiled
from . import format as fmt
from .format import CheckpointError
from .sources import is_checkpoint, open_checkpoint


# -- what the engine holds, by name ----------------------------------------------------------------
def _names(engine) -> dict[int, str]:
    """Parameter -> its first name (tied parameters have several)."""
    names: dict[int, str] = {}
    for name, p in uncompiled(engine.module).named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def _managed(engine) -> set[int]:
    """ids of the parameters held in flat groups (the rest of state_dict is saved as is)."""
    return {id(p) for fg in engine.flat_groups for p in fg.params}


def _jsonable(value):
    if torch.is_tensor(value):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _rng_state() -> dict:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)},
             "python": {"version": version, "internal": list(internal),
                        "gauss_next": gauss_next}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# -- save ------------------------------------------------------------------------------------------
def unsupported_layout(engine) -> str | None:
    """What keeps the exports that read the flat groups' masters directly (save_pretrained,
    save_16bit_model's stream, the DCP save) from this engine, or None: masters swapped to
    NVMe or held by hybrid shard groups are not read that way yet."""
    if engine.optimizer.swap is not None:
        return "with the optimizer state on NVMe (offload_optimizer.device 'nvme')"
    if engine.topology.shard.world_size not in (1, engine.comm.world_size):
        return "under hybrid sharding (zero_hpz / mics groups)"
    return None


def refuse_unsupported_layouts(engine, what: str, instead: str) -> None:
    """``unsupported_layout`` refused by name, saying what to do ``instead``."""
    layout = unsupported_layout(engine)
    if layout is not None:
        raise NotImplementedError(f"{what} {layout} is not supported yet: {instead}")


def checked_tag(tag: str | None, engine) -> str:
    """``tag`` (default ``global_step<N>``), refused unless it is a plain directory name."""
    tag = tag or f"global_step{engine.global_steps}"
    if os.sep in tag or tag in ("", ".", "..", fmt.LATEST) or tag.endswith((".tmp", ".old")):
        raise CheckpointError(f"checkpoint tag {tag!r} is not a plain directory name")
    return tag


def save_checkpoint(engine, save_dir: str, tag: str | None = None,
                    client_state: dict | None = None, node_local: bool = False,
                    save_latest: bool = True) -> str:
    """Collective: write this engine's checkpoint as ``<save_dir>/<tag>``; returns its path.

    ``node_local``: ``save_dir`` is this rank's own directory, not one shared by all ranks (Ray
    Train, which uploads every worker's directory into one checkpoint). Each rank then makes and
    publishes its own directory; rank 0's also gets the metadata and ``latest``, so the union of
    all ranks' directories is the checkpoint. ``save_latest=False`` (DeepSpeed's): leave
    ``latest`` naming the checkpoint it named before."""
    from safetensors.torch import save_file
    comm = engine.comm
    tag = checked_tag(tag, engine)
    final = os.path.join(save_dir, tag)
    tmp = final + ".tmp"
    if comm.rank == 0 or node_local:
        os.makedirs(save_dir, exist_ok=True)
        if os.path.exists(tmp):  # left by a save that died
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    comm.barrier()

    names = _names(engine)
    tensors: dict[str, torch.Tensor] = {}
    groups_meta = []
    # NVMe offload: the master and state are written a tile at a time, never whole in memory
    streamed = engine.optimizer.swap is not None
    specs, to_stream = [], []
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
            elementwise, scalars = engine.optimizer.shard_state(fg)
        else:  # tensor-wise: each owner saves its parameters' whole state, by name
            elementwise, scalars = {}, {}
            tensors.update(_owned_state_tensors(engine, gi, fg, names))
        if not streamed:
            tensors[f"{gi}.master"] = fg.master_shard()
            for key, value in elementwise.items():
                tensors[f"{gi}.state.{key}"] = value
        groups_meta.append({  # used by rank 0, which owns a part of every group
            "optimizer_group": fg.group_index, "dtype": str(fg.dtype).replace("torch.", ""),
            "shard_world": fg.layout.world_size, "partitioned": fg.partitioned,
            "params": [[names[id(p)], list(slot.shape), slot.offset]
                       for p, slot in zip(fg.params, fg.layout.slots)],
            "segments": [[s.start, s.numel, s.shard_offset] for s in fg.layout.segments],
            "state_keys": sorted(elementwise), "scalar_state": _jsonable(scalars),
            # tensor-wise: the rank file holding each parameter's whole optimizer state
            "owners": None if owned is None else list(owned.partition.owner)})
    st_path = os.path.join(tmp, fmt.rank_file(comm.rank, "safetensors"))
    if streamed:
        writer = fmt.StreamedSafetensors(st_path, specs)
        try:
            for gi, fg, kinds in to_stream:
                engine.optimizer.stream_shard_state(
                    fg, kinds, lambda key, seg, values, gi=gi: writer.write(
                        f"{gi}.master" if key == "master" else f"{gi}.state.{key}",
                        seg.shard_offset, values))
        finally:
            writer.close()
    else:
        save_file(tensors, st_path)
    extras = {"rng": _rng_state()}
    if comm.rank == 0:
        extras["client_state"] = client_state or {}
        extras["module_rest"] = _module_rest(engine)
        if engine.lr_scheduler is not None:
            extras["lr_scheduler"] = engine.lr_scheduler.state_dict()
    pt_path = os.path.join(tmp, fmt.rank_file(comm.rank, "pt"))
    torch.save(extras, pt_path)
    for path in (st_path, pt_path):
        fmt.fsync_file(path)
    digests = _gather_digests(comm, [fmt.sha256_file(st_path), fmt.sha256_file(pt_path)])

    if comm.rank == 0:
        files = {}
        for rank, (st, pt) in enumerate(digests):
            files[fmt.rank_file(rank, "safetensors")] = st
            files[fmt.rank_file(rank, "pt")] = pt
        meta = _meta(engine, names, groups_meta, files, tag)
        fmt.write_json_atomic(os.path.join(tmp, fmt.META), fmt.seal(meta))
        fmt.fsync_dir(tmp)
        fmt.publish_dir(tmp, final)
        if save_latest:
            fmt.write_text_atomic(os.path.join(save_dir, fmt.LATEST), tag)
    elif node_local:
        fmt.fsync_dir(tmp)
        fmt.publish_dir(tmp, final)
    comm.barrier()
    return final


def _owned_state_tensors(engine, gi: int, fg, names) -> dict[str, torch.Tensor]:
    """``<gi>.pstate.<param name>.<key>``: the state tensors of the parameters this rank owns;
    plain numbers (a step count) as 0-d tensors under ``<gi>.pscalar.<name>.<key>``."""
    out = {}
    for i, state in engine.optimizer.owned_state(gi).items():
        name = names[id(fg.params[i])]
        for key, value in state.items():
            if torch.is_tensor(value):
                out[f"{gi}.pstate.{name}.{key}"] = value.detach().cpu().contiguous()
            elif isinstance(value, (bool, int, float)):
                out[f"{gi}.pscalar.{name}.{key}"] = torch.tensor(value)
            else:
                raise CheckpointError(
                    f"optimizer state {key!r} of {name!r} is a {type(value).__name__}; "
                    "checkpoints hold tensors and numbers only")
    return out


def _gather_digests(comm, hexes: list[str]) -> list[list[str]]:
    """Every rank's file digests, on every rank (one small all-gather)."""
    mine = torch.tensor(list(bytes.fromhex("".join(hexes))), dtype=torch.uint8)
    if comm.world_size == 1:
        rows = [mine]
    else:
        out = torch.empty(comm.world_size * mine.numel(), dtype=torch.uint8)
        comm.all_gather(out, mine)
        rows = out.view(comm.world_size, -1)
    return [[bytes(row[i * 32:(i + 1) * 32].tolist()).hex() for i in range(len(hexes))]
            for row in rows]


def _module_rest(engine) -> dict[str, torch.Tensor]:
    """state_dict entries not held in flat groups: buffers, frozen and non-optimized params."""
    managed = _managed(engine)
    return {k: v.detach().cpu().clone() for k, v in uncompiled(engine.module).state_dict(keep_vars=True).items()
            if id(v) not in managed}


def _meta(engine, names, groups_meta, files, tag) -> dict:
    from .. import __version__
    managed = _managed(engine)
    state_dict_keys = {k: (names[id(v)] if id(v) in managed else None)
                       for k, v in uncompiled(engine.module).state_dict(keep_vars=True).items()}
    index = {}
    for gi, g in enumerate(groups_meta):
        for entry, (name, _, _) in enumerate(g["params"]):
            index[name] = [gi, entry]
    opt = engine.optimizer
    return {
        "format": fmt.FORMAT_VERSION, "zeroengine": __version__, "tag": tag,
        "stage": engine.stage, "world_size": engine.comm.world_size,
        "shard_group_size": engine.topology.shard.world_size,
        **counters(engine),
        "optimizer": {"class": opt.base_class.__name__,
                      "inner_class": opt.inner_name,
                      "param_groups": [_jsonable({k: v for k, v in g.items() if k != "params"})
                                       for g in opt.param_groups]},
        "groups": groups_meta, "index": index, "state_dict_keys": state_dict_keys,
        "files": files, "hf_config": _hf_config(uncompiled(engine.module)),
    }


def counters(engine) -> dict:
    """The step clock, the optimizer's step count and the loss scaler, as JSON (what
    ``load_checkpoint`` restores them from)."""
    scaler = engine.optimizer.loss_scaler
    return {**engine.clock.state(), "optimizer_steps": engine.optimizer.steps,
            "loss_scaler": _jsonable(scaler.state_dict()) if scaler is not None else None}


def _hf_config(module) -> dict | None:
    """A Hugging Face model's config as plain JSON, so that ``zeroengine consolidate`` can
    write a directory ``from_pretrained`` loads; None for any other module."""
    config = getattr(module, "config", None)
    if config is None or not callable(getattr(config, "to_json_string", None)):
        return None
    return json.loads(config.to_json_string())


# -- load ------------------------------------------------------------------------------------------
# Optimizer classes whose per-element state means the same thing under both names.
_SAME_STATE = {"AdamW": "Adam", "Adam": "Adam", "CPUAdam": "Adam", "FusedAdam": "Adam"}


def load_checkpoint(engine, load_dir: str, tag: str | None = None, *,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False, missing_ok: bool = False,
                    load_rng_states: bool = True):
    """Collective: restore ``engine`` from ``<load_dir>/<tag>`` (None: ``latest``). Returns
    (path, client_state), or (None, None) with ``missing_ok`` when nothing was saved yet (no
    directory, or no ``latest`` in it). ``load_rng_states``: each rank's torch, numpy and
    Python generators as they were at the save (a resume draws what the run straight through
    would have drawn); False leaves them as they are (DeepSpeed's load_checkpoint)."""
    path = load_dir if tag is None and is_checkpoint(load_dir) else \
        fmt.resolve(load_dir, tag, missing_ok)
    if path is None:
        return None, None
    source = open_checkpoint(path)  # zeroengine's own, DeepSpeed's or a DCP directory
    meta, reader = source.meta, source.reader
    names = _names(engine)
    load_states = load_optimizer_states and not load_module_only
    if load_states:
        _check_optimizer_compatible(engine, meta, path)
    extras = source.extras(0)
    foreign_schedule = load_lr_scheduler_states and not load_module_only and \
        extras.get("deepspeed_lr_scheduler")
    if foreign_schedule:  # refused before anything is loaded
        _check_deepspeed_scheduler(engine, foreign_schedule, path)
    for fi, fg in enumerate(engine.flat_groups):
        _load_group(engine, fg, names, meta, reader, load_states, path)
        if load_states and fi in engine.optimizer.owned:
            _load_owned_state(engine, fi, fg, names, meta, reader, path)
    engine.optimizer.republish()
    _load_module_rest(engine, extras.get("module_rest", {}), path)
    if load_module_only:
        return path, extras.get("client_state")
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
    if load_lr_scheduler_states and engine.lr_scheduler is not None and "lr_scheduler" in extras:
        engine.lr_scheduler.load_state_dict(extras["lr_scheduler"])
    if foreign_schedule and engine.lr_scheduler is not None:
        sched = engine.lr_scheduler  # DeepSpeed's iteration t is torch's last_epoch t + 1
        sched.last_epoch = int(foreign_schedule["last_batch_iteration"]) + 1
        sched._last_lr = [g["lr"] for g in sched.optimizer.param_groups]
    rank = engine.comm.rank
    mine = extras if rank == 0 else source.extras(rank)
    if load_rng_states and "rng" in mine:  # DeepSpeed saves none
        _set_rng_state(mine["rng"])
    engine.optimizer.zero_grad()
    return path, extras.get("client_state")


def _check_deepspeed_scheduler(engine, state: dict, path: str) -> None:
    """A DeepSpeed config scheduler's position (``last_batch_iteration``) goes into the same
    schedule here (the lr of each group comes with the optimizer's param groups); another
    scheduler cannot take it."""
    from ..core.schedulers import DEEPSPEED_SCHEDULERS
    sched = engine.lr_scheduler
    if sched is None:
        return
    if type(sched).__name__ not in DEEPSPEED_SCHEDULERS or "last_batch_iteration" not in state:
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


def _load_group(engine, fg, names, meta, reader, load_states: bool, path: str) -> None:
    """Fill the rank's master (and optimizer state) for every element the new layout gives it."""
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
        state_keys.update(meta["groups"][gi]["state_keys"])
        scalars.update(meta["groups"][gi]["scalar_state"])
    if engine.optimizer.swap is not None:
        _load_group_streamed(engine, fg, located, meta, reader,
                             state_keys if load_states else set(), scalars)
        return
    master = torch.zeros(fg.layout.shard_numel, dtype=torch.float32)
    for piece, gi, offset in located:
        reader.read(gi, "master", offset + piece.param_offset, piece.numel,
                    piece.of_shard(master))
    fg.load_master_shard(master)
    if not load_states or not state_keys:
        return
    shards = {key: torch.zeros(fg.layout.shard_numel, dtype=torch.float32) for key in state_keys}
    for piece, gi, offset in located:
        for key in meta["groups"][gi]["state_keys"]:
            reader.read(gi, f"state.{key}", offset + piece.param_offset, piece.numel,
                        piece.of_shard(shards[key]))
    engine.optimizer.load_shard_state(fg, shards, scalars)


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


def _load_owned_state(engine, fi: int, fg, names, meta, reader, path: str) -> None:
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
    engine.optimizer.load_owned_state(fi, states)


def _load_module_rest(engine, rest: dict, path: str) -> None:
    own = uncompiled(engine.module).state_dict(keep_vars=True)
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
