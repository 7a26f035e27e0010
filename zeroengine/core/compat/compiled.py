"""torch.compile and the engine: where the compiled region starts and ends.

Three ways in, one result: ``initialize(torch.compile(model), cfg)``, ``engine.module.compile()``
(or ``engine.compile()``, DeepSpeed's verb) after initialize, and the config's ``compile``
section. In each, the model's *forward* is what dynamo traces; the engine's work stays outside:

- the root module's hooks (ForwardGuard's checks and buffer broadcast, the stage-3 end of
  forward) run eagerly around the compiled forward. ``torch.compile(model)`` gives that by
  itself (an OptimizedModule calls its hooks, then the compiled inner call); nn.Module.compile()
  would compile ``_call_impl`` with the hooks inside it, so on a managed module ``compile`` is
  replaced by ``compile_forward``, which compiles ``forward`` only;
- gradient hooks (post-accumulate-grad on each parameter) run in the autograd engine, outside
  any graph, so stages 0-2 add no graph break to the forward;
- stage 3's per-module gather/release hooks are dynamo-disabled (drop_in.EngineHook):
  dynamo breaks the graph around each, so every fetch unit's forward is its own graph and the
  collectives and storage changes run eagerly between them (docs/compile.md counts them). The
  check for a released parameter read (sharded_param.py) is not traceable, so the first
  forward of a compiled model runs eagerly (``eager_stance``): it learns which parameters each
  module reads without calling their owner (nn.MultiheadAttention's out_proj) before dynamo
  traces anything; later reads are gathered by the module hooks, inside no graph.

Names: an OptimizedModule prefixes every parameter and buffer name with ``_orig_mod.``; the
engine names them by the module inside (``uncompiled``), so checkpoints and consolidated state
dicts of compiled and eager runs are interchangeable.
"""
from __future__ import annotations

import difflib
import functools
import inspect
import sys

import torch
import torch.nn as nn

from ...config import ConfigError


def _optimized_module_class():
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # very old torch: nothing to unwrap
        return ()
    return OptimizedModule


