"""Several optimizers acting as one: Muon for the weight matrices and AdamW for the rest is the
common case (torch.optim.Muon takes only 2-D parameters, so a model needs two optimizers).

``initialize(model, cfg, optimizer=[muon, adamw])`` wraps the list in an OptimizerChain. Its
``param_groups`` is the concatenation of the members' own group dicts (the same objects, so a
scheduler built on one member still drives that member's learning rate), its ``state`` the
union of theirs, and its state_dict the members' state dicts in torch's format with one running
parameter numbering. The sharded step builds one inner optimizer per member and kind of update
and chains them the same way.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch


class _ChainedState(Mapping):
    """The members' ``state`` dicts read as one. Not collections.ChainMap: its lookup indexes
    each member's defaultdict in turn, which inserts the key into the first one."""

    def __init__(self, states):
        self._states = states

    def __getitem__(self, key):
        for state in self._states:
            if key in state:
                return state[key]
        raise KeyError(key)

    def __iter__(self):
        for state in self._states:
            yield from state

    def __len__(self) -> int:
        return sum(len(state) for state in self._states)


def init_without_copying_groups(optimizer: torch.optim.Optimizer, defaults: dict) -> None:
    """What torch.optim.Optimizer.__init__ sets, minus the param groups: for optimizers that
    share another's group dicts (copying them would cut a scheduler off from the groups)."""
    optimizer.defaults = defaults
    for name in ("step_pre", "step_post", "state_dict_pre", "state_dict_post",
                 "load_state_dict_pre", "load_state_dict_post"):
        setattr(optimizer, f"_optimizer_{name}_hooks", {})


class OptimizerChain(torch.optim.Optimizer):
    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        # Not calling Optimizer.__init__: it would copy the groups, and sharing the members'
        # dicts is the point.
        if not optimizers:
            raise ValueError("OptimizerChain needs at least one optimizer")
        for opt in optimizers:
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"every optimizer in the list must be a torch.optim.Optimizer, "
                                f"got {type(opt).__name__}")
        self.optimizers = list(optimizers)
        init_without_copying_groups(self, self.optimizers[0].defaults)

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self):
        return _ChainedState([opt.state for opt in self.optimizers])

    def member_of_group(self) -> list[torch.optim.Optimizer]:
        """For each entry of ``param_groups``: the member optimizer that holds it."""
        return [opt for opt in self.optimizers for _ in opt.param_groups]

    def __repr__(self) -> str:
        return "OptimizerChain(" + ", ".join(type(o).__name__ for o in self.optimizers) + ")"

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("OptimizerChain.step() takes no closure")
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        raise RuntimeError("add a param group to one of the chained optimizers instead")

    def state_dict(self) -> dict:
        state, groups, base = {}, [], 0
        for opt in self.optimizers:
            sd = opt.state_dict()
            count = sum(len(g["params"]) for g in sd["param_groups"])
            state.update({base + int(k): v for k, v in sd["state"].items()})
            groups.extend({**g, "params": [base + int(i) for i in g["params"]]}
                          for g in sd["param_groups"])
            base += count
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        groups = list(state_dict["param_groups"])
        base = 0
        for opt in self.optimizers:
            mine = groups[:len(opt.param_groups)]
            groups = groups[len(opt.param_groups):]
            count = sum(len(g["params"]) for g in mine)
            state = {int(k) - base: v for k, v in state_dict["state"].items()
                     if base <= int(k) < base + count}
            opt.load_state_dict({"state": state, "param_groups": [
                {**g, "params": [int(i) - base for i in g["params"]]} for g in mine]})
            base += count
