"""One step clock (core/compat/step_clock.py): every way a loop completes an optimizer step - the
rows of README's "A loop written for DDP" table - advances the same counters, steps the
config's scheduler, writes the same monitor rows and progress lines and tags checkpoints as the
same run through engine.step() does; at stages 0-3, with an fp16 overflow and an
on_nonfinite "skip" injected. Schedulers the user steps are not stepped twice; loops that mix
engine.step() and optimizer.step() so that steps cannot be counted are refused by name."""
from __future__ import annotations

import csv
import io
import logging
import os
import warnings

import pytest
import torch
import torch.nn as nn
from conftest import train_on_ranks

import zeroengine
from zeroengine import MixedStepError
from zeroengine.testing import run_ranks

STEPS = 5
WORLD = 2
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1,
                                         "warmup_num_steps": 4}}
# loops of the README table; "engine" is the reference every other one is compared with
LOOPS = ["plain", "accumulate", "no_sync", "clip", "chained", "engine_backward"]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def config(stage: int, root: str, *, accumulation: int = 1, precision: str = "fp32",
           nonfinite: str = "raise") -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accumulation,
           "steps_per_print": 2, "wall_clock_breakdown": True, "on_nonfinite": nonfinite,
           "scheduler": WARMUP,
           "csv_monitor": {"enabled": True, "output_path": root, "job_name": "monitor"},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def run_loop(stage: int, loop: str, root: str, precision: str = "fp32",
             inject_at: int | None = None, nonfinite: str = "raise") -> dict:
    """``loop`` for STEPS optimizer steps on this rank; what the clock made of it."""
    net = model()
    accumulation = 2 if loop in ("accumulate", "no_sync", "engine_accumulate") else 1
    params = list(net.parameters())
    if loop in ("chained", "engine_chained"):
        optimizer = [torch.optim.SGD(params[:2], lr=0.1), torch.optim.SGD(params[2:], lr=0.1)]
    else:
        optimizer = torch.optim.SGD(params, lr=0.1)
    logger = logging.getLogger("zeroengine")
    records = Records()
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    engine = zeroengine.initialize(
        net, config(stage, root, accumulation=accumulation, precision=precision,
                    nonfinite=nonfinite), optimizer=optimizer)
    opts = optimizer if isinstance(optimizer, list) else [optimizer]
    dtype = next(net.parameters()).dtype
    gen = torch.Generator().manual_seed(engine.comm.rank)
    lrs = []
    for step in range(STEPS):
        for micro in range(accumulation):
            x = torch.randn(2, 4, generator=gen).to(dtype)
            loss = engine(x).float().square().mean()
            if step == inject_at and micro == 0:
                loss = loss * float("inf")  # every gradient non-finite: a skipped step
            if loop.startswith("engine") or loop == "engine_backward":
                engine.backward(loss)
                if loop != "engine_backward":
                    engine.step()
            elif loop == "no_sync" and micro == 0:
                with engine.no_sync():
                    loss.backward()
            else:
                loss.backward()
        if loop == "clip":
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        if not loop.startswith("engine") or loop == "engine_backward":
            for opt in opts:
                opt.step()
            for opt in opts:
                opt.zero_grad()
        lrs.append([float(g["lr"]) for g in engine.optimizer.param_groups])
    counters = {"global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
                "global_samples": engine.global_samples, "skipped_steps": engine.skipped_steps}
    tag = os.path.basename(engine.save_checkpoint(os.path.join(root, "ckpt")))
    engine.close()
    logger.removeHandler(records)
    rows = {}
    folder = os.path.join(root, "monitor")
    if os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            with open(os.path.join(folder, name), newline="") as f:
                rows[name] = list(csv.reader(f))
    progress = [line for line in records.lines if line.startswith("step=")]
    timings = [line for line in records.lines if line.startswith("time (ms")]
    return {"lrs": lrs, "counters": counters, "tag": tag, "rows": rows, "progress": progress,
            "timings": timings}


