"""``deepspeed.moe.utils``: parameter-group helpers of DeepSpeed's MoE layers."""
from __future__ import annotations


def is_moe_param(param) -> bool:
    """No parameter is an expert's: zeroengine has no MoE layers."""
    return False


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=None):
    """DeepSpeed moves the parameters of its MoE layers into groups of their own; with no such
    layers (zeroengine has none) the groups come back as they were, as DeepSpeed returns them
    for a model without experts: a list of dicts."""
    if isinstance(param_groups, dict):
        param_groups = [param_groups]
    return [dict(g) for g in param_groups]
