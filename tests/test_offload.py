"""Optimizer offload (stages 1-3) and parameter offload (stage 3) give the parameters of the
same run without offload: CPUAdam for AdamW (<= 1e-6, it rounds like torch's single-tensor
AdamW while the device run uses torch's fused kernel), the user's own class otherwise
(bitwise). memory_report() shows where the states went."""
from __future__ import annotations

import pytest
import torch
from conftest import train_on_ranks
from harness import make_model, make_optimizer, max_relative_error, param_groups, train_engine

import zeroengine
from zeroengine import ConfigError
from zeroengine.core.optim.factory import cpu_adam_mode
from zeroengine.testing import run_ranks

STEPS = 5


def offload_config(stage, precision, optimizer_offload, param_offload, sub_group=100):
    cfg = {"gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
           "zero_optimization": {
               "stage": stage, "reduce_bucket_size": 40,
               # several sub-groups per step, so stepping and copying back interleave
               "sub_group_size": sub_group,
               # some parameters whole, some partitioned (the default stage-3 shape)
               "stage3_param_persistence_threshold": 20,
               "offload_optimizer": {"device": "cpu" if optimizer_offload else "none",
                                     "pin_memory": True},
               "offload_param": {"device": "cpu" if param_offload else "none"}}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 10}
    return cfg


def train(cases, drop_in=False):
    out = []
    for stage, precision, optimizer_offload, param_offload, opt in cases:
        engine, _ = train_engine(
            offload_config(stage, precision, optimizer_offload, param_offload), opt, STEPS, 2,
            drop_in)
        master_bytes = sum(4 * fg.layout.shard_numel for fg in engine.flat_groups)
        out.append((engine.consolidated_state_dict(), engine.memory_report(),
                    type(engine.optimizer.inner).__name__, master_bytes))
        engine.close()
    return out


PRECISIONS = ("fp32", "bf16", "fp16")
# (stage, precision, offload_param, optimizer)
CASES = [(s, p, False, "adamw") for s in (1, 2, 3) for p in PRECISIONS] + \
    [(3, p, True, "adamw") for p in PRECISIONS] + \
    [(s, "fp32", s == 3, "sgd") for s in (1, 2, 3)] + [(2, "bf16", False, "sgd")]


def case_id(case):
    stage, precision, param_offload, opt = case
    return f"stage{stage}-{precision}-{opt}" + ("-param" if param_offload else "")


@pytest.fixture(scope="module")
def trained():
    baselines = sorted({(s, p, False, False, o) for s, p, _, o in CASES})
    runs = [(s, p, True, po, o) for s, p, po, o in CASES]
    results = train_on_ranks(2, train, baselines + runs)
    return {case: results[i] for i, case in enumerate(baselines + runs)}


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_offload_matches_the_run_without_it(trained, case):
    stage, precision, param_offload, opt = case
    base = trained[(stage, precision, False, False, opt)]
    offloaded = trained[(stage, precision, True, param_offload, opt)]
    for rank in range(2):
        err, where = max_relative_error(offloaded[rank][0], base[rank][0])
        if opt == "sgd":  # same class, same kernel, only the memory moved
            assert err == 0.0, f"rank {rank}: {err:.2e} at {where}"
        else:
            assert err <= 1e-6, f"rank {rank}: {err:.2e} at {where}"
        assert offloaded[rank][2] == ("CPUAdam" if opt == "adamw" else "SGD")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_memory_report_shows_states_on_the_host(trained, case):
    stage, precision, param_offload, opt = case
    base = trained[(stage, precision, False, False, opt)][0][1]
    report, master_bytes = trained[(stage, precision, True, param_offload, opt)][0][1::2]
    assert report["optimizer_states"] == 0
    # the same master and state elements, now in host memory (torch's AdamW also keeps a
    # small step tensor per chunk, CPUAdam an int); in fp32 the master, which was the
    # parameter memory itself, is now a host copy
    expected = base["optimizer_states"] + (master_bytes if precision == "fp32" else 0)
    assert abs(report["host_optimizer_states"] - expected) <= 64
    assert report["grads"] == base["grads"]  # reduced on the device, as before
    if precision != "fp32":  # fp32 gradients already in host memory are used in place
        assert report["host_grads"] > 0
    if param_offload:
        assert report["host_params"] > 0
        assert report["params"] + report["host_params"] == base["params"]
    else:
        assert report["host_params"] == 0 and report["params"] == base["params"]


