"""The step clock: the one owner of "an optimizer step happened" and of what follows from it.

A step completes in several ways - ``engine.step()`` at an accumulation boundary, the user's
own optimizer's ``step()`` in a loop written for DDP (drop_in.redirect_optimizer), a list of
optimizers stepped one after another (only the first steps: OptimizerChain), a trainer
integration calling either - and all of them end in ``ShardedOptimizer.step``, which reports
to the clock. The clock then, once per step:

- advances ``global_steps`` and ``global_samples`` (by ``train_batch_size`` when the config
  gives the batch sizes) and, for a step skipped on an fp16 overflow or ``on_nonfinite:
  "skip"``, ``skipped_steps``; ``micro_steps`` counts engine.step() calls, or in a plain loop
  the backwards of the step;
- steps the lr scheduler it drives, not on a skipped step (DeepSpeed's rule);
- writes the monitor events (monitor.py), logs progress every ``steps_per_print`` steps and,
  with ``wall_clock_breakdown``, the forward / backward / step times.

Which scheduler the clock drives: the config's "scheduler" always (the user has no other way
to step it); a scheduler passed to ``initialize`` when steps come through ``engine.step()``
(DeepSpeed's engine steps it), and not in a plain loop of ``opt.step()``, where the user's loop
steps its own scheduler as it did under DDP. A scheduler the clock drives is never stepped a
second time: a ``scheduler.step()`` from the user's loop is ignored, with one warning.

A loop that mixes the two ways so that steps cannot be counted - ``opt.step()`` while
``engine.step()`` is counting an accumulation's micro-steps, or both stepping the gradients of
one backward - is refused by name (MixedStepError).
"""
from __future__ import annotations

import contextlib
import logging
import time
import warnings
import weakref

import torch

from ...errors import MixedStepError

logger = logging.getLogger("zeroengine")


class StepTimers:
    """wall_clock_breakdown: seconds in forward, backward and the optimizer step since the last
    report. Forward is the model's outermost call; backward is engine.backward(), or in a plain
    loop the time from the end of the forward to the end of the backward pass (the loss is
    computed in between); step is the optimizer step. On CUDA the device is synchronised at
    each mark, as DeepSpeed's timers do, so the times are the device's."""

    KINDS = ("forward", "backward", "step")

    def __init__(self, sync=None):
        self.sync = sync or (lambda: None)
        self.total = dict.fromkeys(self.KINDS, 0.0)
        self.started: dict[str, float] = {}
        self.forward_end: float | None = None
        self.in_engine_backward = False
        self.steps = 0

    def start(self, kind: str) -> None:
        self.sync()
        self.started[kind] = time.perf_counter()

    def stop(self, kind: str) -> None:
        began = self.started.pop(kind, None)
        if began is None:
            return
        self.sync()
        now = time.perf_counter()
        self.total[kind] += now - began
        if kind == "forward":
            self.forward_end = now

    def backward_pass_ended(self) -> None:
        """The reducer saw a backward end: in a plain loop, count it from the forward's end."""
        if self.in_engine_backward or self.forward_end is None:
            return
        self.sync()
        self.total["backward"] += time.perf_counter() - self.forward_end
        self.forward_end = None

    def report(self) -> str:
        per = max(self.steps, 1)
        text = " | ".join(f"{k}: {1000 * self.total[k] / per:.2f}" for k in self.KINDS)
        self.total = dict.fromkeys(self.KINDS, 0.0)
        self.steps = 0
        return f"time (ms, mean per optimizer step) | {text}"


