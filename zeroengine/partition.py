"""The trainable parameters of one (optimizer param group, dtype), re-laid into a flat buffer.

After construction every parameter's ``.data`` is a view into ``self.data``, so the model keeps
working unchanged while the engine moves whole segments at once. The rank's *master* view is
what its optimizer updates: its chunk of every segment. In fp32 that is the parameter memory
itself (no copy); for a lower-precision compute dtype it is a separate fp32 shard.
"""
from __future__ import annotations

import torch

from .flat import FlatBuffer, FlatLayout, shard_segment_views
from .ops import flatten_into


class FlatParamGroup:
    def __init__(self, params: list[torch.nn.Parameter], group_index: int, rank: int,
                 shard_world: int, bucket_numel: int, device: torch.device, align: int = 16,
                 compute_dtype: torch.dtype | None = None):
        """``shard_world`` is the number of owners: the world size, or 1 at stage 0.
        ``compute_dtype``: the dtype the model computes in (default: the params' own)."""
        self.params = params
        self.group_index = group_index
        self.rank = rank if shard_world > 1 else 0
        self.dtype = compute_dtype or params[0].dtype
        self.layout = FlatLayout([p.shape for p in params], shard_world, bucket_numel, align)
        if self.dtype == torch.float32:
            self.master = None  # the parameters themselves are the fp32 master
        else:
            # Taken from the parameters *before* they are cast to the compute dtype, so the
            # master keeps every bit of the initial fp32 values.
            self.master = torch.zeros(self.layout.shard_numel, dtype=torch.float32,
                                      device=device)
            for piece in self.layout.shard_pieces(self.rank):
                source = params[piece.param].detach().reshape(-1)
                self.master[piece.shard_offset:piece.shard_offset + piece.numel].copy_(
                    source[piece.param_offset:piece.param_offset + piece.numel])
        self.buffer = FlatBuffer(self.layout, self.dtype, device)
        flatten_into([p.detach() for p in params], self.buffer.data,
                     [s.offset for s in self.layout.slots])
        for i, p in enumerate(params):
            p.data = self.buffer.param_view(i)
        if self.master is None:
            self.master_segments = [self.buffer.chunk_view(s, self.rank)
                                    for s in range(len(self.layout.segments))]
        else:
            self.master_segments = shard_segment_views(self.master, self.layout)

    @property
    def data(self) -> torch.Tensor:
        return self.buffer.data

    @property
    def sharded(self) -> bool:
        return self.layout.world_size > 1

    def publish_master(self, segments=None) -> None:
        """Copy updated master values into the compute-dtype parameter chunks (mixed precision)."""
        if self.master is not None:
            for s in (range(len(self.master_segments)) if segments is None else segments):
                self.buffer.chunk_view(s, self.rank).copy_(self.master_segments[s])

    def full_fp32(self, comm) -> torch.Tensor:
        """The whole flat buffer in fp32, gathered from every rank's master (collective)."""
        full = torch.empty(self.layout.numel, dtype=torch.float32, device=self.data.device)
        for s, seg in enumerate(self.layout.segments):
            out = full[seg.start:seg.start + seg.numel]
            if self.sharded:
                comm.all_gather(out, self.master_segments[s].float())
            else:
                out.copy_(self.master_segments[s])
        return full

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def master_nbytes(self) -> int:
        return 0 if self.master is None else self.master.numel() * 4