def uncompiled(module: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped (``module`` itself when it is not wrapped)."""
    while isinstance(module, _optimized_module_class()):
        module = module._orig_mod
    return module


def is_compiled(module: nn.Module) -> bool:
    return uncompiled(module) is not module or "forward" in vars(module)


def compile_forward(module: nn.Module, *args, **kwargs) -> None:
    """``module.compile(*args, **kwargs)`` for a module the engine manages: torch.compile of its
    ``forward`` (an instance attribute), so its hooks - the engine's root hooks - stay eager."""
    if is_compiled(module):
        return  # compiled already (torch.compile before initialize, or a second call)
    module.forward = torch.compile(type(module).forward.__get__(module), *args, **kwargs)


def _known_backends() -> list[str]:
    """Every backend name torch.compile accepts here: built-in ones of every tag (debug and
    experimental included), ones registered with register_backend, and entry points."""
    from torch._dynamo import list_backends
    return sorted(list_backends(exclude_tags=()))


def _offered(known: list[str]) -> str:
    return ", ".join(k for k in known if "TESTING_ONLY" not in k)


def _did_you_mean(value: str, known: list[str]) -> str:
    close = [k for k in known if k == value.strip()] or \
        difflib.get_close_matches(value.strip(), known, n=2, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


# torch.compile's arguments whose JSON value must be a bool (a string "false" is truthy)
_BOOL_ARGS = ("fullgraph", "disable", "isolate_recompiles")


def check_compile_args(backend, kwargs: dict | None, where: str = "compile") -> None:
    """Refuse, naming the key, a compile setting torch would refuse later or silently misread:
    an unknown backend name (with the backends torch offers), a keyword torch.compile does not
    take, a mode or an inductor option it does not know. ``where``: the config section
    ("compile") or "engine.compile" for the method's arguments. A callable backend, or a name
    the user registered (torch._dynamo.register_backend, entry points), passes."""
    kwargs = dict(kwargs or {})
    key = f"{where}.backend" if where == "compile" else "backend"
    if not callable(backend):
        if not isinstance(backend, str):
            raise ConfigError(f"{key} = {backend!r}: a backend name (a string) or a callable")
        known = _known_backends()
        if backend not in known:
            raise ConfigError(
                f"{key} = {backend!r} is not a torch.compile backend"
                f"{_did_you_mean(backend, known)}; torch {torch.__version__} offers: "
                f"{_offered(known)}. A custom backend: register it with "
                "torch._dynamo.register_backend before initialize")
    extra = f"{where}.kwargs" if where == "compile" else "compile_kwargs"
    accepted = [n for n in inspect.signature(torch.compile).parameters
                if n not in ("model", "backend")]
    for name, value in kwargs.items():
        if name == "backend":
            raise ConfigError(f"{extra} has 'backend': give it as {key} instead")
        if name not in accepted:
            raise ConfigError(f"{extra}.{name}: torch.compile takes no such argument"
                              f"{_did_you_mean(str(name), accepted)}; it takes "
                              f"{', '.join(accepted)}")
        if name in _BOOL_ARGS and not isinstance(value, bool):
            raise ConfigError(f"{extra}.{name} = {value!r}: true or false")
        if name == "dynamic" and value is not None and not isinstance(value, bool):
            raise ConfigError(f"{extra}.dynamic = {value!r}: true, false or null")
    options = kwargs.get("options")
    if backend == "inductor" and isinstance(options, dict):
        from torch._inductor import list_options
        known_options = list_options()
        for name in options:
            if name not in known_options:
                raise ConfigError(f"{extra}.options.{name}: not an inductor option"
                                  f"{_did_you_mean(str(name), known_options)} (all of them: "
                                  "torch._inductor.list_options())")
    # mode and options are the backend's; torch checks inductor's when torch.compile is called
    # (this compiles nothing): its message, under the key that holds the value
    if backend == "inductor" and ("mode" in kwargs or "options" in kwargs):
        try:
            torch.compile(_nothing, backend=backend,
                          **{k: kwargs[k] for k in ("mode", "options") if k in kwargs})
        except Exception as e:  # noqa: BLE001 - torch raises several kinds here
            names = " and ".join(f"{extra}.{k}" for k in ("mode", "options") if k in kwargs)
            raise ConfigError(f"{names}: {e}") from None


def _nothing(x):
    return x


def install(module: nn.Module) -> None:
    """Route ``module.compile(...)`` to ``compile_forward`` (see the module docstring)."""
    if not isinstance(module, _optimized_module_class()):
        module.compile = functools.partial(compile_forward, module)


def uninstall(module: nn.Module) -> None:
    vars(module).pop("compile", None)


def eager_stance():
    """Run compiled functions eagerly until the returned object's ``__exit__`` (stage 3's first
    forward: param_fetcher.py); None where torch has no compiler stances (before 2.6)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else None


def check_compiled_autograd() -> None:
    """Compiled autograd traces backward into one graph, where the engine's gradient hooks
    (bucketed reduction as gradients appear) would have to be traced too: refused by name."""
    if "torch._dynamo" not in sys.modules:
        return  # nothing has imported dynamo: compiled autograd cannot be on
    try:
        from torch._dynamo import compiled_autograd
    except ImportError:
        return
    active = getattr(compiled_autograd, "compiled_autograd_enabled", False) or \
        getattr(torch._dynamo.config, "compiled_autograd", False)
    if active:
        raise RuntimeError(
            "compiled autograd is on (torch._dynamo.config.compiled_autograd or "
            "compiled_autograd._enable): zeroengine reduces gradient buckets from hooks that "
            "run as backward produces each gradient, which compiled autograd would trace into "
            "its graph; turn it off for the engine's backward (torch.compile of the forward "
            "still compiles the backward through AOTAutograd)")


class BucketSplit:
    """Compiled stages 0-2: one graph per gradient bucket, so reduction overlaps backward.

    AOTAutograd turns a compiled forward into one backward node: every gradient of the graph
    appears when that node finishes, so the engine's per-bucket reductions (started by
    gradient hooks) would all start after the whole backward, overlapping nothing. Torch
    solves this for DDP with its DDPOptimizer: while a DDP forward is active, dynamo cuts the
    graph it traced into pieces of about DDP's bucket size (in backward order) and compiles
    each with the user's backend, so each piece's gradients are ready as soon as its backward
    ends. The engine asks for the same cut by standing in as the active DDP module for the
    length of its forward (what torch's own ``replicate`` does) with its own bucket size; the
    graph still counts as one (no graph break), and ``torch._dynamo.config.optimize_ddp =
    False`` turns the cut off as it does for DDP. Stage 3 needs none: its per-module gathers
    already cut the graph at every fetch unit.

    DDPOptimizer sizes a parameter by its storage, and the engine's parameters are views into
    one flat buffer each: every parameter would count as the whole buffer and the graph would
    be cut at every parameter. For the length of the forward (when dynamo traces and cuts)
    its sizing counts a parameter's own elements; where that method is absent (other torch
    versions) the cut is left to torch as is.
    """

    def __init__(self, bucket_bytes: int):
        # the one attribute dynamo reads; it must not be below DDP's first bucket (1 MiB), which
        # dynamo cuts first
        first = getattr(torch.distributed, "_DEFAULT_FIRST_BUCKET_BYTES", 1 << 20)
        self.bucket_bytes_cap = max(bucket_bytes, first)
        self._saved = None
        self._sizing = None

    def enter(self) -> None:
        ddp = torch.nn.parallel.DistributedDataParallel
        self._saved = ddp._active_ddp_module
        ddp._active_ddp_module = self
        try:
            from torch._dynamo.backends.distributed import DDPOptimizer
        except ImportError:
            return
        sizing = vars(DDPOptimizer).get("add_param")
        if sizing is not None and not hasattr(sizing, "counts_own_bytes"):
            self._sizing = (DDPOptimizer, sizing)
            DDPOptimizer.add_param = _counting_own_bytes(sizing)

    def leave(self) -> None:
        torch.nn.parallel.DistributedDataParallel._active_ddp_module = self._saved
        self._saved = None
        if self._sizing is not None:
            cls, sizing = self._sizing
            cls.add_param = sizing
            self._sizing = None


def _counting_own_bytes(add_param):
    """DDPOptimizer.add_param counting the parameter's own bytes, not its (shared) storage's."""

    def counted(self, bucket, param, name) -> None:
        before = bucket.size
        add_param(self, bucket, param, name)
        bucket.size = before + param.numel() * param.element_size()

    counted.counts_own_bytes = True
    return counted


def bucket_split(config, sharding, world_size: int, device: torch.device,
                 params: list) -> BucketSplit | None:
    """Where a compiled forward is cut at gradient buckets: stages 0-2 with more than one
    rank and overlap on (stage 3's fetch units already cut it), by default on CUDA only."""
    zero, wanted = config.zero_optimization, config.compile.split_at_buckets
    if wanted is None:
        wanted = device.type == "cuda"
    if not wanted or sharding.parameters or world_size == 1 or not zero.overlap_comm:
        return None
    itemsize = max((p.element_size() for p in params), default=4)
    return BucketSplit(max(1, zero.reduce_bucket_size) * itemsize)
