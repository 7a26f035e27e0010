"""DeepSpeed ZeRO checkpoints (``<save_dir>/global_stepN/``), read as zeroengine reads its own.

What DeepSpeed writes for data-parallel ZeRO at stages 1-3 (checked against 0.19.8):
  mp_rank_00_model_states.pt                (stages 1-2) the module's state_dict in the
                                            training dtype, param_shapes (one ordered dict per
                                            param group), shared_params (tied names), frozen
                                            parameters, the lr scheduler, counters, ds_config
                                            and the user's client_state (top-level keys)
  zero_pp_rank_R_mp_rank_00_model_states.pt (stage 3) the same per rank; the module's params
                                            are empty and frozen ones are rank R's fragment
  [bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt
                                            rank R's fp32 partition and Adam state
Stages 1-2: rank R's partition of param group g is ``single_partition_of_fp32_groups[g]``, with
``param_slice_mappings[g]``: name -> (numel, start) of the slice of each parameter it holds.
Stage 3: every parameter is split on its own, ceil(numel / W) elements per rank (the last
padded), and rank R's flat groups, concatenated, hold its slice of each parameter in
param_shapes order (what DeepSpeed's zero_to_fp32.py reconstructs).

``DeepSpeedCheckpoint`` turns that into zeroengine's checkpoint metadata (``format.read_meta``'s
shape: groups of (name, shape, offset), state keys, counters) and a reader with
``ShardReader``'s methods, so ``load_checkpoint`` and ``consolidate`` reshard it to any world
size and stage as they do their own. Files are read with ``torch_pickle``: nothing pickled is
executed, and only the element ranges asked for are read.
"""
from __future__ import annotations

import bisect
import math
import os
import re

import torch

from ..format import CheckpointError
from .torch_pickle import LazyTensor, Record, UnsafeOrUnreadable, load_lazy, materialize

# DeepSpeed's own record classes, kept as plain attributes
_RECORDS = {("deepspeed.runtime.fp16.loss_scaler", "LossScaler"): Record,
            ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"): Record,
            ("deepspeed.runtime.zero.config", "ZeroStageEnum"): int,
            ("deepspeed.utils.tensor_fragment", "fragment_address"): Record}
_OPTIM = re.compile(r"(?:(bf16|fp16)_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_ZERO3_MODEL = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")
_MODEL = "mp_rank_00_model_states.pt"
# top-level keys of the model-states file that are DeepSpeed's, not the user's client_state
_DEEPSPEED_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
                   "shared_params", "frozen_param_fragments", "lr_scheduler", "data_sampler",
                   "random_ltd", "sparse_tensor_module_names", "skipped_steps", "global_steps",
                   "global_samples", "dp_world_size", "mp_world_size", "ds_config",
                   "ds_version", "checkpoint_parallel_dimensions", "ep_world_size",
                   "num_experts", "universal_checkpoint_info"}
ADAM_KEYS = ("exp_avg", "exp_avg_sq")
_ADAM_TYPES = {"adam": "Adam", "adamw": "Adam", "fusedadam": "Adam", "cpuadam": "Adam",
               "deepspeedcpuadam": "Adam", "onebitadam": "OneBitAdam"}


