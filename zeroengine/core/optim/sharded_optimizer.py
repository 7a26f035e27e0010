"""ShardedOptimizer: a torch.optim.Optimizer to the outside, a step over the rank's shard inside.

Outside: ``param_groups`` are the user's own group dicts (the very same objects, so an lr
scheduler built on the user's optimizer still drives the learning rate), holding the model's
parameters. Inside: an optimizer of the user's class and hyperparameters whose parameters are
the rank's master chunks (one tensor per segment). Because the optimizer is elementwise, a step
over chunks of flat buffers equals the step over the original tensors.

A step: make gradients final (``GradReducer.flush``), compute the global norm over all shards,
clip, copy hyperparameters outer -> inner, step the chunks; ParamSync (param_sync.py) then
makes the updated masters the model's values on every rank. With offload (optimizer_offload.py)
the chunks are host copies, the inner optimizer runs on the CPU, and updated values are copied
back; with NVMe offload (optimizer_swap.py) those host copies live on the drive and each
sub-group is read in before it steps and written back after.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from ...distributed.comm import Comm
from ...errors import NonFiniteGradientError
from ...handles import Handle
from ..grad_reducer import GradReducer
from ..layout.flat_param_group import FlatParamGroup
from ..offload.host_memory import return_free_heap
from ..offload.optimizer_offload import OptimizerOffload
from ..param_sync import ParamSync
from ..sharding import Sharding
from .chain import init_without_copying_groups
from .factory import (
    IMPLEMENTATION_KEYS,
)
from .inner_parts import InnerPart, build_inner_parts
from .nonfinite import nonfinite_message
from .owner_step import OwnedParams
from .precision import LossScaler, OptimizerPrecision
from .shard_state import ShardStateIO

logger = logging.getLogger("zeroengine")

# bf16.store_param_remainders: elements of fp32 master rebuilt at a time (16 MB; at least one
# segment), whatever zero_optimization.sub_group_size allows
REMAINDER_WINDOW = 1 << 22


@dataclass(frozen=True)
class StepSettings:
    """How a step is taken (the config's keys, resolved once by the engine)."""
    clip: float  # gradient_clipping (0: off)
    sub_group_numel: int  # zero_optimization.sub_group_size
    on_nonfinite: str  # without a loss scaler: "raise" or "skip"


class ShardedOptimizer(ShardStateIO, torch.optim.Optimizer):
    def __init__(self, base: torch.optim.Optimizer, flat_groups: list[FlatParamGroup],
                 reducer: GradReducer, comm: Comm, *, sharding: Sharding, settings: StepSettings,
                 loss_scaler: LossScaler | None = None, offload: OptimizerOffload | None = None,
                 param_sync: ParamSync, param_names: dict[int, str] | None = None, swap=None,
                 clock, precision: OptimizerPrecision | None = None,
                 element_index: dict[int, int] | None = None):
        """Collaborators: ``reducer`` makes the gradients final, ``offload`` (optional) holds
        the step's host buffers, ``param_sync`` makes the updated masters the model's values
        on every rank (param_sync.py). ``swap`` (NVMe offload): the OptimizerSwap holding the
        masters on the drive; the state joins them, and each sub-group becomes one of its
        tiles. ``precision``: the
        dtypes of masters and states (bf16/fp16 master keys); ``element_index``: id(param)
        -> the index of its first element in the model, where stochastic rounding's random
        bits come from."""
        # Deliberately not calling Optimizer.__init__: it would copy the groups, and sharing the
        # user's dicts is what keeps their schedulers working.
        init_without_copying_groups(self, base.defaults)
        self.param_groups = base.param_groups
        self.state = {}  # per-parameter state lives in the inner optimizer, by chunk
        self._zero_grad_profile_name = "ShardedOptimizer.zero_grad"
        self.base_class = type(base)
        self.flat_groups = flat_groups
        self.reducer, self.offload, self.param_sync = reducer, offload, param_sync
        self.comm, self.sharding, self.settings = comm, sharding, settings
        self.last_grad_norm: float | None = None
        self.loss_scaler = loss_scaler
        self.param_names = param_names or {}  # id(param) -> name, for messages
        # every completed step is reported to the clock, which counts it (step_clock.py)
        self.clock = clock
        self.steps = 0
        self.stepped_at_backward = -1  # reducer.backward_count at the last step
        # torch.nn.utils.clip_grad_norm_ called by the user's loop: (max_norm, norm, backward
        # passes seen then), applied by the next step (see drop_in.py)
        self._user_clip: tuple[float, float, int] | None = None
        self.precision = precision or OptimizerPrecision()
        self.element_index = element_index or {}
        self._index_runs: dict[tuple[int, int], torch.Tensor] = {}  # stochastic rounding's
        built = build_inner_parts(base, self.param_groups, flat_groups, comm, offload,
                                  self.precision)
        self.parts: list[InnerPart] = built.parts
        self.owned: dict[int, OwnedParams] = built.owned  # flat group index -> its owners' view
        self._part_of = built.part_of  # flat group index -> index into self.parts
        self._inner_of_outer = built.inner_of_outer  # user group -> its inner groups
        self.inner = built.inner
        limit = settings.sub_group_numel
        if any(fg.remainder is not None for fg in flat_groups):
            # the fp32 masters rebuilt from remainders live for their sub-group's step: a
            # small window keeps them from adding the fp32 master back to the peak
            limit = min(limit, REMAINDER_WINDOW)
        self.sub_groups = self._plan_sub_groups(limit)
        self.swap = swap
        if swap is not None:
            if self.owned:
                names = sorted({type(self.parts[self._part_of[fi]].optimizer).__name__
                                for fi in self.owned})
                raise ValueError(
                    f"offload_optimizer.device 'nvme' swaps per-element optimizer state in "
                    f"tiles of flat shards; {', '.join(names)} updates whole tensors "
                    "(tensor-wise), so its state cannot be tiled: use offload_optimizer.device "
                    "'cpu' for it")
            swap.attach(self.flat_groups, self.sub_groups,
                        lambda fi: self.parts[self._part_of[fi]].optimizer.state)

    def _runs(self, fi: int, s: int) -> torch.Tensor:
        """Stochastic rounding: segment s of group fi's chunk as int64 [k, 3] runs (first
        element in the chunk, count, the first's index in the model), padding left out."""
        key = (fi, s)
        if key not in self._index_runs:
            fg = self.flat_groups[fi]
            seg = fg.layout.segments[s]
            rows = []
            for piece in fg.layout.shard_pieces(fg.rank):
                local = piece.shard_offset - seg.shard_offset
                if 0 <= local < seg.chunk_numel:
                    base = self.element_index[id(fg.params[piece.param])]
                    rows.append([local, piece.numel, base + piece.param_offset])
            self._index_runs[key] = torch.tensor(sorted(rows), dtype=torch.int64) \
                .reshape(-1, 3)
        return self._index_runs[key]

    @property
    def inner_name(self) -> str:
        """The inner optimizers' class names (what a checkpoint's state belongs to)."""
        return "+".join(type(part.optimizer).__name__ for part in self.parts)

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

    def global_grad_norm(self, grads: list[list[torch.Tensor]], norm_type: float = 2.0) -> float:
        """The norm of the full (reduced) gradient: a local reduction over the rank's shards
        + one tiny all-reduce (sum of |g|^p, or max for the inf-norm)."""
        device = self.flat_groups[0].device if self.flat_groups else "cpu"
        total = torch.zeros(1, dtype=torch.float32, device=device)
        infinite = math.isinf(norm_type)
        for segs in grads:
            for g in segs:
                local = torch.linalg.vector_norm(g, norm_type, dtype=torch.float32)
                if infinite:
                    total = torch.maximum(total, local)
                else:
                    total += local ** norm_type
        if any(fg.sharded for fg in self.flat_groups):
            self.comm.all_reduce(total, "max" if infinite else "sum", what="the gradient norm")
        return total.item() if infinite else total.item() ** (1.0 / norm_type)

    @torch.no_grad()
    def clip_grad_norm_(self, params: list, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ for the engine's parameters (drop_in.py routes it
        here): the norm of the reduced gradient over all ranks, returned now; the clip
        coefficient is applied by the next step(). Collective."""
        given = {id(p) for p in params}
        missing = [self.param_names.get(id(p), tuple(p.shape)) for fg in self.flat_groups
                   for p in fg.params if id(p) not in given]
        if missing:
            raise RuntimeError(
                f"clip_grad_norm_ was given {len(given)} parameters but the engine also trains "
                f"{len(missing)} others (first: {missing[0]!r}); zeroengine clips by the norm of "
                "all of its parameters' gradients: pass model.parameters()")
        if norm_type <= 0:
            raise ValueError(f"clip_grad_norm_: norm_type must be positive, got {norm_type}")
        self.reducer.flush()
        grads = [self.reducer.owned_grad_segments(fg) for fg in self.flat_groups]
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        norm = self.global_grad_norm(grads, norm_type) / scale
        if error_if_nonfinite and not math.isfinite(norm):
            raise RuntimeError(f"The total norm of order {norm_type} for gradients from "
                               "`parameters` is non-finite, so it cannot be clipped. To disable "
                               "this error and scale the gradients by the non-finite norm "
                               "anyway, set `error_if_nonfinite=False`")
        self._user_clip = (max_norm, norm, self.reducer.backwards_since_step)
        device = self.flat_groups[0].device if self.flat_groups else "cpu"
        return torch.tensor(norm, device=device)

    def _plan_sub_groups(self, limit: int) -> list[list[tuple[int, int]]]:
        """Batches of (flat group, segment) stepped together, at most ``limit`` elements each
        (at least one segment): bounds the fp32 gradient copies alive during a step, and lets
        a batch's all-gather run while the next batch steps."""
        batches, current, numel = [], [], 0
        for fi, fg in enumerate(self.flat_groups):
            if fi in self.owned:
                continue  # tensor-wise: stepped whole, group by group (owner_step.py)
            for s, seg in enumerate(fg.layout.segments):
                if current and numel + seg.chunk_numel > limit:
                    batches.append(current)
                    current, numel = [], 0
                current.append((fi, s))
                numel += seg.chunk_numel
        if current:
            batches.append(current)
        return batches

    # set by the engine where host memory holds the training state (a CPU device, offload):
    # after each step the allocator's free pages go back to the system (host_memory.py)
    trim_host_heap = False

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ShardedOptimizer.step() takes no closure: run forward and "
                             "backward first, then call step()")
        self._opt_called = True  # what torch's lr schedulers check (see _wrapped_by_lr_sched)
        backwards = self.reducer.backward_count - max(self.stepped_at_backward, 0)
        self.clock.check_step(backwards)
        self.comm.step = self.steps + 1  # for messages: the step whose collectives these are
        self.reducer.flush()
        self.steps += 1
        self.stepped_at_backward = self.reducer.backward_count
        try:
            applied = self._step()
        finally:
            if self.swap is not None:
                self.swap.finish()
            if self.offload is not None:
                self.offload.finish_step()
            self.comm.step = self.steps + 1  # the next backward's collectives belong to it
        if self.trim_host_heap:
            return_free_heap()
        self.clock.optimizer_stepped(applied, backwards)
        return None

    @property
    def skipped_steps(self) -> int:
        return self.clock.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self.clock.skipped_steps = value

    def _step(self) -> bool:
        """The update; False when the step is skipped (fp16 overflow, on_nonfinite 'skip')."""
        user_clip, self._user_clip = self._user_clip, None
        if user_clip is not None and user_clip[2] != self.reducer.backwards_since_step:
            raise RuntimeError("clip_grad_norm_ was called, then another backward ran before "
                               "optimizer.step(): the clip was computed for other gradients. "
                               "Clip after the last backward of the step")
        grads = [self.reducer.owned_grad_segments(fg) for fg in self.flat_groups]
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        # One all-reduce gives the norm and the overflow check: any inf/NaN on any rank makes
        # the global sum of squares non-finite everywhere.
        norm = self.global_grad_norm(grads) / scale
        self.last_grad_norm = norm
        if self.loss_scaler is not None:
            old_scale = self.loss_scaler.scale
            overflow = not math.isfinite(norm)
            self.loss_scaler.update(overflow, step=self.steps)
            if self.loss_scaler.scale != old_scale and self.comm.rank == 0:
                logger.info("fp16 loss scale %g -> %g at step %d (%d steps skipped so far)",
                            old_scale, self.loss_scaler.scale, self.steps,
                            self.skipped_steps + overflow)
            if overflow:
                return False  # the clock counts it skipped
        elif not math.isfinite(norm):
            if self.settings.on_nonfinite == "skip":
                if self.comm.rank == 0:
                    logger.warning("step %d skipped: a gradient is not finite (on_nonfinite="
                                   "'skip'; %d steps skipped so far)", self.steps,
                                   self.skipped_steps + 1)
                return False
            raise NonFiniteGradientError(nonfinite_message(self, grads))
        coef = 1.0 / scale
        if user_clip is not None:  # the user's loop called clip_grad_norm_ before step()
            max_norm, user_norm, _ = user_clip
            coef *= min(max_norm / (user_norm + 1e-6), 1.0)
            norm *= coef * scale  # what the config's clipping below sees
        if self.settings.clip > 0:
            # The coefficient torch.nn.utils.clip_grad_norm_ applies, on unscaled gradients.
            coef *= min(self.settings.clip / (norm + 1e-6), 1.0)
        self._sync_hyperparameters()
        for tile, batch in enumerate(self.sub_groups):
            if self.swap is not None:
                self.swap.acquire(tile)  # read from the drive (or read ahead already)
            by_part: dict[int, list[tuple[int, int]]] = {}
            for fi, s in batch:
                by_part.setdefault(self._part_of[fi], []).append((fi, s))
            written: set = set()
            joined = self._join_remainders(batch)
            for k, entries in by_part.items():
                written |= self._step_entries(self.parts[k], entries, grads, coef)
            written |= self._settle_remainders(joined)
            copies: list[Handle] = []
            self.param_sync.start(batch, written, copies)
            if self.swap is not None:
                self.swap.release(tile, copies)
        for fi, owned in self.owned.items():
            fg = self.flat_groups[fi]
            segments = range(len(fg.layout.segments))
            masters = fg.master_segments
            group_grads = [self.offload.grad_segment(fi, s, grads[fi][s])
                           if self.offload is not None else grads[fi][s] for s in segments]
            joined = self._join_remainders([(fi, s) for s in segments])
            owned.step(self.parts[self._part_of[fi]].optimizer, masters, group_grads, coef)
            written = self._settle_remainders(joined)
            self.param_sync.start([(fi, s) for s in segments], written)
        self.param_sync.finish()
        return True

    def _join_remainders(self, batch) -> list[tuple[int, int]]:
        """bf16.store_param_remainders: the exact fp32 masters of ``batch`` ((group, segment)
        pairs) made for the step (one sub-group's worth at a time). Returns those made."""
        joined = [(fi, s) for fi, s in batch if self.flat_groups[fi].remainder is not None]
        for fi, s in joined:
            self.flat_groups[fi].join_masters([s])
        return joined

    def _settle_remainders(self, joined) -> set:
        """After the step: each updated fp32 master split back into its bf16 weight (rounded to
        nearest, as publishing an fp32 master would) and remainder. Returns the pairs whose
        model chunk already holds the weight (not offloaded)."""
        written = set()
        for fi, s in joined:
            fg = self.flat_groups[fi]
            fg.settle_masters([s], write_back=True)
            if fg.master is None:
                written.add((fi, s))
        return written

    def _step_entries(self, part: InnerPart, entries, grads, coef: float) -> set:
        """Step ``part`` (elementwise) over ``entries`` ((flat group, segment) pairs). Returns
        the pairs whose model values the step already wrote."""
        if part.fused:
            return self._fused_step(part.optimizer, entries, grads, coef)
        if part.mixed:
            return self._mixed_step(part, entries, grads, coef)
        copy_out = {}  # master chunk -> tensor receiving its low-precision values
        for fi, s in entries:
            master, grad = self.flat_groups[fi].master_segments[s], grads[fi][s]
            if self.offload is not None:
                grad = self.offload.grad_segment(fi, s, grad)
                target = self.offload.copy_out_target(fi, s) if part.copy_out else None
                if target is not None:
                    copy_out[(fi, s)] = target
            elif grad.dtype != torch.float32:
                grad = grad.float()  # a temporary fp32 copy, one sub-group at a time
            if coef != 1.0:
                grad.mul_(coef)
            master.grad = grad
        if part.copy_out:
            part.optimizer.step(low_precision_copies={
                self.flat_groups[fi].master_segments[s]: t for (fi, s), t in copy_out.items()})
        else:
            part.optimizer.step()
        for fi, s in entries:
            self.flat_groups[fi].master_segments[s].grad = None
        return set(copy_out)

    def _mixed_step(self, part: InnerPart, entries, grads, coef: float) -> set:
        """One CPUAdam pass per chunk over 16-bit masters and/or states: gradients as reduced
        (or their host copies), the coefficient applied in the pass. Returns the pairs whose
        model values are already written (the master is the model's chunk, or its copy-out)."""
        grad_of, copy_out, runs, written = {}, {}, {}, set()
        for fi, s in entries:
            fg = self.flat_groups[fi]
            master, grad = fg.master_segments[s], grads[fi][s]
            if self.offload is not None:
                grad = self.offload.grad_segment(fi, s, grad)
                target = self.offload.copy_out_target(fi, s) if part.copy_out else None
                if target is not None:
                    copy_out[master] = target
                    written.add((fi, s))
            elif fg.master is None and fg.remainder is None:  # the master is the chunk
                written.add((fi, s))
            grad_of[master] = grad
            if self.precision.stochastic:
                runs[master] = self._runs(fi, s)
        part.optimizer.step(grads=grad_of, grad_coef=coef, low_precision_copies=copy_out,
                            index_runs=runs or None)
        return written

    def _fused_step(self, inner, batch, grads, coef: float) -> set:
        """One FusedAdam launch over the batch: gradients as reduced (bf16/fp16/fp32), the
        coefficient applied in the kernel, the compute-dtype chunk written in the same pass.
        Returns the (group, segment) pairs whose model values are already up to date."""
        grad_of, lows, written = {}, {}, set()
        for fi, s in batch:
            fg = self.flat_groups[fi]
            master = fg.master_segments[s]
            grad_of[master] = grads[fi][s]
            if fg.remainder is not None:  # its weights come from splitting the master after
                continue
            if fg.master is None:  # fp32: the master is the model's own chunk
                written.add((fi, s))
                continue
            if fg.param_swap is not None:  # on the drive: publish writes it through the swap
                continue
            chunk = fg.chunk(s)
            if chunk.device == master.device:  # not an offloaded stage-3 shard
                lows[master] = chunk
                written.add((fi, s))
        inner.step(low_precision_copies=lows, grad_coef=coef, grads=grad_of)
        return written

    def republish(self) -> None:
        """Every master (changed outside a step: a checkpoint load) becomes the model's
        values on every rank, as after a step. Collective."""
        if self.swap is not None:  # a tile at a time, read and not written back
            try:
                for tile, batch in enumerate(self.sub_groups):
                    self.swap.acquire(tile)
                    copies: list[Handle] = []
                    self.param_sync.start(batch, set(), copies)
                    self.swap.release(tile, copies, changed=False)
            finally:
                self.swap.finish()
        else:
            self.param_sync.start([(fi, s) for fi, fg in enumerate(self.flat_groups)
                                   for s in range(len(fg.layout.segments))], set())
        self.param_sync.finish(refresh=True)

    # Tells torch's LRScheduler that step() already records _opt_called, so it does not warn.
    step._wrapped_by_lr_sched = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffers. ``set_to_none`` is ignored: at stages 0-1 each
        ``param.grad`` is a view into a flat buffer, which must survive."""
        self.reducer.zero_grad()

    def add_param_group(self, param_group: dict) -> None:
        raise RuntimeError("parameter groups are fixed once zeroengine.initialize() has laid the "
                           "parameters out; add them to the optimizer before initialize()")
