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

import functools
import sys

import torch
import torch.nn as nn


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
