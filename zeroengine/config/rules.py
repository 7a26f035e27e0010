"""The rules across keys, in one place: which keys contradict each other or need another.

``check_config`` runs at the end of parse_config (so ``zeroengine check-config`` reports every
one of them) and again at the end of resolve_auto, once "auto" values have become numbers and
booleans; a rule that reads a value still "auto" waits for that second run. Rules that need
more than the config - the model, the optimizer, the ranks - stay where those are known (the
optimizer factory, distributed/topology.py)."""
from __future__ import annotations

from ..errors import ConfigError
from .fields import AUTO
from .policy import notice
from .schema import Config
from .zero import OffloadParamConfig


def _precisions(cfg: Config) -> None:
    bf16, fp16 = cfg.bf16, cfg.fp16
    if fp16.enabled is True and bf16.enabled is True:
        raise ConfigError("fp16.enabled and bf16.enabled are both true; enable at most one")
    kept_in_bf16 = [key for key, on in (
        ("bf16.bf16_master_weights_and_grads", bf16.bf16_master_weights_and_grads),
        ("bf16.bf16_optimizer_states", bf16.bf16_optimizer_states),
        ("bf16.store_param_remainders", bf16.store_param_remainders),
        ("bf16.stochastic_rounding", bf16.stochastic_rounding)) if on]
    if kept_in_bf16 and bf16.enabled not in (True, AUTO):
        raise ConfigError(f"'{kept_in_bf16[0]}' needs bf16.enabled true (it keeps optimizer "
                          "values in bfloat16 beside bfloat16 weights)")
    if fp16.fp16_master_weights_and_grads and fp16.enabled not in (True, AUTO):
        raise ConfigError("'fp16.fp16_master_weights_and_grads' needs fp16.enabled true")
    if bf16.store_param_remainders and bf16.bf16_master_weights_and_grads:
        raise ConfigError("bf16.store_param_remainders keeps the fp32 master exactly (as the "
                          "bf16 weight + 16 bits) and bf16.bf16_master_weights_and_grads "
                          "drops it to bf16: they contradict each other, set one")
    if bf16.stochastic_rounding and not (bf16.bf16_master_weights_and_grads
                                         or bf16.bf16_optimizer_states):
        raise ConfigError("bf16.stochastic_rounding rounds bf16 master weights and optimizer "
                          "states, and this config keeps neither in bf16: also set "
                          "bf16.bf16_master_weights_and_grads and/or "
                          "bf16.bf16_optimizer_states (or remove it)")
    low = kept_in_bf16 + (["fp16.fp16_master_weights_and_grads"]
                          if fp16.fp16_master_weights_and_grads else [])
    for section in ("offload_optimizer", "offload_param"):
        if low and getattr(cfg.zero_optimization, section).device == "nvme":
            raise ConfigError(f"'{low[0]}' with zero_optimization.{section}.device 'nvme' is "
                              "not supported (the swap files hold fp32 masters and states): "
                              f"use {section}.device 'cpu' or 'none'")


def _offload(cfg: Config) -> None:
    zero = cfg.zero_optimization
    if zero.offload_optimizer.device != "none" and zero.stage == 0:
        raise ConfigError("zero_optimization.offload_optimizer needs stage 1, 2 or 3 (it offloads "
                          "the rank's shard of the optimizer state); set zero_optimization.stage "
                          "or offload_optimizer.device 'none'")
    if zero.offload_param.device != "none" and zero.stage != 3:
        # DeepSpeed reads offload_param at stage 3 only and ignores it below: so does zeroengine
        notice("zero_optimization.offload_param", f"no effect at stage {zero.stage}: only "
               "stage 3 shards (and so offloads) parameters; DeepSpeed ignores it too")
        zero.offload_param = OffloadParamConfig()
    for section in ("offload_param", "offload_optimizer"):
        if getattr(zero, section).device == "nvme" and not getattr(zero, section).nvme_path:
            raise ConfigError(f"zero_optimization.{section}.device 'nvme' needs "
                              f"{section}.nvme_path: a directory on the drive to swap to")
    if cfg.aio.block_size % 4096:
        raise ConfigError(f"aio.block_size must be a multiple of 4096 (O_DIRECT), got "
                          f"{cfg.aio.block_size}")


def _quantized(cfg: Config) -> None:
    zero = cfg.zero_optimization
    if zero.zero_quantized_weights and zero.stage != 3:
        raise ConfigError("zero_optimization.zero_quantized_weights quantizes stage 3's "
                          f"parameter all-gathers, but the stage is {zero.stage}: use stage 3, "
                          "or drop the key")
    if zero.zero_quantized_gradients and zero.stage == 0:
        raise ConfigError("zero_optimization.zero_quantized_gradients quantizes the gradient "
                          "reduce-scatter of stages 1-3; stage 0 all-reduces: use stage 1-3, "
                          "or drop the key")


RULES = (_precisions, _offload, _quantized)


def check_config(cfg: Config) -> Config:
    """Every rule across keys; raises ConfigError naming the keys and the fix."""
    for rule in RULES:
        rule(cfg)
    return cfg
