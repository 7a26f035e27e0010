"""Updated parameters back into the model after an optimizer step: the other half of a step's
communication, beside GradReducer's (gradients out during backward).

``start(batch, written)`` makes the updated masters of a sub-group the model's values (master ->
the rank's chunk, through the offload's copy when there is one) and, at stages 1-2, starts
all-gathering those chunks so every rank holds the whole parameters again, keeping at most
allgather_bucket_size elements in flight; ``finish()`` waits for the gathers and has stage 3
refresh the segments it holds gathered across the step. As Megatron's start_param_sync /
finish_param_sync: ShardedOptimizer steps, this publishes.
"""
from __future__ import annotations

from ..distributed.comm import Comm
from ..handles import Handle
from .layout.flat_param_group import FlatParamGroup


class ParamSync:
    def __init__(self, flat_groups: list[FlatParamGroup], comm: Comm, bucket_numel: int,
                 offload=None, fetcher=None):
        """``offload``: OptimizerOffload (the host masters' copies to the chunks);
        ``fetcher``: stage 3's ParamFetcher (segments gathered across the step)."""
        self.flat_groups, self.comm, self.bucket_numel = flat_groups, comm, bucket_numel
        self.offload, self.fetcher = offload, fetcher
        self._in_flight: list[tuple[Handle, int]] = []

    def start(self, batch, written: set, copies: list[Handle] | None = None) -> None:
        """Make the updated masters of ``batch`` ((group, segment) pairs) the model's values,
        unless the step wrote them already (``written``), and start gathering whole groups'
        chunks to every rank (stages 1-2; stage 3 gathers on use instead). The offload's copies
        out of the masters are appended to ``copies``."""
        for fi, s in batch:
            fg = self.flat_groups[fi]
            copied = None
            if self.offload is not None:
                copied = self.offload.publish(fi, s, written=(fi, s) in written)
                if copies is not None:
                    copies.append(copied)
            elif (fi, s) not in written:
                fg.master_to_chunks([s])
            if fg.sharded and not fg.partitioned:
                if copied is not None:
                    copied.wait()  # the gather reads the chunk the copy writes
                self._all_gather_segment(fg, s)

    def finish(self, refresh: bool = False) -> None:
        """Wait for the gathers; then what is held whole across the step (stage 3's gathered
        segments, its secondary copies) is refreshed from the updated chunks - and everything,
        with ``refresh``, after a checkpoint load."""
        for handle, _ in self._in_flight:
            handle.wait()
        self._in_flight = []
        held = self.fetcher is not None and bool(self.fetcher.gathered or self.fetcher.secondary)
        if not (refresh or held):
            return
        if self.offload is not None:
            self.offload.finish_step()  # what is refreshed reads the updated chunks
        if self.fetcher is not None:
            self.fetcher.refresh_gathered()

    def _all_gather_segment(self, fg: FlatParamGroup, s: int) -> None:
        """Start gathering every rank's updated chunk of segment s, keeping at most
        ``bucket_numel`` elements in flight."""
        full = fg.full.segment_view(s)
        if sum(n for _, n in self._in_flight) + full.numel() > self.bucket_numel:
            for handle, _ in self._in_flight:
                handle.wait()
            self._in_flight = []
        handle = self.comm.all_gather(full, fg.chunk(s), async_op=True,
                                      what=lambda: f"updated parameters, segment {s} of "
                                      f"param group {fg.group_index}")
        self._in_flight.append((handle, full.numel()))
