"""Ray Train: run a zeroengine training function under ``ray.train.torch.TorchTrainer``.

Ray's workers start with a gloo/NCCL group already built; ``zeroengine.initialize`` joins it as
it is (no second ``init_process_group``). What Ray adds is where metrics and checkpoints go:

    from zeroengine.integrations import ray as zray

    def train_func(config):
        engine = zeroengine.initialize(build_model(), config["zero"])
        start = zray.restore(engine)                 # resume from Ray's checkpoint, if any
        for step in range(start, config["steps"]):
            loss = ...; engine.backward(loss); engine.step()
            zray.report(engine, {"loss": loss.item()}, checkpoint=(step + 1) % 100 == 0)

    result = zray.trainer(train_func, {"zero": "config.json", "steps": 1000},
                          num_workers=8, use_gpu=True).fit()

A checkpoint is the engine's own sharded format: every worker saves its shards to a directory
of its own and reports it; Ray assembles the workers' directories into one checkpoint, which
``restore`` (or ``engine.load_checkpoint`` / ``zeroengine consolidate`` on its path) reads at any
world size. Needs ``pip install zeroengine[ray]``.
"""
from __future__ import annotations

import shutil
import tempfile
from typing import Any, Callable

_TAG = "zeroengine"  # one checkpoint per Ray checkpoint directory


def _ray_train():
    try:
        import ray.train
    except ImportError:
        raise ImportError("zeroengine.integrations.ray needs Ray Train: "
                          "pip install 'zeroengine[ray]' (or 'ray[train]')") from None
    return ray.train


def report(engine, metrics: dict[str, Any], checkpoint: bool = False) -> None:
    """Report ``metrics`` to Ray from every worker (Ray requires all of them to call it); with
    ``checkpoint``, save the engine's sharded checkpoint with them. Collective either way."""
    train = _ray_train()
    metrics = {**metrics, "global_step": engine.global_steps}
    if not checkpoint:
        train.report(metrics)
        return
    local = tempfile.mkdtemp(prefix="zeroengine-ray-")
    try:
        engine.save_checkpoint(local, tag=_TAG, node_local=True,
                               async_save=False)  # Ray uploads the directory next
        # Ray copies the directory into its storage before report returns.
        train.report(metrics, checkpoint=train.Checkpoint.from_directory(local))
    finally:
        shutil.rmtree(local, ignore_errors=True)


def restore(engine, **load_options) -> int:
    """Load Ray's latest checkpoint for this run into ``engine`` (the last one reported before
    a worker-group restart, or by an earlier ``fit()`` of a trainer with the same name and
    storage path); returns the step to start from (``engine.global_steps``, 0 when there is
    nothing to restore)."""
    ckpt = _ray_train().get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as path:
            engine.load_checkpoint(path, tag=_TAG, **load_options)
    return engine.global_steps


def trainer(train_func: Callable[[dict], None], train_loop_config: dict | None = None, *,
            num_workers: int = 2, use_gpu: bool = False, name: str | None = None,
            storage_path: str | None = None, max_failures: int = 0):
    """A ``TorchTrainer`` for ``train_func`` with the usual settings spelled out; ``.fit()``
    runs it, and fitting a trainer of the same ``name`` and ``storage_path`` again continues
    that run from its last checkpoint (through ``restore``). Anything more specific: build
    ``ray.train.torch.TorchTrainer`` directly, the functions above work the same inside it."""
    train = _ray_train()
    from ray.train.torch import TorchTrainer
    return TorchTrainer(
        train_func, train_loop_config=train_loop_config,
        scaling_config=train.ScalingConfig(num_workers=num_workers, use_gpu=use_gpu),
        run_config=train.RunConfig(name=name, storage_path=storage_path,
                                   failure_config=train.FailureConfig(max_failures=max_failures)))
