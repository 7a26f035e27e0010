"""Gradient buckets: reduce each segment's gradient as soon as backward has produced it.

One ``Bucket`` per segment of every FlatParamGroup. A post-accumulate-grad hook on each
parameter marks it ready; when a bucket is complete its collective is launched asynchronously
(``_start_reduce``) while autograd computes the rest of backward, and the end-of-backward
callback (``_end_backward``) launches what is left and waits for it (``_finish_reduce``).

Ordering: every rank must issue the same collectives in the same order, even when a parameter
gets no gradient on one rank only. Buckets are therefore launched strictly in a fixed order (the
order backward usually completes them); a bucket that is ready early waits for its
predecessors, and at the end of backward the rest are launched in order, absent gradients
counting as zero.

Where gradients live, by stage:
- 0 and 1: a persistent full-size flat gradient buffer per group; each ``param.grad`` is a view
  into it, so autograd accumulates micro-steps in place. Communication happens only in the
  backward of the accumulation boundary: all-reduce (stage 0) or reduce-scatter (stage 1) whose
  output is the rank's own chunk of that same buffer, so no second gradient copy exists.
- 2: no full buffer. A hook copies ``param.grad`` into its bucket's staging tensor and drops it;
  every micro-step's buckets are reduce-scattered and added into the owned shard, and staging is
  freed, so gradient memory per rank is ~1/N plus the buckets in flight.

Reduce dtype: gradients travel in ``reduce_dtype`` (the config's communication_data_type,
default the compute dtype). When it differs from the parameters' dtype, stages 0-1 send a
converted copy of each bucket and the reduced shard is kept in ``reduce_dtype``.
"""
from __future__ import annotations

import contextlib

import torch

from ..distributed.comm import Comm
from ..ops import host_pool
from .buckets import (
    Bucket,
    PassListener,
    ReducedGradListener,
    ReduceSettings,
    ReductionState,
)
from .layout.flat_param_group import FlatParamGroup
from .layout.partition import FlatBuffer
from .offload.host_memory import zeros_on_demand
from .sharding import Sharding


