"""Pretrained weights into a stage-3 engine: memory and time per rank, beside DeepSpeed.

A Llama-shaped model (~290M parameters, fp32, written by save_pretrained as a sharded
safetensors checkpoint) is brought into a stage-3 engine three ways, each at world 2 and 4:

- zeroengine: ``with zero_init(cfg): from_pretrained(dir)`` then ``initialize`` (each rank reads
  only the bytes of its slices, straight into its shard);
- whole: plain ``from_pretrained(dir)`` on every rank, then ``initialize`` (what worked before);
- deepspeed: DeepSpeed's path for the same model, ``HfDeepSpeedConfig`` alive so transformers
  builds under ``deepspeed.zero.Init`` and loads through ``_load_state_dict_into_zero3_model``,
  then ``deepspeed.initialize`` (DeepSpeed 0.19.8 on CPU).

Per rank: the peak RSS rise from just before from_pretrained to the end of initialize (the
kernel's high-water mark, reset first), the bytes each rank read from the checkpoint, and the
wall time; the page cache is emptied of the checkpoint's files before every run
(posix_fadvise DONTNEED), and the disk's cold sequential read bandwidth is measured the same
way, to set the time against. Median of --repeats runs; the table shows the worst rank.

    python benchmarks/load_bench.py [--repeats 3] [--worlds 2,4] [--small] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from zeroengine.testing import run_ranks

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench_out")


def llama_config(small: bool):
    from transformers import LlamaConfig
    if small:
        return LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=352,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           tie_word_embeddings=True)
    return LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                       num_hidden_layers=20, num_attention_heads=16, num_key_value_heads=8,
                       tie_word_embeddings=True)


def checkpoint(small: bool) -> str:
    """The model's save_pretrained directory (made once, kept in bench_out/)."""
    from transformers import LlamaForCausalLM
    path = os.path.join(ROOT, "load_bench_small" if small else "load_bench_300m")
    if not os.path.exists(os.path.join(path, "model.safetensors.index.json")):
        torch.manual_seed(0)
        model = LlamaForCausalLM(llama_config(small))
        model.save_pretrained(path, max_shard_size="200MB" if not small else "1MB")
        del model
    return path


def files_of(path: str) -> list[str]:
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))


def evict(path: str) -> None:
    for file in files_of(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cold_read_bandwidth(path: str) -> tuple[int, float]:
    """Bytes and seconds to read the checkpoint's files once, cold, sequentially."""
    evict(path)
    total, start = 0, time.perf_counter()
    for file in files_of(path):
        with open(file, "rb", buffering=0) as f:
            while chunk := f.read(64 << 20):
                total += len(chunk)
    return total, time.perf_counter() - start


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _ds_config() -> dict:
    return {"train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def _load(method: str, path: str) -> dict:
    """One rank: load the checkpoint into a stage-3 engine by ``method``."""
    import transformers  # noqa: F401  (imported before the clock and the memory mark)
    from transformers import AutoModelForCausalLM

    import zeroengine
    cfg = _ds_config()
    if method == "deepspeed":
        import deepspeed
        from transformers.integrations import HfDeepSpeedConfig
        deepspeed.init_distributed(dist_backend="gloo")
        keep_alive = HfDeepSpeedConfig(cfg)  # noqa: F841  (transformers reads it while alive)
    else:
        zeroengine.init_distributed()
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # imports torch._dynamo now
    torch.distributed.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark starts at the current RSS
    before = _status("VmRSS")
    start = time.perf_counter()
    read = None
    if method == "zeroengine":
        with zeroengine.zero_init(cfg):
            model = AutoModelForCausalLM.from_pretrained(path)
        files = next(p._ze_source.files for p in model.parameters() if p.is_meta)
        engine = zeroengine.initialize(model, cfg)
        read = files.bytes_read
    elif method == "whole":
        model = AutoModelForCausalLM.from_pretrained(path)
        engine = zeroengine.initialize(model, cfg)
    else:
        model = AutoModelForCausalLM.from_pretrained(path)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=cfg)
    torch.distributed.barrier()
    seconds = time.perf_counter() - start
    rise = _status("VmHWM") - before
    params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                 for p in model.parameters())
    del engine
    return {"seconds": seconds, "rise": rise, "read": read, "params": params}


def run(method: str, world: int, path: str, repeats: int) -> dict:
    runs = []
    for _ in range(repeats):
        evict(path)
        ranks = run_ranks(world, _load, method, path, timeout=1800)
        runs.append({"seconds": max(r["seconds"] for r in ranks),
                     "rise": max(r["rise"] for r in ranks),
                     "read": None if ranks[0]["read"] is None
                     else max(r["read"] for r in ranks),
                     "params": ranks[0]["params"]})
    return {"runs": runs,
            "seconds": statistics.median(r["seconds"] for r in runs),
            "rise": statistics.median(r["rise"] for r in runs),
            "read": runs[0]["read"], "params": runs[0]["params"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--methods", default="zeroengine,whole,deepspeed")
    parser.add_argument("--small", action="store_true", help="a tiny model (a dry run)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    path = checkpoint(args.small)
    entries = __import__("zeroengine.checkpoint.weights.weight_files", fromlist=["x"]) \
        .WeightFiles.open(path).entries.values()
    fp32_bytes = sum(e.numel for e in entries) * 4
    largest = max(e.numel for e in entries) * 4
    total, cold = cold_read_bandwidth(path)
    bandwidth = total / cold
    print(f"checkpoint: {path}, {total / 2**20:.0f} MiB in {len(files_of(path))} files; "
          f"cold sequential read {cold:.2f} s ({bandwidth / 2**20:.0f} MiB/s); fp32 model "
          f"{fp32_bytes / 2**20:.0f} MiB, largest tensor {largest / 2**20:.0f} MiB")
    results = {"checkpoint_bytes": total, "cold_read_s": cold, "fp32_bytes": fp32_bytes,
               "largest_tensor_bytes": largest, "rows": []}
    print("| world | method | peak RSS rise per rank (MiB) | x fp32 model | budget: share + 2x "
          "largest (MiB) | read per rank (MiB) | load time (s) | x cold read of the files |")
    print("|---|---|---|---|---|---|---|---|")
    for world in (int(w) for w in args.worlds.split(",")):
        budget = fp32_bytes / world + 2 * largest
        for method in args.methods.split(","):
            r = run(method, world, path, args.repeats)
            results["rows"].append({"world": world, "method": method, **r})
            read = "-" if r["read"] is None else f"{r['read'] / 2**20:.0f}"
            print(f"| {world} | {method} | {r['rise'] / 2**20:.0f} | "
                  f"{r['rise'] / fp32_bytes:.2f} | {budget / 2**20:.0f} | {read} | "
                  f"{r['seconds']:.2f} | {r['seconds'] / cold:.1f} |", flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
