"""Checkpoints fail together (issue 41): a fault on one rank - its disk full, its file
truncated, flipped or missing, the rank killed mid-write - ends in the same named
CheckpointError on every rank within seconds; nothing is half-loaded, ``latest`` still names the
last good checkpoint, no ``.tmp`` is left, and the engine (and its process group) goes on. And
an asynchronous save is a snapshot of its step although training changes the parameters while
it is written."""
from __future__ import annotations

import concurrent.futures
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from harness import make_model, make_optimizer, param_groups, run_step

import zeroengine
from zeroengine import CheckpointError, ConfigError
from zeroengine.checkpoint import format as fmt
from zeroengine.testing import run_ranks

STAGES = [1, 2, 3]
TIMEOUT_S = 60  # a fault that hung a rank would show as this long a wait (checked below)


def new_engine(stage, seed=0, **checkpoint):
    model = make_model(seed)
    opt = make_optimizer("adamw", param_groups(model))
    cfg = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 40,
                                 "stage3_param_persistence_threshold": 20},
           "collective_timeout_s": TIMEOUT_S, "checkpoint": checkpoint}
    return zeroengine.initialize(model, cfg, optimizer=opt)


def held(engine):
    """Everything a load could change, on this rank: masters (gathered), optimizer state
    shards, counters, generator state."""
    state = {f"master.{k}": v for k, v in engine.consolidated_state_dict().items()}
    for gi, fg in enumerate(engine.flat_groups):
        elementwise, scalars = engine.optimizer.shard_state(fg)
        state.update({f"state.{gi}.{k}": v.clone() for k, v in elementwise.items()})
        state.update({f"scalar.{gi}.{k}": torch.tensor(float(v)) for k, v in scalars.items()})
    state["global_steps"] = torch.tensor(engine.global_steps)
    state["rng"] = torch.get_rng_state()
    return state


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def file_size_limit(nbytes: int | None):
    """A full disk, as one rank sees it: writes past ``nbytes`` fail with EFBIG (the signal a
    process gets for it is ignored, as a writer on a full drive gets ENOSPC, not a kill)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard if nbytes is None else nbytes, hard))


def failing(engine, action):
    """(message, seconds) of the CheckpointError ``action`` raises; the state must not move."""
    before = held(engine)
    start = time.monotonic()
    try:
        action()
    except CheckpointError as err:
        message, seconds = str(err), time.monotonic() - start
    else:
        raise AssertionError("no CheckpointError")
    assert same(before, held(engine)), "state changed by a failed checkpoint operation"
    return message, seconds


def damage(path, how):
    if how == "missing":
        os.remove(path)
        return
    with open(path, "r+b") as f:
        size = os.path.getsize(path)
        if how == "half":
            f.truncate(size // 2)
        elif how == "one_byte_short":
            f.truncate(size - 1)
        else:  # one byte flipped, in the data
            f.seek(size - 3)
            byte = f.read(1)
            f.seek(size - 3)
            f.write(bytes([byte[0] ^ 0xFF]))


LOAD_FAULTS = [("rank00001.safetensors", "half"), ("rank00001.safetensors", "one_byte_short"),
               ("rank00001.safetensors", "flipped"), ("rank00001.safetensors", "missing"),
               ("rank00001.pt", "missing")]


def faults_at(root, stage):
    """On each rank: a good checkpoint, then every fault; what each rank saw."""
    rank = int(os.environ["RANK"])
    engine = new_engine(stage)
    run_step(engine, 0, 1)
    good = engine.save_checkpoint(root, tag="good")
    run_step(engine, 1, 1)
    seen = {}

    def after(name):  # the engine goes on: a step, and latest still names the good one
        run_step(engine, 2, 1)
        with open(os.path.join(root, "latest")) as f:
            seen[name + ".latest"] = f.read()
        seen[name + ".tmp_left"] = sorted(n for n in os.listdir(root) if n.endswith(".tmp"))

    for name, limited, background in [("one_rank_full", {1}, False),
                                      ("every_rank_full", {0, 1}, False),
                                      ("one_rank_full_async", {1}, True)]:
        def save(limited=limited, background=background, name=name):
            if rank in limited:
                file_size_limit(512)
            try:
                result = engine.save_checkpoint(root, tag=name, async_save=background)
                if background:
                    result.result()
            finally:
                file_size_limit(None)
        seen[name] = failing(engine, save)
        after(name)

    for fault in LOAD_FAULTS:
        name = "load_" + "_".join(fault)
        copy = os.path.join(root, name)
        if rank == 0:
            shutil.copytree(good, copy)
            damage(os.path.join(copy, fault[0]), fault[1])
        engine.comm.barrier()
        seen[name] = failing(engine, lambda copy=copy: engine.load_checkpoint(copy))
        after(name)

    dangling = os.path.join(root, "dangling")
    if rank == 0:
        os.makedirs(dangling)
        with open(os.path.join(dangling, "latest"), "w") as f:
            f.write("global_step99")
    engine.comm.barrier()
    seen["dangling_latest"] = failing(engine, lambda: engine.load_checkpoint(dangling))
    after("dangling_latest")

    # and then everything works: a save, a load of it, training on
    expected = held(engine)
    engine.save_checkpoint(root, tag="after")
    run_step(engine, 3, 1)
    engine.load_checkpoint(root)
    seen["reload_exact"] = same(expected, held(engine))
    return seen


@pytest.fixture(scope="module", params=STAGES, ids=lambda s: f"stage{s}")
def faults(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"faults{request.param}")
    return run_ranks(2, faults_at, str(root), request.param)


def test_a_fault_on_one_rank_fails_every_rank_at_once_by_name(faults):
    rank0, rank1 = faults
    names = ["one_rank_full", "every_rank_full", "one_rank_full_async", "dangling_latest"] + \
        ["load_" + "_".join(f) for f in LOAD_FAULTS]
    for name in names:
        (m0, s0), (m1, s1) = rank0[name], rank1[name]
        assert m0 == m1, f"{name}: ranks raised different errors:\n{m0}\n{m1}"
        assert max(s0, s1) < TIMEOUT_S / 3, f"{name}: took {max(s0, s1):.1f} s (a hang?)"
    assert "failed on rank 1: " in rank0["one_rank_full"][0]
    assert "File too large" in rank0["one_rank_full"][0]
    assert "rank00001" in rank0["one_rank_full"][0]
    assert "ranks 0, 1" in rank0["every_rank_full"][0]
    assert "failed on rank 1: " in rank0["one_rank_full_async"][0]
    assert "'latest' names the checkpoint it named before" in rank0["one_rank_full"][0]
    assert "global_step99" in rank0["dangling_latest"][0]
    for fault in LOAD_FAULTS:
        message = rank0["load_" + "_".join(fault)][0]
        assert "failed on rank 1: " in message and fault[0] in message, message
        assert "nothing was loaded" in message
        assert ("missing" if fault[1] == "missing" else "corrupt") in message, message


def test_a_failed_checkpoint_leaves_latest_no_tmp_and_a_working_engine(faults):
    for seen in faults:
        for key, value in seen.items():
            if key.endswith(".latest"):
                assert value == "good", key
            if key.endswith(".tmp_left"):
                assert value == [], key
        assert seen["reload_exact"]


# -- a rank killed during an asynchronous write --------------------------------------------------
def killed_mid_write(root, stage):
    rank = int(os.environ["RANK"])
    engine = new_engine(stage)
    run_step(engine, 0, 1)
    engine.save_checkpoint(root, tag="good")
    run_step(engine, 1, 1)
    if rank == 1:
        original = fmt.write_safetensors

        def killed(*args, **kwargs):
            if threading.current_thread() is not threading.main_thread():
                os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)
        fmt.write_safetensors = killed
    future = engine.save_checkpoint(root, tag="doomed", async_save=True)
    start = time.monotonic()
    try:
        future.result()
    except CheckpointError as err:
        message, seconds = str(err), time.monotonic() - start
    else:
        raise AssertionError("the save survived its rank's death")
    with open(os.path.join(root, "latest")) as f:
        latest = f.read()
    return message, seconds, latest, sorted(os.listdir(root))


@pytest.mark.parametrize("stage", STAGES)
def test_a_rank_killed_during_an_asynchronous_write(tmp_path, stage):
    result, dead = run_ranks(2, killed_mid_write, str(tmp_path), stage, expect_dead=(1,))
    assert dead is None
    message, seconds, latest, listing = result
    assert "peer rank stopped" in message, message
    assert seconds < TIMEOUT_S / 3, f"{seconds:.1f} s"
    assert latest == "good" and "doomed.tmp" not in listing and "doomed" not in listing


# -- an asynchronous save is a snapshot of its step ---------------------------------------------
def snapshot_then_resume(root, stage):
    engine = new_engine(stage)
    for step in range(2):
        run_step(engine, step, 1)
    original = fmt.write_safetensors

    def slow(*args, **kwargs):  # the write surely overlaps the next steps
        time.sleep(1.0)
        return original(*args, **kwargs)
    fmt.write_safetensors = slow
    future = engine.save_checkpoint(root, tag="snap", async_save=True)
    straight = []
    for step in range(2, 5):
        run_step(engine, step, 1)
        straight.append(held(engine))
    overlapped = not future.done()
    future.result()
    fmt.write_safetensors = original
    staging = engine.memory_report()["checkpoint_staging"]
    resumed_engine = new_engine(stage, seed=7)
    resumed_engine.load_checkpoint(root, tag="snap")
    resumed = []
    for step in range(2, 5):
        run_step(resumed_engine, step, 1)
        resumed.append(held(resumed_engine))
    exact = [same({k: v for k, v in a.items() if k != "rng"},
                  {k: v for k, v in b.items() if k != "rng"}) for a, b in zip(straight, resumed)]
    return overlapped, exact, staging


@pytest.mark.parametrize("stage", STAGES)
def test_an_asynchronous_save_is_a_snapshot_of_its_step(tmp_path, stage):
    for overlapped, exact, staging in run_ranks(2, snapshot_then_resume, str(tmp_path), stage):
        assert overlapped, "training did not run while the save was written"
        assert exact == [True, True, True]
        assert staging > 0


# -- a clean exit --------------------------------------------------------------------------------
def test_a_job_that_never_closes_exits_0_every_time_with_its_last_save_complete(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    job = os.path.join(os.path.dirname(os.path.abspath(__file__)), "unclosed_job.py")
    for run in range(20):
        out = tmp_path / f"run{run}"
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc_per_node=2", job, str(out)], capture_output=True, text=True, env=env,
            timeout=120)
        assert proc.returncode == 0, f"run {run}:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
        assert (out / "latest").read_text() == "global_step2"
        fmt.read_meta(str(out / "global_step2"))  # complete: sealed metadata, every file
        for name in ("rank00000.safetensors", "rank00001.safetensors", "rank00001.pt"):
            assert (out / "global_step2" / name).exists()


# -- the config (single process) -----------------------------------------------------------------
@pytest.fixture
def single(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(key, raising=False)


@pytest.mark.parametrize("section", [{"async_save": True},
                                     {"writer": {"decoupled": True, "type": "fast"}}])
def test_the_config_makes_saves_asynchronous(tmp_path, single, section):
    engine = new_engine(1, **section)
    run_step(engine, 0, 1)
    future = engine.save_checkpoint(str(tmp_path))
    assert isinstance(future, concurrent.futures.Future)
    assert future.result() == str(tmp_path / "global_step1")
    assert engine.memory_report()["checkpoint_staging"] > 0
    assert engine.save_checkpoint(str(tmp_path), tag="sync", async_save=False) == \
        str(tmp_path / "sync")
    path, _ = engine.load_checkpoint(str(tmp_path), tag="global_step1")
    assert path == str(tmp_path / "global_step1")
    engine.close()


@pytest.mark.parametrize("key", ["load_universal", "use_node_local_storage"])
def test_deepspeed_checkpoint_features_we_lack_are_refused_by_name(single, key):
    with pytest.raises(ConfigError, match=f"checkpoint.{key}"):
        new_engine(1, **{key: True})
    new_engine(1, **{key: False}, tag_validation="Fail", checkpoint_serialization=False,
               parallel_write={"pipeline_stage": False})


def test_asynchronous_saves_with_the_optimizer_on_nvme_are_refused(tmp_path, single):
    model = make_model(0)
    engine = zeroengine.initialize(model, {"zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}},
        optimizer=make_optimizer("adamw", param_groups(model)))
    run_step(engine, 0, 1)
    with pytest.raises(NotImplementedError, match="async_save=True.*NVMe"):
        engine.save_checkpoint(str(tmp_path / "ckpt"), async_save=True)
    path = engine.save_checkpoint(str(tmp_path / "ckpt"))  # synchronous: fine
    damage(os.path.join(path, "rank00000.safetensors"), "flipped")
    before = held(engine)
    with pytest.raises(CheckpointError, match="corrupt"):  # verified before the swap is touched
        engine.load_checkpoint(str(tmp_path / "ckpt"))
    assert same(before, held(engine))
    run_step(engine, 1, 1)
    engine.close()


def test_checkpoints_with_sha256_checksums_still_load(tmp_path, single):
    """Checkpoints written before CRC-32 carry sha256 and no sizes: verified as such."""
    engine = new_engine(1)
    run_step(engine, 0, 1)
    path = engine.save_checkpoint(str(tmp_path))
    meta_path = os.path.join(path, fmt.META)
    with open(meta_path) as f:
        meta = json.load(f)
    meta.pop("meta_sha256")
    del meta["checksum"], meta["file_bytes"]
    meta["files"] = {name: fmt.file_checksum(os.path.join(path, name), "sha256")
                     for name in meta["files"]}
    with open(meta_path, "w") as f:
        json.dump(fmt.seal(meta), f)
    expected = held(engine)
    run_step(engine, 1, 1)
    engine.load_checkpoint(str(tmp_path))
    assert same(expected, held(engine))
    damage(os.path.join(path, "rank00000.safetensors"), "flipped")
    with pytest.raises(CheckpointError, match="its sha256 does not match"):
        engine.load_checkpoint(str(tmp_path))
