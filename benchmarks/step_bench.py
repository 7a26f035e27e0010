"""Step time, peak memory and model-state bytes per rank: zeroengine stages 0-3 vs torch DDP.

A GPT-like model (~25M parameters, byte vocabulary), world size 2 on CPU with gloo, one thread
per rank, AdamW, fp32, the same seed and data for every variant. Variants run interleaved
(repeat 1 of every variant, then repeat 2, ...) so drift in the machine hits all alike; each
reports the median step time over its measured steps, and the table shows the median over
repeats.

    python benchmarks/step_bench.py [--repeats 3] [--steps 6] [--warmup 2] [--small]
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time

import torch

from zeroengine.examples.gpt import GPT, GPTConfig, num_params
from zeroengine.testing import run_ranks

VARIANTS = ["ddp", "ddp-fused", "zero0", "zero1", "zero2", "zero3", "zero2-offload",
            "zero3-offload"]
# also runnable by name: "zero3-nocheck" (stage 3 without the gather-order check), to price it


def model_config(small: bool) -> GPTConfig:
    return GPTConfig(context=256, layers=2, heads=4, dim=256) if small else \
        GPTConfig(context=256, layers=8, heads=8, dim=512)


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run_variant(variant: str, steps: int, warmup: int, small: bool, micro: int) -> dict:
    import torch.distributed as dist

    import zeroengine
    zeroengine.init_distributed()
    rank = dist.get_rank()
    cfg = model_config(small)
    torch.manual_seed(0)
    model = GPT(cfg)
    n = num_params(model)
    lr = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    if variant.startswith("ddp"):
        from torch.nn.parallel import DistributedDataParallel as DDP
        wrapped = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), **lr, fused=variant == "ddp-fused" or None)

        def train_step(tokens, targets):
            loss = _loss(wrapped, tokens, targets)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        state_bytes = lambda: 16 * n  # noqa: E731  params + grads + Adam m, v (fp32)
    else:
        stage = int(variant[4])
        offload = {"device": "cpu" if variant.endswith("-offload") else "none"}
        engine = zeroengine.initialize(model, {
            "optimizer": {"type": "AdamW", "params": {**lr, "betas": list(lr["betas"])}},
            "zero_optimization": {"stage": stage, "offload_optimizer": offload,
                                  **({"offload_param": offload} if stage == 3 else {}),
                                  **({"stage3_check_gather_order": False}
                                     if variant.endswith("-nocheck") else {})}})

        def train_step(tokens, targets):
            loss = _loss(engine, tokens, targets)
            engine.backward(loss)
            engine.step()
            return loss
        state_bytes = lambda: engine.memory_report()["total"]  # noqa: E731
    gen = torch.Generator().manual_seed(100 + rank)
    times, losses = [], []
    for step in range(warmup + steps):
        window = torch.randint(0, cfg.vocab, (micro, cfg.context + 1), generator=gen)
        start = time.perf_counter()
        loss = train_step(window[:, :-1], window[:, 1:])
        elapsed = time.perf_counter() - start
        losses.append(loss.item())
        if step >= warmup:
            times.append(elapsed)
    return {"step_s": statistics.median(times), "peak_rss": _peak_rss(),
            "state_bytes": state_bytes(), "params": n, "first_loss": losses[0],
            "last_loss": losses[-1]}


def _loss(forward, tokens, targets):
    logits = forward(tokens)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             targets.reshape(-1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--small", action="store_true", help="a ~2M model, for a quick check")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    variants = args.variants.split(",")
    runs: dict[str, list[list[dict]]] = {v: [] for v in variants}
    for r in range(args.repeats):
        for v in variants:
            runs[v].append(run_ranks(args.world, run_variant, v, args.steps, args.warmup,
                                     args.small, args.micro, timeout=1800))
            print(f"repeat {r + 1}/{args.repeats} {v:10s} "
                  f"{statistics.median(x['step_s'] for x in runs[v][-1]):.3f} s/step",
                  file=sys.stderr, flush=True)
    base = statistics.median(max(x["step_s"] for x in rep) for rep in runs[variants[0]])
    first = runs[variants[0]][0][0]
    print(f"\nGPT {first['params'] / 1e6:.1f}M params, world size {args.world}, micro batch "
          f"{args.micro}x{model_config(args.small).context}, fp32 AdamW, {args.repeats} repeats "
          f"x {args.steps} steps (median)\n")
    print("| variant | step time (s) | vs " + variants[0] + " | peak RSS / rank (MB) | "
          "model states / rank (MB) | loss first -> last |")
    print("|---|---|---|---|---|---|")
    table = {}
    for v in variants:
        step = statistics.median(max(x["step_s"] for x in rep) for rep in runs[v])
        rss = max(statistics.median(rep[k]["peak_rss"] for rep in runs[v])
                  for k in range(args.world))
        states = max(x["state_bytes"] for x in runs[v][0])
        r0 = runs[v][0][0]
        table[v] = dict(step_s=step, ratio=step / base, peak_rss=rss, state_bytes=states,
                        first_loss=r0["first_loss"], last_loss=r0["last_loss"])
        print(f"| {v} | {step:.3f} | {step / base:.2f}x | {rss / 1e6:.0f} | {states / 1e6:.0f} "
              f"| {r0['first_loss']:.4f} -> {r0['last_loss']:.4f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=2)


if __name__ == "__main__":
    main()