def is_deepspeed_checkpoint(path: str) -> bool:
    """Whether ``path`` is one DeepSpeed checkpoint tag directory."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return _MODEL in names or any(_OPTIM.fullmatch(n) or _ZERO3_MODEL.fullmatch(n)
                                  for n in names)


class _Concat:
    """Several flat LazyTensors read as one (stage 3's sub-groups of a rank)."""

    def __init__(self, parts: list[LazyTensor]):
        self.parts = parts
        self.starts = [0]
        for p in parts:
            self.starts.append(self.starts[-1] + p.numel)

    @property
    def numel(self) -> int:
        return self.starts[-1]

    def read(self, begin: int, out: torch.Tensor) -> None:
        done, n = 0, out.numel()
        while done < n:
            at = begin + done
            k = bisect.bisect_right(self.starts, at) - 1
            if k >= len(self.parts):
                raise IndexError(f"element {at} of {self.numel}")
            take = min(n - done, self.starts[k + 1] - at)
            self.parts[k].read(at - self.starts[k], out[done:done + take])
            done += take


class DeepSpeedCheckpoint:
    """One DeepSpeed ZeRO checkpoint directory as zeroengine checkpoint metadata + reader."""

    def __init__(self, path: str):
        self.dir = path
        names = sorted(os.listdir(path))
        self._refuse_layouts(names)
        optim = {}
        for n in names:
            m = _OPTIM.fullmatch(n)
            if m:
                optim[int(m.group(2))] = n
        if not optim:
            raise CheckpointError(f"{path} holds no *_optim_states.pt: a DeepSpeed checkpoint "
                                  "saved without its ZeRO optimizer states cannot be resumed "
                                  "here (its model file alone: load the weights with "
                                  "from_pretrained or load_state_dict)")
        first = self._load(optim[min(optim)])["optimizer_state_dict"]
        count = first.get("partition_count")
        world = int(count[0] if isinstance(count, list) else count or max(optim) + 1)
        missing = [r for r in range(world) if r not in optim]
        if missing:
            raise CheckpointError(f"{path} lacks the optimizer states of rank(s) {missing} of "
                                  f"{world} (zero_pp_rank_{missing[0]}_mp_rank_00_optim_states"
                                  ".pt): copy every rank's file")
        if max(optim) >= world:
            raise CheckpointError(f"{path} holds optimizer files of ranks up to {max(optim)} "
                                  f"but they were saved by a {world}-rank run: files of two "
                                  "runs mixed?")
        self.world = world
        self._optim = [first if r == min(optim) else
                       self._load(optim[r])["optimizer_state_dict"] for r in range(world)]
        self.stage = int(self._optim[0].get("zero_stage", 0))
        if self.stage == 3:
            model_files = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)]
        else:
            model_files = [_MODEL]
        self._models = [self._load(name) for name in model_files]
        self.model = self._models[0]
        self._check_partition_counts(optim)
        self._flats: dict = {}
        self._build_fragments()
        self.meta = self._meta()

    # -- reading the files -----------------------------------------------------------------------
    def _load(self, name: str):
        file = os.path.join(self.dir, name)
        if not os.path.exists(file):
            raise CheckpointError(f"{file} is missing from the DeepSpeed checkpoint")
        try:
            tree = load_lazy(file, _RECORDS)
        except UnsafeOrUnreadable as err:
            raise CheckpointError(f"{err}") from None
        if not isinstance(tree, dict):
            raise CheckpointError(f"{file} does not hold a DeepSpeed checkpoint dict")
        if name.endswith("_optim_states.pt") and "optimizer_state_dict" not in tree:
            raise CheckpointError(f"{file} has no 'optimizer_state_dict': not a ZeRO "
                                  "optimizer checkpoint")
        return tree

    def _refuse_layouts(self, names: list[str]) -> None:
        where = self.dir
        if any(n.startswith("layer_") for n in names):
            raise CheckpointError(f"{where} is a pipeline-parallel DeepSpeed checkpoint "
                                  "(layer_*-model_states.pt): zeroengine is data-parallel "
                                  "only; convert it with DeepSpeed's ds_to_universal first")
        if any("expp_rank" in n or n.startswith("expert_") for n in names):
            raise CheckpointError(f"{where} holds MoE expert files (expert_*/expp_rank_*): "
                                  "zeroengine has no expert parallelism to load them into")
        mp = {int(m.group(3)) for n in names for m in [_OPTIM.fullmatch(n)] if m}
        mp |= {int(n[len("mp_rank_"):len("mp_rank_") + 2]) for n in names
               if n.startswith("mp_rank_") and n.endswith("_model_states.pt")}
        if any(r != 0 for r in mp):
            raise CheckpointError(f"{where} was saved with tensor (model) parallelism "
                                  f"(mp_rank_{max(mp):02d} files): zeroengine is data-parallel "
                                  "only; merge the tensor-parallel slices first")

    def _check_partition_counts(self, optim: dict) -> None:
        for r, state in enumerate(self._optim):
            count = state.get("partition_count")
            counts = count if isinstance(count, list) else [count]
            if any(c is not None and int(c) != self.world for c in counts):
                raise CheckpointError(
                    f"{os.path.join(self.dir, optim[r])} was saved by a {counts[0]}-rank "
                    f"partition but the directory holds {self.world} ranks' files: files of "
                    "two runs mixed?")
            if int(state.get("zero_stage", 0)) != self.stage:
                raise CheckpointError(f"{os.path.join(self.dir, optim[r])} is ZeRO stage "
                                      f"{state.get('zero_stage')}, rank 0's is {self.stage}")
        if self.stage not in (1, 2, 3):
            raise CheckpointError(f"{self.dir}: ZeRO stage {self.stage} optimizer files; "
                                  "stages 1-3 are read")

    def _flat(self, rank: int, key: str):
        """Rank ``rank``'s flat fp32 tensor of ``key`` ("master" or "state.<name>"), per
        param group (stages 1-2) or one concatenation of its sub-groups (stage 3)."""
        found = self._flats.get((rank, key))
        if found is None:
            try:
                found = self._flats[(rank, key)] = self._find_flat(rank, key)
            except (KeyError, IndexError, TypeError) as err:
                raise CheckpointError(f"{self._optim_path(rank)} has no {key!r} tensors "
                                      f"where DeepSpeed keeps them ({err!r})") from None
        return found

    def _find_flat(self, rank: int, key: str):
        state = self._optim[rank]
        if self.stage == 3:
            if key == "master":
                parts = state["fp32_flat_groups"]
            else:
                inner = state["optimizer_state_dict"]["state"]
                parts = [inner[i][key[len("state."):]] for i in sorted(inner)]
            return _Concat(list(parts))
        if key == "master":
            return state["single_partition_of_fp32_groups"]
        inner = state["base_optimizer_state"]["state"]
        return [inner[i][key[len("state."):]] for i in sorted(inner)]

    def _inner_state(self, rank: int) -> dict:
        state = self._optim[rank]
        return (state["optimizer_state_dict"] if self.stage == 3
                else state["base_optimizer_state"])

    # -- where each parameter's elements are -------------------------------------------------------
    def _build_fragments(self) -> None:
        """name -> [(rank, group or None, start in that rank's flat, numel, offset in param)]."""
        shapes = self.model.get("param_shapes")
        if not isinstance(shapes, list) or not shapes:
            raise CheckpointError(f"{self._model_path()} has no param_shapes: not a ZeRO "
                                  "checkpoint DeepSpeed wrote (or an older format)")
        self.param_shapes = [dict((k, tuple(v)) for k, v in d.items()) for d in shapes]
        self.fragments: dict[str, list[tuple]] = {}
        if self.stage == 3:
            offset = 0
            for group in self.param_shapes:
                for name, shape in group.items():
                    numel = math.prod(shape)
                    part = math.ceil(numel / self.world)
                    frags = []
                    for r in range(self.world):
                        n = max(0, min(part, numel - r * part))
                        if n:
                            frags.append((r, None, offset, n, r * part))
                    self.fragments[name] = frags
                    offset += part
            have = self._flat(0, "master").numel
            if offset != have:
                raise CheckpointError(f"{self._optim_path(0)} holds {have} fp32 elements but "
                                      f"param_shapes needs {offset} per rank: the model file "
                                      "and the optimizer files are from different runs")
            return
        for r in range(self.world):
            mappings = self._optim[r].get("param_slice_mappings")
            if mappings is None:
                raise CheckpointError(f"{self._optim_path(r)} has no param_slice_mappings "
                                      "(DeepSpeed before 0.10): convert it with that "
                                      "version's zero_to_fp32.py first")
            for g, mapping in enumerate(mappings):
                for name, address in mapping.items():
                    self.fragments.setdefault(name, []).append(
                        (r, g, int(address.start), int(address.numel), None))
        for group in self.param_shapes:
            for name, shape in group.items():
                frags, at = [], 0
                for r, g, start, n, _ in self.fragments.get(name, []):
                    frags.append((r, g, start, n, at))
                    at += n
                if at != math.prod(shape):
                    raise CheckpointError(
                        f"{self.dir}: the ranks' files hold {at} elements of {name!r}, which "
                        f"has {math.prod(shape)} ({list(shape)}): a rank's file is from "
                        "another run or damaged")
                self.fragments[name] = frags

    def _model_path(self) -> str:
        return os.path.join(self.dir, _MODEL if self.stage != 3 else
                            "zero_pp_rank_0_mp_rank_00_model_states.pt")

    def _optim_path(self, rank: int) -> str:
        found = [n for n in os.listdir(self.dir)
                 if (m := _OPTIM.fullmatch(n)) and int(m.group(2)) == rank]
        return os.path.join(self.dir, found[0])

    # -- zeroengine's view -------------------------------------------------------------------------
    def _meta(self) -> dict:
        inner = self._inner_state(0)
        keys = sorted({k for s in inner["state"].values() for k, v in s.items()
                       if isinstance(v, LazyTensor) and v.numel > 1})
        steps = [materialize(s.get("step")) for s in inner["state"].values()]
        step = next((float(s) for s in steps if s is not None), None)
        groups, index = [], {}
        for gi, group in enumerate(self.param_shapes):
            params, offset = [], 0
            for entry, (name, shape) in enumerate(group.items()):
                params.append([name, list(shape), offset])
                index[name] = [gi, entry]
                offset += math.prod(shape)
            groups.append({"params": params, "state_keys": keys,
                           "scalar_state": {} if step is None else {"step": step}})
        shared = dict(self.model.get("shared_params") or {})
        for alias, canonical in shared.items():
            if canonical in index:
                index.setdefault(alias, index[canonical])
        module = self.model.get("module") or {}
        state_dict_keys = {}
        for key in module:
            canonical = shared.get(key, key)
            state_dict_keys[key] = canonical if canonical in self.fragments else None
        config = self.model.get("ds_config") or {}
        gas = int(config.get("gradient_accumulation_steps", 1) or 1)
        global_steps = int(self.model.get("global_steps", 0))
        skipped = int(self.model.get("skipped_steps", 0))
        optimizer = str((config.get("optimizer") or {}).get("type", ""))
        # the config's optimizer names the state's meaning (LAMB keeps exp_avg too); a client
        # optimizer (no section) is known by its state keys
        if optimizer:
            inner_class = _ADAM_TYPES.get(optimizer.lower(), optimizer)
        else:
            inner_class = "Adam" if set(ADAM_KEYS) <= set(keys) else "+".join(keys)
        groups_hp = [{k: v for k, v in g.items() if k != "params"}
                     for g in materialize(inner.get("param_groups", []))]
        return {
            "format": "deepspeed", "tag": os.path.basename(self.dir), "stage": self.stage,
            "world_size": self.world, "global_steps": global_steps,
            "micro_steps": global_steps * gas, "skipped_steps": skipped,
            "global_samples": int(self.model.get("global_samples", 0)),
            "optimizer_steps": global_steps - skipped,
            "loss_scaler": self._loss_scaler(),
            "optimizer": {"class": optimizer or "Adam", "inner_class": inner_class,
                          "param_groups": groups_hp},
            "groups": groups, "index": index, "state_dict_keys": state_dict_keys,
            "files": {}, "hf_config": None,
        }

    def _loss_scaler(self) -> dict | None:
        """DeepSpeed's dynamic fp16 scaler in zeroengine's terms (None: static, i.e. bf16/fp32
        or a fixed fp16 scale, which the config sets)."""
        scaler = self._optim[0].get("loss_scaler")
        if not isinstance(scaler, Record) or not getattr(scaler, "dynamic", False):
            return None
        out = {"scale": float(scaler.cur_scale)}
        window = getattr(scaler, "scale_window", None)
        if window:
            out["clean_steps"] = int((scaler.cur_iter - 1 - scaler.last_overflow_iter) % window)
        if hasattr(scaler, "cur_hysteresis"):
            out["hysteresis_left"] = int(scaler.cur_hysteresis)
        return out

    def extras(self, rank: int) -> dict:
        """What zeroengine keeps in rank files' .pt: module entries not in the flat groups
        (buffers, frozen parameters), the lr scheduler's state, client_state. DeepSpeed saves
        no RNG states."""
        if rank != 0:
            return {}
        module = self.model.get("module") or {}
        rest = {}
        frozen = self.model.get("frozen_param_fragments") or {}
        frozen_shapes = self.model.get("frozen_param_shapes") or {}
        buffers = set(self.model.get("buffer_names") or ())
        for key, value in module.items():
            if self.meta["state_dict_keys"].get(key) is not None:
                continue
            if key in frozen:
                rest[key] = self._frozen(key, frozen_shapes.get(key))
            elif isinstance(value, LazyTensor) and (key in buffers or self.stage != 3):
                rest[key] = value.load()  # at stage 3 a parameter here is an empty stand-in
        client = {k: materialize(v) for k, v in self.model.items() if k not in _DEEPSPEED_KEYS}
        scheduler = materialize(self.model.get("lr_scheduler"))
        return {"module_rest": rest, "client_state": client,
                "deepspeed_lr_scheduler": scheduler}

    def _frozen(self, key: str, shape) -> torch.Tensor:
        if self.stage != 3:
            return self.model["frozen_param_fragments"][key].load()
        pieces = [m["frozen_param_fragments"][key].load().reshape(-1) for m in self._models]
        shape = tuple(shape)
        return torch.cat(pieces)[:math.prod(shape)].view(shape)

    # -- ShardReader's methods ---------------------------------------------------------------------
    @property
    def reader(self):
        return self

    def read(self, group_index: int, key: str, flat_begin: int, numel: int,
             out: torch.Tensor) -> None:
        params = self.meta["groups"][group_index]["params"]
        offsets = [p[2] for p in params]
        entry = bisect.bisect_right(offsets, flat_begin) - 1
        name, shape, offset = params[entry]
        begin = flat_begin - offset
        if begin + numel > math.prod(shape):
            raise CheckpointError(f"{self.dir}: a read of {name!r} past its end")
        for rank, g, start, n, at in self.fragments[name]:
            lo, hi = max(begin, at), min(begin + numel, at + n)
            if lo >= hi:
                continue
            source = self._flat(rank, key)
            if g is not None:
                source = source[g]
            target = out[lo - begin:hi - begin]
            if target.is_contiguous():
                source.read(start + lo - at, target)
            else:
                staged = torch.empty(hi - lo, dtype=target.dtype)
                source.read(start + lo - at, staged)
                target.copy_(staged)

    def full_parameter(self, name: str, key: str = "master") -> torch.Tensor:
        gi, entry = self.meta["index"][name]
        _, shape, offset = self.meta["groups"][gi]["params"][entry]
        out = torch.empty(math.prod(shape), dtype=torch.float32)
        self.read(gi, key, offset, out.numel(), out)
        return out.view(shape)
