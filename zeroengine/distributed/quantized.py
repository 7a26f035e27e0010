"""ZeRO++'s quantized collectives (qwZ's int8 all-gather, qgZ's int8 reduce-scatter, one hop
or two): blockwise int8 + fp32 scales on the wire (the format: ops/quantize.py), issued through
the plain collectives and the accounting of the ``Comm`` they are mixed into."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..handles import GATHER, REDUCE, Handle, StreamRole
from ..ops import quantize


class QuantizedCollectives:
    """Mixed into ``Comm`` (comm.py), whose ``_issue``, ``_count``, ``_all_gather_any``,
    ``reduce_scatter``, ``rank``, ``world_size`` and ``group`` these use."""

    def all_gather_quantized(self, output: torch.Tensor, input: torch.Tensor, block: int,
                             async_op: bool = False, role: StreamRole = GATHER,
                             what="") -> Handle:
        """all_gather with each rank's input sent as blockwise int8 + fp32 scales: every rank
        (the sender too) gets the same dequantized values, each within max|its block| / 254
        of the sent one; ~0.5x the bytes of a bf16 gather, ~0.25x of fp32 (kind
        "all_gather_int8")."""
        if self.world_size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Handle()
        n = input.numel()
        piece = quantize.piece_bytes(n, block)
        send = torch.empty(piece, dtype=torch.uint8, device=input.device)
        recv = torch.empty(piece * self.world_size, dtype=torch.uint8, device=input.device)

        def issue(a: bool) -> Handle:
            quantize.pack(input, block, send)
            return self._all_gather_any(recv, send, a, kind="all_gather_int8")

        def unpack() -> None:
            rows = recv.view(self.world_size, piece)
            for r in range(self.world_size):
                quantize.unpack(rows[r], n, block, output[r * n:(r + 1) * n])

        handle = self._issue("all_gather_int8", what, role, [output, input, send, recv],
                             async_op, issue).then(unpack)
        if not async_op:
            handle.wait()
        return handle

    def reduce_scatter_quantized(self, output: torch.Tensor, input: torch.Tensor, block: int,
                                 op: str = "avg", async_op: bool = False, what="") -> Handle:
        """reduce_scatter with every chunk sent to its owner as blockwise int8 + fp32 scales
        (one all-to-all): the owner sums its own chunk exactly and the others' dequantized, in
        fp32. Each sender's part is off by at most max|its block| / 254 per element, so the
        mean is off by at most the mean of those bounds over the senders (kind
        "reduce_scatter_int8")."""
        if self.world_size == 1:
            return self.reduce_scatter(output, input, op, async_op, what=what)
        n = output.numel()
        chunks = [input[r * n:(r + 1) * n] for r in range(self.world_size)]
        total = torch.empty(n, dtype=torch.float32, device=input.device)
        handle = self._exchange_quantized(chunks, total, chunks[self.rank], block, what,
                                          async_op).then(self._mean_into(output, total, op))
        if not async_op:
            handle.wait()
        return handle

    def _mean_into(self, output: torch.Tensor, total: torch.Tensor, op: str):
        def finish() -> None:
            if op == "avg":
                total.div_(self.world_size)
            output.copy_(total)
        return finish

    def reduce_scatter_quantized_2hop(self, output: torch.Tensor, input: torch.Tensor,
                                      block: int, node: QuantizedCollectives,
                                      across: QuantizedCollectives,
                                      op: str = "avg", async_op: bool = False,
                                      what="") -> Handle:
        """reduce_scatter over this group laid out as ``across.world_size`` nodes of
        ``node.world_size`` consecutive ranks, int8 on both hops (ZeRO++ qgZ's hierarchy):
        inside the node each rank collects, from its node peers, the partial sums of the
        chunks owned by the ranks with its own local index on every node (int8 all-to-all,
        run now: node links are fast), then sends each such partial sum to its owner across
        the nodes (int8 all-to-all, asynchronous). Per node, about a quarter of an fp32
        ring's bytes cross nodes (half of bf16's), where a one-hop all-to-all would send K
        times that. Error: two quantizations, each within max|block| / 254 of its input."""
        K, M, n = node.world_size, across.world_size, output.numel()
        if K * M != self.world_size or node.world_size == 1 or across.world_size == 1:
            return self.reduce_scatter_quantized(output, input, block, op, async_op, what)
        local, me = node.rank, across.rank
        chunks = input.view(M, K, n)  # chunk of global rank m*K + l at [m, l]
        partial = torch.empty(M * n, dtype=torch.float32, device=input.device)
        # hop 1 (inside the node): partial[m] = sum over the node of chunk (m, local)
        for_peer = [chunks[:, peer].reshape(-1) for peer in range(K)]
        node._exchange_quantized(for_peer, partial, for_peer[local], block, what).wait()
        # hop 2 (across nodes): my chunk = sum over nodes of their partial[me]
        rows = [partial[m * n:(m + 1) * n] for m in range(M)]
        total = torch.empty(n, dtype=torch.float32, device=input.device)
        handle = across._exchange_quantized(rows, total, rows[me], block, what,
                                            async_op=async_op).then(
            self._mean_into(output, total, op))
        if not async_op:
            handle.wait()
        return handle

    def _exchange_quantized(self, for_rank: list[torch.Tensor], out: torch.Tensor,
                            own: torch.Tensor, block: int, what, async_op: bool = False
                            ) -> Handle:
        """All-to-all of int8: rank r gets ``for_rank[r]`` of every rank; ``out`` (fp32) =
        ``own`` exactly + the others' dequantized, once the returned handle is waited for.
        Counted as "reduce_scatter_int8"."""
        world, n = self.world_size, own.numel()
        piece = quantize.piece_bytes(n, block)
        send = torch.empty(piece * world, dtype=torch.uint8, device=own.device)
        recv = torch.empty_like(send)
        rows_out, rows_in = send.view(world, piece), recv.view(world, piece)

        def issue(a: bool) -> Handle:
            for r in range(world):
                if r != self.rank:
                    quantize.pack(for_rank[r], block, rows_out[r])
            self._count("reduce_scatter_int8", send.numel(), 1.0)
            return Handle(dist.all_to_all_single(recv, send, group=self.group, async_op=a))

        def combine() -> None:
            out.copy_(own)
            for r in range(world):
                if r != self.rank:
                    quantize.unpack(rows_in[r], n, block, out, accumulate=True)
        return self._issue("reduce_scatter_int8", what, REDUCE, [out, own, send, recv],
                           async_op, issue).then(combine)
