"""``deepspeed.moe.layer``: DeepSpeed's MoE layer is not implemented."""
from __future__ import annotations


class MoE:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            "deepspeed.moe.layer.MoE: zeroengine has no expert-parallel MoE layer. Build the "
            "experts as plain modules (each rank computes every expert it routes to) and, at "
            "stage 3, name the block in zero_optimization.stage3_leaf_modules so that it is "
            "fetched as one unit")
