"""The optimizer state of a ShardedOptimizer by flat group, as checkpoints save and load it
(checkpoint/sharded.py): elementwise state laid out like the rank's shard, scalars apart, the
whole-parameter state of tensor-wise groups by parameter; with NVMe offload streamed a tile at
a time instead of built whole. A mixin: it reads the optimizer's flat groups, inner parts and
swap (sharded_optimizer.py builds them)."""
from __future__ import annotations

import torch

from ...ops import CPUAdam
from ..layout.flat_param_group import FlatParamGroup


class ShardStateIO:
    def shard_state(self, fg: FlatParamGroup, buffer=None) -> tuple[dict[str, torch.Tensor],
                                                                    dict]:
        """The inner optimizer's state over one group's shard, for checkpoints: elementwise
        tensors laid out like the shard (key -> CPU tensor), and the scalar state.
        ``buffer(key, dtype, numel)``: the tensor to fill for ``key`` (an asynchronous save's
        staging buffer; default a new one); elements no segment holds state for are zeros."""
        self._refuse_tensorwise(fg, "saving")
        elementwise: dict[str, torch.Tensor] = {}
        filled: dict[str, set[int]] = {}
        scalars: dict = {}
        for s in fg.resident_masters():
            seg, master = fg.layout.segments[s], fg.master_segments[s]
            for key, value in self.inner.state.get(master, {}).items():
                if torch.is_tensor(value) and value.numel() == master.numel() and value.dim() > 0:
                    if key not in elementwise:
                        elementwise[key] = torch.empty(fg.layout.shard_numel, dtype=value.dtype) \
                            if buffer is None else buffer(key, value.dtype, fg.layout.shard_numel)
                        filled[key] = set()
                    seg.of_shard(elementwise[key]).copy_(value.detach().reshape(-1))
                    filled[key].add(s)
                elif key not in scalars:
                    scalars[key] = value.item() if torch.is_tensor(value) else value
        for key, done in filled.items():  # zeros where a segment has no state (yet)
            if len(done) < len(fg.layout.segments):
                covered = torch.zeros(fg.layout.shard_numel, dtype=torch.bool)
                for s in done:
                    fg.layout.segments[s].of_shard(covered).fill_(True)
                elementwise[key][~covered] = 0
        return elementwise, scalars

    def load_shard_state(self, fg: FlatParamGroup, shards: dict[str, torch.Tensor],
                         scalars: dict) -> None:
        """The inverse of ``shard_state``, through the inner optimizer's own load_state_dict so
        each class gets its own dtypes and devices (torch keeps ``step`` as a tensor, CPUAdam
        as an int)."""
        self._refuse_tensorwise(fg, "loading")
        optimizer = self.parts[self._part_of[self.flat_groups.index(fg)]].optimizer
        wants_int_step = isinstance(optimizer, CPUAdam)
        if self.swap is not None:  # into the swapped tensors, a tile at a time
            for s in fg.resident_masters(write_back=True):
                self._load_segment_state(optimizer, fg, s, shards, scalars, wants_int_step)
            return
        current = self.inner.state_dict()
        index_of = {}
        for group in self.inner.param_groups:
            for p in group["params"]:
                index_of[id(p)] = len(index_of)
        state = current["state"]
        for seg, master in zip(fg.layout.segments, fg.master_segments):
            entry = {}
            for key, value in scalars.items():
                if key == "step":
                    entry[key] = int(value) if wants_int_step else torch.tensor(float(value))
                else:
                    entry[key] = value
            for key, shard in shards.items():
                entry[key] = seg.of_shard(shard).clone().to(master.device)
            state[index_of[id(master)]] = entry
        self.inner.load_state_dict({"state": state, "param_groups": current["param_groups"]})

    def _load_segment_state(self, optimizer, fg: FlatParamGroup, s: int, shards: dict,
                            scalars: dict, wants_int_step: bool) -> None:
        """Segment s's state from checkpoint shards (NVMe offload, its tile resident)."""
        seg = fg.layout.segments[s]
        targets = self.segment_state_targets(fg, s, list(shards), scalars)
        for key, shard in shards.items():
            targets[key].copy_(seg.of_shard(shard).view_as(targets[key]))

    def segment_state_targets(self, fg: FlatParamGroup, s: int, keys, scalars: dict) -> dict:
        """NVMe offload, segment s's tile resident: set its scalar state and return, for each
        per-element state key, the (zeroed) tensor to fill - the one the optimizer holds
        (swapped tensors keep their identity) or a new one, adopted by the swap when the tile
        is written back."""
        optimizer = self.parts[self._part_of[self.flat_groups.index(fg)]].optimizer
        master = fg.master_segments[s]
        state = optimizer.state[master]
        for key, value in scalars.items():
            if key == "step":
                value = int(value) if isinstance(optimizer, CPUAdam) \
                    else torch.tensor(float(value))
            state[key] = value
        targets = {}
        for key in keys:
            held = state.get(key)
            if not (torch.is_tensor(held) and held.numel() == master.numel()):
                dtype = self.swap.kinds.get(key, torch.float32) if self.swap else torch.float32
                held = state[key] = torch.zeros(master.numel(), dtype=dtype,
                                                device=master.device)
            targets[key] = held.zero_()
        return targets

    def shard_state_kinds(self, fg: FlatParamGroup) -> tuple[dict, dict]:
        """NVMe offload: what ``shard_state`` would return, without bringing anything in:
        (per-element state key -> dtype, scalar state). The values are streamed by
        ``stream_shard_state``."""
        fi = self.flat_groups.index(fg)
        self._refuse_tensorwise(fg, "saving")
        states = self.parts[self._part_of[fi]].optimizer.state
        kinds, scalars = {}, {}
        for s, master in enumerate(fg.master_segments):
            swapped = self.swap.keys_of.get((fi, s), ())
            for key in swapped:
                kinds[key] = self.swap.kinds[key]
            for key, value in states.get(master, {}).items():
                if key not in swapped and key not in scalars and \
                        (not torch.is_tensor(value) or value.dim() == 0):
                    scalars[key] = value.item() if torch.is_tensor(value) else value
        return kinds, scalars

    def stream_shard_state(self, fg: FlatParamGroup, kinds, write) -> None:
        """NVMe offload: ``write(key, segment, values)`` for the master ("master") and each
        per-element state key of every segment of ``fg``, a tile at a time."""
        states = self.parts[self._part_of[self.flat_groups.index(fg)]].optimizer.state
        for s in fg.resident_masters():
            seg, master = fg.layout.segments[s], fg.master_segments[s]
            write("master", seg, master)
            state = states.get(master, {})
            for key in kinds:
                if torch.is_tensor(state.get(key)) and state[key].numel() == master.numel():
                    write(key, seg, state[key])

    def _refuse_tensorwise(self, fg: FlatParamGroup, doing: str) -> None:
        fi = next(i for i, g in enumerate(self.flat_groups) if g is fg)
        if fi in self.owned:  # a bug if reached: checkpoints use owned_state for these
            raise RuntimeError(f"{doing} flat-shard state of a tensor-wise group ({fi})")

    def owned_state(self, fi: int) -> dict[int, dict]:
        """Tensor-wise flat group ``fi``: parameter index -> the inner optimizer's state for
        that whole parameter, for the parameters this rank owns (tensors as they are kept)."""
        owned = self.owned[fi]
        inner = self.parts[self._part_of[fi]].optimizer
        return {i: dict(inner.state.get(p, {})) for i, p in zip(owned.names, owned.params)}

    def load_owned_state(self, fi: int, states: dict[int, dict]) -> None:
        """The inverse of ``owned_state`` (parameters missing from ``states`` start fresh),
        through the inner optimizer's load_state_dict so its own dtype/device rules apply."""
        owned = self.owned[fi]
        current = self.inner.state_dict()
        index_of = {}
        for group in self.inner.param_groups:
            for p in group["params"]:
                index_of[id(p)] = len(index_of)
        for i, p in zip(owned.names, owned.params):
            if i in states:
                current["state"][index_of[id(p)]] = states[i]
            else:
                current["state"].pop(index_of[id(p)], None)
        self.inner.load_state_dict(current)

    # -- the optimizer's own state_dict: this rank's shard, same world size and stage ----------
    def state_dict(self) -> dict:
        """This rank's shard of the optimizer state and every group's hyperparameters.

        Loading needs the same world size and stage; checkpoints (engine.save_checkpoint) are the
        way to reshard."""
        self._refuse_swapped("optimizer.state_dict()")
        inner = self.inner.state_dict()
        groups = []
        for group in self.param_groups:
            groups.append({k: v for k, v in group.items() if k != "params"})
        return {"state": inner["state"], "param_groups": groups,
                "inner_param_groups": inner["param_groups"],
                "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None,
                "skipped_steps": self.skipped_steps,
                "zero": {"rank": self.comm.rank, "world_size": self.comm.world_size,
                         "stage": self.sharding.stage,
                         "shard_numels": [fg.layout.shard_numel for fg in self.flat_groups]}}

    def load_state_dict(self, state_dict: dict) -> None:
        self._refuse_swapped("optimizer.load_state_dict()")
        meta = state_dict.get("zero")
        if meta is None:
            raise ValueError("this is not a zeroengine optimizer state dict (no 'zero' entry); "
                             "a plain torch optimizer state cannot be loaded into shards")
        mine = {"world_size": self.comm.world_size, "stage": self.sharding.stage,
                "shard_numels": [fg.layout.shard_numel for fg in self.flat_groups]}
        for key, value in mine.items():
            if meta[key] != value:
                raise ValueError(f"optimizer state was saved with {key}={meta[key]} but this "
                                 f"engine has {key}={value}; use engine.load_checkpoint(), which "
                                 "reshards")
        if meta.get("rank", self.comm.rank) != self.comm.rank:
            raise ValueError(
                f"rank {self.comm.rank} was given the optimizer state of rank {meta['rank']}: "
                "optimizer.state_dict() holds only the saving rank's shard, so a file saved on "
                "one rank (e.g. `if master_process: torch.save(optimizer.state_dict())`) cannot "
                "restore the others. Save with engine.save_checkpoint(dir) on every rank and "
                "resume with engine.load_checkpoint(dir), or save each rank's state_dict to its "
                "own file")
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError(f"optimizer state has {len(state_dict['param_groups'])} param groups,"
                             f" this optimizer has {len(self.param_groups)}")
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self.inner.load_state_dict({"state": state_dict["state"],
                                    "param_groups": state_dict["inner_param_groups"]})
        if self.loss_scaler is not None and state_dict.get("loss_scaler"):
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        self.skipped_steps = state_dict.get("skipped_steps", 0)

    def _refuse_swapped(self, what: str) -> None:
        if self.swap is not None:
            raise RuntimeError(
                f"{what} would hold this rank's whole optimizer state in memory, which "
                "offload_optimizer.device 'nvme' keeps on the drive; save and resume with "
                "engine.save_checkpoint(dir) / engine.load_checkpoint(dir), which read and write "
                "it a tile at a time")

    def state_nbytes(self) -> int:
        """Bytes of the inner optimizer's state tensors (in host memory when offloaded)."""
        total = 0
        for per_param in self.inner.state.values():
            for value in per_param.values():
                if torch.is_tensor(value):
                    total += value.numel() * value.element_size()
        return total

