"""fastai on zeroengine: a callback in place of fastai's ``DistributedTrainer``.

    from zeroengine.integrations.fastai import ZeroCallback  # also adds Learner.zero_ctx
    learn = Learner(dls, model, loss_func=...,
                    opt_func=partial(OptimWrapper, opt=torch.optim.AdamW))
    with learn.zero_ctx("ds.json"):         # was: with learn.distrib_ctx():
        learn.fit_one_cycle(5, 1e-3)        # launched as before (torchrun / accelerate launch)

The callback shards the data loaders as fastai's distributed training does (``DistributedDL``),
builds the engine over ``learn.model`` and the torch optimizer inside ``learn.opt``, and routes
each batch's backward and step through the engine (it cancels fastai's own, which would apply
an unreduced gradient). fastai's schedulers (``fit_one_cycle``, ``ParamScheduler``) keep
driving the learning rate: they set the hyperparameters of the optimizer's param groups, which
are the engine's. ``GradientClip`` works (its clip is applied by the engine's step). fastai's
own optimizers (``Adam``, ``SGD`` from fastai.optimizer) are not torch optimizers and are refused
by name; so are ``GradientAccumulation`` and ``MixedPrecision`` (set gradient_accumulation_steps /
bf16 in the config instead).
"""
from __future__ import annotations

import os

import torch

from ..config import ConfigError, config_dict
from ..distributed.comm import Comm

try:
    import fastai
    from fastai.callback.core import Callback, CancelBackwardException, CancelStepException
    from fastai.callback.progress import ProgressCallback
    from fastai.distributed import DistributedDL
    from fastai.learner import Learner
    from fastai.optimizer import OptimWrapper
    from fastcore.basics import patch
except ImportError:  # pragma: no cover - the fastai extra is installed wherever tests run
    raise ImportError("zeroengine.integrations.fastai needs fastai: "
                      "pip install 'zeroengine[fastai]'") from None

SUPPORTED = "fastai >= 2.7, < 3"  # tested: 2.8


def _check_version() -> None:
    major, minor = (int(x) for x in fastai.__version__.split(".")[:2])
    if major != 2 or minor < 7:
        raise ImportError(f"zeroengine's ZeroCallback supports {SUPPORTED}; found fastai "
                          f"{fastai.__version__}")


class _DistributedDL(DistributedDL):
    """fastai's DistributedDL, whose index broadcast also runs without CUDA (fastai's moves the
    indices to the GPU for NCCL; with gloo on CPUs they stay on the host)."""

    def _broadcast(self, t, rank):
        device = "cuda" if torch.cuda.is_available() else "cpu"
        t = torch.tensor(t, dtype=torch.long, device=device)
        Comm().broadcast(t, rank, what="the data loader's sample order")
        return t.cpu().tolist()


class ZeroCallback(Callback):
    """Shards the data, builds the engine, and runs backward / step through it."""
    order = 12  # after GradientClip (11): its clip_grad_norm_ reaches this step

    def __init__(self, config: str | os.PathLike | dict | None = None):
        _check_version()
        self.config = config_dict(config, "ZeroCallback(config=...)")
        self.engine = None
        self._cast = None

    def before_fit(self):
        from fastai.callback.fp16 import MixedPrecision
        from fastai.callback.training import GradientAccumulation
        for cb in self.learn.cbs:
            if isinstance(cb, (GradientAccumulation, MixedPrecision)):
                raise ConfigError(f"ZeroCallback: fastai's {type(cb).__name__} callback does not "
                                  "go with the engine; set \"gradient_accumulation_steps\" / "
                                  "\"bf16\" or \"fp16\" in the zeroengine config instead")
        if self.engine is None:
            opt = self.learn.opt
            if not isinstance(opt, OptimWrapper):
                raise ConfigError(
                    f"ZeroCallback needs a torch optimizer; learn.opt is fastai's "
                    f"{type(opt).__name__}. Build the Learner with opt_func=partial("
                    "OptimWrapper, opt=torch.optim.AdamW) (or another torch.optim class)")
            import zeroengine
            self.engine = zeroengine.initialize(self.learn.model, self.config, optimizer=opt.opt)
            self._cast = self.engine.precision.compute if self.engine.precision.mixed else None
            self.learn.zero_engine = self.engine
        self.old_dls = list(self.dls)
        self.learn.dls.loaders = [self._wrap_dl(dl) for dl in self.dls]
        if self.engine.comm.rank:
            self.learn.logger = lambda *args, **kwargs: None

    def _wrap_dl(self, dl):
        if isinstance(dl, DistributedDL) or self.engine.comm.world_size == 1:
            return dl
        return _DistributedDL(dl, rank=self.engine.comm.rank,
                              world_size=self.engine.comm.world_size)

    def before_train(self):
        self.learn.dl = self._wrap_dl(self.learn.dl)

    def before_validate(self):
        self.learn.dl = self._wrap_dl(self.learn.dl)

    def before_batch(self):
        if self._cast is not None:  # bf16/fp16 parameters: floating inputs in that dtype
            self.learn.xb = tuple(x.to(self._cast) if torch.is_tensor(x) and x.is_floating_point()
                                  else x for x in self.xb)

    def before_backward(self):
        self.engine.backward(self.learn.loss_grad)
        raise CancelBackwardException()  # fastai's loss_grad.backward() would run it again

    def before_step(self):
        self.engine.step()
        raise CancelStepException()  # learn.opt.step() would step without the engine

    def after_fit(self):
        self.learn.dls.loaders = self.old_dls


@patch
def zero_ctx(self: Learner, config: str | os.PathLike | dict | None = None):
    """Like ``Learner.distrib_ctx``: add a ZeroCallback for the block, remove it after."""
    import contextlib

    @contextlib.contextmanager
    def context():
        cb = ZeroCallback(config)
        self.add_cb(cb)
        rank = int(os.environ.get("RANK", "0"))
        progress = [c for c in self.cbs if isinstance(c, ProgressCallback)]
        if rank:
            for c in progress:
                self.remove_cb(c)
        try:
            yield self
        finally:
            self.remove_cb(cb)
            if rank:
                for c in progress:
                    self.add_cb(c)

    return context()
