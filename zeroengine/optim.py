"""ShardedOptimizer: a torch.optim.Optimizer to the outside, a step over the rank's shard inside.

Outside: ``param_groups`` are the user's own group dicts (the very same objects, so an lr
scheduler built on the user's optimizer still drives the learning rate), holding the model's
parameters. Inside: an optimizer of the user's class and hyperparameters whose parameters are
the rank's master chunks (one tensor per segment). Because the optimizer is elementwise, a step
over chunks of flat buffers equals the step over the original tensors.

A step: make gradients final (``GradReducer.flush``), compute the global norm over all shards,
clip, copy hyperparameters outer -> inner, step the chunks, then all-gather the updated chunks
so every rank holds the full parameters again (stages 1-2).
"""
from __future__ import annotations

import math

import torch

from .buckets import GradReducer
from .comm import Comm, Handle
from .optim_factory import IMPLEMENTATION_KEYS, build_inner
from .partition import FlatParamGroup


class ShardedOptimizer(torch.optim.Optimizer):
    def __init__(self, base: torch.optim.Optimizer, flat_groups: list[FlatParamGroup],
                 reducer: GradReducer, comm: Comm, clip: float = 0.0,
                 allgather_bucket_numel: int = 50_000_000):
        # Deliberately not calling Optimizer.__init__: it would copy the groups, and sharing the
        # user's dicts is what keeps their schedulers working.
        self.defaults = base.defaults
        self.param_groups = base.param_groups
        self.state = {}  # per-parameter state lives in the inner optimizer, by chunk
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self._optimizer_state_dict_pre_hooks = {}
        self._optimizer_state_dict_post_hooks = {}
        self._optimizer_load_state_dict_pre_hooks = {}
        self._optimizer_load_state_dict_post_hooks = {}
        self._zero_grad_profile_name = "ShardedOptimizer.zero_grad"
        self.base_class = type(base)
        self.flat_groups = flat_groups
        self.reducer = reducer
        self.comm = comm
        self.clip = clip
        self.allgather_bucket_numel = allgather_bucket_numel
        self.last_grad_norm: float | None = None
        inner_groups = []
        self._inner_of_outer: list[list[int]] = [[] for _ in self.param_groups]
        for fg in flat_groups:
            hyper = {k: v for k, v in self.param_groups[fg.group_index].items()
                     if k not in IMPLEMENTATION_KEYS}
            self._inner_of_outer[fg.group_index].append(len(inner_groups))
            inner_groups.append({"params": list(fg.master_segments), **hyper})
        self.inner = build_inner(base, inner_groups)

    def __repr__(self) -> str:
        return f"ShardedOptimizer({self.base_class.__name__}, rank {self.comm.rank} of " \
               f"{self.comm.world_size})"

    # -- the step -------------------------------------------------------------------------------
    def _sync_hyperparameters(self) -> None:
        for outer_index, inner_indices in enumerate(self._inner_of_outer):
            outer = self.param_groups[outer_index]
            for i in inner_indices:
                inner = self.inner.param_groups[i]
                for key, value in outer.items():
                    if key not in IMPLEMENTATION_KEYS:
                        inner[key] = value

    def global_grad_norm(self, grads: list[list[torch.Tensor]]) -> float:
        """L2 norm of the full (reduced) gradient: local sum of squares + one tiny all-reduce."""
        device = self.flat_groups[0].data.device if self.flat_groups else "cpu"
        total = torch.zeros(1, dtype=torch.float32, device=device)
        for segs in grads:
            for g in segs:
                total += torch.linalg.vector_norm(g, dtype=torch.float32) ** 2
        if any(fg.sharded for fg in self.flat_groups):
            self.comm.all_reduce(total, "sum")
        return math.sqrt(total.item())

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ShardedOptimizer.step() takes no closure: run forward and "
                             "backward first, then call step()")
        self._opt_called = True  # what torch's lr schedulers check (see _wrapped_by_lr_sched)
        self.reducer.flush()
        grads = [self.reducer.owned_grad_segments(fg) for fg in self.flat_groups]
        norm = self.global_grad_norm(grads)
        self.last_grad_norm = norm
        if self.clip > 0:
            # The same coefficient torch.nn.utils.clip_grad_norm_ applies.
            coef = min(self.clip / (norm + 1e-6), 1.0)
            if coef < 1.0:
                for segs in grads:
                    torch._foreach_mul_(segs, coef)
        for fg, segs in zip(self.flat_groups, grads):
            for master, grad in zip(fg.master_segments, segs):
                master.grad = grad if grad.dtype == master.dtype else grad.to(master.dtype)
        self._sync_hyperparameters()
        self.inner.step()
        for fg in self.flat_groups:
            for master in fg.master_segments:
                master.grad = None
            fg.publish_master()
        self._all_gather_params()

    # Tells torch's LRScheduler that step() already records _opt_called, so it does not warn.
    step._wrapped_by_lr_sched = True

    def _all_gather_params(self) -> None:
        """Every rank gets the updated chunks of the others, at most allgather_bucket_numel
        elements in flight."""
        in_flight: list[Handle] = []
        numel = 0
        for fg in self.flat_groups:
            if not fg.sharded:
                continue
            for s in range(len(fg.layout.segments)):
                full = fg.buffer.segment_view(s)
                if in_flight and numel + full.numel() > self.allgather_bucket_numel:
                    for h in in_flight:
                        h.wait()
                    in_flight, numel = [], 0
                in_flight.append(self.comm.all_gather(full, fg.buffer.chunk_view(s, fg.rank),
                                                      async_op=True))
                numel += full.numel()
        for h in in_flight:
            h.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffers. ``set_to_none`` is ignored: at stages 0-1 each
        ``param.grad`` is a view into a flat buffer, which must survive."""
        self.reducer.zero_grad()

    def add_param_group(self, param_group: dict) -> None:
        raise RuntimeError("parameter groups are fixed once zeroengine.initialize() has laid the "
                           "parameters out; add them to the optimizer before initialize()")

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's shard of the optimizer state and every group's hyperparameters.

        Loading needs the same world size and stage; checkpoints (engine.save_checkpoint) are the
        way to reshard."""
        inner = self.inner.state_dict()
        groups = []
        for group in self.param_groups:
            groups.append({k: v for k, v in group.items() if k != "params"})
        return {"state": inner["state"], "param_groups": groups,
                "inner_param_groups": inner["param_groups"],
                "zero": {"rank": self.comm.rank, "world_size": self.comm.world_size,
                         "stage": self.reducer.stage,
                         "shard_numels": [fg.layout.shard_numel for fg in self.flat_groups]}}

    def load_state_dict(self, state_dict: dict) -> None:
        meta = state_dict.get("zero")
        if meta is None:
            raise ValueError("this is not a zeroengine optimizer state dict (no 'zero' entry); "
                             "a plain torch optimizer state cannot be loaded into shards")
        mine = {"world_size": self.comm.world_size, "stage": self.reducer.stage,
                "shard_numels": [fg.layout.shard_numel for fg in self.flat_groups]}
        for key, value in mine.items():
            if meta[key] != value:
                raise ValueError(f"optimizer state was saved with {key}={meta[key]} but this "
                                 f"engine has {key}={value}; use engine.load_checkpoint(), which "
                                 "reshards")
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError(f"optimizer state has {len(state_dict['param_groups'])} param groups,"
                             f" this optimizer has {len(self.param_groups)}")
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self.inner.load_state_dict({"state": state_dict["state"],
                                    "param_groups": state_dict["inner_param_groups"]})

    def state_nbytes(self) -> int:
        total = 0
        for per_param in self.inner.state.values():
            for value in per_param.values():
                if torch.is_tensor(value):
                    total += value.numel() * value.element_size()
        return total
