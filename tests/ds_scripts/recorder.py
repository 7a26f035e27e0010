"""Runs a DeepSpeed script unchanged and records, on rank 0, what the comparison needs and the
script does not print: every training loss (the value torch.nn.functional.cross_entropy /
mse_loss returned with gradients on), each engine's lr and global_steps after every step(),
and the final parameters (gathered with zero.GatheredParameters). zeroengine's tests own this
file; the scripts it runs are public (tests/ds_scripts/*.py, each with its source).

    python recorder.py [--local_rank=N] OUT ENGINE SCRIPT [script args]

ENGINE: "deepspeed" (DeepSpeed itself) or "zeroengine" (zeroengine.deepspeed).
"""
import importlib
import json
import os
import runpy
import sys

import torch


def main():
    argv = sys.argv[1:]
    local = [a for a in argv if a.startswith("--local_rank=")]
    argv = [a for a in argv if not a.startswith("--local_rank=")]
    out, engine_name, script, script_args = argv[0], argv[1], argv[2], argv[3:]
    ds = importlib.import_module("deepspeed" if engine_name == "deepspeed"
                                 else "zeroengine.deepspeed")
    losses, engines, steps = [], [], []
    captured: dict[int, dict] = {}

    def capture(index, engine):
        params = list(engine.module.parameters())
        with ds.zero.GatheredParameters(params):
            captured[index] = {f"{index}.{name}": p.detach().float().flatten().tolist()
                               for name, p in engine.module.named_parameters()}

    def record_loss(fn):
        def wrapped(*args, **kwargs):
            value = fn(*args, **kwargs)
            if torch.is_grad_enabled() and value.requires_grad:
                losses.append(value.item())
            return value
        return wrapped

    for name in ("cross_entropy", "mse_loss"):
        setattr(torch.nn.functional, name, record_loss(getattr(torch.nn.functional, name)))
    initialize = ds.initialize

    def recording_initialize(*args, **kwargs):
        result = initialize(*args, **kwargs)
        engine = result[0]
        index = len(engines)
        engines.append(engine)
        step = engine.step

        def recording_step(*a, **k):
            value = step(*a, **k)
            steps.append({"engine": index, "lr": engine.get_lr()[0],
                          "global_steps": engine.global_steps})
            return value

        engine.step = recording_step
        destroy = getattr(engine, "destroy", None)

        def recording_destroy(*a, **k):  # the script's last call: the parameters before it
            capture(index, engine)
            return destroy(*a, **k)

        if destroy is not None:
            engine.destroy = recording_destroy
        return result

    ds.initialize = recording_initialize
    # scripts that build their model without seeding (cifar10) start from the same weights
    # under both engines: each broadcasts rank 0's, and rank 0 draws them from this seed
    torch.manual_seed(1234)
    sys.argv = [script, *local, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
    for index, engine in enumerate(engines):
        if index not in captured:
            capture(index, engine)
    final = {k: v for index in sorted(captured) for k, v in captured[index].items()}
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w") as f:
            json.dump({"losses": losses, "steps": steps, "final": final}, f)
    # Take the group down together, for either engine: a gloo group left to interpreter exit
    # can abort a rank whose peer exited first ("terminate called without an active
    # exception"), after the run itself succeeded (seen with DeepSpeed in CI).
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