def test_gradients_reach_the_host_during_backward():
    """bf16 (gradients need a host fp32 copy): every segment's copy is started by the bucket
    hook in the boundary backward, before step() - the overlap a CUDA run gets."""
    model = make_model()
    engine = zeroengine.initialize(model, offload_config(2, "bf16", True, False),
                                   optimizer=make_optimizer("adamw", param_groups(model)))
    from harness import batch, loss_fn
    tokens, targets = batch(0, 0, 0)
    engine.backward(loss_fn(engine(tokens), targets))
    engine.step()
    assert not engine.offload._grad_copies  # not the boundary: nothing final yet
    engine.backward(loss_fn(engine(tokens), targets))
    segments = sum(len(fg.layout.segments) for fg in engine.flat_groups)
    assert len(engine.offload._grad_copies) == segments
    engine.step()
    assert not engine.offload._grad_copies and engine.global_steps == 1
    engine.close()


def test_drop_in_loop_with_early_step_matches():
    """optimizer.step() straight after loss.backward(): copies made at step time instead."""
    cases = [(2, "bf16", False, False, "adamw"), (2, "bf16", True, False, "adamw"),
             (3, "fp32", False, False, "adamw"), (3, "fp32", True, True, "adamw")]
    results = run_ranks(2, train, cases, True)
    for rank in range(2):
        for base, off in ((0, 1), (2, 3)):
            err, where = max_relative_error(results[rank][off][0], results[rank][base][0])
            assert err <= 1e-6, f"{cases[off]} rank {rank}: {err:.2e} at {where}"


def test_cpu_adam_takes_only_what_it_computes_exactly():
    p = [torch.nn.Parameter(torch.zeros(3))]
    assert cpu_adam_mode(torch.optim.AdamW(p)) is True
    assert cpu_adam_mode(torch.optim.Adam(p, weight_decay=0.1)) is False
    assert cpu_adam_mode(torch.optim.Adam(p, amsgrad=True)) is None
    assert cpu_adam_mode(torch.optim.AdamW(p, maximize=True)) is None
    assert cpu_adam_mode(torch.optim.SGD(p, lr=0.1)) is None


def test_offload_with_a_non_adam_keeps_the_users_class():
    model = make_model()
    opt = torch.optim.Adam(param_groups(model), lr=0.01, amsgrad=True)
    engine = zeroengine.initialize(model, offload_config(1, "fp32", True, False), optimizer=opt)
    assert type(engine.optimizer.inner) is torch.optim.Adam
    assert engine.optimizer.inner.param_groups[0]["amsgrad"] is True
    engine.close()


def test_offload_at_a_stage_that_cannot_is_refused():
    cfg = {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(ConfigError, match="offload_optimizer needs stage 1, 2 or 3"):
        zeroengine.parse_config(cfg)


@pytest.mark.parametrize("stage", [1, 2])
def test_offload_param_below_stage_3_is_ignored_as_deepspeed_does(stage):
    """DeepSpeed reads offload_param only at stage 3 (trlx's stage-2 configs set it): accepted,
    said once, and the parameters stay where they are."""
    from zeroengine.config import policy as config_policy
    config_policy.forget_notices("zero_optimization.offload_param")
    cfg = {"zero_optimization": {"stage": stage, "offload_param": {"device": "cpu"}}}
    with pytest.warns(config_policy.ConfigNotice, match="offload_param.*no effect at stage"):
        zero = zeroengine.parse_config(cfg).zero_optimization
    assert zero.offload_param.device == "none"
