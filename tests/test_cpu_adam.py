"""zeroengine.ops.CPUAdam (C++ one-pass kernel) equals torch.optim.AdamW / Adam."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from zeroengine.ops import CPUAdam
from zeroengine.ops import cpu_adam


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (elementwise ratios blow up where the reference is ~0)."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() if b.numel() else 0.0


def run(make_optimizer, size, steps, seed, lr_gamma=None):
    g = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(size, generator=g))
    opt = make_optimizer([p])
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, lr_gamma) if lr_gamma else None
    for _ in range(steps):
        p.grad = torch.randn(size, generator=g)
        opt.step()
        if sched is not None:
            sched.step()
    return p.detach(), opt


def test_extension_is_built():
    assert cpu_adam.using_extension()


@settings(max_examples=120, deadline=None)
@given(size=st.sampled_from([0, 1, 7, 15, 16, 17, 33, 1000, 4099, 70_001]),
       lr=st.floats(1e-5, 1e-1), beta1=st.floats(0.0, 0.99), beta2=st.floats(0.5, 0.9999),
       eps=st.sampled_from([1e-8, 1e-6, 1e-3]), weight_decay=st.sampled_from([0.0, 0.01, 0.3]),
       adamw=st.booleans(), steps=st.integers(1, 5), gamma=st.sampled_from([None, 0.5]),
       use_ext=st.booleans())
def test_matches_torch(size, lr, beta1, beta2, eps, weight_decay, adamw, steps, gamma, use_ext):
    torch_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    kw = dict(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
    ours, _ = run(lambda ps: CPUAdam(ps, adamw_mode=adamw, use_extension=use_ext, **kw),
                  size, steps, 0, gamma)
    ref, _ = run(lambda ps: torch_cls(ps, foreach=False, **kw), size, steps, 0, gamma)
    assert rel_err(ours, ref) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_copy_is_the_rounded_result(dtype):
    p = torch.nn.Parameter(torch.randn(10_007))
    p.grad = torch.randn(10_007)
    low = torch.empty(10_007, dtype=dtype)
    CPUAdam([p], lr=0.01).step(low_precision_copies={p: low})
    assert torch.equal(low, p.detach().to(dtype))


def test_state_and_scheduler_interplay():
    _, opt = run(lambda ps: CPUAdam(ps, lr=0.1), 100, 3, 1, lr_gamma=0.5)
    state = next(iter(opt.state.values()))
    assert state["step"] == 3 and opt.param_groups[0]["lr"] == pytest.approx(0.0125)


def test_bad_hyperparameters():
    with pytest.raises(ValueError, match="betas"):
        CPUAdam([torch.nn.Parameter(torch.zeros(1))], betas=(0.9, 1.0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_copy_rounds_special_values_like_torch(dtype):
    """The kernel's own branch-free converters against torch's .to(dtype): ties, overflow,
    subnormals, NaN (lr 0 and zero gradients leave a finite parameter as it is)."""
    info = torch.finfo(dtype)
    tiny = info.tiny
    values = [0.0, -0.0, 1.0, -1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -11, 1 + 3 * 2 ** -11,
              float(info.max), float(info.max) * 1.001, 65520.0, 1e30, -1e30, tiny, tiny / 3,
              tiny / 1024, 2 ** -24, 2 ** -25, 1.5 * 2 ** -25, 3e-39, float("nan")]
    g = torch.Generator().manual_seed(0)
    values += (torch.randn(4096, generator=g) * torch.logspace(-30, 30, 4096)).tolist()
    p = torch.nn.Parameter(torch.tensor(values, dtype=torch.float32))
    p.grad = torch.zeros_like(p)
    low = torch.empty(len(values), dtype=dtype)
    CPUAdam([p], lr=0.0, weight_decay=0.0).step(low_precision_copies={p: low})
    expected = torch.tensor(values, dtype=torch.float32).to(dtype)
    nan = expected.isnan()
    assert torch.equal(low.isnan(), nan)
    assert torch.equal(low[~nan].view(torch.int16), expected[~nan].view(torch.int16))