class GradReducer:
    """Reduces gradients during backward, bucket by bucket, and tells its listeners:
    ``fetcher`` (stage 3, a PassListener) when a segment's gradients are all taken and when
    backward ends, ``offload`` (a ReducedGradListener) when a bucket's reduced gradient has
    landed in the rank's owned chunk."""

    def __init__(self, groups: list[FlatParamGroup], comm: Comm, sharding: Sharding,
                 settings: ReduceSettings, *, param_order: dict[int, int] | None = None,
                 fetcher: PassListener | None = None,
                 offload: ReducedGradListener | None = None, replicas: Comm | None = None,
                 hierarchy: tuple[Comm, Comm] | None = None):
        """``comm``: the ranks a group is sharded over; ``replicas`` (hybrid sharding): the
        ranks holding the same shard in the other shard groups, across which each reduced
        chunk is all-reduced (only the rank's 1/K of the gradient crosses groups)."""
        self.groups = groups
        self.comm, self.sharding, self.settings = comm, sharding, settings
        self.replicas = replicas
        self.hierarchy = hierarchy  # qgZ: (node, across) for the two-hop int8 exchange
        self.reduce_dtype = settings.reduce_dtype
        self.fetcher, self.offload = fetcher, offload
        # Per-flat-group lists are indexed by position in ``groups``; one optimizer group can own
        # several flat groups (stage 3 keeps small parameters whole beside partitioned ones).
        self._index = {id(g): i for i, g in enumerate(groups)}
        # Without a full buffer, at most this many staging elements are in flight; past it,
        # backward waits for the oldest bucket (two buckets' worth: one filling, one on the wire).
        self.max_staging_numel = 2 * max((seg.numel for g in groups
                                          for seg in g.layout.segments), default=0)
        self.buckets = [Bucket(g, s) for g in groups for s in range(len(g.layout.segments))]
        # Launch order: by when backward completes a bucket, i.e. by the position of its
        # earliest-registered parameter (backward runs roughly in reverse registration order).
        if param_order is not None:
            self.buckets.sort(key=lambda b: -min(param_order[id(b.group.params[i])]
                                                 for i in b.param_indices))
        self._where: dict[int, tuple[Bucket, int]] = {}
        for b in self.buckets:
            for i in b.param_indices:
                self._where[id(b.group.params[i])] = (b, i)

        device = groups[0].device if groups else torch.device("cpu")
        # Full-size gradient buffers (stages 0-1); param.grad are views into them.
        self.full_grads: list[FlatBuffer | None] = []
        for g in groups:
            if sharding.full_gradient_buffer:
                buf = FlatBuffer(g.layout, g.dtype, device)
                for i, p in enumerate(g.params):
                    p.grad = buf.param_view(i)
                self.full_grads.append(buf)
            else:
                self.full_grads.append(None)
        # A separate reduced-gradient shard where the full buffer cannot hold it: stage 2 (no
        # full buffer), or stage 1 reducing in another dtype. Otherwise the chunk of the full
        # buffer is the shard (stage 1 reduce-scatters in place; stage 0 owns everything).
        self.owned: list[torch.Tensor | None] = [
            zeros_on_demand(g.layout.shard_numel, self._reduce_dtype(g), device)
            if sharding.gradients or (sharding.optimizer_state and self._reduce_dtype(g) != g.dtype)
            else None
            for g in groups]
        self.state = ReductionState(owned_valid=[False] * len(groups))
        self.backward_count = 0  # backwards ever finished (never reset)
        # stage 2-3 staging and accumulation buffers in flight now, and their high-water mark
        # since reset_peak (memory_report)
        self._staging_bytes = 0
        self.peak_staging_bytes = 0
        self.on_backward_end = None  # called after each backward pass (wall_clock_breakdown)
        self._hooks = []
        for g in groups:
            for p in g.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
        self._reduces_in_place = sharding.optimizer_state and sharding.full_gradient_buffer \
            and any(o is None for o in self.owned)
        if self._reduces_in_place:  # see _prepare_next_reduction
            for g in groups:
                for p in g.params:
                    self._hooks.append(p.register_hook(self._before_accumulate))

    def _staged(self, b: Bucket, buf: torch.Tensor) -> torch.Tensor:
        """Count a bucket's temporary buffer until _finish_reduce lets it go."""
        b.counted += buf.numel() * buf.element_size()
        self._staging_bytes += buf.numel() * buf.element_size()
        self.peak_staging_bytes = max(self.peak_staging_bytes, self._staging_bytes)
        return buf

    def staging_nbytes(self) -> int:
        return self._staging_bytes

    def reset_peak(self) -> None:
        self.peak_staging_bytes = self._staging_bytes

    def _reduce_dtype(self, g: FlatParamGroup) -> torch.dtype:
        return self.reduce_dtype or g.dtype

    @property
    def backwards_since_step(self) -> int:
        return self.state.backwards_since_step

    @contextlib.contextmanager
    def scaled_backward(self):
        """engine.backward's loss.backward(): its loss carries the loss scale."""
        self.state.scaled_backward = True
        try:
            yield
        finally:
            self.state.scaled_backward = False

    @contextlib.contextmanager
    def deferred(self):
        """engine.no_sync(): stages 0-1 keep gradients local (reduced by a later backward or
        the step); stages 2-3 hold no full gradient, so they reduce as always."""
        before, self.state.defer_reduction = self.state.defer_reduction, True
        try:
            yield
        finally:
            self.state.defer_reduction = before

    # -- backward-time ------------------------------------------------------------------------
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self.state.in_backward:
            self._begin_backward()
        bucket, index = self._where[id(param)]
        if index in bucket.ready:
            raise RuntimeError(
                f"parameter {tuple(param.shape)} received its gradient twice in one backward "
                "pass; zeroengine reduces each parameter once per backward (reentrant "
                "checkpointing does this: use torch.utils.checkpoint(..., use_reentrant=False))")
        g = bucket.group
        layout = g.layout
        if self.sharding.full_gradient_buffer:
            view = self.full_grads[self._index[id(g)]].param_view(index)
            if param.grad is not view:
                # The user replaced or cleared .grad (e.g. model.zero_grad()): autograd made a new
                # tensor holding the whole accumulated gradient; move it back into the buffer.
                view.copy_(param.grad)
                param.grad = view
        else:
            seg = layout.segments[bucket.segment]
            if bucket.staging is None:
                # Uninitialised: every byte is written by a gradient, or zeroed at launch
                # (padding, parameters that got none) - one memory pass saved per micro-step.
                bucket.staging = self._staged(bucket, host_pool.empty(
                    seg.numel, self._reduce_dtype(g), g.device))
            bucket.staging[seg.local(layout.slots[index])].copy_(param.grad.reshape(-1))
            param.grad = None
        bucket.ready.add(index)
        if self.fetcher is not None and bucket.complete:
            self.fetcher.grads_taken(g, bucket.segment)
        if self.state.reduce_now and self.settings.overlap:
            self._launch_ready()

    def _begin_backward(self) -> None:
        st = self.state
        if self.settings.loss_scaled and not st.scaled_backward:
            raise RuntimeError("fp16 training needs engine.backward(loss), which applies the "
                               "loss scale; a plain loss.backward() was called")
        st.in_backward = True
        counted = (st.backwards_since_step + 1) % self.settings.accumulation_steps == 0
        boundary = (counted if st.boundary_override is None else st.boundary_override) \
            and not st.defer_reduction
        st.reduce_now = self.sharding.gradients or boundary
        st.final = boundary
        st.next_launch = 0
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _launch_ready(self) -> None:
        st = self.state
        while st.next_launch < len(self.buckets) and self.buckets[st.next_launch].complete:
            self._start_reduce(self.buckets[st.next_launch])
            st.next_launch += 1
        self._reap()

    def _reap(self) -> None:
        """Finish buckets whose collective is done (freeing staging memory while backward
        still runs); wait for the oldest while staging in flight is over budget."""
        in_flight = self.state.in_flight
        while in_flight:
            over = self.sharding.gradients and sum(
                b.staging.numel() for b in in_flight if b.staging is not None
            ) > self.max_staging_numel
            if not (over or in_flight[0].handle.done()):
                return
            self._finish_reduce(in_flight[0])

    def _end_backward(self) -> None:
        st = self.state
        if st.reduce_now:
            self._reduce_all()
        else:
            st.unreduced = True
        for b in self.buckets:
            b.ready.clear()
        st.backwards_since_step += 1
        self.backward_count += 1
        st.in_backward = False
        if self.fetcher is not None:
            self.fetcher.end_of_pass()
        if self.on_backward_end is not None:
            self.on_backward_end()

    def _reduce_all(self) -> None:
        """Launch every bucket not yet launched, in order, then wait for all of them."""
        st = self.state
        while st.next_launch < len(self.buckets):
            self._start_reduce(self.buckets[st.next_launch])
            st.next_launch += 1
            self._reap()
        while st.in_flight:
            self._finish_reduce(st.in_flight[0])
        # Only now: a bucket finished mid-backward must not make a later bucket of the same
        # pass accumulate onto the stale shard.
        st.owned_valid = [True] * len(self.groups)
        st.unreduced = False
        if self.sharding.optimizer_state and self.sharding.full_gradient_buffer:
            self._prepare_next_reduction()

    def _prepare_next_reduction(self) -> None:
        """Stage 1: another backward may come before the step (a plain loop that accumulates
        with several loss.backward() calls, whatever gradient_accumulation_steps says); its
        reduction must *add* the mean of the new local gradients to what is reduced already,
        as DDP does. The full buffer still holds this rank's unreduced gradients outside its own
        chunks: zero them, so autograd accumulates only the new ones there. In-place reduction
        (the own chunk lives in the full buffer) averages the own chunk with the others' again:
        the next backward first multiplies it by the world size (``_before_accumulate``, a
        hook that runs before autograd adds into the buffer), so that average gives back the
        reduced value plus the mean of the new gradients."""
        for gi, g in enumerate(self.groups):
            buf = self.full_grads[gi]
            if self.owned[gi] is not None:
                buf.data.zero_()  # the reduced shard lives apart: nothing here is needed
                continue
            for s, seg in enumerate(g.layout.segments):
                view = buf.segment_view(s)
                own = seg.own_chunk_local(g.rank)
                view[:own.start].zero_()
                view[own.stop:].zero_()
            self.state.rescale_pending = True

    def _before_accumulate(self, grad: torch.Tensor) -> None:
        """Stage 1, in place: the first gradient of a backward that follows a reduction."""
        if self.state.rescale_pending:
            self.state.rescale_pending = False
            for gi, g in enumerate(self.groups):
                if self.owned[gi] is None:
                    for s in range(len(g.layout.segments)):
                        self.full_grads[gi].chunk_view(s, g.rank).mul_(self.comm.world_size)
        return None

    # -- one bucket -----------------------------------------------------------------------------
    def _start_reduce(self, b: Bucket) -> None:
        g = b.group
        gi = self._index[id(g)]
        seg = g.layout.segments[b.segment]
        dtype = self._reduce_dtype(g)
        if self.sharding.full_gradient_buffer:
            grads = self.full_grads[gi].segment_view(b.segment)
            source = grads if dtype == g.dtype else grads.to(dtype)
        else:
            if b.staging is None:  # no parameter of this bucket got a gradient here
                b.staging = self._staged(b, host_pool.zeros(seg.numel, dtype, g.device))
            else:
                self._zero_unwritten(b)
            source = b.staging
        after = None
        def what():  # for an error message only
            return f"gradient bucket {b.segment} of param group {g.group_index} " \
                f"({seg.numel} elements)"
        if not self.sharding.optimizer_state:
            b.handle = self.comm.all_reduce(source, "avg", async_op=True, what=what)
            if source is not grads:
                after = lambda: grads.copy_(source)  # noqa: E731
        else:
            owned = self.owned_chunk(g, b.segment)
            accumulate = self.state.owned_valid[gi] and self.owned[gi] is not None
            out = self._staged(b, host_pool.empty(owned.numel(), owned.dtype, owned.device)) \
                if accumulate else owned
            if self.settings.quantize_block and self.hierarchy is not None:
                b.handle = self.comm.reduce_scatter_quantized_2hop(
                    out, source, self.settings.quantize_block, *self.hierarchy, "avg",
                    async_op=True, what=what)
            elif self.settings.quantize_block:
                b.handle = self.comm.reduce_scatter_quantized(
                    out, source, self.settings.quantize_block, "avg", async_op=True, what=what)
            else:
                b.handle = self.comm.reduce_scatter(
                    out, source, "avg", async_op=True,
                    via_all_reduce=not self.settings.reduce_scatter, what=what)
            if self.replicas is not None:
                b.cross = out
            if accumulate:
                after = lambda: owned.add_(out)  # noqa: E731
        b.finish = after
        self.state.in_flight.append(b)

    def owned_chunk(self, g: FlatParamGroup, segment: int) -> torch.Tensor:
        """Where the rank's reduced gradient for one segment lives."""
        gi = self._index[id(g)]
        if self.owned[gi] is None:
            return self.full_grads[gi].chunk_view(segment, g.rank)
        return g.layout.segments[segment].of_shard(self.owned[gi])

    @staticmethod
    def _zero_unwritten(b: Bucket) -> None:
        """Zero the staging regions no gradient wrote: padding and absent gradients."""
        layout = b.group.layout
        seg = layout.segments[b.segment]
        b.staging[seg.used:].zero_()
        if not b.complete:
            for i in b.param_indices:
                if i not in b.ready:
                    b.staging[seg.local(layout.slots[i])].zero_()

    def _finish_reduce(self, b: Bucket) -> None:
        b.handle.wait()
        if b.cross is not None:
            # hybrid: the group's mean is in; average it with the other groups' (the same
            # chunk on each), asynchronously. The bucket stays in flight for this phase.
            chunk, b.cross = b.cross, None
            b.handle = self.replicas.all_reduce(
                chunk, "avg", async_op=True,
                what=lambda: f"gradient bucket {b.segment} of param group "
                f"{b.group.group_index} across shard groups")
            return
        if b.finish is not None:
            b.finish()
        if self.offload is not None and self.sharding.optimizer_state:
            self.offload.grad_reduced(b.group, b.segment, self.owned_chunk(b.group, b.segment),
                                      self.state.final)
        b.handle, b.finish = None, None
        self._staging_bytes -= b.counted
        b.counted = 0
        b.staging = None  # stage 2: the bucket's memory goes back
        self.state.in_flight.remove(b)

    # -- step-time --------------------------------------------------------------------------------
    def flush(self) -> None:
        """Make the reduced gradients final: reduce what backward left local (stages 0-1, when
        step() comes before the configured boundary) and zero shards no backward wrote."""
        st = self.state
        if st.in_backward:
            raise RuntimeError("optimizer step called during backward")
        if st.unreduced:
            st.next_launch = 0
            st.final = True
            self._reduce_all()
        for gi, owned in enumerate(self.owned):
            if owned is not None and not st.owned_valid[gi]:
                owned.zero_()  # no backward wrote it since the last step
            st.owned_valid[gi] = True

    def owned_grad_segments(self, group: FlatParamGroup) -> list[torch.Tensor]:
        """The reduced gradient of every chunk the rank owns, aligned with master_segments."""
        gi = self._index[id(group)]
        if not self.sharding.optimizer_state:
            buf = self.full_grads[gi]
            return [buf.segment_view(s) for s in range(len(group.layout.segments))]
        return [self.owned_chunk(group, s) for s in range(len(group.layout.segments))]

    def zero_grad(self) -> None:
        for buf in self.full_grads:
            if buf is not None:
                buf.data.zero_()
        # Owned shards are overwritten by the next reduce-scatter: no pass over memory needed.
        self.state = ReductionState(owned_valid=[False] * len(self.groups),
                                    defer_reduction=self.state.defer_reduction,
                                    scaled_backward=self.state.scaled_backward)

    def nbytes(self) -> int:
        total = sum(b.data.numel() * b.data.element_size() for b in self.full_grads if b)
        total += sum(o.numel() * o.element_size() for o in self.owned if o is not None)
        total += sum(b.staging.numel() * b.staging.element_size() for b in self.buckets
                     if b.staging is not None)
        return total

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
