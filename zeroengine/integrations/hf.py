"""Hugging Face Trainer on zeroengine: ``ZeroTrainer`` is ``transformers.Trainer`` with the
DeepSpeed config handed to zeroengine instead of DeepSpeed. From a DeepSpeed run, one line:

    - args = TrainingArguments(..., deepspeed="ds_config.json")
    - trainer = Trainer(model, args, ...)
    + args = TrainingArguments(...)
    + trainer = ZeroTrainer(model, args, ..., zero_config="ds_config.json")

The config's "auto" values resolve from TrainingArguments as transformers resolves them for
DeepSpeed (batch sizes, accumulation, max_grad_norm, the optimizer's lr / betas / eps /
weight_decay, the scheduler's warmup and total steps, fp16 / bf16; bucket sizes from the
model's hidden size). A key the config leaves out follows TrainingArguments too; a value that
disagrees with TrainingArguments stops the run before training, naming both.

How a step runs (the Trainer's loop is untouched; these are its extension points):
- the Trainer creates its optimizer (or the config's "optimizer" section is built), then
  ``_wrap_model`` builds the engine over the model and that optimizer instead of wrapping the
  model in DistributedDataParallel; the Trainer then holds ``EngineModule`` (forward through
  the engine) and an optimizer whose ``step()`` does nothing, because:
- the accelerator's ``backward`` runs ``engine.backward`` (the Trainer already divided the loss
  by the accumulation steps) and ``engine.step()`` on every micro-batch, with the Trainer's own
  accumulation boundary - as accelerate runs a DeepSpeed engine. The update, with the config's
  clipping, happens at the boundary; the Trainer's gradient norm is the engine's.
- the Trainer's lr scheduler (or the config's "scheduler") is stepped by the Trainer, except
  after a step the engine skipped for an fp16 overflow (as DeepSpeed does).
- checkpoints: ``checkpoint-N/`` holds the engine's sharded checkpoint (any world size loads
  it), the scheduler and the Trainer state; ``save_model`` writes the whole model in the
  Hugging Face format (gathered at stage 3), which ``from_pretrained`` loads.
"""
from __future__ import annotations

import copy
import json
import os
from typing import Any

import torch

from ..config import ConfigError, config_dict
from ._engine_module import EngineModule

try:
    import transformers
    from transformers import Trainer
except ImportError:  # pragma: no cover - the hf extra is installed wherever tests run
    raise ImportError("zeroengine.integrations.hf needs transformers and accelerate: "
                      "pip install 'zeroengine[hf]'") from None

# Tested with 5.24; ZeroTrainer overrides methods the Trainer gained in 5.x
# (_prepare_for_training, _build_accelerator_args).
SUPPORTED = "transformers >= 5.0, < 6"
_HOOKS = ("_prepare_for_training", "_build_accelerator_args", "_wrap_model", "_clip_grad_norm",
          "_get_grad_norm", "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler",
          "_load_from_checkpoint", "create_accelerator_and_postprocess")


def _check_version() -> None:
    major = int(transformers.__version__.split(".")[0])
    missing = [h for h in _HOOKS if not hasattr(Trainer, h)]
    if major != 5 or missing:
        raise ImportError(f"zeroengine's ZeroTrainer supports {SUPPORTED}; found transformers "
                          f"{transformers.__version__}" + (f" (without Trainer.{missing[0]})"
                                                           if missing else ""))


# -- the config against TrainingArguments -----------------------------------------------------
def _node(config: dict, dotted: str, create: bool) -> tuple[dict | None, str]:
    *parents, key = dotted.split(".")
    for part in parents:
        child = config.get(part)
        if not isinstance(child, dict):
            if not create:
                return None, key
            child = config[part] = {}
        config = child
    return config, key


