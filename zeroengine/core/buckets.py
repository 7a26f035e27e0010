"""What GradReducer (grad_reducer.py) works with: a ``Bucket`` per segment (one segment's
gradient on its way to being reduced), the ``ReductionState`` of the backward -> step cycle,
its ``ReduceSettings`` from the config, and the listener protocols of the collaborators it
tells what backward finished (stage 3's ParamFetcher, the optimizer offload)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..handles import Handle
from .layout.flat_param_group import FlatParamGroup


class Bucket:
    """One segment's gradient on its way to being reduced."""

    def __init__(self, group: FlatParamGroup, segment: int):
        self.group = group
        self.segment = segment
        self.param_indices = group.layout.segments[segment].params
        self.ready: set[int] = set()
        self.staging: torch.Tensor | None = None  # no full buffer: the segment's gradients
        self.handle: Handle | None = None  # its collective, while in flight
        self.counted = 0  # bytes of its temporary buffers (GradReducer._staged)
        self.finish = None  # callable run after the handle completes
        # hybrid sharding: the group's reduced chunk, to be all-reduced across the groups once
        # the reduce-scatter inside the group is done (then None: the second phase is on)
        self.cross: torch.Tensor | None = None

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.param_indices)


@dataclass
class ReductionState:
    """Where the reducer is in the cycle backward -> ... -> backward -> step (zero_grad)."""
    owned_valid: list[bool]  # per group: its owned shard holds this cycle's reduced gradient
    backwards_since_step: int = 0
    in_backward: bool = False
    reduce_now: bool = False  # this backward reduces (else stages 0-1 keep gradients local)
    final: bool = False  # this backward's reductions are the last before the step
    next_launch: int = 0  # index into the launch order of the next bucket to launch
    unreduced: bool = False  # stages 0-1: local gradients not yet reduced
    rescale_pending: bool = False  # stage 1 in place: see GradReducer._prepare_next_reduction
    defer_reduction: bool = False  # engine.no_sync()
    # engine.set_gradient_accumulation_boundary(): the caller says whether the next backward
    # ends an accumulation (a trainer's short last group of an epoch); None: count backwards
    boundary_override: bool | None = None
    scaled_backward: bool = False  # inside engine.backward (fp16 needs the loss scale)
    in_flight: list[Bucket] = field(default_factory=list)  # launched, in launch order


class PassListener(Protocol):
    """What stage 3 (ParamFetcher) hears from the reducer during backward."""

    def grads_taken(self, group: FlatParamGroup, segment: int) -> None:
        """Every parameter of the segment has its gradient: backward needs it no more."""

    def end_of_pass(self) -> None:
        """Backward ended (all its buckets are launched)."""


class ReducedGradListener(Protocol):
    """What the optimizer offload (OptimizerOffload) hears from the reducer."""

    def grad_reduced(self, group: FlatParamGroup, segment: int, grad: torch.Tensor,
                     final: bool) -> None:
        """The rank's reduced gradient of a segment landed in its owned chunk; ``final``: no
        backward changes it before the step."""


@dataclass(frozen=True)
class ReduceSettings:
    """How gradients are reduced (the config's keys, resolved once by the engine)."""
    accumulation_steps: int  # backwards per optimizer step (gradient_accumulation_steps)
    overlap: bool  # zero_optimization.overlap_comm: launch buckets during backward
    reduce_scatter: bool  # zero_optimization.reduce_scatter (False: all-reduce, keep own part)
    reduce_dtype: torch.dtype | None  # communication_data_type (None: each group's dtype)
    loss_scaled: bool  # fp16: a backward outside engine.backward lacks the loss scale
    quantize_block: int = 0  # > 0: reduce-scatter as blockwise int8 (ZeRO++ qgZ)
