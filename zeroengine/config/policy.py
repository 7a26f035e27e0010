"""What zeroengine does with the DeepSpeed config keys it does not implement - the policy,
written down once (docs/config.md is generated from these tables):

- a key that would change training results if ignored is refused, naming the feature
  (``REFUSED``), unless its value is the one that turns the feature off (a DeepSpeed default
  such as ``"zero_quantized_weights": false`` is no reason to refuse a config);
- a knob that only steers DeepSpeed's own logging, profiling or internals is accepted with any
  value and reported once as having no effect here (``NO_EFFECT``);
- an unknown key close to a known one is a typo, refused with the suggestion (config.py);
  an unknown top-level key close to nothing is reported once and ignored, as DeepSpeed does.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

from ..errors import ConfigNotice

# the keys already spoken of: a notice is said once per process (a job that builds several
# engines, or a test suite, reads the same keys again and again)
_noticed: set[str] = set()


def notice(key: str, message: str) -> None:
    """Say ``message`` about ``key`` once per process."""
    if key not in _noticed:
        _noticed.add(key)
        warnings.warn(f"config key '{key}': {message}", ConfigNotice, stacklevel=4)


def forget_notices(*keys: str) -> None:
    """Say the notices about ``keys`` (all, when none are named) again when next due."""
    if keys:
        _noticed.difference_update(keys)
    else:
        _noticed.clear()


def _equals(*off) -> Callable[[Any], bool]:
    return lambda value: value is None or any(value == o and type(value) is type(o)
                                              for o in off)


def _disabled(value) -> bool:
    """A DeepSpeed feature section that is off: absent, empty, or {"enabled": false}."""
    return value is None or value == {} or (isinstance(value, dict)
                                            and value.get("enabled") is False)


_FEATURE = "a DeepSpeed feature zeroengine does not implement"
# key (dotted path) -> (why it is refused, the test for a value that keeps the feature off)
REFUSED: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "tensor_parallel": ("tensor parallelism (AutoTP) is " + _FEATURE,
                        lambda v: _disabled(v) or (isinstance(v, dict)
                                                   and v.get("autotp_size", 1) in (0, 1))),
    "sequence_parallel_size": ("sequence parallelism is " + _FEATURE, _equals(1)),
    "amp": ("NVIDIA apex AMP is not supported: use \"bf16\" or \"fp16\"", _disabled),
    "sparse_attention": ("sparse attention is " + _FEATURE, _disabled),
    "compression_training": ("compression training is " + _FEATURE, _disabled),
    "data_efficiency": ("data efficiency (curriculum, sampling) is " + _FEATURE, _disabled),
    "curriculum_learning": ("curriculum learning is " + _FEATURE, _disabled),
    "quantize_training": ("quantization-aware training is " + _FEATURE, _disabled),
    "weight_quantization": ("weight quantization is " + _FEATURE, _disabled),
    "hybrid_engine": ("the RLHF hybrid engine is " + _FEATURE, _disabled),
    "elasticity": ("elastic batch sizes are " + _FEATURE, _disabled),
    "torch_autocast": ("torch autocast inside the engine is not supported: use \"bf16\" or "
                       "\"fp16\"", _disabled),
    "sparse_gradients": ("sparse gradients are " + _FEATURE, _equals(False)),
    "data_types": ("data_types (e.g. grad_accum_dtype) is " + _FEATURE,
                   lambda v: _disabled(v) or (isinstance(v, dict) and all(
                       x is None for x in v.values()))),
    "fp32_allreduce": ("say \"communication_data_type\": \"fp32\" instead", _equals(False)),
    "zero_optimization.zenflow": ("ZenFlow is " + _FEATURE, _disabled),
    "zero_optimization.zero_quantized_nontrainable_weights": (
        "quantized non-trainable weights are " + _FEATURE, _equals(False)),
    "zero_optimization.zeropp_loco_param": ("ZeRO++ LoCo is " + _FEATURE, _disabled),
    "zero_optimization.leaf_module": ("DeepSpeed's leaf_module section: name the classes in "
                                      "zero_optimization.stage3_leaf_modules instead",
                                      _disabled),
    **{f"compile.{k}": ("DeepSpeed's DeepCompile (its own compiler passes: " + k + ") is "
                        + _FEATURE + "; zeroengine compiles with torch.compile (compile."
                        "enabled)", _equals(False))
       for k in ("deepcompile", "free_activation", "offload_activation", "offload_opt_states",
                 "offload_parameters", "autoep_non_moe")},
    "aio.use_gds": ("GPUDirect Storage is " + _FEATURE, _equals(False)),
    "checkpoint.load_universal": ("DeepSpeed universal checkpoints are not read: "
                                  "load_checkpoint reads DeepSpeed's ZeRO checkpoint directory "
                                  "itself, at any world size", _equals(False)),
    "checkpoint.use_node_local_storage": ("pass node_local=True to engine.save_checkpoint "
                                          "(each rank's save_dir its own) instead",
                                          _equals(False)),
    "compile.passes": ("DeepCompile passes are " + _FEATURE, lambda v: not v),
}

_LOGGING = "steers DeepSpeed's own logging or profiling"
_INTERNAL = "tunes DeepSpeed's internals; zeroengine has its own"
# key (dotted path) -> why it has no effect here (accepted with any value)
NO_EFFECT: dict[str, str] = {
    **{k: _LOGGING for k in ("comms_logger", "flops_profiler", "timers", "dump_state",
                             "memory_breakdown")},
    "comet": "zeroengine writes DeepSpeed's monitor events to tensorboard, csv_monitor and "
             "wandb, not to Comet",
    "monitor_config": "DeepSpeed's monitors are configured by the top-level tensorboard, "
                      "csv_monitor and wandb sections",
    "prescale_gradients": "gradients are averaged in the reduction itself; the mean is the same",
    "gradient_predivide_factor": "gradients are averaged in the reduction itself; the mean is "
                                 "the same",
    "zero_force_ds_cpu_optimizer": "the CPU optimizer is chosen by offload_optimizer",
    "fp16.opt_level": "an apex AMP setting that DeepSpeed's fp16 mode never read",
    "bf16.loss_scale": "bf16 needs no loss scaling (older DeepSpeed ignored the key)",
    "bf16.immediate_grad_update": _INTERNAL,
    "bf16.check_grad_overflow": "a non-finite gradient is never applied: on_nonfinite decides "
                                "('raise' by default; 'skip' skips the step as DeepSpeed does)",
    "checkpoint.checkpoint_serialization": "checkpoints are safetensors files and a "
                                           "torch.save archive read with weights_only=True",
    "checkpoint.parallel_write": "every rank writes its own files in parallel already",
    "dataloader_drop_last": "zeroengine does not build data loaders",
    "job": "the built-in `zeroengine train` job's section (docs/job.md): that job reads it, "
           "initialize() does not",
    "activation_checkpointing": "it configures deepspeed.checkpointing, which a model run by "
                                "zeroengine does not call: use torch.utils.checkpoint("
                                "use_reentrant=False)",
    "pipeline": "it configures DeepSpeed's pipeline engine, which zeroengine does not run",
    "nebula": "it configures a DeepSpeed checkpoint service",
    "autotuning": "it configures DeepSpeed's autotuner",
    **{f"compile.{k}": "tunes DeepSpeed's own compiler (DeepCompile); zeroengine uses "
       "torch.compile" for k in ("double_buffer", "symmetric_memory", "debug_log",
                                  "sync_before_reduce", "sync_after_reduce",
                                  "sync_before_allgather", "sync_after_allgather",
                                  "keep_int_input_tensors", "keep_all_input_tensors",
                                  "free_activation_threshold", "offload_activation_pin_memory")},
    "zero_optimization.mics_hierarchical_params_gather": "with mics_shard_size the "
        "parameters are gathered inside the group only: nothing crosses groups to gather "
        "hierarchically",
    "comms_config": _INTERNAL, "disable_allgather": _INTERNAL,
    **{f"zero_optimization.{k}": _INTERNAL for k in (
        "stage3_module_granularity_threshold", "module_granularity_threshold",
        "stage3_model_persistence_threshold", "model_persistence_threshold",
        "stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params",
        "stage3_allgather_sequential", "allgather_sequential", "use_multi_rank_bucket_allreduce",
        "memory_efficient_linear", "legacy_stage1", "override_module_apply",
        "pipeline_loading_checkpoint", "log_trace_cache_warnings")},
}
