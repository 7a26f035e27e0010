"""``deepspeed.moe``: DeepSpeed's mixture-of-experts layers are not implemented (zeroengine shards
data-parallel model states; no expert parallelism). The names a script imports exist so that it
imports and runs without MoE; building a ``layer.MoE`` is refused by name."""
from . import layer, utils  # noqa: F401
