"""Build a torch optimizer from the config's "optimizer" section, and the inner optimizers the
sharded step runs (the user's class and hyperparameters over the rank's shards)."""
from __future__ import annotations

import inspect
import json

import torch

from ...config import AUTO, ConfigError, OptimizerConfig
from ...ops import CPUAdam, FusedAdam, Lamb, load_cuda_kernels
from .kind import check_class

# DeepSpeed optimizer names that torch does not provide.
NOT_IN_TORCH = {
    "onebitadam": "1-bit Adam compresses communication, which zeroengine does not do",
    "zerooneadam": "0/1 Adam compresses communication, which zeroengine does not do",
    "onebitlamb": "1-bit LAMB compresses communication, which zeroengine does not do",
    "lion": "torch.optim has no Lion; pass a Lion optimizer object to initialize() instead",
    "muadam": "MuP optimizers are not built in; pass the optimizer object instead",
    "muadamw": "MuP optimizers are not built in; pass the optimizer object instead",
    "musgd": "MuP optimizers are not built in; pass the optimizer object instead",
}
# DeepSpeed's config Adam/AdamW (its FusedAdam / DeepSpeedCPUAdam) default weight_decay is 0.0;
# torch's AdamW has 0.01: a DeepSpeed config that says nothing means 0.0.
DEEPSPEED_ADAM_DEFAULTS = {"weight_decay": 0.0}
# What "auto" becomes outside the Hugging Face Trainer: TrainingArguments' defaults (adam_beta1,
# adam_beta2, adam_epsilon, weight_decay), which the Trainer would have filled in. The learning
# rate has no such default worth guessing: "auto" there is refused.
HF_AUTO_DEFAULTS = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
# Keys that choose an implementation, not a hyperparameter: not copied between groups.
IMPLEMENTATION_KEYS = ("params", "foreach", "fused", "capturable")


def _torch_optimizer_class(name: str) -> type:
    key = name.lower()
    if key == "lamb":  # DeepSpeed's Lamb: zeroengine's own (torch has none)
        return Lamb
    if key in NOT_IN_TORCH:
        raise ConfigError(f"optimizer.type {name!r} is not supported: {NOT_IN_TORCH[key]}")
    for attr in dir(torch.optim):
        cls = getattr(torch.optim, attr)
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and \
                attr.lower() == key and attr != "Optimizer":
            return cls
    known = sorted(a for a in dir(torch.optim) if isinstance(getattr(torch.optim, a), type)
                   and issubclass(getattr(torch.optim, a), torch.optim.Optimizer)
                   and a != "Optimizer" and a not in ("LBFGS", "SparseAdam"))
    raise ConfigError(f"optimizer.type {name!r} is not a torch.optim optimizer; use one of "
                      f"{', '.join(known)}")


def optimizer_from_config(cfg: OptimizerConfig, params) -> torch.optim.Optimizer:
    """The optimizer the config describes, over ``params`` (tensors or param-group dicts)."""
    kwargs = dict(cfg.params)
    name = cfg.type
    if "max_grad_norm" in kwargs:  # old BERT configs; DeepSpeed refuses it the same way
        raise ConfigError("optimizer.params.max_grad_norm: clipping is not an optimizer "
                          "argument; set the top-level \"gradient_clipping\": "
                          f"{json.dumps(kwargs['max_grad_norm'])} instead (as DeepSpeed asks)")
    cls = None
    if name.lower() in ("adam", "adamw"):
        kwargs = _deepspeed_adam(kwargs)
        # DeepSpeed's "Adam" decouples weight decay unless told otherwise (adam_w_mode=True).
        adamw = kwargs.pop("adam_w_mode")
        name = "AdamW" if adamw else "Adam"
        if kwargs.pop("bias_correction") is False:
            # torch's Adam always corrects the moments' bias; zeroengine's Adam (the CPU
            # offload one: plain torch ops on any device) can leave it out, as DeepSpeed's
            # FusedAdam does
            cls = CPUAdam
            kwargs.update(adamw_mode=adamw, bias_correction=False)
    cls = cls or _torch_optimizer_class(name)
    check_class(cls)
    signature = inspect.signature(cls.__init__)
    for key, value in list(kwargs.items()):
        if key not in signature.parameters:
            accepted = [p for p in signature.parameters if p not in ("self", "params")]
            raise ConfigError(f"optimizer.params.{key} is not an argument of {cls.__name__}; "
                              f"accepted: {', '.join(accepted)}")
        if value == AUTO:
            kwargs[key] = _resolve_auto_param(cls, key, signature.parameters[key].default)
    if isinstance(kwargs.get("betas"), list):
        kwargs["betas"] = tuple(kwargs["betas"])
    try:
        return cls(params, **kwargs)
    except (TypeError, ValueError) as err:
        hint = ""
        if cls.__name__ == "Muon":
            hint = ("; Muon takes only the 2-D weight matrices: build it in code, e.g. "
                    "initialize(model, config, optimizer=[Muon(matrices), AdamW(the rest)])")
        raise ConfigError(f"optimizer {cls.__name__} refused its params: {err}{hint}") from None


