"""Code written for plain PyTorch / DDP, run unchanged on the engine (issue 16): every pattern
gives DDP's numbers against a single-process reference of DDP semantics (mean over ranks, sum
over micro-steps), or fails at once with an error naming the parameter and the fix."""
from __future__ import annotations

import itertools

import pytest
import torch

from zeroengine.local_ranks import run_ranks
from models import batch, loss_fn, make_model, make_optimizer, max_relative_error, param_groups

STEPS = 3


def ddp_reference(world: int, accumulation: int, clip: float, steps: int = STEPS):
    """What DDP computes for the plain loop below: each micro-step's loss divided by the
    accumulation count by the user, gradients averaged over ranks and summed over micro-steps,
    torch's clip_grad_norm_ on the result. Returns (state, clip norms)."""
    model = make_model(0)
    opt = make_optimizer("adamw", param_groups(model))
    norms = []
    for step in range(steps):
        for micro in range(accumulation):
            for rank in range(world):
                tokens, targets = batch(step, micro, rank)
                (loss_fn(model(tokens), targets) / (accumulation * world)).backward()
        for p in model.parameters():  # the engine counts an absent gradient as zero
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone().float() for k, v in model.state_dict().items()}, norms


def plain_loop(cases):
    """On every rank: nanoGPT's loop shape on the engine - several loss.backward() per step,
    torch.nn.utils.clip_grad_norm_, optimizer.step(), optimizer.zero_grad()."""
    import zeroengine
    out = []
    for c in cases:
        model = make_model(0)
        opt = make_optimizer("adamw", param_groups(model))
        engine = zeroengine.initialize(model, {
            "gradient_accumulation_steps": c["config_accumulation"],
            "zero_optimization": {"stage": c["stage"], "reduce_bucket_size": 40,
                                  "stage3_param_persistence_threshold": c.get("persist", 0)}},
            optimizer=opt)
        rank = engine.comm.rank
        norms = []
        for step in range(STEPS):
            for micro in range(c["accumulation"]):
                tokens, targets = batch(step, micro, rank)
                (loss_fn(model(tokens), targets) / c["accumulation"]).backward()
            if c["clip"]:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                                  c["clip"])))
            opt.step()
            opt.zero_grad()
        out.append((engine.consolidated_state_dict(), norms))
        engine.close()
    return out


ACCUMULATION_CASES = [dict(stage=s, accumulation=a, config_accumulation=ca, clip=0.0)
                      for s, (a, ca) in itertools.product((0, 1, 2, 3), ((3, 1), (2, 2), (3, 2)))]
CLIP_CASES = [dict(stage=s, accumulation=a, config_accumulation=1, clip=0.05)
              for s, a in itertools.product((0, 1, 2, 3), (1, 2))]


def _check(results, cases, world):
    for i, c in enumerate(cases):
        expected, expected_norms = ddp_reference(world, c["accumulation"], c["clip"])
        for rank in range(world):
            state, norms = results[rank][i]
            err, where = max_relative_error(state, expected)
            assert err <= 1e-5, f"{c} rank {rank}: max relative error {err:.2e} at {where}"
            for got, want in zip(norms, expected_norms, strict=True):
                assert abs(got - want) <= 1e-5 * want, f"{c} rank {rank}: norm {got} != {want}"


@pytest.mark.parametrize("world", [2, 3])
def test_plain_loop_accumulation_matches_ddp(world):
    """Several loss.backward() before optimizer.step(), whatever the config's
    gradient_accumulation_steps (fewer, equal, or a count that is no multiple of it)."""
    _check(run_ranks(world, plain_loop, ACCUMULATION_CASES), ACCUMULATION_CASES, world)


def test_clip_grad_norm_in_the_loop_clips_by_the_global_norm():
    """torch.nn.utils.clip_grad_norm_(model.parameters(), max) returns the true global norm
    on every rank and clips by it, at every stage (the clip is active: 0.05 < the norms)."""
    _check(run_ranks(2, plain_loop, CLIP_CASES), CLIP_CASES, 2)


def load_other_ranks_optimizer_state(_):
    import zeroengine
    model = make_model(0)
    opt = make_optimizer("adamw", param_groups(model))
    engine = zeroengine.initialize(model, {"zero_optimization": {"stage": 1}}, optimizer=opt)
    tokens, targets = batch(0, 0, engine.comm.rank)
    loss_fn(model(tokens), targets).backward()
    opt.step()
    states = engine.comm.all_gather_object(opt.state_dict())  # every rank's shard
    opt.load_state_dict(states[engine.comm.rank])  # its own: fine
    try:
        opt.load_state_dict(states[0])  # nanoGPT's resume: rank 0's file on every rank
    except ValueError as err:
        return str(err)
    return None


def test_loading_another_ranks_optimizer_shard_is_refused():
    messages = run_ranks(2, load_other_ranks_optimizer_state, None)
    assert messages[0] is None
    assert "rank 1 was given the optimizer state of rank 0" in messages[1]
    assert "engine.load_checkpoint" in messages[1]
