"""Collectives over a process group, and what they carried.

With bootstrap.py (joining and leaving the group) and quantized.py (ZeRO++'s int8 collectives,
mixed into ``Comm``), this folder is where zeroengine calls torch.distributed; the rest of the
package goes through ``Comm``. (deepspeed/comm.py is DeepSpeed's names for torch.distributed
itself, for scripts written against DeepSpeed.)

Collectives are issued through a ``Comm`` object that (1) picks, once, the primitive the installed
torch offers on the active backend (``*_single`` names on new torch, ``*_tensor`` names on older,
list-based fallbacks where gloo lacks both), (2) returns a handle whose ``wait()`` also runs any
fix-up a fallback needs, and (3) counts bytes per collective kind for ``comm_report()``.

Byte accounting uses the ring-algorithm cost that NCCL and gloo both approach: for a tensor of B
bytes over N ranks, reduce-scatter and all-gather each send and receive B*(N-1)/N per rank,
all-reduce twice that. It is what the ZeRO paper's communication volumes are stated in.
"""
from __future__ import annotations

import datetime
import time
from collections import defaultdict
from typing import Callable, NoReturn

import torch
import torch.distributed as dist

from ..errors import CollectiveError
from ..handles import GATHER, REDUCE, Handle, StreamRole
from ..ops import flatten_into, host_pool, unflatten_from
from .quantized import QuantizedCollectives

_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}


# How torch/gloo word a collective that waited too long or lost its peer.
_TIMEOUT_MARKS = ("timed out", "timeout")
_PEER_MARKS = ("connection closed by peer", "connection reset", "broken pipe",
               "connection refused")


def _pick(*names: str):
    for name in names:
        fn = getattr(dist, name, None)
        if fn is not None:
            return fn
    return None


