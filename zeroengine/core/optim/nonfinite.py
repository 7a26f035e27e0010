"""A step whose reduced gradient holds inf/NaN (without fp16 loss scaling): which parameter,
found over every rank's shard, for the message of on_nonfinite="raise"."""
from __future__ import annotations

import torch


def first_nonfinite(optimizer, grads: list[list[torch.Tensor]]) -> tuple | None:
    """(group, flat index, parameter name) of this rank's first inf/NaN gradient element."""
    for fi, fg in enumerate(optimizer.flat_groups):
        for s, g in enumerate(grads[fi]):
            bad = (~torch.isfinite(g)).nonzero()
            if bad.numel() == 0:
                continue
            seg = fg.layout.segments[s]
            start = seg.start if len(g) == seg.numel else seg.chunk_range(fg.rank)[0]
            flat_index = start + int(bad[0, 0])
            for i in seg.params:
                slot = fg.layout.slots[i]
                if slot.offset <= flat_index < slot.offset + slot.numel:
                    return fi, flat_index, optimizer.param_names.get(id(fg.params[i]),
                                                                f"#{i} of group {fi}")
    return None  # only padding is non-finite here, or nothing


def nonfinite_message(optimizer, grads: list[list[torch.Tensor]]) -> str:
    """Collective: the step and the first parameter (in model order over all ranks'
    shards) whose reduced gradient holds an inf/NaN."""
    found = first_nonfinite(optimizer, grads)
    everyone = [f for f in optimizer.comm.all_gather_object(found) if f is not None]
    if everyone:
        _, _, name = min(everyone)
        which = f"the gradient of {name!r} holds inf/NaN"
    else:
        which = "the gradient norm is not finite"
    return (f"step {optimizer.steps}: {which} (after the reduction over ranks, so any rank's "
            "data may have caused it). Without fp16 loss scaling nothing skips such a step; "
            "check the data and learning rate, or set \"on_nonfinite\": \"skip\" to skip "
            "these steps")
