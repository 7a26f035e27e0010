"""Sharded checkpoints: resharding between any world size and stage (offload on or off), atomic
saves that survive a kill at any point, checksums, weights_only loading, consolidation and
16-bit export."""
from __future__ import annotations

import json
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
)

import zeroengine
from zeroengine import CheckpointError
from zeroengine.checkpoint import format as fmt
from zeroengine.testing import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAVE_AT, STEPS = 2, 4


def config(stage, offload=False, precision="fp32", **zero):
    cfg = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 40,
                                 "stage3_param_persistence_threshold": 20, **zero}}
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def new_engine(stage, offload=False, precision="fp32", seed=0, **zero):
    model = make_model(seed)
    sched = None
    opt = make_optimizer("adamw", param_groups(model))
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.9)
    return zeroengine.initialize(model, config(stage, offload, precision, **zero), optimizer=opt,
                                 lr_scheduler=sched)


def save_runs(cases, root):
    """On every rank: train SAVE_AT steps per case and save (case i -> root/i)."""
    out = []
    for i, (stage, offload) in enumerate(cases):
        engine = new_engine(stage, offload)
        for step in range(SAVE_AT):
            run_step(engine, step, 1)
        engine.save_checkpoint(os.path.join(root, str(i)), client_state={"case": i})
        out.append(engine.consolidated_state_dict())
        engine.close()
    return out


def resume_runs(cases, root, clients):
    """On every rank: a fresh engine (other seed) loads case i and trains to STEPS."""
    out = []
    for i, (stage, offload) in enumerate(cases):
        engine = new_engine(stage, offload, seed=7)
        path, client = engine.load_checkpoint(os.path.join(root, str(i)))
        assert client == clients[i] and engine.global_steps == SAVE_AT
        assert engine.lr_scheduler.last_epoch == SAVE_AT
        for step in range(SAVE_AT, STEPS):
            run_step(engine, step, 1)
        out.append(engine.consolidated_state_dict())
        engine.close()
    return out


# (saved world, stage, offload) -> (loaded world, stage, offload): every world size 1-4 and
# every stage on both sides, offload on either side.
PAIRS = [((1, 0, False), (2, 3, False)), ((2, 1, False), (3, 3, True)),
         ((3, 3, False), (1, 0, False)), ((4, 2, False), (2, 1, True)),
         ((2, 3, True), (4, 0, False)), ((3, 2, True), (2, 2, False)),
         ((2, 0, False), (3, 1, False)), ((4, 3, False), (3, 2, False))]


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    saves, loads = {}, {}
    for i, ((n, s, so), (m, t, to)) in enumerate(PAIRS):
        saves.setdefault(n, []).append((i, (s, so)))
        loads.setdefault(m, []).append((i, (t, to)))
    saved, resumed = {}, {}
    for n, items in saves.items():
        states = run_ranks(n, save_runs, [c for _, c in items], str(root / f"w{n}"))[0]
        for (i, _), state in zip(items, states):
            saved[i] = state
    for m, items in loads.items():
        target = root / f"load{m}"
        clients = []
        for j, (i, _) in enumerate(items):
            n = PAIRS[i][0][0]
            index = [k for k, _ in saves[n]].index(i)
            os.makedirs(target, exist_ok=True)
            os.symlink(root / f"w{n}" / str(index), target / str(j))
            clients.append({"case": index})
        states = run_ranks(m, resume_runs, [c for _, c in items], str(target), clients)[0]
        for (i, _), state in zip(items, states):
            resumed[i] = state
    return saved, resumed


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "w{}s{}{}-to-w{}s{}{}".format(
    p[0][0], p[0][1], "off" if p[0][2] else "", p[1][0], p[1][1], "off" if p[1][2] else ""))
def test_resharded_training_continues_exactly(resharded, pair):
    saved, resumed = resharded
    i = PAIRS.index(pair)
    (n, _, _), (m, _, _) = pair
    expected = checkpoint_reference([n] * SAVE_AT + [m] * (STEPS - SAVE_AT))
    err, where = max_relative_error(saved[i], checkpoint_reference([n] * SAVE_AT))
    assert err <= 1e-6, f"before saving: {err:.2e} at {where}"
    err, where = max_relative_error(resumed[i], expected)
    assert err <= 1e-6, f"after resuming at {m} ranks: {err:.2e} at {where}"


