"""The scale model (zeroengine.tools.scale_model) against measured runs at world sizes 1-4 here.

For each world size and stage: the GPT example, AdamW, fp32, a few steps on gloo; measured are
the model-state bytes per rank (engine.memory_report(); its transient buckets and stage-3
gathers are not in it, so the buffer term is shown predicted only) and the bytes each rank really
sent per step (the loopback interface's counters); predicted are the same from the model with
the run's own settings. Step time is predicted from this machine's measured matmul FLOP/s and
loopback bandwidth; the model gives every rank its own device, so at world 3-4 (ranks sharing 2
cores) the measured time is expected to exceed it.

    python benchmarks/scale_validate.py [--worlds 1,2,3,4] [--stages 0,1,2,3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
from compare import loopback_tx_bytes  # noqa: E402

from zeroengine.examples.gpt import GPT, GPTConfig  # noqa: E402
from zeroengine.testing import run_ranks  # noqa: E402
from zeroengine.tools.estimate import gpt_num_params  # noqa: E402
from zeroengine.tools.scale_model import Hardware, Job, predict  # noqa: E402

CFG = GPTConfig(context=128, layers=4, heads=4, dim=256)
MICRO, BUCKET = 4, 500_000


def measure(stage: int, steps: int) -> dict:
    import torch.distributed as dist

    import zeroengine
    zeroengine.init_distributed()
    world = dist.get_world_size() if dist.is_initialized() else 1
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET,
                                    "stage3_prefetch_bucket_size": BUCKET}}
    torch.manual_seed(0)
    with zeroengine.zero_init(config):
        model = GPT(CFG)
    engine = zeroengine.initialize(model, config)
    gen = torch.Generator().manual_seed(engine.comm.rank)
    times = []
    for i in range(steps + 1):
        if i == 1:  # the first step is warm-up
            engine.comm.barrier()
            tx = loopback_tx_bytes()
        w = torch.randint(0, CFG.vocab, (MICRO, CFG.context + 1), generator=gen)
        start = time.perf_counter()
        loss = model.loss(w[:, :-1], w[:, 1:])
        engine.backward(loss)
        engine.step()
        if i >= 1:
            times.append(time.perf_counter() - start)
    engine.comm.barrier()
    sent = (loopback_tx_bytes() - tx) / world / steps if world > 1 else 0.0
    buffers = len(engine.flat_groups)
    return {"states": engine.memory_report()["total"], "sent": sent,
            "step_s": statistics.median(times), "buffers": buffers}


def machine() -> Hardware:
    """This machine's figures for one rank: single-thread matmul FLOP/s, loopback bandwidth."""
    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    start = time.perf_counter()
    for _ in range(20):
        a @ b
    flops = 20 * 2 * 512**3 / (time.perf_counter() - start)
    return Hardware(flops=flops * 0.6,  # a transformer step reaches ~60% of a plain matmul
                    bandwidth=1.0e9, latency=50e-6, memory_bandwidth=5e9,
                    device_memory=24 * 2**30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="1,2,3,4")
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    params = gpt_num_params(CFG.vocab, CFG.context, CFG.layers, CFG.dim)
    hw = machine()
    print(f"GPT {params / 1e6:.2f}M params, fp32 AdamW, micro batch {MICRO}x{CFG.context}, "
          f"buckets {BUCKET}; hardware model: {hw.flops / 1e9:.1f} GFLOP/s, "
          f"{hw.bandwidth / 1e9:.1f} GB/s, {hw.latency * 1e6:.0f} us\n")
    print("| world | stage | model states MB (formula / measured) | + buffers MB (predicted) "
          "| sent/rank/step MB (predicted / measured) | step s (predicted / measured) |")
    print("|---|---|---|---|---|---|")
    for world in [int(w) for w in args.worlds.split(",")]:
        for stage in [int(s) for s in args.stages.split(",")]:
            if stage > 0 and world == 1:
                continue  # nothing to shard
            got = run_ranks(world, measure, stage, args.steps, timeout=900)
            states = max(g["states"] for g in got)
            sent = statistics.mean(g["sent"] for g in got)
            step = max(g["step_s"] for g in got)
            pred = predict(Job(params, stage, world, precision="fp32",
                               tokens_per_rank=MICRO * CFG.context, reduce_bucket_size=BUCKET,
                               prefetch_bucket_size=BUCKET, largest_module=4 * CFG.dim ** 2,
                               buffers=got[0]["buffers"]), hw)
            print(f"| {world} | {stage} | {pred.model_states / 2**20:.2f} / {states / 2**20:.2f} "
                  f"| {pred.buffers / 2**20:.2f} "
                  f"| {pred.comm_bytes / 2**20:.2f} / {sent / 2**20:.2f} "
                  f"| {pred.step_s:.3f} / {step:.3f} |", flush=True)


if __name__ == "__main__":
    main()
