"""DeepSpeed ZeRO checkpoints continued here: DeepSpeed itself (on CPU, a test dependency)
trains the test model at world 2 and stages 1-3, saves, and trains on; zeroengine loads the same
checkpoint at world 1 and 2 and other stages, and trains on to the same numbers. Also
``zeroengine consolidate`` of a DeepSpeed checkpoint against DeepSpeed's own zero_to_fp32, and
foreign files that cannot be loaded refused by name."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
from harness import global_batch, load_refused, loss_fn, make_model

from zeroengine.testing import run_ranks

SAVE_AT, STEPS = 3, 6
TAG = f"global_step{SAVE_AT}"


def ds_config(stage: int, micro: int, precision: str = "fp32") -> dict:
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01,
                                                     "torch_adam": True}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10,
                                                         "warmup_max_lr": 0.01}},
           "zero_optimization": {"stage": stage}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _deepspeed(root: str, stage: int, precision: str) -> dict:
    """DeepSpeed: train SAVE_AT steps, save, train to STEPS. The fp32 masters and Adam state at
    the save and at the end, by name (rank 0's view: every rank's is the same)."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    deepspeed.init_distributed(dist_backend="gloo")
    model = make_model(0)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(stage, 4, precision),
                                      model_parameters=[p for p in model.parameters()
                                                        if p.requires_grad])
    rank = torch.distributed.get_rank()

    def snapshot():
        out = {}
        for name, p in engine.module.named_parameters():
            if p.requires_grad:
                out[name] = safe_get_full_fp32_param(p).clone()
                for key in ("exp_avg", "exp_avg_sq"):
                    out[f"{name}:{key}"] = safe_get_full_optimizer_state(p, key).clone()
        return out

    seen = {}
    for step in range(STEPS):
        tokens, targets = global_batch(step, 2, rank)
        engine.backward(loss_fn(engine(tokens), targets))
        engine.step()
        if step + 1 == SAVE_AT:
            engine.save_checkpoint(root, tag=TAG, client_state={"epoch": 7})
            seen["saved"] = snapshot()
            seen["saved_lr"] = engine.get_lr()
    seen["final"] = snapshot()
    seen["final_lr"] = engine.get_lr()
    return seen