class StepClock:
    def __init__(self, *, config, rank: int, monitor, scheduler=None,
                 scheduler_from_config: bool = False, sync=None):
        """``scheduler``: the lr scheduler the engine holds; ``scheduler_from_config``: it was
        built from the config's "scheduler" (always driven), else the user passed it."""
        self.global_steps = 0
        self.micro_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self.samples_per_step = config.train_batch_size or 0
        self.steps_per_print = config.steps_per_print
        self.fp16 = config.fp16.enabled
        self.rank = rank
        self.monitor = monitor
        self.timers = StepTimers(sync) if config.wall_clock_breakdown else None
        self.optimizer = None  # bound by the engine once built (lrs, loss scale)
        self.backward_pending = False  # engine.backward() ran for the current micro-step
        self.last_step_applied = False  # the latest step() updated the parameters
        self._engine_micro = 0  # engine.step() micro-steps since the last optimizer step
        self._by_engine = False  # inside engine.step()'s optimizer step
        self._lr_kwargs: dict = {}
        self._last_driver: str | None = None  # "engine.step()" or "optimizer.step()"
        self._loss_sum: torch.Tensor | None = None  # this step's losses (monitor)
        self._loss_count = 0
        self._scheduler = None
        self._drive: bool | None = None  # None: decided by the first step's path
        self._in_scheduler_step = False
        self._warned_user_step = False
        self.set_scheduler(scheduler, scheduler_from_config)

    def bind(self, optimizer) -> None:
        self.optimizer = optimizer

    # -- the scheduler ---------------------------------------------------------------------
    @property
    def scheduler(self):
        return self._scheduler

    def set_scheduler(self, scheduler, from_config: bool = False) -> None:
        self._scheduler = scheduler
        self._drive = True if from_config else None
        if scheduler is not None and from_config:
            self._guard(scheduler)

    def _guard(self, scheduler) -> None:
        """Make the user's calls of ``scheduler.step()`` no-ops while the clock drives it.
        The object's class is swapped for a subclass (not an instance attribute: a
        scheduler's state_dict() is its __dict__, which must stay plain data)."""
        base = type(scheduler)
        if getattr(base, "_zeroengine_clock", None) is not None:
            base._zeroengine_clock = weakref.ref(self)
            return
        clock_ref = weakref.ref(self)

        def step(sched, *args, **kwargs):
            clock = type(sched)._zeroengine_clock()
            if clock is not None and not clock._in_scheduler_step and clock._drive:
                clock._user_stepped_driven_scheduler()
                return None
            return base.step(sched, *args, **kwargs)

        scheduler.__class__ = type(base.__name__, (base,), {
            "step": step, "__module__": base.__module__, "__qualname__": base.__qualname__,
            "_zeroengine_clock": clock_ref})

    def _user_stepped_driven_scheduler(self) -> None:
        if not self._warned_user_step:
            self._warned_user_step = True
            warnings.warn(
                "lr_scheduler.step() was called by the training loop, but the engine steps this "
                "scheduler at every optimizer step (the config's \"scheduler\", or one passed to "
                "initialize() in a loop of engine.step()); the call is ignored so that the "
                "schedule is not advanced twice. Drop the call (or the scheduler from "
                "initialize/the config and step your own)", stacklevel=3)

    def _step_scheduler(self, by_engine: bool) -> None:
        if self._scheduler is None:
            return
        if self._drive is None:  # a scheduler passed to initialize: the first step decides
            self._drive = by_engine
            if by_engine:
                self._guard(self._scheduler)
        if not self._drive:
            return
        self._in_scheduler_step = True
        try:
            self._scheduler.step(**self._lr_kwargs)
        finally:
            self._in_scheduler_step = False

    # -- micro-steps -----------------------------------------------------------------------
    def record_loss(self, loss: torch.Tensor) -> None:
        """engine.backward's loss, summed on the device (no host sync per micro-step)."""
        if self.monitor.enabled:
            value = loss.detach().float()
            self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
            self._loss_count += 1

    def engine_micro_step(self, boundary: bool) -> None:
        """engine.step(): one micro-step counted; at a boundary the optimizer step follows."""
        self.micro_steps += 1
        self.backward_pending = False
        if not boundary:
            self._engine_micro += 1
            self.last_step_applied = False

    @contextlib.contextmanager
    def engine_step(self, lr_kwargs: dict | None = None):
        """engine.step()'s optimizer step (tells the clock which path this step came by);
        ``lr_kwargs``: for the scheduler's step() (DeepSpeed's engine.step argument)."""
        self._by_engine, self._lr_kwargs = True, lr_kwargs or {}
        try:
            yield
        finally:
            self._by_engine, self._lr_kwargs = False, {}

    @contextlib.contextmanager
    def timing(self, kind: str):
        if self.timers is None:
            yield
            return
        if kind == "backward":
            self.timers.in_engine_backward = True
        self.timers.start(kind)
        try:
            yield
        finally:
            self.timers.stop(kind)
            if kind == "backward":
                self.timers.in_engine_backward = False
                self.timers.forward_end = None

    # -- the optimizer step ----------------------------------------------------------------
    def check_step(self, backwards: int) -> None:
        """Before an optimizer step with ``backwards`` backward passes since the last one:
        refuse the mixes of engine.step() and optimizer.step() that cannot be counted."""
        driver = "engine.step()" if self._by_engine else "optimizer.step()"
        if not self._by_engine and self._engine_micro:
            raise MixedStepError(
                f"optimizer.step() was called after {self._engine_micro} engine.step() "
                "micro-step(s) of an accumulation (gradient_accumulation_steps counts "
                "engine.step() calls): the loop mixes the engine's step with the optimizer's "
                "own, and the steps cannot be counted. Use one of the two: engine.backward(loss)"
                " + engine.step() every micro-step, or loss.backward() + optimizer.step() at "
                "your own accumulation boundary")
        if backwards == 0 and self._last_driver not in (None, driver):
            raise MixedStepError(
                f"{driver} was called after {self._last_driver} already stepped the gradients "
                "of the last backward: the loop mixes the engine's step with the optimizer's "
                "own, which would apply one gradient twice and count two steps. Call one of "
                "the two after each backward (engine.step(), or optimizer.step())")

    def optimizer_stepped(self, applied: bool, backwards: int) -> None:
        """One optimizer step completed (``applied``: False when skipped on an overflow or a
        non-finite gradient), after ``backwards`` backward passes."""
        by_engine = self._by_engine
        self._last_driver = "engine.step()" if by_engine else "optimizer.step()"
        if not by_engine:  # a plain loop: its backwards are its micro-steps
            self.micro_steps += backwards
            self.backward_pending = False
        self._engine_micro = 0
        self.last_step_applied = applied
        self.global_steps += 1
        self.global_samples += self.samples_per_step
        if applied:
            self._step_scheduler(by_engine)
        else:
            self.skipped_steps += 1
        if self.timers is not None:
            self.timers.steps += 1
        every = self.steps_per_print
        if every and self.global_steps % every == 0 and self.rank == 0:
            self._log_progress()
        if self.monitor.enabled:
            self._write_monitor_events()

    # -- reports ---------------------------------------------------------------------------
    def lrs(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def loss_scale(self) -> float:
        scaler = self.optimizer.loss_scaler
        return scaler.scale if scaler is not None else 1.0

    def _log_progress(self) -> None:
        """Rank 0, every steps_per_print optimizer steps, as DeepSpeed's engine logs them."""
        if not logger.handlers and not logging.getLogger().handlers:
            # nothing configured to show INFO: say it on stderr, as DeepSpeed's own logger does
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[zeroengine] %(message)s"))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
        logger.info("step=%d, skipped=%d, lr=%s, loss_scale=%g", self.global_steps,
                    self.skipped_steps, [float(f"{lr:.6g}") for lr in self.lrs()],
                    self.loss_scale())
        if self.timers is not None:
            logger.info("%s", self.timers.report())

    def _write_monitor_events(self) -> None:
        """DeepSpeed's per-step events (monitor.py) against the samples seen so far (the
        optimizer steps when no batch size was configured)."""
        x = self.global_samples if self.samples_per_step else self.global_steps
        events = [("Train/Samples/lr", self.lrs()[0], x)]
        if self._loss_sum is not None:
            loss = self._loss_sum.item() / self._loss_count
            events.insert(0, ("Train/Samples/train_loss", loss, x))
            self._loss_sum, self._loss_count = None, 0
        if self.fp16:
            events.append(("Train/Samples/loss_scale", float(self.loss_scale()), x))
        self.monitor.write(events)

    # -- checkpoints -------------------------------------------------------------------------
    def state(self) -> dict:
        return {"global_steps": self.global_steps, "micro_steps": self.micro_steps,
                "global_samples": self.global_samples, "skipped_steps": self.skipped_steps}

    def load(self, state: dict) -> None:
        self.global_steps = int(state["global_steps"])
        self.micro_steps = int(state["micro_steps"])
        self.skipped_steps = int(state["skipped_steps"])
        # checkpoints before the clock did not store it: the steps at this batch size
        self.global_samples = int(state.get("global_samples",
                                            self.global_steps * self.samples_per_step))
        self._engine_micro = 0
        self._last_driver = None
        self.backward_pending = False
