"""Stage 3's gather order and what follows from it: the first step records, per phase, the
order in which segments are first requested (backward runs the other way); later steps
prefetch along it within stage3_prefetch_bucket_size, keep a segment released in forward that
backward needs again within stage3_max_reuse_distance, and read ahead from the drive (NVMe
parameter offload)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from ...config import auto_stage3_window
from ..layout.flat_param_group import FlatParamGroup

Key = tuple[int, int]  # (index of the partitioned group, segment)


class Phase(enum.Enum):
    """The pass under way: the fetcher records (first step) and follows (after) one gather
    order per phase."""
    FORWARD = "forward"
    BACKWARD = "backward"


class FetchMode(enum.Enum):
    """How the fetcher gathers: the first step records the order of first requests in each
    phase and gathers on demand; every later step prefetches along that order."""
    RECORDING = "recording the gather order"
    FOLLOWING = "prefetching along the recorded order"


@dataclass
class _Order:
    """Segments in the order they were first requested in one training step."""
    keys: list[Key] = field(default_factory=list)
    seen: set[Key] = field(default_factory=set)

    def add(self, key: Key) -> None:
        if key not in self.seen:
            self.seen.add(key)
            self.keys.append(key)


class PrefetchPlan:
    """Mixed into ParamFetcher; reads its recorded orders (``_orders``, ``_positions``,
    ``_before``, ``_reached``, ``_phase``, ``recording``), its windows and what is gathered,
    and starts gathers with its ``_start``."""

    def _reused_soon(self, key: Key) -> bool:
        """Whether a segment released in forward is used again in the backward soon enough to
        keep it: within ``max_reuse_numel`` elements gathered from here (the rest of forward,
        then backward up to it, along the recorded order) and under ``max_live_numel``.
        Only forward -> backward: a segment kept past backward would be stale after the
        optimizer step and gathered again anyway."""
        if self._phase is not Phase.FORWARD or self.max_reuse_numel <= 0 \
                or self.recording or not torch.is_grad_enabled() \
                or key not in self._positions[Phase.BACKWARD]:
            return False
        here = max(self._reached[Phase.FORWARD], self._positions[Phase.FORWARD].get(key, -1))
        forward = self._before[Phase.FORWARD]
        distance = forward[-1] - forward[min(here + 1, len(forward) - 1)] + \
            self._before[Phase.BACKWARD][self._positions[Phase.BACKWARD][key]]
        if distance > self.max_reuse_numel:
            return False
        # kept, it must still leave room under max_live for a module of its size to gather
        # (summed over what is gathered: only for a segment within the reuse distance)
        return self.gathered_numel() + self._segment_numel(key) <= self.max_live_numel

    def _prefetch_after(self, keys: list[Key]) -> None:
        order, positions = self._orders[self._phase], self._positions[self._phase]
        if not order:
            return
        position = max((positions.get(k, -1) for k in keys), default=-1)
        if position < 0:
            return
        position = max(position, self._reached[self._phase])
        if self.prefetch_numel > 0:
            self._reached[self._phase] = position
            budget = self.prefetch_numel
            live = self.gathered_numel()
            for key in order[position + 1:]:
                numel = self._segment_numel(key)
                if numel > budget or live + numel > self.max_live_numel:
                    break
                budget -= numel
                if key not in self.gathered:
                    self._start(key, prefetch=True)
                    live += numel
        self._read_ahead(order[position + 1:])  # from the drive: even without prefetching

    def _read_ahead(self, keys: list[Key]) -> None:
        """offload_param nvme: start reading the chunks of the segments coming next from the
        drive (ParamSwap bounds how many), so the gathers beyond the window find them."""
        swap = self.groups[0].param_swap if self.groups else None
        if swap is not None:
            swap.read_ahead([(self.groups[gi].param_index, s) for gi, s in keys[:256]
                             if (gi, s) not in self.gathered])


def auto_window(groups: list[FlatParamGroup]) -> int:
    """Stage 3's "auto" prefetch window and reuse distance for these groups (config/auto.py's
    auto_stage3_window)."""
    sizes = [seg.numel for g in groups for seg in g.layout.segments]
    return auto_stage3_window(sum(sizes), max(sizes, default=0))
