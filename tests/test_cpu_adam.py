"""zeroengine.ops.CPUAdam (C++ one-pass kernel) equals torch.optim.AdamW / Adam."""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from zeroengine.ops import CPUAdam, cpu_adam, torch_adam


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


@settings(max_examples=examples(120), deadline=None)
@given(size=st.sampled_from([0, 1, 7, 15, 16, 17, 33, 1000, 4099, 70_001]),
       lr=st.floats(1e-5, 1e-1), beta1=st.floats(0.0, 0.99), beta2=st.floats(0.5, 0.9999),
       eps=st.sampled_from([1e-8, 1e-6, 1e-3]), weight_decay=st.sampled_from([0.0, 0.01, 0.3]),
       adamw=st.booleans(), steps=st.integers(1, 5), gamma=st.sampled_from([None, 0.5]),
       use_ext=st.booleans())
# found by hypothesis: 1 - beta2 taken in float (1 - 0.9999f is 1.7e-4 off, relative)
@example(size=1000, lr=1e-3, beta1=0.9, beta2=0.9999, eps=1e-8, weight_decay=0.0, adamw=True,
         steps=5, gamma=None, use_ext=True)
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


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between a and b in float32 units in the last place (same-sign values:
    the bit patterns of floats are ordered like the values)."""
    ia, ib = a.view(torch.int32).long(), b.view(torch.int32).long()
    return int((ia - ib).abs().max()) if a.numel() else 0


def ulp_of(x: torch.Tensor) -> torch.Tensor:
    """The float32 spacing at |x|, elementwise."""
    x = x.abs()
    return torch.nextafter(x, torch.full_like(x, float("inf"))) - x


@settings(max_examples=examples(80), deadline=None)
@given(lr=st.floats(1e-5, 1e-1), beta1=st.sampled_from([0.0, 0.3, 0.5, 0.9, 0.95]),
       beta2=st.sampled_from([0.9, 0.95, 0.999, 0.9999]), eps=st.sampled_from([1e-8, 1e-6]),
       weight_decay=st.sampled_from([0.0, 0.01, 0.1]), adamw=st.booleans(),
       step=st.integers(1, 2000), seed=st.integers(0, 2**16))
def test_kernel_within_one_ulp_of_the_reference(lr, beta1, beta2, eps, weight_decay, adamw,
                                               step, seed):
    """One step from the same state: the C++ kernel and the PyTorch reference that the CUDA
    path falls back to (and the CUDA kernel mirrors: csrc/common/adam_coefficients.h) agree
    within one float32 ulp per element, for both lerp forms (beta1 below and above 0.5) and
    both weight decays. m and v: one ulp of their own value. The parameter is a sum, p*decay -
    update: one ulp of the largest of the two and the result (where they nearly cancel, one ulp
    of the update is many ulps of the small result, and that is rounding, not a different
    formula)."""
    g = torch.Generator().manual_seed(seed)
    n = 4099
    p0, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)
    m0 = torch.randn(n, generator=g) * 0.1
    v0 = torch.rand(n, generator=g) * 0.01
    hyper = (lr, beta1, beta2, eps, weight_decay, step, adamw, True)
    kernel = [t.clone() for t in (p0, m0, v0)]
    cpu_adam._ext.adam_step(kernel[0], grad, kernel[1], kernel[2], *hyper, None)
    reference = [t.clone() for t in (p0, m0, v0)]
    torch_adam.adam_torch(reference[0], grad, reference[1], reference[2], *hyper)
    for name, ours, ref in zip(("exp_avg", "exp_avg_sq"), kernel[1:], reference[1:]):
        assert ulps(ours, ref) <= 1, f"{name}: {ulps(ours, ref)} ulps apart"
    decayed = p0 * (1 - lr * weight_decay) if adamw else p0
    scale = torch.maximum(torch.maximum(decayed.abs(), (reference[0] - decayed).abs()),
                          reference[0].abs())
    excess = (kernel[0] - reference[0]).abs() - ulp_of(scale)
    assert excess.max() <= 0, f"param: {float(excess.max()):.3g} past one ulp"


# -- the 16-bit step's AVX2 kernel (csrc/adam/mixed_avx2.h) against mixed_range ---------------
MIXED_LAYOUTS = [  # (master, moments, gradient, copy-out) the AVX2 kernel takes
    (torch.float32, torch.bfloat16, torch.float32, None),
    (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float32, torch.float32, None),
    (torch.bfloat16, torch.float32, torch.bfloat16, None),
    (torch.bfloat16, torch.bfloat16, torch.float32, None),
    (torch.bfloat16, torch.bfloat16, torch.bfloat16, None),
]


def _special_values(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Sprinkle NaN, +-inf, +-0, huge (rounding carries into the exponent) and subnormal
    values over ``t``."""
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3.3e38,
                             -3.3e38, 1e-40, 1.00390625, 1.01171875])  # last two: bf16 ties
    where = torch.randint(0, t.numel(), (max(1, t.numel() // 20),), generator=g)
    t.view(-1)[where] = specials[torch.randint(0, len(specials), where.shape, generator=g)].to(
        t.dtype)
    return t


def _mixed_step(layout, n, stochastic, runs, seed, avx2: bool, lerp_beta1: float):
    ext = cpu_adam._ext
    pd, sd, gd, low_dtype = layout
    g = torch.Generator().manual_seed(seed)
    p = _special_values(torch.randn(n, generator=g).to(pd), g)
    grad = _special_values(torch.randn(n, generator=g).to(gd), g)
    m = (torch.randn(n, generator=g) * 0.1).to(sd)
    v = (torch.rand(n, generator=g) * 0.01).to(sd)
    low = torch.empty(n, dtype=low_dtype) if low_dtype is not None else None
    was = ext.use_avx2(avx2)
    try:
        built = ext.adam_step_mixed(p, grad, m, v, 1e-2, lerp_beta1, 0.95, 1e-8, 0.1, 3, True,
                                    True, 0.5, stochastic, 1234, runs, low)
    finally:
        ext.use_avx2(was)
    assert built
    return [t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)
            for t in (p, m, v, *([low] if low is not None else []))]


@pytest.mark.skipif(not (cpu_adam.using_extension() and cpu_adam._ext.avx2_available()),
                    reason="the kernel is used on AVX2 CPUs without AVX-512 only, not here")
@settings(max_examples=examples(60), deadline=None)
@given(layout=st.sampled_from(MIXED_LAYOUTS), n=st.sampled_from([16, 17, 31, 48, 1000, 40_001]),
       stochastic=st.booleans(), split=st.booleans(), seed=st.integers(0, 2 ** 16),
       beta1=st.sampled_from([0.9, 0.3]))
def test_avx2_kernel_is_bitwise_the_vectorised_loop(layout, n, stochastic, split, seed, beta1):
    """Both of torch's lerp forms, both roundings, runs that start mid-block and at model
    indices crossing 2^32, NaN/inf/ties/subnormals: every output bit equal."""
    if stochastic and layout[0] != torch.bfloat16 and layout[1] != torch.bfloat16:
        stochastic = False
    runs = None
    if split:
        a = n // 3
        runs = torch.tensor([[0, a, 2 ** 32 - 7], [a, n - a, 5]], dtype=torch.int64)
    ours = _mixed_step(layout, n, stochastic, runs, seed, True, beta1)
    loop = _mixed_step(layout, n, stochastic, runs, seed, False, beta1)
    for a, b in zip(ours, loop):
        assert torch.equal(a, b)
