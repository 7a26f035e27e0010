"""Stage 3: gather a module's parameter segments just before it runs, release them after.

Every module that directly holds partitioned parameters (a tied parameter counts for each module
holding it) gets:
- a forward pre-hook that gathers (all-gathers) the segments its parameters live in, and a
  forward hook that releases them; references are counted, so nested and repeated calls work;
- on its forward outputs, gradient hooks that gather the same segments again just before the
  module's own backward runs (the pre-backward "unshard").
In backward a segment is released as soon as every parameter in it has had its gradient reduced
(GradReducer calls ``grads_taken``), and whatever is still gathered when backward ends
is released then (parameters that got no gradient).

Fetch units (param_layout.fetch_units): consecutive small modules share segments, so one
all-gather serves several modules. Such a segment stays gathered until every module of its unit
that runs in forward has run (the ones the first step never saw run, such as
nn.MultiheadAttention's out_proj, are not waited for), and its gradient is one bucket.

Releasing empties the storage of the segment's full tensor (see flat_param_group.py); gathering
refills it, so the model's parameter objects never change.

Prefetch: the first forward+backward records the order in which segments are first requested.
Afterwards, requesting one also starts the all-gathers of the following segments in that order,
up to ``prefetch_numel`` elements ahead, so the next module's parameters are on the way while this
one computes. Another order (dynamic control flow) stays correct: a segment not prefetched is
gathered on demand, and one prefetched but never used is released when the pass ends.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from ...config import AUTO
from ...distributed.comm import Comm
from ...handles import GATHER, PREFETCH, Handle
from ...ops.quantize import DEFAULT_BLOCK as QUANT_BLOCK
from ..compat.compiled import uncompiled
from ..compat.drop_in import EngineHook
from ..layout.flat_param_group import FlatParamGroup
from ..layout.param_layout import fetching_modules, parameter_owners
from .gather_check import NO_KEY, GatherOrderCheck, GatherPurpose
from .module_hooks import ModuleHooks
from .prefetch import FetchMode, Phase, PrefetchPlan, _Order, auto_window
from .sharded_param import mark_sharded, unmark_sharded

Key = tuple[int, int]  # (index of the partitioned group, segment)

@dataclass
class _Gathered:
    handle: Handle | None  # the all-gather, until waited for
    verify: Callable[[], None] | None = None  # its gather-order check, until compared
    refs: int = 0  # module forward calls holding it
    user_refs: int = 0  # gathered_parameters blocks holding it
    in_backward: bool = False  # gathered for a backward computation
    exact: bool = True  # False: gathered int8-quantized (qwZ); a user block regathers it
    keep_secondary: bool = False  # hpZ: once gathered, keep the node's slice (see _wait)
    # a fetch unit of several modules: the ones whose forward has not yet run since it was
    # gathered (it stays gathered for them); None: not acquired by a module's forward yet
    pending: set[int] | None = None

    @property
    def held(self) -> bool:
        return self.refs > 0 or self.user_refs > 0


class ParamFetcher(ModuleHooks, PrefetchPlan):
    @classmethod
    def from_config(cls, module: nn.Module, groups: list[FlatParamGroup], comm: Comm, topology,
                    zero) -> ParamFetcher:
        """The fetcher of ``groups`` (the partitioned ones) as the config's zero_optimization
        section ``zero`` and the topology (hpZ's secondary group) say."""
        window = auto_window(groups)
        return cls(module, groups, comm, gather_comm=topology.shard,
                   secondary_comm=topology.secondary,
                   quantize_block=QUANT_BLOCK if zero.zero_quantized_weights else 0,
                   prefetch_numel=window if zero.stage3_prefetch_bucket_size == AUTO
                   else zero.stage3_prefetch_bucket_size,
                   max_reuse_numel=window if zero.stage3_max_reuse_distance == AUTO
                   else zero.stage3_max_reuse_distance,
                   max_live_numel=zero.stage3_max_live_parameters,
                   check_order=zero.stage3_check_gather_order,
                   leaf_modules=zero.stage3_leaf_modules)

    def __init__(self, module: nn.Module, groups: list[FlatParamGroup], comm: Comm, *,
                 prefetch_numel: int, max_live_numel: int, max_reuse_numel: int,
                 check_order: bool = True, leaf_modules=(), gather_comm: Comm | None = None,
                 secondary_comm: Comm | None = None, quantize_block: int = 0):
        """``prefetch_numel``: most elements gathered ahead of use; ``max_live_numel``: most
        gathered at once; ``max_reuse_numel``: a segment whose next use (along the recorded
        order) comes within this many gathered elements is kept instead of released. The
        config's stage3_* keys, resolved from the model when "auto" (see ``auto_window``).
        ``comm``: every rank (checks, write-backs); ``gather_comm``: the ranks a segment is
        sharded over (hybrid sharding: the rank's shard group; default ``comm``).
        ``secondary_comm`` (ZeRO++ hpZ): the ranks of this rank's node; after a segment's first
        gather in a step each rank keeps the node's 1/K slice of it, and later gathers until
        the step (backward, the next micro-steps' forwards) gather those slices inside the
        node. ``quantize_block`` (ZeRO++ qwZ): > 0 gathers the model's segments as blockwise
        int8 with one scale per this many elements (user gathers stay exact)."""
        self.groups = groups
        # Every forward starts with a cross-rank check (cheap: one per forward); checking
        # before every gather too catches a branch taken on one rank, at a price (see config).
        self.check_ranks = comm.world_size > 1
        self.check_order = check_order and self.check_ranks
        if self.check_ranks:
            comm.open_check_group()
        self.comm = comm
        self.gather_comm = gather_comm or comm
        self.secondary_comm = secondary_comm
        self.quantize_block = quantize_block
        self.secondary: dict[Key, torch.Tensor] = {}  # hpZ: the node's slice of a segment
        self.secondary_gathers = 0  # gathers served inside the node (for tests and reports)
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.max_reuse_numel = max_reuse_numel
        self.gathered: dict[Key, _Gathered] = {}
        self._group_index = {id(g): gi for gi, g in enumerate(groups)}
        where: dict[int, Key] = {}
        for gi, g in enumerate(groups):
            for s, seg in enumerate(g.layout.segments):
                for i in seg.params:
                    where[id(g.params[i])] = (gi, s)
        self.where = where
        self._param_names = {id(p): name for name, p in uncompiled(module).named_parameters()}
        self._check = GatherOrderCheck(comm, self._names_of)  # (used only when check_ranks)
        self._hooks = []
        self.module_keys: dict[nn.Module, list[Key]] = {}
        # segment -> the modules whose own parameters it holds (several: a fetch unit grouping
        # modules, param_layout.fetch_units), by the rule the layout cut the units with
        modules = list(module.modules())
        self._members: dict[Key, set[int]] = {}
        for p, owner in parameter_owners(module, leaf_modules).items():
            if p in where:
                self._members.setdefault(where[p], set()).add(id(modules[owner]))
        for mod, leaf in fetching_modules(module, leaf_modules):
            keys = sorted({where[id(p)] for p in mod.parameters(recurse=leaf)
                           if id(p) in where})
            # The root always: a parameter read in its own forward code is gathered for it.
            if keys or mod is module:
                self.module_keys[mod] = keys
                self._hooks.append(mod.register_forward_pre_hook(EngineHook(self._pre_forward)))
                self._hooks.append(mod.register_forward_hook(EngineHook(self._post_forward)))
        self._hooks.append(module.register_forward_hook(EngineHook(self._after_root_forward),
                                                        always_call=True))
        self.root = module
        # the root called inside its own forward (a LightningModule's training_step run as the
        # forward, calling self(x)): the end-of-forward work waits for the outermost call
        self._root_depth = 0
        # A compiled model's first forward runs eagerly (compiled.eager_stance): the checks
        # that find parameters a module reads without calling their owner (sharded_param.py)
        # cannot run inside a graph, so they learn them once, before anything is traced.
        self._first_forward = True
        self._stance = None
        self._running: list[nn.Module] = []  # hooked modules whose forward is running
        for g in groups:
            for p in g.params:
                mark_sharded(p, self)
        # The first step records the order of first requests, per phase (backward runs the
        # other way); later steps prefetch along it.
        self.mode = FetchMode.RECORDING
        # while recording: the gather order seen so far in each phase
        self._recording: dict[Phase, _Order] | None = {Phase.FORWARD: _Order(),
                                                       Phase.BACKWARD: _Order()}
        self._ran: set[int] = set()  # modules whose forward ran while recording
        self._orders: dict[Phase, list[Key]] = {Phase.FORWARD: [], Phase.BACKWARD: []}
        self._positions: dict[Phase, dict[Key, int]] = {Phase.FORWARD: {}, Phase.BACKWARD: {}}
        # elements gathered before each position of an order: _before[phase][i]
        self._before: dict[Phase, list[int]] = {Phase.FORWARD: [0], Phase.BACKWARD: [0]}
        self._phase = Phase.FORWARD
        # Furthest position of the current pass, per phase: a module late in the pass that uses
        # an early segment (a head tied to the embedding) must not restart the prefetch from
        # there, which gathered the whole model a second time.
        self._reached = {Phase.FORWARD: -1, Phase.BACKWARD: -1}
        self.gathers = 0  # all-gathers issued (for tests and reports)
        self._gathered_bytes = 0  # bytes of the segments gathered now
        self.peak_gathered_bytes = 0  # its high-water mark since reset_peak (memory_report)
        self.passes = 0  # backward passes ended
        self.prefetch_hits = 0

    # -- gather / release ----------------------------------------------------------------------
    def _segment_numel(self, key: Key) -> int:
        return self.groups[key[0]].layout.segments[key[1]].numel

    def _start(self, key: Key, prefetch: bool = False, user: bool = False) -> _Gathered:
        gi, s = key
        g = self.groups[gi]
        verify = None
        if self.check_order:  # compared when the gather is waited for (see _wait)
            purpose = GatherPurpose.USER if user else self._purpose()
            verify = self._check.exchange(key, purpose, async_op=True)
        full = g.segment_full[s]
        full.untyped_storage().resize_(full.numel() * full.element_size())
        entry = self._gather_into(key, full, g.chunk_on_device(s), prefetch, user)
        entry.verify = verify
        self.gathered[key] = entry
        self._gathered_bytes += full.numel() * full.element_size()
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self._gathered_bytes)
        self.gathers += 1
        return entry

    def _gather_into(self, key: Key, full: torch.Tensor, chunk: torch.Tensor, prefetch: bool,
                     user: bool) -> _Gathered:
        """Start filling ``full`` (a segment) by the cheapest way that gives the model what it
        needs: the node's slices (hpZ, after the step's first gather), else every rank's
        chunk - int8 with qwZ - over the shard group. A user block always gets exact values."""
        # CUDA: prefetches complete on their own side stream, tracked apart from on-demand
        # gathers (NCCL still runs the collectives of one communicator in issue order)
        role = PREFETCH if prefetch else GATHER
        what = lambda: f"stage-3 parameters {self._names_of(key)}"  # noqa: E731
        slice_ = self.secondary.get(key)
        if slice_ is not None:
            self.secondary_gathers += 1
            return _Gathered(self.secondary_comm.all_gather(full, slice_, async_op=True,
                                                            role=role, what=what))
        quantized = self.quantize_block > 0 and not user
        if quantized:
            handle = self.gather_comm.all_gather_quantized(full, chunk, self.quantize_block,
                                                           async_op=True, role=role, what=what)
        else:
            handle = self.gather_comm.all_gather(full, chunk, async_op=True, role=role,
                                                 what=what)
        return _Gathered(handle, exact=not quantized,
                         keep_secondary=self.secondary_comm is not None)

    def _keep_secondary(self, key: Key) -> None:
        """hpZ: keep this rank's slice of the node's split of a freshly gathered segment."""
        full = self.groups[key[0]].segment_full[key[1]]
        node = self.secondary_comm
        n = full.numel() // node.world_size
        self.secondary[key] = full[node.rank * n:(node.rank + 1) * n].clone()

    def _purpose(self) -> GatherPurpose:
        if self._phase is Phase.BACKWARD:
            return GatherPurpose.BACKWARD
        return GatherPurpose.FORWARD if torch.is_grad_enabled() else \
            GatherPurpose.FORWARD_NO_GRAD

    def check_forward_start(self) -> None:
        """Before the model's forward (and its buffer broadcast): every rank starts the same
        kind of forward. Catches rank-0-only evaluation before any collective can mismatch."""
        self._check.exchange(NO_KEY, self._purpose())

    def _wait(self, entry: _Gathered) -> None:
        """The gather of ``entry`` is complete and its order check passed."""
        if entry.verify is not None:
            verify, entry.verify = entry.verify, None
            verify()  # before the gather's own wait: a mismatch there may be a size error
        if entry.handle is not None:
            entry.handle.wait()
            entry.handle = None

    def _names_of(self, key: Key) -> str:
        """The parameters of a segment, for error messages: 'a.weight' or 'a.weight .. b.bias
        (n)'."""
        g = self.groups[key[0]]
        indices = g.layout.segments[key[1]].params
        names = [self._param_names.get(id(g.params[i]), f"#{i}") for i in indices]
        if not names:
            return f"(segment {key[1]})"
        return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)})"

    def _ready(self, key: Key, user: bool = False) -> _Gathered:
        entry = self.gathered.get(key)
        if entry is None:
            entry = self._start(key, user=user)
        elif entry.handle is not None:
            self.prefetch_hits += 1  # requested while its prefetched all-gather was under way
        self._wait(entry)
        if entry.keep_secondary:
            entry.keep_secondary = False
            if key not in self.secondary:  # (dequantized values, with qwZ: as forward saw)
                self._keep_secondary(key)
        if user and not entry.exact:  # quantized for the model: the user sees exact values
            g = self.groups[key[0]]
            self.gather_comm.all_gather(g.segment_full[key[1]], g.chunk_on_device(key[1]))
            entry.exact = True
        if self.recording:
            self._recording[self._phase].add(key)
        elif not user:
            reached = self._reached
            reached[self._phase] = max(reached[self._phase],
                                       self._positions[self._phase].get(key, -1))
        return entry

    def _free(self, key: Key) -> None:
        entry = self.gathered.pop(key)
        self._wait(entry)  # never free memory a collective is still writing
        full = self.groups[key[0]].segment_full[key[1]]
        full.untyped_storage().resize_(0)
        self._gathered_bytes -= full.numel() * full.element_size()

    def acquire(self, keys: list[Key], user: bool = False,
                module: nn.Module | None = None) -> None:
        """Gather ``keys`` (if needed) and hold them until ``release``; ``module``: the
        module whose forward holds them."""
        for key in keys:
            entry = self._ready(key, user)
            if user:
                entry.user_refs += 1
            else:
                entry.refs += 1
                if module is not None and entry.pending is None:
                    members = self._members.get(key, ())
                    entry.pending = set(members) if len(members) > 1 else set()
        self._prefetch_after(keys)

    def release(self, keys: list[Key], user: bool = False,
                keep_for_backward: bool = False, module: nn.Module | None = None) -> None:
        """Drop a hold; the segment is freed when nothing holds it and every module of its
        fetch unit has run (``module``: the one whose forward ended), unless
        ``keep_for_backward`` keeps it until the end of the next backward."""
        for key in keys:
            entry = self.gathered.get(key)
            if entry is None:  # already cleared at the end of a backward
                continue
            if user:
                entry.user_refs -= 1
            else:
                entry.refs = max(0, entry.refs - 1)
                if entry.pending and module is not None:
                    entry.pending.discard(id(module))
            entry.in_backward = entry.in_backward or keep_for_backward
            # kept for reuse only at the end of a module's forward: a user block left after
            # the pass is no forward, and its segment would stay gathered into the next step
            if not entry.held and not entry.in_backward and not entry.pending \
                    and (module is None or not self._reused_soon(key)):
                self._free(key)

    def write_back(self, keys: list[Key], src: int) -> None:
        """Rank ``src``'s (possibly modified) full values become every rank's: broadcast each
        segment, then every rank refreshes its own chunk and fp32 master from it."""
        for gi, s in keys:
            g = self.groups[gi]
            full = g.segment_full[s]
            self.comm.broadcast(full, src)
            g.set_chunk(s, full[g.layout.segments[s].own_chunk_local(g.rank)])
            g.refresh_master([s])

    def gather_for_backward(self, keys: list[Key]) -> None:
        self._phase = Phase.BACKWARD
        for key in keys:
            self._ready(key).in_backward = True
        self._prefetch_after(keys)

    def grads_taken(self, group: FlatParamGroup, segment: int) -> None:
        """GradReducer: every parameter of the segment has its gradient, so backward needs it
        no more (a group this fetcher does not partition is ignored)."""
        gi = self._group_index.get(id(group))
        if gi is None:
            return
        key = (gi, segment)
        entry = self.gathered.get(key)
        if entry is not None and not entry.held:
            self._free(key)

    def end_of_pass(self) -> None:
        """After backward (or a forward without backward): release all that is not held, and
        fix the prefetch order after the first step. Module holds are cleared too: a forward
        cut short (non-reentrant checkpointing stops recomputing as soon as it has what backward
        needs; or an exception) never ran its modules' release hooks."""
        for entry in self.gathered.values():  # what a user block holds on is not backward's
            entry.refs, entry.pending, entry.in_backward = 0, None, False
        self.release_unheld()
        self._reached = {Phase.FORWARD: -1, Phase.BACKWARD: -1}
        self.passes += 1
        self._phase = Phase.FORWARD
        if self.recording and self._recording[Phase.BACKWARD].keys:
            # a unit's module the model never calls (nn.MultiheadAttention's out_proj, read by
            # its parent) must not keep the unit gathered: wait only for the ones that ran
            for members in self._members.values():
                members &= self._ran
            for phase, order in self._recording.items():
                self._orders[phase] = order.keys
                self._positions[phase] = {k: i for i, k in enumerate(order.keys)}
                before = [0]
                for k in order.keys:
                    before.append(before[-1] + self._segment_numel(k))
                self._before[phase] = before
            self._recording = None
            self.mode = FetchMode.FOLLOWING

    @property
    def recording(self) -> bool:
        """The first step: the gather order is being recorded, nothing is prefetched yet."""
        return self.mode is FetchMode.RECORDING

    def refresh_gathered(self) -> None:
        """After an optimizer step: segments still gathered (held across the step) would show
        stale values; gather them again from the updated shards. hpZ's node slices are stale
        too: the next gather of each segment goes to the shard group again."""
        self.secondary.clear()
        for key, entry in self.gathered.items():
            self._wait(entry)
            g = self.groups[key[0]]
            if self.check_order:
                self._check.exchange(key, GatherPurpose.REFRESH)
            # synchronous: user code holding the segment reads the parameters directly
            self.gather_comm.all_gather(g.segment_full[key[1]], g.chunk_on_device(key[1]))
            entry.handle = None
            self.gathers += 1

    def release_unheld(self) -> None:
        for key in [k for k, e in self.gathered.items() if not e.held]:
            self._free(key)

    def gathered_numel(self) -> int:
        return sum(self._segment_numel(k) for k in self.gathered)

    def gathered_nbytes(self) -> int:
        return self._gathered_bytes

    def secondary_nbytes(self) -> int:
        """hpZ: the node's slices this rank keeps between gathers."""
        return sum(t.numel() * t.element_size() for t in self.secondary.values())

    def reset_peak(self) -> None:
        self.peak_gathered_bytes = self._gathered_bytes

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for g in self.groups:
            for p in g.params:
                unmark_sharded(p)
