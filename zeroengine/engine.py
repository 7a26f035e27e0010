"""ZeroEngine: the user-facing verbs (forward, backward, step) and reports; thin by design.

The work is done by the pieces it wires together at initialize():
FlatParamGroup (partition.py) lays parameters out, GradReducer (buckets.py) reduces gradients
during backward, ShardedOptimizer (optim.py) steps the shard and re-gathers parameters, Comm
(comm.py) carries the bytes.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .buckets import GradReducer
from .comm import Comm
from .config import Config
from .flat import bucket_params
from .optim import ShardedOptimizer
from .partition import FlatParamGroup


class ZeroEngine:
    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, config: Config,
                 comm: Comm, device: torch.device, lr_scheduler=None):
        self.module = module
        self.config = config
        self.comm = comm
        self.device = device
        self.stage = config.zero_optimization.stage
        self.gradient_accumulation_steps = config.gradient_accumulation_steps
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        zero = config.zero_optimization

        order = {id(p): i for i, p in enumerate(module.parameters())}
        shard_world = comm.world_size if self.stage >= 1 else 1
        self.flat_groups: list[FlatParamGroup] = []
        for gi, group in enumerate(optimizer.param_groups):
            # Reverse registration order: the first segments are the first finished in backward.
            trainable = [p for p in group["params"] if p.requires_grad]
            params = sorted(trainable, key=lambda p: -order[id(p)])
            for _, same_dtype in bucket_params(params):
                self.flat_groups.append(FlatParamGroup(
                    same_dtype, gi, comm.rank, shard_world, zero.reduce_bucket_size, device))
        self._sync_initial_state()
        self.reducer = GradReducer(self.flat_groups, comm, self.stage,
                                   self.gradient_accumulation_steps, overlap=zero.overlap_comm,
                                   reduce_scatter=zero.reduce_scatter, param_order=order)
        self.optimizer = ShardedOptimizer(optimizer, self.flat_groups, self.reducer, comm,
                                          clip=config.gradient_clipping,
                                          allgather_bucket_numel=zero.allgather_bucket_size)
        self.lr_scheduler = lr_scheduler
        if lr_scheduler is not None and hasattr(lr_scheduler, "optimizer"):
            lr_scheduler.optimizer = self.optimizer

    def _sync_initial_state(self) -> None:
        """Every rank starts from rank 0's parameters and buffers, as DDP does."""
        with torch.no_grad():
            for fg in self.flat_groups:
                self.comm.broadcast(fg.data, 0)
                fg.refresh_master()
            managed = {id(p) for fg in self.flat_groups for p in fg.params}
            for p in self.module.parameters():
                if id(p) not in managed:
                    self.comm.broadcast(p.data, 0)
            for b in self.module.buffers():
                self.comm.broadcast(b.data, 0)

    # -- training verbs ------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    forward = __call__

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-step's loss, averaged over the accumulation steps, so the
        applied gradient is the mean over ranks and micro-steps (DeepSpeed's semantics)."""
        if self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        loss.backward()

    def step(self) -> None:
        """Count a micro-step; at an accumulation boundary update, clear grads, step the
        scheduler."""
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.global_steps += 1
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    def train(self, mode: bool = True) -> "ZeroEngine":
        self.module.train(mode)
        return self

    def eval(self) -> "ZeroEngine":
        return self.train(False)

    def parameters(self):
        return self.module.parameters()

    def named_parameters(self):
        return self.module.named_parameters()

    # -- reports ---------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return 1.0

    def get_global_grad_norm(self) -> float | None:
        """Norm of the (unclipped) gradient applied at the last step, over all ranks."""
        return self.optimizer.last_grad_norm

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds now for model states, by category."""
        managed = {id(p) for fg in self.flat_groups for p in fg.params}
        params = sum(fg.nbytes() for fg in self.flat_groups)
        params += sum(p.numel() * p.element_size() for p in self.module.parameters()
                      if id(p) not in managed)
        grads = self.reducer.nbytes()
        states = self.optimizer.state_nbytes() + sum(fg.master_nbytes() for fg in self.flat_groups)
        return {"params": params, "grads": grads, "optimizer_states": states,
                "total": params + grads + states}

    def comm_report(self, reset: bool = True) -> dict[str, dict[str, int]]:
        """Bytes this rank sent/received per collective kind since the last call."""
        return self.comm.report(reset)

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: on every rank, the full fp32 state dict with model.state_dict()'s keys."""
        full_values: dict[int, torch.Tensor] = {}
        for fg in self.flat_groups:
            full = fg.full_fp32(self.comm)
            for i, p in enumerate(fg.params):
                slot = fg.layout.slots[i]
                full_values[id(p)] = full[slot.offset:slot.offset + slot.numel].view(slot.shape)
        out = {}
        for name, t in self.module.state_dict(keep_vars=True).items():
            value = full_values.get(id(t))
            if value is None:
                value = t.detach()
                value = value.float() if value.is_floating_point() else value
            out[name] = value.clone().cpu()
        return out
