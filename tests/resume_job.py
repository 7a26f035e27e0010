"""The training job of the crash-resume test, run by torchrun with --max-restarts=1.

    python -m torch.distributed.run --standalone --nproc_per_node=2 --max-restarts=1 \
        tests/resume_job.py CKPT_DIR OUT STEPS KILL_AT

Rank 1 kills itself before step KILL_AT in the first attempt only; torchrun restarts both ranks,
which resume from the latest checkpoint (saved every 2 steps) with the one-line pattern.
"""
import os
import sys

import torch
from harness import make_model, make_optimizer, param_groups, run_step

import zeroengine


def main(ckpt_dir: str, out: str, steps: int, kill_at: int) -> None:
    model = make_model()
    engine = zeroengine.initialize(
        model, {"zero_optimization": {"stage": 2, "reduce_bucket_size": 40}},
        optimizer=make_optimizer("adamw", param_groups(model)))
    engine.load_checkpoint(ckpt_dir, missing_ok=True)  # resume if anything was saved
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    for step in range(engine.global_steps, steps):
        if step == kill_at and engine.comm.rank == 1 and first_attempt:
            os._exit(13)  # killed mid-training: no cleanup of any kind
        run_step(engine, step, 1)
        if (step + 1) % 2 == 0:
            engine.save_checkpoint(ckpt_dir)
    state = engine.consolidated_state_dict()
    if engine.comm.rank == 0:
        torch.save({"state": state, "restarts": int(os.environ.get(
            "TORCHELASTIC_RESTART_COUNT", "0"))}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
