"""Which parts of which engine hold a parameter: one registry for the code that is handed a bare
parameter by the user (``clip_grad_norm_``, ``gathered_parameters``, DeepSpeed's
``safe_get_full_*``, a stage-3 parameter read while released) and must find its engine.

Keyed by the parameter object itself (torch's WeakIdKeyDictionary: identity, not tensor
equality), and every holder is kept by weak reference too (a holder references its parameters,
so a strong value would keep its own key alive): a model and engine that are garbage-collected
take their entries with them, where a dict keyed by ``id()`` would keep them and hand them to
the next tensor given that id. Engines add their parameters at initialize() and remove them at
close().
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, fields

from torch.utils.weak import WeakIdKeyDictionary


@dataclass
class Holders:
    """Weak references (or None) to what holds one parameter."""
    optimizer: weakref.ref | None = None  # the ShardedOptimizer stepping it (drop_in.py)
    fetcher: weakref.ref | None = None  # stage 3's ParamFetcher partitioning it (gathered.py)
    whole: tuple | None = None  # (FlatParamGroup, Comm) of a parameter kept whole (gathered.py)
    reader: weakref.ref | None = None  # its read_released(param, what) (sharded_param.py)

    def empty(self) -> bool:
        return all(getattr(self, f.name) is None for f in fields(self))


def _weak(value):
    if value is None:
        return None
    if isinstance(value, tuple):
        return tuple(weakref.ref(v) for v in value)
    return weakref.ref(value)


def _strong(value):
    """The holder, or None where it was collected."""
    if value is None:
        return None
    if isinstance(value, tuple):
        held = tuple(ref() for ref in value)
        return None if any(v is None for v in held) else held
    return value()


_HOLDERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def holders(param) -> Holders | None:
    return _HOLDERS.get(param)


def held_by(param, role: str):
    """What holds ``param`` in ``role`` (a Holders field), or None."""
    entry = _HOLDERS.get(param)
    return None if entry is None else _strong(getattr(entry, role))


def hold(param, **roles) -> None:
    """Record who holds ``param``: ``hold(p, optimizer=opt)``."""
    entry = _HOLDERS.get(param)
    if entry is None:
        entry = _HOLDERS[param] = Holders()
    for role, value in roles.items():
        setattr(entry, role, _weak(value))


def let_go(param, *roles: str) -> None:
    """Forget ``roles`` of ``param`` (an engine's close()); the entry goes with its last."""
    entry = _HOLDERS.get(param)
    if entry is None:
        return
    for role in roles:
        setattr(entry, role, None)
    if entry.empty():
        del _HOLDERS[param]


def held_count(role: str) -> int:
    """How many live parameters are held in ``role`` (the drop-in install's reference count)."""
    return sum(1 for entry in list(_HOLDERS.values())
               if _strong(getattr(entry, role)) is not None)