def resolve_training_args(raw: dict, args, num_training_steps: int) -> dict:
    """The config with every "auto" (and every key left out that TrainingArguments decides)
    filled from ``args``, as transformers fills a DeepSpeed config. Raises ConfigError naming
    each value that disagrees with TrainingArguments."""
    config = copy.deepcopy(raw)
    mismatches: list[str] = []

    def fill(dotted: str, value: Any, hf_name: str | None, *, fill_absent: bool = True) -> None:
        node, key = _node(config, dotted, create=fill_absent)
        if node is None:
            return  # e.g. no "optimizer" section: the Trainer builds its own
        current = node.get(key)
        if current == "auto" or (current is None and fill_absent):
            node[key] = value
        elif hf_name is not None and current is not None and current != value:
            mismatches.append(f"- config {dotted}={json.dumps(current)} vs TrainingArguments "
                              f"{hf_name}={json.dumps(value)}")

    world = args.world_size
    fill("train_micro_batch_size_per_gpu", args.per_device_train_batch_size,
         "per_device_train_batch_size")
    fill("gradient_accumulation_steps", args.gradient_accumulation_steps,
         "gradient_accumulation_steps")
    fill("train_batch_size", world * args.per_device_train_batch_size
         * args.gradient_accumulation_steps, "train_batch_size (calculated)")
    fill("gradient_clipping", float(args.max_grad_norm or 0.0), "max_grad_norm")
    fill("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16")
    fill("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16")
    if isinstance(config.get("optimizer"), dict):
        fill("optimizer.params.lr", args.learning_rate, "learning_rate")
        fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2],
             "adam_beta1+adam_beta2", fill_absent=False)
        fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon", fill_absent=False)
        fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay",
             fill_absent=False)
    if isinstance(config.get("scheduler"), dict):
        fill("scheduler.params.warmup_min_lr", 0, None, fill_absent=False)
        fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate",
             fill_absent=False)
        fill("scheduler.params.total_num_steps", num_training_steps,
             "num_training_steps (calculated)", fill_absent=False)
        fill("scheduler.params.warmup_num_steps",
             max(1, args.get_warmup_steps(num_training_steps)), "warmup_steps",
             fill_absent=False)
    if mismatches:
        raise ConfigError("the zeroengine config and TrainingArguments disagree:\n"
                          + "\n".join(mismatches) + "\nSet these config values to \"auto\" (or "
                          "leave them out) and TrainingArguments decides them.")
    return config


# -- what the Trainer holds instead of DDP(model) and its optimizer ----------------------------
class _StepsInBackward(torch.optim.Optimizer):
    """The optimizer the Trainer calls: the engine's param groups (the Trainer's scheduler
    sets their lr), and a ``step`` that does nothing - the engine stepped at the end of the
    accumulation's last backward (``_ZeroAccelerator.backward``). Like accelerate's wrapper it
    skips torch.optim.Optimizer.__init__: it holds no parameters of its own."""

    def __init__(self, engine):  # no super().__init__: see the class docstring
        self._engine = engine
        self.state: dict = {}

    @property
    def param_groups(self):
        return self._engine.optimizer.param_groups

    @property
    def defaults(self):
        return self._engine.optimizer.defaults

    def step(self, closure=None):
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def state_dict(self) -> dict:
        return {}  # the engine's checkpoint holds the optimizer state

    def load_state_dict(self, state_dict: dict) -> None:
        return None


