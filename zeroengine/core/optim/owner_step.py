"""The step of a tensor-wise optimizer (optim/kind.py): each parameter whole, on its owner.

Gradients are reduced and master weights kept in the flat layout's chunks, as for every group
(so reduction, clipping, overflow checks, checkpoints and stage 3 are unchanged). For a
tensor-wise group, a step then

  1. gathers each owned parameter's fp32 master and reduced gradient from the chunks that hold
     its pieces into two transient flat buffers on its owner (one all-to-all each; pieces
     already in the owner's own chunk are copied locally),
  2. runs the user's optimizer class over *whole-shaped views* of those buffers (the views
     are the inner optimizer's parameters, so its state - Muon's momentum, Adafactor's row and
     column factors - is kept per parameter, on the owner only),
  3. sends the updated values back to the chunks (one all-to-all), after which the usual
     publish runs (mixed precision copy, stage 1-2 all-gather).

Communication added per step, per rank, for a group of P elements over N ranks: the pieces of
the rank's chunk owned elsewhere, about (N-1)/N^2 * P elements, sent three times (gradient in
the reduce dtype; master there and back in fp32). See docs/optimizers.md for it against the ZeRO
volumes. Memory: the state of ~P/N elements (owner_partition.py), plus 2 x owned x 4 bytes
alive only during the step.
"""
from __future__ import annotations

import torch

from ...distributed.comm import Comm
from ..layout.flat_param_group import FlatParamGroup
from ..layout.partition import ShardPiece
from .owner_partition import OwnerPartition


class OwnedParams:
    """One tensor-wise flat group's parameters as its owners step them."""

    def __init__(self, fg: FlatParamGroup, comm: Comm):
        self.fg, self.comm = fg, comm
        self.partition = OwnerPartition.of_layout(fg.layout)
        self.me = fg.rank
        numel = self.partition.owned_numel[self.me]
        device = fg.master_device
        self.values = torch.empty(numel, dtype=torch.float32, device=device)
        self.grads = torch.empty(numel, dtype=torch.float32, device=device)
        self._offset = self.partition.owned_offset(self.me)
        # Whole-shaped views: the inner optimizer's parameters. Their storage is the buffers',
        # emptied between steps (``release``) and refilled by ``acquire``; the views, and the
        # optimizer state keyed by them, persist.
        self.params: list[torch.Tensor] = []
        self._grad_views: list[torch.Tensor] = []
        self.names: list[int] = []  # parameter index (into fg.params) of each view
        for i, offset in self.partition.owned[self.me]:
            slot = fg.layout.slots[i]
            self.params.append(self.values[offset:offset + slot.numel].view(slot.shape))
            self._grad_views.append(self.grads[offset:offset + slot.numel].view(slot.shape))
            self.names.append(i)
        self.release()

    # -- transient storage -----------------------------------------------------------------------
    def acquire(self) -> None:
        for buf in (self.values, self.grads):
            buf.untyped_storage().resize_(buf.numel() * buf.element_size())

    def release(self) -> None:
        for p in self.params:
            p.grad = None
        for buf in (self.values, self.grads):
            buf.untyped_storage().resize_(0)

    # -- chunks <-> owners -------------------------------------------------------------------------
    def _in_chunk(self, chunks: list[torch.Tensor], piece: ShardPiece) -> torch.Tensor:
        seg_index = self.fg.layout.slots[piece.param].segment
        begin = piece.shard_offset - self.fg.layout.segments[seg_index].shard_offset
        return chunks[seg_index][begin:begin + piece.numel]

    def _in_owned(self, buf: torch.Tensor, piece: ShardPiece) -> torch.Tensor:
        begin = self._offset[piece.param] + piece.param_offset
        return buf[begin:begin + piece.numel]

    def _exchange(self, outgoing, incoming, read, write, dtype, device, what) -> None:
        """One all-to-all: ``outgoing[r]`` pieces read with ``read(piece)`` go to rank r,
        ``incoming[r]`` pieces arrive from rank r and are stored with ``write(piece, values)``."""
        flat = [p for pieces in outgoing for p in pieces]
        send = torch.cat([read(p) for p in flat]) if flat else \
            torch.empty(0, dtype=dtype, device=device)
        recv = torch.empty(sum(p.numel for pieces in incoming for p in pieces), dtype=send.dtype,
                           device=send.device)
        self.comm.all_to_all(recv, send, [sum(p.numel for p in ps) for ps in incoming],
                             [sum(p.numel for p in ps) for ps in outgoing],
                             what=lambda: f"{what} (param group {self.fg.group_index})")
        cursor = 0
        for pieces in incoming:
            for p in pieces:
                write(p, recv[cursor:cursor + p.numel])
                cursor += p.numel

    def gather(self, chunks: list[torch.Tensor], into: torch.Tensor, what: str) -> None:
        """``into`` (an owned buffer) <- the values of ``chunks`` (this rank's chunk of every
        segment, any dtype) for every parameter this rank owns. Collective over the group's
        ranks."""
        part, me = self.partition, self.me
        for piece in part.local[me]:
            self._in_owned(into, piece).copy_(self._in_chunk(chunks, piece))
        if part.world_size > 1:
            ranks = range(part.world_size)
            self._exchange([part.sends[me][o] for o in ranks], [part.sends[h][me] for h in ranks],
                           lambda p: self._in_chunk(chunks, p),
                           lambda p, v: self._in_owned(into, p).copy_(v),
                           chunks[0].dtype if chunks else torch.float32, into.device,
                           f"{what} to their owners")

    def scatter(self, source: torch.Tensor, chunks: list[torch.Tensor], what: str) -> None:
        """The inverse of ``gather``: ``chunks`` <- the owners' values in ``source``."""
        part, me = self.partition, self.me
        for piece in part.local[me]:
            self._in_chunk(chunks, piece).copy_(self._in_owned(source, piece))
        if part.world_size > 1:
            ranks = range(part.world_size)
            self._exchange([part.sends[h][me] for h in ranks], [part.sends[me][o] for o in ranks],
                           lambda p: self._in_owned(source, p),
                           lambda p, v: self._in_chunk(chunks, p).copy_(v),
                           source.dtype, source.device, f"{what} back from their owners")

    def step(self, optimizer: torch.optim.Optimizer, masters: list[torch.Tensor],
             grads: list[torch.Tensor], coef: float) -> None:
        """One step of ``optimizer`` (built over ``self.params``) for the whole group: masters
        and gradients in, updated masters back into ``masters``."""
        self.acquire()
        try:
            self.gather(masters, self.values, "master weights")
            self.gather(grads, self.grads, "reduced gradients")
            if coef != 1.0:
                self.grads.mul_(coef)
            for p, g in zip(self.params, self._grad_views):
                p.grad = g
            optimizer.step()
            self.scatter(self.values, masters, "updated master weights")
        finally:
            self.release()
