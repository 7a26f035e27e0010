"""Rank consistency at initialize(): every rank must build the same thing.

Ranks that disagree on the model (a parameter more or less, another shape, dtype or
requires_grad), the config or the zeroengine version lay out different flat buffers, and their
collectives then either hang (different counts) or silently combine unrelated numbers. One small
all-gather of a digest per rank catches all of it before the first real collective; only when
digests differ do the ranks exchange their full descriptions, to name the first difference.
"""
from __future__ import annotations

import hashlib
import json

import torch
import torch.nn as nn

from ..errors import RankMismatchError
from .comm import Comm


def describe(model: nn.Module, config_dict: dict, version: str) -> list[tuple[str, str]]:
    """What every rank must agree on, as (item, value) pairs in a fixed order."""
    items = [("zeroengine version", version),
             ("config", json.dumps(config_dict, sort_keys=True, default=str))]
    for name, p in model.named_parameters():
        items.append((f"parameter {name!r}", f"shape {tuple(p.shape)}, dtype "
                      f"{str(p.dtype).replace('torch.', '')}, requires_grad {p.requires_grad}"))
    return items


def digest(items: list[tuple[str, str]]) -> int:
    raw = hashlib.sha256(repr(items).encode()).digest()
    return int.from_bytes(raw[:8], "little", signed=True)


def first_difference(mine: list[tuple[str, str]], theirs: list[tuple[str, str]]) -> str:
    """The first item where two descriptions differ, in words (reference = ``mine``)."""
    for index, ((item_a, value_a), (item_b, value_b)) in enumerate(zip(mine, theirs)):
        if item_a != item_b:
            return (f"item {index}: rank 0 has {item_a} where this rank has {item_b} "
                    "(parameters added, removed or renamed)")
        if value_a != value_b:
            if item_a == "config":
                return f"the config: {_config_difference(value_a, value_b)}"
            return f"{item_a}: rank 0 has {value_a}, this rank has {value_b}"
    if len(mine) != len(theirs):
        longer, extra = ("rank 0", mine) if len(mine) > len(theirs) else ("this rank", theirs)
        return (f"{longer} has {abs(len(mine) - len(theirs))} more parameter(s), first "
                f"{extra[min(len(mine), len(theirs))][0]}")
    return "nothing (digest collision)"


def _config_difference(a: str, b: str) -> str:
    """The first differing key of two configs (JSON strings), as a dotted path."""
    def walk(x, y, path):
        if isinstance(x, dict) and isinstance(y, dict):
            for key in sorted(set(x) | set(y)):
                if x.get(key) != y.get(key):
                    return walk(x.get(key), y.get(key), f"{path}.{key}" if path else key)
        return f"{path or '(top level)'} is {json.dumps(x)} on rank 0, {json.dumps(y)} here"
    return walk(json.loads(a), json.loads(b), "")


def check_rank_consistency(model: nn.Module, config_dict: dict, version: str, comm: Comm,
                           device: torch.device) -> None:
    """Collective: raise RankMismatchError on every rank if any rank differs from rank 0."""
    if comm.world_size == 1:
        return
    items = describe(model, config_dict, version)
    mine = torch.tensor([digest(items)], dtype=torch.int64, device=device)
    every = torch.empty(comm.world_size, dtype=torch.int64, device=device)
    comm.all_gather(every, mine)
    digests = every.tolist()
    if len(set(digests)) == 1:
        return
    descriptions = comm.all_gather_object(items)  # only now: the words, to name the difference
    lines = []
    for rank in range(1, comm.world_size):
        if digests[rank] != digests[0]:
            difference = first_difference(descriptions[0], descriptions[rank])
            lines.append(f"rank {rank} differs from rank 0 in "
                         + difference.replace("this rank", f"rank {rank}"))
    raise RankMismatchError(
        "the ranks did not build the same model/config (found at initialize, before any "
        "training collective): " + "; ".join(lines) + ". Every rank must run the same code "
        "with the same config and model definition.")
