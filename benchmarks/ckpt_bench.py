"""Checkpoint save / load / consolidate time for the ~25M-parameter GPT benchmark model.

World size 2 on CPU (gloo), AdamW, after one training step: save_checkpoint, load at the same
world size and stage, load resharded at world size 1 (stage 0), and `zeroengine consolidate`.
Median of --repeats runs each; times are the slowest rank's.

    python benchmarks/ckpt_bench.py [--repeats 3] [--stages 2,3] [--small]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from zeroengine.examples.gpt import GPT, GPTConfig, num_params  # noqa: E402
from zeroengine.testing import run_ranks  # noqa: E402


def model_config(small: bool) -> GPTConfig:
    return GPTConfig(context=256, layers=2, heads=4, dim=256) if small else \
        GPTConfig(context=256, layers=8, heads=8, dim=512)


def _engine(stage: int, small: bool, precision: str):
    import zeroengine
    torch.manual_seed(0)
    model = GPT(model_config(small))
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
           "zero_optimization": {"stage": stage}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return zeroengine.initialize(model, cfg), num_params(model)


def _step(engine, small):
    cfg = model_config(small)
    tokens = torch.randint(0, cfg.vocab, (2, cfg.context + 1))
    logits = engine(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             tokens[:, 1:].reshape(-1))
    engine.backward(loss)
    engine.step()


def save_and_load(root: str, stage: int, small: bool, precision: str, repeats: int) -> dict:
    engine, n = _engine(stage, small, precision)
    _step(engine, small)
    saves, loads = [], []
    for r in range(repeats):
        engine.comm.barrier()
        start = time.perf_counter()
        path = engine.save_checkpoint(root, tag=f"t{r}")
        saves.append(time.perf_counter() - start)
        engine.comm.barrier()
        start = time.perf_counter()
        engine.load_checkpoint(root, tag=f"t{r}")
        loads.append(time.perf_counter() - start)
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    return {"save": saves, "load": loads, "bytes": size, "params": n}


def load_resharded(root: str, small: bool, precision: str, repeats: int) -> list[float]:
    engine, _ = _engine(0, small, precision)
    times = []
    for r in range(repeats):
        start = time.perf_counter()
        engine.load_checkpoint(root, tag=f"t{r}")
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    from zeroengine.tools.cli import main as cli
    print("| stage | params | checkpoint size, all ranks (MB) | save, 2 ranks (s) | load, 2 ranks (s) | "
          "load resharded to 1 rank, stage 0 (s) | consolidate (s) |")
    print("|---|---|---|---|---|---|---|")
    for stage in (int(s) for s in args.stages.split(",")):
        root = tempfile.mkdtemp(prefix="ckpt_bench")
        try:
            ranks = run_ranks(2, save_and_load, root, stage, args.small, args.precision,
                              args.repeats, timeout=1800)
            save = statistics.median(max(x) for x in zip(*(r["save"] for r in ranks)))
            load = statistics.median(max(x) for x in zip(*(r["load"] for r in ranks)))
            reshard = statistics.median(run_ranks(1, load_resharded, root, args.small,
                                                  args.precision, args.repeats)[0])
            times = []
            for r in range(args.repeats):
                start = time.perf_counter()
                cli(["consolidate", os.path.join(root, f"t{r}"), os.path.join(root, "out")])
                times.append(time.perf_counter() - start)
            print(f"| {stage} | {ranks[0]['params'] / 1e6:.1f}M | {ranks[0]['bytes'] / 2**20:.0f}"
                  f" | {save:.2f} | {load:.2f} | {reshard:.2f} | "
                  f"{statistics.median(times):.2f} |", flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
