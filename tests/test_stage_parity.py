"""Stages 0-3 at world sizes 1-3 give the parameters of single-process PyTorch training on the
same global batches: two param groups, AdamW and SGD-momentum, accumulation and clipping, tied,
frozen and unused parameters, tiny buckets and one big bucket."""
from __future__ import annotations

import itertools

import pytest
import torch
from harness import (
    max_relative_error,
    reference_train,
    train_engine,
)

from zeroengine.testing import run_ranks

STEPS = 4
CASES = [dict(stage=s, opt=o, accumulation=a, clip=c, bucket=b)
         for s, o, (a, c), b in itertools.product(
             (0, 1, 2, 3), ("adamw", "sgd"), ((1, 0.0), (2, 0.05)), (40, 10_000_000))]


def case_id(c):
    return f"stage{c['stage']}-{c['opt']}-acc{c['accumulation']}-clip{c['clip']}-b{c['bucket']}"


def train_cases(cases, drop_in=False):
    """Runs on every rank: train each case with the engine, return consolidated states."""
    out = []
    for c in cases:
        config = {"gradient_accumulation_steps": c["accumulation"],
                  "gradient_clipping": c["clip"],
                  "zero_optimization": {"stage": c["stage"], "reduce_bucket_size": c["bucket"],
                                        "reduce_scatter": c.get("reduce_scatter", True),
                                        # stage 3: partition every parameter, however small
                                        "stage3_param_persistence_threshold":
                                            c.get("persist", 0)}}
        engine, losses = train_engine(config, c["opt"], STEPS, c["accumulation"], drop_in)
        assert engine.global_steps == STEPS  # a plain loop's opt.step() counts too
        if c["stage"] == 3 and engine.comm.world_size > 1:
            # really partitioned, and nothing left gathered between steps
            assert engine.fetcher.gathers > 0 and not engine.fetcher.gathered
            assert all(p.untyped_storage().nbytes() == 0 for fg in engine.flat_groups
                       if fg.partitioned for p in fg.params)
        out.append((engine.consolidated_state_dict(), engine.get_global_grad_norm(), losses))
        engine.close()
    return out


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda w: f"world{w}")
def trained(request):
    world = request.param
    results = run_ranks(world, train_cases, CASES)
    return world, results


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_single_process_reference(trained, case):
    world, results = trained
    index = CASES.index(case)
    expected = reference_train(case["opt"], world, STEPS, case["accumulation"], case["clip"])
    for rank, per_rank in enumerate(results):
        state, norm, _ = per_rank[index]
        err, where = max_relative_error(state, expected)
        assert err <= 1e-5, f"rank {rank}: max relative error {err:.2e} at {where}"
        assert norm is not None and norm > 0


def test_switching_stage_keeps_the_loss_curve(trained):
    """The same script with only "stage" changed sees the same losses at every micro-step."""
    world, results = trained
    for case in CASES:
        if case["stage"] != 0:
            continue
        base = CASES.index(case)
        for stage in (1, 2, 3):
            other = CASES.index({**case, "stage": stage})
            for rank, per_rank in enumerate(results):
                a, b = per_rank[base][2], per_rank[other][2]
                assert len(a) == len(b) and all(abs(x - y) <= 1e-5 * abs(x) for x, y in
                                                zip(a, b)), (case_id(case), stage, rank, a, b)


DROP_IN = [dict(stage=s, opt="adamw", accumulation=1, clip=0.0, bucket=40)
           for s in (0, 1, 2, 3)]


def test_drop_in_torch_loop_matches_reference():
    """loss.backward(); optimizer.step(); optimizer.zero_grad() on the wrapped model."""
    results = run_ranks(2, train_cases, DROP_IN, True)
    expected = reference_train("adamw", 2, STEPS, 1, 0.0)
    for case_index, case in enumerate(DROP_IN):
        for rank in range(2):
            err, where = max_relative_error(results[rank][case_index][0], expected)
            assert err <= 1e-5, f"stage {case['stage']} rank {rank}: {err:.2e} at {where}"


def test_reduce_scatter_false_all_reduces_and_matches():
    """DeepSpeed's "reduce_scatter": false: gradients all-reduced, the owned chunk kept."""
    cases = [dict(stage=s, opt="adamw", accumulation=2, clip=0.05, bucket=40,
                  reduce_scatter=False) for s in (1, 2, 3)]
    results = run_ranks(2, train_cases, cases)
    expected = reference_train("adamw", 2, STEPS, 2, 0.05)
    for i, case in enumerate(cases):
        for rank in range(2):
            err, where = max_relative_error(results[rank][i][0], expected)
            assert err <= 1e-5, f"stage {case['stage']} rank {rank}: {err:.2e} at {where}"


def test_world_size_one_needs_no_launcher(monkeypatch):
    """No launcher variables at all: a single process, no process group."""
    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(key, raising=False)
    [(state, _, _)] = train_cases([dict(stage=2, opt="sgd", accumulation=2, clip=0.05, bucket=40)])
    err, where = max_relative_error(state, reference_train("sgd", 1, STEPS, 2, 0.05))
    assert err <= 1e-5, f"{err:.2e} at {where}"
    assert not torch.distributed.is_initialized()


def test_stage3_with_small_parameters_kept_whole_matches():
    """The default stage-3 setup: parameters under stage3_param_persistence_threshold stay
    whole beside the partitioned ones, so one optimizer group owns two flat buffers."""
    cases = [dict(stage=3, opt=o, accumulation=a, clip=c, bucket=40, persist=100)
             for o in ("adamw", "sgd") for a, c in ((1, 0.0), (2, 0.05))]
    results = run_ranks(2, train_cases, cases)
    for i, case in enumerate(cases):
        expected = reference_train(case["opt"], 2, STEPS, case["accumulation"], case["clip"])
        for rank in range(2):
            err, where = max_relative_error(results[rank][i][0], expected)
            assert err <= 1e-5, f"{case_id(case)} rank {rank}: {err:.2e} at {where}"
