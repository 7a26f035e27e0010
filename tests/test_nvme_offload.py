"""NVMe offload of the optimizer (offload_optimizer.device "nvme"): the master and Adam's moments
live in swap files and come in a sub-group tile at a time, and the run's numbers are those of
the CPU-offload run (the same CPUAdam on the same values: bitwise), at stages 1-3, fp32 and
bf16, with and without pipelined reads and writes. Checkpoints of an NVMe run load into a
CPU-offload run at another world size and back; swap files go away at close."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from harness import (
    checkpoint_reference,
    make_model,
    make_optimizer,
    max_relative_error,
    param_groups,
    run_step,
    train_engine,
)

import zeroengine
from zeroengine import ConfigError
from zeroengine.core.offload.swap_files import ROOT_NAME
from zeroengine.testing import run_ranks

STEPS = 4
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def nvme_config(stage, precision, device, path, pipeline=False, sub_group=100):
    """``device``: offload_optimizer's; "<device>+params" puts stage 3's parameter shard on
    the drive too (offload_param "nvme", with a cache smaller than the shard)."""
    device, _, params = device.partition("+")
    cfg = {"gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
           "zero_optimization": {
               "stage": stage, "reduce_bucket_size": 40,
               "sub_group_size": sub_group,  # several tiles per step
               "stage3_param_persistence_threshold": 20,
               "offload_optimizer": {"device": device, "nvme_path": path,
                                     "pipeline_read": pipeline, "pipeline_write": pipeline}}}
    if params:
        cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": path,
                                                     "max_in_cpu": 100}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 10}
    return cfg


def train(cases, path):
    out = []
    for stage, precision, device, pipeline, opt in cases:
        engine, losses = train_engine(nvme_config(stage, precision, device, path, pipeline),
                                      opt, STEPS, 2)
        swap = engine.optimizer.swap
        out.append((engine.consolidated_state_dict(), losses, engine.memory_report(),
                    None if swap is None else (swap.stats.read_bytes, swap.stats.write_bytes,
                                               len(swap.tiles), swap.dir.path,
                                               swap.tile_capacity, swap.total,
                                               len(swap.slots))))
        engine.close()
    return out


# (stage, precision, pipelined, optimizer)
CASES = [(s, p, s == 2, "adamw") for s in (1, 2, 3) for p in ("fp32", "bf16")] + \
    [(2, "fp32", False, "adamw"), (3, "bf16", True, "adamw"), (2, "fp16", True, "adamw"),
     (3, "fp32", False, "sgd")]


def case_id(case):
    stage, precision, pipelined, opt = case
    return f"stage{stage}-{precision}-{opt}" + ("-pipelined" if pipelined else "")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("nvme"))
    runs = [(s, p, "cpu", False, o) for s, p, _, o in CASES] + \
        [(s, p, "nvme", pipe, o) for s, p, pipe, o in CASES]
    per_rank = run_ranks(2, train, runs, path)
    results = {index: r for index, r in enumerate(zip(*per_rank))}
    return path, {case: (results[i], results[len(CASES) + i]) for i, case in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_nvme_run_equals_the_cpu_offload_run(trained, case):
    _, runs = trained
    cpu, nvme = runs[case]
    for rank in range(2):
        err, where = max_relative_error(nvme[rank][0], cpu[rank][0])
        assert err == 0.0, f"rank {rank}: {err:.2e} at {where}"
        assert nvme[rank][1] == cpu[rank][1]  # the losses of every micro-step


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_states_live_on_the_drive_and_stream_a_tile_at_a_time(trained, case):
    stage, precision, pipelined, opt = case
    path, runs = trained
    report = runs[case][1][0][2]
    read, written, tiles, swap_dir, capacity, total, slots = runs[case][1][0][3]
    assert tiles > 2 and slots == (3 if pipelined else 1)
    kinds = 3 if opt == "adamw" else 2  # master + exp_avg, exp_avg_sq / momentum_buffer
    assert report["nvme_optimizer_states"] == kinds * 4 * total
    # in host memory: the tiles' slots only (no master, no moments), and no shard-sized fp32
    # gradient copy either (bf16 gradients are converted a tile at a time)
    assert report["host_optimizer_states"] == slots * kinds * 4 * capacity
    assert report["host_grads"] == 0
    # every step read and wrote every tile's master and state (the first read only masters;
    # a loss-scale overflow step reads nothing)
    skipped = 1 if precision == "fp16" else 0
    assert written >= (STEPS - skipped) * kinds * 4 * total
    assert read >= (STEPS - 1 - skipped) * kinds * 4 * total
    assert not os.path.exists(swap_dir)  # removed by engine.close()
    assert os.listdir(os.path.join(path, ROOT_NAME)) == []


def swapped_out(path):
    engine, _ = train_engine(nvme_config(2, "fp32", "nvme", path), "adamw", 1, 2)
    master = engine.flat_groups[0].master_segments[0]
    state = engine.optimizer.swap._states(0)[master]
    out = (master.numel(), state["exp_avg"].numel(), state["step"])
    with pytest.raises(RuntimeError, match="engine.save_checkpoint"):
        engine.optimizer.state_dict()
    with pytest.raises(RuntimeError, match="nvme"):
        engine.optimizer.load_state_dict({})
    engine.close()
    return out


def test_swapped_out_tensors_are_empty_and_whole_state_dicts_refused(tmp_path):
    """Between steps nothing of the master or moments is in memory: a tensor the step left
    behind is empty (a read fails loudly), and optimizer.state_dict(), which would need it all
    in memory, is refused in favour of checkpoints."""
    out = run_ranks(2, swapped_out, str(tmp_path))
    assert all(o == (0, 0, 1) for o in out)


def test_tensorwise_optimizer_is_refused_by_name(tmp_path):
    model = make_model()
    opt = make_optimizer("lamb", param_groups(model))
    with pytest.raises(ValueError, match="Lamb.*tensor-wise.*'cpu'"):
        zeroengine.initialize(model, nvme_config(2, "fp32", "nvme", str(tmp_path)),
                              optimizer=opt)


def test_config_names_what_nvme_needs():
    with pytest.raises(ConfigError, match="offload_optimizer.nvme_path"):
        zeroengine.parse_config({"zero_optimization": {
            "stage": 2, "offload_optimizer": {"device": "nvme"}}})
    with pytest.raises(ConfigError, match="aio.block_size"):
        zeroengine.parse_config({"aio": {"block_size": 5000}})
    cfg = zeroengine.parse_config({
        "zero_optimization": {"stage": 3, "offload_optimizer": {
            "device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 4,
            "pipeline_read": True, "pipeline_write": True, "fast_init": False}},
        "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1,
                "single_submit": False, "overlap_events": True}})
    assert cfg.zero_optimization.offload_optimizer.pipeline_read is True
    assert cfg.aio.queue_depth == 8


# -- checkpoints -------------------------------------------------------------------------------
SAVE_AT = 2


def ckpt_engine(stage, device, path, seed=0):
    model = make_model(seed)
    opt = make_optimizer("adamw", param_groups(model))
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.9)
    os.makedirs(path, exist_ok=True)
    cfg = nvme_config(stage, "fp32", device, path)
    cfg.pop("gradient_accumulation_steps")
    cfg.pop("gradient_clipping")
    return zeroengine.initialize(model, cfg, optimizer=opt, lr_scheduler=sched)


def save_nvme(root, stage, device):
    engine = ckpt_engine(stage, device, os.path.join(root, "swap"))
    for step in range(SAVE_AT):
        run_step(engine, step, 1)
    engine.save_checkpoint(os.path.join(root, "ckpt"))
    state = engine.consolidated_state_dict()
    engine.close()
    return state


def resume(root, stage, device, steps):
    engine = ckpt_engine(stage, device, os.path.join(root, "swap"), seed=7)
    engine.load_checkpoint(os.path.join(root, "ckpt"))
    for step in range(SAVE_AT, steps):
        run_step(engine, step, 1)
    state = engine.consolidated_state_dict()
    engine.close()
    return state


# (saved world, stage, device) -> (loaded world, stage, device)
RESHARDS = [((2, 2, "nvme"), (1, 1, "cpu")), ((2, 1, "cpu"), (2, 3, "nvme")),
            ((2, 3, "nvme"), (2, 2, "nvme")),
            # parameters on the drive too, on either side
            ((2, 3, "nvme+params"), (1, 2, "cpu")), ((1, 2, "cpu"), (2, 3, "cpu+params"))]


@pytest.mark.parametrize("pair", RESHARDS, ids=lambda p: "w{}s{}{}-to-w{}s{}{}".format(
    *p[0], *p[1]))
def test_nvme_checkpoints_reshard_both_ways(tmp_path, pair):
    (n, s, d), (m, t, e) = pair
    saved = run_ranks(n, save_nvme, str(tmp_path), s, d)[0]
    err, where = max_relative_error(saved, checkpoint_reference([n] * SAVE_AT))
    assert err <= 1e-6, f"before saving: {err:.2e} at {where}"
    resumed = run_ranks(m, resume, str(tmp_path), t, e, 4)[0]
    err, where = max_relative_error(resumed, checkpoint_reference([n] * SAVE_AT + [m] * 2))
    assert err <= 1e-6, f"after resuming: {err:.2e} at {where}"
    # and the checkpoint consolidates like any other
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "zeroengine", "consolidate",
                           str(tmp_path / "ckpt"), str(out)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    from safetensors.torch import load_file
    err, where = max_relative_error(load_file(str(out / "model.safetensors")), saved)
    assert err == 0.0, f"{err:.2e} at {where}"


def test_nvme_demo_runs_under_its_cap(tmp_path):
    """benchmarks/nvme_demo.py (`make nvme-demo`) at a tiny size: the job runs under the cap
    it enforces, the loss goes down, the step is split into disk / Adam / rest."""
    out = tmp_path / "demo.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "nvme_demo.py"), "--dim", "384",
         "--layers", "2", "--heads", "4", "--steps", "8", "--cap-gb", "3", "--no-compare",
         "--no-fio", "--max-in-cpu", "100000", "--nvme-path", str(tmp_path / "swap"),
         "--json", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    import json
    result = json.loads(out.read_text())
    assert result["under_cap"] and result["loss_went_down"]
    assert len(result["losses"]) == 8 and result["tiles"] >= 1
    step = result["median_step"]
    assert step["read_gb"] > 0 and step["write_gb"] > 0 and step["adam_s"] > 0
    # the parameter shard on the drive too: forward and backward read it back every step
    assert result["params_on_drive"] and step["param_read_gb"] > 0
    for row in result["nvme_rows"]:
        assert row["disk_wait_s"] >= 0 and row["other_s"] >= 0
        assert abs(row["disk_wait_s"] + row["adam_s"] + row["other_s"] - row["step_s"]) < 1e-6
    assert os.listdir(tmp_path / "swap" / ROOT_NAME) == []  # swap files removed at the end


def save_and_load_in_tiles(root):
    """Save and load with every whole-shard path made to fail: an NVMe run's checkpoint never
    holds the rank's master or state whole in memory."""
    from zeroengine.core.layout.flat_param_group import FlatParamGroup
    from zeroengine.core.optim.sharded_optimizer import ShardedOptimizer

    def refuse(*args, **kwargs):
        raise AssertionError("a whole shard was built")
    engine = ckpt_engine(2, "nvme", os.path.join(root, "swap"))
    for step in range(SAVE_AT):
        run_step(engine, step, 1)
    before = engine.consolidated_state_dict()
    for cls, name in ((FlatParamGroup, "master_shard"), (FlatParamGroup, "load_master_shard"),
                      (ShardedOptimizer, "shard_state"), (ShardedOptimizer, "load_shard_state")):
        setattr(cls, name, refuse)
    engine.save_checkpoint(os.path.join(root, "ckpt"))
    engine.close()
    engine = ckpt_engine(2, "nvme", os.path.join(root, "swap"), seed=7)
    engine.load_checkpoint(os.path.join(root, "ckpt"))
    loaded = engine.consolidated_state_dict()
    for step in range(SAVE_AT, 4):
        run_step(engine, step, 1)
    after = engine.consolidated_state_dict()
    engine.close()
    return before, loaded, after


