"""Lightning on zeroengine: a ``Strategy`` in place of "ddp" / "deepspeed_stage_N".

    import zeroengine.integrations.lightning      # registers the strategy names below
    trainer = L.Trainer(strategy="zeroengine_stage_3", devices=2, precision="bf16-mixed",
                        accumulate_grad_batches=4, gradient_clip_val=1.0)

Registered names: "zeroengine" (stage 2), "zeroengine_stage_0" ... "zeroengine_stage_3",
"zeroengine_stage_2_offload", "zeroengine_stage_3_offload" (optimizer state and, at stage 3,
parameters in host memory); or ``ZeroStrategy(stage=..., config="ds.json")`` for a full
DeepSpeed-style config. The Trainer's own flags map onto the engine: ``accumulate_grad_batches``,
``gradient_clip_val`` (norm clipping) and ``precision`` ("32-true", "bf16-mixed": bf16 compute
with fp32 master weights, "16-mixed": fp16 with dynamic loss scaling); a config that says
otherwise stops the run naming both settings.

How a step runs: the strategy builds the engine over the LightningModule and the optimizer of
``configure_optimizers`` (one optimizer; its schedulers keep working - they are pointed at the
engine's param groups); the model Lightning calls is ``EngineModule``, so ``training_step`` runs
as the engine's forward. Each backward goes to ``engine.backward`` (Lightning divided the loss by
``accumulate_grad_batches`` already); the engine updates at Lightning's own accumulation
boundary, with the clipping of ``gradient_clip_val``. Stage 3 models can be built sharded in
``configure_model`` (zero_init). ``trainer.save_checkpoint`` / ``ModelCheckpoint`` write the
engine's sharded checkpoint into a directory at the checkpoint's path (with Lightning's own
state in it); ``fit(ckpt_path=...)`` resumes from it at any world size.
"""
from __future__ import annotations

import contextlib
import copy
import os
from typing import Any

import torch

from ..config import ConfigError, config_dict
from ._engine_module import EngineModule

try:
    import lightning
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError:  # pragma: no cover - the lightning extra is installed wherever tests run
    raise ImportError("zeroengine.integrations.lightning needs Lightning: "
                      "pip install 'zeroengine[lightning]'") from None

SUPPORTED = "lightning >= 2.2, < 3"  # tested: 2.6


def _check_version() -> None:
    major, minor = (int(x) for x in lightning.__version__.split(".")[:2])
    if major != 2 or minor < 2:
        raise ImportError(f"zeroengine's ZeroStrategy supports {SUPPORTED}; found lightning "
                          f"{lightning.__version__}")


# Lightning's precision flag -> the engine's precision section
_PRECISION = {"32-true": None, "32": None, "bf16-mixed": "bf16", "16-mixed": "fp16"}


class _EnginePrecision(Precision):
    """Lightning's precision plugin, with the work done by the engine: no autocast or
    GradScaler (the engine keeps bf16/fp16 parameters and fp32 masters), backward through
    ``engine.backward``, clipping by the engine's ``gradient_clipping``."""

    def __init__(self, strategy: "ZeroStrategy", precision: str):
        super().__init__()
        self.strategy = strategy
        self.precision = precision

    def convert_input(self, data):
        """Floating-point inputs in the compute dtype, as DeepSpeed's precision plugin does
        (the parameters are bf16/fp16; there is no autocast)."""
        dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(self.precision)
        if dtype is None:
            return data
        from lightning.fabric.utilities.apply_func import apply_to_collection
        return apply_to_collection(data, torch.Tensor,
                                   lambda t: t.to(dtype) if t.is_floating_point() else t)

    def backward(self, tensor, model, optimizer, *args, **kwargs) -> None:
        self.strategy._engine_backward(tensor)

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=None) -> None:
        return None  # the engine clips at its step (config gradient_clipping)


