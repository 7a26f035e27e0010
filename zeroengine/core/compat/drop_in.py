"""What makes a loop written for plain PyTorch / DDP run unchanged on the engine.

A user who replaces ``DDP(model)`` by ``zeroengine.initialize(model, config, optimizer=opt)``
keeps calling ``opt.step()``, ``opt.zero_grad()`` and
``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)``. Those read ``param.grad``,
which at stages 1-3 is not the reduced gradient (it lives sharded in the engine), so each
would be silently wrong. This module routes them to the engine:

- ``redirect_optimizer``: the user's optimizer object forwards step / zero_grad /
  state_dict / load_state_dict to the ShardedOptimizer that replaced it.
- ``clip_grad_norm_``: installed over torch's by the first engine (and torch's put back when
  the last one closes, so importing zeroengine changes nothing); for the engine's parameters it
  returns the true global norm (a collective: every rank calls it, as under DDP) and the
  clip coefficient is applied by the next optimizer step, on the shards. Any other
  parameters go to torch's own function. A copy of torch's function bound before zeroengine
  was imported is caught where it hands the parameters to ``_clip_grads_with_norm_``, and
  refused there by name (its norm was computed from the wrong gradients).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad as _clip_module

from ...errors import ParameterReplacedError
from .. import registry
from ..optim.chain import OptimizerChain
from .compiled import BucketSplit, is_compiled, uncompiled


def register_parameters(params, optimizer) -> None:
    """An engine's parameters, stepped by ``optimizer``; the first engine installs the
    engine-aware clip_grad_norm_."""
    for p in params:
        registry.hold(p, optimizer=optimizer)
    install()


def unregister_parameters(params) -> None:
    """An engine's close(): its parameters forgotten; torch's clip_grad_norm_ back once no
    engine holds any."""
    for p in params:
        registry.let_go(p, "optimizer")
    if registry.held_count("optimizer") == 0:
        uninstall()


def redirect_optimizer(user_optimizer: torch.optim.Optimizer, sharded,
                       chained: bool = False) -> None:
    """Make the object the user built (and still holds) act as the engine's optimizer.
    ``chained``: one of several optimizers the engine steps as one (OptimizerChain); a loop
    calls step() on each, and only the first call after a backward steps the engine."""
    if user_optimizer is sharded:
        return
    if isinstance(user_optimizer, OptimizerChain):
        for member in user_optimizer.optimizers:
            redirect_optimizer(member, sharded, chained=True)
        return

    @functools.wraps(sharded.step)
    def step(closure=None):
        user_optimizer._opt_called = True  # torch lr schedulers built on this object check it
        if chained and sharded.stepped_at_backward == sharded.reducer.backward_count:
            return None  # another of the chained optimizers stepped these gradients
        return sharded.step(closure)

    step._wrapped_by_lr_sched = True
    user_optimizer.step = step
    for name in ("zero_grad", "state_dict", "load_state_dict", "add_param_group"):
        setattr(user_optimizer, name, getattr(sharded, name))
    user_optimizer._zeroengine_optimizer = sharded


_torch_clip_grad_norm_ = _clip_module.clip_grad_norm_
_torch_clip_grads_with_norm_ = _clip_module._clip_grads_with_norm_
_torch_public_clip_grads = getattr(torch.nn.utils, "clip_grads_with_norm_", None)  # torch >= 2.6


def _engine_parameters(params: list) -> tuple[object | None, list]:
    """(the one ShardedOptimizer owning any of ``params`` or None, the others)."""
    owners, others = {}, []
    for p in params:
        optimizer = registry.held_by(p, "optimizer")
        if optimizer is None:
            others.append(p)
        else:
            owners[id(optimizer)] = optimizer
    if len(owners) > 1:
        raise RuntimeError("clip_grad_norm_ was given the parameters of several zeroengine "
                           "engines at once; clip each engine's parameters separately")
    return (next(iter(owners.values())) if owners else None), others


@functools.wraps(_torch_clip_grad_norm_)
def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False,
                    foreach=None):
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    optimizer, others = _engine_parameters(params)
    if optimizer is None:
        return _torch_clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
    stray = [p for p in others if p.requires_grad and p.grad is not None]
    if stray:
        raise RuntimeError(
            f"clip_grad_norm_ was given {len(stray)} parameters with gradients that the "
            "zeroengine engine does not manage beside its own; their norms cannot be combined "
            "with the engine's sharded gradients. Clip the engine's parameters on their own")
    return optimizer.clip_grad_norm_(params, float(max_norm), float(norm_type),
                                     error_if_nonfinite)


@functools.wraps(_torch_clip_grads_with_norm_)
def _clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    optimizer, _ = _engine_parameters(params)
    if optimizer is not None:
        raise RuntimeError(
            "torch's clip_grad_norm_ / clip_grads_with_norm_ was called on parameters that "
            "zeroengine shards: param.grad is not their reduced gradient there, so the norm "
            "torch computed is wrong. Call torch.nn.utils.clip_grad_norm_ through the module "
            "attribute (the engine replaces it while it exists; a `from torch.nn.utils import "
            "clip_grad_norm_` made before initialize() binds torch's own), or set "
            "\"gradient_clipping\" in the config")
    return _torch_clip_grads_with_norm_(params, max_norm, total_norm, foreach)


def install() -> None:
    """Put the engine-aware functions where torch code looks them up (idempotent)."""
    for module in (torch.nn.utils, _clip_module):
        module.clip_grad_norm_ = clip_grad_norm_
    _clip_module._clip_grads_with_norm_ = _clip_grads_with_norm_
    torch.nn.utils.clip_grads_with_norm_ = _clip_grads_with_norm_


def uninstall() -> None:
    """torch's own functions back where they were (idempotent)."""
    for module in (torch.nn.utils, _clip_module):
        module.clip_grad_norm_ = _torch_clip_grad_norm_
    _clip_module._clip_grads_with_norm_ = _torch_clip_grads_with_norm_
    if _torch_public_clip_grads is not None:
        torch.nn.utils.clip_grads_with_norm_ = _torch_public_clip_grads
    elif hasattr(torch.nn.utils, "clip_grads_with_norm_"):
        del torch.nn.utils.clip_grads_with_norm_