def test_nvme_checkpoints_stream_a_tile_at_a_time(tmp_path):
    before, loaded, after = run_ranks(2, save_and_load_in_tiles, str(tmp_path))[0]
    err, where = max_relative_error(loaded, before)
    assert err == 0.0, f"{err:.2e} at {where}"
    err, where = max_relative_error(after, checkpoint_reference([2] * 4))
    assert err <= 1e-6, f"{err:.2e} at {where}"


def edit_between_steps(path, stage, device):
    """Train, change a weight in place through gathered_parameters (a write-back into the
    master, which NVMe keeps on the drive), train on."""
    engine, _ = train_engine(nvme_config(stage, "fp32", device, path), "adamw", 1, 2)
    weight = next(p for p in engine.module.parameters() if p.dim() == 2)
    with zeroengine.gathered_parameters(weight, modifier_rank=0):
        if engine.comm.rank == 0:
            weight.data.mul_(0.5)
    for step in range(1, 3):
        run_step(engine, step, 2)
    state = engine.consolidated_state_dict()
    engine.close()
    return state


@pytest.mark.parametrize("stage,device", [(2, "nvme"), (3, "nvme"), (3, "cpu+params")])
def test_a_write_back_reaches_the_swapped_master(tmp_path, stage, device):
    cpu = run_ranks(2, edit_between_steps, str(tmp_path), stage, "cpu")[0]
    nvme = run_ranks(2, edit_between_steps, str(tmp_path), stage, device)[0]
    err, where = max_relative_error(nvme, cpu)
    assert err == 0.0, f"{err:.2e} at {where}"


