"""torch.distributed.checkpoint both ways with FSDP2: a run of FSDP2 (fully_shard, on CPU with
gloo) saved with DCP is continued here at world 1 and 2 and any stage, to the numbers FSDP2 gets
continuing it; a zeroengine run saved with ``save_checkpoint(format="dcp")`` is continued by
FSDP2 with its own ``dcp.load``, to the numbers zeroengine gets. Also the rectangles a flat
range is cut into, and damaged DCP directories refused by name."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
from harness import global_batch, load_refused, loss_fn, make_model
from hypothesis import given
from hypothesis import strategies as st

import zeroengine
from zeroengine.checkpoint.interop.dcp_save import rectangles
from zeroengine.testing import run_ranks

SAVE_AT, STEPS = 3, 6


def optimizer(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


def _fsdp_model():
    from torch.distributed.fsdp import fully_shard
    model = make_model(0)
    fully_shard(model.body)
    fully_shard(model)
    return model


def _fsdp_state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def _full(model) -> dict:
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def _fsdp_train(model, opt, start: int, stop: int, world: int, rank: int) -> None:
    for step in range(start, stop):
        tokens, targets = global_batch(step, world, rank)
        loss_fn(model(tokens), targets).backward()
        opt.step()
        opt.zero_grad()


def _fsdp_saves(root: str) -> dict:
    """FSDP2 at world 2: SAVE_AT steps, dcp.save, on to STEPS."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    dist.init_process_group("gloo")
    model = _fsdp_model()
    opt = optimizer([p for p in model.parameters() if p.requires_grad])
    _fsdp_train(model, opt, 0, SAVE_AT, 2, dist.get_rank())
    dcp.save(_fsdp_state(model, opt), checkpoint_id=root)
    saved = _full(model)
    _fsdp_train(model, opt, SAVE_AT, STEPS, 2, dist.get_rank())
    return {"saved": saved, "final": _full(model)}


