"""``with zeroengine.zero_init(config):`` builds a model already sharded: no rank ever holds it
all, only its 1/N of every parameter plus, briefly, the one module being constructed.

While the block is active:
- every nn.Module class's constructor is wrapped; when the *most-derived* constructor of a module
  returns, each parameter it holds that is not yet sharded is broadcast from rank 0 (every rank
  then has rank 0's initial values, as DDP would), rank r keeps slice r of it (``_ze_slice``), and
  the full tensor's storage is emptied (the parameter keeps its shape; reading it is an error);
- ``nn.Module.apply`` (how models usually run custom init, e.g. ``self.apply(self._init_weights)``)
  materialises one module's parameters at a time around ``fn`` and re-shards them after.
Code that writes a sharded parameter of a *child* directly in a parent's constructor is not
covered; use ``apply`` or ``gathered_parameters`` for that.

Parameters built on the meta device (transformers 5's ``from_pretrained`` builds there, then
loads) are left on meta: ``from_pretrained`` binds each to its tensor in the checkpoint files
instead of reading it (stage3/hf_from_pretrained.py), and ``initialize`` reads each rank's
slices straight into its shard (deferred_params.py).

``initialize()`` then moves these per-parameter slices into its own layout, one parameter at a
time (``materialize``), so its peak stays one parameter above the shards.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn

from ...config import parse_config
from ...distributed.bootstrap import init_distributed
from ...distributed.comm import Comm
from ..sharding import Sharding
from . import hf_from_pretrained

_active: "ZeroInit | None" = None


def is_sharded(p: torch.Tensor) -> bool:
    return hasattr(p, "_ze_slice")


def materialize(p: torch.nn.Parameter, comm: Comm) -> torch.Tensor:
    """The full value of a zero_init parameter (a collective: every rank calls it, in the same
    order). The parameter itself is left sharded."""
    piece = p._ze_slice
    full = torch.empty(piece.numel() * comm.world_size, dtype=piece.dtype, device=piece.device)
    comm.all_gather(full, piece)
    return full[:p.numel()].view(p.shape)


def make_whole(p: torch.nn.Parameter, comm: Comm) -> None:
    """Turn a zero_init parameter back into an ordinary full one."""
    p.data = materialize(p, comm).clone()
    del p._ze_slice


def _shard(p: torch.nn.Parameter, comm: Comm, device: torch.device) -> None:
    with torch.no_grad():
        data = p.data.to(device)
        comm.broadcast(data, 0)
        n = data.numel()
        per_rank = -(-n // comm.world_size)  # ceil
        begin = min(n, comm.rank * per_rank)
        piece = torch.zeros(per_rank, dtype=data.dtype, device=device)
        piece[:min(n, begin + per_rank) - begin].copy_(data.reshape(-1)[begin:begin + per_rank])
        p._ze_slice = piece
        empty = torch.empty(p.shape, dtype=data.dtype, device=device)
        empty.untyped_storage().resize_(0)
        p.data = empty


class ZeroInit:
    def __init__(self, comm: Comm, device: torch.device):
        self.comm, self.device = comm, device
        self._saved: list[tuple[type, object]] = []

    def shard_module(self, module: nn.Module) -> None:
        for p in module.parameters():
            # meta parameters (transformers 5 builds on meta, then loads) have no values to
            # shard: they are read from their files (or reset) at initialize
            if not is_sharded(p) and not p.is_meta:
                _shard(p, self.comm, self.device)

    def _wrap(self, cls: type) -> None:
        original = cls.__dict__.get("__init__")
        if original is None or getattr(original, "_ze_wrapped", False):
            return
        owner = self

        @functools.wraps(original)
        def init(module, *args, **kwargs):
            original(module, *args, **kwargs)
            if type(module).__init__ is init and _active is owner:  # the outermost constructor
                owner.shard_module(module)
        init._ze_wrapped = True
        self._saved.append((cls, original))
        cls.__init__ = init

    def _apply(self, module: nn.Module, fn):
        for child in module.children():
            child.apply(fn)
        own = [p for p in module.parameters(recurse=False) if is_sharded(p)]
        for p in own:
            p.data = materialize(p, self.comm).clone()
            del p._ze_slice
        fn(module)
        for p in own:
            _shard(p, self.comm, self.device)
        return module

    def __enter__(self):
        global _active
        if _active is not None:
            raise RuntimeError("zero_init blocks cannot be nested")
        stack = [nn.Module]
        while stack:
            cls = stack.pop()
            self._wrap(cls)
            stack.extend(cls.__subclasses__())
        owner = self
        self._saved_subclass_hook = nn.Module.__dict__.get("__init_subclass__")

        def init_subclass(cls, **kwargs):
            super(nn.Module, cls).__init_subclass__(**kwargs)
            owner._wrap(cls)
        nn.Module.__init_subclass__ = classmethod(init_subclass)
        self._saved_apply = nn.Module.apply
        nn.Module.apply = lambda module, fn: owner._apply(module, fn)
        _active = self
        hf_from_pretrained.install()  # from_pretrained binds files instead of reading them
        return self

    def __exit__(self, *exc):
        global _active
        _active = None
        hf_from_pretrained.uninstall()
        for cls, original in reversed(self._saved):
            cls.__init__ = original
        self._saved.clear()
        if self._saved_subclass_hook is None:
            del nn.Module.__init_subclass__
        else:
            nn.Module.__init_subclass__ = self._saved_subclass_hook
        nn.Module.apply = self._saved_apply
        return False


@contextlib.contextmanager
def zero_init(config=None):
    """Construct modules directly sharded across the ranks (joins the process group first).
    With a config whose zero_optimization.stage is not 3 this does nothing: only stage 3 keeps
    parameters sharded."""
    if config is not None and \
            not Sharding.of_stage(parse_config(config).zero_optimization.stage).parameters:
        yield None
        return
    env = init_distributed()
    device = torch.device("cuda", env.local_rank % torch.cuda.device_count()) \
        if torch.cuda.is_available() else torch.device("cpu")
    with ZeroInit(Comm(), device) as ctx:
        yield ctx
