"""zeroengine.deepspeed, piece by piece: DeepSpeed's names and meanings (initialize's
arguments and return values, the loader it builds against DeepSpeed's own, the client-wins
rules, DeepSpeed's default clipping), the engine's DeepSpeed methods, utils.safe_get_full_* /
safe_set_full_* against the values a plain model holds, names we do not implement refused by
name, and `zeroengine launch` (hostfile, include/exclude, --local_rank as DeepSpeed passes
it). tests/test_ds_scripts.py runs whole scripts beside DeepSpeed itself."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn

import zeroengine.deepspeed as deepspeed
from zeroengine import ConfigError, NotInZeroengine
from zeroengine.testing import run_ranks
from zeroengine.tools import launch as launcher


@pytest.fixture
def single_process(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(key, raising=False)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
          "zero_optimization": {"stage": 2}}


# -- names ------------------------------------------------------------------------------------
@pytest.mark.parametrize("where,name,words", [
    (deepspeed, "PipelineModule", "no pipeline parallelism"),
    (deepspeed, "init_inference", "zeroengine trains"),
    (deepspeed, "initialise", "did you mean initialize"),
    (deepspeed.zero, "Intt", "did you mean Init"),
    (deepspeed.comm, "all_reduce_coalesced", "what it provides"),
    (deepspeed.checkpointing, "get_cuda_rng_tracker", "no model-parallel RNG tracker"),
    (deepspeed.utils, "safe_get_local_fp32_param", "safe_get_full_fp32_param"),
])
def test_deepspeed_names_we_lack_are_refused_by_name(where, name, words):
    with pytest.raises(NotInZeroengine) as info:
        getattr(where, name)
    assert name in str(info.value) and words in str(info.value), str(info.value)
    assert not hasattr(where, name)  # still an AttributeError for probes


def test_add_config_arguments_and_the_config_sources(single_process, tmp_path):
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", '
                    '"params": {"lr": 0.1}}}')
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    assert args.deepspeed and args.deepspeed_config == str(path)
    model = net()
    engine, optimizer, loader, scheduler = deepspeed.initialize(args=args, model=model)
    assert isinstance(engine, deepspeed.DeepSpeedEngine) and optimizer is engine.optimizer
    assert loader is None and scheduler is None
    assert engine.train_micro_batch_size_per_gpu() == 2 and engine.train_batch_size() == 2
    assert engine.gradient_accumulation_steps() == 1 and engine.zero_optimization_stage() == 0
    assert not engine.fp16_enabled() and not engine.bfloat16_enabled()
    assert engine.gradient_clipping() == 1.0  # DeepSpeed's default when the config is silent
    assert (engine.global_rank, engine.world_size, engine.local_rank) == (0, 1, 0)
    engine.close()
    with pytest.raises(ConfigError, match="args.deepspeed_config"):
        deepspeed.initialize(args=args, model=net(), config=CONFIG)
    with pytest.raises(ConfigError, match="needs a config"):
        deepspeed.initialize(model=net())
    # config_params is DeepSpeed's older name for config
    engine, *_ = deepspeed.initialize(model=net(), config_params=CONFIG)
    assert engine.zero_optimization_stage() == 2
    engine.close()


def test_client_optimizer_and_scheduler_win_over_the_config(single_process):
    cfg = {**CONFIG, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}}
    model = net()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=model, config=cfg, model_parameters=model.parameters(),
            optimizer=lambda params: torch.optim.Adam(params, lr=0.01),
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
    said = " ".join(str(w.message) for w in caught)
    assert "client optimizer" in said and "client lr_scheduler" in said, said
    assert optimizer.base_class is torch.optim.Adam
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR)
    engine.backward(engine(torch.randn(2, 4)).square().mean())
    engine.step()  # engine.step() drives a client scheduler, as DeepSpeed's does
    assert engine.get_lr() == [0.005] and engine.was_step_applied()
    engine.close()


def test_training_data_loader_is_deepspeeds(monkeypatch):
    """initialize(training_data=...) yields, on each rank, the batches DeepSpeed's own
    DeepSpeedDataLoader yields there (same sampler, seed and micro batch)."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.dataloader import DeepSpeedDataLoader
    data = torch.utils.data.TensorDataset(torch.arange(22).float().unsqueeze(1))
    for rank in range(2):
        engine_like = type("E", (), {"train_micro_batch_size_per_gpu": lambda self: 3,
                                     "comm": type("C", (), {"rank": rank, "world_size": 2})()})
        ours = deepspeed._data_loader(data, engine_like(), None, drop_last=False)
        theirs = DeepSpeedDataLoader(data, batch_size=3, pin_memory=False, local_rank=rank,
                                     tput_timer=None, data_parallel_world_size=2,
                                     data_parallel_rank=rank, num_local_io_workers=0)
        assert len(ours) == len(theirs) == 4
        for epoch in range(2):  # DeepSpeed's loader repeats its order every epoch
            got = [b[0].flatten().tolist() for b in ours]
            want = [b[0].flatten().tolist() for b in theirs]
            assert got == want, (rank, epoch, got, want)


