"""A job that ends without close() or destroy_process_group(), its last line an asynchronous
save: the clean-exit test runs it under torchrun many times (issue 41).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/unclosed_job.py DIR

Every run must exit 0 and leave DIR/global_step2 complete: the engine's exit path finishes the
pending save, closes the engine and takes the process group down.
"""
import sys

from harness import make_model, make_optimizer, param_groups, run_step

import zeroengine

model = make_model()
engine = zeroengine.initialize(
    model, {"zero_optimization": {"stage": 3, "reduce_bucket_size": 40,
                                  "stage3_param_persistence_threshold": 20}},
    optimizer=make_optimizer("adamw", param_groups(model)))
for step in range(2):
    run_step(engine, step, 1)
engine.save_checkpoint(sys.argv[1], async_save=True)