class ZeroStrategy(DDPStrategy):
    strategy_name = "zeroengine"

    def __init__(self, stage: int | None = None, config: str | os.PathLike | dict | None = None,
                 offload_optimizer: bool = False, offload_parameters: bool = False,
                 offload_optimizer_device: str = "cpu", offload_params_device: str = "cpu",
                 nvme_path: str = "/local_nvme", params_buffer_count: int = 5,
                 params_buffer_size: int = 100_000_000, max_in_cpu: int = 1_000_000_000,
                 optimizer_buffer_count: int = 4, pin_memory: bool = False,
                 block_size: int = 1_048_576, queue_depth: int = 8, thread_count: int = 1,
                 single_submit: bool = False, overlap_events: bool = True, **ddp_kwargs: Any):
        """Lightning's DeepSpeedStrategy arguments where they mean the same: ``stage``,
        ``config`` (a DeepSpeed-style dict or JSON path), ``offload_optimizer`` /
        ``offload_parameters`` to ``offload_optimizer_device`` / ``offload_params_device``
        ("cpu" or "nvme", under ``nvme_path``) with ``pin_memory``, and for NVMe the swap
        buffers (``params_buffer_count`` x ``params_buffer_size`` read ahead, ``max_in_cpu``
        cached, ``optimizer_buffer_count``) and the ``aio`` settings (``block_size``,
        ``queue_depth``, ``thread_count``, ``single_submit``, ``overlap_events``), as
        DeepSpeedStrategy writes them into its config; the rest go to DDPStrategy."""
        _check_version()
        super().__init__(**ddp_kwargs)
        raw = config_dict(config, "ZeroStrategy(config=...)")
        zero = raw.setdefault("zero_optimization", {})
        if stage is not None:
            if "stage" in zero and zero["stage"] != stage:
                raise ConfigError(f"ZeroStrategy(stage={stage}) and the config's "
                                  f"zero_optimization.stage {zero['stage']} disagree; give one")
            zero["stage"] = stage
        zero.setdefault("stage", 2)
        swap_buffers = {"offload_optimizer": {"buffer_count": optimizer_buffer_count},
                        "offload_param": {"buffer_count": params_buffer_count,
                                          "buffer_size": params_buffer_size,
                                          "max_in_cpu": max_in_cpu}}
        for on, key, device, arg in (
                (offload_optimizer, "offload_optimizer", offload_optimizer_device,
                 "offload_optimizer_device"),
                (offload_parameters, "offload_param", offload_params_device,
                 "offload_params_device")):
            if device not in ("cpu", "nvme"):
                raise ConfigError(f"ZeroStrategy({arg}={device!r}): expected 'cpu' or 'nvme'")
            if on:
                zero[key] = {"device": device, "pin_memory": pin_memory}
                if device == "nvme":
                    zero[key].update(nvme_path=nvme_path, **swap_buffers[key])
                    raw.setdefault("aio", {
                        "block_size": block_size, "queue_depth": queue_depth,
                        "thread_count": thread_count, "single_submit": single_submit,
                        "overlap_events": overlap_events})
        self._zero_raw = raw
        self.engine = None
        self._stepping = False  # inside optimizer_step's closure: the backward ends a group

    # -- the config against the Trainer's flags ------------------------------------------------
    def _resolved_config(self, trainer: "pl.Trainer") -> dict:
        config = copy.deepcopy(self._zero_raw)
        mismatches = []

        def fill(dotted: str, value, flag: str) -> None:
            *parents, key = dotted.split(".")
            node = config
            for part in parents:
                node = node.setdefault(part, {})
            current = node.get(key)
            if current is None or current == "auto":
                node[key] = value
            elif current != value:
                mismatches.append(f"- config {dotted}={current!r} vs Trainer {flag}={value!r}")

        precision = str(trainer.precision)
        if precision not in _PRECISION:
            raise ConfigError(f"ZeroStrategy: Trainer(precision={precision!r}) is not supported;"
                              " zeroengine keeps fp32 master weights: use \"32-true\", "
                              "\"bf16-mixed\" or \"16-mixed\"")
        dtype = _PRECISION[precision]
        fill("bf16.enabled", dtype == "bf16", "precision")
        fill("fp16.enabled", dtype == "fp16", "precision")
        fill("gradient_accumulation_steps", trainer.accumulate_grad_batches,
             "accumulate_grad_batches")
        if trainer.gradient_clip_algorithm not in (None, "norm"):
            raise ConfigError("ZeroStrategy clips the gradient norm (gradient_clip_algorithm="
                              f"'norm'); {trainer.gradient_clip_algorithm!r} is not supported")
        fill("gradient_clipping", float(trainer.gradient_clip_val or 0.0), "gradient_clip_val")
        if mismatches:
            raise ConfigError("the zeroengine config and the Lightning Trainer disagree:\n"
                              + "\n".join(mismatches) + "\nLeave these out of the config (or "
                              "set them to \"auto\") and the Trainer decides them.")
        config.pop("train_batch_size", None)  # Lightning's data loader decides the batch
        return config

    # -- setup ---------------------------------------------------------------------------------
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        config = self._resolved_config(trainer)
        self.precision_plugin = _EnginePrecision(self, str(trainer.precision))
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING and self.engine is None:
            if not self.lightning_module.automatic_optimization:
                raise ConfigError("ZeroStrategy runs automatic optimization; manual "
                                  "optimization (self.manual_backward / opt.step()) is not "
                                  "supported yet: use automatic optimization, or zeroengine's "
                                  "own loop")
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise ConfigError(f"ZeroStrategy supports one optimizer; configure_optimizers "
                                  f"returned {len(self.optimizers)}")
            import zeroengine
            self.engine = zeroengine.initialize(self.lightning_module, config,
                                                optimizer=self.optimizers[0])
            # the schedulers of configure_optimizers set the lr of the groups the engine steps
            for scheduler_config in self.lr_scheduler_configs:
                scheduler_config.scheduler.optimizer = self.engine.optimizer
        if self.engine is not None:
            self.model = EngineModule(self.engine)

    def _setup_model(self, model):
        return model  # no DistributedDataParallel: the engine does the data-parallel work

    def configure_ddp(self) -> None:
        return None

    @contextlib.contextmanager
    def model_sharded_context(self):
        """``configure_model`` builds the model here: directly sharded at stage 3."""
        import zeroengine
        with zeroengine.zero_init(self._zero_raw):
            yield

    def teardown(self) -> None:
        if self.engine is None:
            return super().teardown()
        # Lightning's teardown moves the module to the CPU (module.cpu()), which reads every
        # parameter: at stage 3 they are shards the engine owns. They stay where they are.
        assert self.accelerator is not None
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @property
    def handles_gradient_accumulation(self) -> bool:
        return False  # Lightning decides the boundary; _engine_backward follows it

    # -- backward and step ---------------------------------------------------------------------
    def pre_backward(self, closure_loss) -> None:
        return None  # DDP's prepare_for_backward: nothing to prepare

    def post_backward(self, closure_loss) -> None:
        return None

    def _engine_backward(self, loss: torch.Tensor) -> None:
        engine = self.engine
        engine.set_gradient_accumulation_boundary(self._stepping)
        engine.backward(loss, scale_wrt_gas=False)  # Lightning divided it already
        if not self._stepping:
            engine.step()  # a micro-batch that accumulates: counted, no update

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        """Lightning's step at its accumulation boundary: the closure runs training_step and
        the group's last backward; then the engine updates (clipping included)."""
        self._stepping = True
        try:
            result = closure()
        finally:
            self._stepping = False
        self.precision_plugin._after_closure(self.lightning_module, optimizer)
        self.engine.step()
        return result

    # -- checkpoints: the engine's sharded format, in a directory at the checkpoint path ------
    def lightning_module_state_dict(self) -> dict:
        return {} if self.engine is not None else super().lightning_module_state_dict()

    def optimizer_state(self, optimizer) -> dict:
        return {}

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine's checkpoint restores it

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine must exist to load its checkpoint

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError("ZeroStrategy writes the engine's own checkpoint format; "
                            "storage_options are not supported")
        filepath = self.broadcast(str(filepath))
        state = {k: v for k, v in checkpoint.items() if k not in ("state_dict",
                                                                 "optimizer_states")}
        self.engine.save_checkpoint(filepath, tag="checkpoint", client_state=state,
                                    async_save=False)  # Lightning may move it next

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        checkpoint_path = self.broadcast(str(checkpoint_path))
        _, state = self.engine.load_checkpoint(checkpoint_path)
        state = dict(state or {})
        # a scheduler's state does not hold the groups' current lr (Lightning's would come back
        # with the optimizer state it does not restore here)
        for scheduler_config, saved in zip(self.lr_scheduler_configs,
                                           state.get("lr_schedulers", [])):
            scheduler_config.scheduler.load_state_dict(saved)
            for group, lr in zip(self.engine.optimizer.param_groups,
                                 scheduler_config.scheduler.get_last_lr()):
                group["lr"] = lr
        return state

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        return None  # loaded with the engine's checkpoint

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            import shutil
            shutil.rmtree(filepath, ignore_errors=True)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register("zeroengine", cls, description="zeroengine ZeRO stage 2",
                                   stage=2, override=True)
        for stage in range(4):
            strategy_registry.register(f"zeroengine_stage_{stage}", cls,
                                       description=f"zeroengine ZeRO stage {stage}",
                                       stage=stage, override=True)
        strategy_registry.register("zeroengine_stage_2_offload", cls,
                                   description="zeroengine stage 2, optimizer state on the host",
                                   stage=2, offload_optimizer=True, override=True)
        strategy_registry.register("zeroengine_stage_3_offload", cls,
                                   description="zeroengine stage 3, optimizer state and "
                                   "parameters on the host", stage=3, offload_optimizer=True,
                                   offload_parameters=True, override=True)


ZeroStrategy.register_strategies(StrategyRegistry)