def test_engine_deepspeed_conventions(single_process, tmp_path):
    model = net()
    engine, *_ = deepspeed.initialize(model=model, config=CONFIG)
    with pytest.warns(UserWarning, match="Unable to find a checkpoint"):
        assert engine.load_checkpoint(str(tmp_path / "nothing")) == (None, None)
    loss = engine(torch.randn(2, 4)).square().mean()
    returned = engine.backward(loss)
    assert torch.equal(returned, loss.detach())  # gas 1: the loss itself
    engine.step()
    assert engine.save_checkpoint(str(tmp_path / "ck"), tag=7, client_state={"epoch": 2})
    assert engine.save_checkpoint(str(tmp_path / "ck"), tag="later", save_latest=False)
    assert (tmp_path / "ck" / "latest").read_text().strip() == "7"
    rng = torch.get_rng_state()
    path, client = engine.load_checkpoint(str(tmp_path / "ck"))
    assert path.endswith("7") and client == {"epoch": 2}
    assert torch.equal(torch.get_rng_state(), rng)  # DeepSpeed's load leaves generators alone
    assert engine.save_16bit_model(str(tmp_path / "out"))  # DeepSpeed's pytorch_model.bin
    state = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    assert torch.equal(state["0.weight"], model[0].weight.detach())
    for name, words in (("tput_timer", "wall_clock_breakdown"),
                        ("module_state_dict", "consolidated_state_dict")):
        with pytest.raises(NotInZeroengine, match=words):
            getattr(engine, name)
    with pytest.raises(ValueError, match="load_module_strict"):
        engine.load_checkpoint(str(tmp_path / "ck"), load_module_strict=False)
    engine.destroy()


