"""bf16 and fp16 with fp32 master chunks at stages 0-2: tracking an fp32 reference, memory per
the ZeRO paper, and dynamic loss scaling decided identically on every rank."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from harness import (
    PRECISION_STEPS,
    TOLERANCE,
    batch,
    loss_fn,
    make_model,
    make_optimizer,
    param_groups,
    precision_config,
    reference_train,
    relative_deviation,
    train_precision_cases,
)

from zeroengine.testing import run_ranks

# (precision, stage, optimizer, clip). Adam is blind to a constant gradient scale and clipping
# normalises it away, so SGD without clipping is what catches a missing or doubled unscale.
CASES = [(p, s, "adamw", 1.0) for p in ("bf16", "fp16", "bf16-fp32reduce", "fp16-static")
         for s in (0, 1, 2, 3)] + [(p, s, "sgd", 0.0) for p in ("bf16", "fp16") for s in (0, 3)]


@pytest.fixture(scope="module")
def trained():
    return run_ranks(2, train_precision_cases, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-stage{c[1]}-{c[2]}")
def test_tracks_fp32_reference(trained, case):
    index = CASES.index(case)
    reference = reference_train(case[2], 2, PRECISION_STEPS, 2, case[3])
    initial = {k: v.float() for k, v in make_model().state_dict().items()}
    compute = "torch.float16" if case[0].startswith("fp16") else "torch.bfloat16"
    for rank, per_rank in enumerate(trained):
        state, skipped, scales, dtypes = per_rank[index]
        assert dtypes == {compute}
        assert all(v.dtype == torch.float32 for k, v in state.items())
        deviation = relative_deviation(state, reference, initial)
        assert deviation < TOLERANCE, f"rank {rank}: deviation {deviation:.3f}"
        if case[0] == "fp16-static":
            assert scales == [512.0] * PRECISION_STEPS
        assert skipped == 0
    # the ranks agree exactly with each other
    for k in trained[0][index][0]:
        assert torch.equal(trained[0][index][0][k], trained[1][index][0][k]), k


def test_bf16_drop_in_loop_tracks_reference():
    results = run_ranks(2, train_precision_cases, [("bf16", 2, "adamw", 1.0)], True)
    reference = reference_train("adamw", 2, PRECISION_STEPS, 2, 1.0)
    initial = {k: v.float() for k, v in make_model().state_dict().items()}
    for state, *_ in (r[0] for r in results):
        assert relative_deviation(state, reference, initial) < TOLERANCE


def fp16_plain_backward():
    import zeroengine
    model = make_model()
    engine = zeroengine.initialize(model, precision_config("fp16", 1),
                                   optimizer=make_optimizer("adamw", param_groups(model)))
    tokens, targets = batch(0, 0, 0)
    with pytest.raises(RuntimeError, match="fp16 training needs engine.backward"):
        loss_fn(engine(tokens), targets).backward()
    return True


def test_fp16_refuses_unscaled_backward():
    assert run_ranks(1, fp16_plain_backward) == [True]


def overflow_on_one_rank(stage):
    """Rank 1 alone gets an inf gradient at step 2: every rank must skip it identically."""
    import zeroengine
    model = make_model()
    engine = zeroengine.initialize(
        model, {"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1,
                         "loss_scale_window": 2},
                "zero_optimization": {"stage": stage, "reduce_bucket_size": 40}},
        optimizer=make_optimizer("adamw", param_groups(model)))
    rank = engine.comm.rank
    log = []
    for step in range(5):
        tokens, targets = batch(step, 0, rank)
        loss = loss_fn(engine(tokens), targets)
        if step == 2 and rank == 1:
            loss = loss * float("inf")
        before = engine.consolidated_state_dict()
        state_before = {id(k): {n: t.clone() for n, t in v.items() if torch.is_tensor(t)}
                        for k, v in engine.optimizer.inner.state.items()}
        engine.backward(loss)
        engine.step()
        after = engine.consolidated_state_dict()
        unchanged = all(torch.equal(before[k], after[k]) for k in before)
        state_same = all(torch.equal(t, engine.optimizer.inner.state[k][n])
                         for k in engine.optimizer.inner.state
                         for n, t in state_before.get(id(k), {}).items())
        log.append((engine.loss_scale, engine.skipped_steps, unchanged, state_same))
    saved = engine.optimizer.state_dict()
    engine.optimizer.loss_scaler.scale = 3.0
    engine.optimizer.load_state_dict(saved)
    return log, engine.loss_scale, engine.global_steps


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_overflow_on_one_rank_skips_everywhere(stage):
    results = run_ranks(2, overflow_on_one_rank, stage)
    assert results[0] == results[1], "ranks disagree"
    log, restored_scale, global_steps = results[0]
    scales = [entry[0] for entry in log]
    skipped = [entry[1] for entry in log]
    # window 2: doubles after 2 clean steps; the overflow at step 2 halves it (hysteresis 1)
    # and restarts the count; two clean steps later it doubles again.
    assert scales == [256.0, 512.0, 256.0, 256.0, 512.0]
    assert skipped == [0, 0, 1, 1, 1]
    assert [entry[2] for entry in log] == [False, False, True, False, False]  # params frozen
    assert log[2][3], "optimizer state changed on a skipped step"
    assert restored_scale == 512.0 and global_steps == 5


def mixed_memory(stages, precision):
    import zeroengine
    out = {}
    for stage in stages:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 200), nn.ReLU(), nn.Linear(200, 200), nn.ReLU(),
                              nn.Linear(200, 33))
        scaling = {"initial_scale_power": 8} if precision == "fp16" else {}
        engine = zeroengine.initialize(model, {
            precision: {"enabled": True, **scaling}, "optimizer": {"type": "AdamW"},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 10_000,
                                  "stage3_param_persistence_threshold": 0}})
        x = torch.randn(8, 64).to(engine.precision.compute)
        for _ in range(2):
            engine.backward(engine(x).float().square().mean())
            engine.step()
        padded = sum(fg.layout.numel for fg in engine.flat_groups)
        segments = sum(len(fg.layout.segments) for fg in engine.flat_groups)
        out[stage] = (engine.memory_report(), padded, segments,
                      sum(p.numel() for p in model.parameters()))
        engine.close()
    return out


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_memory_follows_zero_paper(precision):
    """Bytes per parameter: stage 0: 2+2+12 = 16; stage 1: 2+2+12/N; stage 2: 2+2/N+12/N;
    stage 3: 16/N (outside forward/backward)."""
    world = 2
    formulas = {0: (2, 2, 12), 1: (2, 2, 12 / world), 2: (2, 2 / world, 12 / world),
                3: (2 / world, 2 / world, 12 / world)}
    for per_rank in run_ranks(world, mixed_memory, [0, 1, 2, 3], precision):
        for stage, (report, padded, segments, params) in per_rank.items():
            for key, per_param in zip(("params", "grads", "optimizer_states"), formulas[stage]):
                low, high = per_param * params, per_param * padded + 8 * segments
                assert low <= report[key] <= high, (stage, key, report[key], low, high)


def test_fp16_auto_cast_casts_the_inputs_as_deepspeed_does(monkeypatch):
    """fp16.auto_cast: engine(x) with fp32 inputs runs the fp16 model (DeepSpeed casts them);
    without it the same call fails on the dtype mismatch, as in DeepSpeed."""
    import zeroengine
    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(key, raising=False)
    for auto_cast in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3))
        engine = zeroengine.initialize(model, {
            "fp16": {"enabled": True, "auto_cast": auto_cast}, "optimizer": {
                "type": "SGD", "params": {"lr": 0.1}}})
        x = {"inputs": [torch.randn(2, 4)], "steps": torch.arange(2)}
        from zeroengine.core.module_state import cast_floating
        cast = cast_floating(((x,), {"y": (torch.ones(1),)}), torch.float16)
        assert cast[0][0]["inputs"][0].dtype == torch.float16 and \
            cast[0][0]["steps"].dtype == torch.int64 and cast[1]["y"][0].dtype == torch.float16
        try:
            if auto_cast:
                out = engine(x["inputs"][0])
                assert out.dtype == torch.float16
                engine.backward(out.float().square().mean())
                engine.step()
                assert engine._cast_inputs is torch.float16
            else:
                with pytest.raises(RuntimeError):
                    engine(x["inputs"][0])
        finally:
            engine.close()


def test_steps_per_print_logs_progress_on_rank_0(monkeypatch, caplog):
    """As DeepSpeed's engine: every steps_per_print optimizer steps, step / skipped / lr /
    loss scale at INFO on the 'zeroengine' logger."""
    import logging

    import zeroengine
    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(key, raising=False)
    model = nn.Sequential(nn.Linear(4, 3))
    engine = zeroengine.initialize(model, {"steps_per_print": 2, "optimizer": {
        "type": "SGD", "params": {"lr": 0.25}}})
    with caplog.at_level(logging.INFO, logger="zeroengine"):
        for _ in range(5):
            engine.backward(engine(torch.randn(2, 4)).square().mean())
            engine.step()
    engine.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "zeroengine"]
    assert lines == ["step=2, skipped=0, lr=[0.25], loss_scale=1",
                     "step=4, skipped=0, lr=[0.25], loss_scale=1"], lines
