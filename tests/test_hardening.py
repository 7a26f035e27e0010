"""Failures that would hang or silently diverge become early, clear errors: ranks that built
different things, a rank that stops calling collectives, non-finite gradients without a loss
scaler, and the engine's verbs called in the wrong order."""
from __future__ import annotations

import time

import pytest
import torch
from harness import batch, loss_fn, make_model, make_optimizer, param_groups, run_step

from zeroengine.testing import run_ranks

BASE = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 40}}


def _config(**top) -> dict:
    return {**BASE, **top}


# -- rank consistency --------------------------------------------------------------------------
def build_differently(kind: str):
    import os

    import zeroengine
    model = make_model()
    config = _config()
    rank = int(os.environ["RANK"])
    if rank == 1 and kind == "shape":
        first = model.body[0]
        model.body[0] = torch.nn.Linear(first.in_features, first.out_features + 1)
    if rank == 1 and kind == "requires_grad":
        model.body[0].bias.requires_grad_(False)
    if rank == 1 and kind == "config":
        config = _config(gradient_clipping=0.5)
    if rank == 1 and kind == "version":
        zeroengine.__version__ = "0.0.9"
    try:
        zeroengine.initialize(model, config,
                              optimizer=make_optimizer("adamw", param_groups(model)))
    except zeroengine.RankMismatchError as err:
        return str(err)
    return None


@pytest.mark.parametrize("kind, expected", [
    ("shape", r"rank 1 differs from rank 0 in parameter 'body.0.weight': rank 0 has shape "
              r"\(17, 9\), dtype float32, requires_grad True, rank 1 has shape \(18, 9\)"),
    ("requires_grad", r"rank 1 differs from rank 0 in parameter 'body.0.bias'.*requires_grad "
                      r"True, rank 1 .*requires_grad False"),
    ("config", r"rank 1 differs from rank 0 in the config: gradient_clipping is 0.0 on rank 0, "
               r"0.5 here"),
    ("version", r"rank 1 differs from rank 0 in zeroengine version: rank 0 has 0.1.0, rank 1 "
                r"has 0.0.9"),
])
def test_ranks_that_built_different_things_all_raise(kind, expected):
    messages = run_ranks(2, build_differently, kind)
    for rank, message in enumerate(messages):
        assert message is not None, f"rank {rank} did not raise"
        assert __import__("re").search(expected, message), message


def test_same_build_passes_the_check():
    assert run_ranks(2, build_differently, "none") == [None, None]


# -- collective timeouts -----------------------------------------------------------------------
def one_rank_skips_backward(timeout_s: float):
    """Rank 1 stops after step 1 (as if its data loader ran dry); rank 0 goes on."""
    import os

    import zeroengine
    rank = int(os.environ["RANK"])
    model = make_model()
    engine = zeroengine.initialize(model, _config(collective_timeout_s=timeout_s),
                                   optimizer=make_optimizer("adamw", param_groups(model)))
    run_step(engine, 0, 1)
    if rank == 1:
        time.sleep(2.5 * timeout_s)  # gone quiet; returns without another collective
        return None, 0.0
    start = time.monotonic()
    try:
        run_step(engine, 1, 1)
    except zeroengine.CollectiveError as err:
        return str(err), time.monotonic() - start
    return None, time.monotonic() - start


def test_rank_that_stops_calling_collectives_fails_the_others_in_time():
    timeout = 3.0
    message, waited = run_ranks(2, one_rank_skips_backward, timeout)[0]
    assert message is not None, "rank 0 did not raise"
    assert "at step 2" in message and "timed out after 3 s" in message, message
    # where rank 0 waits first: the forward's buffer broadcast (the model has a buffer), else
    # a gradient bucket
    assert any(w in message for w in ("module buffers", "gradient bucket", "gradient norm")), \
        message
    assert "collective_timeout_s" in message
    assert waited < 3 * timeout, f"took {waited:.1f} s with a {timeout} s timeout"


# -- non-finite gradients ----------------------------------------------------------------------
def nonfinite_on_rank_1(policy: str | None, stage: int, precision: str):
    import os

    import zeroengine
    rank = int(os.environ["RANK"])
    model = make_model()
    config = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 40},
              "bf16": {"enabled": precision == "bf16"}}
    if policy is not None:
        config["on_nonfinite"] = policy
    engine = zeroengine.initialize(model, config,
                                   optimizer=make_optimizer("adamw", param_groups(model)))
    run_step(engine, 0, 1)
    before = engine.consolidated_state_dict()
    tokens, targets = batch(1, 0, rank)
    loss = loss_fn(engine(tokens), targets)
    if rank == 1:
        # one parameter's gradient becomes NaN on rank 1 only
        engine.module.body[2].weight.register_hook(lambda g: g * float("nan"))
    engine.backward(loss)
    try:
        engine.step()
    except FloatingPointError as err:
        return "raised", str(err)
    after = engine.consolidated_state_dict()
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    return "skipped" if unchanged else "stepped", engine.skipped_steps


@pytest.mark.parametrize("stage, precision", [(0, "fp32"), (2, "fp32"), (3, "bf16")])
def test_nonfinite_gradient_raises_by_default_naming_step_and_parameter(stage, precision):
    for outcome, message in run_ranks(2, nonfinite_on_rank_1, None, stage, precision):
        assert outcome == "raised"
        assert message.startswith("step 2: the gradient of 'body.2.weight' holds inf/NaN"), \
            message
        assert '"on_nonfinite": "skip"' in message


def test_nonfinite_gradient_skip_policy_skips_on_every_rank():
    for outcome, skipped in run_ranks(2, nonfinite_on_rank_1, "skip", 2, "fp32"):
        assert (outcome, skipped) == ("skipped", 1)


# -- the verbs in the wrong order --------------------------------------------------------------
def verbs_out_of_order():
    import zeroengine
    model = make_model()
    engine = zeroengine.initialize(model, {"gradient_accumulation_steps": 2, **BASE},
                                   optimizer=make_optimizer("adamw", param_groups(model)))
    out = []
    try:
        engine.step()
    except RuntimeError as err:
        out.append(str(err))
    tokens, targets = batch(0, 0, 0)
    engine.backward(loss_fn(engine(tokens), targets))
    try:
        engine.backward(loss_fn(engine(tokens), targets))
    except RuntimeError as err:
        out.append(str(err))
    engine.step()  # the first backward's micro-step still completes normally
    engine.close()
    return out


def test_step_before_backward_and_double_backward_are_refused():
    step_first, twice = run_ranks(1, verbs_out_of_order)[0]
    assert step_first.startswith("engine.step() called for micro-step 1 without "
                                 "engine.backward(loss)")
    assert "called twice for micro-step 1 without engine.step()" in twice
    assert "gradient_accumulation_steps=2" in twice


def test_wrong_type_optimizer_is_refused():
    import zeroengine
    model = make_model()
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer, got dict"):
        zeroengine.initialize(model, BASE, optimizer={"lr": 0.1})


def test_rank_stopped_by_its_launcher_says_so():
    """torchrun stops the other ranks with SIGTERM when one fails: the stopped rank's log
    names the rank, the signal and where it was, and it still dies of that signal."""
    import os
    import signal
    import subprocess
    import sys

    from zeroengine.testing import free_port
    code = ("import time, zeroengine; zeroengine.init_distributed(); print('ready', flush=True); "
            "time.sleep(60)")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGTERM
    assert "rank 0 stopped by SIGTERM from outside" in err and "in <module>" in err, err
