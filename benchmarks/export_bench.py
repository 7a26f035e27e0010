"""Weights out of a stage-3 run: memory and write speed, beside DeepSpeed.

The ~290M Llama of load_bench.py (fp32) in a stage-3 engine at world 2, written out in the
Hugging Face layout at --max-shard-size 1/8 of the fp32 model:

- save_pretrained: ``engine.save_pretrained(dir, max_shard_size)`` from the live engine, every
  rank writing its own files (peak RSS rise per rank, the worst rank shown);
- consolidate: ``zeroengine consolidate ckpt out --max-shard-size`` on the checkpoint
  ``save_checkpoint`` wrote, in its own process (its peak RSS above that process's RSS once
  it imported the same modules, the high-water mark reset there);
- DeepSpeed's ``save_16bit_model`` from a DeepSpeed stage-3 engine of the same model (fp32:
  what it gathers on rank 0), and its ``zero_to_fp32`` conversion of its checkpoint
  (``convert_zero_checkpoint_to_fp32_state_dict``), in its own
  process likewise (``safe_serialization=False``: with True, DeepSpeed 0.19.8 refuses the
  Llama's tied embedding - "Some tensors share memory");
- zeroengine's consolidate of that DeepSpeed checkpoint (it reads DeepSpeed's files);
- FSDP2's full-state-dict export: the model fully_shard'ed per decoder layer,
  ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` onto rank 0, torch.save.

Write speed is bytes written over seconds, against this disk's sequential write bandwidth
(a file of the model's size written and fsynced). Median of --repeats.

    python benchmarks/export_bench.py [--repeats 3] [--small] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.load_bench import _status, checkpoint
from zeroengine.testing import run_ranks

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench_out")


def _mark() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if f.endswith((".safetensors", ".bin", ".json", ".pt")))


def write_bandwidth(nbytes: int, where: str) -> float:
    """Bytes/s of one sequential write of ``nbytes``, fsynced."""
    block = os.urandom(16 << 20)
    path = os.path.join(where, "bandwidth.tmp")
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        written = 0
        while written < nbytes:
            written += f.write(block)
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    os.remove(path)
    return written / seconds


def _config(deepspeed_side: bool) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    if deepspeed_side:
        cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    return cfg


def _ours(path: str, out: str, shard_size: int) -> dict:
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM

    import zeroengine
    zeroengine.init_distributed()
    cfg = _config(False)
    with zeroengine.zero_init(cfg):
        model = AutoModelForCausalLM.from_pretrained(path)
    engine = zeroengine.initialize(model, cfg)
    rank = torch.distributed.get_rank()
    result = {}
    torch.distributed.barrier()
    before, start = _mark(), time.perf_counter()
    engine.save_pretrained(os.path.join(out, "pretrained"), max_shard_size=shard_size)
    result["save_pretrained"] = {"seconds": time.perf_counter() - start,
                                 "rise": _status("VmHWM") - before}
    engine.save_checkpoint(os.path.join(out, "ckpt"), tag="t")
    torch.distributed.barrier()
    result["rank"] = rank
    return result


def _deepspeed(path: str, out: str) -> dict:
    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = _config(True)
    keep = HfDeepSpeedConfig(cfg)  # noqa: F841
    model = AutoModelForCausalLM.from_pretrained(path)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg)
    torch.distributed.barrier()
    before, start = _mark(), time.perf_counter()
    engine.save_16bit_model(os.path.join(out, "ds16"))
    torch.distributed.barrier()
    result = {"save_16bit_model": {"seconds": time.perf_counter() - start,
                                   "rise": _status("VmHWM") - before}}
    engine.save_checkpoint(os.path.join(out, "dsckpt"), tag="t")
    torch.distributed.barrier()
    return result


# The peak is measured from a reset high-water mark (clear_refs 5), not ru_maxrss: the
# imports' own transient peak would otherwise hide a rise smaller than it.
_PEAK = """
def _status(field):
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(field + ":"))
def _mark():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")
"""

def _fsdp2(path: str, out: str) -> dict:
    """FSDP2's full-state-dict export (its tutorial's recipe): every decoder layer and the root
    fully_shard'ed, get_model_state_dict(full_state_dict, cpu_offload) gathers onto rank 0,
    which torch.saves it."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    dist.init_process_group("gloo")
    model = AutoModelForCausalLM.from_pretrained(path)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    dist.barrier()
    before, start = _mark(), time.perf_counter()
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))
    if dist.get_rank() == 0:
        os.makedirs(os.path.join(out, "fsdp2"), exist_ok=True)
        target = os.path.join(out, "fsdp2", "model.pt")
        torch.save(state, target)
        with open(target, "rb") as f:
            os.fsync(f.fileno())
    del state
    dist.barrier()
    return {"fsdp2 full state dict": {"seconds": time.perf_counter() - start,
                                      "rise": _status("VmHWM") - before}}