def train(cases):
    out = []
    for index, (stage, loop, precision, inject_at, nonfinite) in enumerate(cases):
        root = os.path.join(os.environ["CLOCK_TMP"], f"case{index}")
        os.makedirs(root, exist_ok=True)
        out.append(run_loop(stage, loop, root, precision, inject_at, nonfinite))
    return out


REFERENCE = {"plain": "engine", "accumulate": "engine_accumulate", "no_sync": "engine_accumulate",
             "clip": "engine", "chained": "engine_chained", "engine_backward": "engine"}
CASES = []
for _stage in range(4):
    for _loop in LOOPS + ["engine", "engine_accumulate", "engine_chained"]:
        CASES.append((_stage, _loop, "fp32", None, "raise"))
# an fp16 overflow skipped by the loss scaler; an inf skipped by on_nonfinite "skip"
CASES += [(2, "engine", "fp16", 2, "raise"), (2, "engine_backward", "fp16", 2, "raise"),
          (3, "engine", "fp16", 2, "raise"), (3, "engine_backward", "fp16", 2, "raise"),
          (1, "engine", "fp32", 1, "skip"), (1, "plain", "fp32", 1, "skip"),
          (3, "engine", "fp32", 1, "skip"), (3, "clip", "fp32", 1, "skip")]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    os.environ["CLOCK_TMP"] = str(tmp_path_factory.mktemp("clock"))
    return train_on_ranks(WORLD, train, CASES)


def result(trained, stage, loop, precision="fp32", inject_at=None, nonfinite="raise"):
    return trained[CASES.index((stage, loop, precision, inject_at, nonfinite))]


def without_loss(rows: dict) -> dict:
    """A plain loop's loss.backward() does not pass the loss to the engine, so its monitor has
    no train_loss rows (engine.backward(loss) gives them); every other row must match."""
    return {k: v for k, v in rows.items() if not k.endswith("train_loss.csv")}


