"""`zeroengine train`: the built-in job at 2 ranks (launched by --nproc), its metrics, eval,
checkpoints, --resume, and rank-aware output."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from harness import TINY_JOB

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

def _train(tmp_path, *flags):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY_JOB))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "zeroengine", "train", str(config), "--nproc",
                           "2", "--runs-dir", str(tmp_path / "runs"), *flags],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def test_train_runs_evaluates_checkpoints_and_resumes(tmp_path):
    first = _train(tmp_path)
    run = tmp_path / "runs" / "tiny"
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["step"] for r in rows if "val_loss" in r] == [2, 4]
    assert all(len(r["model_state_mb_per_rank"]) == 2 and r["tokens_per_s"] > 0 for r in rows)
    assert (run / "checkpoints" / "latest").read_text() == "global_step4"
    assert (run / "logs" / "rank0.log").exists() and (run / "logs" / "rank1.log").exists()
    # rank 0 reports; rank 1 prints nothing but warnings
    assert "ZeRO stage 3" in first.stderr and "sample:" in first.stderr
    assert not any(line.startswith("[rank 1]") and "WARNING" not in line.upper()
                   for line in first.stderr.splitlines() if "INFO" in line)
    assert "ZeRO stage 3" in (run / "logs" / "rank1.log").read_text()

    second = _train(tmp_path, "--resume", "--steps", "6")
    assert "resumed from" in second.stderr and "global_step4" in second.stderr
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert (run / "checkpoints" / "latest").read_text() == "global_step6"


def test_metrics_go_to_jsonl_and_tensorboard(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (CI installs it)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from zeroengine.tools.train_job import MetricsWriter
    writer = MetricsWriter(tmp_path)
    for step in (1, 2):
        writer.write({"step": step, "loss": 3.0 / step, "model_state_mb_per_rank": [1.5, 2.5],
                      **({"val_loss": 2.0} if step == 2 else {})})
    writer.close()
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [1, 2]
    board = EventAccumulator(str(tmp_path / "tensorboard"))
    board.Reload()
    assert [(e.step, e.value) for e in board.Scalars("loss")] == [(1, 3.0), (2, 1.5)]
    assert [(e.step, e.value) for e in board.Scalars("val_loss")] == [(2, 2.0)]
    assert [e.value for e in board.Scalars("model_state_mb_per_rank/rank1")] == [2.5, 2.5]


def test_minimal_example_loop_runs():
    """zeroengine/examples/demo.py, the minimal loop the README's usage grows from, still runs."""
    out = subprocess.run([sys.executable, "-m", "zeroengine.examples.demo",
                          os.path.join(ROOT, "configs", "zero2.json"), "2"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ZeRO stage 2, world size 1" in out.stdout and "step    1  loss" in out.stdout, \
        out.stdout


def test_resumed_metrics_hold_each_step_once(tmp_path):
    """A run that stopped at step 4 after its step-2 checkpoint resumes at 2: steps 3-4 run
    again, and their old rows go."""
    from zeroengine.tools.train_job import MetricsWriter
    writer = MetricsWriter(tmp_path)
    for step in (1, 2, 3, 4):
        writer.write({"step": step, "loss": 1.0})
    writer.close()
    writer = MetricsWriter(tmp_path, resumed_at=2)
    writer.write({"step": 3, "loss": 0.5})
    writer.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 1.0), (3, 0.5)]
    MetricsWriter(tmp_path).close()  # a fresh run starts empty
    assert (tmp_path / "metrics.jsonl").read_text() == ""
