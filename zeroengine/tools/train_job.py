"""The built-in job of `zeroengine train`: a byte-level GPT learning Python from the standard
library's own .py sources (present on every machine, no download), split into train and
validation by file.

Runs on every rank of whatever launched it (torchrun, SLURM, MPI, PyTorchJob, or one process).
Rank 0 shows progress and writes runs/<run_name>/metrics.jsonl (one JSON object per step; eval
rows carry "val_loss"; TensorBoard scalars too when tensorboard is installed), checkpoints go to
runs/<run_name>/checkpoints, and at the end a PNG plot
(when matplotlib is installed) and a generated sample. Other ranks print only warnings; every
rank logs to runs/<run_name>/logs/rank<N>.log.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

import zeroengine
from zeroengine.distributed.bootstrap import shutdown_distributed
from zeroengine.examples.corpus import stdlib_corpus, windows
from zeroengine.examples.gpt import GPT, GPTConfig, num_params
from zeroengine.tools.job_config import split_job

log = logging.getLogger("zeroengine.train")


# -- data -----------------------------------------------------------------------------------------
# -- logging --------------------------------------------------------------------------------------
def setup_logging(run_dir: Path, rank: int) -> None:
    """Rank 0: INFO to the console; other ranks: warnings only. Every rank: a log file."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    root = logging.getLogger("zeroengine")
    root.setLevel(logging.INFO)
    root.handlers.clear()
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    console.setFormatter(logging.Formatter(f"[rank {rank}] %(message)s" if rank else
                                           "%(message)s"))
    file = logging.FileHandler(run_dir / "logs" / f"rank{rank}.log")
    file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(console)
    root.addHandler(file)
    root.propagate = False