def mixed_roundtrip(root, precision):
    engine = new_engine(2, precision=precision)
    for step in range(SAVE_AT):
        run_step(engine, step, 1)
    engine.save_checkpoint(root)
    return engine.consolidated_state_dict(), engine.loss_scale


def mixed_load(root, precision):
    engine = new_engine(3, precision=precision, seed=3)
    engine.load_checkpoint(root)
    return engine.consolidated_state_dict(), engine.loss_scale


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_master_and_loss_scale_survive_resharding(tmp_path, precision):
    state, scale = run_ranks(2, mixed_roundtrip, str(tmp_path), precision)[0]
    loaded, loaded_scale = run_ranks(3, mixed_load, str(tmp_path), precision)[0]
    for key in state:  # the fp32 masters, bit for bit
        assert torch.equal(state[key], loaded[key]), key
    assert loaded_scale == scale


# -- atomicity ----------------------------------------------------------------------------------
def save_twice_and_die(root, where, rank_to_kill, nth):
    """Save at step 1 (tag A), then die inside the second save at the nth call of ``where``."""
    engine = new_engine(2)
    run_step(engine, 0, 1)
    engine.save_checkpoint(root, tag="A")
    run_step(engine, 1, 1)
    original = getattr(fmt, where)
    calls = [0]

    def dying(*args, **kwargs):
        calls[0] += 1
        if engine.comm.rank == rank_to_kill and calls[0] == nth:
            os._exit(9)  # no cleanup, no finally: as if killed
        return original(*args, **kwargs)
    setattr(fmt, where, dying)
    engine.save_checkpoint(root, tag="B")
    return "survived"


def load_latest(root):
    engine = new_engine(1, seed=5)
    path, _ = engine.load_checkpoint(root)
    return os.path.basename(path), engine.global_steps, engine.consolidated_state_dict()


def state_after_one_step(root):
    engine = new_engine(2)
    run_step(engine, 0, 1)
    return engine.consolidated_state_dict()


# Kill points: during the rank files (fsync of a shard, rank 1), and on rank 0 at each fsync of
# a directory: after meta.json is in place, after the tmp directory is synced, after the rename
# into place (latest still names A), after latest was replaced (then B is complete and named).
KILLS = [("fsync_fd", 1, 1), ("fsync_fd", 0, 2), ("fsync_dir", 0, 1), ("fsync_dir", 0, 2),
         ("fsync_dir", 0, 3), ("fsync_dir", 0, 4)]


@pytest.fixture(scope="module")
def after_one_step(tmp_path_factory):
    return run_ranks(2, state_after_one_step, str(tmp_path_factory.mktemp("one")))[0]


@pytest.mark.parametrize("kill", KILLS, ids=lambda k: f"{k[0]}-rank{k[1]}-call{k[2]}")
def test_a_kill_during_save_leaves_a_loadable_checkpoint(tmp_path, kill, after_one_step):
    # the killed rank's peer may notice first (its collective fails) - either way the run dies
    with pytest.raises(AssertionError, match="died with exit code 9|Connection reset|closed"):
        run_ranks(2, save_twice_and_die, str(tmp_path), *kill)
    tag, steps, state = run_ranks(1, load_latest, str(tmp_path))[0]
    if kill == KILLS[-1]:
        assert tag == "B" and steps == 2  # the kill came after the new checkpoint was complete
        return
    assert tag == "A" and steps == 1
    err, where = max_relative_error(state, after_one_step)
    assert err == 0.0, f"{err:.2e} at {where}"


def test_a_tag_half_replaced_falls_back_to_the_old_copy(tmp_path):
    (tmp_path / "A.old").mkdir()
    (tmp_path / "latest").write_text("A")
    assert fmt.resolve(str(tmp_path), None) == str(tmp_path / "A.old")


