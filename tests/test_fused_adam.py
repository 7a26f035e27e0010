"""FusedAdam's contract (the CUDA kernel's semantics, here through its PyTorch path on the CPU):
the gradient coefficient, non-finite elements left alone, the low-precision copy-out, gradients
passed beside fp32 masters; and the engine's fused step path (what runs on GPUs) against plain
PyTorch at every stage. benchmarks/gpu_check.py checks the kernel itself on a GPU."""
from __future__ import annotations

import pytest
import torch
from harness import (
    PRECISION_STEPS,
    TOLERANCE,
    make_model,
    reference_train,
    relative_deviation,
    train_precision_cases,
)

from zeroengine.ops import FusedAdam
from zeroengine.testing import run_ranks

HYPER = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def trajectories(scale: float, steps: int = 4, adamw: bool = True):
    """(torch's parameter, ours) after the same gradients; ours sees them x scale and unscales
    through grad_coef."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(1000, generator=gen)
    ref = torch.nn.Parameter(start.clone())
    ours = torch.nn.Parameter(start.clone())
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    ref_opt = cls([ref], **HYPER)
    opt = FusedAdam([ours], **HYPER, adamw_mode=adamw, use_cuda_kernels=False)
    for _ in range(steps):
        g = torch.randn(1000, generator=gen)
        ref.grad = g.clone()
        ours.grad = g * scale
        ref_opt.step()
        opt.step(grad_coef=1.0 / scale)
    return ref.detach(), ours.detach(), opt


@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("scale", [1.0, 1024.0, 0.125])
def test_grad_coef_unscales(adamw, scale):
    ref, ours, opt = trajectories(scale, adamw=adamw)
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-6
    assert int(opt.found_nonfinite.item()) == 0


def test_nonfinite_elements_are_left_untouched_and_flagged():
    p = torch.nn.Parameter(torch.linspace(-1, 1, 8))
    opt = FusedAdam([p], **HYPER, use_cuda_kernels=False)
    before = p.detach().clone()
    grad = torch.ones(8)
    grad[2], grad[5] = float("inf"), float("nan")
    p.grad = grad
    opt.step()
    state = opt.state[p]
    assert int(opt.found_nonfinite.item()) == 1
    for i in (2, 5):
        assert p[i].item() == before[i].item()
        assert state["exp_avg"][i].item() == 0.0 and state["exp_avg_sq"][i].item() == 0.0
    # the finite elements took a normal step
    ref = torch.nn.Parameter(before.clone())
    ref.grad = torch.ones(8)
    torch.optim.AdamW([ref], **HYPER).step()
    finite = [i for i in range(8) if i not in (2, 5)]
    assert torch.allclose(p.detach()[finite], ref.detach()[finite], rtol=1e-6, atol=0)
    # the flag is per step
    p.grad = torch.ones(8)
    opt.step()
    assert int(opt.found_nonfinite.item()) == 0


def test_low_copy_and_bf16_grads_beside_fp32_master():
    gen = torch.Generator().manual_seed(1)
    master = torch.randn(300, generator=gen)
    ref = torch.nn.Parameter(master.clone())
    ours = torch.nn.Parameter(master.clone())
    low = torch.empty(300, dtype=torch.bfloat16)
    grad = torch.randn(300, generator=gen).bfloat16()
    ref.grad = grad.float()
    torch.optim.AdamW([ref], **HYPER).step()
    opt = FusedAdam([ours], **HYPER, use_cuda_kernels=False)
    opt.step(low_precision_copies={ours: low}, grads={ours: grad})
    assert ours.grad is None  # the gradient came beside the parameter
    assert torch.allclose(ours.detach(), ref.detach(), rtol=1e-6, atol=0)
    assert torch.equal(low, ours.detach().bfloat16())


def test_no_kernels_on_cpu_means_pytorch_path():
    opt = FusedAdam([torch.nn.Parameter(torch.zeros(3))], use_cuda_kernels=None)
    assert opt._kernels is None  # no GPU here: nothing is built or loaded
    with pytest.raises(RuntimeError, match="CUDA kernels are not available"):
        FusedAdam([torch.nn.Parameter(torch.zeros(3))], use_cuda_kernels=True)


# -- the engine's fused step path, forced onto the CPU -----------------------------------------
CASES = [("fp32", s, "adamw", 1.0) for s in (0, 1, 2, 3)] + \
    [("bf16", s, "adamw", 1.0) for s in (1, 2, 3)] + [("fp16", 2, "adamw", 1.0)]


def train_with_fused_step(cases):
    """test_precision's training, with the inner optimizer FusedAdam on its PyTorch path (on a
    GPU the engine picks it itself, with the kernels)."""
    import zeroengine.core.optim.inner_parts as engine_optim  # where the inner optimizers are built
    from zeroengine.core.optim.factory import cpu_adam_mode

    def fused_inner(base, groups, device):
        d = base.defaults
        return FusedAdam(groups, lr=d["lr"], betas=d["betas"], eps=d["eps"],
                         weight_decay=d["weight_decay"], adamw_mode=cpu_adam_mode(base),
                         use_cuda_kernels=False)
    engine_optim.build_device_inner = fused_inner
    return train_precision_cases(cases)


def test_engine_fused_step_matches_plain_pytorch():
    results = run_ranks(2, train_with_fused_step, CASES)
    reference = reference_train("adamw", 2, PRECISION_STEPS, 2, 1.0)
    initial = {k: v.float() for k, v in make_model().state_dict().items()}
    for i, (name, stage, _, _) in enumerate(CASES):
        for rank in range(2):
            state, skipped, _, _ = results[rank][i]
            deviation = relative_deviation(state, reference, initial)
            bound = 1e-5 if name == "fp32" else TOLERANCE
            assert deviation < bound, f"{name} stage {stage} rank {rank}: {deviation:.2e}"
            assert skipped == 0


def resume_across_optimizers(root: str, stage: int):
    """2 steps with the fused inner optimizer (what a GPU run has), checkpoint, then 2 more in
    an engine with torch's AdamW inside (what a CPU run has): the state carries over."""
    from harness import make_optimizer, param_groups, precision_config, run_step

    import zeroengine
    import zeroengine.core.optim.inner_parts as engine_optim  # where the inner optimizers are built

    def engine_with(inner_builder):
        engine_optim.build_device_inner = inner_builder
        model = make_model()
        return zeroengine.initialize(model, precision_config("fp32", stage),
                                     optimizer=make_optimizer("adamw", param_groups(model)))
    original = engine_optim.build_device_inner
    first = engine_with(lambda base, groups, device: FusedAdam(
        groups, lr=base.defaults["lr"], betas=base.defaults["betas"], eps=base.defaults["eps"],
        weight_decay=base.defaults["weight_decay"], use_cuda_kernels=False))
    assert type(first.optimizer.inner).__name__ == "FusedAdam"
    for step in range(2):
        run_step(first, step, 2)
    first.save_checkpoint(root)
    first.close()
    second = engine_with(original)
    assert type(second.optimizer.inner).__name__ == "AdamW"
    second.load_checkpoint(root)
    for step in range(2, PRECISION_STEPS):
        run_step(second, step, 2)
    state = second.consolidated_state_dict()
    second.close()
    return state


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_moves_between_fused_and_torch_adam(tmp_path, stage):
    results = run_ranks(2, resume_across_optimizers, str(tmp_path), stage)
    reference = reference_train("adamw", 2, PRECISION_STEPS, 2, 1.0)
    initial = {k: v.float() for k, v in make_model().state_dict().items()}
    for state in results:
        assert relative_deviation(state, reference, initial) < 1e-5
