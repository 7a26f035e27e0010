"""The trainable parameters of one (optimizer param group, dtype), re-laid into a flat buffer.

Two modes:
- whole (stages 0-2, and stage-3 parameters below the persistence threshold): ``self.full``
  holds every element; each parameter's ``.data`` is a view into it, so the model runs unchanged.
- partitioned (stage 3): ``self.shard`` holds only this rank's chunks; each parameter is a view
  into its segment's full tensor, whose storage is empty until the ParamFetcher
  (param_fetcher.py) gathers the segment for a module that needs it.

The rank's *master* chunks are what its optimizer updates. In fp32 they are the parameter memory
itself (no copy); for a lower-precision compute dtype they are a separate fp32 shard, taken from
the parameters before they were cast so the master keeps every bit of the initial values.

Offload (see optimizer_offload.py) only moves tensors: ``offload_master`` puts the fp32 master
in host memory (then always a separate copy, even in fp32, so the CPU-only machine runs the
same code path as a GPU one), ``offload_shard`` puts stage 3's partitioned shard there; ``pin``
makes those host tensors page-locked. NVMe offload (optimizer_swap.py) then takes the master
to the drive: ``swap`` is set, the master chunks are empty except while their tile is in host
memory, and every method here that reads or writes them brings them in a tile at a time
(``resident_masters``). With ``offload_param.device: "nvme"`` (param_swap.py) the partitioned
shard is on the drive too: ``chunk`` reads a segment's chunk through the swap's cache, and
whatever changes one goes through ``set_chunk`` (or ``chunk_for_overwrite`` + ``chunk_written``).
"""
from __future__ import annotations

import torch

from ...ops import host_pool
from ..optim.precision import FP32_MASTER, LOW_MASTER, REMAINDER_MASTER
from .master_bits import join_master, split_master
from .partition import FlatBuffer, FlatLayout, shard_segment_views


