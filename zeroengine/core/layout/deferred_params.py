"""Parameters whose values are not in memory yet when ``initialize`` starts: a model built on
the meta device (FSDP2's / torchtitan's ``with torch.device("meta"): model = Model(cfg)``), or
any model given ``weights=`` (safetensors files). Each such parameter is bound to a *source*
and its storage emptied; the engine then reads every value where it lands:

- a partitioned (stage 3) parameter: only the elements of this rank's shard, from the files
  (exact byte ranges) or from its module's ``reset_parameters()``, straight into the shard;
- a parameter kept whole (stages 0-2, frozen ones, those under the persistence threshold):
  the whole tensor, once per rank.

Nothing is broadcast: every rank reads the same files, and ``reset_parameters()`` runs under a
generator seeded from rank 0's seed and the module's name, so the values depend on neither the
world size nor the stage (nor the order modules are visited in).

``bind(model, weights, device, comm)`` checks everything first (shapes, keys, a meta parameter
neither source covers), on every rank, and raises the same error on all of them before any
value is read: a failed load leaves no half-loaded model that could train.
"""
from __future__ import annotations

import warnings
import zlib

import torch
import torch.nn as nn

from ...checkpoint.weights.weight_files import WeightFiles, WeightsError
from ...distributed.comm import Comm