class Progress:
    """A tqdm bar on rank 0 when tqdm is installed, else a line every few steps."""

    def __init__(self, rank: int, start: int, total: int, every: int):
        self.rank, self.every, self.bar = rank, every, None
        if rank == 0:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, step: int, fields: dict) -> None:
        if self.rank != 0:
            return
        text = "  ".join(f"{k} {v}" for k, v in fields.items())
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        elif step % self.every == 0:
            log.info("step %d  %s", step, text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# -- the job --------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(engine, model, data, batches: int, micro: int, context: int, seed: int) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(seed)  # the same windows at every evaluation
    losses = []
    for _ in range(batches):
        w = windows(data, micro, context, gen).to(engine.device)
        losses.append(model.loss(w[:, :-1], w[:, 1:]).float())
    model.train()
    loss = torch.stack(losses).mean().reshape(1)
    engine.comm.all_reduce(loss, "avg")
    return loss.item()


@torch.no_grad()
def sample(engine, model, prompt: bytes, length: int, context: int, seed: int) -> str:
    """Generated text; every rank runs it (stage 3 gathers parameters collectively)."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.tensor(list(prompt), dtype=torch.long).unsqueeze(0)
    for _ in range(length):
        logits = model(tokens[:, -context:].to(engine.device))[0, -1].float().cpu()
        probs = torch.softmax(logits / 0.8, dim=-1)
        tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=gen).view(1, 1)], 1)
    model.train()
    return bytes(tokens[0].tolist()).decode("utf-8", errors="replace")


class MetricsWriter:
    """Rank 0's metrics: one JSON object per step in metrics.jsonl and, when the tensorboard
    package is installed, the same numbers as TensorBoard scalars under <run>/tensorboard."""

    def __init__(self, run_dir: Path, resumed_at: int | None = None):
        """``resumed_at``: the step the run resumed from (None: a fresh run, the file starts
        empty). Rows after it are dropped: the steps after the checkpoint run again and write
        their rows anew, so the file never holds a step twice."""
        self.path = run_dir / "metrics.jsonl"
        if self.path.exists():
            kept = []
            if resumed_at is not None:
                kept = [line for line in self.path.read_text().splitlines(keepends=True)
                        if line.strip() and json.loads(line).get("step", 0) <= resumed_at]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(kept))
            os.replace(tmp, self.path)
        self.file = open(self.path, "a")
        self.board = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # torch's writer needs the tensorboard package
            log.info("tensorboard is not installed: metrics go to %s only", self.path)
        else:
            self.board = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def write(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.board is None:
            return
        for key, value in row.items():
            if key == "step":
                continue
            if isinstance(value, list):  # one value per rank
                for rank, v in enumerate(value):
                    self.board.add_scalar(f"{key}/rank{rank}", v, row["step"])
            elif isinstance(value, (int, float)):
                self.board.add_scalar(key, value, row["step"])

    def close(self) -> None:
        self.file.close()
        if self.board is not None:
            self.board.close()


def run(config_path: str, resume: bool = False, steps: int | None = None,
        run_name: str | None = None, runs_dir: str = "runs") -> dict:
    engine_config, job = split_job(config_path)
    cfg = zeroengine.parse_config(engine_config)
    if steps is not None:
        job.steps = steps
    if run_name is not None:
        job.run_name = run_name
    env = zeroengine.init_distributed()
    run_dir = Path(runs_dir) / job.run_name
    setup_logging(run_dir, env.rank)
    torch.manual_seed(job.seed)
    m = job.model
    gpt = GPTConfig(context=m.context, layers=m.layers, heads=m.heads, dim=m.dim)
    with zeroengine.zero_init(cfg):  # stage 3: built directly sharded
        model = GPT(gpt)
    engine = zeroengine.initialize(model, cfg)
    rank, world = engine.comm.rank, engine.comm.world_size
    micro = engine.config.train_micro_batch_size_per_gpu or 8
    accumulation = engine.gradient_accumulation_steps()
    ckpt_dir = str(run_dir / "checkpoints")
    if resume:
        path, _ = engine.load_checkpoint(ckpt_dir, missing_ok=True)
        log.info("resumed from %s at step %d" % (path, engine.global_steps) if path else
                 "--resume: no checkpoint in %s yet, starting fresh" % ckpt_dir)
    train, val = stdlib_corpus()
    log.info("GPT %.1fM params, ZeRO stage %d, %s, world size %d, micro batch %dx%d bytes x %d "
             "accumulation; corpus %.1f MB train / %.1f MB validation (Python stdlib)",
             num_params(model) / 1e6,
             engine.stage, str(engine.precision.compute).replace("torch.", ""), world, micro,
             gpt.context, accumulation, len(train) / 1e6, len(val) / 1e6)
    metrics = MetricsWriter(run_dir, engine.global_steps if resume else None) \
        if rank == 0 else None
    progress = Progress(rank, engine.global_steps, job.steps, cfg.steps_per_print)
    tokens_per_step = micro * gpt.context * accumulation * world
    last = {}
    try:
        while engine.global_steps < job.steps:
            step = engine.global_steps
            # data order depends only on (seed, step, rank): a resumed run sees the same batches
            gen = torch.Generator().manual_seed(job.seed * 1_000_003 + step * 1009 + rank)
            start = time.perf_counter()
            total = 0.0
            for _ in range(accumulation):
                w = windows(train, micro, gpt.context, gen).to(engine.device)
                loss = model.loss(w[:, :-1], w[:, 1:])
                engine.backward(loss)
                engine.step()
                total += loss.item() / accumulation
            elapsed = time.perf_counter() - start
            memory = engine.comm.all_gather_object(engine.memory_report()["total"])
            row = {"step": engine.global_steps, "loss": round(total, 5),
                   "tokens_per_s": round(tokens_per_step / elapsed, 1),
                   "lr": engine.optimizer.param_groups[0]["lr"],
                   "loss_scale": engine.loss_scale,
                   "grad_norm": engine.get_global_grad_norm(),
                   "model_state_mb_per_rank": [round(b / 2**20, 2) for b in memory]}
            if engine.global_steps % job.eval_interval == 0 or engine.global_steps == job.steps:
                row["val_loss"] = round(evaluate(engine, model, val, job.eval_batches, micro,
                                                 gpt.context, job.seed + 17), 5)
            if metrics is not None:
                metrics.write(row)
            progress.update(engine.global_steps, {
                "loss": f"{total:.3f}", "tok/s": f"{row['tokens_per_s']:.0f}",
                "scale": f"{engine.loss_scale:g}",
                "mem/rank": f"{max(memory) / 2**20:.0f}MB",
                **({"val": f"{row['val_loss']:.3f}"} if "val_loss" in row else {})})
            if job.checkpoint_interval and engine.global_steps % job.checkpoint_interval == 0:
                engine.save_checkpoint(ckpt_dir)
            last = row
        if not job.checkpoint_interval or engine.global_steps % job.checkpoint_interval:
            engine.save_checkpoint(ckpt_dir)
    finally:
        progress.close()
        if metrics is not None:
            metrics.close()
    text = sample(engine, model, b"def ", 160, gpt.context, job.seed)
    if rank == 0:
        plot = write_plot(metrics.path, run_dir / "loss.png",
                          unsharded_mb=_unsharded_mb(cfg, engine, num_params(model)))
        log.info("final: loss %s, validation loss %s; metrics %s%s", last.get("loss"),
                 last.get("val_loss"), metrics.path, f", plot {plot}" if plot else "")
        log.info("sample:\n%s", text)
    engine.close()
    shutdown_distributed(engine.comm)
    return last


def _unsharded_mb(cfg, engine, params: int) -> float | None:
    """What each rank would hold without sharding (stage 0, the ZeRO formula), for the plot."""
    from zeroengine.tools.estimate import model_state_bytes, states_per_param
    try:
        states = states_per_param(cfg.optimizer.type if cfg.optimizer else "adamw")
    except ValueError:  # an optimizer the formulas do not know
        return None
    precision = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[
        engine.precision.compute]
    return model_state_bytes(params, 0, engine.comm.world_size, precision,
                             states).device_total / 2**20


def write_plot(metrics_path: Path, out: Path, unsharded_mb: float | None = None) -> Path | None:
    """Train/validation loss and model-state memory per rank (beside what plain data parallel
    would hold), as a PNG (needs matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    rows = [json.loads(line) for line in open(metrics_path)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train")
    evals = [r for r in rows if "val_loss" in r]
    ax1.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="validation")
    ax1.set(xlabel="step", ylabel="loss (nats/byte)", title="loss")
    ax1.legend()
    for rank in range(len(rows[-1]["model_state_mb_per_rank"])):
        ax2.plot([r["step"] for r in rows], [r["model_state_mb_per_rank"][rank] for r in rows],
                 "-" if rank == 0 else "--", label=f"rank {rank}")
    if unsharded_mb is not None:
        ax2.axhline(unsharded_mb, color="gray", linestyle=":",
                    label=f"unsharded (DDP): {unsharded_mb:.0f} MB")
    ax2.set_ylim(bottom=0)
    ax2.set(xlabel="step", ylabel="MB", title="model states per rank")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="zeroengine train (worker)")
    ap.add_argument("config")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--run-name", default=None)
    ap.add_argument("--runs-dir", default="runs")
    args = ap.parse_args(argv)
    run(args.config, args.resume, args.steps, args.run_name, args.runs_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
