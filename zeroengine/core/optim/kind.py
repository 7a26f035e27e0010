"""What kind of update an optimizer makes, which decides how zeroengine may shard it.

- ``elementwise``: each element's update depends on that element's gradient and state alone
  (SGD, Adam, AdamW, ...). A step over any chunk of a flat buffer equals the step over the
  whole tensors, so these run on flat 1/N chunks (the fast path, sharded_optimizer.py).
- ``tensorwise``: each parameter's update depends on the whole parameter and its whole gradient
  (Muon's orthogonalisation, Adafactor's row/column factors, LAMB's trust ratio), but not on
  other parameters. These run on whole parameters, each stepped by the one rank that owns it
  (owner_step.py).
- anything else (a line search over all parameters, a global norm inside step()) cannot be
  sharded either way and is refused.

Known classes are listed by exact class: a subclass may override step() with anything. Other
classes are *probed*: stepped on a few small tensors shaped like the group's parameters, once
on the whole tensors and once on a permuted flat layout cut into two pieces, each in its own
optimizer as each rank's shard is (elementwise iff they agree), and once with every tensor in
its own optimizer (tensorwise iff that agrees). A user may declare a class instead:
``zeroengine.declare_optimizer(MyOpt, "tensorwise")`` or a
class attribute ``zeroengine_update = "tensorwise"``.
"""
from __future__ import annotations

import inspect
import math

import torch

from ...errors import OptimizerKindError
from ...ops import CPUAdam, FusedAdam

ELEMENTWISE = "elementwise"
TENSORWISE = "tensorwise"
KINDS = (ELEMENTWISE, TENSORWISE)

_KNOWN: dict[type, str] = {
    **{getattr(torch.optim, name): ELEMENTWISE for name in (
        "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam",
        "RMSprop", "Rprop") if hasattr(torch.optim, name)},
    **{getattr(torch.optim, name): TENSORWISE for name in ("Adafactor", "Muon")
       if hasattr(torch.optim, name)},
    CPUAdam: ELEMENTWISE, FusedAdam: ELEMENTWISE,
}
# Classes that neither path can run, with the reason.
_REFUSED: dict[str, str] = {
    "LBFGS": "it runs a line search over all parameters together (and needs a closure)",
    "SparseAdam": "it needs sparse gradients, and zeroengine reduces dense flat buffers",
}
_declared: dict[type, str] = {}


def declare_optimizer(cls: type, kind: str) -> None:
    """Say how ``cls`` updates: "elementwise" (each element from its own gradient and state:
    runs on flat chunks) or "tensorwise" (each parameter from its whole self, independently
    of the others: each runs whole on one rank). Skips the probe for that class."""
    if kind not in KINDS:
        raise ValueError(f"declare_optimizer: kind must be one of {KINDS}, got {kind!r}")
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"declare_optimizer takes a torch.optim.Optimizer subclass, got {cls!r}")
    _declared[cls] = kind


def optimizer_kind(optimizer: torch.optim.Optimizer, group: dict) -> str:
    """The kind of update ``optimizer`` makes on ``group`` (one of its param groups): known,
    declared, or probed; raises OptimizerKindError when it can be neither."""
    cls = type(optimizer)
    declared = _declared.get(cls) or cls.__dict__.get("zeroengine_update")
    if declared is not None:
        if declared not in KINDS:
            raise OptimizerKindError(f"{cls.__name__}.zeroengine_update is {declared!r}; it "
                                     f"must be one of {KINDS}")
        return declared
    if cls in _KNOWN:
        return _KNOWN[cls]
    for klass in cls.__mro__:
        if klass.__name__ in _REFUSED and klass.__module__.startswith("torch.optim"):
            raise OptimizerKindError(f"{cls.__name__} cannot be sharded by zeroengine: "
                                     f"{_REFUSED[klass.__name__]}")
    return probe_kind(cls, optimizer.defaults, group)


def check_class(cls: type) -> None:
    """Refuse the classes no path can run, before anything is built (config optimizers)."""
    for klass in cls.__mro__:
        if klass.__name__ in _REFUSED and klass.__module__.startswith("torch.optim"):
            raise OptimizerKindError(f"{cls.__name__} cannot be sharded by zeroengine: "
                                     f"{_REFUSED[klass.__name__]}")


# -- the probe ---------------------------------------------------------------------------------
_PROBE_STEPS = 3


def _probe_shapes(group: dict) -> list[tuple[int, ...]]:
    """Two small shapes per number of dimensions the group's parameters have (so factored or
    per-matrix updates see more than one tensor), never square (rows and columns differ)."""
    ndims = sorted({p.dim() for p in group["params"]}) or [1]
    shapes = []
    for d in ndims:
        if d == 0:
            shapes.append(())
            continue
        shapes.append(tuple(3 + 2 * i for i in range(d)))
        shapes.append(tuple(6 - i for i in range(d)))
    return shapes


