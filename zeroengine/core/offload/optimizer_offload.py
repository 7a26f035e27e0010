"""ZeRO-Offload: the rank's fp32 master weights, reduced gradients and optimizer state live in
host memory and the optimizer runs on the CPU.

One step, sub-group by sub-group (``zero_optimization.sub_group_size`` elements each):
  1. gradients: each bucket's reduced chunk is copied into its host fp32 buffer (in the compute
     dtype for a bf16/fp16 master, whose fused step widens it) as soon as its
     collective finishes in the last backward before the step (on CUDA: a non-blocking copy on
     a side stream, overlapping the rest of backward); the step waits only for the sub-group it
     is about to update, and copies now whatever no backward copied (an early step()).
  2. the CPU optimizer (CPUAdam for Adam/AdamW, else the user's class) updates the host master
     and, with CPUAdam, writes the bf16/fp16 parameter copy in the same pass.
  3. the updated values go back to where the model computes with them (on CUDA a non-blocking
     host->device copy on the side stream) while the next sub-group steps; a segment's
     all-gather waits for its copy's event on the device, not on the host.
On a CPU-only machine the host *is* the device: the same path runs with plain copies between
separate host buffers, no pinning and no streams - which is how it is tested here.
"""
from __future__ import annotations

import torch

from ...handles import Handle, copy_async
from ..layout.flat_param_group import FlatParamGroup
from ..layout.partition import shard_segment_views
from ..optim.precision import FP32_MASTER, LOW_MASTER

HOST = torch.device("cpu")


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, device=HOST, pin_memory=pin)


