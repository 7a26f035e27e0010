"""The inner optimizers of a ShardedOptimizer: for each user optimizer and kind of update, one
optimizer of the user's class (or CPUAdam / FusedAdam / the 16-bit Adam in its place) over the
rank's master chunks (elementwise) or over the whole parameters the rank owns (tensor-wise)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...distributed.comm import Comm
from ...ops import CPUAdam, FusedAdam
from ..layout.flat_param_group import FlatParamGroup
from .chain import OptimizerChain
from .factory import (
    IMPLEMENTATION_KEYS,
    build_device_inner,
    build_host_inner,
    build_inner,
    build_mixed_inner,
    cpu_adam_mode,
)
from .kind import TENSORWISE, optimizer_kind
from .owner_step import OwnedParams
from .precision import LOW_MASTER, OptimizerPrecision


@dataclass
class InnerPart:
    """One inner optimizer: the user's class (or CPUAdam/FusedAdam in its place) over the flat
    groups of one user optimizer that share one kind of update."""
    optimizer: torch.optim.Optimizer
    kind: str  # optimizer_kind.ELEMENTWISE or TENSORWISE
    flat_groups: tuple[int, ...]  # indices into ShardedOptimizer.flat_groups
    copy_out: bool = False  # CPUAdam writing the low-precision copy in its pass (offload)
    fused: bool = False  # FusedAdam taking reduced gradients as they are (CUDA)
    mixed: bool = False  # CPUAdam over 16-bit masters and/or states (OptimizerPrecision)


@dataclass
class InnerParts:
    """What build_inner_parts made."""
    parts: list[InnerPart] = field(default_factory=list)
    owned: dict[int, OwnedParams] = field(default_factory=dict)  # flat group -> its owners
    part_of: dict[int, int] = field(default_factory=dict)  # flat group -> index into parts
    inner_of_outer: list[list[int]] = field(default_factory=list)  # user group -> inner groups
    inner: torch.optim.Optimizer | None = None  # the parts as one optimizer


def build_inner_parts(base: torch.optim.Optimizer, param_groups: list[dict],
                      flat_groups: list[FlatParamGroup], comm: Comm, offload,
                      precision: OptimizerPrecision) -> InnerParts:
    """One inner optimizer per (user optimizer, kind of update), over the rank's master
    chunks (elementwise) or the whole parameters it owns (tensorwise), chained so that
    ``inner`` reads like one optimizer (state, state_dict, param_groups). ``param_groups``:
    the user's group dicts (ShardedOptimizer's own)."""
    built = InnerParts()
    members = base.member_of_group() if isinstance(base, OptimizerChain) \
        else [base] * len(param_groups)
    kinds = [optimizer_kind(members[gi], group) for gi, group in enumerate(param_groups)]
    plan: dict[tuple[int, str], list[int]] = {}
    for fi, fg in enumerate(flat_groups):
        gi = fg.group_index
        plan.setdefault((id(members[gi]), kinds[gi]), []).append(fi)
    member_by_id = {id(m): m for m in members}
    built.inner_of_outer = [[] for _ in param_groups]
    inner_index = 0
    for (member_id, kind), flat_indices in plan.items():
        member = member_by_id[member_id]
        groups = []
        for fi in flat_indices:
            fg = flat_groups[fi]
            hyper = {k: v for k, v in param_groups[fg.group_index].items()
                     if k not in IMPLEMENTATION_KEYS}
            if kind == TENSORWISE:
                owned = built.owned[fi] = OwnedParams(fg, comm)
                params = owned.params
            else:
                params = list(fg.master_segments)
            groups.append({"params": params, **hyper})
            built.inner_of_outer[fg.group_index].append(inner_index)
            inner_index += 1
            built.part_of[fi] = len(built.parts)
        fg0 = flat_groups[flat_indices[0]]
        mixed = _needs_mixed(member, kind, [flat_groups[fi] for fi in flat_indices], precision)
        if mixed:
            optimizer = build_mixed_inner(member, groups, precision)
        elif kind == TENSORWISE:
            for fi in flat_indices:  # a constructor may look at the values
                built.owned[fi].acquire()
            optimizer = build_inner(member, groups)
            for fi in flat_indices:
                built.owned[fi].release()
        elif offload is None:
            optimizer = build_device_inner(member, groups, torch.device(fg0.device))
        else:
            optimizer = build_host_inner(member, groups)
        built.parts.append(InnerPart(
            optimizer, kind, tuple(flat_indices),
            # CPUAdam writes the bf16/fp16 copy of what it updates in the same pass
            copy_out=offload is not None and isinstance(optimizer, CPUAdam),
            # FusedAdam (CUDA) also takes the gradient as it is (bf16, scaled) with the
            # unscale / clip coefficient, so no fp32 copy or scaling pass precedes it
            fused=offload is None and isinstance(optimizer, FusedAdam),
            mixed=mixed))
    built.inner = OptimizerChain([part.optimizer for part in built.parts]) \
        if len(built.parts) != 1 else built.parts[0].optimizer
    return built


def _needs_mixed(member, kind: str, fgs: list[FlatParamGroup],
                 precision: OptimizerPrecision) -> bool:
    """Whether these groups step with 16-bit masters or states (CPUAdam's mixed step);
    refuses, by name, an optimizer that cannot (only Adam/AdamW computes its update in
    fp32 and rounds it into 16-bit storage here)."""
    low_master = any(fg.master_format == LOW_MASTER for fg in fgs)
    if not low_master and precision.states == torch.float32:
        return False
    keys = ([f"{'fp16.fp16' if fgs[0].dtype == torch.float16 else 'bf16.bf16'}"
             "_master_weights_and_grads"] if low_master else []) + \
        (["bf16.bf16_optimizer_states"] if precision.states != torch.float32 else [])
    name = type(member).__name__
    if kind == TENSORWISE:
        raise ValueError(
            f"{' and '.join(keys)}: {name} updates whole tensors (tensor-wise) and keeps its "
            "own state dtypes; zeroengine rounds 16-bit masters and states only in its fused "
            "Adam/AdamW step. Use bf16.store_param_remainders (exact, any optimizer) or "
            "leave these keys off for it")
    if cpu_adam_mode(member) is None:
        raise ValueError(
            f"{' and '.join(keys)}: supported for torch.optim.Adam/AdamW (without amsgrad, "
            f"maximize, differentiable, capturable or a tensor lr), whose update the fused "
            f"step computes in fp32 and rounds into 16-bit storage; {name} would compute in "
            "bf16 itself. Use bf16.store_param_remainders (exact, any optimizer) instead")
    return True
