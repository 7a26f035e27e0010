"""NVMe offload of stage-3 parameters (offload_param.device "nvme"): the partitioned parameter
shard lives in swap files and is read through a small host cache, read ahead along the recorded
order; the run's numbers are those of the run with the shard in host memory (offload_param
"cpu"), bitwise, with the optimizer on the training device, in host memory or on the drive."""
from __future__ import annotations

import os

import pytest
import torch
from harness import max_relative_error, train_engine
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

import zeroengine
from zeroengine import ConfigError
from zeroengine.core.offload.param_swap import ParamSwap
from zeroengine.core.offload.swap_files import ROOT_NAME, SwapDir
from zeroengine.ops.aio import AsyncFileIO
from zeroengine.testing import run_ranks

STEPS = 3


def config(precision, optimizer_device, param_device, path, max_in_cpu=60, read_ahead=2):
    cfg = {"gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
           "zero_optimization": {
               "stage": 3, "reduce_bucket_size": 40, "sub_group_size": 100,
               "stage3_param_persistence_threshold": 20,
               "stage3_prefetch_bucket_size": 30,
               "offload_optimizer": {"device": optimizer_device, "nvme_path": path},
               # a cache smaller than the shard and reads ahead of the gathers: chunks leave
               # and come back every pass
               "offload_param": {"device": param_device, "nvme_path": path,
                                 "max_in_cpu": max_in_cpu, "buffer_count": read_ahead,
                                 "buffer_size": 100}}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def train(cases, path):
    out = []
    for precision, opt_device, param_device in cases:
        engine, losses = train_engine(config(precision, opt_device, param_device, path),
                                      "adamw", STEPS, 2)
        swap = engine.param_swap
        stats = None if swap is None else (
            swap.stats.read_bytes, swap.stats.write_bytes, swap.stats.misses,
            swap.stats.read_ahead_hits,
            (swap.cached_numel, len(swap.cache), swap.host_bytes()), swap.dir.path,
            sum(fg.layout.shard_numel for fg in engine.flat_groups if fg.partitioned))
        out.append((engine.consolidated_state_dict(), losses, engine.memory_report(), stats))
        engine.close()
    return out


CASES = [(p, opt) for p in ("fp32", "bf16") for opt in ("none", "cpu", "nvme")]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("nvme_params"))
    runs = [(p, opt, "cpu") for p, opt in CASES] + [(p, opt, "nvme") for p, opt in CASES]
    per_rank = run_ranks(2, train, runs, path)
    results = list(zip(*per_rank))
    return path, {case: (results[i], results[len(CASES) + i]) for i, case in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-optimizer-{c[1]}")
def test_parameters_on_the_drive_equal_parameters_in_host_memory(trained, case):
    _, runs = trained
    host, drive = runs[case]
    for rank in range(2):
        err, where = max_relative_error(drive[rank][0], host[rank][0])
        assert err == 0.0, f"rank {rank}: {err:.2e} at {where}"
        assert drive[rank][1] == host[rank][1]  # every micro-step's loss


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-optimizer-{c[1]}")
def test_the_shard_streams_through_a_bounded_cache(trained, case):
    path, runs = trained
    host, drive = runs[case]
    for rank in range(2):
        report, (read, written, misses, ahead, cached, swap_dir, shard) = drive[rank][2:]
        itemsize = 2 if case[0] == "bf16" else 4
        # nothing of the partitioned shard is held outside the swap; the swap's files hold it
        assert report["nvme_params"] >= shard * itemsize
        numel, entries, host_bytes = cached
        assert numel <= 60 or entries == 1  # the chunk used last stays, whatever its size
        # in host memory: what the swap holds (each chunk padded to 4096 bytes for O_DIRECT,
        # more than this tiny model's shard; benchmarks/nvme_demo.py shows the saving)
        assert report["host_params"] == host_bytes > 0
        assert host[rank][2]["host_params"] > 0 and "nvme_params" not in host[rank][2]
        # every step's forward and backward read the chunks again, some of them read ahead
        assert read >= 2 * STEPS * shard * itemsize
        assert written >= STEPS * shard * itemsize  # every step's new values went out
        assert ahead > 0 and misses > 0
        assert not os.path.exists(swap_dir)
    assert os.listdir(os.path.join(path, ROOT_NAME)) == []


def test_cache_evicts_least_recently_used_and_writes_changed_chunks(tmp_path):
    swap = ParamSwap(SwapDir(str(tmp_path), 0), AsyncFileIO(4096, 4, 1), max_in_cpu=3000,
                     read_ahead_numel=2000)
    gi = swap.reserve([1000, 1000, 1000, 500], torch.bfloat16)
    values = [torch.arange(n, dtype=torch.bfloat16) + 7 * s
              for s, n in enumerate([1000, 1000, 1000, 500])]
    for s, v in enumerate(values):
        swap.put(gi, s, v)
    held = swap.chunk(gi, 0)
    for s in (1, 2, 3):
        assert torch.equal(swap.chunk(gi, s), values[s])
    assert (gi, 0) not in swap.cache and swap.cached_numel == 2500
    assert torch.equal(held, values[0])  # evicted, still valid for whoever holds it
    new = swap.for_overwrite(gi, 0)  # a fresh buffer, nothing read
    assert swap.stats.misses == 4
    new.fill_(3)
    swap.written(gi, 0, new)  # cached dirty; chunk 1 (least recently used) leaves, clean
    before = swap.stats.write_bytes
    swap.chunk(gi, 1)  # chunk 2 out clean, then 3 (LRU); chunk 0 is dirty and recent
    swap.chunk(gi, 2)
    swap.chunk(gi, 3)  # now 0 is the least recently used: written as it leaves
    assert swap.stats.write_bytes > before
    swap.read_ahead([(gi, 0), (gi, 1)])
    assert torch.equal(swap.chunk(gi, 0), torch.full((1000,), 3, dtype=torch.bfloat16))
    assert swap.stats.read_ahead_hits == 1
    swap.close()


def test_a_read_ahead_of_a_chunk_changed_meanwhile_is_dropped(tmp_path):
    swap = ParamSwap(SwapDir(str(tmp_path), 0), AsyncFileIO(4096, 4, 1), max_in_cpu=0,
                     read_ahead_numel=10_000)
    gi = swap.reserve([2048], torch.float32)
    swap.put(gi, 0, torch.ones(2048))
    swap.read_ahead([(gi, 0)])  # the old values, on their way
    new = swap.for_overwrite(gi, 0)
    new.fill_(2)
    swap.written(gi, 0, new)
    swap.reserve([16], torch.float32)  # another group (index 1) pushes chunk 0 out
    swap.put(1, 0, torch.zeros(16))
    swap.chunk(1, 0)
    assert (gi, 0) not in swap.cache
    assert torch.equal(swap.chunk(gi, 0), torch.full((2048,), 2.0))
    swap.close()


NUMELS = [1000, 3000, 17, 2048, 500]
OPS = st.lists(st.tuples(st.sampled_from(["read", "write", "ahead", "flush"]),
                         st.integers(0, len(NUMELS) - 1), st.integers(-50, 50)),
               min_size=1, max_size=40)


@settings(max_examples=examples(60), deadline=None)
@given(ops=OPS, max_in_cpu=st.sampled_from([0, 1500, 4000, 10_000]),
       read_ahead=st.sampled_from([0, 2000, 10_000]), held=st.booleans())
def test_every_read_sees_the_last_values_written(tmp_path_factory, ops, max_in_cpu, read_ahead,
                                                 held):
    """Any sequence of reads, overwrites, reads ahead and flushes, under any cache size and
    read-ahead budget: a read returns what was last written, and a chunk handed out earlier
    (``held``: kept by its reader, as a gather in flight keeps it) keeps its values, evicted,
    overwritten or not."""
    path = str(tmp_path_factory.mktemp("swap"))
    swap = ParamSwap(SwapDir(path, 0), AsyncFileIO(4096, 4, 1), max_in_cpu=max_in_cpu,
                     read_ahead_numel=read_ahead)
    gi = swap.reserve(NUMELS, torch.float32)
    truth = [torch.full((n,), float(s)) for s, n in enumerate(NUMELS)]
    for s, values in enumerate(truth):
        swap.put(gi, s, values)
    kept = []
    try:
        for op, s, value in ops:
            if op == "read":
                got = swap.chunk(gi, s)
                assert torch.equal(got, truth[s]), (op, s)
                if held:
                    kept.append((got, truth[s].clone()))
            elif op == "write":
                buf = swap.for_overwrite(gi, s)
                buf.fill_(float(value))
                swap.written(gi, s, buf)
                truth[s] = torch.full((NUMELS[s],), float(value))
            elif op == "ahead":
                swap.read_ahead([(gi, (s + i) % len(NUMELS)) for i in range(3)])
            else:
                swap.flush()
            assert swap.cached_numel <= max(max_in_cpu, max(NUMELS))
        for got, expected in kept:
            assert torch.equal(got, expected)
        for s in range(len(NUMELS)):
            assert torch.equal(swap.chunk(gi, s), truth[s])
    finally:
        swap.close()


def test_parameters_on_nvme_need_a_path():
    with pytest.raises(ConfigError, match="offload_param.nvme_path"):
        zeroengine.config.parse_config({"zero_optimization": {
            "stage": 3, "offload_optimizer": {"device": "cpu"},
            "offload_param": {"device": "nvme"}}})


def missing_path(path):
    with pytest.raises(ConfigError, match="offload_param.nvme_path .* is not a directory"):
        train_engine(config("fp32", "cpu", "nvme", path), "adamw", 0)
    return True


def test_a_missing_param_nvme_path_is_refused_by_name(tmp_path):
    assert run_ranks(1, missing_path, str(tmp_path / "no_such_dir")) == [True]


def read_ahead_without_prefetch(path):
    cfg = config("bf16", "cpu", "nvme", path)
    cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = 0  # no all-gathers ahead
    engine, _ = train_engine(cfg, "adamw", STEPS, 2)
    hits = engine.param_swap.stats.read_ahead_hits
    engine.close()
    return hits


def test_the_drive_is_read_ahead_even_without_gather_prefetch(tmp_path):
    assert all(hits > 0 for hits in run_ranks(2, read_ahead_without_prefetch, str(tmp_path)))