class FileSource:
    def __init__(self, files: WeightFiles, key: str):
        self.files, self.key = files, key

    def piece(self, p: torch.Tensor, begin: int, numel: int,
              out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None or out.dtype != p.dtype:  # values rounded to the parameter's dtype
            return self.files.read(self.key, begin, torch.empty(numel, dtype=p.dtype))
        return self.files.read(self.key, begin, out)  # straight into the shard: no copy

    def whole(self, p: torch.Tensor) -> torch.Tensor:
        return self.files.read_full(self.key, p.dtype)


class ResetSource:
    """The values ``module.reset_parameters()`` gives, computed on the CPU under a generator
    seeded by (seed, module name); the last module's values are kept while its parameters are
    read, and recomputed (the same numbers) if asked again later."""
    _cache: tuple[int, dict[int, torch.Tensor]] | None = None

    def __init__(self, module: nn.Module, name: str, seed: int):
        self.module, self.name, self.seed = module, name, seed

    def _values(self) -> dict[int, torch.Tensor]:
        cached = ResetSource._cache
        if cached is not None and cached[0] == id(self.module):
            return cached[1]
        values = _run_reset(self.module, self.name, self.seed)
        ResetSource._cache = (id(self.module), values)
        return values

    def piece(self, p: torch.Tensor, begin: int, numel: int,
              out: torch.Tensor | None = None) -> torch.Tensor:
        return self._values()[id(p)].reshape(-1)[begin:begin + numel]

    def whole(self, p: torch.Tensor) -> torch.Tensor:
        return self._values()[id(p)]


def is_deferred(t: torch.Tensor) -> bool:
    return hasattr(t, "_ze_source")


def read_piece(p: torch.Tensor, begin: int, numel: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Elements [begin, begin + numel) of ``p``'s flattened value, in ``p``'s dtype; read
    into ``out`` (a CPU tensor) where the source can (then ``out`` is returned)."""
    return p._ze_source.piece(p, begin, numel, out)


def load_whole(t: torch.Tensor) -> None:
    """Give a deferred parameter or buffer its whole value (on its device) and drop its
    source."""
    t.data = t._ze_source.whole(t).to(device=t.device, dtype=t.dtype)
    del t._ze_source


def done(t: torch.Tensor) -> None:
    """The engine has taken a deferred parameter's values into its shard."""
    del t._ze_source


def finish() -> None:
    """Every deferred value has been read: drop the last module's reset values."""
    ResetSource._cache = None


def has_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def bind(model: nn.Module, weights, device: torch.device, comm: Comm) -> dict[int, torch.Tensor]:
    """Bind every meta parameter/buffer (and, with ``weights``, every one the files hold) to
    its source and empty its storage on ``device``. A collective (every rank calls it): any
    rank's error is raised on every rank, naming that rank. Returns {id(old): new} for the
    meta parameters, which are replaced by new Parameter objects (torch cannot move a meta
    parameter's data in place), the same new object wherever the old one was held (tied
    weights stay tied): an optimizer built over the meta parameters is remapped with it."""
    error, files, plan = None, None, []
    try:
        files = weights if isinstance(weights, WeightFiles) or weights is None \
            else WeightFiles.open(weights)
        plan = _plan(model, files)
    except WeightsError as e:
        error = str(e)
    if comm.world_size > 1:
        errors = comm.all_gather_object(error)
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            rank, first = failed[0]
            raise WeightsError(first if len(failed) == comm.world_size
                               else f"rank {rank}: {first}")
    elif error is not None:
        raise WeightsError(error)
    seed = _shared_seed(comm, device)
    replaced: dict[int, torch.Tensor] = {}
    for t, source in plan:
        if t.is_meta:
            new = _empty(t, device)
            replaced[id(t)] = new
            t = new
        else:  # same tensor type: emptied in place, every reference to it stays valid
            t.data = _empty(t, device).data
        t._ze_source = source
    for module in model.modules():
        for kind in ("_parameters", "_buffers"):
            held = getattr(module, kind)
            for local, t in held.items():
                if t is not None and id(t) in replaced:
                    held[local] = replaced[id(t)]
    for t, source in plan:  # reset sources name their module, now holding the new tensors
        t = replaced.get(id(t), t)
        if isinstance(source, tuple):  # (module, name): reset_parameters
            module, name = source
            t._ze_source = ResetSource(module, name,
                                       (seed + zlib.crc32(name.encode())) % (2 ** 63))
    return replaced


def _plan(model: nn.Module, files: WeightFiles | None) -> list:
    """(tensor, source) for each parameter/buffer to defer; every check made here."""
    names: dict[int, list[str]] = {}
    owners: dict[int, tuple[str, nn.Module]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for local, t in getattr(module, kind).items():
                if t is None:
                    continue
                full = f"{mname}.{local}" if mname else local
                names.setdefault(id(t), []).append(full)
                owners.setdefault(id(t), (mname, module))
                tensors[id(t)] = t
    plan, used, uncovered = [], set(), []
    for tid, t in tensors.items():
        key = next((n for n in names[tid] if files is not None and n in files), None)
        if key is not None:
            files.entry(key).check_shape(t.shape, f"the model's {names[tid][0]!r}")
            used.update(n for n in names[tid] if n in files)
            plan.append((t, FileSource(files, key)))
        elif t.is_meta and is_deferred(t):  # bound already (from_pretrained under zero_init)
            plan.append((t, t._ze_source))
        elif t.is_meta:
            mname, module = owners[tid]
            if callable(getattr(module, "reset_parameters", None)):
                plan.append((t, (module, mname)))
            else:
                uncovered.append((names[tid][0], mname, type(module).__name__))
    if uncovered:
        name, mname, cls = uncovered[0]
        more = f" (and {len(uncovered) - 1} more)" if len(uncovered) > 1 else ""
        where = f"module {mname!r} ({cls})" if mname else f"the root module ({cls})"
        raise WeightsError(
            f"{name!r}{more} is on the meta device and nothing gives it values: "
            f"{where} has no reset_parameters(), and "
            + ("no weights= were given" if files is None else
               f"{files.path} holds no {name!r}")
            + ". Either pass weights= files that hold it, or give the module a "
            "reset_parameters() that initialises its own parameters and buffers (or build "
            "that module off the meta device)")
    if files is not None:
        unexpected = sorted(set(files.entries) - used)
        if unexpected:
            shown = ", ".join(unexpected[:10]) + (" ..." if len(unexpected) > 10 else "")
            warnings.warn(f"Some weights of {files.path} were not used when initializing "
                          f"{type(model).__name__}: [{shown}] ({len(unexpected)} keys the "
                          "model does not have)", stacklevel=4)
    return plan


def _shared_seed(comm: Comm, device: torch.device) -> int:
    """Rank 0's torch seed, on every rank (ranks that did not seed alike still agree)."""
    seed = torch.tensor([torch.initial_seed() % (2 ** 62)], dtype=torch.int64, device=device)
    if comm.world_size > 1:
        comm.broadcast(seed, 0)
    return int(seed.item())


def _empty(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t``'s shape and dtype on ``device``, no storage (reading it before the engine fills
    it is an error): a Parameter (with ``t``'s attributes) for a parameter."""
    empty = torch.empty(t.shape, dtype=t.dtype, device=device)
    empty.untyped_storage().resize_(0)
    if isinstance(t, nn.Parameter):
        new = nn.Parameter(empty, requires_grad=t.requires_grad)
        new.__dict__.update({k: v for k, v in t.__dict__.items() if k != "_ze_source"})
        return new
    return empty


def remap_optimizer(optimizer, replaced: dict[int, torch.Tensor]) -> None:
    """An optimizer (or a list of them) built over meta parameters: over their replacements."""
    for opt in optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]:
        for group in getattr(opt, "param_groups", []):
            group["params"] = [replaced.get(id(p), p) for p in group["params"]]


def _run_reset(module: nn.Module, name: str, seed: int) -> dict[int, torch.Tensor]:
    """``module.reset_parameters()`` on CPU tensors for its parameters and buffers (and, for
    resets that reach into children, theirs: those values are discarded, each child resets its
    own), under a generator seeded with ``seed``. Its own tensors start as NaN (integers: 0):
    one the reset leaves unset is an error naming it."""
    saved = []
    for sub in module.modules():
        for kind in ("_parameters", "_buffers"):
            for t in getattr(sub, kind).values():
                if t is not None and is_deferred(t):
                    saved.append((t, t.data))
                    fill = torch.empty(t.shape, dtype=t.dtype)
                    fill.fill_(float("nan") if t.is_floating_point() else 0)
                    t.data = fill
    own = [(local, t) for kind in ("_parameters", "_buffers")
           for local, t in getattr(module, kind).items() if t is not None and is_deferred(t)]
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            module.reset_parameters()
        values = {}
        for local, t in own:
            if t.is_floating_point() and torch.isnan(t.data).any():
                raise WeightsError(
                    f"{name + '.' if name else ''}{local} is on the meta device and "
                    f"{type(module).__name__}.reset_parameters() left it (or part of it) "
                    "unset: initialise it there, or pass weights= files that hold it")
            values[id(t)] = t.data
        return values
    finally:
        for t, data in saved:
            t.data = data
