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
import warnings

import torch

from .. import format as fmt
from ..sharded import refuse_unsupported_layouts, unsupported_layout
from .hf_layout import INDEX, file_names, owning, parse_dtype, parse_size, write_index


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
            except BaseException as e:  # noqa: BLE001 - raised in the rank by wait()
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


_INSTEAD = ("save_checkpoint(dir), then `zeroengine consolidate dir out/ --max-shard-size ... "
            "--dtype ...` writes the Hugging Face layout")


def _out_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """What an export writes a state_dict entry as: floating point in ``dtype``, the rest as
    they are (integer buffers)."""
    return dtype if t.is_floating_point() else t.dtype


class _Gatherer:
    """Whole values of the model's state_dict entries, one at a time (collective: every rank
    asks for the same names in the same order; fp32 masters of managed parameters, the
    module's own tensors for buffers and frozen parameters)."""

    def __init__(self, engine):
        self.engine = engine
        self.state = engine.plain_module.state_dict(keep_vars=True)
        self._where = {id(p): (fg, i) for fg in engine.flat_groups
                       for i, p in enumerate(fg.params)}
        self._pieces = _pieces_by_param(engine.flat_groups)

    def value(self, name: str) -> torch.Tensor:
        t = self.state[name]
        if id(t) in self._where:
            return _gather_master(self.engine.topology.shard, self._where[id(t)],
                                  self.engine.comm.rank, self._pieces)
        return t.detach().to("cpu")


def save_pretrained(engine, save_dir: str, max_shard_size="5GB", dtype=None) -> list[str]:
    """Collective. Returns the files this rank wrote (rank 0: also the index and config)."""
    dtype = parse_dtype(dtype) or engine.precision.compute
    limit = parse_size(max_shard_size)
    refuse_unsupported_layouts(engine, "save_pretrained", _INSTEAD)
    gather = _Gatherer(engine)
    state = gather.state
    itemsize = torch.empty(0, dtype=dtype).element_size()
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
            value = gather.value(name)
            if mine:
                tensors[name] = owning(value.to(_out_dtype(state[name], dtype)))
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
        written += _save_configs(engine.plain_module, save_dir, dtype)
    engine.comm.barrier()
    return written


def save_16bit_model(engine, save_dir: str, filename: str = "model.safetensors") -> bool:
    """Collective: DeepSpeed's ``save_16bit_model``, one file written by rank 0 with the whole
    model in the compute dtype (tied parameters under each of their names, so strict
    load_state_dict and from_pretrained accept it), gathered a tensor at a time.

    A ``.safetensors`` name is streamed: the header first, then each tensor written in place
    as it arrives, so no rank holds more than one tensor. Any other name (DeepSpeed's default
    ``pytorch_model.bin``) is a torch.save'd state dict, which pickles the dict whole: rank 0
    holds the model in 16 bits (what DeepSpeed holds), the others one tensor. With the
    optimizer on NVMe or under hybrid sharding, the whole fp32 model is gathered on every rank
    first (not streamed there yet). At stage 3 this needs
    ``stage3_gather_16bit_weights_on_model_save``, as in DeepSpeed: without it nothing is
    written and False is returned."""
    zero = engine.config.zero_optimization
    if engine.sharding.parameters and not zero.stage3_gather_16bit_weights_on_model_save:
        warnings.warn("save_16bit_model at stage 3 needs zero_optimization."
                      "stage3_gather_16bit_weights_on_model_save=true (the weights are sharded); "
                      "nothing was saved. save_pretrained(dir) writes them streamed without it, "
                      "and `zeroengine consolidate` builds them from a checkpoint",
                      stacklevel=3)
        return False
    dtype = engine.precision.compute
    rank0 = engine.comm.rank == 0
    if unsupported_layout(engine) is None:
        gather = _Gatherer(engine)
        state, fetch = gather.state, gather.value
    else:  # NVMe or hybrid sharding: the whole fp32 model on every rank first (collective)
        state = engine.plain_module.state_dict(keep_vars=True)
        fetch = engine.consolidated_state_dict().__getitem__
    values = ((name, fetch(name)) for name in state)
    path = os.path.join(save_dir, filename)
    if rank0:
        os.makedirs(save_dir, exist_ok=True)
    if filename.endswith(".safetensors"):
        specs = [(n, _out_dtype(t, dtype), tuple(t.shape)) for n, t in state.items()]
        out = fmt.StreamedSafetensors(path + ".tmp", specs, metadata={"format": "pt"}) \
            if rank0 else None
        for name, value in values:
            if rank0:
                out.write(name, 0, value)  # cast to the header's dtype there
        if rank0:
            out.close()
    else:
        kept, by_id = {}, {}
        for name, value in values:
            if rank0:  # tied names share one tensor, as in the model's own state_dict
                key = id(state[name])
                if key not in by_id:
                    by_id[key] = value.to(_out_dtype(state[name], dtype)).contiguous()
                kept[name] = by_id[key]
        if rank0:
            torch.save(kept, path + ".tmp")
    if rank0:
        fmt.fsync_file(path + ".tmp")
        os.replace(path + ".tmp", path)
    engine.comm.barrier()
    return True


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
    for _ in fg.resident_masters([slot.segment]):  # (remainders: the exact fp32 values)
        master = fg.master_segments[slot.segment]
        full = torch.empty(slot.numel, dtype=torch.float32, device=fg.device)
        if not fg.sharded:
            full.copy_(master[seg.local(slot)].reshape(-1))
            continue
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
                except Exception:  # noqa: BLE001 - an optional attribute
                    pass
        config.save_pretrained(save_dir)
        written.append(os.path.join(save_dir, "config.json"))
    generation = getattr(module, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        try:
            generation.save_pretrained(save_dir)
            written.append(os.path.join(save_dir, "generation_config.json"))
        except Exception as e:  # noqa: BLE001 - one transformers would refuse
            warnings.warn(f"save_pretrained: generation_config not written ({e})", stacklevel=3)
    return written