class _SkipAwareScheduler:
    """The Trainer steps its scheduler after every optimizer step; one the engine skipped
    (fp16 overflow) does not advance it, as in DeepSpeed."""

    def __init__(self, inner, engine):
        self.inner, self.engine = inner, engine
        self._skipped = engine.skipped_steps

    def step(self, *args, **kwargs):
        if self.engine.skipped_steps != self._skipped:
            self._skipped = self.engine.skipped_steps
            return None
        return self.inner.step(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _backward_through_engine(accelerator, trainer):
    """The Trainer builds its Accelerator itself (no factory to pass a subclass to); its
    ``backward`` is the one call of the loop that must go to the engine, so it is replaced on
    this instance."""

    def backward(loss, **kwargs):
        engine = trainer._zero_engine
        if engine is None:
            raise RuntimeError("ZeroTrainer: backward before the engine was built")
        engine.set_gradient_accumulation_boundary(accelerator.gradient_state.sync_gradients)
        engine.backward(loss, scale_wrt_gas=False)  # the Trainer divided it already
        engine.step()

    accelerator.backward = backward


class ZeroTrainer(Trainer):
    """``transformers.Trainer`` with zeroengine in place of DDP / DeepSpeed. ``zero_config``:
    a DeepSpeed-style JSON path or dict (Hugging Face "auto" values welcome)."""

    def __init__(self, *args, zero_config: str | os.PathLike | dict | None = None, **kwargs):
        _check_version()
        self._zero_raw = config_dict(zero_config, "ZeroTrainer(zero_config=...)")
        self._zero_engine = None
        self._zero_config: dict | None = None
        self._zero_resume: str | None = None
        super().__init__(*args, **kwargs)
        if getattr(self.args, "deepspeed", None):
            raise ValueError("ZeroTrainer runs the config itself: pass it as "
                             "ZeroTrainer(..., zero_config=...) and leave "
                             "TrainingArguments.deepspeed unset")

    @property
    def engine(self):
        """The ZeroEngine, once train() built it."""
        return self._zero_engine

    # -- accelerator: no autocast / GradScaler (the engine does precision); backward -> engine
    def _build_accelerator_args(self, **kwargs) -> dict:
        built = super()._build_accelerator_args(**kwargs)
        built["mixed_precision"] = "no"
        return built

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        _backward_through_engine(self.accelerator, self)

    # -- building the engine -------------------------------------------------------------------
    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        self._zero_config = resolve_training_args(self._zero_raw, self.args, max_steps)
        return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)

    def create_optimizer(self, model=None):
        if self.optimizer is None and self._zero_config is not None and \
                isinstance(self._zero_config.get("optimizer"), dict):
            # the config's optimizer, as DeepSpeed builds it from the config
            from ..config import parse_config
            from ..core.optim.factory import optimizer_from_config
            section = parse_config({"optimizer": self._zero_config["optimizer"]}).optimizer
            self.optimizer = optimizer_from_config(
                section, [p for p in self.model.parameters() if p.requires_grad])
            return self.optimizer
        return super().create_optimizer(model)

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if self._zero_engine is not None:
            return EngineModule(self._zero_engine) if not isinstance(model, EngineModule) \
                else model
        if not training:
            return model  # evaluate() before train(): plain forward, no engine needed
        import zeroengine
        # the optimizer (the config's or the Trainer's) was built by create_optimizer, and the
        # scheduler is the Trainer's to step (create_scheduler)
        config = {k: v for k, v in self._zero_config.items()
                  if k not in ("optimizer", "scheduler")}
        engine = zeroengine.initialize(self.model, config, optimizer=self.optimizer)
        self._zero_engine = engine
        if self._zero_resume is not None:
            engine.load_checkpoint(self._zero_resume)
            self._zero_resume = None
        self.optimizer = _StepsInBackward(engine)
        return EngineModule(engine)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.lr_scheduler is None and self._zero_engine is not None:
            section = (self._zero_config or {}).get("scheduler")
            if isinstance(section, dict):
                from ..config import parse_config
                from ..core.optim.schedulers import scheduler_from_config
                inner = scheduler_from_config(parse_config({"scheduler": section}).scheduler,
                                              self._zero_engine.optimizer)
            else:
                inner = super().create_scheduler(num_training_steps, optimizer)
            self.lr_scheduler = _SkipAwareScheduler(inner, self._zero_engine)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    # -- the gradient norm is the engine's (clipping is its config's gradient_clipping) -------
    def _clip_grad_norm(self, model):
        return self._zero_engine.get_global_grad_norm()

    def _get_grad_norm(self, model, grad_norm=None):
        norm = self._zero_engine.get_global_grad_norm() if grad_norm is None else grad_norm
        return float(norm) if norm is not None else None

    # -- checkpoints ---------------------------------------------------------------------------
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self._zero_engine.save_checkpoint(  # collective: every rank its shards; complete before
            output_dir, async_save=False)  # the Trainer writes beside it and rotates old ones
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if self._zero_engine is None:
            self._zero_resume = resume_from_checkpoint  # loaded once the engine exists
        else:
            self._zero_engine.load_checkpoint(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, "scheduler.pt")
        if os.path.isfile(path):
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))
            # a scheduler's state does not hold the groups' current lr (a plain Trainer gets it
            # back from optimizer.pt); without this the first resumed step would run with the
            # lr the freshly built scheduler set for step 0
            for group, lr in zip(self._zero_engine.optimizer.param_groups,
                                 self.lr_scheduler.get_last_lr()):
                group["lr"] = lr

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self._zero_engine is None:
            return super().save_model(output_dir, _internal_call)
        # collective: the whole model, gathered from the shards, in the HF format
        state = self._zero_engine.consolidated_state_dict()
        self._save(output_dir if output_dir is not None else self.args.output_dir,
                   state_dict=state)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
