"""Runs a DeepSpeed script unchanged and records, on rank 0, what the comparison needs and the
script does not print: every training loss (the value torch.nn.functional.cross_entropy /
mse_loss returned with gradients on), each engine's lr and global_steps after every step(),
and the final parameters (gathered with zero.GatheredParameters). zeroengine's tests own this
file; the scripts it runs are public (tests/ds_scripts/*.py, each with its source).

    python recorder.py [--local_rank=N] OUT ENGINE SCRIPT [script args]

ENGINE: "deepspeed" (DeepSpeed itself) or "zeroengine" (zeroengine.deepspeed).

With RECORD_STATE=1 it also records, through DeepSpeed's utils.safe_get_full_fp32_param /
safe_get_full_optimizer_state, a digest of every parameter's fp32 master and Adam moments
right after each engine.load_checkpoint(...) the script makes (with the client_state it
returned) and at the end: a resumed run's state after loading must be the saved run's state at
its end, bit for bit. With RECORD_FIXED_CLOCK=1 the wall clock pytz-zoned now() reads is one
fixed instant (see _fix_clock).
"""
import datetime
import hashlib
import importlib
import json
import os
import runpy
import sys

import torch


def _fix_clock():
    """HelloDeepSpeed's train_bert_ds.py names its experiment directory after each rank's own
    ``datetime.now(pytz.timezone(...))`` to the second, so two ranks that straddle a second
    save into two directories and the resume finds half a checkpoint (a race in the script,
    under DeepSpeed as under us). Both engines' runs read one fixed instant instead."""
    import pytz

    class FixedInstant(datetime.tzinfo):
        def utcoffset(self, dt):
            return datetime.timedelta(0)

        def dst(self, dt):
            return datetime.timedelta(0)

        def tzname(self, dt):
            return "UTC"

        def fromutc(self, dt):  # what datetime.now(tz) returns
            return datetime.datetime(2025, 1, 1, 12, 0, 0, tzinfo=self)

    pytz.timezone = lambda name: FixedInstant()


def _rng_digest() -> dict:
    import numpy as np
    return {"torch": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest(),
            "numpy": hashlib.sha256(np.random.get_state()[1].tobytes()).hexdigest()
            + str(np.random.get_state()[2])}


def _digest(ds, engine, engine_name: str) -> dict:
    """Per parameter: sha256, norm and sum of its fp32 master and of each Adam moment, read
    through DeepSpeed's own accessors (collectives: every rank calls them in one order).
    DeepSpeed 0.19.8 cannot read the moments back with the optimizer offloaded (its
    tensor_fragment has no optim_fragment there: TypeError on the owning rank, a collective
    left waiting on the other): those are None for DeepSpeed then; zeroengine's must read."""
    moments = not (engine_name == "deepspeed" and engine.zero_cpu_offload())
    out = {}
    for name, p in engine.module.named_parameters():
        entry = {"fp32": ds.utils.safe_get_full_fp32_param(p)}
        for key in ("exp_avg", "exp_avg_sq"):
            entry[key] = ds.utils.safe_get_full_optimizer_state(p, key) if moments else None
        for kind, t in entry.items():
            if t is None:
                continue
            t = t.detach().float().cpu().contiguous()
            entry[kind] = {"sha": hashlib.sha256(t.numpy().tobytes()).hexdigest(),
                           "norm": t.norm().item(), "sum": t.sum().item()}
        out[name] = entry
    return out


def _allow_cpu_fp16():
    """DeepSpeed's CPU accelerator refuses fp16 ("Type fp16 is not supported on your device")
    unless oneDNN has fp16 kernels for the CPU (AVX512-FP16 or AMX), although torch computes
    fp16 on any CPU, only slower. On a CPU without them the reference run would not exist: let
    DeepSpeed's check pass, so both engines run the same fp16 script on every machine."""
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu" and not accelerator.is_fp16_supported():
        type(accelerator).is_fp16_supported = lambda self: True


def main():
    argv = sys.argv[1:]
    local = [a for a in argv if a.startswith("--local_rank=")]
    argv = [a for a in argv if not a.startswith("--local_rank=")]
    out, engine_name, script, script_args = argv[0], argv[1], argv[2], argv[3:]
    ds = importlib.import_module("deepspeed" if engine_name == "deepspeed"
                                 else "zeroengine.deepspeed")
    if engine_name == "deepspeed":
        _allow_cpu_fp16()
    losses, engines, steps, loads = [], [], [], []
    record_state = os.environ.get("RECORD_STATE") == "1"
    if os.environ.get("RECORD_FIXED_CLOCK") == "1":
        _fix_clock()
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
        load = engine.load_checkpoint

        def recording_load(*a, **k):
            before = _rng_digest()
            value = load(*a, **k)
            after = _rng_digest()
            if record_state:
                loads.append({"engine": index, "client_state": value[1],
                              "state": _digest(ds, engine, engine_name),
                              "rng_before": before, "rng_after": after})
            return value

        engine.load_checkpoint = recording_load
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
    result = {"losses": losses, "steps": steps, "final": final}
    if record_state:
        result["loads"] = loads
        result["final_state"] = [_digest(ds, engine, engine_name) for engine in engines]
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w") as f:
            json.dump(result, f, default=str)
    # Take the group down together, for either engine: a gloo group left to interpreter exit
    # can abort a rank whose peer exited first ("terminate called without an active
    # exception"), after the run itself succeeded (seen with DeepSpeed in CI).
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