def start_and_die(path):
    """Optimizer and parameters on the drive: two swap directories left behind."""
    engine, _ = train_engine(nvme_config(3, "fp32", "nvme+params", path), "adamw", 1, 2)
    with open(os.path.join(path, "swap_dir"), "w") as f:
        f.write(f"{engine.optimizer.swap.dir.path}\n{engine.param_swap.dir.path}")
    os.kill(os.getpid(), 9)  # no atexit, no close: the swap directories stay behind


def start_again(path):
    engine, _ = train_engine(nvme_config(3, "fp32", "nvme+params", path), "adamw", 1, 2)
    # the first swap directory made removes every stale one
    removed = engine.optimizer.swap.dir.removed_stale + engine.param_swap.dir.removed_stale
    engine.close()
    return removed


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_killed_run_leaves_nothing_the_next_start_keeps(tmp_path):
    """A run killed with SIGKILL cannot remove its swap files; the next start on the same
    nvme_path does (its owner is gone), and never reads them: swap files are scratch."""
    proc = subprocess.run([sys.executable, "-c", (
        "import test_nvme_offload as t; "
        f"from zeroengine.testing import run_ranks; t.start_and_die({str(tmp_path)!r})")],
        cwd=ROOT, capture_output=True, text=True, env=dict(
            os.environ, PYTHONPATH=os.path.join(ROOT, "tests"), RANK="0", WORLD_SIZE="1",
            LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port())), timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    left = open(tmp_path / "swap_dir").read().split("\n")
    assert all(os.path.isdir(d) and os.listdir(d) for d in left) and len(set(left)) == 2
    removed = run_ranks(1, start_again, str(tmp_path))[0]
    assert sorted(removed) == sorted(os.path.basename(d) for d in left)
    assert not any(os.path.exists(d) for d in left)


