"""Step time of each trainer integration against the framework's own data-parallel run and
against our own loop, on the same model and data.

Model: benchmarks/compare.py's 25M GPT (fp32, world size 2 on CPU with gloo, one thread per
rank), micro batch 4, gradient accumulation 2, AdamW. Variants:

    loop-ze{0..3}   our own loop: engine(...) / engine.backward / engine.step per micro-batch
    hf-ddp          transformers.Trainer's own DDP run
    hf-ze{0..3}     zeroengine.integrations.hf.ZeroTrainer at that stage
    pl-ddp          Lightning's "ddp" strategy
    pl-ze{0..3}     zeroengine.integrations.lightning.ZeroStrategy at that stage
    fa-ddp          fastai's distrib_ctx (accelerate's DDP)
    fa-ze{0..3}     zeroengine.integrations.fastai.ZeroCallback at that stage
    loop8-ze{0..3}  our own loop, one micro-batch of 8 per step (the fastai and Keras shape)
    keras-ze{0..3}  Keras 3 fit() (the GPT in a TorchModuleWrapper) on the engine; Keras has no
                    torch data-parallel run of its own to compare with

Step time: one optimizer step (both micro-batches, 2 x 4 sequences per rank; fastai and Keras,
which do not accumulate here, take one micro-batch of 8 per step), timed between the
framework's own step callbacks (HF on_step_begin/end, Lightning on_train_batch_start of a
group's first batch to on_train_batch_end of its last, fastai before_batch/after_batch, Keras
on_train_batch_begin/end); median over the measured steps, slowest rank. Runs are
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
from zeroengine.examples.gpt import GPT, GPTConfig  # noqa: E402
from zeroengine.testing import run_ranks  # noqa: E402

CFG = GPTConfig(context=256, layers=8, heads=8, dim=512)  # compare.py's 25m
MICRO, ACCUM, LR = 4, 2, 3e-4
VARIANTS = [f"loop-ze{s}" for s in range(4)] + [f"loop8-ze{s}" for s in range(4)] + [
    v for f in ("hf", "pl", "fa") for v in [f"{f}-ddp"] + [f"{f}-ze{s}" for s in range(4)]] + [
    f"keras-ze{s}" for s in range(4)]


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


def run_loop(stage: int, steps: int, accum: int = ACCUM) -> list[float]:
    """``accum`` 1: one micro-batch of MICRO x ACCUM sequences per step (the shape of the
    fastai and Keras rows)."""
    import zeroengine
    model = make_model()
    config = {**zero_config(stage), "gradient_accumulation_steps": accum,
              "train_micro_batch_size_per_gpu": MICRO * ACCUM // accum}
    engine = zeroengine.initialize(model, config,
                                   optimizer=torch.optim.AdamW(model.parameters(), lr=LR))
    data = batches(engine.comm.rank, steps * ACCUM)
    if accum == 1:
        data = [torch.cat(data[i:i + ACCUM]) for i in range(0, len(data), ACCUM)]
    times = []
    for step in range(steps):
        group = data[step * accum:(step + 1) * accum]
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


def run_lightning(stage: int | None, steps: int, out: str) -> list[float]:
    import lightning.pytorch as pl

    from zeroengine.integrations.lightning import ZeroStrategy
    times, started = [], []

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.gpt = make_model()

        def training_step(self, batch, batch_idx):
            (window,) = batch
            return self.gpt.loss(window[:, :-1], window[:, 1:])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR)

    class Clock(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx % ACCUM == 0:
                started.append(time.perf_counter())

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx % ACCUM == ACCUM - 1:
                times.append(time.perf_counter() - started[-1])

    windows = torch.cat(batches(0, steps * ACCUM * 2))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(windows),
                                         batch_size=MICRO)
    strategy = "ddp" if stage is None else ZeroStrategy(stage=stage)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps,
                         accumulate_grad_batches=ACCUM, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[Clock()],
                         default_root_dir=out)
    trainer.fit(Lit(), loader)
    return times


def run_fastai(stage: int | None, steps: int, out: str) -> list[float]:
    from functools import partial

    import fastai.distributed as fd
    from fastai.callback.core import Callback
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from fastai.learner import Learner
    from fastai.optimizer import OptimWrapper

    import zeroengine.integrations.fastai as zfa
    times, started = [], []

    class Clock(Callback):
        def before_batch(self):
            if self.training:
                started.append(time.perf_counter())

        def after_batch(self):
            if self.training:
                times.append(time.perf_counter() - started[-1])

    windows = torch.cat(batches(0, steps * 4))  # 8 per rank per step, 2 ranks
    data = [(w[:-1], w[1:]) for w in windows]
    dls = DataLoaders(DataLoader(data, bs=MICRO * ACCUM, shuffle=False),
                      DataLoader(data[:MICRO], bs=MICRO), device="cpu")
    gpt = make_model()
    learn = Learner(dls, gpt, cbs=[Clock()],
                    loss_func=lambda logits, y: torch.nn.functional.cross_entropy(
                        logits.reshape(-1, logits.shape[-1]), y.reshape(-1)),
                    opt_func=partial(OptimWrapper, opt=torch.optim.AdamW), wd=0.0)
    if stage is None:
        fd.DistributedDL._broadcast = zfa._DistributedDL._broadcast  # gloo: no CUDA needed
        context = learn.distrib_ctx(cpu=True)
    else:
        context = learn.zero_ctx({"zero_optimization": {"stage": stage}})
    with learn.no_bar(), learn.no_logging(), context:
        learn.fit(1, LR)
    return times


def run_keras(stage: int, steps: int, out: str) -> list[float]:
    os.environ["KERAS_BACKEND"] = "torch"
    import keras

    from zeroengine.integrations import keras as zkeras
    times, started = [], []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            started.append(time.perf_counter())

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - started[-1])

    gpt = make_model()
    model = keras.Sequential([keras.Input((CFG.context,), dtype="int32"),
                              keras.layers.TorchModuleWrapper(gpt)])
    model.compile(optimizer=keras.optimizers.AdamW(LR, weight_decay=0.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    engine = zkeras.distribute(model, {"zero_optimization": {"stage": stage}})
    windows = torch.cat(batches(0, steps * 4)).numpy()  # 8 per rank per step, 2 ranks
    global_batch = MICRO * ACCUM * engine.comm.world_size
    x, y = zkeras.shard(windows[:, :-1], global_batch), zkeras.shard(windows[:, 1:], global_batch)
    model.fit(x, y, batch_size=MICRO * ACCUM, epochs=1, shuffle=False, verbose=0,
              steps_per_epoch=steps, callbacks=[Clock()])
    return times


def run_variant(variant: str, steps: int, out: str) -> list[float]:
    kind, _, stage = variant.rpartition("-ze") if "-ze" in variant else (variant, "", "")
    runners = {"hf": run_hf, "pl": run_lightning, "fa": run_fastai}
    if variant.endswith("-ddp"):
        return runners[variant[:-4]](None, steps, out)
    if kind in runners:
        return runners[kind](int(stage), steps, out)
    if kind == "keras":
        return run_keras(int(stage), steps, out)
    return run_loop(int(stage), steps, accum=1 if kind == "loop8" else ACCUM)


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
        # fastai and Keras steps are one micro-batch of 8: their loop row is loop8
        loop = None if stage is None else (f"loop8-ze{stage}" if v.startswith(("fa", "keras"))
                                           else f"loop-ze{stage}")
        over_loop = median / statistics.median(runs[loop]) \
            if loop in runs and not v.startswith("loop") else None
        ddp = v.split("-")[0] + "-ddp"
        over_ddp = median / statistics.median(runs[ddp]) \
            if ddp in runs and "-ze" in v else None
        # the same repeat of both: what a machine-wide slowdown of one repeat does not skew
        paired = statistics.median(a / b for a, b in zip(runs[v], runs[loop])) \
            if over_loop is not None else None
        rows.append({"variant": v, "step_s": median, "repeats": runs[v],
                     "vs_own_loop": over_loop, "vs_own_loop_paired": paired,
                     "vs_framework_ddp": over_ddp})
    print("| variant | step s (median of repeats) | vs our own loop, same stage (paired by "
          "repeat) | vs the framework's own DDP |")
    print("|---|---|---|---|")
    for row in rows:
        ratio = f"{row['vs_own_loop']:.3f}x ({row['vs_own_loop_paired']:.3f}x)" \
            if row["vs_own_loop"] else "-"
        ddp = f"{row['vs_framework_ddp']:.3f}x" if row["vs_framework_ddp"] else "-"
        print(f"| {row['variant']} | {row['step_s']:.3f} | {ratio} | {ddp} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": "25M GPT fp32", "world": 2, "micro": MICRO, "accum": ACCUM,
                       "steps": args.steps, "repeats": args.repeats, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