# -- utils: whole values out of the shards ------------------------------------------------------
def full_values(stage: int):
    import zeroengine.deepspeed as ds
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    reference = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    reference.load_state_dict(model.state_dict())
    engine, *_ = ds.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.0)  # DeepSpeed's
    rank, world = engine.comm.rank, engine.comm.world_size
    gen = torch.Generator().manual_seed(3)
    out = {}
    for step in range(2):
        x = torch.randn(2 * world, 5, generator=gen)
        engine.backward(model(x[2 * rank:2 * rank + 2]).square().mean())
        ref_loss = sum(reference(x[2 * r:2 * r + 2]).square().mean() for r in range(world))
        (ref_loss / world).backward()
        if step == 1:  # between the last backward and step(): the reduced gradient
            out["grad"] = [(ds.utils.safe_get_full_grad(p) - q.grad).abs().max().item()
                           for p, q in zip(model.parameters(), reference.parameters())]
        engine.step()
        ref_opt.step()
        ref_opt.zero_grad()
    params = list(model.parameters())
    out["param"] = [(ds.utils.safe_get_full_fp32_param(p) - q.detach()).abs().max().item()
                    for p, q in zip(params, reference.parameters())]
    out["state"] = [(ds.utils.safe_get_full_optimizer_state(p, "exp_avg_sq")
                     - ref_opt.state[q]["exp_avg_sq"]).abs().max().item()
                    for p, q in zip(params, reference.parameters())]
    new = torch.full((3, 7), 0.25)
    ds.utils.safe_set_full_fp32_param(params[2], new)
    ds.utils.safe_set_full_optimizer_state(params[2], torch.ones(3, 7), "exp_avg")
    out["set"] = (torch.equal(ds.utils.safe_get_full_fp32_param(params[2]), new),
                  torch.equal(ds.utils.safe_get_full_optimizer_state(params[2], "exp_avg"),
                              torch.ones(3, 7)))
    with ds.zero.GatheredParameters([params[2]]):
        out["model_sees_it"] = torch.equal(params[2].detach().float(), new)
    engine.close()
    return out


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_safe_get_and_set_full_values(stage):
    for rank in run_ranks(2, full_values, stage):
        assert max(rank["grad"]) < 1e-6, rank["grad"]
        assert max(rank["param"]) < 1e-6, rank["param"]
        assert max(rank["state"]) < 1e-9, rank["state"]
        assert rank["set"] == (True, True) and rank["model_sees_it"]


# -- the launcher -------------------------------------------------------------------------------
def test_hostfile_and_filters(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two nodes\nworker-0 slots=4\nworker-1 slots=4\n\nworker-2\n")
    hosts = launcher.read_hostfile(str(hostfile))
    assert hosts == {"worker-0": 4, "worker-1": 4, "worker-2": 1}
    assert launcher.resources(hosts, "worker-0:0,2@worker-1", "") == \
        {"worker-0": [0, 2], "worker-1": [0, 1, 2, 3]}
    assert launcher.resources(hosts, "", "worker-1@worker-0:3") == \
        {"worker-0": [0, 1, 2], "worker-2": [0]}
    for include, words in (("worker-9", "not in the hostfile"), ("worker-0:7", "has devices"),
                           ("worker-0:x", "must be integers")):
        with pytest.raises(launcher.LaunchError, match=words):
            launcher.resources(hosts, include, "")
    (tmp_path / "bad").write_text("worker-0 gpus=4\n")
    with pytest.raises(launcher.LaunchError, match="line 1"):
        launcher.read_hostfile(str(tmp_path / "bad"))
    args = launcher.build_parser().parse_args(
        ["--hostfile", str(hostfile), "--node_rank", "1", "--include", "worker-0@worker-1:1,3",
         "train.py", "--lr", "1"])
    torchrun, env = launcher.plan(args)
    assert torchrun == ["--nnodes=2", "--node_rank=1", "--nproc_per_node=2",
                        "--master_addr=worker-0", "--master_port=29500"]
    assert env == {"CUDA_VISIBLE_DEVICES": "1,3"} and args.user_args == ["--lr", "1"]
    args = launcher.build_parser().parse_args(["--num_nodes", "2", "train.py"])
    with pytest.raises(launcher.LaunchError, match="--master_addr"):
        launcher.plan(args)


def test_launch_passes_local_rank_first(tmp_path):
    script = tmp_path / "show.py"
    script.write_text("import os, sys\nprint('ARGS', os.environ['RANK'], sys.argv[1:])\n")
    from zeroengine.testing import free_port
    done = subprocess.run(
        [sys.executable, "-m", "zeroengine", "launch",
         "--num_gpus", "2", "--master_port", str(free_port()), str(script), "--x", "1"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("ARGS"))
    assert lines == ["ARGS 0 ['--local_rank=0', '--x', '1']",
                     "ARGS 1 ['--local_rank=1', '--x', '1']"], done.stdout + done.stderr
    bad = subprocess.run([sys.executable, "-m", "zeroengine", "launch", "--num_nodes", "2",
                          str(script)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--master_addr" in bad.stderr, bad.stderr
