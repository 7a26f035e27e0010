"""Sharded checkpoints of a ZeroEngine: every rank writes only what it owns, in parallel, and
any world size and stage can load any checkpoint (format: format.py). This module: what the
engine holds, by name, and the save; restore.py: the load.

Save (snapshot.py, saver.py): all ranks write into ``<save_dir>/<tag>.tmp/`` and fsync; the
commit protocol's reports bring every file's size and checksum to rank 0, which writes
meta.json (fsynced), renames the directory into place and only then replaces ``latest``. A
process killed at any point leaves ``latest`` naming the previous complete checkpoint; a
failure on any rank fails the save on every rank (commit.py).

Load: every rank reads meta.json, then for each element the *new* layout gives it, the saved
values from whichever rank files hold them (by parameter name, so the stage, world size, bucket
sizes and offload may all differ), verifying each file's checksum before use, into staging;
only when every rank has read its part is it applied. Whole parameters are then all-gathered
as after an optimizer step.
"""
from __future__ import annotations

import json
import os
import random

import numpy as np
import torch

from . import format as fmt
from .format import CheckpointError


# -- what the engine holds, by name ----------------------------------------------------------------
def _names(engine) -> dict[int, str]:
    """Parameter -> its first name (tied parameters have several)."""
    names: dict[int, str] = {}
    for name, p in engine.plain_module.named_parameters(remove_duplicate=False):
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
                    save_latest: bool = True, async_save: bool | None = None):
    """Collective: write this engine's checkpoint as ``<save_dir>/<tag>``; returns its path
    (or, with ``async_save``, a Future of it: see saver.py).

    ``node_local``: ``save_dir`` is this rank's own directory, not one shared by all ranks (Ray
    Train, which uploads every worker's directory into one checkpoint). Each rank then makes and
    publishes its own directory; rank 0's also gets the metadata and ``latest``, so the union of
    all ranks' directories is the checkpoint. ``save_latest=False`` (DeepSpeed's): leave
    ``latest`` naming the checkpoint it named before."""
    return engine.checkpoints.save(save_dir, tag, client_state, node_local, save_latest,
                                   async_save)


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


def _module_rest(engine) -> dict[str, torch.Tensor]:
    """state_dict entries not held in flat groups: buffers, frozen and non-optimized params."""
    managed = _managed(engine)
    state = engine.plain_module.state_dict(keep_vars=True)
    return {k: v.detach().cpu().clone() for k, v in state.items()
            if id(v) not in managed}


def _meta(engine, names, groups_meta, files, tag) -> dict:
    from .. import __version__
    managed = _managed(engine)
    state_dict_keys = {k: (names[id(v)] if id(v) in managed else None)
                       for k, v in engine.plain_module.state_dict(keep_vars=True).items()}
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
        "optimizer_precision": _precision_meta(engine),
        "groups": groups_meta, "index": index, "state_dict_keys": state_dict_keys,
        "files": files, "hf_config": _hf_config(engine.plain_module),
    }


# The format's words for masters kept in fp32 exactly: a separate fp32 copy, or the 16-bit
# weight with its 16-bit remainder (the other words are the dtype of a 16-bit master). They
# are core's FP32_MASTER and REMAINDER_MASTER as written (a test holds the two together).
EXACT_MASTERS = ("fp32", "remainder")


def _precision_meta(engine) -> dict:
    """What the masters and Adam's moments were kept in (bf16/fp16 master keys): "fp32",
    "float16"/"bfloat16" (low-precision masters) or "remainder" (exact fp32)."""
    precision = engine.optimizer_precision
    master = str(engine.precision.compute).replace("torch.", "") if precision.low_master \
        else precision.master
    return {"master": master, "states": str(precision.states).replace("torch.", ""),
            "stochastic_rounding": precision.stochastic}


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
