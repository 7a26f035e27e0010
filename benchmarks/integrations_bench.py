"""Step time of each trainer integration against the framework's own data-parallel run and
against our own loop, on the same model and data.

Model: benchmarks/compare.py's 25M GPT (fp32, world size 2 on CPU with gloo, one thread per
rank), micro batch 4, gradient accumulation 2, AdamW. Variants:

    loop-ze{0..3}   our own loop: engine(...) / engine.backward / engine.step per micro-batch
    hf-ddp          transformers.Trainer's own DDP run
    hf-ze{0..3}     zeroengine.integrations.hf.ZeroTrainer at that stage

Step time: one optimizer step (both micro-batches), from the Trainer's on_step_begin to
on_step_end for the Trainer rows (the batches are fetched before on_step_begin, as our loop
builds them outside its timed region); median over the measured steps, slowest rank. Runs are
interleaved (repeat 1 of every variant, then repeat 2, ...), each in fresh processes. The
integration's cost is its row over the loop row of the same stage.

    python benchmarks/integrations_bench.py [--repeats 3] [--steps 6] [--variants ...]
        [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from zeroengine.examples.gpt import GPT, GPTConfig  # noqa: E402
from zeroengine.testing import run_ranks  # noqa: E402

CFG = GPTConfig(context=256, layers=8, heads=8, dim=512)  # compare.py's 25m
MICRO, ACCUM, LR = 4, 2, 3e-4
VARIANTS = [f"loop-ze{s}" for s in range(4)] + ["hf-ddp"] + [f"hf-ze{s}" for s in range(4)]


class LMWrapper(torch.nn.Module):
    """The GPT as the Hugging Face Trainer expects a model: forward(input_ids, labels) returns
    a dict holding the loss."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.gpt = gpt

    def forward(self, input_ids, labels):
        return {"loss": self.gpt.loss(input_ids, labels)}


def make_model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def batches(rank: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, CFG.vocab, (MICRO, CFG.context + 1), generator=g) for _ in range(n)]


def zero_config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM,
            "zero_optimization": {"stage": stage}}


def run_loop(stage: int, steps: int) -> list[float]:
    import zeroengine
    model = make_model()
    engine = zeroengine.initialize(model, zero_config(stage),
                                   optimizer=torch.optim.AdamW(model.parameters(), lr=LR))
    data = batches(engine.comm.rank, steps * ACCUM)
    times = []
    for step in range(steps):
        group = data[step * ACCUM:(step + 1) * ACCUM]
        start = time.perf_counter()
        for window in group:
            loss = model.loss(window[:, :-1], window[:, 1:])
            engine.backward(loss)
            engine.step()
        times.append(time.perf_counter() - start)
    engine.close()
    return times


def run_hf(stage: int | None, steps: int, out: str) -> list[float]:
    import torch.distributed as dist
    import transformers
    times, started = [], []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            started.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - started[-1])

    data = [{"input_ids": w[:-1], "labels": w[1:]}
            for b in batches(0, steps * ACCUM * 2) for w in b]  # one dataset, sharded
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM,
        max_steps=steps, learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=0.0,
        weight_decay=0.0, use_cpu=True, report_to=[], save_strategy="no",
        logging_strategy="no", disable_tqdm=True, dataloader_drop_last=True)
    common = dict(model=LMWrapper(make_model()), args=args, train_dataset=data,
                  callbacks=[Clock()])
    if stage is None:
        trainer = transformers.Trainer(**common)
    else:
        from zeroengine.integrations.hf import ZeroTrainer
        trainer = ZeroTrainer(**common, zero_config=zero_config(stage))
    trainer.train()
    if dist.is_initialized():
        dist.barrier()
    return times


def run_variant(variant: str, steps: int, out: str) -> list[float]:
    kind, _, stage = variant.rpartition("-ze") if "-ze" in variant else (variant, "", "")
    if variant == "hf-ddp":
        return run_hf(None, steps, out)
    if kind == "hf":
        return run_hf(int(stage), steps, out)
    return run_loop(int(stage), steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    variants = args.variants.split(",")
    out = os.path.join("bench_out", "integrations")
    runs: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.repeats):
        for v in variants:
            per_rank = run_ranks(2, run_variant, v, args.warmup + args.steps, out, timeout=3600)
            step = max(statistics.median(t[args.warmup:]) for t in per_rank)
            runs[v].append(step)
            print(f"repeat {r + 1}/{args.repeats} {v:9s} {step:.3f} s/step", file=sys.stderr,
                  flush=True)
    rows = []
    for v in variants:
        median = statistics.median(runs[v])
        stage = v.rpartition("-ze")[2] if "-ze" in v else None
        loop = f"loop-ze{stage}" if stage is not None else None
        over_loop = median / statistics.median(runs[loop]) \
            if loop in runs and not v.startswith("loop") else None
        rows.append({"variant": v, "step_s": median, "repeats": runs[v],
                     "vs_own_loop": over_loop})
    print("| variant | step s (median of repeats) | vs our own loop, same stage |")
    print("|---|---|---|")
    for row in rows:
        ratio = f"{row['vs_own_loop']:.3f}x" if row["vs_own_loop"] else "-"
        print(f"| {row['variant']} | {row['step_s']:.3f} | {ratio} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": "25M GPT fp32", "world": 2, "micro": MICRO, "accum": ACCUM,
                       "steps": args.steps, "repeats": args.repeats, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
