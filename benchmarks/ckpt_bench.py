"""Checkpoint save / load / consolidate time for the ~25M-parameter GPT benchmark model.

World size 2 on CPU (gloo), AdamW, after one training step: save_checkpoint, load at the same
world size and stage, load resharded at world size 1 (stage 0), and `zeroengine consolidate`.
Median of --repeats runs each; times are the slowest rank's.

    python benchmarks/ckpt_bench.py [--repeats 3] [--stages 2,3] [--small]

``--loop fast=/tmp,slow=/mnt/slow --stages 1,2,3``: what a save costs the training loop - the
stall of a synchronous and of an asynchronous save (slowest rank, median), the time to copy the
rank's states once in memory, and steps/s over windows of --every steps that start an
asynchronous save against windows without one (interleaved in one run), beside FSDP2 with DCP's
``async_save`` on the same model. benchmarks/slow_disk.sh makes a write-throttled directory.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

from zeroengine.examples.gpt import GPT, GPTConfig, num_params
from zeroengine.testing import run_ranks


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


# -- the training loop's view: how long a save holds it (issue 41) -------------------------------
def _fsdp2(small: bool):
    """The same GPT under FSDP2 (fully_shard per block), AdamW, and DCP save callables."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = GPT(model_config(small))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    group = dist.new_group(backend="gloo")  # DCP's collectives off the training group

    def state():
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd}

    def save(path, background):
        if background:
            return dcp.async_save(state(), checkpoint_id=path, process_group=group)
        dcp.save(state(), checkpoint_id=path, process_group=group)
        return None
    return model, opt, save


def _plain_step(model, opt, small):
    cfg = model_config(small)
    tokens = torch.randint(0, cfg.vocab, (2, cfg.context + 1))
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                      tokens[:, 1:].reshape(-1)).backward()
    opt.step()
    opt.zero_grad()


def in_the_loop(root: str, variant: str, stage: int, small: bool, every: int,
                windows: int) -> dict:
    """Rank-local timings: a synchronous save's stall (x2), then ``windows`` pairs of
    ``every`` steps without a save and ``every`` steps whose first starts an asynchronous
    save (its stall, the background write and the wait for it at the window's end all inside
    the window's time); and the time to copy the rank's states once in memory."""
    import torch.distributed as dist
    if variant == "zeroengine":
        import zeroengine  # noqa: F401 - the group comes from initialize()
        engine, _ = _engine(stage, small, "fp32")

        def step():
            _step(engine, small)

        def save(path, background):
            return engine.save_checkpoint(os.path.dirname(path), tag=os.path.basename(path),
                                          async_save=background)
        def rank_states():
            return [fg.master_shard() for fg in engine.flat_groups] + [
                v for fg in engine.flat_groups
                for v in engine.optimizer.shard_state(fg)[0].values()]
    else:
        from zeroengine.distributed.bootstrap import init_distributed
        init_distributed()
        model, opt, save = _fsdp2(small)

        def step():
            _plain_step(model, opt, small)
        def rank_states():
            return [p.to_local() for p in model.parameters()] + [
                v.to_local() for s in opt.state.values() for v in s.values() if v.dim() > 0]
    for _ in range(2):
        step()
    states = [t.detach().reshape(-1) for t in rank_states()]  # optimizer state exists now
    copies = [torch.empty_like(t) for t in states]
    copy_times = []
    for _ in range(5):
        start = time.perf_counter()
        for dst, src in zip(copies, states):
            dst.copy_(src)
        copy_times.append(time.perf_counter() - start)
    del copies
    sync_stall = []
    for r in range(2):
        dist.barrier()
        start = time.perf_counter()
        save(os.path.join(root, f"sync{r}"), False)
        sync_stall.append(time.perf_counter() - start)
    # the first asynchronous save allocates (faults in) its staging buffers, once per run:
    # timed apart, so the windows' stalls are those of every later save
    dist.barrier()
    start = time.perf_counter()
    first = save(os.path.join(root, "async_first"), True)
    first_stall = time.perf_counter() - start
    first.result()
    plain, saving, async_stall = [], [], []
    for w in range(windows):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(every):
            step()
        plain.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        future = save(os.path.join(root, f"async{w % 2}"), True)
        async_stall.append(time.perf_counter() - start)
        for _ in range(every):
            step()
        future.result()
        saving.append(time.perf_counter() - start)
    return {"sync_stall": sync_stall, "async_stall": async_stall, "plain": plain,
            "first_async_save": [first_stall],
            "saving": saving, "copy": statistics.median(copy_times),
            "state_bytes": sum(t.numel() * t.element_size() for t in states)}


def _slowest(ranks: list[dict], key: str) -> float:
    """Median over repeats of the slowest rank's time."""
    return statistics.median(max(x) for x in zip(*(r[key] for r in ranks)))


def loop_table(dirs: dict[str, str], stages: list[int], small: bool, every: int,
               windows: int) -> None:
    print(f"| disk | engine | state/rank (MB) | copy in memory (s) | sync save stall (s) | "
          f"async save stall (s) | async / sync | async / copy | steps/s, a save every "
          f"{every} / none | first async save's stall (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for disk, base in dirs.items():
        for variant, stage in [("zeroengine", s) for s in stages] + [("fsdp2", 3)]:
            root = tempfile.mkdtemp(prefix="ckpt_loop", dir=base)
            try:
                ranks = run_ranks(2, in_the_loop, root, variant, stage, small, every,
                                  windows, timeout=3600)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            sync, stall = _slowest(ranks, "sync_stall"), _slowest(ranks, "async_stall")
            copy = max(r["copy"] for r in ranks)
            plain = sum(max(x) for x in zip(*(r["plain"] for r in ranks)))
            saving = sum(max(x) for x in zip(*(r["saving"] for r in ranks)))
            name = f"zeroengine stage {stage}" if variant == "zeroengine" else \
                "FSDP2 + DCP async_save"
            print(f"| {disk} | {name} | {ranks[0]['state_bytes'] / 2**20:.0f} | {copy:.3f} | "
                  f"{sync:.2f} | {stall:.3f} | {stall / sync:.2f}x | {stall / copy:.2f}x | "
                  f"{plain / saving:.3f} | {_slowest(ranks, 'first_async_save'):.2f} |",
                  flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--loop", default=None, metavar="NAME=DIR[,NAME=DIR]",
                    help="instead: the loop's stall per save and steps/s with saves, for each "
                    "directory (e.g. fast=/tmp,slow=/mnt/slow: see benchmarks/slow_disk.sh)")
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    if args.loop:
        dirs = dict(item.split("=", 1) for item in args.loop.split(","))
        loop_table(dirs, [int(s) for s in args.stages.split(",")], args.small, args.every,
                   args.windows)
        return
    from zeroengine.tools.cli import main as cli
    print("| stage | params | checkpoint size, all ranks (MB) | save, 2 ranks (s) | "
          "load, 2 ranks (s) | "
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
