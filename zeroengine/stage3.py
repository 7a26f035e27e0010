"""Stage 3: gather a module's parameter segments just before it runs, release them after.

Every module that directly holds partitioned parameters (a tied parameter counts for each module
holding it) gets:
- a forward pre-hook that gathers (all-gathers) the segments its parameters live in, and a
  forward hook that releases them; references are counted, so nested and repeated calls work;
- on its forward outputs, an identity autograd function whose backward gathers the same segments
  again just before the module's own backward runs (the pre-backward "unshard").
In backward a segment is released as soon as every parameter in it has had its gradient reduced
(GradReducer calls ``on_segment_reduced``), and whatever is still gathered when backward ends
is released then (parameters that got no gradient).

Releasing empties the storage of the segment's full tensor (see partition.py); gathering
refills it, so the model's parameter objects never change.

Prefetch: the first forward+backward records the order in which segments are first requested.
Afterwards, requesting one also starts the all-gathers of the following segments in that order,
up to ``prefetch_numel`` elements ahead, so the next module's parameters are on the way while this
one computes. Another order (dynamic control flow) stays correct: a segment not prefetched is
gathered on demand, and one prefetched but never used is released when the pass ends.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .comm import Comm, Handle
from .partition import FlatParamGroup

Key = tuple[int, int]  # (index of the partitioned group, segment)


@dataclass
class _Gathered:
    handle: Handle | None  # the all-gather, until waited for
    refs: int = 0  # forward calls holding it
    in_backward: bool = False  # gathered for a backward computation


class _PreBackward(torch.autograd.Function):
    """Identity on the module's outputs; its backward gathers the module's parameters."""

    @staticmethod
    def forward(ctx, fetcher, keys, *outputs):
        ctx.fetcher, ctx.keys = fetcher, keys
        return tuple(o.detach() for o in outputs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.fetcher.gather_for_backward(ctx.keys)
        return (None, None) + grads


@dataclass
class _Order:
    """Segments in the order they were first requested in one training step."""
    keys: list[Key] = field(default_factory=list)
    seen: set[Key] = field(default_factory=set)

    def add(self, key: Key) -> None:
        if key not in self.seen:
            self.seen.add(key)
            self.keys.append(key)


class ParamFetcher:
    def __init__(self, module: nn.Module, groups: list[FlatParamGroup], comm: Comm,
                 prefetch_numel: int = 50_000_000, max_live_numel: int = 1_000_000_000):
        self.groups = groups
        self.comm = comm
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.gathered: dict[Key, _Gathered] = {}
        where: dict[int, Key] = {}
        for gi, g in enumerate(groups):
            for s, seg in enumerate(g.layout.segments):
                for i in seg.params:
                    where[id(g.params[i])] = (gi, s)
        self._hooks = []
        self.module_keys: dict[nn.Module, list[Key]] = {}
        for mod in module.modules():
            keys = sorted({where[id(p)] for p in mod.parameters(recurse=False)
                           if id(p) in where})
            if keys:
                self.module_keys[mod] = keys
                self._hooks.append(mod.register_forward_pre_hook(self._pre_forward))
                self._hooks.append(mod.register_forward_hook(self._post_forward))
        self._hooks.append(module.register_forward_hook(self._after_root_forward))
        # The first step records the order of first requests, per phase (backward runs the
        # other way); later steps prefetch along it.
        self._recording: dict[str, _Order] | None = {"forward": _Order(), "backward": _Order()}
        self._orders: dict[str, list[Key]] = {"forward": [], "backward": []}
        self._positions: dict[str, dict[Key, int]] = {"forward": {}, "backward": {}}
        self._phase = "forward"
        self.gathers = 0  # all-gathers issued (for tests and reports)

    # -- module hooks ------------------------------------------------------------------------
    def _pre_forward(self, module, args):
        self.acquire(self.module_keys[module])

    def _post_forward(self, module, args, output):
        keys = self.module_keys[module]
        self.release(keys)
        if torch.is_grad_enabled():
            return _wrap_outputs(output, lambda outs: _PreBackward.apply(self, keys, *outs))
        return None

    def _after_root_forward(self, module, args, output):
        if not torch.is_grad_enabled():  # no backward follows: drop unused prefetches now
            self.release_unheld()

    # -- gather / release ----------------------------------------------------------------------
    def _segment_numel(self, key: Key) -> int:
        return self.groups[key[0]].layout.segments[key[1]].numel

    def _start(self, key: Key) -> _Gathered:
        gi, s = key
        g = self.groups[gi]
        full = g.segment_full[s]
        full.untyped_storage().resize_(full.numel() * full.element_size())
        entry = _Gathered(self.comm.all_gather(full, g.chunk(s), async_op=True))
        self.gathered[key] = entry
        self.gathers += 1
        return entry

    def _ready(self, key: Key) -> _Gathered:
        entry = self.gathered.get(key) or self._start(key)
        if entry.handle is not None:
            entry.handle.wait()
            entry.handle = None
        if self._recording is not None:
            self._recording[self._phase].add(key)
        return entry

    def _free(self, key: Key) -> None:
        entry = self.gathered.pop(key)
        if entry.handle is not None:
            entry.handle.wait()  # never free memory a collective is still writing
        self.groups[key[0]].segment_full[key[1]].untyped_storage().resize_(0)

    def acquire(self, keys: list[Key]) -> None:
        """Gather ``keys`` (if needed) and hold them until ``release``."""
        for key in keys:
            self._ready(key).refs += 1
        self._prefetch_after(keys)

    def release(self, keys: list[Key]) -> None:
        for key in keys:
            entry = self.gathered[key]
            entry.refs -= 1
            if entry.refs == 0 and not entry.in_backward:
                self._free(key)

    def gather_for_backward(self, keys: list[Key]) -> None:
        self._phase = "backward"
        for key in keys:
            self._ready(key).in_backward = True
        self._prefetch_after(keys)

    def on_segment_reduced(self, group: FlatParamGroup, segment: int) -> None:
        """Every parameter of the segment has its gradient: backward needs it no more."""
        key = (self.groups.index(group), segment)
        entry = self.gathered.get(key)
        if entry is not None and entry.refs == 0:
            self._free(key)

    def end_of_pass(self) -> None:
        """After backward (or a forward without backward): release all that is not held, and
        fix the prefetch order after the first step."""
        self.release_unheld()
        self._phase = "forward"
        if self._recording is not None and self._recording["backward"].keys:
            for phase, order in self._recording.items():
                self._orders[phase] = order.keys
                self._positions[phase] = {k: i for i, k in enumerate(order.keys)}
            self._recording = None

    def release_unheld(self) -> None:
        for key in [k for k, e in self.gathered.items() if e.refs == 0]:
            self._free(key)

    # -- prefetch ------------------------------------------------------------------------------
    def _prefetch_after(self, keys: list[Key]) -> None:
        order, positions = self._orders[self._phase], self._positions[self._phase]
        if not order or self.prefetch_numel <= 0:
            return
        position = max((positions.get(k, -1) for k in keys), default=-1)
        if position < 0:
            return
        budget = self.prefetch_numel
        live = self.gathered_numel()
        for key in order[position + 1:]:
            numel = self._segment_numel(key)
            if numel > budget or live + numel > self.max_live_numel:
                break
            budget -= numel
            if key not in self.gathered:
                self._start(key)
                live += numel

    def gathered_numel(self) -> int:
        return sum(self._segment_numel(k) for k in self.gathered)

    def gathered_nbytes(self) -> int:
        return sum(self.groups[k[0]].segment_full[k[1]].untyped_storage().nbytes()
                   for k in self.gathered)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _wrap_outputs(output, apply):
    """Pass the tensors of ``output`` that need gradients through ``apply`` (one call for all
    of them), keeping the container structure (tensor, tuple, list or dict)."""
    if isinstance(output, torch.Tensor):
        return apply((output,))[0] if output.requires_grad else output
    if isinstance(output, (tuple, list)):
        wanted = [i for i, o in enumerate(output) if isinstance(o, torch.Tensor) and
                  o.requires_grad]
        if not wanted:
            return output
        wrapped = apply(tuple(output[i] for i in wanted))
        items = list(output)
        for i, w in zip(wanted, wrapped):
            items[i] = w
        return type(output)(items) if isinstance(output, list) else (
            type(output)(*items) if hasattr(output, "_fields") else tuple(items))
    if isinstance(output, dict):
        wanted = [k for k, o in output.items() if isinstance(o, torch.Tensor) and o.requires_grad]
        if not wanted:
            return output
        wrapped = apply(tuple(output[k] for k in wanted))
        out = dict(output)
        out.update(zip(wanted, wrapped))
        return type(output)(out) if type(output) is not dict else out
    return output
