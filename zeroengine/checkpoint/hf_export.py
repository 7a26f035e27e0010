"""``engine.save_pretrained(dir)``: a live engine's weights in the Hugging Face layout, streamed.

Every rank computes the same plan from the model's ``state_dict()`` names: the files
(``max_shard_size`` each, in name order, as save_pretrained packs them) and which rank writes
which (file k: rank k mod world). Then, tensor by tensor in that order, all ranks move each
parameter's fp32 master to the rank writing its file - a broadcast of each piece from the rank
that holds it, so no rank holds more than one tensor it does not write - and the writer casts
it to ``dtype`` and keeps it until its file is complete; the file is written by a thread while
the ranks go on with the next ones. So a rank holds about one output file (two while the
previous one is being written), and W ranks write W files at a time.
"""
from __future__ import annotations

import os
import threading

import torch

from ..core.compiled import uncompiled
from . import format as fmt
from .hf_layout import INDEX, file_names, parse_dtype, parse_size, write_index


class _Writer:
    """One file write at a time, in a thread: the rank goes on gathering meanwhile."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def write(self, tensors: dict, path: str) -> None:
        self.wait()

        def run():
            try:
                from safetensors.torch import save_file
                save_file(tensors, path + ".tmp", metadata={"format": "pt"})
                fmt.fsync_file(path + ".tmp")
                os.replace(path + ".tmp", path)
            except BaseException as e:  # raised in the rank by wait()
                self._error = e
        self._thread = threading.Thread(target=run, name="save_pretrained-writer", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """The write under way finished; its error, if any, raised here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def plan_files(sizes: list[tuple[str, int]], limit: int) -> list[list[str]]:
    """Names packed in order into files of at most ``limit`` bytes (a tensor larger than
    that gets a file of its own), as transformers' save_pretrained packs them."""
    files, current, used = [], [], 0
    for name, nbytes in sizes:
        if current and used + nbytes > limit:
            files.append(current)
            current, used = [], 0
        current.append(name)
        used += nbytes
    if current or not files:
        files.append(current)
    return files


def save_pretrained(engine, save_dir: str, max_shard_size="5GB", dtype=None) -> list[str]:
    """Collective. Returns the files this rank wrote (rank 0: also the index and config)."""
    dtype = parse_dtype(dtype) or engine.precision.compute
    limit = parse_size(max_shard_size)
    if engine.optimizer.swap is not None:
        raise NotImplementedError(
            "save_pretrained with the optimizer state on NVMe (offload_optimizer.device "
            "'nvme') is not streamed yet: save_checkpoint(dir), then `zeroengine consolidate "
            "dir out/ --max-shard-size ... --dtype ...` writes the same layout")
    shard = engine.topology.shard
    if shard.world_size not in (1, engine.comm.world_size):
        raise NotImplementedError(
            "save_pretrained under hybrid sharding (zero_hpz / mics groups) is not streamed "
            "yet: save_checkpoint(dir), then `zeroengine consolidate dir out/`")
    module = uncompiled(engine.module)
    state = module.state_dict(keep_vars=True)
    where = {id(p): (fg, i) for fg in engine.flat_groups for i, p in enumerate(fg.params)}
    pieces = _pieces_by_param(engine.flat_groups)
    itemsize = torch.empty(0, dtype=dtype).element_size()

    def out_dtype(t: torch.Tensor) -> torch.dtype:
        return dtype if t.is_floating_point() else t.dtype

    sizes = [(name, t.numel() * (itemsize if t.is_floating_point() else t.element_size()))
             for name, t in state.items()]
    files = plan_files(sizes, limit)
    count = len(files)
    names = file_names(count)
    rank, world = engine.comm.rank, engine.comm.world_size
    os.makedirs(save_dir, exist_ok=True)
    writer, written = _Writer(), []
    for k, keys in enumerate(files):
        mine = k % world == rank
        tensors = {}
        for name in keys:
            t = state[name]
            value = _gather_master(shard, where[id(t)], rank, pieces) if id(t) in where \
                else t.detach().to("cpu")
            if mine:  # a tensor of its own (safetensors writes whole storages)
                value = value.to(out_dtype(t))
                if not value.is_contiguous() or value.untyped_storage().nbytes() != \
                        value.numel() * value.element_size():
                    value = value.contiguous().clone()
                tensors[name] = value
        if mine:
            path = os.path.join(save_dir, names[k])
            writer.write(tensors, path)
            written.append(path)
    writer.wait()
    engine.comm.barrier()  # every file is on disk before the index names them
    if rank == 0:
        total = sum(n for _, n in sizes)
        if count > 1:
            written.append(write_index(save_dir, total, {name: names[k] for k, keys
                                                         in enumerate(files) for name in keys}))
        else:
            stale = os.path.join(save_dir, INDEX)  # an earlier sharded export here
            if os.path.exists(stale):
                os.remove(stale)
        written += _save_configs(module, save_dir, dtype)
    engine.comm.barrier()
    return written


def _pieces_by_param(groups) -> dict[tuple[int, int], list]:
    """(id(group), parameter index) -> [(owner rank, piece)] for every sharded group, computed
    once per save (shard_pieces walks the whole layout)."""
    found: dict[tuple[int, int], list] = {}
    for fg in groups:
        if fg.sharded:
            for owner in range(fg.layout.world_size):
                for piece in fg.layout.shard_pieces(owner):
                    found.setdefault((id(fg), piece.param), []).append((owner, piece))
    return found


def _gather_master(shard, located, rank: int, pieces: dict) -> torch.Tensor:
    """One managed parameter's whole fp32 master, on every rank: each piece broadcast from
    the rank holding it (collective, in the same order on every rank)."""
    fg, i = located
    slot = fg.layout.slots[i]
    seg = fg.layout.segments[slot.segment]
    master = fg.master_segments[slot.segment]
    full = torch.empty(slot.numel, dtype=torch.float32, device=fg.device)
    if not fg.sharded:
        full.copy_(master[seg.local(slot)].reshape(-1))
        return full.cpu().view(slot.shape)
    for owner, piece in pieces[(id(fg), i)]:
        out = full[piece.param_offset:piece.param_offset + piece.numel]  # contiguous
        if owner == rank:
            local = piece.shard_offset - seg.shard_offset
            out.copy_(master[local:local + piece.numel])
        shard.broadcast(out, src=owner, what=lambda: "save_pretrained")
    return full.cpu().view(slot.shape)


def _save_configs(module, save_dir: str, dtype: torch.dtype) -> list[str]:
    """The model's config.json (and generation_config.json) when it is a transformers model,
    with the dtype the weights were written in."""
    written = []
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config = config.__class__.from_dict(config.to_dict())  # the model's own is left as is
        for attr in ("dtype", "torch_dtype"):
            if hasattr(config, attr):
                try:
                    setattr(config, attr, dtype)
                except Exception:
                    pass
        config.save_pretrained(save_dir)
        written.append(os.path.join(save_dir, "config.json"))
    generation = getattr(module, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        try:
            generation.save_pretrained(save_dir)
            written.append(os.path.join(save_dir, "generation_config.json"))
        except Exception as e:  # a generation config transformers itself would refuse
            import warnings
            warnings.warn(f"save_pretrained: generation_config not written ({e})", stacklevel=3)
    return written