def test_a_missing_nvme_path_is_refused_by_name(tmp_path):
    model = make_model()
    opt = make_optimizer("adamw", param_groups(model))
    missing = str(tmp_path / "not_made")
    with pytest.raises(ConfigError, match="nvme_path.*not_made.*is not a directory"):
        zeroengine.initialize(model, nvme_config(2, "fp32", "nvme", missing), optimizer=opt)
    assert not os.path.exists(missing)


def as_if_on_a_gpu(path, stage, device):
    """The CUDA layout on this machine: the chunks the model computes with count as device
    memory, so the optimizer's bf16 values go through host staging to them (with NVMe: the
    tile's slot instead of a shard-sized buffer)."""
    from zeroengine.core.offload.optimizer_offload import OptimizerOffload
    OptimizerOffload._chunk_on_host = staticmethod(lambda g: False)
    engine, losses = train_engine(nvme_config(stage, "bf16", device, path, pipeline=True),
                                  "adamw", STEPS, 2)
    swap = engine.optimizer.swap
    out = (engine.consolidated_state_dict(), losses, engine.offload.nbytes(),
           None if swap is None else [s.staging is not None for s in swap.slots])
    engine.close()
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_low_precision_values_are_staged_a_tile_at_a_time(trained, tmp_path, stage):
    cpu = trained[1][(stage, "bf16", stage == 2, "adamw")][0]  # plain CPU offload
    staged = run_ranks(2, as_if_on_a_gpu, str(tmp_path), stage, "cpu")
    nvme = run_ranks(2, as_if_on_a_gpu, str(tmp_path), stage, "nvme")
    for rank in range(2):
        for run in (staged, nvme):
            err, where = max_relative_error(run[rank][0], cpu[rank][0])
            assert err == 0.0, f"rank {rank}: {err:.2e} at {where}"
            assert run[rank][1] == cpu[rank][1]
        assert staged[rank][2] > 0  # CPU offload: a shard-sized bf16 staging buffer
        assert nvme[rank][2] == 0 and all(nvme[rank][3])  # NVMe: each slot stages its tile
