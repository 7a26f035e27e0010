"""ZeroEngine: the user-facing verbs (forward, backward, step) and reports; thin by design.

The collaborators, wired once in ``__init__`` (each gets the others it calls at construction):
FlatParamGroup (flat_param_group.py) lays parameters out in flat buffers; ParamFetcher
(param_fetcher.py, stage 3) gathers and releases parameter segments around their use;
GradReducer (grad_reducer.py) reduces gradients during backward; OptimizerOffload
(optimizer_offload.py) holds the host side of an offloaded step; ShardedOptimizer
(sharded_optimizer.py) steps the rank's shard; Comm (distributed/comm.py) carries the bytes and
distributed/handles.py names what is in flight.

One training step, in order (the file and function where each happens):
  forward   ForwardGuard (drop_in.py) checks the parameters and broadcasts buffers; stage 3:
            ParamFetcher._pre_forward gathers each module's segments (prefetching the next
            ones along the recorded order) and _post_forward releases them.
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
import os

import torch
import torch.nn as nn

from ..config import AUTO, Config, ConfigError
from ..distributed.comm import Comm
from ..distributed.topology import Topology
from ..monitor import Monitor
from ..ops.quantize import DEFAULT_BLOCK as QUANT_BLOCK
from .compat import compiled
from .compat.compiled import uncompiled
from .compat.drop_in import (
    ForwardGuard,
    redirect_optimizer,
    register_parameters,
    unregister_parameters,
)
from .compat.step_clock import StepClock
from .engine_queries import EngineQueries
from .grad_reducer import GradReducer, ReduceSettings
from .layout.deferred_params import is_deferred
from .layout.param_layout import element_index, lay_out_parameters, report_persistence
from .offload.host_memory import heap_free_bytes
from .offload.optimizer_offload import OptimizerOffload
from .optim.precision import LossScaler, OptimizerPrecision, Precision
from .optim.sharded_optimizer import ShardedOptimizer, StepSettings
from .sharding import Sharding
from .stage3 import gathered
from .stage3.param_fetcher import ParamFetcher, auto_window
from .stage3.zero_init import is_sharded


class ZeroEngine(EngineQueries):
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

        self._broadcast_module_state()  # every rank starts from rank 0's values, as in DDP
        order = {id(p): i for i, p in enumerate(module.parameters())}
        # NVMe offload: the swap exists first, so the masters go to the drive as laid out
        self._aio = None
        swap = self._nvme_swap(config) if zero.offload_optimizer.device == "nvme" else None
        self.param_swap = self._param_swap(config) if zero.offload_param.device == "nvme" \
            else None
        self.flat_groups = lay_out_parameters(module, optimizer, order, self.sharding, comm,
                                              zero, self.precision, device, self._pin,
                                              shard=shard, master_sink=swap,
                                              param_sink=self.param_swap,
                                              master_format=self.optimizer_precision.master)
        if self.precision.mixed:
            self._cast_rest_of_module(self.precision.compute)
        partitioned = [fg for fg in self.flat_groups if fg.partitioned]
        if self.sharding.parameters:
            report_persistence(self.flat_groups, zero.stage3_param_persistence_threshold, comm)
        # The collaborators, built in dependency order and handed to each other here: the
        # reducer tells the fetcher and the offload what backward finished; the optimizer
        # steps, publishes through the offload and has the fetcher refresh what is gathered.
        window = auto_window(partitioned)
        self.fetcher = ParamFetcher(
            module, partitioned, comm, gather_comm=shard,
            secondary_comm=self.topology.secondary,
            quantize_block=QUANT_BLOCK if zero.zero_quantized_weights else 0,
            prefetch_numel=window if zero.stage3_prefetch_bucket_size == AUTO
            else zero.stage3_prefetch_bucket_size,
            max_reuse_numel=window if zero.stage3_max_reuse_distance == AUTO
            else zero.stage3_max_reuse_distance,
            max_live_numel=zero.stage3_max_live_parameters,
            check_order=zero.stage3_check_gather_order,
            leaf_modules=zero.stage3_leaf_modules) if partitioned else None
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
            settings=StepSettings(config.gradient_clipping, zero.allgather_bucket_size,
                                  zero.sub_group_size, config.on_nonfinite),
            loss_scaler=scaler, offload=self.offload, fetcher=self.fetcher,
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
            split=self._bucket_split(config, comm, device), clock=self.clock)
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

    def _bucket_split(self, config, comm, device) -> compiled.BucketSplit | None:
        """Where a compiled forward is cut at gradient buckets: stages 0-2 with more than one
        rank and overlap on (stage 3's fetch units already cut it), by default on CUDA only."""
        zero, wanted = config.zero_optimization, config.compile.split_at_buckets
        if wanted is None:
            wanted = device.type == "cuda"
        if not wanted or self.sharding.parameters or comm.world_size == 1 \
                or not zero.overlap_comm:
            return None
        itemsize = max((p.element_size() for p in self._managed_params()), default=4)
        return compiled.BucketSplit(max(1, zero.reduce_bucket_size) * itemsize)

    def _swap_dir(self, section: str, nvme_path: str):
        """This rank's swap directory under ``nvme_path`` (offload_<section>.nvme_path)."""
        from .offload.swap_files import SwapDir
        if not os.path.isdir(nvme_path):  # a typo must not swap to another drive
            raise ConfigError(f"zero_optimization.{section}.nvme_path {nvme_path!r} is not a "
                              f"directory on rank {self.comm.rank}; create it on the drive to "
                              "swap to (every rank needs its own or a shared one)")
        return SwapDir(nvme_path, self.comm.rank)

    def _file_io(self, config: Config):
        """The rank's one asynchronous I/O engine, shared by the optimizer and parameter swaps."""
        from ..ops.aio import AsyncFileIO
        if self._aio is None:
            aio = config.aio
            self._aio = AsyncFileIO(aio.block_size, aio.queue_depth, aio.thread_count)
        return self._aio

    def _nvme_swap(self, config: Config):
        """NVMe offload of the optimizer: master and state in swap files under nvme_path."""
        from .offload.optimizer_swap import OptimizerSwap
        off = config.zero_optimization.offload_optimizer
        return OptimizerSwap(self._swap_dir("offload_optimizer", off.nvme_path),
                             self._file_io(config), pipeline_read=off.pipeline_read,
                             pipeline_write=off.pipeline_write, pin=self._pin)

    def _param_swap(self, config: Config):
        """NVMe offload of stage-3 parameters: the shard in swap files, a cache of max_in_cpu
        elements in memory, buffer_count x buffer_size elements read ahead."""
        from .offload.param_swap import ParamSwap
        off = config.zero_optimization.offload_param
        return ParamSwap(self._swap_dir("offload_param", off.nvme_path),
                         self._file_io(config), max_in_cpu=off.max_in_cpu,
                         read_ahead_numel=off.buffer_count * off.buffer_size, pin=self._pin)

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

    def _broadcast_module_state(self) -> None:
        """Rank 0's parameters and buffers to every rank."""
        # zero_init parameters already hold rank 0's values, sharded; deferred ones (weights
        # files, reset_parameters) get the same values on every rank when they are read
        self.comm.broadcast_many([t.data for t in list(self.module.parameters())
                                  + list(self.module.buffers())
                                  if not is_sharded(t) and not is_deferred(t)], src=0)

    def _broadcast_buffers(self, buffers: list[torch.Tensor]) -> None:
        self.comm.broadcast_many(buffers, src=0, what=lambda: f"module buffers ({len(buffers)}, "
                                   "broadcast from rank 0 before the forward: broadcast_buffers)")

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
        if self._cast_inputs is not None:  # fp16.auto_cast, as DeepSpeed's engine.forward
            args, kwargs = _cast_floating((args, kwargs), self._cast_inputs)
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
        return self.clock.loss_scale()

    # the step clock's counters and scheduler (step_clock.py), under DeepSpeed's names
    @property
    def global_steps(self) -> int:
        return self.clock.global_steps

    @property
    def global_samples(self) -> int:
        return self.clock.global_samples

    @property
    def micro_steps(self) -> int:
        return self.clock.micro_steps

    @property
    def skipped_steps(self) -> int:
        return self.clock.skipped_steps

    @property
    def lr_scheduler(self):
        return self.clock.scheduler

    def get_global_grad_norm(self) -> float | None:
        """Norm of the (unclipped) gradient applied at the last step, over all ranks."""
        return self.optimizer.last_grad_norm

    def memory_report(self, reset_peak: bool = False) -> dict[str, int]:
        """Bytes this rank holds for model states, by category: ``params``, ``grads`` and
        ``optimizer_states`` on the training device now, ``host_*`` the same offloaded to host
        memory (on a CPU-only machine both are RAM; the split says where the engine put them),
        ``total`` all of them; with NVMe offload ``nvme_optimizer_states`` and
        ``nvme_params``, the bytes of the master and state, and of the parameter shard, kept on
        the drive (not in the total).

        Where the peak is (since the engine was built, or the last ``reset_peak=True``):
        ``gathered_params_peak`` - stage 3's most bytes of gathered segments at once (the
        module running, prefetched ones, ones kept for backward), ``grad_buckets_peak`` - the
        most bytes of gradient staging and reduce outputs in flight (stages 2-3),
        ``peak_total`` - the states held permanently plus both peaks: the engine's own
        memory at its peak (activations and autograd's temporaries are the model's). And
        ``heap_free``: bytes the C allocator holds free (glibc; resident or not), the slack
        the process can see - see zero_optimization.return_free_host_memory.
        ``checkpoint_staging``: the host buffers asynchronous saves copy the states into
        (kept from one save to the next; not in the totals)."""
        managed = {id(p) for p in self._managed_params()}
        params = sum(fg.nbytes() for fg in self.flat_groups)
        params += sum(p.numel() * p.element_size() for p in self.module.parameters()
                      if id(p) not in managed)
        gathered = gathered_peak = 0
        if self.fetcher is not None:
            params += self.fetcher.secondary_nbytes()
            gathered = self.fetcher.gathered_nbytes()
            gathered_peak = self.fetcher.peak_gathered_bytes
        grads = self.reducer.nbytes()
        staging = self.reducer.staging_nbytes()
        states = sum(fg.master_nbytes() for fg in self.flat_groups)
        host_states = sum(fg.master_nbytes(host=True) for fg in self.flat_groups)
        if self.offload is not None:
            host_states += self.optimizer.state_nbytes()
        else:
            states += self.optimizer.state_nbytes()
        swap = self.optimizer.swap
        if swap is not None:
            host_states += swap.host_bytes()  # the tiles' slots
        host_params = sum(fg.nbytes(host=True) for fg in self.flat_groups)
        if self.param_swap is not None:
            host_params += self.param_swap.host_bytes()  # its cache and reads in flight
        report = {"params": params + gathered, "grads": grads, "optimizer_states": states,
                  "host_params": host_params,
                  "host_grads": self.offload.nbytes() if self.offload is not None else 0,
                  "host_optimizer_states": host_states}
        report["total"] = sum(report.values())
        report["gathered_params_peak"] = gathered_peak
        report["grad_buckets_peak"] = self.reducer.peak_staging_bytes
        report["peak_total"] = report["total"] - gathered - staging + gathered_peak + \
            self.reducer.peak_staging_bytes
        report["heap_free"] = heap_free_bytes()
        report["checkpoint_staging"] = self.checkpoints.staging_nbytes()
        if swap is not None:  # on the drive, not in memory: outside the total
            report["nvme_optimizer_states"] = swap.file_bytes()
        if self.param_swap is not None:
            report["nvme_params"] = self.param_swap.file_bytes()
        if reset_peak:
            self.reducer.reset_peak()
            if self.fetcher is not None:
                self.fetcher.reset_peak()
        return report

    def comm_report(self, reset: bool = True) -> dict[str, dict[str, int]]:
        """Bytes this rank sent/received per collective kind since the last call. Hybrid
        sharding: kinds inside the shard group are named as in a plain run, the all-reduce
        across groups ``all_reduce@replica_group`` (the traffic that crosses nodes)."""
        out = self.comm.report(reset)
        for name, comm in self.topology.comms().items():
            if name == "world":
                continue
            for kind, counts in comm.report(reset).items():
                key = kind if name == "shard_group" else f"{kind}@{name}"
                if key in out:
                    out[key] = {k: out[key][k] + v for k, v in counts.items()}
                else:
                    out[key] = counts
        return out

    # -- checkpoints (sharded.py) ------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: str | None = None,
                        client_state: dict | None = None, node_local: bool = False,
                        save_latest: bool = True, format: str = "zeroengine",
                        async_save: bool | None = None):
        """Collective: each rank writes its own shards of ``<save_dir>/<tag>`` (default tag
        ``global_step<N>``), atomically; ``latest`` then names it. Returns the path.
        ``node_local=True``: each rank's ``save_dir`` is its own (not shared); the checkpoint
        is the union of the ranks' directories, as Ray Train assembles it.
        ``format="dcp"``: a torch.distributed.checkpoint directory in FSDP2's layout
        ({"model": ..., "optim": ...}) that FSDP2/torchtitan load with ``dcp.load`` (no RNG
        states in it); ``load_checkpoint`` reads either.
        ``async_save=True`` (default: the config's checkpoint.async_save): return a
        ``concurrent.futures.Future`` of the path as soon as this rank's states are copied to
        host memory; the files are written and committed in the background (checkpoint/
        saver.py). Every save, synchronous or not, fails on every rank at once or on none:
        ``latest`` then still names the last complete checkpoint (checkpoint/commit.py)."""
        if format == "dcp":
            if async_save:
                raise NotImplementedError("save_checkpoint(format='dcp', async_save=True) is "
                                          "not supported: DCP's own save holds the loop; use "
                                          "the default format for asynchronous saves")
            from ..checkpoint.dcp_save import save_dcp
            from ..checkpoint.sharded import checked_tag
            if node_local:
                raise ValueError("save_checkpoint(format='dcp', node_local=True): DCP writes "
                                 "one shared directory; leave node_local out")
            return save_dcp(self, save_dir, checked_tag(tag, self), client_state, save_latest)
        if format != "zeroengine":
            raise ValueError(f"save_checkpoint(format={format!r}): 'zeroengine' (default) or "
                             "'dcp'")
        from ..checkpoint.sharded import save_checkpoint
        return save_checkpoint(self, save_dir, tag, client_state, node_local, save_latest,
                               async_save)

    def load_checkpoint(self, load_dir: str, tag: str | None = None, **options):
        """Collective: restore from ``<load_dir>/<tag>`` (None: the latest), whatever world
        size, stage or offload it was saved with. Returns (path, client_state). Options:
        load_optimizer_states, load_lr_scheduler_states, load_module_only, missing_ok (return
        (None, None) instead of raising when nothing was saved yet: the resume pattern),
        load_rng_states (default True: each rank's torch/numpy/Python generators as saved)."""
        from ..checkpoint.sharded import load_checkpoint
        return load_checkpoint(self, load_dir, tag, **options)

    def save_pretrained(self, save_dir: str, max_shard_size="5GB", dtype=None) -> list[str]:
        """Collective: the weights in the Hugging Face layout (``model.safetensors``, or
        ``model-0000k-of-0000N.safetensors`` and ``model.safetensors.index.json``), with the
        model's config.json when it is a transformers model; ``from_pretrained`` loads it.
        Streamed: tensor by tensor, each rank writing its own files (file k: rank k mod
        world) in a thread while the next are gathered; a rank holds about one output file.
        ``dtype``: bf16/fp16/fp32 (default: the training dtype). Returns this rank's files."""
        from ..checkpoint.hf_export import save_pretrained
        return save_pretrained(self, save_dir, max_shard_size, dtype)

    def save_16bit_model(self, save_dir: str, save_filename: str = "model.safetensors") -> bool:
        """Collective: rank 0 writes the model's weights in the compute dtype (bf16/fp16, or
        fp32 when that is what it trains in) as one safetensors file. At stage 3 this needs
        ``stage3_gather_16bit_weights_on_model_save`` (as in DeepSpeed); without it nothing is
        written and False is returned."""
        from ..checkpoint.hf_export import save_16bit_model
        return save_16bit_model(self, save_dir, save_filename)

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: on every rank, the full fp32 state dict with model.state_dict()'s keys."""
        full_values: dict[int, torch.Tensor] = {}
        for fg in self.flat_groups:
            full = fg.full_fp32(self.topology.shard)
            for i, p in enumerate(fg.params):
                slot = fg.layout.slots[i]
                full_values[id(p)] = full[slot.offset:slot.offset + slot.numel].view(slot.shape)
        out = {}
        for name, t in uncompiled(self.module).state_dict(keep_vars=True).items():
            value = full_values.get(id(t))
            if value is None:
                value = t.detach()
                value = value.float() if value.is_floating_point() else value
            out[name] = value.clone().cpu()
        return out


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


def _cast_floating(value, dtype: torch.dtype):
    """``value`` with every floating-point tensor in it (through lists, tuples and dicts) cast
    to ``dtype``."""
    if torch.is_tensor(value):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_floating(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floating(v, dtype) for k, v in value.items()}
    return value
