"""What the bf16/fp16 master keys cost and save (issue 42), side by side in one run.

    python benchmarks/precision_bench.py memory [--repeats 3] [--steps 4] [--stages 1,2,3]
    python benchmarks/precision_bench.py adam [--numel 12500000] [--repeats 7]
    python benchmarks/precision_bench.py curves [--seeds 0,1,2] [--steps 150]

memory: the 25M GPT of step_bench.py (world size 2, bf16, AdamW) at stages 1-3, with and without
  CPU offload, under each way of keeping the optimizer's masters and moments: fp32 master (today),
  remainders (bf16.store_param_remainders), bf16 master + bf16 moments rounded to nearest, and
  the same stochastic. Per variant: bytes per parameter of master + states (memory_report), of
  all model states, the measured peak RSS per rank, step time (median) and engine.step()'s share.
  Variants run interleaved, repeat by repeat.
adam: the CPU Adam step alone (what offload runs) over one rank's shard, fp32 master + fp32
  moments against each 16-bit layout, interleaved, median: the bytes it moves per parameter and
  the time.
curves: `make demo`'s job (configs/demo_zero3.json: the byte-level GPT, ZeRO-3, 2 ranks) in bf16
  under each mode and several seeds; writes the loss curves to docs/precision_loss.png and each
  run's final training and validation loss.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODES = {  # name -> the bf16 section's keys
    "fp32 master": {},
    "remainders": {"store_param_remainders": True},
    "bf16 nearest": {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
    "bf16 stochastic": {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True,
                        "stochastic_rounding": True},
}


# -- memory and step time ------------------------------------------------------------------------
def run_variant(mode: str, stage: int, offload: bool, steps: int, warmup: int) -> dict:
    from step_bench import _loss, _peak_rss, model_config

    import zeroengine
    from zeroengine.examples.gpt import GPT, num_params
    cfg = model_config(False)
    torch.manual_seed(0)
    model = GPT(cfg)
    n = num_params(model)
    where = {"device": "cpu" if offload else "none"}
    engine = zeroengine.initialize(model, {
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95],
                                                  "weight_decay": 0.1}},
        "bf16": {"enabled": True, **MODES[mode]}, "steps_per_print": 10 ** 9,
        "zero_optimization": {"stage": stage, "offload_optimizer": where}})
    gen = torch.Generator().manual_seed(100 + engine.comm.rank)
    steps_s, opt_s, losses = [], [], []
    for step in range(warmup + steps):
        window = torch.randint(0, cfg.vocab, (4, cfg.context + 1), generator=gen)
        start = time.perf_counter()
        loss = _loss(engine, window[:, :-1], window[:, 1:])
        engine.backward(loss)
        before_step = time.perf_counter()
        engine.step()
        end = time.perf_counter()
        losses.append(loss.item())
        if step >= warmup:
            steps_s.append(end - start)
            opt_s.append(end - before_step)
    report = engine.memory_report()
    engine.close()
    return {"step_s": statistics.median(steps_s), "optimizer_s": statistics.median(opt_s),
            "master_state_bytes": report["optimizer_states"] + report["host_optimizer_states"],
            "state_bytes": report["total"], "peak_rss": _peak_rss(), "params": n,
            "last_loss": losses[-1]}


def memory(args) -> None:
    from zeroengine.testing import run_ranks
    variants = [(mode, stage, offload) for stage in args.stages for offload in (False, True)
                for mode in MODES]
    runs: dict = {v: [] for v in variants}
    for r in range(args.repeats):
        for v in variants:
            runs[v].append(run_ranks(2, run_variant, *v, args.steps, args.warmup, timeout=1800))
            print(f"repeat {r + 1}/{args.repeats} {v}: "
                  f"{max(x['step_s'] for x in runs[v][-1]):.3f} s/step", file=sys.stderr,
                  flush=True)
    n = runs[variants[0]][0][0]["params"]
    print(f"\nGPT {n / 1e6:.1f}M params, world size 2, bf16, AdamW, {args.repeats} repeats x "
          f"{args.steps} steps (median; the slower rank)\n")
    print("| stage | offload | mode | master + states B/param | vs fp32 master | model states "
          "B/param | peak RSS / rank (MB) | step (s) | vs fp32 master | engine.step() (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    table = []
    for stage in args.stages:
        for offload in (False, True):
            base = None
            for mode in MODES:
                reps = runs[(mode, stage, offload)]
                step = statistics.median(max(x["step_s"] for x in rep) for rep in reps)
                opt = statistics.median(max(x["optimizer_s"] for x in rep) for rep in reps)
                ms = max(x["master_state_bytes"] for x in reps[0]) * 2 / n  # both ranks' shards
                total = max(x["state_bytes"] for x in reps[0]) * 2 / n
                rss = max(statistics.median(rep[k]["peak_rss"] for rep in reps) for k in (0, 1))
                base = base or (ms, step)
                row = dict(stage=stage, offload=offload, mode=mode, master_state_B=ms,
                           master_state_ratio=ms / base[0], model_state_B=total,
                           peak_rss_mb=rss / 1e6, step_s=step, step_ratio=step / base[1],
                           optimizer_s=opt, last_loss=reps[0][0]["last_loss"])
                table.append(row)
                print(f"| {stage} | {'cpu' if offload else 'none'} | {mode} | {ms:.2f} | "
                      f"{ms / base[0]:.2f}x | {total:.2f} | {rss / 1e6:.0f} | {step:.3f} | "
                      f"{step / base[1]:.2f}x | {opt:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": n, "rows": table}, f, indent=1)


# -- the CPU Adam step alone ---------------------------------------------------------------------
def adam(args) -> None:
    from adam_bench import interleaved_ms

    from zeroengine.ops import CPUAdam
    n = args.numel
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen)
    layouts = {  # name -> (master dtype, moments dtype, gradient dtype, stochastic, B moved)
        "fp32 master + fp32 moments": (torch.float32, torch.float32, torch.float32, False, 28),
        "fp32 master + bf16 moments": (torch.float32, torch.bfloat16, torch.float32, False, 20),
        "bf16 master + bf16 moments": (torch.bfloat16, torch.bfloat16, torch.float32, False, 16),
        "bf16 master + bf16 moments, stochastic": (torch.bfloat16, torch.bfloat16,
                                                   torch.float32, True, 16),
        "bf16 master + bf16 moments + bf16 grad": (torch.bfloat16, torch.bfloat16,
                                                   torch.bfloat16, False, 14),
    }
    steps = {}
    for name, (pdt, sdt, gdt, stochastic, _) in layouts.items():
        p = base.to(pdt)
        g = grad.to(gdt)
        opt = CPUAdam([p], lr=1e-4, weight_decay=0.1, state_dtype=sdt,
                      stochastic_rounding=stochastic)
        runs = {p: torch.tensor([[0, n, 0]])} if stochastic else None
        if pdt == sdt == gdt == torch.float32:
            p.grad = g
            steps[name] = (lambda o=opt: o.step())
        else:
            steps[name] = (lambda o=opt, p=p, g=g, r=runs: o.step(grads={p: g}, index_runs=r))
    from zeroengine.ops import cpu_adam
    ext = cpu_adam._ext if cpu_adam.using_extension() else None
    if ext is not None and ext.avx2_available():
        # the same step through the compiler-vectorised loop (what ran before the AVX2 kernel)
        name = "bf16 master + bf16 moments, without the AVX2 kernel"
        layouts[name] = layouts["bf16 master + bf16 moments"]
        with_kernel = steps["bf16 master + bf16 moments"]
        steps[name] = lambda: (ext.use_avx2(False), with_kernel(), ext.use_avx2(True))
    ms = interleaved_ms(steps, args.repeats)
    base_ms = ms["fp32 master + fp32 moments"]
    print(f"\nCPUAdam over {n / 1e6:.1f}M elements (one rank's shard of a 25M model at 2 ranks"
          f"), {torch.get_num_threads()} threads, median of {args.repeats}\n")
    print("| layout | bytes moved / param | step (ms) | speed-up | GB/s |")
    print("|---|---|---|---|---|")
    rows = []
    for name, (_, _, _, _, moved) in layouts.items():
        t = ms[name]
        rows.append(dict(layout=name, bytes=moved, ms=t, speedup=base_ms / t,
                         gbps=moved * n / t / 1e6))
        print(f"| {name} | {moved} | {t:.2f} | {base_ms / t:.2f}x | {moved * n / t / 1e6:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"numel": n, "rows": rows}, f, indent=1)


# -- loss curves of the demo job -------------------------------------------------------------------
def curves(args) -> None:
    with open(os.path.join(ROOT, "configs", "demo_zero3.json")) as f:
        base = json.load(f)
    out_dir = tempfile.mkdtemp(prefix="precision_curves_")
    results: dict = {}
    for seed in args.seeds:  # seed by seed: a partial run still compares every mode
        for mode, keys in MODES.items():
            cfg = json.loads(json.dumps(base))
            cfg["bf16"] = {"enabled": True, **keys}
            cfg["steps_per_print"] = 10 ** 9
            cfg["job"].update(run_name=f"{mode.replace(' ', '_')}-{seed}", seed=seed,
                              steps=args.steps, checkpoint_interval=0)
            path = os.path.join(out_dir, f"{cfg['job']['run_name']}.json")
            with open(path, "w") as f:
                json.dump(cfg, f)
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "zeroengine", "train", path, "--nproc", "2",
                            "--runs-dir", out_dir], check=True, cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            with open(os.path.join(out_dir, cfg["job"]["run_name"], "metrics.jsonl")) as f:
                rows = [json.loads(line) for line in f]
            results.setdefault(mode, {})[seed] = rows
            print(f"{mode} seed {seed}: loss {rows[-1]['loss']:.4f}, val "
                  f"{rows[-1].get('val_loss')}, {time.perf_counter() - start:.0f} s",
                  file=sys.stderr, flush=True)
    print(f"\nmake demo's job in bf16, {args.steps} steps, seeds {args.seeds}: final training "
          "loss (mean of the last 10 steps) and validation loss\n")
    print("| mode | train loss per seed | mean | val loss per seed | mean |")
    print("|---|---|---|---|---|")
    summary = {}
    for mode, by_seed in results.items():
        train = [statistics.mean(r["loss"] for r in rows[-10:]) for rows in by_seed.values()]
        val = [rows[-1].get("val_loss") for rows in by_seed.values()]
        summary[mode] = dict(train=train, val=val)
        print(f"| {mode} | {', '.join(f'{x:.4f}' for x in train)} | {statistics.mean(train):.4f}"
              f" | {', '.join(f'{x:.4f}' for x in val)} | {statistics.mean(val):.4f} |")
    _plot(results, os.path.join(ROOT, "docs", "precision_loss.png"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "curves": {m: {s: [r["loss"] for r in rows]
                                                          for s, rows in by.items()}
                                                      for m, by in results.items()}}, f)


def _plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (whole, tail) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = dict(zip(MODES, ("black", "tab:blue", "tab:red", "tab:green")))
    for mode, by_seed in results.items():
        for i, rows in enumerate(by_seed.values()):
            steps = [r["step"] for r in rows]
            smooth = [statistics.mean(r["loss"] for r in rows[max(0, k - 9):k + 1])
                      for k in range(len(rows))]
            for ax in (whole, tail):
                ax.plot(steps, smooth, color=colours[mode], alpha=0.7, linewidth=1,
                        label=mode if i == 0 else None)
    half = max(r["step"] for by in results.values() for rows in by.values() for r in rows) // 2
    tail.set_xlim(left=half)
    lows = [statistics.mean(r["loss"] for r in rows[k - 9:k + 1])
            for by in results.values() for rows in by.values() for k in range(half, len(rows))]
    tail.set_ylim(min(lows) - 0.02, max(lows) + 0.02)
    for ax, title in ((whole, "training loss (10-step mean)"), (tail, "second half")):
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.legend()
    fig.suptitle("make demo's GPT (ZeRO-3, 2 ranks, bf16) under each master/state layout, "
                 "one line per seed")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    m = sub.add_parser("memory")
    m.add_argument("--repeats", type=int, default=3)
    m.add_argument("--steps", type=int, default=4)
    m.add_argument("--warmup", type=int, default=2)
    m.add_argument("--stages", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3])
    a = sub.add_parser("adam")
    a.add_argument("--numel", type=int, default=12_500_000)
    a.add_argument("--repeats", type=int, default=7)
    c = sub.add_parser("curves")
    c.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    c.add_argument("--steps", type=int, default=150)
    for p in (m, a, c):
        p.add_argument("--json", default=None)
    args = ap.parse_args()
    {"memory": memory, "adam": adam, "curves": curves}[args.what](args)


if __name__ == "__main__":
    main()
