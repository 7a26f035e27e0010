"""``from_pretrained`` under ``zero_init`` (transformers 5.x): the weights are not read by
transformers at all; each parameter is bound to its tensor in the checkpoint's safetensors
files and stays on the meta device until ``initialize`` reads, at stage 3, only the elements
each rank keeps straight into its shard (deferred_params.py). zero_init installs this while
its block is open, so it lives beside zero_init rather than with the optional integrations.

transformers 5 builds the model on the meta device and then ``_load_pretrained_model`` reads
every tensor. While a zero_init block is active that step is replaced: the checkpoint's keys
are matched to the model's by name (with or without the model's ``base_model_prefix``, as
transformers matches them), every match is bound (a shape mismatch is an error naming the key
and both shapes), and transformers gets back the loading report it would have built: keys the
checkpoint lacks go through its own ``_finalize_model_loading`` (moved off meta and
initialised by the model's ``_init_weights``, only those; tied weights tied; non-persistent
buffers such as rotary ``inv_freq`` recomputed), unexpected keys reported as it reports them.

Checkpoints transformers would *convert* while loading (a WeightConverter or renaming of the
model's conversion mapping matches a key: fused experts, legacy names), .bin checkpoints and a
``state_dict=`` argument are left to transformers' own loader, with a warning: every rank then
reads those weights whole.
"""
from __future__ import annotations

import copy
import functools
import os
import warnings

from ...checkpoint.weights.weight_files import WeightFiles, read_header
from ..layout.deferred_params import FileSource

_saved = None


def install() -> None:
    """Replace PreTrainedModel._load_pretrained_model while zero_init is active (if
    transformers is imported; a no-op otherwise)."""
    global _saved
    import importlib
    import sys
    if "transformers" not in sys.modules or _saved is not None:
        return
    # transformers imports its submodules lazily: `from transformers import AutoModel...`
    # alone has not loaded modeling_utils yet
    modeling = importlib.import_module("transformers.modeling_utils")
    cls = modeling.PreTrainedModel
    original = cls.__dict__.get("_load_pretrained_model")
    if not isinstance(original, staticmethod):  # another transformers: leave it alone
        return
    _saved = (cls, original)
    cls._load_pretrained_model = staticmethod(functools.partial(_load, original.__func__))


def uninstall() -> None:
    global _saved
    if _saved is not None:
        cls, original = _saved
        cls._load_pretrained_model = original
        _saved = None


def _load(original, model, state_dict, checkpoint_files, load_config, *args, **kwargs):
    reason = _why_not_ours(state_dict, checkpoint_files, load_config)
    files = None
    if reason is None:
        files = WeightFiles(os.path.dirname(str(checkpoint_files[0])), {})
        for file in checkpoint_files:
            files.entries.update(read_header(str(file)))
        reason = _conversion(files, load_config)
    if reason is None and not all(t.is_meta for t in model.state_dict(keep_vars=True).values()
                                  if t is not None and t.is_floating_point()):
        reason = "the model was not built on the meta device"
    if reason is not None:
        warnings.warn(f"zero_init: {type(model).__name__}.from_pretrained reads its weights "
                      f"through transformers' own loader ({reason}): every rank reads them "
                      "whole, and they are sharded at initialize", stacklevel=4)
        return original(model, state_dict, checkpoint_files, load_config, *args, **kwargs)
    return _bind(model, files), None


def _why_not_ours(state_dict, checkpoint_files, load_config) -> str | None:
    if state_dict is not None:
        return "a state_dict was passed"
    if not checkpoint_files or not all(str(f).endswith(".safetensors")
                                       for f in checkpoint_files):
        return "the checkpoint is not in safetensors files"
    for attr in ("hf_quantizer", "device_map", "device_mesh"):
        if getattr(load_config, attr, None) is not None:
            return f"{attr} is set"
    return None


def _conversion(files: WeightFiles, load_config) -> str | None:
    """A key transformers would rename or convert for this model (its conversion mapping)."""
    mapping = copy.deepcopy(getattr(load_config, "weight_mapping", None) or [])
    for key in files.entries:
        for transform in mapping:
            try:
                renamed, pattern = transform.rename_source_key(key)
            except Exception:  # noqa: BLE001 - a transform we cannot read
                return f"its conversion mapping ({type(transform).__name__}) could not be read"
            if pattern is not None or renamed != key:
                return f"it converts checkpoint key {key!r} ({type(transform).__name__})"
    return None


def _bind(model, files: WeightFiles):
    import torch
    from transformers.utils.loading_report import LoadStateDictInfo
    # the device it will train on: transformers' kernelize() asks model.device otherwise,
    # which is "meta" until initialize reads the weights
    model._kernels_device = "cuda" if torch.cuda.is_available() else "cpu"
    prefix = getattr(model, "base_model_prefix", "") or ""
    expected = model.state_dict(keep_vars=True)
    target_of = {}
    for key in files.entries:
        if key in expected:
            target_of[key] = key
        elif prefix and f"{prefix}.{key}" in expected:
            target_of[key] = f"{prefix}.{key}"
        elif prefix and key.startswith(prefix + ".") and key[len(prefix) + 1:] in expected:
            target_of[key] = key[len(prefix) + 1:]
    for key, name in target_of.items():
        files.entry(key).check_shape(expected[name].shape,
                                     f"{type(model).__name__}'s {name!r}")
    loaded = set()
    for key, name in target_of.items():
        tensor = expected[name]
        tensor._ze_source = FileSource(files, key)
        tensor._is_hf_initialized = True  # its _init_weights must leave it alone
        loaded.add(name)
    return LoadStateDictInfo(missing_keys=set(expected) - loaded,
                             unexpected_keys=set(files.entries) - set(target_of),
                             mismatched_keys=set(), error_msgs=[], conversion_errors={},
                             skipped_pp_keys=set())
