"""ZeroEngine: the user-facing verbs (forward, backward, step); it wires and delegates.

The collaborators, built once in ``__init__`` and handed to each other there: FlatParamGroup
(layout/flat_param_group.py) holds parameters in flat buffers; ParamFetcher
(stage3/param_fetcher.py) gathers and releases stage 3's segments around their use;
GradReducer (grad_reducer.py) reduces gradients during backward; OptimizerOffload
(offload/optimizer_offload.py) holds the host side of an offloaded step; ShardedOptimizer
(optim/sharded_optimizer.py) steps the rank's shard; Comm (distributed/comm.py) carries the
bytes. Reports, checkpoints and DeepSpeed's queries are mixins (engine_reports.py,
engine_checkpoints.py, engine_queries.py).

One training step, in order (the file and function where each happens):
  forward   ForwardGuard (compat/drop_in.py) checks the parameters and broadcasts buffers;
            stage 3: ParamFetcher._pre_forward gathers each module's fetch unit (prefetching
            the next along the recorded order) and _post_forward releases it.
  backward  ZeroEngine.backward scales the loss; GradReducer._on_grad_ready takes each
            parameter's gradient into its bucket; a complete bucket -> ParamFetcher.grads_taken
            (stage 3 frees the segment) and, in launch order, GradReducer._start_reduce
            (all-reduce or reduce-scatter, asynchronous); GradReducer._finish_reduce ->
            OptimizerOffload.grad_reduced (the host copy starts); GradReducer._end_backward
            waits for the rest -> ParamFetcher.end_of_pass.
  step      ZeroEngine.step at the accumulation boundary -> ShardedOptimizer.step: reducer
            .flush, the global norm (one all-reduce), loss scale / clipping, per sub-group the
            inner step -> ShardedOptimizer.publish (master -> model chunk, through the offload's
            copy) and the all-gather of updated chunks (stages 1-2) -> ParamFetcher
            .refresh_gathered (stage 3, segments held across the step) -> reducer.zero_grad.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from ..config import Config
from ..distributed.comm import Comm
from ..distributed.topology import Topology
from ..monitor import Monitor
from ..ops.quantize import DEFAULT_BLOCK as QUANT_BLOCK
from .buckets import ReduceSettings
from .compat import compiled
from .compat.compiled import uncompiled
from .compat.drop_in import (
    ForwardGuard,
    redirect_optimizer,
    register_parameters,
    unregister_parameters,
)
from .compat.step_clock import StepClock
from .engine_checkpoints import EngineCheckpoints
from .engine_queries import EngineQueries
from .engine_reports import EngineReports
from .grad_reducer import GradReducer
from .layout.param_layout import element_index, lay_out_parameters, report_persistence
from .module_state import broadcast_module_state, cast_floating, cast_rest_of_module
from .offload.optimizer_offload import OptimizerOffload
from .optim.precision import LossScaler, OptimizerPrecision, Precision
from .optim.sharded_optimizer import ShardedOptimizer, StepSettings
from .param_sync import ParamSync
from .sharding import Sharding
from .stage3 import gathered
from .stage3.param_fetcher import ParamFetcher


class ZeroEngine(EngineQueries, EngineReports, EngineCheckpoints):
    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, config: Config,
                 comm: Comm, device: torch.device, lr_scheduler=None,
                 topology: Topology | None = None, scheduler_from_config: bool = False,
                 local_rank: int = 0):
        """``lr_scheduler``: the config's (``scheduler_from_config``) or the user's; the step
        clock decides when it steps (step_clock.py)."""
        self.module = module
        self.config = config
        self.comm = comm
        # hybrid sharding: states sharded over topology.shard, replicated across groups
        self.topology = topology or Topology.plain(comm)
        self._local_rank = local_rank  # the launcher's LOCAL_RANK
        self._backwards_at_step = 0  # reducer.backward_count at the last engine.step()
        shard = self.topology.shard
        self.device = device
        self.stage = config.zero_optimization.stage
        self.sharding = Sharding.of_stage(self.stage)
        self.accumulation_steps = config.gradient_accumulation_steps
        self._cast_inputs = torch.float16 if config.fp16.enabled and config.fp16.auto_cast \
            else None
        self.monitor = Monitor.from_config(config, comm.rank)
        # the counters, the scheduler, the monitor rows and the progress log: one owner that
        # every way of completing an optimizer step reports to
        self.clock = StepClock(config=config, rank=comm.rank, monitor=self.monitor,
                               sync=torch.cuda.synchronize if device.type == "cuda" else None)
        zero = config.zero_optimization
        self.precision = Precision.from_config(config)
        # what the optimizer keeps its masters and states in (bf16/fp16 master keys)
        self.optimizer_precision = OptimizerPrecision.from_config(config)
        # "nvme": offloaded as to "cpu", then the host master and state go to the drive
        self.offload_optimizer = zero.offload_optimizer.device in ("cpu", "nvme")
        self.offload_param = zero.offload_param.device in ("cpu", "nvme")
        # page-locked host memory only helps (and only exists) with a CUDA device
        self._pin = device.type == "cuda" and (zero.offload_optimizer.pin_memory
                                               or zero.offload_param.pin_memory)

        broadcast_module_state(module, comm)  # every rank starts from rank 0's values, as in DDP
        order = {id(p): i for i, p in enumerate(module.parameters())}
        # NVMe offload: the swap exists first, so the masters go to the drive as laid out
        swap = self.param_swap = None
        if "nvme" in (zero.offload_optimizer.device, zero.offload_param.device):
            from .offload import nvme
            io = nvme.file_io(config)  # one asynchronous I/O engine for both swaps
            if zero.offload_optimizer.device == "nvme":
                swap = nvme.optimizer_swap(config, comm.rank, io, self._pin)
            if zero.offload_param.device == "nvme":
                self.param_swap = nvme.param_swap(config, comm.rank, io, self._pin)
        self.flat_groups = lay_out_parameters(module, optimizer, order, self.sharding, comm,
                                              zero, self.precision, device, self._pin,
                                              shard=shard, master_sink=swap,
                                              param_sink=self.param_swap,
                                              master_format=self.optimizer_precision.master)
        if self.precision.mixed:
            cast_rest_of_module(module, self._managed_params(), self.precision.compute)
        partitioned = [fg for fg in self.flat_groups if fg.partitioned]
        if self.sharding.parameters:
            report_persistence(self.flat_groups, zero.stage3_param_persistence_threshold, comm)
        # The collaborators, built in dependency order and handed to each other here: the
        # reducer tells the fetcher and the offload what backward finished; the optimizer
        # steps, publishes through the offload and has the fetcher refresh what is gathered.
        self.fetcher = ParamFetcher.from_config(module, partitioned, comm, self.topology, zero) \
            if partitioned else None
        reduce_dtype = self.precision.reduce if config.communication_data_type else None
        self.offload = OptimizerOffload(self.flat_groups, reduce_dtype, self._pin, swap=swap) \
            if self.offload_optimizer else None
        scaler = LossScaler.from_config(config.fp16) if config.fp16.enabled else None
        self.reducer = GradReducer(
            self.flat_groups, shard, self.sharding, ReduceSettings(
                self.accumulation_steps, zero.overlap_comm, zero.reduce_scatter,
                reduce_dtype, loss_scaled=scaler is not None,
                quantize_block=QUANT_BLOCK if zero.zero_quantized_gradients else 0),
            param_order=order, fetcher=self.fetcher, offload=self.offload,
            replicas=self.topology.replicas,
            hierarchy=(self.topology.node, self.topology.across)
            if self.topology.node is not None else None)
        self.optimizer = ShardedOptimizer(
            optimizer, self.flat_groups, self.reducer, shard, sharding=self.sharding,
            settings=StepSettings(config.gradient_clipping, zero.sub_group_size,
                                  config.on_nonfinite),
            loss_scaler=scaler, offload=self.offload,
            param_sync=ParamSync(self.flat_groups, shard, zero.allgather_bucket_size,
                                 self.offload, self.fetcher),
            param_names={id(p): n for n, p in uncompiled(module).named_parameters()},
            precision=self.optimizer_precision,
            element_index=element_index(uncompiled(module)),
            swap=swap, clock=self.clock)
        self.optimizer.trim_host_heap = zero.return_free_host_memory and (
            device.type == "cpu" or self.offload_optimizer or self.offload_param)
        self.clock.bind(self.optimizer)
        gathered.register(self.flat_groups, comm, self.fetcher)
        # the loop the user already has keeps working: their optimizer object and torch's
        # clip_grad_norm_ reach the sharded step (drop_in.py)
        redirect_optimizer(optimizer, self.optimizer)
        register_parameters(self._managed_params(), self.optimizer)
        broadcast = config.broadcast_buffers and comm.world_size > 1
        self.guard = ForwardGuard(
            module, self.flat_groups, self._broadcast_buffers if broadcast else None,
            check_ranks=self.fetcher.check_forward_start
            if self.fetcher is not None and self.fetcher.check_ranks else None,
            split=compiled.bucket_split(config, self.sharding, comm.world_size, device,
                                       self._managed_params()), clock=self.clock)
        if self.clock.timers is not None:
            self.reducer.on_backward_end = self.clock.timers.backward_pass_ended
        compiled.install(module)  # module.compile() compiles forward, keeping our hooks eager
        from ..checkpoint.saver import CheckpointSaver
        self.checkpoints = CheckpointSaver(self, config.checkpoint.background)
        self._closed = False
        _close_at_exit(self)
        self.clock.set_scheduler(lr_scheduler, scheduler_from_config)
        # a scheduler over the optimizer given now drives the engine's (the same group dicts);
        # one over a member of a list given keeps driving just that member's groups
        members = getattr(optimizer, "optimizers", ())
        if lr_scheduler is not None and hasattr(lr_scheduler, "optimizer") and \
                not any(lr_scheduler.optimizer is m for m in members):
            lr_scheduler.optimizer = self.optimizer

    def _managed_params(self) -> list[torch.nn.Parameter]:
        return [p for fg in self.flat_groups for p in fg.params]

    def close(self) -> None:
        """Finish a pending asynchronous save; remove every hook the engine put on the model
        and its parameters; close the monitor's writers; remove NVMe swap files. Called at
        interpreter exit for an engine the script never closed."""
        if self._closed:
            return
        self._closed = True
        self.checkpoints.close()
        self.monitor.close()
        if self.optimizer.swap is not None:
            self.optimizer.swap.close()
        if self.param_swap is not None:
            self.param_swap.close()
        compiled.uninstall(self.module)
        unregister_parameters(self._managed_params())
        self.guard.remove()
        self.reducer.remove_hooks()
        gathered.unregister(self.flat_groups)
        if self.fetcher is not None:
            self.fetcher.remove_hooks()

    def _broadcast_buffers(self, buffers: list[torch.Tensor]) -> None:
        self.comm.broadcast_many(buffers, src=0, what=lambda: f"module buffers ({len(buffers)}, "
                                   "broadcast from rank 0 before the forward: broadcast_buffers)")

    # -- training verbs ------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self._cast_inputs is not None:  # fp16.auto_cast, as DeepSpeed's engine.forward
            args, kwargs = cast_floating((args, kwargs), self._cast_inputs)
        return self.module(*args, **kwargs)

    forward = __call__

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-step's step() updates the parameters."""
        override = self.reducer.state.boundary_override  # set_gradient_accumulation_boundary
        if override is not None:
            return override
        return (self.micro_steps + 1) % self.accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """DeepSpeed's: say whether the coming micro-step (its backward and step()) ends an
        accumulation, instead of counting gradient_accumulation_steps - for a trainer whose last
        group of an epoch is shorter. None: count again."""
        self.reducer.state.boundary_override = is_boundary  # read by the reducer and step()

    def backward(self, loss: torch.Tensor, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of one micro-step's loss, averaged over the accumulation steps, so the
        applied gradient is the mean over ranks and micro-steps (DeepSpeed's semantics).
        ``scale_wrt_gas=False`` (DeepSpeed's argument): the caller divided the loss already
        (the Hugging Face Trainer does). Returns the loss divided by the accumulation steps
        (unscaled by fp16's loss scale), as DeepSpeed's does."""
        if self.clock.backward_pending:
            raise RuntimeError(
                f"engine.backward() called twice for micro-step {self.micro_steps + 1} without "
                "engine.step() in between: each micro-step is one backward and one step() "
                f"(step() only updates every gradient_accumulation_steps="
                f"{self.accumulation_steps} micro-steps); for several losses of one "
                "micro-step, add them and call backward once")
        self.clock.record_loss(loss)
        compiled.check_compiled_autograd()
        returned = loss.detach() / (self.accumulation_steps if scale_wrt_gas else 1)
        factor = self.loss_scale / (self.accumulation_steps if scale_wrt_gas else 1)
        if factor != 1.0:
            # fp16: scaled in fp32, since loss x 2**16 overflows fp16 itself.
            loss = loss.float() * factor
        with self.reducer.scaled_backward(), self.clock.timing("backward"):
            loss.backward(retain_graph=retain_graph)
        self.clock.backward_pending = True
        return returned

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Count a micro-step; at an accumulation boundary update and clear the gradients. The
        step clock (step_clock.py) counts the step and steps the scheduler, as it does for an
        optimizer step taken any other way. ``lr_kwargs`` (DeepSpeed's): keyword arguments of
        the scheduler's step() at this step."""
        clock = self.clock
        if not clock.backward_pending:
            if self.reducer.backward_count == self.optimizer.stepped_at_backward and \
                    self.optimizer.steps:
                with clock.engine_step():  # optimizer.step() stepped this backward already
                    clock.check_step(0)
            if self.reducer.backward_count == self._backwards_at_step:
                raise RuntimeError(
                    f"engine.step() called for micro-step {self.micro_steps + 1} without "
                    "engine.backward(loss) (or loss.backward()) before it: stepping would apply "
                    "stale or zero gradients (Adam would still move the weights). Call "
                    "engine.backward(loss), then step()")
            self._check_plain_backward()
        self._backwards_at_step = self.reducer.backward_count
        boundary = self.is_gradient_accumulation_boundary()
        clock.engine_micro_step(boundary)
        if not boundary:
            return
        with clock.engine_step(lr_kwargs):
            self.optimizer.step()
        self.optimizer.zero_grad()

    def _check_plain_backward(self) -> None:
        """``loss.backward(); engine.step()`` (DeepSpeed's torch-style backward): the loss
        reached backward unscaled, which is right only without a loss scaler and with one
        micro-step per update."""
        if self.optimizer.loss_scaler is not None:
            raise RuntimeError("loss.backward() then engine.step() with fp16: the loss was not "
                               "multiplied by the loss scale, so small gradients underflow and "
                               "the step is scaled wrong. Call engine.backward(loss) instead")
        if self.accumulation_steps > 1:
            raise RuntimeError(
                "loss.backward() then engine.step() with gradient_accumulation_steps="
                f"{self.accumulation_steps}: the loss was not divided by the accumulation "
                "steps. Call engine.backward(loss) (it divides), or step your own optimizer "
                "after the accumulation (optimizer.step())")

    @contextlib.contextmanager
    def no_sync(self):
        """DDP's ``no_sync()``: backwards inside accumulate without communicating; the next
        backward outside it (or the step) reduces the sum. The numbers are the same either way;
        this only saves communication, at stages 0-1 (stages 2-3 keep no full gradient to
        accumulate into, so they reduce every backward regardless)."""
        with self.reducer.deferred():
            yield

    def compile(self, backend: str = "inductor", compile_kwargs: dict | None = None,
                compiled_autograd_enabled: bool = False) -> None:
        """DeepSpeed's verb: torch.compile the model's forward (compat/compiled.py), the engine's
        hooks staying outside the graph. ``compile_kwargs``: torch.compile's other arguments
        (mode, dynamic, fullgraph, options). Compiled autograd is refused (see
        compiled.check_compiled_autograd)."""
        if compiled_autograd_enabled:
            raise ValueError("compiled_autograd_enabled=True: zeroengine's gradient hooks run "
                             "as backward produces each gradient, outside any graph; compiled "
                             "autograd is not supported (the forward's backward is compiled "
                             "through AOTAutograd without it)")
        compiled.check_compile_args(backend, compile_kwargs, where="engine.compile")
        compiled.compile_forward(self.module, backend=backend, **(compile_kwargs or {}))

    @property
    def is_compiled(self) -> bool:
        return compiled.is_compiled(self.module)

    def get_global_grad_norm(self) -> float | None:
        """Norm of the (unclipped) gradient applied at the last step, over all ranks."""
        return self.optimizer.last_grad_norm



def _close_at_exit(engine: "ZeroEngine") -> None:
    """At interpreter exit, ``close()`` an engine the script left open (a pending save
    finishes first: its writer thread is joined before atexit handlers run). Registered after
    the process group's own exit handler, so it runs before the group is destroyed."""
    import atexit
    import weakref
    ref = weakref.ref(engine)

    def close():
        alive = ref()
        if alive is not None:
            alive.close()
    atexit.register(close)