class OptimizerOffload:
    """Host-side buffers and copies of an offloaded optimizer step, per flat group."""

    def __init__(self, groups: list[FlatParamGroup], reduce_dtype: torch.dtype | None,
                 pin: bool, swap=None):
        """``reduce_dtype``: the dtype reduced gradients arrive in (None: each group's own).
        ``swap`` (NVMe offload, an OptimizerSwap; host memory is what is short there): no
        shard-sized host buffers - each sub-group's fp32 gradients are made when it steps, and
        its low-precision values bound for the device are staged in its tile's slot."""
        self.groups = groups
        self.swap = swap
        stream_grads = swap is not None
        self.reduce_dtype = reduce_dtype
        self._index = {id(g): i for i, g in enumerate(groups)}
        self.grads: list[list[torch.Tensor] | None] = []
        self.low: list[list[torch.Tensor] | None] = []
        self._convert = [self._needs_grad_copy(g) for g in groups]  # not usable as reduced
        for g, convert in zip(groups, self._convert):
            self.grads.append(self._host_views(g, self._grad_dtype(g), pin)
                              if convert and not stream_grads else None)
            # The bf16/fp16 values the optimizer writes go straight into the chunk when it is
            # in host memory; otherwise into a host staging buffer sent to the device after
            # (with NVMe: the tile's, from the swap).
            # (a low-precision master or remainders' upper halves are such values already)
            self.low.append(None if g.dtype == torch.float32 or self._chunk_on_host(g)
                            or swap is not None or g.master_format != FP32_MASTER
                            else self._host_views(g, g.dtype, pin))
        self._stage_in_swap = [swap is not None and g.dtype != torch.float32
                               and not self._chunk_on_host(g) for g in groups]
        self._grad_copies: dict[tuple[int, int], Handle] = {}  # copied for this step
        # parameter shard on the drive: the buffers the step writes chunks into, until publish
        self._targets: dict[tuple[int, int], torch.Tensor] = {}
        self._param_copies: list[Handle] = []

    @staticmethod
    def _chunk_on_host(g: FlatParamGroup) -> bool:
        """Whether the chunks the model computes with are in host memory (the optimizer can
        write them in place)."""
        return g.shard_device.type == "cpu" if g.partitioned else g.device.type == "cpu"

    def _grad_dtype(self, g: FlatParamGroup) -> torch.dtype:
        """The dtype of the host gradient the optimizer reads: fp32, or as reduced for a
        low-precision master (bf16_master_weights_and_grads: its fused step widens it)."""
        if g.master_format == LOW_MASTER:
            return self.reduce_dtype or g.dtype
        return torch.float32

    def _needs_grad_copy(self, g: FlatParamGroup) -> bool:
        """False where the reduced gradient already is in host memory in the dtype the
        optimizer reads: used in place."""
        reduce_dtype = self.reduce_dtype or g.dtype
        return g.device.type != "cpu" or reduce_dtype != self._grad_dtype(g)

    @staticmethod
    def _host_views(g: FlatParamGroup, dtype: torch.dtype, pin: bool) -> list[torch.Tensor]:
        return shard_segment_views(host_empty(g.layout.shard_numel, dtype, pin), g.layout)

    def grad_reduced(self, group: FlatParamGroup, segment: int, grad: torch.Tensor,
                     final: bool) -> None:
        """GradReducer: ``grad``, the rank's reduced gradient of a segment, landed; ``final``:
        no backward changes it before the step, so its host copy can start now."""
        fi = self._index[id(group)]
        if self.grads[fi] is None:
            return
        key = (fi, segment)
        if final:
            self._grad_copies[key] = copy_async(self.grads[fi][segment], grad)
        else:
            self._grad_copies.pop(key, None)

    # -- used by ShardedOptimizer.step ----------------------------------------------------------
    def grad_segment(self, fi: int, s: int, device_grad: torch.Tensor) -> torch.Tensor:
        """The host gradient of segment s of flat group fi (fp32, or as reduced beside a
        low-precision master: ``_grad_dtype``), ready for the CPU to read."""
        if self.grads[fi] is None:  # used as reduced, or converted now (stream_grads)
            return device_grad.to(HOST, self._grad_dtype(self.groups[fi])) \
                if self._convert[fi] else device_grad
        host = self.grads[fi][s]
        key = (fi, s)
        if key in self._grad_copies:
            self._grad_copies[key].host_wait()
        else:
            host.copy_(device_grad)
        return host

    def copy_out_target(self, fi: int, s: int) -> torch.Tensor | None:
        """Where the optimizer may write segment s's updated low-precision values in its own
        pass; None in fp32 (the master itself is what gets copied)."""
        g = self.groups[fi]
        if g.dtype == torch.float32 or g.master_format != FP32_MASTER:
            return None  # the master itself holds the values to copy
        if self.low[fi] is not None:
            return self.low[fi][s]
        if self._stage_in_swap[fi]:  # the same bytes every call while the tile is in
            return self.swap.staging((fi, s), g.dtype)
        if (fi, s) not in self._targets:  # (nothing read from the drive to be overwritten)
            self._targets[(fi, s)] = g.chunk_for_overwrite(s)
        return self._targets[(fi, s)]

    def publish(self, fi: int, s: int, written: bool) -> Handle:
        """Send segment s's updated values to the chunk the model computes with. ``written``:
        the optimizer already wrote them into copy_out_target. Returns the copy's handle."""
        g = self.groups[fi]
        master = g.master_segments[s]
        if g.param_swap is not None:  # a host buffer the swap takes over: no copy to wait for
            target = self._targets.pop((fi, s), None)
            if target is None:
                target = g.chunk_for_overwrite(s)
                written = False
            if not written:
                target.copy_(master)
            g.chunk_written(s, target)
            return Handle()
        chunk = g.chunk(s)
        if g.dtype == torch.float32:
            source = master
        elif g.master_format != FP32_MASTER:
            source = g.weights_of_master(s)
        else:
            source = self.copy_out_target(fi, s)
            if not written:
                source.copy_(master)
        if source is chunk:
            return Handle()
        handle = copy_async(chunk, source)
        self._param_copies.append(handle)
        return handle

    def finish_step(self) -> None:
        """After the step (or a skipped one): later device work waits for the parameter
        copies, and no gradient copy is left reading buffers the next backward writes."""
        for handle in self._grad_copies.values():
            handle.host_wait()
        for handle in self._param_copies:
            handle.wait()
        self._grad_copies.clear()
        self._param_copies.clear()
        self._targets.clear()  # a step cut short: its unpublished chunks change nothing

    def nbytes(self) -> int:
        """Host bytes of the gradient and staging buffers."""
        total = 0
        for views in self.grads + self.low:
            if views:
                total += sum(v.numel() * v.element_size() for v in views)
        return total
