"""Stage 3's module hooks: a module's fetch unit gathered before its forward and released
after it, gathered again when its backward comes (a hook on its outputs' gradients), and a
parameter read while released either gathered for the module running (a module using a
child's weight without calling the child) or refused by name outside the forward."""
from __future__ import annotations

import torch

from ...errors import ShardedParameterAccessError
from ..compat.compiled import eager_stance, is_compiled
from .prefetch import Phase


class ModuleHooks:
    """Mixed into ParamFetcher: the hooks it registers on the model's modules, over its
    ``acquire`` / ``release`` / ``gather_for_backward`` and its record of running modules."""

    def _pre_forward(self, module, args):
        if module is self.root:
            self._root_depth += 1
            if self._root_depth == 1 and self._first_forward and is_compiled(self.root):
                self._stance = eager_stance()
        self._running.append(module)
        if self.recording:
            self._ran.add(id(module))
        self.acquire(self.module_keys[module], module=module)

    def _post_forward(self, module, args, output):
        if self._running and self._running[-1] is module:
            self._running.pop()
        keys = self.module_keys[module]
        self.release(keys, module=module)
        if torch.is_grad_enabled() and keys:
            # The gradient of an output exists just before the module's own backward runs.
            # A plain tensor hook survives later in-place ops on the output (it then sees the
            # gradient of the pre-in-place value), which a custom autograd Function would not.
            for t in _tensor_leaves(output):
                if t.requires_grad:
                    t.register_hook(lambda grad, keys=keys: self.gather_for_backward(keys))

    def _after_root_forward(self, module, args, output):
        self._root_depth = max(0, self._root_depth - 1)
        if self._root_depth:
            return  # a nested call of the root: the outer forward goes on
        self._first_forward = False
        if self._stance is not None:
            self._stance.__exit__(None, None, None)
            self._stance = None
        self._running.clear()  # a forward that raised inside never ran its post hooks
        self._reached[Phase.FORWARD] = -1
        if not torch.is_grad_enabled():  # no backward follows: drop unused prefetches now
            for entry in self.gathered.values():
                entry.pending = None
            self.release_unheld()

    def read_released(self, param: torch.Tensor, what: str) -> None:
        """A torch call (``what``) reads a partitioned parameter whose segment is not gathered
        (sharded_param.py). Inside the model's forward - which every rank runs alike - gather
        it for the module running now and remember it as that module's, so it is gathered with
        the module's own parameters from then on and again for its backward (a module using a
        child's weight without calling the child, e.g. nn.MultiheadAttention's out_proj).
        Anywhere else, refuse by name."""
        key = self.where[id(param)]
        if not self._running:
            name = self._param_names.get(id(param), tuple(param.shape))
            raise ShardedParameterAccessError(
                f"parameter {name!r} is partitioned by ZeRO stage 3 and not gathered here "
                f"({what} outside the model's forward): its values live sharded across the "
                "ranks. Read or change it inside `with zeroengine.gathered_parameters(params, "
                "modifier_rank=...)` (every rank enters it), take a full state dict with "
                "engine.consolidated_state_dict() (model.state_dict() cannot hold sharded "
                "values), or keep small parameters whole with zero_optimization."
                "stage3_param_persistence_threshold")
        module = self._running[-1]
        keys = self.module_keys[module]
        if key not in keys:
            keys.append(key)  # the same list _post_forward releases and backward re-gathers
            self.acquire([key])
        else:  # held by this module but freed under it (should not happen): gather again
            self._ready(key)


def _tensor_leaves(output) -> list[torch.Tensor]:
    """The tensors in a module's output (a tensor, or tuples/lists/dicts of them)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensor_leaves(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _tensor_leaves(item)]
    return []
