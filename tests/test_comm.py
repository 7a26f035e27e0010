"""The comm layer's collectives, native and through the fallbacks older torch/gloo need, give
the same results; byte accounting follows the ring cost."""
from __future__ import annotations

import pytest
import torch

from zeroengine.testing import run_ranks

N = 7  # elements per rank's chunk


def collectives(mode: str):
    from zeroengine.distributed.bootstrap import init_distributed
    from zeroengine.distributed.comm import Comm
    init_distributed()
    comm = Comm()
    comm._p2p_reduce_scatter = comm._p2p_all_gather = mode == "p2p"
    if mode == "fallback":
        comm._reduce_scatter = None
        comm._all_gather = None
        comm._avg_ok = False
    r, w = comm.rank, comm.world_size
    source = torch.arange(w * N, dtype=torch.float32) * (r + 1)
    rs = torch.empty(N)
    comm.reduce_scatter(rs, source, "avg", async_op=True).wait()
    in_place = source.clone()  # stage 1: the output is this rank's own chunk of the input
    comm.reduce_scatter(in_place[r * N:(r + 1) * N], in_place, "sum")
    assert torch.allclose(in_place[r * N:(r + 1) * N], rs * w)
    ar = source.clone()
    comm.all_reduce(ar, "avg", async_op=True).wait()
    full = torch.zeros(w * N)
    full[r * N:(r + 1) * N] = r + 0.5
    comm.all_gather(full, full[r * N:(r + 1) * N], async_op=True).wait()  # input aliases output
    apart = torch.empty(w * N, dtype=torch.bfloat16)  # input apart from output, synchronous
    comm.all_gather(apart, torch.full((N,), r + 0.25, dtype=torch.bfloat16))
    return rs, ar, full, apart, comm.report()


@pytest.mark.parametrize("mode", ["native", "p2p", "fallback"])
def test_collectives_native_and_fallback(mode):
    """native: torch's reduce-scatter and all-gather; p2p: ours from sends and receives (what
    gloo gets); fallback: through all-reduce and a list all-gather, for older torch."""
    world = 3
    fallback = mode == "fallback"
    results = run_ranks(world, collectives, mode)
    mean_factor = sum(range(1, world + 1)) / world
    expected_ar = torch.arange(world * N, dtype=torch.float32) * mean_factor
    for rank, (rs, ar, full, apart, report) in enumerate(results):
        assert torch.allclose(ar, expected_ar)
        assert torch.allclose(rs, expected_ar[rank * N:(rank + 1) * N])
        assert torch.equal(full, torch.arange(world).float().repeat_interleave(N) + 0.5)
        assert torch.equal(apart, (torch.arange(world).repeat_interleave(N) + 0.25).bfloat16())
        nbytes = world * N * 4 + world * N * 2
        assert report["all_gather"]["sent_bytes"] == nbytes * (world - 1) // world
        assert report["all_reduce"]["calls"] == (3 if fallback else 1)  # + 2 reduce-scatters


def test_single_process_collectives_are_local():
    from zeroengine.distributed.comm import Comm
    comm = Comm()
    assert comm.world_size == 1
    out = torch.empty(4)
    comm.reduce_scatter(out, torch.arange(4.0)).wait()
    assert torch.equal(out, torch.arange(4.0)) and comm.report() == {}