def _build(cls: type, defaults: dict, group: dict, params: list[torch.Tensor]):
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in defaults.items() if k in accepted}
    hyper = {k: v for k, v in group.items() if k not in ("params", "initial_lr")}
    return cls([{**hyper, "params": params}], **kwargs)


def _run(cls, defaults, group, layouts: list[list[torch.Tensor]], grads) -> None:
    """Step one optimizer per list in ``layouts`` (each list: tensors stepped together),
    ``_PROBE_STEPS`` times; ``grads(step)`` writes every tensor's .grad."""
    optimizers = [_build(cls, defaults, group, tensors) for tensors in layouts]
    for step in range(_PROBE_STEPS):
        grads(step)
        for opt in optimizers:
            opt.step()


def probe_kind(cls: type, defaults: dict, group: dict) -> str:
    """Classify ``cls`` with ``group``'s hyperparameters by stepping it on small tensors."""
    device = group["params"][0].device if group["params"] else torch.device("cpu")
    shapes = _probe_shapes(group)
    numels = [math.prod(s) for s in shapes]
    total = sum(numels)
    with torch.random.fork_rng(devices=[]):  # the user's random stream stays as it was
        gen = torch.Generator().manual_seed(1234)
        start = [torch.randn(s, generator=gen) for s in shapes]
        # Each tensor's gradient has its own scale, so anything normalised per tensor differs
        # from the same thing normalised per flat piece.
        grads = [[torch.randn(s, generator=gen) * 10.0 ** (i - 1) for i, s in enumerate(shapes)]
                 for _ in range(_PROBE_STEPS)]
        perm = torch.randperm(total, generator=gen)

        def tensors():
            return [t.clone().to(device).requires_grad_(True) for t in start]

        def whole_run() -> list[torch.Tensor]:
            ts = tensors()

            def set_grads(step):
                for t, g in zip(ts, grads[step]):
                    t.grad = g.to(device)
            _run(cls, defaults, group, [ts], set_grads)
            return [t.detach().cpu() for t in ts]

        try:
            reference = whole_run()
            again = whole_run()
        except Exception as err:
            raise _unclassified(cls, f"stepping it on small tensors failed "
                                f"({type(err).__name__}: {str(err).splitlines()[0][:200]})"
                                ) from err
        if not all(torch.equal(a, b) for a, b in zip(reference, again)):
            raise _unclassified(cls, "two identical runs gave different results (randomness "
                                "inside step()?)")

        # 1. the flat layout: all elements concatenated, permuted, cut in two unequal pieces
        cut = max(1, total // 3)
        try:
            flat = torch.cat([t.reshape(-1) for t in start])[perm]
            pieces = [flat[:cut].clone().to(device).requires_grad_(True),
                      flat[cut:].clone().to(device).requires_grad_(True)]

            def set_flat_grads(step):
                g = torch.cat([x.reshape(-1) for x in grads[step]])[perm].to(device)
                pieces[0].grad, pieces[1].grad = g[:cut].clone(), g[cut:].clone()
            # one optimizer per piece, as each rank steps only its own shard
            _run(cls, defaults, group, [[pieces[0]], [pieces[1]]], set_flat_grads)
            out = torch.empty(total)
            out[perm] = torch.cat([p.detach().cpu() for p in pieces])
            flat_ok = _close(torch.cat([r.reshape(-1) for r in reference]), out)
        except Exception:  # noqa: BLE001 - refusing 1-D or flat tensors: not elementwise
            flat_ok = False
        if flat_ok:
            return ELEMENTWISE

        # 2. independence: every tensor in its own optimizer
        try:
            alone = tensors()

            def set_alone_grads(step):
                for t, g in zip(alone, grads[step]):
                    t.grad = g.to(device)
            _run(cls, defaults, group, [[t] for t in alone], set_alone_grads)
            independent = all(_close(r, a.detach().cpu()) for r, a in zip(reference, alone))
        except Exception as err:
            raise _unclassified(cls, f"stepping one tensor at a time failed "
                                f"({type(err).__name__}: {str(err).splitlines()[0][:200]})"
                                ) from err
        if independent:
            return TENSORWISE
        raise OptimizerKindError(
            f"{cls.__name__} cannot be sharded by zeroengine: a parameter's update depends on "
            "the other parameters (stepping tensors together and one at a time differ: a "
            "global norm or line search inside step()?), so neither flat chunks nor whole "
            "parameters on separate ranks reproduce it. If that is wrong, declare it: "
            f"zeroengine.declare_optimizer({cls.__name__}, 'tensorwise')")


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def _unclassified(cls: type, why: str) -> OptimizerKindError:
    return OptimizerKindError(
        f"zeroengine could not tell how {cls.__name__} updates parameters: {why}. Declare it "
        f"before initialize(): zeroengine.declare_optimizer({cls.__name__}, 'elementwise') "
        "if each element's update depends only on that element's gradient and state (runs on "
        f"flat shards), or zeroengine.declare_optimizer({cls.__name__}, 'tensorwise') if each "
        "parameter's update depends only on that whole parameter (each runs whole on one "
        "rank); or set the class attribute zeroengine_update to either")
