"""ZeroEngine: the user-facing verbs (forward, backward, step) and reports; thin by design.

The work is done by the pieces it wires together at initialize():
FlatParamGroup (partition.py) lays parameters out, GradReducer (buckets.py) reduces gradients
during backward, ShardedOptimizer (optim.py) steps the shard and re-gathers parameters, Comm
(comm.py) carries the bytes.
"""
from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn as nn

from .buckets import GradReducer
from .comm import Comm
from .config import Config
from .drop_in import ForwardGuard, redirect_optimizer, register_parameters, unregister_parameters
from .flat import bucket_params
from .ops import flatten_into, unflatten_from
from .offload import OptimizerOffload
from .optim import ShardedOptimizer
from .partition import FlatParamGroup
from .precision import LossScaler, Precision
from .sharding import Sharding
from .stage3 import ParamFetcher, register_whole, unregister_whole
from .zero_init import is_sharded, make_whole, materialize


class ZeroEngine:
    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, config: Config,
                 comm: Comm, device: torch.device, lr_scheduler=None):
        self.module = module
        self.config = config
        self.comm = comm
        self.device = device
        self.stage = config.zero_optimization.stage
        self.sharding = Sharding.of_stage(self.stage)
        self.gradient_accumulation_steps = config.gradient_accumulation_steps
        self.global_steps = 0
        self.micro_steps = 0
        self._backward_done = False  # engine.backward() ran for the current micro-step
        zero = config.zero_optimization
        self.precision = Precision.from_config(config)
        self.offload_optimizer = zero.offload_optimizer.device == "cpu"
        self.offload_param = zero.offload_param.device == "cpu"
        # page-locked host memory only helps (and only exists) with a CUDA device
        self._pin = device.type == "cuda" and (zero.offload_optimizer.pin_memory
                                               or zero.offload_param.pin_memory)

        self._broadcast_module_state()  # every rank starts from rank 0's values, as in DDP
        order = {id(p): i for i, p in enumerate(module.parameters())}
        self.flat_groups = self._lay_out_parameters(optimizer, order, device)
        if self.precision.mixed:
            self._cast_rest_of_module(self.precision.compute)
        self.fetcher = None
        register_whole([fg for fg in self.flat_groups if not fg.partitioned], comm)
        partitioned = [fg for fg in self.flat_groups if fg.partitioned]
        if self.sharding.parameters:
            self._report_persistence(partitioned)
        if partitioned:
            self.fetcher = ParamFetcher(module, partitioned, comm,
                                        prefetch_numel=zero.stage3_prefetch_bucket_size,
                                        max_live_numel=zero.stage3_max_live_parameters,
                                        check_order=zero.stage3_check_gather_order,
                                        leaf_modules=zero.stage3_leaf_modules)
        self.reducer = GradReducer(
            self.flat_groups, comm, self.stage, self.gradient_accumulation_steps,
            overlap=zero.overlap_comm, reduce_scatter=zero.reduce_scatter, param_order=order,
            reduce_dtype=self.precision.reduce if config.communication_data_type else None)
        if self.fetcher is not None:
            self.reducer.on_segment_done = self._segment_done
            self.reducer.on_backward_end = self.fetcher.end_of_pass
        scaler = LossScaler.from_config(config.fp16) if config.fp16.enabled else None
        self.reducer.require_scaled_backward = scaler is not None
        self.offload = OptimizerOffload(self.flat_groups, self.reducer, device, self._pin) \
            if self.offload_optimizer else None
        self.optimizer = ShardedOptimizer(optimizer, self.flat_groups, self.reducer, comm,
                                          clip=config.gradient_clipping,
                                          allgather_bucket_numel=zero.allgather_bucket_size,
                                          loss_scaler=scaler,
                                          sub_group_numel=zero.sub_group_size,
                                          offload=self.offload,
                                          on_nonfinite=config.on_nonfinite,
                                          param_names={id(p): n for n, p in
                                                       module.named_parameters()})
        if self.fetcher is not None:
            self.optimizer.after_step = self.fetcher.refresh_gathered
        # the loop the user already has keeps working: their optimizer object and torch's
        # clip_grad_norm_ reach the sharded step (drop_in.py)
        redirect_optimizer(optimizer, self.optimizer)
        register_parameters(self._managed_params(), self.optimizer)
        broadcast = config.broadcast_buffers and comm.world_size > 1
        self.guard = ForwardGuard(
            module, self.flat_groups, self._broadcast_buffers if broadcast else None,
            check_ranks=self.fetcher.check_forward_start
            if self.fetcher is not None and self.fetcher.check_ranks else None)
        self.lr_scheduler = lr_scheduler
        if lr_scheduler is not None and hasattr(lr_scheduler, "optimizer"):
            lr_scheduler.optimizer = self.optimizer

    def _lay_out_parameters(self, optimizer, order: dict[int, int],
                            device: torch.device) -> list[FlatParamGroup]:
        """One FlatParamGroup per (optimizer group, dtype); at stage 3 split further into
        parameters kept whole (below stage3_param_persistence_threshold elements) and
        partitioned ones, whose segments follow the modules that hold them."""
        zero = self.config.zero_optimization
        shard_world = self.comm.world_size if self.sharding.optimizer_state else 1
        owner: dict[int, int] = {}  # parameter -> index of the first module holding it
        for mi, mod in enumerate(self.module.modules()):
            for p in mod.parameters(recurse=False):
                owner.setdefault(id(p), mi)
        limit = zero.stage3_param_persistence_threshold
        to_partition = {id(p) for group in optimizer.param_groups for p in group["params"]
                        if self.sharding.parameters and p.requires_grad
                        and p.numel() >= limit}
        for p in self.module.parameters():  # zero_init: whatever stays whole is made whole
            if is_sharded(p) and id(p) not in to_partition:
                make_whole(p, self.comm)

        def value_of(p):  # a collective for zero_init parameters, called in the same order
            return materialize(p, self.comm) if is_sharded(p) else p.detach()

        groups: list[FlatParamGroup] = []
        for gi, group in enumerate(optimizer.param_groups):
            trainable = [p for p in group["params"] if p.requires_grad]
            # Reverse registration order: the first segments are the first finished in backward.
            params = sorted(trainable, key=lambda p: -order[id(p)])
            if self.precision.mixed:  # one flat buffer in the compute dtype
                by_dtype = [(self.precision.compute, params)] if params else []
            else:  # each dtype keeps its own buffer
                by_dtype = bucket_params(params)
            for dtype, same in by_dtype:
                whole = same
                if self.sharding.parameters:
                    whole = [p for p in same if id(p) not in to_partition]
                    split = sorted((p for p in same if id(p) in to_partition),
                                   key=lambda p: (-owner[id(p)], -order[id(p)]))
                    if split:
                        groups.append(FlatParamGroup(
                            split, gi, self.comm.rank, shard_world, zero.reduce_bucket_size,
                            device, compute_dtype=dtype, partitioned=True,
                            units=[owner[id(p)] for p in split], value_of=value_of,
                            offload_master=self.offload_optimizer,
                            offload_shard=self.offload_param, pin=self._pin))
                        for p in split:
                            if is_sharded(p):
                                del p._ze_slice  # its values now live in the group's shard
                if whole:
                    groups.append(FlatParamGroup(whole, gi, self.comm.rank, shard_world,
                                                 zero.reduce_bucket_size, device,
                                                 compute_dtype=dtype,
                                                 offload_master=self.offload_optimizer,
                                                 pin=self._pin))
        return groups

    def _report_persistence(self, partitioned: list[FlatParamGroup]) -> None:
        """Stage 3 keeps parameters under stage3_param_persistence_threshold whole on every
        rank: say so when that is most of the model, which a small model hits by default."""
        whole = sum(fg.layout.used_numel for fg in self.flat_groups if not fg.partitioned)
        split = sum(fg.layout.used_numel for fg in partitioned)
        if whole > split and self.comm.rank == 0:
            limit = self.config.zero_optimization.stage3_param_persistence_threshold
            warnings.warn(
                f"stage 3 partitions {split:,} of the model's {whole + split:,} trainable "
                f"elements: parameters under stage3_param_persistence_threshold={limit:,} "
                f"elements ({whole:,} elements) stay whole on every rank, so this run holds "
                "more parameter memory per rank than stage 3 promises. Lower the threshold "
                "(e.g. 0) to partition them too", stacklevel=4)

    def _segment_done(self, group: FlatParamGroup, segment: int) -> None:
        if group.partitioned:
            self.fetcher.on_segment_reduced(group, segment)

    def _managed_params(self) -> list[torch.nn.Parameter]:
        return [p for fg in self.flat_groups for p in fg.params]

    def close(self) -> None:
        """Remove every hook the engine put on the model and its parameters."""
        unregister_parameters(self._managed_params())
        self.guard.remove()
        self.reducer.remove_hooks()
        unregister_whole(self.flat_groups)
        if self.fetcher is not None:
            self.fetcher.remove_hooks()

    def _broadcast_module_state(self) -> None:
        """Rank 0's parameters and buffers to every rank."""
        # zero_init parameters already hold rank 0's values, sharded
        self._broadcast_from_rank0([t.data for t in list(self.module.parameters())
                                    + list(self.module.buffers()) if not is_sharded(t)])

    def _broadcast_buffers(self, buffers: list[torch.Tensor]) -> None:
        self._broadcast_from_rank0(buffers, what=lambda: f"module buffers ({len(buffers)}, "
                                   "broadcast from rank 0 before the forward: broadcast_buffers)")

    def _broadcast_from_rank0(self, tensors: list[torch.Tensor], max_numel: int = 1 << 22,
                              what="") -> None:
        """Rank 0's values of ``tensors`` to every rank, a few large broadcasts per dtype."""
        if self.comm.world_size == 1:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for same in by_dtype.values():
            batch: list[torch.Tensor] = []
            for t in same + [None]:
                if t is None or (batch and sum(b.numel() for b in batch) + t.numel() > max_numel):
                    offsets = [0]
                    for b in batch:
                        offsets.append(offsets[-1] + b.numel())
                    flat = torch.empty(offsets[-1], dtype=batch[0].dtype, device=batch[0].device)
                    flatten_into(batch, flat, offsets[:-1])
                    self.comm.broadcast(flat, 0, what=what)
                    unflatten_from(flat, batch, offsets[:-1])
                    batch = []
                if t is not None:
                    batch.append(t)

    def _cast_rest_of_module(self, dtype: torch.dtype) -> None:
        """Frozen parameters and floating-point buffers follow the compute dtype, as they
        would under module.to(dtype); managed parameters already live in it."""
        managed = {id(p) for p in self._managed_params()}
        with torch.no_grad():
            for p in self.module.parameters():
                if id(p) not in managed and p.is_floating_point():
                    p.data = p.data.to(dtype)
            for mod in self.module.modules():
                for name, buf in mod._buffers.items():
                    if buf is not None and buf.is_floating_point():
                        mod._buffers[name] = buf.to(dtype)

    # -- training verbs ------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    forward = __call__

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-step's loss, averaged over the accumulation steps, so the
        applied gradient is the mean over ranks and micro-steps (DeepSpeed's semantics)."""
        if self._backward_done:
            raise RuntimeError(
                f"engine.backward() called twice for micro-step {self.micro_steps + 1} without "
                "engine.step() in between: each micro-step is one backward and one step() "
                f"(step() only updates every gradient_accumulation_steps="
                f"{self.gradient_accumulation_steps} micro-steps); for several losses of one "
                "micro-step, add them and call backward once")
        factor = self.loss_scale / self.gradient_accumulation_steps
        if factor != 1.0:
            # fp16: scaled in fp32, since loss x 2**16 overflows fp16 itself.
            loss = loss.float() * factor
        self.reducer.scaled_backward_pending = True
        try:
            loss.backward()
        finally:
            self.reducer.scaled_backward_pending = False
        self._backward_done = True

    def step(self) -> None:
        """Count a micro-step; at an accumulation boundary update, clear grads, step the
        scheduler."""
        if not self._backward_done:
            raise RuntimeError(
                f"engine.step() called for micro-step {self.micro_steps + 1} without "
                "engine.backward(loss) before it: stepping would apply stale or zero gradients "
                "(Adam would still move the weights). Call engine.backward(loss), then step()")
        self._backward_done = False
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        skipped_before = self.optimizer.skipped_steps
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.global_steps += 1
        # A step skipped for overflow does not advance the schedule (as in DeepSpeed).
        if self.lr_scheduler is not None and self.optimizer.skipped_steps == skipped_before:
            self.lr_scheduler.step()

    @contextlib.contextmanager
    def no_sync(self):
        """DDP's ``no_sync()``: backwards inside accumulate without communicating; the next
        backward outside it (or the step) reduces the sum. The numbers are the same either way;
        this only saves communication, at stages 0-1 (stages 2-3 keep no full gradient to
        accumulate into, so they reduce every backward regardless)."""
        before, self.reducer.defer_reduction = self.reducer.defer_reduction, True
        try:
            yield
        finally:
            self.reducer.defer_reduction = before

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
        scaler = self.optimizer.loss_scaler
        return scaler.scale if scaler is not None else 1.0

    @property
    def skipped_steps(self) -> int:
        return self.optimizer.skipped_steps

    def get_global_grad_norm(self) -> float | None:
        """Norm of the (unclipped) gradient applied at the last step, over all ranks."""
        return self.optimizer.last_grad_norm

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds now for model states, by category: ``params``, ``grads`` and
        ``optimizer_states`` on the training device, ``host_*`` the same offloaded to host
        memory (on a CPU-only machine both are RAM; the split says where the engine put them),
        ``total`` all of them."""
        managed = {id(p) for p in self._managed_params()}
        params = sum(fg.nbytes() for fg in self.flat_groups)
        if self.fetcher is not None:
            params += self.fetcher.gathered_nbytes()
        params += sum(p.numel() * p.element_size() for p in self.module.parameters()
                      if id(p) not in managed)
        grads = self.reducer.nbytes()
        states = sum(fg.master_nbytes() for fg in self.flat_groups)
        host_states = sum(fg.master_nbytes(host=True) for fg in self.flat_groups)
        if self.offload is not None:
            host_states += self.optimizer.state_nbytes()
        else:
            states += self.optimizer.state_nbytes()
        report = {"params": params, "grads": grads, "optimizer_states": states,
                  "host_params": sum(fg.nbytes(host=True) for fg in self.flat_groups),
                  "host_grads": self.offload.nbytes() if self.offload is not None else 0,
                  "host_optimizer_states": host_states}
        report["total"] = sum(report.values())
        return report

    def comm_report(self, reset: bool = True) -> dict[str, dict[str, int]]:
        """Bytes this rank sent/received per collective kind since the last call."""
        return self.comm.report(reset)

    # -- checkpoints (checkpoint.py) ------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: str | None = None,
                        client_state: dict | None = None, node_local: bool = False) -> str:
        """Collective: each rank writes its own shards of ``<save_dir>/<tag>`` (default tag
        ``global_step<N>``), atomically; ``latest`` then names it. Returns the path.
        ``node_local=True``: each rank's ``save_dir`` is its own (not shared); the checkpoint
        is the union of the ranks' directories, as Ray Train assembles it."""
        from .checkpoint import save_checkpoint
        return save_checkpoint(self, save_dir, tag, client_state, node_local)

    def load_checkpoint(self, load_dir: str, tag: str | None = None, **options):
        """Collective: restore from ``<load_dir>/<tag>`` (None: the latest), whatever world
        size, stage or offload it was saved with. Returns (path, client_state). Options:
        load_optimizer_states, load_lr_scheduler_states, load_module_only, missing_ok (return
        (None, None) instead of raising when nothing was saved yet: the resume pattern)."""
        from .checkpoint import load_checkpoint
        return load_checkpoint(self, load_dir, tag, **options)

    def save_16bit_model(self, save_dir: str, save_filename: str = "model.safetensors") -> bool:
        """Collective: rank 0 writes the model's weights in the compute dtype (bf16/fp16, or
        fp32 when that is what it trains in) as one safetensors file. At stage 3 this needs
        ``stage3_gather_16bit_weights_on_model_save`` (as in DeepSpeed); without it nothing is
        written and False is returned."""
        from .checkpoint import save_16bit_model
        return save_16bit_model(self, save_dir, save_filename)

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