class Comm(QuantizedCollectives):
    """Collectives over one process group (the default group unless told otherwise)."""

    def __init__(self, group=None, timeout_s: float | None = None):
        self.group = group
        self._check_group = None  # open_check_group(): host-side group for gather_ints
        self.timeout_s = timeout_s  # for messages: the group's own timeout when we built it
        self.step = 1  # the optimizer step under way, for messages (ShardedOptimizer sets it)
        self.active = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.active else 0
        self.world_size = dist.get_world_size(group) if self.active else 1
        self.backend = dist.get_backend(group) if self.active else "none"
        self._bytes: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # sent, recv, calls
        self._waited: dict[str, float] = {}  # kind -> seconds blocked (record_wait)
        self._all_gather = _pick("all_gather_single", "all_gather_into_tensor")
        self._reduce_scatter = _pick("reduce_scatter_single", "reduce_scatter_tensor")
        self._avg_ok = True  # gloo before torch 2.6 or so rejects ReduceOp.AVG
        # gloo's reduce-scatter is an all-reduce underneath: each rank sends the whole input
        # ((N-1)/N of it twice over), not the (N-1)/N a reduce-scatter needs. Sending each rank
        # its chunk directly halves the bytes (measured on loopback, 2 ranks: 1.00x -> 0.50x).
        self._p2p_reduce_scatter = self.backend == "gloo"
        # gloo's all-gather receives into a temporary flat tensor of the whole output and copies
        # it into place afterwards: one extra copy of every gathered byte, and a transient
        # buffer the size of each stage-3 segment allocated in gloo's thread (heap fragments
        # the resident peak keeps). Receiving each rank's chunk straight into its slot avoids
        # both; the bytes sent are the same as gloo's ring, (N-1)/N of the output per rank.
        self._p2p_all_gather = self.backend == "gloo"
        self._p2p_tag = 0

    # -- failures -----------------------------------------------------------------------------
    def explain(self, err: Exception, op: str, what, step: int) -> CollectiveError | None:
        """A CollectiveError saying which collective failed and the likely why, or None when
        ``err`` is not a timeout or a lost peer."""
        text = str(err).lower()
        what = what() if callable(what) else what  # formatted only when something failed
        where = f"{op} of {what}" if what else op
        waited = f" after {self.timeout_s:g} s" if self.timeout_s else ""
        if any(mark in text for mark in _TIMEOUT_MARKS):
            why = (f"timed out{waited} waiting for the other ranks: a rank stopped calling "
                   "collectives (it crashed, hangs, or skipped a forward/backward/step the "
                   "others ran). The timeout is the config's collective_timeout_s")
        elif any(mark in text for mark in _PEER_MARKS):
            why = "a peer rank exited or lost its connection"
        else:
            return None
        return CollectiveError(f"rank {self.rank}: {where} at step {step} failed: {why}. "
                               f"({type(err).__name__}: {str(err).splitlines()[0][:300]})")

    def raise_explained(self, err: RuntimeError, op: str, what, step: int) -> NoReturn:
        """Raise ``err`` as a CollectiveError when it is a timeout or a lost peer, else as is."""
        explained = self.explain(err, op, what, step)
        if explained is None:
            raise err
        raise explained from err

    def _issue(self, op: str, what, role: StreamRole | None, tensors: list[torch.Tensor],
               async_op: bool, issue: Callable[[bool], Handle]) -> Handle:
        """``issue(async_op)`` a collective on ``tensors``: asynchronous ones run in ``role``
        (on CUDA its side stream; see handles.py); a timeout becomes a CollectiveError here or
        at ``wait()``."""
        step = self.step
        start = time.perf_counter()
        try:
            if async_op and role is not None:
                handle = role.run(tensors, lambda: issue(True))
            else:
                handle = issue(False)
        except RuntimeError as err:
            self.raise_explained(err, op, what, step)
        if not async_op:  # the caller waited for all of it
            self.record_wait(op, time.perf_counter() - start)
        handle.context = (self, op, what, step)
        return handle

    # -- accounting -------------------------------------------------------------------------
    def _count(self, kind: str, nbytes: int, factor: float) -> None:
        moved = int(nbytes * factor * (self.world_size - 1) / self.world_size)
        entry = self._bytes[kind]
        entry[0] += moved
        entry[1] += moved
        entry[2] += 1

    def record_wait(self, kind: str, seconds: float) -> None:
        """Time the host spent blocked on a ``kind`` collective (Handle.wait, or a synchronous
        call): communication not hidden behind compute. On CUDA an asynchronous collective's
        wait orders streams without blocking the host, so only synchronous ones count there."""
        self._waited[kind] = self._waited.get(kind, 0.0) + seconds

    def report(self, reset: bool = True) -> dict[str, dict]:
        """Per collective kind: sent_bytes, recv_bytes, calls, and exposed_s (seconds callers
        were blocked waiting for it)."""
        out = {k: {"sent_bytes": v[0], "recv_bytes": v[1], "calls": v[2], "exposed_s": 0.0}
               for k, v in sorted(self._bytes.items())}
        for kind, seconds in self._waited.items():
            out.setdefault(kind, {"sent_bytes": 0, "recv_bytes": 0, "calls": 0,
                                  "exposed_s": 0.0})["exposed_s"] = seconds
        if reset:
            self._bytes.clear()
            self._waited.clear()
        return out

    # -- collectives ------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False,
                   what="") -> Handle:
        """``what``: what the tensor holds, for error messages (as for every collective): a
        string, or a callable returning one, called only if the collective fails."""
        if self.world_size == 1:
            return Handle()
        return self._issue("all_reduce", what, REDUCE, [tensor], async_op,
                           lambda a: self._all_reduce(tensor, op, a))

    def _all_reduce(self, tensor: torch.Tensor, op: str, async_op: bool) -> Handle:
        self._count("all_reduce", tensor.numel() * tensor.element_size(), 2.0)
        if op == "avg" and not self._avg_ok:
            return self._sum_then_divide(tensor, async_op)
        try:
            work = dist.all_reduce(tensor, op=_OPS[op], group=self.group, async_op=async_op)
        except (RuntimeError, ValueError):
            if op != "avg":
                raise
            self._avg_ok = False
            return self._sum_then_divide(tensor, async_op)
        return Handle(work)

    def _sum_then_divide(self, tensor, async_op):
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)
        return Handle(work, lambda: tensor.div_(self.world_size))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "avg",
                       async_op: bool = False, via_all_reduce: bool = False,
                       what="") -> Handle:
        """output (numel n) <- op over ranks of input[rank*n:(rank+1)*n]. ``via_all_reduce``
        forces the all-reduce fallback (DeepSpeed's reduce_scatter=false)."""
        if self.world_size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Handle()
        return self._issue("reduce_scatter", what, REDUCE, [output, input], async_op,
                           lambda a: self._reduce_scatter_any(output, input, op, a,
                                                              via_all_reduce))

    def _reduce_scatter_any(self, output, input, op, async_op, via_all_reduce) -> Handle:
        if not via_all_reduce:
            self._count("reduce_scatter", input.numel() * input.element_size(), 1.0)
        if self._p2p_reduce_scatter and op in ("sum", "avg") and not via_all_reduce:
            handle = self._reduce_scatter_p2p(output, input, op)
            if not async_op:
                handle.wait()
            return handle
        reduce_op = op if (op != "avg" or self._avg_ok) else "sum"
        if self._reduce_scatter is not None and not via_all_reduce:
            try:
                work = self._reduce_scatter(output, input, op=_OPS[reduce_op], group=self.group,
                                            async_op=async_op)
                after = (lambda: output.div_(self.world_size)) if reduce_op != op else None
                return Handle(work, after)
            except (RuntimeError, ValueError) as err:
                if "AVG" in str(err) or "avg" in str(err).lower():
                    self._avg_ok = False
                    return self._reduce_scatter_any(output, input, op, async_op, False)
                self._reduce_scatter = None  # backend lacks it: use the all-reduce fallback
        # Fallback (old gloo): all-reduce a copy, keep our chunk. Correct, twice the bytes.
        scratch = input.clone()
        handle = self._all_reduce(scratch, op, async_op)
        n = output.numel()

        def take_chunk():
            handle.wait()
            output.copy_(scratch[self.rank * n:(self.rank + 1) * n])
        result = Handle(None, take_chunk)
        if not async_op:  # a synchronous call returns with the output written
            result.wait()
        return result

    def _reduce_scatter_p2p(self, output: torch.Tensor, input: torch.Tensor, op: str) -> Handle:
        """Reduce-scatter as N-1 sends of the other ranks' chunks and N-1 receives of ours; the
        sum is taken in rank order, on every rank the same. Always asynchronous underneath (the
        messages progress in gloo's threads); ``wait`` adds. ``output`` may alias our chunk."""
        n, me, world = output.numel(), self.rank, self.world_size
        chunks = input.view(-1).split(n)
        mine = chunks[me]
        received = {r: host_pool.empty(n, output.dtype, output.device)
                    for r in range(world) if r != me}
        tag = self._next_p2p_tag()
        works = []
        for step in range(1, world):  # staggered so that no rank is everyone's first peer
            to, frm = (me + step) % world, (me - step) % world
            works.append(dist.isend(chunks[to], self._global(to), group=self.group, tag=tag))
            works.append(dist.irecv(received[frm], self._global(frm), group=self.group,
                                    tag=tag))

        def add():
            if me == 0:
                acc = output
                if output.data_ptr() != mine.data_ptr():
                    output.copy_(mine)
            else:
                acc = received[0]
            for r in range(1, world):
                acc.add_(mine if r == me else received[r])
            if acc is not output:
                output.copy_(acc)
            if op == "avg":
                output.div_(world)
        return Handle(works, add)

    def _next_p2p_tag(self) -> int:
        self._p2p_tag = (self._p2p_tag + 1) % (1 << 24)
        return self._p2p_tag

    def _all_gather_p2p(self, output: torch.Tensor, input: torch.Tensor) -> Handle:
        """All-gather as N-1 sends of our chunk and N-1 receives straight into the other ranks'
        slots of ``output``. Always asynchronous underneath, like _reduce_scatter_p2p."""
        n, me, world = input.numel(), self.rank, self.world_size
        slots = output.view(-1).split(n)
        if slots[me].data_ptr() != input.data_ptr():
            slots[me].copy_(input.view(-1))
        tag = self._next_p2p_tag()
        works = []
        for step in range(1, world):  # staggered so that no rank is everyone's first peer
            to, frm = (me + step) % world, (me - step) % world
            works.append(dist.isend(slots[me], self._global(to), group=self.group, tag=tag))
            works.append(dist.irecv(slots[frm], self._global(frm), group=self.group, tag=tag))
        return Handle(works)

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
                   role: StreamRole = GATHER, what="") -> Handle:
        """output[r*n:(r+1)*n] <- input of rank r. ``input`` may alias its own slot in output.
        ``role``: where an asynchronous gather runs (stage 3's prefetches: PREFETCH)."""
        if self.world_size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Handle()
        return self._issue("all_gather", what, role, [output, input], async_op,
                           lambda a: self._all_gather_any(output, input, a))

    def _all_gather_any(self, output: torch.Tensor, input: torch.Tensor,
                        async_op: bool, kind: str = "all_gather") -> Handle:
        self._count(kind, output.numel() * output.element_size(), 1.0)
        if self._p2p_all_gather and output.is_contiguous() and input.is_contiguous() \
                and output.numel() == input.numel() * self.world_size:
            handle = self._all_gather_p2p(output, input)
            if not async_op:
                handle.wait()
            return handle
        if self._all_gather is not None:
            try:
                return Handle(self._all_gather(output, input, group=self.group,
                                               async_op=async_op))
            except (RuntimeError, ValueError):
                self._all_gather = None
        outputs = list(output.chunk(self.world_size))
        return Handle(dist.all_gather(outputs, input.clone(), group=self.group,
                                      async_op=async_op))

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                   input_splits: list[int], what="") -> None:
        """Rank r sends input's r'-th split (``input_splits[r']`` elements, in rank order) to
        every rank r' and receives rank r''s split for it into output's r'-th split
        (``output_splits``). Synchronous; counted as sent/received off-rank bytes (kind
        "all_to_all"). NCCL needs device tensors: host ones travel through the device."""
        if self.world_size == 1:
            if output.numel():
                output.copy_(input)
            return
        size = input.element_size()
        entry = self._bytes["all_to_all"]
        entry[0] += (sum(input_splits) - input_splits[self.rank]) * size
        entry[1] += (sum(output_splits) - output_splits[self.rank]) * size
        entry[2] += 1
        staged = self.backend == "nccl" and input.device.type == "cpu"
        send = input.cuda() if staged else input
        recv = torch.empty(output.numel(), dtype=output.dtype, device=send.device) \
            if staged else output
        self._issue("all_to_all", what, None, [recv, send], False, lambda _: Handle(
            dist.all_to_all_single(recv, send, output_splits, input_splits, group=self.group)))
        if staged:
            output.copy_(recv)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, what="") -> None:
        if self.world_size == 1:
            return
        self._count("broadcast", tensor.numel() * tensor.element_size(), 1.0)
        self._issue("broadcast", what, None, [tensor], False, lambda _: Handle(
            dist.broadcast(tensor, src=src, group=self.group)))

    def broadcast_many(self, tensors: list[torch.Tensor], src: int = 0, what="",
                       max_numel: int = 1 << 22) -> None:
        """Rank ``src``'s values of ``tensors`` to every rank, as a few large broadcasts per
        dtype (flattened into batches of at most ``max_numel`` elements)."""
        if self.world_size == 1:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for same in by_dtype.values():
            batch: list[torch.Tensor] = []
            for t in same + [None]:
                if t is None or (batch and sum(b.numel() for b in batch) + t.numel() > max_numel):
                    offsets = [0]
                    for b in batch:
                        offsets.append(offsets[-1] + b.numel())
                    flat = torch.empty(offsets[-1], dtype=batch[0].dtype, device=batch[0].device)
                    flatten_into(batch, flat, offsets[:-1])
                    self.broadcast(flat, src, what=what)
                    unflatten_from(flat, batch, offsets[:-1])
                    batch = []
                if t is not None:
                    batch.append(t)

    def open_check_group(self) -> None:
        """Collective: a second (gloo, host-side) group for ``gather_ints``. Checks on the
        model's own group would queue behind its asynchronous collectives (a prefetch, a
        gradient bucket) and wait for them, which undoes the overlap; on GPUs they would also
        synchronise the host with the device."""
        if self.world_size == 1 or self._check_group is not None:
            return
        self._check_group = self._gloo_group_of_same_ranks()

    def _gloo_group_of_same_ranks(self):
        ranks = None if self.group is None else dist.get_process_group_ranks(self.group)
        kwargs = {}
        if self.timeout_s is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=self.timeout_s)
        return dist.new_group(ranks=ranks, backend="gloo", **kwargs)

    def host_side_twin(self) -> "Comm":
        """Collective: a Comm over a new gloo group of the same ranks, for host-side exchanges
        that must not queue behind this group's collectives (the checkpoint protocol's reports
        from a background writer)."""
        if self.world_size == 1:
            return self
        return Comm(self._gloo_group_of_same_ranks(), self.timeout_s)

    def gather_ints(self, values: list[int], what="", async_op: bool = False):
        """Every rank's ``values`` (same length everywhere) over the check group
        (``open_check_group``, else the model's group): a tiny host-side all-gather for
        cross-rank checks, counted apart from the model's traffic (kind "rank_check").
        Returns the rows, or with ``async_op`` a callable that waits and returns them."""
        if self.world_size == 1:
            return (lambda: [list(values)]) if async_op else [list(values)]
        group = self._check_group or self.group
        mine = torch.tensor(values, dtype=torch.int64)
        out = torch.empty(self.world_size * len(values), dtype=torch.int64)
        self._count("rank_check", out.numel() * out.element_size(), 1.0)
        handle = self._issue("rank_check", what, None, [out, mine], False, lambda _: Handle(
            dist.all_gather(list(out.chunk(self.world_size)), mine, group=group,
                            async_op=async_op)))

        def rows() -> list[list[int]]:
            handle.wait()
            return out.view(self.world_size, len(values)).tolist()
        return rows if async_op else rows()

    def all_gather_object(self, obj) -> list:
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        self._issue("all_gather_object", "", None, [], False, lambda _: Handle(
            dist.all_gather_object(out, obj, group=self.group)))
        return out

    def barrier(self, what="") -> None:
        if self.world_size > 1:
            self._issue("barrier", what, None, [], False,
                        lambda _: Handle(dist.barrier(group=self.group)))