def _ours(root: str, ds_stage: int, stage: int, world: int, precision: str) -> dict:
    """zeroengine.deepspeed with the same config (stage and micro batch for this world): load
    DeepSpeed's checkpoint, check what came in, train to STEPS."""
    import zeroengine.deepspeed as zd
    model = make_model(0)
    engine, *_ = zd.initialize(model=model, config=ds_config(stage, 8 // world, precision),
                               model_parameters=[p for p in model.parameters()
                                                 if p.requires_grad])
    path, client = engine.load_checkpoint(root)
    rank = engine.comm.rank
    loaded = engine.consolidated_state_dict()
    out = {"path": path, "client": client, "loaded": loaded, "global_steps": engine.global_steps,
           "loaded_lr": engine.get_lr()}
    for step in range(SAVE_AT, STEPS):
        tokens, targets = global_batch(step, world, rank)
        engine.backward(loss_fn(engine(tokens), targets))
        engine.step()
    out["final"] = engine.consolidated_state_dict()
    out["final_lr"] = engine.get_lr()
    return out


@pytest.fixture(scope="module")
def ds_runs(tmp_path_factory):
    """DeepSpeed at world 2: fp32 at stages 1-3, bf16 at stage 2 (one spawn each)."""
    root = tmp_path_factory.mktemp("ds")
    runs = {}
    for stage, precision in ((1, "fp32"), (2, "fp32"), (3, "fp32"), (2, "bf16")):
        where = str(root / f"s{stage}_{precision}")
        runs[(stage, precision)] = (where, run_ranks(2, _deepspeed, where, stage, precision,
                                                     timeout=600)[0])
    return runs


def _compare(ours: dict, theirs: dict, tol: float) -> None:
    for name, value in theirs.items():
        if ":" in name:
            continue
        got = ours[name]
        err = (got - value).abs().max().item() / max(value.abs().max().item(), 1e-12)
        assert err <= tol, f"{name}: relative error {err:.3g}"


@pytest.mark.parametrize("ds_stage,stage,world", [
    (1, 1, 2), (2, 2, 2), (3, 3, 2),  # same layout
    (1, 3, 1), (2, 0, 1), (3, 2, 1), (3, 1, 2), (2, 3, 2)])  # another world size or stage
def test_deepspeed_checkpoint_resumes_here(ds_runs, ds_stage, stage, world):
    where, theirs = ds_runs[(ds_stage, "fp32")]
    ours = run_ranks(world, _ours, where, ds_stage, stage, world, "fp32")[0]
    assert ours["path"].endswith(TAG) and ours["client"] == {"epoch": 7}
    assert ours["global_steps"] == SAVE_AT
    for name, value in theirs["saved"].items():  # the fp32 masters, exactly
        if ":" not in name:
            assert torch.equal(ours["loaded"][name], value), name
    assert ours["loaded_lr"] == pytest.approx(theirs["saved_lr"], rel=1e-7)
    # Adam's moments and step came too: training on matches DeepSpeed's own resume
    _compare(ours["final"], theirs["final"], 1e-5)
    assert ours["final_lr"] == pytest.approx(theirs["final_lr"], rel=1e-7)


def test_bf16_deepspeed_checkpoint_resumes_here(ds_runs):
    """bf16 at stage 2: the fp32 masters load exactly; training on in bf16 stays within bf16's
    rounding of DeepSpeed's (both round the same masters to bf16 for the forward)."""
    where, theirs = ds_runs[(2, "bf16")]
    ours = run_ranks(2, _ours, where, 2, 3, 2, "bf16")[0]
    for name, value in theirs["saved"].items():
        if ":" not in name:
            assert torch.equal(ours["loaded"][name], value), name
    _compare(ours["final"], theirs["final"], 2e-2)


def _zero_to_fp32(where: str) -> dict:
    os.environ["DS_ACCELERATOR"] = "cpu"
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    return {k: v.contiguous() for k, v in
            get_fp32_state_dict_from_zero_checkpoint(where, tag=TAG).items()}


@pytest.mark.parametrize("stage,precision", [(1, "fp32"), (2, "bf16"), (3, "fp32")])
def test_consolidate_deepspeed_equals_zero_to_fp32(ds_runs, tmp_path, stage, precision):
    from safetensors.torch import load_file

    from zeroengine.tools.cli import main
    where, theirs = ds_runs[(stage, precision)]
    out = tmp_path / "hf"
    assert main(["consolidate", where, str(out), "--max-shard-size", "1KB"]) == 0
    assert (out / "model.safetensors.index.json").exists()  # several files at 1KB
    import json
    index = json.loads((out / "model.safetensors.index.json").read_text())
    ours = {}
    for name in set(index["weight_map"].values()):
        ours.update(load_file(str(out / name)))
    reference = _zero_to_fp32(where)
    model = make_model(0)
    model.load_state_dict(ours, strict=True)  # every key, tied head included
    for key, value in reference.items():  # DeepSpeed's own conversion, bitwise
        assert torch.equal(ours[key].to(value.dtype), value), key
    if stage == 1:  # zero_to_fp32 leaves stage 1's frozen parameters out; we keep them
        assert "frozen.weight" in ours and "frozen.weight" not in reference


# -- refused by name, nothing half-loaded ---------------------------------------------------------
def _damaged(ds_runs, tmp_path, how: str) -> str:
    where, _ = ds_runs[(2, "fp32")]
    copy = tmp_path / "ckpt"
    shutil.copytree(where, copy)
    tag = copy / TAG
    if how == "missing rank":
        os.remove(tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    elif how == "truncated":
        path = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        data = path.read_bytes()
        path.write_bytes(data[:len(data) // 2])
    elif how == "tensor parallel":
        shutil.copy(tag / "mp_rank_00_model_states.pt", tag / "mp_rank_01_model_states.pt")
    elif how == "mixed runs":  # rank 1's file from the stage-1 run
        other, _ = ds_runs[(1, "fp32")]
        shutil.copy(os.path.join(other, TAG, "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                    tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    elif how == "unsafe pickle":
        import pickle
        import zipfile

        class Evil:
            def __reduce__(self):
                return (os.system, ("echo pwned",))
        path = tag / "mp_rank_00_model_states.pt"
        with zipfile.ZipFile(path) as z:
            members = {n: z.read(n) for n in z.namelist()}
        pkl = next(n for n in members if n.endswith("data.pkl"))
        members[pkl] = pickle.dumps({"module": Evil()}, protocol=2)
        with zipfile.ZipFile(path, "w") as z:
            for n, data in members.items():
                z.writestr(n, data)
    return str(copy)


def _load_only(root: str) -> str:
    import zeroengine.deepspeed as zd
    model = make_model(0)
    engine, *_ = zd.initialize(model=model, config=ds_config(2, 8),
                               model_parameters=[p for p in model.parameters()
                                                 if p.requires_grad])
    return load_refused(engine, root)


@pytest.mark.parametrize("how,words", [
    ("missing rank", "lacks the optimizer states of rank(s) [1]"),
    ("truncated", "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    ("tensor parallel", "tensor (model) parallelism"),
    ("mixed runs", "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    ("unsafe pickle", "pickles posix.system"),
])
def test_foreign_damage_is_named_and_loads_nothing(ds_runs, tmp_path, how, words):
    message = run_ranks(1, _load_only, _damaged(ds_runs, tmp_path, how))[0]
    assert words in message, message


def _load_with_step_lr(root: str) -> str:
    import zeroengine
    model = make_model(0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    engine = zeroengine.initialize(model, {"train_batch_size": 8,
                                           "zero_optimization": {"stage": 2}},
                                   optimizer=opt,
                                   lr_scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))
    return load_refused(engine, root)


def test_a_deepspeed_schedule_another_scheduler_cannot_take_is_refused_first(ds_runs):
    message = run_ranks(1, _load_with_step_lr, ds_runs[(2, "fp32")][0])[0]
    assert "StepLR cannot take" in message and "load_lr_scheduler_states=False" in message