# -- integrity and safety (single process) ------------------------------------------------------
@pytest.fixture
def saved_single(tmp_path, monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(key, raising=False)
    engine = new_engine(1)
    run_step(engine, 0, 1)
    path = engine.save_checkpoint(str(tmp_path), client_state={"epoch": 3})
    return engine, tmp_path, path


def _rewrite_meta(path, edit):
    meta_path = os.path.join(path, fmt.META)
    with open(meta_path) as f:
        meta = json.load(f)
    meta.pop("meta_sha256")
    edit(meta)
    with open(meta_path, "w") as f:
        json.dump(fmt.seal(meta), f)


def test_truncated_shard_is_refused_by_name(saved_single):
    engine, root, path = saved_single
    shard = os.path.join(path, "rank00000.safetensors")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    with pytest.raises(CheckpointError, match="rank00000.safetensors is corrupt"):
        engine.load_checkpoint(str(root))


def test_altered_byte_is_refused_by_name(saved_single):
    engine, root, path = saved_single
    shard = os.path.join(path, "rank00000.safetensors")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) - 3)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(CheckpointError, match="rank00000.safetensors is corrupt"):
        engine.load_checkpoint(str(root))


def test_edited_metadata_is_refused(saved_single):
    engine, root, path = saved_single
    meta_path = os.path.join(path, fmt.META)
    text = open(meta_path).read().replace('"global_steps": 1', '"global_steps": 7')
    open(meta_path, "w").write(text)
    with pytest.raises(CheckpointError, match="meta.json is corrupt"):
        engine.load_checkpoint(str(root))


def test_planted_pickle_is_never_executed(saved_single, tmp_path):
    """A .pt whose unpickling would run code, with checksums forged to match: refused."""
    engine, root, path = saved_single
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    evil = os.path.join(path, "rank00000.pt")
    torch.save({"rng": Exploit()}, evil)
    _rewrite_meta(path, lambda m: (
        m["files"].update({"rank00000.pt": fmt.file_checksum(evil, m["checksum"])}),
        m["file_bytes"].update({"rank00000.pt": os.path.getsize(evil)})))
    with pytest.raises(CheckpointError, match="weights_only=True refused"):
        engine.load_checkpoint(str(root))
    assert not marker.exists()