CONSOLIDATE = _PEAK + """
import sys, time, os
sys.argv = {argv!r}
import torch, zeroengine
from zeroengine.tools import cli
base = _mark()
start = time.perf_counter()
if {run!r}:
    cli.main(sys.argv[1:])
print("RESULT", base, _status("VmHWM"), time.perf_counter() - start)
"""

ZERO_TO_FP32 = _PEAK + """
import sys, time
import torch
from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
base = _mark()
start = time.perf_counter()
if {run!r}:
    convert_zero_checkpoint_to_fp32_state_dict({ckpt!r}, {out!r}, max_shard_size={size!r},
                                               safe_serialization=False, tag="t")
print("RESULT", base, _status("VmHWM"), time.perf_counter() - start)
"""


def _in_process(code: str) -> tuple[int, float]:
    """(peak RSS above the interpreter's after its imports, seconds) of ``code``."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(done.stderr[-3000:])
    _, base, peak, seconds = line.split()
    return int(peak) - int(base), float(seconds)


def one_run(path: str, shard_size: int, work: str) -> dict:
    out = {}
    ours = run_ranks(2, _ours, path, work, shard_size, timeout=3600)
    worst = max(ours, key=lambda r: r["save_pretrained"]["rise"])["save_pretrained"]
    out["save_pretrained"] = {**worst, "bytes": dir_bytes(os.path.join(work, "pretrained")),
                              "seconds": max(r["save_pretrained"]["seconds"] for r in ours)}
    ckpt = os.path.join(work, "ckpt", "t")
    target = os.path.join(work, "consolidated")
    argv = ["zeroengine", "consolidate", ckpt, target, "--max-shard-size", str(shard_size)]
    rise, seconds = _in_process(CONSOLIDATE.format(argv=argv, run=True))
    out["consolidate"] = {"rise": rise, "seconds": seconds, "bytes": dir_bytes(target)}
    ds = run_ranks(2, _deepspeed, path, work, timeout=3600)
    worst = max(ds, key=lambda r: r["save_16bit_model"]["rise"])["save_16bit_model"]
    out["deepspeed save_16bit_model"] = {**worst, "bytes": dir_bytes(os.path.join(work, "ds16"))}
    target = os.path.join(work, "ds_fp32")
    rise, seconds = _in_process(ZERO_TO_FP32.format(run=True, ckpt=os.path.join(work, "dsckpt"),
                                                    out=target, size=shard_size))
    out["deepspeed zero_to_fp32"] = {"rise": rise, "seconds": seconds,
                                     "bytes": dir_bytes(target)}
    # the same conversion of DeepSpeed's checkpoint by zeroengine (it reads DeepSpeed's files)
    target = os.path.join(work, "ds_consolidated")
    argv = ["zeroengine", "consolidate", os.path.join(work, "dsckpt", "t"), target,
            "--max-shard-size", str(shard_size)]
    rise, seconds = _in_process(CONSOLIDATE.format(argv=argv, run=True))
    out["consolidate (DeepSpeed's checkpoint)"] = {"rise": rise, "seconds": seconds,
                                                   "bytes": dir_bytes(target)}
    fsdp = run_ranks(2, _fsdp2, path, work, timeout=3600)
    worst = max(fsdp, key=lambda r: r["fsdp2 full state dict"]["rise"])["fsdp2 full state dict"]
    out["fsdp2 full state dict"] = {**worst, "bytes": dir_bytes(os.path.join(work, "fsdp2"))}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    path = checkpoint(args.small)
    from zeroengine.checkpoint.weights.weight_files import WeightFiles
    fp32 = sum(e.numel for e in WeightFiles.open(path).entries.values()) * 4
    shard_size = fp32 // 8
    os.makedirs(ROOT, exist_ok=True)
    bandwidth = write_bandwidth(fp32, ROOT)
    print(f"fp32 model {fp32 / 2**20:.0f} MiB, --max-shard-size {shard_size / 2**20:.0f} MiB; "
          f"this disk writes {bandwidth / 2**20:.0f} MiB/s sequentially (fsynced)")
    runs = []
    for _ in range(args.repeats):
        work = tempfile.mkdtemp(dir=ROOT, prefix="export_")
        try:
            runs.append(one_run(path, shard_size, work))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    rows = {}
    print("| what | peak RSS rise (MiB) | x fp32 model | written (MiB) | seconds | MiB/s | "
          "x disk bandwidth |")
    print("|---|---|---|---|---|---|---|")
    for what in runs[0]:
        rise = statistics.median(r[what]["rise"] for r in runs)
        seconds = statistics.median(r[what]["seconds"] for r in runs)
        nbytes = runs[0][what]["bytes"]
        rows[what] = {"rise": rise, "seconds": seconds, "bytes": nbytes,
                      "runs": [r[what] for r in runs]}
        print(f"| {what} | {rise / 2**20:.0f} | {rise / fp32:.2f} | {nbytes / 2**20:.0f} | "
              f"{seconds:.2f} | {nbytes / seconds / 2**20:.0f} | "
              f"{nbytes / seconds / bandwidth:.2f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"fp32_bytes": fp32, "max_shard_size": shard_size,
                       "write_bandwidth": bandwidth, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
