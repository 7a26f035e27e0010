"""Step time against the number of modules and tensors: where per-collective latency, not bytes,
sets stage 3's step.

A deep narrow model - ``blocks`` x (Linear(width, width) + LayerNorm(width)), 4 tensors a block,
little compute - at world 2 on CPU with gloo (one thread per rank), AdamW, fp32. Two widths: one
whose Linear is under stage 3's persistence threshold (kept whole, never gathered) and one over
it. Variants, interleaved (repeat 1 of every (variant, blocks, width), then repeat 2, ...), each in
fresh processes:

    ddp        torch DistributedDataParallel (the floor)
    ze1 ze2 ze3  zeroengine stages 1-3 (stage 3 built under zero_init)
    fsdp2      torch fully_shard on every block and the root (reshard_after_forward=True)
    ds3        DeepSpeed ZeRO stage 3 (DS_ACCELERATOR=cpu)

Per run: init seconds (model built and wrapped), median step seconds over the measured steps
(slowest rank), peak RSS rise per rank above the post-import baseline, and bytes sent per rank
per step (loopback counters). The table gives each row's ratio to DDP at the same size, and stage
3's fixed cost per block: (stage-3 step - DDP step) / blocks.

    DS_ACCELERATOR=cpu python benchmarks/growth_bench.py [--blocks 50,200,400]
        [--widths 128,384] [--variants ddp,ze1,ze2,ze3,fsdp2,ds3] [--repeats 3] [--json out]
        [--ours-zero '{"stage3_fetch_unit_size": 0}']
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
from benchmarks.compare import _engine_step, loopback_tx_bytes, rss_now, rss_peak  # noqa: E402
from zeroengine.testing import run_ranks  # noqa: E402

OURS_ZERO_ENV = "ZEROENGINE_GROWTH_ZERO"  # --ours-zero, for the spawned ranks
LR = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
MICRO = 8


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return x + self.norm(torch.tanh(self.linear(x)))


class Deep(nn.Module):
    def __init__(self, blocks: int, width: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x

    def loss(self, x, target):
        return torch.nn.functional.mse_loss(self(x), target)


def build(variant: str, blocks: int, width: int):
    """A step function (x, target) -> loss for ``variant``."""
    if variant.startswith("ze"):
        import zeroengine
        config = {"train_micro_batch_size_per_gpu": MICRO,
                  "zero_optimization": {"stage": int(variant[2]),
                                        **json.loads(os.environ.get(OURS_ZERO_ENV, "{}"))}}
        torch.manual_seed(0)
        with zeroengine.zero_init(config):
            model = Deep(blocks, width)
        engine = zeroengine.initialize(model, config,
                                       optimizer=torch.optim.AdamW(model.parameters(), **LR))
        return _engine_step(model, engine)
    torch.manual_seed(0)
    model = Deep(blocks, width)
    if variant == "ds3":
        import deepspeed
        config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "AdamW", "params": {**LR, "betas": list(LR["betas"]),
                                                            "torch_adam": True}},
                  "zero_optimization": {"stage": 3, "reduce_bucket_size": 5_000_000,
                                        "stage3_prefetch_bucket_size": 50_000_000},
                  "steps_per_print": 10**9}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config)
        return _engine_step(model, engine)
    if variant == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        wrapped = model
    elif variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        wrapped = DDP(model)
    else:
        raise ValueError(f"unknown variant {variant!r}")
    opt = torch.optim.AdamW(model.parameters(), **LR)

    def step(x, target):
        loss = torch.nn.functional.mse_loss(wrapped(x), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


def run(variant: str, blocks: int, width: int, steps: int, warmup: int) -> dict:
    import torch.distributed as dist

    import zeroengine
    if variant == "ds3":
        importlib.import_module("deepspeed")
    zeroengine.init_distributed()
    rank = dist.get_rank()
    baseline = rss_now()
    start = time.perf_counter()
    step = build(variant, blocks, width)
    dist.barrier()
    init_s = time.perf_counter() - start
    gen = torch.Generator().manual_seed(100 + rank)
    times = []
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            tx = loopback_tx_bytes()
        x = torch.randn(MICRO, width, generator=gen)
        target = torch.randn(MICRO, width, generator=gen)
        begin = time.perf_counter()
        step(x, target).item()
        times.append(time.perf_counter() - begin)
    dist.barrier()
    return {"init_s": init_s, "step_s": statistics.median(times[warmup:]),
            "rise": rss_peak() - baseline,
            "sent": (loopback_tx_bytes() - tx) / dist.get_world_size() / steps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", default="50,200,400")
    ap.add_argument("--widths", default="128,384")
    ap.add_argument("--variants", default="ddp,ze1,ze2,ze3,fsdp2,ds3")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--ours-zero", default=None, help="JSON merged into our rows' "
                    "zero_optimization (e.g. '{\"stage3_fetch_unit_size\": 0}')")
    args = ap.parse_args(argv)
    if args.ours_zero:
        os.environ[OURS_ZERO_ENV] = json.dumps(json.loads(args.ours_zero))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    variants = args.variants.split(",")
    if "ds3" in variants and importlib.util.find_spec("deepspeed") is None:
        variants.remove("ds3")
    cases = [(v, int(b), int(w)) for w in args.widths.split(",")
             for b in args.blocks.split(",") for v in variants]
    runs: dict = {c: [] for c in cases}
    for _ in range(args.repeats):
        for case in cases:
            per_rank = run_ranks(2, run, *case, args.steps, args.warmup, timeout=3600)
            runs[case].append({"init_s": max(r["init_s"] for r in per_rank),
                               "step_s": max(r["step_s"] for r in per_rank),
                               "rise": max(r["rise"] for r in per_rank),
                               "sent": max(r["sent"] for r in per_rank)})
    rows = []
    print("| width | blocks | params | variant | init s | step s | x DDP | peak rise MiB | "
          "sent MiB/step | stage-3 cost per block (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case in cases:
        variant, blocks, width = case
        med = {k: statistics.median(r[k] for r in runs[case]) for k in runs[case][0]}
        ddp = runs.get(("ddp", blocks, width))
        ddp_step = statistics.median(r["step_s"] for r in ddp) if ddp else None
        params = blocks * (width * width + 3 * width)
        per_block = "" if ddp_step is None or variant != "ze3" else \
            f"{(med['step_s'] - ddp_step) / blocks * 1e3:.2f}"
        ratio = f"{med['step_s'] / ddp_step:.2f}" if ddp_step else ""
        rows.append({"variant": variant, "blocks": blocks, "width": width, "params": params,
                     **med, "runs": runs[case]})
        print(f"| {width} | {blocks} | {params / 1e6:.1f}M | {variant} | {med['init_s']:.2f} | "
              f"{med['step_s']:.3f} | {ratio} | {med['rise'] / 2**20:.0f} | "
              f"{med['sent'] / 2**20:.1f} | {per_block} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