def _fsdp_loads(root: str) -> dict:
    """FSDP2 at world 2 continuing a checkpoint with its own dcp.load."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    dist.init_process_group("gloo")
    model = _fsdp_model()
    opt = optimizer([p for p in model.parameters() if p.requires_grad])
    state = _fsdp_state(model, opt)
    dcp.load(state, checkpoint_id=root)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    loaded = _full(model)
    _fsdp_train(model, opt, SAVE_AT, STEPS, 2, dist.get_rank())
    return {"loaded": loaded, "final": _full(model)}


def _config(stage: int, world: int) -> dict:
    return {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8 // world,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 40,
                                  "stage3_param_persistence_threshold": 20}}


def _ours(root: str, stage: int, world: int, load: bool, save: bool) -> dict:
    model = make_model(0)
    engine = zeroengine.initialize(model, _config(stage, world), optimizer=optimizer(
        [p for p in model.parameters() if p.requires_grad]))
    rank = engine.comm.rank
    out = {}
    if load:
        out["path"], out["client"] = engine.load_checkpoint(root)
        out["loaded"] = engine.consolidated_state_dict()
        out["global_steps"] = engine.global_steps
    for step in range(SAVE_AT if load else 0, STEPS if load else SAVE_AT):
        tokens, targets = global_batch(step, world, rank)
        engine.backward(loss_fn(engine(tokens), targets))
        engine.step()
    if save:
        out["saved"] = engine.consolidated_state_dict()
        engine.save_checkpoint(root, tag="dcp", client_state={"epoch": 2}, format="dcp")
        for step in range(SAVE_AT, STEPS):
            tokens, targets = global_batch(step, world, rank)
            engine.backward(loss_fn(engine(tokens), targets))
            engine.step()
    out["final"] = engine.consolidated_state_dict()
    return out


def _close(ours: dict, theirs: dict, tol: float = 1e-5) -> None:
    """Within ``tol``, except the layer that never gets a gradient: torch's AdamW under FSDP2
    skips a parameter whose .grad is None, zeroengine (as DeepSpeed) steps it with a zero
    gradient, so weight decay shrinks it - a difference of the engines, not the checkpoint."""
    for name, value in theirs.items():
        if name.startswith("unused."):
            continue
        err = (ours[name] - value).abs().max().item() / max(value.abs().max().item(), 1e-12)
        assert err <= tol, f"{name}: relative error {err:.3g}"


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fsdp") / "ckpt")
    return root, run_ranks(2, _fsdp_saves, root, timeout=600)[0]


@pytest.mark.parametrize("stage,world", [(3, 2), (2, 1), (1, 2), (0, 2)])
def test_fsdp2_dcp_checkpoint_continues_here(fsdp_run, stage, world):
    root, theirs = fsdp_run
    ours = run_ranks(world, _ours, root, stage, world, True, False)[0]
    assert ours["global_steps"] == SAVE_AT  # Adam's step count stands for the steps
    for name, value in theirs["saved"].items():
        assert torch.equal(ours["loaded"][name], value), name
    _close(ours["final"], theirs["final"])


@pytest.mark.parametrize("stage,world", [(3, 2), (2, 1)])
def test_zeroengine_dcp_checkpoint_continues_in_fsdp2(tmp_path, stage, world):
    root = str(tmp_path / "run")
    ours = run_ranks(world, _ours, root, stage, world, False, True)[0]
    theirs = run_ranks(2, _fsdp_loads, os.path.join(root, "dcp"), timeout=600)[0]
    for name, value in theirs["loaded"].items():
        assert torch.equal(ours["saved"][name], value), name
    _close(ours["final"], theirs["final"])
    # and back here, at another stage: the same numbers, counters and client_state
    back = run_ranks(2, _ours, root, 1, 2, True, False)[0]
    assert back["global_steps"] == SAVE_AT and back["path"].endswith("dcp")
    assert back["client"] == {"epoch": 2}
    _close(back["final"], ours["final"])


def test_consolidate_dcp_equals_dcp_to_torch_save(fsdp_run, tmp_path):
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from zeroengine.tools.cli import main
    root, _ = fsdp_run
    assert main(["consolidate", root, str(tmp_path / "hf")]) == 0
    ours = load_file(str(tmp_path / "hf" / "model.safetensors"))
    dcp_to_torch_save(root, str(tmp_path / "ref.pt"))
    reference = torch.load(str(tmp_path / "ref.pt"), weights_only=True)["model"]
    assert set(ours) == set(reference)
    for key, value in reference.items():
        assert torch.equal(ours[key], value.float()), key


@given(st.lists(st.integers(1, 4), min_size=0, max_size=3), st.data())
def test_rectangles_cover_a_flat_range_in_order(shape, data):
    numel = 1
    for s in shape:
        numel *= s
    begin = data.draw(st.integers(0, numel))
    end = data.draw(st.integers(begin, numel))
    full = torch.arange(numel).view(shape)
    got = []
    for offsets, sizes in rectangles(shape, begin, end):
        index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        got += full[index].reshape(-1).tolist()
    assert got == list(range(begin, end))


def _damaged(root: str, tmp_path, how: str) -> str:
    copy = str(tmp_path / "ckpt")
    shutil.copytree(root, copy)
    if how == "missing file":
        os.remove(os.path.join(copy, "__1_0.distcp"))
    elif how == "truncated":
        path = os.path.join(copy, "__1_0.distcp")
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    elif how == "bad metadata":
        with open(os.path.join(copy, ".metadata"), "r+b") as f:
            f.truncate(100)
    return copy


def _load_only(root: str) -> str:
    model = make_model(0)
    engine = zeroengine.initialize(model, _config(2, 1), optimizer=optimizer(
        [p for p in model.parameters() if p.requires_grad]))
    return load_refused(engine, root)


@pytest.mark.parametrize("how,words", [
    ("missing file", "__1_0.distcp is missing"),
    ("truncated", "__1_0.distcp is shorter than .metadata says"),
    ("bad metadata", "is not readable DCP metadata"),
])
def test_damaged_dcp_is_named_and_loads_nothing(fsdp_run, tmp_path, how, words):
    message = run_ranks(1, _load_only, _damaged(fsdp_run[0], tmp_path, how))[0]
    assert words in message, message