def installed() -> bool:
    return torch.nn.utils.clip_grad_norm_ is clip_grad_norm_


class EngineHook:
    """A module hook of the engine's. ``copy.deepcopy(model)`` (an EMA copy, a frozen
    reference model) copies module hooks with the module: the copy must not drag the engine
    along (process groups cannot be copied) nor call back into it, so a copied hook does
    nothing and the copy is a plain model."""

    def __init__(self, fn):
        self.fn = fn

    # Never traced by torch.compile: dynamo breaks the graph around an engine hook and runs it
    # eagerly (compiled.py). torch._disable_dynamo imports dynamo on the first call only.
    @torch._disable_dynamo
    def __call__(self, *args):
        return self.fn(*args)

    def __deepcopy__(self, memo):
        return _detached


def _detached(*args):
    return None


class ForwardGuard:
    """Runs before every forward of the wrapped model: refuses an outer DistributedDataParallel,
    re-binds or refuses parameters replaced since initialize(), and broadcasts rank 0's buffers
    as DDP does (``broadcast_buffers``)."""

    def __init__(self, module: torch.nn.Module, flat_groups, broadcast=None,
                 check_ranks=None, split: BucketSplit | None = None, clock=None):
        """``broadcast(tensors)``: sends rank 0's values of the tensors to every rank, or None
        to leave buffers alone. ``check_ranks()``: a collective check that every rank starts
        the same kind of forward (stage 3, where every forward is collective), run first.
        ``split``: cuts a compiled forward's graph at gradient buckets (compiled.BucketSplit).
        ``clock``: the step clock, whose wall_clock_breakdown times the outermost forward."""
        self.module = module
        self.timers = clock.timers if clock is not None else None
        self.split = split
        self.splitting = False
        self.broadcast = broadcast
        self.check_ranks = check_ranks
        self.where = {}  # id(param) -> (its flat group, index in it)
        for fg in flat_groups:
            for i, p in enumerate(fg.params):
                self.where[id(p)] = (fg, i)
        # (owning module, its attribute name, the managed parameter, full name): checked with
        # one dict lookup each per forward instead of a named_parameters() walk
        self.slots = [(mod, local, p, f"{prefix}.{local}" if prefix else local)
                      for prefix, mod in uncompiled(module).named_modules(remove_duplicate=False)
                      for local, p in mod._parameters.items() if id(p) in self.where]
        self.managed = [(name, p) for name, p in uncompiled(module).named_parameters()
                        if id(p) in self.where]
        self.storage = {id(p): p.untyped_storage()._cdata for _, p in self.managed}
        # The model called inside its own forward (a LightningModule's training_step run as the
        # forward, calling self(x)) is one forward: the checks run at the outermost call only.
        self.depth = 0
        self.hook = module.register_forward_pre_hook(EngineHook(self), prepend=True)
        self.leave_hook = module.register_forward_hook(EngineHook(self._leave),
                                                       always_call=True)

    def _leave(self, module, args, output) -> None:
        self.depth = max(0, self.depth - 1)
        if self.depth == 0 and self.timers is not None:
            self.timers.stop("forward")
        if self.depth == 0 and self.splitting:
            self.split.leave()
            self.splitting = False

    def __call__(self, module, args):
        self.depth += 1
        if self.depth > 1:
            return
        if self.timers is not None:
            self.timers.start("forward")
        self.refuse_outer_ddp()
        self.check_parameters()
        if self.check_ranks is not None:
            self.check_ranks()
        if self.broadcast is not None and torch.is_grad_enabled():
            buffers = list(module.buffers())
            if buffers:
                self.broadcast(buffers)
        # only while dynamo may trace a training forward of the compiled model
        if self.split is not None and torch.is_grad_enabled() and is_compiled(module):
            self.split.enter()
            self.splitting = True

    def refuse_outer_ddp(self) -> None:
        ddp = torch.nn.parallel.DistributedDataParallel._active_ddp_module
        if ddp is not None and not isinstance(ddp, BucketSplit) \
                and any(m is self.module for m in ddp.module.modules()):
            raise RuntimeError(
                "the model zeroengine manages is wrapped in torch's DistributedDataParallel, "
                "which reduces the gradients a second time (the Hugging Face Trainer and "
                "accelerate wrap a model this way when they see several processes). zeroengine "
                "already does the data-parallel work: call the model (or engine) directly, "
                "without DDP, or let a zeroengine integration drive the framework")

    def check_parameters(self) -> None:
        for mod, local, expected, name in self.slots:
            if mod._parameters.get(local) is not expected:
                raise ParameterReplacedError(
                    f"parameter {name!r} was replaced by another Parameter object after "
                    "zeroengine.initialize() (e.g. `module.weight = nn.Parameter(...)` or "
                    "load_state_dict(..., assign=True)); the engine would keep training the "
                    "old one. Change values in place (torch.no_grad() + copy_, inside "
                    "zeroengine.gathered_parameters(..., modifier_rank=0) at stage 3), or build "
                    "the model fully before initialize()")
        for name, p in self.managed:
            if p.untyped_storage()._cdata != self.storage[id(p)]:
                self._rebind(name, p)

    def _rebind(self, name: str, p: torch.nn.Parameter) -> None:
        """``p.data`` was re-pointed (model.to(), .half(), a framework's prepare): take it back
        into the flat buffer when it is the same values, else refuse by name."""
        fg, i = self.where[id(p)]
        how = ("(by model.to(...), .half()/.float(), or a framework that moves the model, "
               "such as accelerate's prepare or the Hugging Face Trainer)")
        if fg.partitioned:
            raise ParameterReplacedError(
                f"parameter {name!r} was re-pointed to new memory after zeroengine.initialize() "
                f"{how}; at stage 3 it lives in shards the engine gathers. Move or cast the "
                "model before initialize(); for bf16/fp16 set \"bf16\"/\"fp16\" in the config")
        view = fg.full.param_view(i)
        if p.dtype != view.dtype or p.device != view.device or p.shape != view.shape:
            raise ParameterReplacedError(
                f"parameter {name!r} was changed to {p.dtype} on {p.device} after "
                f"zeroengine.initialize() {how}, but the engine trains it as {view.dtype} on "
                f"{view.device}. Move or cast the model before initialize(); for mixed precision "
                "set \"bf16\": {\"enabled\": true} (or fp16) in the config instead of .half()")
        with torch.no_grad():
            if not torch.equal(p.data, view):
                raise ParameterReplacedError(
                    f"parameter {name!r} was given new memory holding other values after "
                    "zeroengine.initialize(); the engine's copy (and its fp32 master) would "
                    "not see them. Write values in place inside "
                    "zeroengine.gathered_parameters(params, modifier_rank=0), or load them "
                    "with engine.load_checkpoint()")
        p.data = view  # a plain copy (model.to() onto the same device): same values, rebind

    def remove(self) -> None:
        self.hook.remove()
        self.leave_hook.remove()