def test_missing_directory_and_missing_latest(saved_single, tmp_path):
    engine, _, _ = saved_single
    with pytest.raises(CheckpointError, match="does not exist"):
        engine.load_checkpoint(str(tmp_path / "nowhere"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="latest does not exist"):
        engine.load_checkpoint(str(empty))
    assert engine.load_checkpoint(str(empty), missing_ok=True) == (None, None)
    assert engine.load_checkpoint(str(tmp_path / "nowhere"), missing_ok=True) == (None, None)
    with pytest.raises(CheckpointError, match="tag 'nope'"):
        engine.load_checkpoint(str(empty), tag="nope")


def test_other_format_version_is_refused(saved_single):
    engine, root, path = saved_single
    _rewrite_meta(path, lambda m: m.update(format=99))
    with pytest.raises(CheckpointError, match="format 99"):
        engine.load_checkpoint(str(root))


def test_other_optimizer_is_refused_unless_weights_only(saved_single):
    engine, root, _ = saved_single
    model = make_model()
    other = zeroengine.initialize(model, config(1), optimizer=torch.optim.SGD(
        param_groups(model), lr=0.1, momentum=0.9))
    with pytest.raises(CheckpointError, match="AdamW optimizer state but this engine's "
                                              "optimizer is SGD"):
        other.load_checkpoint(str(root))
    other.load_checkpoint(str(root), load_optimizer_states=False)
    err, _ = max_relative_error(other.consolidated_state_dict(), engine.consolidated_state_dict())
    assert err == 0.0


# -- consolidation and 16-bit export -------------------------------------------------------------
def test_consolidate_needs_no_world_size_and_loads_strictly(tmp_path):
    states = run_ranks(3, save_runs, [(3, False)], str(tmp_path))[0]
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "zeroengine", "consolidate",
                           str(tmp_path / "0"), str(out), "--pt"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    from safetensors.torch import load_file
    loaded = load_file(str(out / "model.safetensors"))
    model = make_model(seed=9)
    model.load_state_dict(loaded, strict=True)  # every name, tied ones included
    assert loaded.keys() == model.state_dict().keys()
    err, where = max_relative_error(loaded, states[0])
    assert err == 0.0, f"{err:.2e} at {where}"
    pt = torch.load(out / "pytorch_model.pt", weights_only=True)
    assert pt.keys() == loaded.keys()


def test_consolidate_reports_a_missing_checkpoint(tmp_path, capsys):
    from zeroengine.tools.cli import main
    assert main(["consolidate", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "latest does not exist" in capsys.readouterr().err


def export_16bit(root, stage, gather, filename):
    engine = new_engine(stage, precision="bf16",
                        stage3_gather_16bit_weights_on_model_save=gather)
    run_step(engine, 0, 1)
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrote = engine.save_16bit_model(root, filename)
    full = engine.consolidated_state_dict()
    return wrote, [str(w.message) for w in caught], full


@pytest.mark.parametrize("stage,gather,world,filename", [
    (2, False, 2, "model.safetensors"), (3, True, 2, "model.safetensors"),
    (3, False, 2, "model.safetensors"), (3, True, 3, "pytorch_model.bin"),
    (1, False, 1, "pytorch_model.bin")])
def test_save_16bit_model(tmp_path, stage, gather, world, filename):
    """Streamed to one file by rank 0 (safetensors), or DeepSpeed's torch.save'd
    pytorch_model.bin: every key of the model's state_dict, bf16, equal to the engine's
    fp32 values rounded once, loadable strictly."""
    wrote, warned, full = run_ranks(world, export_16bit, str(tmp_path), stage, gather,
                                    filename)[0]
    path = tmp_path / filename
    if stage == 3 and not gather:
        assert wrote is False and not path.exists()
        assert any("stage3_gather_16bit_weights_on_model_save" in w for w in warned)
        return
    assert wrote is True
    assert not list(tmp_path.glob("*.tmp"))
    if filename.endswith(".safetensors"):
        from safetensors import safe_open
        from safetensors.torch import load_file
        loaded = load_file(str(path))
        with safe_open(str(path), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}  # what transformers asks of the file
    else:
        loaded = torch.load(str(path), weights_only=True)
        assert loaded["embed.weight"] is loaded["head.weight"]  # tied: one tensor, two names
    make_model().load_state_dict(loaded, strict=True)
    assert set(loaded) == set(full)
    for key, value in loaded.items():
        if full[key].is_floating_point():
            assert value.dtype == torch.bfloat16
            assert torch.equal(value, full[key].to(torch.bfloat16)), key
        else:
            assert torch.equal(value, full[key]), key


def nvme_exports(root):
    engine = new_engine(2, offload_optimizer={"device": "nvme", "nvme_path": root})
    run_step(engine, 0, 1)
    refused = []
    for export in (lambda: engine.save_pretrained(os.path.join(root, "hf")),
                   lambda: engine.save_checkpoint(os.path.join(root, "dcp"), format="dcp")):
        try:
            export()
            refused.append(None)
        except NotImplementedError as err:
            refused.append(str(err))
    wrote = engine.save_16bit_model(os.path.join(root, "16"))  # the whole-model gather
    return refused, wrote, engine.consolidated_state_dict()


def test_exports_refuse_or_fall_back_with_the_optimizer_on_nvme(tmp_path):
    """The exports that stream from the masters do not read NVMe-swapped ones yet: two refuse
    by name, saying what to do instead; save_16bit_model gathers the whole model instead."""
    refused, wrote, full = run_ranks(1, nvme_exports, str(tmp_path))[0]
    assert refused[0] is not None and "save_pretrained with the optimizer state on NVMe" in \
        refused[0] and "zeroengine consolidate" in refused[0]
    assert refused[1] is not None and "save_checkpoint(format='dcp')" in refused[1] and \
        "NVMe" in refused[1]
    from safetensors.torch import load_file
    loaded = load_file(str(tmp_path / "16" / "model.safetensors"))
    assert wrote is True and set(loaded) == set(full)
    assert all(torch.equal(loaded[k], full[k]) for k in full)  # fp32 training: fp32 file


# -- crash resume under torchrun ------------------------------------------------------------------
def _torchrun(tmp_path, name, kill_at):
    ckpt, out = tmp_path / f"{name}-ckpt", tmp_path / f"{name}.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "--max-restarts=1", os.path.join(ROOT, "tests", "resume_job.py"), str(ckpt), str(out),
         "6", str(kill_at)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out, weights_only=True)


def test_killed_rank_restarts_and_resumes_to_the_same_parameters(tmp_path):
    resumed = _torchrun(tmp_path, "killed", kill_at=3)
    straight = _torchrun(tmp_path, "straight", kill_at=-1)
    assert resumed["restarts"] == 1 and straight["restarts"] == 0
    err, where = max_relative_error(resumed["state"], straight["state"])
    assert err == 0.0, f"{err:.2e} at {where}"


def test_rng_states_are_restored(saved_single):
    import random

    import numpy as np
    engine, root, _ = saved_single
    engine.save_checkpoint(str(root), tag="rng")
    drawn = (torch.rand(3), np.random.rand(3), random.random())
    engine.load_checkpoint(str(root), tag="rng")
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(drawn[0], again[0]) and (drawn[1] == again[1]).all()
    assert drawn[2] == again[2]


def test_rng_states_left_alone_when_asked(saved_single):
    """load_rng_states=False (what zeroengine.deepspeed's load_checkpoint passes: DeepSpeed
    does not restore generators) leaves every generator where it was."""
    import random

    import numpy as np
    engine, root, _ = saved_single
    engine.save_checkpoint(str(root), tag="rng")
    torch.rand(3), np.random.rand(3), random.random()  # move past the saved states
    states = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    engine.load_checkpoint(str(root), tag="rng", load_rng_states=False)
    assert torch.equal(torch.get_rng_state(), states[0])
    assert (np.random.get_state()[1] == states[1]).all() and random.getstate() == states[2]


def test_consolidate_writes_the_hugging_face_layout_a_file_at_a_time(tmp_path):
    """--max-shard-size smaller than the model: several files and an index, as save_pretrained
    writes them; the tensors equal the one-file output bitwise; --dtype casts."""
    from safetensors.torch import load_file

    from zeroengine.checkpoint.weights.weight_files import WeightFiles
    from zeroengine.tools.cli import main
    states = run_ranks(2, save_runs, [(3, False)], str(tmp_path))[0]
    one, many, half = tmp_path / "one", tmp_path / "many", tmp_path / "half"
    assert main(["consolidate", str(tmp_path / "0"), str(one)]) == 0
    assert main(["consolidate", str(tmp_path / "0"), str(many), "--max-shard-size", "1KB"]) == 0
    assert main(["consolidate", str(tmp_path / "0"), str(half), "--dtype", "bf16",
                 "--max-shard-size", "1KB"]) == 0
    index = json.loads((many / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(os.listdir(many)) == sorted(files + ["model.safetensors.index.json"])
    whole = load_file(str(one / "model.safetensors"))
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in whole.values())
    for path in files:  # at most 1 KB of tensors, or one tensor larger than that
        held = load_file(str(many / path))
        assert sum(v.numel() * 4 for v in held.values()) <= 1000 or len(held) == 1, path
    sharded = WeightFiles.open(str(many))
    assert set(sharded.entries) == set(whole)
    for key, value in whole.items():
        assert torch.equal(sharded.read_full(key), value), key
        assert torch.equal(value, states[0][key].float()), key
    halved = WeightFiles.open(str(half))
    assert all(e.dtype == torch.bfloat16 for e in halved.entries.values())
    assert main(["consolidate", str(tmp_path / "0"), str(half), "--max-shard-size", "x"]) == 2
