"""Ray Train: a 2-worker CPU TorchTrainer runs the engine on Ray's own process group, reports
metrics and sharded checkpoints to Ray, and a second run resumed from Ray's checkpoint ends
where uninterrupted plain single-process training ends. Needs the `ray` extra (CI installs it)."""
from __future__ import annotations

import os
import uuid

import pytest
import torch

ray = pytest.importorskip("ray", reason="the optional `ray` extra is not installed "
                          "(pip install 'zeroengine[ray]')")

from zeroengine.checkpoint.format import META, rank_file  # noqa: E402
from zeroengine.integrations import ray as zray  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))
from harness import max_relative_error, reference_train  # noqa: E402


def train_func(config):
    import torch.distributed as dist
    from harness import make_model, make_optimizer, param_groups, run_step

    import zeroengine
    assert dist.is_initialized()  # Ray built the group; initialize must join it, not rebuild
    model = make_model()
    engine = zeroengine.initialize(
        model, {"zero_optimization": {"stage": config["stage"], "reduce_bucket_size": 40}},
        optimizer=make_optimizer("adamw", param_groups(model)))
    start = zray.restore(engine)
    for step in range(start, config["steps"]):
        losses = run_step(engine, step, 1)
        zray.report(engine, {"loss": losses[0], "rank_world": [engine.comm.rank,
                                                               engine.comm.world_size]},
                    checkpoint=(step + 1) % 2 == 0)
    state = engine.consolidated_state_dict()
    if engine.comm.rank == 0:
        torch.save({"state": state, "start": start}, config["out"])


@pytest.fixture(scope="module")
def local_ray():
    # The workers import this module (train_func is pickled by reference) and tests/harness.py.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                 [TESTS, os.environ.get("PYTHONPATH", "")])}})
    yield
    ray.shutdown()


@pytest.mark.parametrize("stage", [3])
def test_ray_train_checkpoint_and_resume_match_plain_training(local_ray, tmp_path, stage):
    config = {"stage": stage, "steps": 4, "out": str(tmp_path / "a.pt")}
    name, storage = f"ze-{uuid.uuid4().hex[:8]}", str(tmp_path / "ray")
    first = zray.trainer(train_func, config, num_workers=2, name=name,
                         storage_path=storage).fit()
    assert first.error is None, first.error
    assert first.metrics["global_step"] == 4 and first.metrics["rank_world"] == [0, 2]
    with first.checkpoint.as_directory() as path:
        files = sorted(os.listdir(os.path.join(path, "zeroengine")))
    # Both workers' shards were assembled into the one checkpoint Ray keeps.
    assert files == sorted([META] + [rank_file(r, ext) for r in (0, 1)
                                     for ext in ("pt", "safetensors")]), files

    config.update(steps=6, out=str(tmp_path / "b.pt"))
    # The same name and storage path: Ray restores the run, restore() loads its checkpoint.
    second = zray.trainer(train_func, config, num_workers=2, name=name,
                          storage_path=storage).fit()
    assert second.error is None, second.error
    out = torch.load(config["out"], weights_only=True)
    assert out["start"] == 4 and second.metrics["global_step"] == 6
    err, where = max_relative_error(out["state"], reference_train("adamw", 2, 6, 1, 0.0))
    assert err < 1e-5, (err, where)