@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("loop", LOOPS)
def test_every_loop_counts_like_engine_step(trained, stage, loop):
    ours, reference = result(trained, stage, loop), result(trained, stage, REFERENCE[loop])
    for rank in range(WORLD):
        got, want = ours[rank], reference[rank]
        assert got["lrs"] == want["lrs"], (rank, got["lrs"], want["lrs"])
        assert got["counters"] == want["counters"], (rank, got["counters"], want["counters"])
        assert got["tag"] == want["tag"] == f"global_step{STEPS}"
        assert got["progress"] == want["progress"]
        assert len(got["timings"]) == len(want["timings"]) == (rank == 0) * (STEPS // 2)
    # the warm-up the config asks for, not the lr it started at (the bug: 0.0 for ever)
    first = result(trained, stage, loop)[0]["lrs"]
    assert [round(r[0], 3) for r in first[:5]] == [0.0, 0.05, 0.079, 0.1, 0.1]  # DeepSpeed's
    rank0, ref0 = ours[0]["rows"], reference[0]["rows"]
    assert rank0  # rank 0 wrote the (shared) monitor directory
    if loop == "engine_backward":
        assert rank0 == ref0
    else:
        assert without_loss(rank0) == without_loss(ref0) and without_loss(rank0)
    samples = [int(row[0]) for row in rank0["Train_Samples_lr.csv"][1:]]
    assert samples == [(s + 1) * 2 * WORLD * (2 if "accum" in REFERENCE[loop] else 1)
                       for s in range(STEPS)]


@pytest.mark.parametrize("stage,loop,precision,nonfinite", [
    (2, "engine_backward", "fp16", "raise"), (3, "engine_backward", "fp16", "raise"),
    (1, "plain", "fp32", "skip"), (3, "clip", "fp32", "skip")])
def test_skipped_steps_count_and_hold_the_schedule(trained, stage, loop, precision, nonfinite):
    at = 2 if precision == "fp16" else 1
    ours = result(trained, stage, loop, precision, at, nonfinite)
    reference = result(trained, stage, "engine", precision, at, nonfinite)
    for got, want in zip(ours, reference):
        assert got["counters"] == want["counters"]
        assert got["counters"]["skipped_steps"] == 1 and got["counters"]["global_steps"] == STEPS
        assert got["lrs"] == want["lrs"]
        assert got["lrs"][at] == got["lrs"][at - 1]  # the skipped step did not advance it
        assert got["progress"] == want["progress"]
    assert without_loss(ours[0]["rows"]) == without_loss(reference[0]["rows"])
    if precision == "fp16":
        assert ours[0]["rows"] == reference[0]["rows"]  # loss and loss_scale rows too
        assert "Train_Samples_loss_scale.csv" in ours[0]["rows"]


# -- schedulers the user steps ------------------------------------------------------------------
def user_scheduler(path: str):
    """A StepLR passed to initialize: engine.step() drives it (DeepSpeed's rule) and the loop's
    own sched.step() is ignored with a warning; in an opt.step() loop the loop drives it."""
    out = {}
    for how in ("engine", "plain"):
        net = model()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        engine = zeroengine.initialize(net, {"zero_optimization": {"stage": 2}},
                                       optimizer=opt, lr_scheduler=sched)
        lrs = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                loss = engine(torch.randn(2, 4)).square().mean()
                if how == "engine":
                    engine.backward(loss)
                    engine.step()
                else:
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                sched.step()  # the loop steps its scheduler, as under DDP
                lrs.append(opt.param_groups[0]["lr"])
        out[how] = (lrs, [str(w.message) for w in caught if "lr_scheduler.step()" in
                          str(w.message)], sched.state_dict()["last_epoch"])
        engine.close()
    return out


def test_a_scheduler_is_stepped_once_per_step():
    got = run_ranks(2, user_scheduler, "")
    for rank in got:
        assert rank["engine"][0] == rank["plain"][0] == [0.05, 0.025, 0.0125]
        assert rank["engine"][2] == rank["plain"][2] == 3
        assert len(rank["engine"][1]) == 1, rank["engine"][1]  # warned once, not per step
        assert rank["plain"][1] == []


def config_scheduler_stepped_by_user(_):
    net = model()
    engine = zeroengine.initialize(net, {"optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                         "scheduler": WARMUP})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            engine.backward(engine(torch.randn(2, 4)).square().mean())
            engine.step()
            engine.lr_scheduler.step()  # a DeepSpeed script that steps the returned scheduler
    lr = engine.optimizer.param_groups[0]["lr"]
    state = engine.lr_scheduler.state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)  # plain data: the clock's guard is not in the scheduler's state
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    engine.close()
    return round(lr, 3), state["last_epoch"], len(caught)


def test_config_scheduler_stepped_by_the_loop_too_is_not_stepped_twice():
    assert run_ranks(1, config_scheduler_stepped_by_user, None) == [(0.05, 2, 1)]


# -- loops that cannot be counted ---------------------------------------------------------------
def mixed(kind: str):
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    engine = zeroengine.initialize(
        net, {"gradient_accumulation_steps": 2 if kind == "micro" else 1}, optimizer=opt)
    loss = engine(torch.randn(2, 4)).square().mean()
    try:
        engine.backward(loss)
        if kind == "engine_then_opt":
            engine.step()
            opt.step()
        elif kind == "opt_then_engine":
            opt.step()
            engine.step()
        else:  # "micro": engine.step() counting an accumulation, then the optimizer's step
            engine.step()
            opt.step()
    except MixedStepError as err:
        return str(err)
    finally:
        engine.close()
    return None


@pytest.mark.parametrize("kind,words", [
    ("engine_then_opt", "optimizer.step() was called after engine.step() already stepped"),
    ("opt_then_engine", "engine.step() was called after optimizer.step() already stepped"),
    ("micro", "optimizer.step() was called after 1 engine.step() micro-step")])
def test_mixed_loops_are_refused_by_name(kind, words):
    [message] = run_ranks(1, mixed, kind)
    assert message is not None and words in message, message
