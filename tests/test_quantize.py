"""Blockwise int8 quantization (the wire format of the quantized collectives): the C++
kernel and the PyTorch fallback give the same bytes, every element comes back within the
documented bound, and the wire is the size the docs say."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

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


@settings(max_examples=examples(40), deadline=None)
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


def quantized_collectives():
    """4 ranks as 2 nodes of 2: the one-hop and two-hop int8 reduce-scatters and the int8
    all-gather, synchronous, against the exact collectives."""
    import torch.distributed as dist

    from zeroengine.distributed.bootstrap import init_distributed
    from zeroengine.distributed.comm import Comm
    from zeroengine.distributed.topology import build_topology
    init_distributed()
    comm = Comm()
    topo = build_topology(comm, comm.world_size, None, 2)
    rank, n = comm.rank, 1000
    gen = torch.Generator().manual_seed(rank)
    grads = torch.randn(4 * n, generator=gen) * (rank + 1)
    exact = torch.empty(n)
    comm.reduce_scatter(exact, grads.clone(), "avg")
    every = [torch.empty(4 * n) for _ in range(4)]
    dist.all_gather(every, grads)
    # each sender's chunk for this rank is off by at most its block max / 254; the mean of them
    bound = sum(qz.error_bound(e[rank * n:(rank + 1) * n], 256) for e in every) / 4
    one, two = torch.empty(n), torch.empty(n)
    comm.reduce_scatter_quantized(one, grads, 256)
    comm.reduce_scatter_quantized_2hop(two, grads, 256, topo.node, topo.across)
    gathered = torch.empty(4 * n)
    comm.all_gather_quantized(gathered, grads[:n] * 0 + rank, 256)  # each rank's constant
    return ((one - exact).abs() <= bound * 1.001).all().item(), \
        ((two - exact).abs() <= 2.2 * bound).all().item(), \
        (two - exact).abs().max().item() > 0, \
        torch.allclose(gathered, torch.arange(4.0).repeat_interleave(n), rtol=1e-6)


def test_quantized_collectives_within_bounds():
    from zeroengine.testing import run_ranks
    for one_hop, two_hop, lossy, gather in run_ranks(4, quantized_collectives):
        # two hops quantize twice: the partial sums' own error adds to the first
        assert one_hop and two_hop and lossy and gather
