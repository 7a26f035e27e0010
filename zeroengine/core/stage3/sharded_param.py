"""The class a stage-3 partitioned parameter wears while the engine manages it.

Stage 3 keeps each partitioned parameter as a view into its segment's full tensor and empties
that tensor's storage while the segment is not gathered (flat_param_group.py,
param_fetcher.py). A plain
tensor read in that state reads freed memory: torch does not check it, and the process dies
with SIGSEGV (``w.sum()``, ``copy.deepcopy(model)``, ``model.to(...)``, ``state_dict()`` that
then fails to load). So the parameter's class becomes ``ShardedParameter`` (a subclass of its
own class, so ``isinstance(p, nn.Parameter)`` and user subclasses still hold), whose
``__torch_function__`` sees every torch call that touches it:

- while its segment is gathered (inside the model's forward/backward, inside
  ``gathered_parameters``), the call runs unchanged;
- metadata (shape, dtype, device, grad, requires_grad, hooks, ...) is always served;
- any other use of a released parameter goes to the fetcher that owns it
  (``ParamFetcher.read_released``): inside the model's forward it is gathered on demand, as a
  parameter of the module running now (so modules that use a child's weight without calling the
  child, such as nn.MultiheadAttention's ``out_proj``, work); anywhere else it raises an error
  naming the parameter and the ways to read it.

Why not FSDP2's design (a sharded DTensor registered outside forward, swapped for the gathered
tensor inside)? Our shards are flat ranges of segments, not dim-0 slices, which DTensor cannot
describe; and keeping one parameter object whose storage comes and goes keeps every reference
the user holds (optimizer param_groups, tied weights, saved autograd views) valid. This class
turns the one hazard of that design, reading freed storage, into a named Python error.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .. import registry

_BYPASS = [0]  # > 0 inside engine code that handles released parameters knowingly

# Tensor attributes and methods that read no element values: always served.
_METADATA_ATTRIBUTES = frozenset({
    "shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "grad_fn", "ndim",
    "layout", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn",
    "is_nested", "names", "_backward_hooks", "_post_accumulate_grad_hooks", "itemsize",
    "_version", "name", "output_nr", "retains_grad", "is_xpu", "is_mps", "_grad_fn",
    "_base", "__class__", "__dict__"})
_METADATA_METHODS = frozenset({
    "size", "dim", "numel", "stride", "element_size", "is_floating_point", "is_complex",
    "untyped_storage", "data_ptr", "storage_offset", "is_contiguous", "register_hook",
    "register_post_accumulate_grad_hook", "requires_grad_", "nelement", "ndimension",
    "get_device", "_has_compatible_shallow_copy_type", "is_shared", "is_pinned", "__len__",
    "__hash__", "__setstate__", "is_inference", "_is_view"})


def _reads_values(func) -> bool:
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", "") not in \
            _METADATA_ATTRIBUTES
    if name == "__set__":
        return False  # assigning .grad / .data / .requires_grad reads nothing
    return name not in _METADATA_METHODS


def _released(t: torch.Tensor) -> bool:
    with torch._C.DisableTorchFunctionSubclass():
        return t.numel() > 0 and t.untyped_storage().nbytes() == 0


def _sharded_in(obj, found: list) -> list:
    if isinstance(obj, ShardedParameter):
        found.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _sharded_in(item, found)
    elif isinstance(obj, dict):
        for item in obj.values():
            _sharded_in(item, found)
    return found


def _describe(func) -> str:
    name = getattr(func, "__name__", repr(func))
    if name in ("__get__", "__set__"):
        return f".{getattr(getattr(func, '__self__', None), '__name__', '?')}"
    return f"{name}()"


def _is_noop_to(args, kwargs) -> bool:
    """``t.to(...)`` that changes neither device nor dtype (model.to(device) by frameworks,
    e.g. the HF Trainer's ``cpu:0`` on a CPU machine): served as ``t`` itself."""
    t = args[0]
    try:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args[1:], **kwargs)
    except (TypeError, RuntimeError):
        return False
    if memory_format not in (None, torch.preserve_format):
        return False
    if dtype is not None and dtype != t.dtype:
        return False
    if device is None:
        return True
    device = torch.device(device)
    if device.type != t.device.type:
        return False
    current = t.device.index if t.device.index is not None else 0
    return device.index is None or device.index == current


class ShardedParameter(nn.Parameter):
    """A stage-3 partitioned parameter (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and isinstance(args[0], ShardedParameter) \
                and _is_noop_to(args, kwargs):
            return args[0]
        # Under torch.compile the check is not traceable (storage sizes); compiled code runs
        # between the fetcher's module hooks, which run eagerly and gather what it reads.
        if not _BYPASS[0] and not torch.compiler.is_compiling() and _reads_values(func):
            for t in _sharded_in(args, _sharded_in(kwargs, [])):
                if _released(t):
                    owner = registry.held_by(t, "reader")
                    if owner is not None:
                        owner.read_released(t, _describe(func))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


_SUBCLASSES: dict[type, type] = {nn.Parameter: ShardedParameter}


def mark_sharded(p: nn.Parameter, owner) -> None:
    """Give ``p`` the guarding class (a subclass of its own) and route its reads to ``owner``
(an object with ``read_released(param, what)``: param_fetcher.ParamFetcher)."""
    base = type(p)
    if not isinstance(p, ShardedParameter):
        if base not in _SUBCLASSES:
            _SUBCLASSES[base] = type(f"Sharded{base.__name__}", (ShardedParameter, base), {})
        p.__class__ = _SUBCLASSES[base]
    registry.hold(p, reader=owner)


def unmark_sharded(p: nn.Parameter) -> None:
    """Give ``p`` its own class back (engine.close())."""
    registry.let_go(p, "reader")
    if isinstance(p, ShardedParameter):
        base = next(b for b in type(p).__mro__ if not issubclass(b, ShardedParameter))
        p.__class__ = base


class knowingly:
    """Engine code that handles released parameters itself: no checks inside."""

    def __enter__(self):
        _BYPASS[0] += 1

    def __exit__(self, *exc):
        _BYPASS[0] -= 1
