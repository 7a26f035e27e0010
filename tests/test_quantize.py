"""Blockwise int8 quantization (the wire format of the quantized collectives): the C++
kernel and the PyTorch fallback give the same bytes, every element comes back within the
documented bound, and the wire is the size the docs say."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zeroengine.ops import quantize as qz


def fallback(fn):
    """Run ``fn`` with the C++ kernel switched off (the PyTorch path)."""
    saved, qz._ext = qz._ext, None
    try:
        return fn()
    finally:
        qz._ext = saved


def test_kernel_is_built():
    # make test builds csrc/quant: a missing kernel would hide behind the fallback
    assert qz.using_extension()


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 3000), block=st.sampled_from([1, 7, 64, 256]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       scale=st.sampled_from([0.0, 1e-30, 1e-3, 1.0, 1e4]), seed=st.integers(0, 2**16))
def test_kernel_equals_fallback_within_bound(n, block, dtype, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=gen) * scale).to(dtype)
    if n > 10:
        x[3:9] = 0  # an all-zero stretch (a whole block when block <= 6)
    q, s = qz.quantize(x, block)
    fq, fs = fallback(lambda: qz.quantize(x, block))
    assert torch.equal(q, fq) and torch.equal(s, fs)
    assert q.abs().max().item() <= 127 if n else True
    out = torch.empty(n, dtype=torch.float32)
    back = qz.dequantize(q, s, out, block)
    fback = fallback(lambda: qz.dequantize(q, s, torch.empty(n), block))
    assert torch.equal(back, fback)
    bound = qz.error_bound(x, block)
    # scale / 2, plus float32's rounding of x / scale and q * scale (<= 127 ulps of the scale)
    assert ((back - x.float()).abs() <= bound * (1 + 1e-4) + 1e-45).all()
    acc = torch.ones(n, dtype=dtype)
    qz.dequantize(q, s, acc, block, accumulate=True)
    facc = fallback(lambda: qz.dequantize(q, s, torch.ones(n, dtype=dtype), block,
                                          accumulate=True))
    assert torch.equal(acc, facc)


def test_wire_size():
    assert qz.wire_bytes(1024, 256) == 1024 + 16
    # 256-element blocks: about half of bf16's bytes, a quarter of fp32's
    assert qz.wire_bytes(1 << 20, 256) / (2 << 20) == pytest.approx(0.508, abs=1e-3)
    assert qz.wire_bytes(1 << 20, 256) / (4 << 20) == pytest.approx(0.254, abs=1e-3)
