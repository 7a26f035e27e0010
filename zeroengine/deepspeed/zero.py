"""``deepspeed.zero``: ``Init`` builds a model straight into stage-3 shards (zeroengine's
``zero_init``), ``GatheredParameters`` reads or changes whole parameters
(``gathered_parameters``)."""
from __future__ import annotations

import contextlib

from ..core.stage3.gathered import gathered_parameters
from ..core.stage3.zero_init import zero_init
from ._missing import missing


class Init(contextlib.ContextDecorator):
    """``with deepspeed.zero.Init(config_dict_or_path=cfg): model = Model()``. Arguments that
    would change what zeroengine builds are refused by name; the device follows the launcher
    (``remote_device``: "cpu" keeps the shards in host memory only through the config's
    offload_param, which is what DeepSpeed also reads)."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True,
                 remote_device=None, pin_memory=False, config_dict_or_path=None, config=None,
                 enabled=True, dtype=None, mpu=None, zero_param_parallel_group=None,
                 zero_quantized_weights=False, zero_quantized_nontrainable_weights=False,
                 sequence_data_parallel_group=None, param_swapper=None):
        if module is not None:
            raise ValueError("deepspeed.zero.Init(module=...): converting a model built before "
                             "is not supported; build it inside `with deepspeed.zero.Init(...):`")
        if data_parallel_group is not None or mpu is not None or \
                zero_param_parallel_group is not None:
            raise ValueError("deepspeed.zero.Init: zeroengine shards over all ranks; "
                             "data_parallel_group, mpu and zero_param_parallel_group are not "
                             "supported")
        self.enabled = enabled
        self.config = config_dict_or_path if config_dict_or_path is not None else config
        self.dtype = dtype
        self._inner = None

    def __enter__(self):
        if not self.enabled:
            return self
        # dtype: the engine trains in the config's precision (fp16/bf16 sections), as
        # DeepSpeed's Init also defaults to; the values are cast when initialize() lays them out
        self._inner = zero_init(self.config if self.config is not None else
                                {"zero_optimization": {"stage": 3}})
        self._inner.__enter__()
        return self

    def __exit__(self, *exc):
        if self._inner is not None:
            inner, self._inner = self._inner, None
            return inner.__exit__(*exc)
        return False


def GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled=True):
    """``with deepspeed.zero.GatheredParameters(params, modifier_rank=0):`` whole parameters
    inside; with a modifier rank, its changes reach every rank's shards on exit."""
    if not enabled:
        return contextlib.nullcontext()
    return gathered_parameters(params, modifier_rank=modifier_rank)


_NEAREST = {
    "register_external_parameter": "zeroengine gathers a parameter read outside its owner "
    "module on demand (no registration needed)",
    "MiCS_Init": "zero_optimization.mics_shard_size in the config, with deepspeed.zero.Init",
    "TiledLinear": "not supported",
}


def __getattr__(name: str):
    raise missing("deepspeed.zero", name, _NEAREST, ["Init", "GatheredParameters"])