def _deepspeed_adam(kwargs: dict) -> dict:
    """A DeepSpeed Adam/AdamW section's params with DeepSpeed's meaning, for torch's class."""
    # DeepSpeed's switch between its FusedAdam (weight_decay 0 unless given) and torch's class,
    # which then keeps torch's defaults: AdamW's weight_decay is 0.01 there
    torch_adam = kwargs.pop("torch_adam", False) in (True, "true", "True")
    if not torch_adam:
        kwargs = {**DEEPSPEED_ADAM_DEFAULTS, **kwargs}
    kwargs.setdefault("adam_w_mode", True)
    kwargs.setdefault("bias_correction", True)
    return kwargs


def _resolve_auto_param(cls: type, key: str, default):
    """An optimizer hyperparameter given as "auto" outside the Hugging Face Trainer."""
    from ...config.policy import notice
    if key == "lr":
        raise ConfigError("optimizer.params.lr is 'auto', which only the Hugging Face Trainer "
                          "fills in (from TrainingArguments.learning_rate); give a number, or "
                          "pass an optimizer object to initialize()")
    if key in HF_AUTO_DEFAULTS:
        value = HF_AUTO_DEFAULTS[key]
        source = "the Hugging Face TrainingArguments default"
    elif default is not inspect.Parameter.empty:
        value, source = default, f"{cls.__name__}'s default"
    else:
        raise ConfigError(f"optimizer.params.{key}: 'auto' cannot be resolved, {cls.__name__} "
                          "has no default for it; give a value")
    notice(f"optimizer.params.{key}", f"'auto' resolved to {value!r} ({source})")
    return value


def build_inner(optimizer: torch.optim.Optimizer, groups: list[dict]) -> torch.optim.Optimizer:
    """A fresh optimizer of ``optimizer``'s class and hyperparameters over ``groups``.

    When the user left the implementation to torch (``fused`` and ``foreach`` unset) and the
    class has a fused kernel for the device, it is used: the shards are a few large flat
    tensors, where one fused pass beats the per-op loop several times over.
    """
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    # defaults may hold derived keys the constructor does not take (AdamW's
    # decoupled_weight_decay); every group carries them anyway.
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    params = [g["params"] for g in groups]
    if "fused" in defaults and defaults.get("fused") is None and \
            defaults.get("foreach") is None and not defaults.get("differentiable", False):
        try:
            return cls(groups, **{**defaults, "fused": True})
        except (RuntimeError, ValueError, TypeError):
            for group, p in zip(groups, params):
                group["params"] = p  # the failed constructor may have rewrapped them
    return cls(groups, **defaults)


def cpu_adam_mode(optimizer: torch.optim.Optimizer) -> bool | None:
    """Whether ``optimizer`` is an Adam/AdamW that CPUAdam computes exactly: its adamw_mode,
    or None when an option needs torch's own implementation (amsgrad, maximize, tensor lr,
    differentiable, capturable) or the class is not torch's Adam/AdamW."""
    cls = type(optimizer)
    if cls not in (torch.optim.Adam, torch.optim.AdamW):
        return None
    for group in optimizer.param_groups:
        if any(group.get(k) for k in ("amsgrad", "maximize", "differentiable", "capturable")) \
                or torch.is_tensor(group["lr"]):
            return None
    decoupled = optimizer.defaults.get("decoupled_weight_decay")
    return cls is torch.optim.AdamW if decoupled is None else bool(decoupled)


def build_host_inner(optimizer: torch.optim.Optimizer, groups: list[dict]) -> torch.optim.Optimizer:
    """The optimizer of an offloaded step, over host fp32 tensors: CPUAdam (one pass, and the
    bf16/fp16 copy-out in the same pass) for torch's Adam/AdamW, else the user's class."""
    adamw = cpu_adam_mode(optimizer)
    if adamw is None:
        return build_inner(optimizer, groups)
    d = optimizer.defaults
    return CPUAdam(groups, lr=d["lr"], betas=d["betas"], eps=d["eps"],
                   weight_decay=d["weight_decay"], adamw_mode=adamw)


def build_device_inner(optimizer: torch.optim.Optimizer, groups: list[dict],
                       device: torch.device) -> torch.optim.Optimizer:
    """The optimizer of a step on the compute device: on CUDA, for torch's Adam/AdamW and where
    the kernels of csrc/cuda load, FusedAdam (unscale, update, inf/NaN check and bf16/fp16
    copy-out in one pass); else build_inner (torch's own fused kernel where it has one)."""
    adamw = cpu_adam_mode(optimizer)
    if device.type != "cuda" or adamw is None or optimizer.defaults.get("foreach") is not None \
            or optimizer.defaults.get("fused") is False or load_cuda_kernels() is None:
        return build_inner(optimizer, groups)
    d = optimizer.defaults
    return FusedAdam(groups, lr=d["lr"], betas=d["betas"], eps=d["eps"],
                     weight_decay=d["weight_decay"], adamw_mode=adamw)


def build_mixed_inner(optimizer: torch.optim.Optimizer, groups: list[dict],
                      precision) -> torch.optim.Optimizer:
    """The optimizer of a step over 16-bit masters and/or states (OptimizerPrecision): CPUAdam
    with its mixed pass (the C++ kernel on the CPU, the same arithmetic in PyTorch elsewhere),
    for an Adam/AdamW that ``cpu_adam_mode`` accepts (the caller checks)."""
    d = optimizer.defaults
    return CPUAdam(groups, lr=d["lr"], betas=d["betas"], eps=d["eps"],
                   weight_decay=d["weight_decay"], adamw_mode=cpu_adam_mode(optimizer),
                   state_dtype=precision.states, stochastic_rounding=precision.stochastic,
                   rounding_seed=precision.seed)