class FlatParamGroup:
    def __init__(self, params: list[torch.nn.Parameter], group_index: int, rank: int,
                 shard_world: int, bucket_numel: int, device: torch.device, align: int = 16,
                 compute_dtype: torch.dtype | None = None, partitioned: bool = False,
                 units: list[int] | None = None, value_of=None,
                 offload_master: bool = False, offload_shard: bool = False, pin: bool = False,
                 master_sink=None, param_sink=None, master_format: str = FP32_MASTER):
        """``shard_world``: the number of owners (the world size, or 1 at stage 0).
        ``compute_dtype``: the dtype the model computes in (default: the params' own).
        ``units``: stage 3's fetch unit per parameter; segments follow unit boundaries.
        ``value_of(p)``: a parameter's full value (default ``p.detach()``); called for every
        parameter in order on every rank, so it may be a collective (zero_init). It may
        instead return a reader ``(param_offset, numel, out=None) -> values`` that gives
        only the pieces this rank keeps (weights read from files: deferred_params.py), into
        ``out`` where it can.
        ``offload_master`` / ``offload_shard``: keep the fp32 master / the partitioned shard in
        host memory. ``master_sink`` (an OptimizerSwap; with ``offload_master``): the master
        goes to the drive a segment at a time instead, never whole in memory. ``param_sink`` (a
        ParamSwap; partitioned): the same for the parameter shard (the master is then always a
        separate copy)."""
        self.params = params
        self.group_index = group_index
        self.rank = rank if shard_world > 1 else 0
        self.dtype = compute_dtype or params[0].dtype
        self.device = device
        self.partitioned = partitioned
        self.layout = FlatLayout([p.shape for p in params], shard_world, bucket_numel, align,
                                 units)
        self.full: FlatBuffer | None = None
        self.shard: torch.Tensor | None = None
        self.segment_full: list[torch.Tensor] = []
        self.offload_master = offload_master
        self.offload_shard = offload_shard and partitioned
        host = torch.device("cpu")
        self.master_device = host if offload_master else device
        self.shard_device = host if self.offload_shard else device
        param_sink = param_sink if partitioned else None
        self.master_format = master_format
        if master_format != FP32_MASTER and (param_sink is not None or master_sink is not None):
            raise ValueError("bf16/fp16 masters and remainders are not kept on NVMe")
        # fp32 compute on the device: the parameters (or their shard) are the master, no copy
        # - unless the shard lives on the drive, where the optimizer cannot step it in place.
        # A low-precision master likewise is the parameters themselves, unless offloaded.
        low_master = master_format != FP32_MASTER
        separate_master = (self.dtype != torch.float32 and not low_master) or \
            offload_master or param_sink is not None
        self.master_dtype = self.dtype if master_format == LOW_MASTER else torch.float32
        sink = master_sink if separate_master and offload_master else None
        # remainders: the fp32 values are needed once, to take their low halves
        first_values = separate_master or master_format == REMAINDER_MASTER
        wanted = ([(torch.float32, self.master_device)] if first_values and not sink
                  else []) + ([(self.dtype, self.shard_device)]
                              if partitioned and param_sink is None else [])
        numels = [seg.chunk_numel for seg in self.layout.segments]
        sinks = []  # (sink, this group's index there, dtype it takes)
        if sink is not None:
            sinks.append((sink, sink.reserve(numels), torch.float32))
        self.param_swap, self.param_index = param_sink, None
        if param_sink is not None:
            self.param_index = param_sink.reserve(numels, self.dtype)
            sinks.append((param_sink, self.param_index, self.dtype))
        shards = self._shards_of(params, value_of or (lambda p: p.detach()), wanted, pin,
                                 sinks)
        # with a sink: an empty placeholder, still "a separate master" (not None)
        self.master = (shards[0] if sink is None else torch.empty(0)) if separate_master \
            else None
        self.remainder: torch.Tensor | None = None
        if master_format == REMAINDER_MASTER:
            values = shards[0]
            self.remainder = torch.empty(values.numel(), dtype=torch.int16,
                                         device=self.master_device)
            split_master(values, None, self.remainder)
            # the master's upper halves: the host weights (offload) or the chunks (below)
            self.master = values.to(self.dtype) if separate_master else None
            shards = shards[1:]
            del values
        elif master_format == LOW_MASTER and self.master is not None:
            self.master = self.master.to(self.dtype)  # offloaded: the host copy, low precision
        if partitioned:
            self.shard = shards[-1] if param_sink is None else \
                torch.empty(0, dtype=self.dtype)  # on the drive: chunk() reads it
            # One full-size tensor per segment whose *storage* is emptied when released and
            # refilled when gathered; parameters stay views into it, so tensors autograd saved
            # (even views such as weight.t()) are valid again once the segment is re-gathered.
            self.segment_full = []
            for seg in self.layout.segments:
                full = host_pool.empty(seg.numel, self.dtype, device)
                for i in seg.params:
                    slot = self.layout.slots[i]
                    params[i].data = full[seg.local(slot)].view(slot.shape)
                full.untyped_storage().resize_(0)
                self.segment_full.append(full)
        else:
            # one parameter at a time: each original is released as soon as it is copied (the
            # buffer's pages are taken as they are written), so the model is not held twice;
            # a parameter still to be read from its files is read straight into its view
            self.full = FlatBuffer(self.layout, self.dtype, device)
            for i, p in enumerate(params):
                view = self.full.param_view(i)
                source = value_of(p) if value_of is not None else p.detach()
                if callable(source):
                    flat = view.view(-1)
                    values = source(0, flat.numel(), flat if flat.device.type == "cpu"
                                    else None)
                    if values.data_ptr() != flat.data_ptr():
                        flat.copy_(values)
                else:
                    view.copy_(source)
                p.data = view
        segments = range(len(self.layout.segments))
        if master_format == REMAINDER_MASTER:  # given storage while resident
            self.master_segments = [_no_storage(seg.chunk_numel, self.master_device)
                                    for seg in self.layout.segments]
            self.remainder_segments = shard_segment_views(self.remainder, self.layout)
        elif self.master is None:
            self.master_segments = [self.chunk(s) for s in segments]
        elif sink is None:
            self.master_segments = shard_segment_views(self.master, self.layout)
        else:  # swapped out: empty until their tile is brought in
            self.master_segments = [torch.empty(0) for _ in segments]
        self.swap = sink  # an OptimizerSwap when the master lives on the drive

    def _shards_of(self, params, value_of, wanted, pin: bool,
                   sinks=()) -> list[torch.Tensor]:
        """This rank's chunks of ``params``, one shard tensor per (dtype, device) in ``wanted``;
        ``sinks``: (swap, group index, dtype) each also takes them, segment by segment."""
        # Uninitialised, and only the padding zeroed now: the pages of the values are touched
        # as the values arrive, while zero_init's slices are freed one parameter at a time, so
        # the shards and the slices are not both whole in memory at once.
        shards = [torch.empty(self.layout.shard_numel, dtype=d, device=dev,
                              pin_memory=pin and dev.type == "cpu")
                  for d, dev in wanted]
        pieces = self.layout.shard_pieces(self.rank)
        for shard in shards:
            covered = 0
            for piece in sorted(pieces, key=lambda p: p.shard_offset):
                shard[covered:piece.shard_offset].zero_()
                covered = piece.shard_offset + piece.numel
            shard[covered:].zero_()
        if not shards and not sinks:
            return shards
        by_param: dict[int, list] = {}
        for piece in pieces:
            by_param.setdefault(piece.param, []).append(piece)
        segment_of = {i: s for s, seg in enumerate(self.layout.segments) for i in seg.params}
        current, staging = -1, []  # the segment whose chunks the sinks' staging assembles

        def flush():
            for (sink, index, _), values in zip(sinks, staging):
                sink.put(index, current, values)
        for index, p in enumerate(params):  # every parameter, in order, on every rank
            source = value_of(p)
            reader = source if callable(source) else None  # only this rank's pieces
            if reader is None:
                source = source.reshape(-1)
            if sinks and segment_of[index] != current:
                if segment_of[index] < current:  # each segment is written once, whole
                    raise RuntimeError("segments do not follow parameter order (a bug)")
                flush()
                current = segment_of[index]
                seg = self.layout.segments[current]
                staging = [torch.zeros(seg.chunk_numel, dtype=d) for _, _, d in sinks]
            for piece in by_param.get(index, ()):
                if reader is not None:  # read straight into the first shard where it can
                    first = piece.of_shard(shards[0]) \
                        if shards and shards[0].device.type == "cpu" else None
                    values = reader(piece.param_offset, piece.numel, first)
                else:
                    values = source[piece.param_offset:piece.param_offset + piece.numel]
                for shard in shards:
                    target = piece.of_shard(shard)
                    if target.data_ptr() != values.data_ptr():
                        target.copy_(values)
                begin = piece.shard_offset - self.layout.segments[current].shard_offset \
                    if sinks else 0
                for buf in staging:
                    buf[begin:begin + piece.numel].copy_(values)
        flush()
        return shards

    @property
    def sharded(self) -> bool:
        return self.layout.world_size > 1

    def chunk(self, s: int) -> torch.Tensor:
        """This rank's chunk of segment s, in the compute dtype (to read: change it with
        ``set_chunk``, which also reaches a chunk on the drive)."""
        if self.partitioned:
            if self.param_swap is not None:
                return self.param_swap.chunk(self.param_index, s)
            return self.layout.segments[s].of_shard(self.shard)
        return self.full.chunk_view(s, self.rank)

    def chunk_for_overwrite(self, s: int) -> torch.Tensor:
        """Where segment s's new values go, to be filled whole; then ``chunk_written``."""
        if self.param_swap is None:
            return self.chunk(s)
        return self.param_swap.for_overwrite(self.param_index, s)

    def chunk_written(self, s: int, values: torch.Tensor) -> None:
        """``values`` (from ``chunk_for_overwrite``) now holds segment s's chunk."""
        if self.param_swap is not None:
            self.param_swap.written(self.param_index, s, values)

    def set_chunk(self, s: int, values: torch.Tensor) -> None:
        target = self.chunk_for_overwrite(s)
        target.copy_(values)
        self.chunk_written(s, target)

    def chunk_on_device(self, s: int) -> torch.Tensor:
        """``chunk(s)`` on the compute device, copied there if the shard is offloaded."""
        chunk = self.chunk(s)
        return chunk.to(self.device, non_blocking=True)

    def resident_masters(self, segments=None, write_back: bool = False):
        """Yield the segment indices (default: all) with their master chunk in memory: all of
        them at once, or with NVMe offload a tile at a time (``write_back``: the caller
        changes them, so each tile goes back to the drive after)."""
        segments = range(len(self.master_segments)) if segments is None else segments
        if self.remainder is not None:
            for s in segments:
                self.join_masters([s])
                try:
                    yield s
                except GeneratorExit:  # the caller stopped early: nothing to take back
                    self.settle_masters([s], write_back=False)
                    raise
                self.settle_masters([s], write_back)
            return
        if self.swap is None:
            yield from segments
            return
        for resident in self.swap.visit(self, segments, write_back):
            yield from resident

    # -- remainders (REMAINDER_MASTER) -------------------------------------------------------
    def weight_segment(self, s: int) -> torch.Tensor:
        """Remainders: where segment s's upper halves (its bf16 weights) live: the host copy
        with offload, else the model's own chunk."""
        return self.layout.segments[s].of_shard(self.master) if self.master is not None \
            else self.chunk(s)

    def join_masters(self, segments) -> None:
        """Remainders: give the fp32 masters of ``segments`` storage and their exact values."""
        for s in segments:
            master = self.master_segments[s]
            master.untyped_storage().resize_(master.numel() * 4)
            join_master(self.weight_segment(s), self.remainder_segments[s], master)

    def settle_masters(self, segments, write_back: bool) -> None:
        """Remainders: after ``join_masters`` (``write_back``: the fp32 values changed, so
        their bf16 weights and remainders are taken from them), the fp32 storage goes."""
        for s in segments:
            master = self.master_segments[s]
            if write_back:
                split_master(master, self.weight_segment(s), self.remainder_segments[s])
            master.untyped_storage().resize_(0)

    def weights_of_master(self, s: int) -> torch.Tensor | None:
        """Segment s's updated values in the compute dtype where the master holds them
        (low-precision masters, remainders' upper halves), else None (an fp32 master, to be
        rounded when published)."""
        if self.master_format == LOW_MASTER:
            return self.master_segments[s]
        if self.master_format == REMAINDER_MASTER:
            return self.weight_segment(s)
        return None

    def master_to_chunks(self, segments=None) -> None:
        """Copy updated master values into the compute-dtype chunks (mixed precision)."""
        if self.master is None:
            return  # the chunks are the master (fp32, low precision) or hold its upper halves
        if self.master_format == REMAINDER_MASTER:
            for s in (range(len(self.master_segments)) if segments is None else segments):
                self.set_chunk(s, self.weight_segment(s))
            return
        for s in self.resident_masters(segments):
            self.set_chunk(s, self.master_segments[s])

    def refresh_master(self, segments=None) -> None:
        """The inverse: chunks changed from outside (a write-back) become the master's values."""
        if self.master_format == REMAINDER_MASTER:
            for s in (range(len(self.master_segments)) if segments is None else segments):
                if self.master is not None:
                    self.weight_segment(s).copy_(self.chunk(s))
                self.remainder_segments[s].zero_()  # exactly the weight
            return
        if self.master is not None:
            for s in self.resident_masters(segments, write_back=True):
                self.master_segments[s].copy_(self.chunk(s))

    def master_shard(self) -> torch.Tensor:
        """The master values of every element the rank owns (fp32, or the compute dtype for a
        low-precision master), as one contiguous CPU tensor."""
        if self.master is not None and self.swap is None and self.remainder is None:
            return self.master.detach().cpu()
        if self.master is None and self.remainder is None:
            return torch.cat([s.detach().to(self.master_dtype).cpu()
                              for s in self.master_segments])
        out = torch.zeros(self.layout.shard_numel, dtype=torch.float32)
        if self.remainder is not None:  # joined straight into place (the step's way costs a copy)
            for s, seg in enumerate(self.layout.segments):
                join_master(self.weight_segment(s).cpu(), self.remainder_segments[s].cpu(),
                            seg.of_shard(out))
            return out
        for s in self.resident_masters():
            self.layout.segments[s].of_shard(out).copy_(self.master_segments[s])
        return out

    def load_master_shard(self, master: torch.Tensor) -> None:
        """Set the master from a tensor laid out like ``master_shard()``."""
        for s in self.resident_masters(write_back=True):
            self.master_segments[s].copy_(self.layout.segments[s].of_shard(master))

    def full_fp32(self, comm) -> torch.Tensor:
        """The whole flat buffer in fp32, gathered from every rank's master (collective)."""
        full = torch.empty(self.layout.numel, dtype=torch.float32, device=self.device)
        for s in self.resident_masters():
            out = self.layout.segments[s].of_full(full)
            if self.sharded:
                comm.all_gather(out, self.master_segments[s].float())
            else:
                out.copy_(self.master_segments[s])
        return full

    def nbytes(self, host: bool = False) -> int:
        """Parameter bytes this group holds permanently (gathered segments not included) on
        the compute device, or with ``host=True`` offloaded to host memory."""
        data = self.shard if self.partitioned else self.full.data
        offloaded = self.offload_shard
        return data.numel() * data.element_size() if offloaded == host else 0

    def master_nbytes(self, host: bool = False) -> int:
        """Bytes of the master kept beside the parameters (a separate copy, remainders)."""
        if self.offload_master != host:
            return 0
        total = 0 if self.master is None else self.master.numel() * self.master.element_size()
        if self.remainder is not None:
            total += self.remainder.numel() * 2
        return total


def _no_storage(numel: int, device) -> torch.Tensor:
    """An fp32 tensor of ``numel`` elements whose storage is empty until resized."""
    t = torch.empty(numel, dtype=torch.float32, device=device)
    t.untyped_storage().resize_(0)
    return t
