"""The JSON config: a typed schema with DeepSpeed's key names, defaults in one place.

Every field is declared once (zero.py, sections.py, schema.py; ``option`` in fields.py), with
its default, allowed range and a docstring; parsing and validation (parse.py), the "did you
mean" suggestions and the generated reference (reference.py: ``make docs`` -> docs/config.md)
all read these declarations; auto.py fills in what the engine knows. This package imports
nothing from torch, so it can be tested and used (``zeroengine check-config``) without a
framework.

Four kinds of keys:
- supported: declared and acted upon;
- accepted without effect: declared with ``no_effect`` saying why (e.g. DeepSpeed's
  ``contiguous_gradients``, which is how zeroengine always works);
- DeepSpeed's own spellings of a key (``aliases``; deprecated ones warn once);
- DeepSpeed keys zeroengine does not implement: policy.py says which are refused by name
  (they would change results) and which are accepted with no effect (logging, internals).
An unknown key close to a known one is refused with the suggestion; an unknown top-level key
close to nothing is reported once and ignored, as DeepSpeed ignores it.
"""
from __future__ import annotations

from ..errors import ConfigError
from .auto import (
    AUTO_FETCH_UNIT_MAX,
    auto_fetch_unit,
    auto_stage3_window,
    model_hidden_size,
    resolve_auto,
    resolve_batch,
)
from .fields import AUTO, COMMENT_PREFIX, option
from .parse import collect_report, config_dict, load_json, parse_config, parse_section, to_dict
from .schema import Config
from .sections import (
    BF16Config,
    CheckpointConfig,
    CheckpointWriterConfig,
    CompileConfig,
    CSVMonitorConfig,
    FP16Config,
    OptimizerConfig,
    SchedulerConfig,
    TensorBoardConfig,
    WandbConfig,
)
from .zero import AioConfig, OffloadConfig, OffloadParamConfig, ZeroConfig

__all__ = ["AUTO", "AUTO_FETCH_UNIT_MAX", "COMMENT_PREFIX", "AioConfig", "BF16Config",
           "CSVMonitorConfig", "CheckpointConfig", "CheckpointWriterConfig", "CompileConfig",
           "Config", "ConfigError", "FP16Config", "OffloadConfig", "OffloadParamConfig",
           "OptimizerConfig", "SchedulerConfig", "TensorBoardConfig", "WandbConfig",
           "ZeroConfig", "auto_fetch_unit", "auto_stage3_window", "collect_report",
           "config_dict", "load_json", "model_hidden_size", "option", "parse_config",
           "parse_section", "resolve_auto", "resolve_batch", "to_dict"]
