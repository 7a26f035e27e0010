"""CPU Adam step time: torch AdamW (foreach, fused), DeepSpeedCPUAdam (if installed) and
zeroengine's CPUAdam, at 10M and 50M parameters and 1 and 2 threads, beside the machine's
memory bandwidth (triad a = b + s*c). Effective GB/s counts 28 bytes per parameter (read p, g,
m, v; write p, m, v), also for the rows that write a bf16 copy as well (2 bytes more). The
optimizers are stepped in turn, one step each per round, so a noisy
machine's drift hits them alike.

    python benchmarks/adam_bench.py [--sizes 10e6,50e6] [--threads 1,2] [--repeats 15]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from zeroengine.ops import CPUAdam

BYTES_PER_PARAM = 28


def median_ms(fn, repeats: int, warmup: int = 3) -> float:
    return interleaved_ms({"fn": fn}, repeats, warmup)["fn"]


def interleaved_ms(fns: dict, repeats: int, warmup: int = 3) -> dict:
    """Median ms per call of each function, calling them in turn (one call of each per round)
    so that drift in a shared machine's speed hits all of them alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def triad_gbs(n: int, repeats: int) -> float:
    b, c, a = torch.rand(n), torch.rand(n), torch.empty(n)
    ms = median_ms(lambda: torch.add(b, c, alpha=0.5, out=a), repeats)
    return 3 * 4 * n / (ms / 1e3) / 1e9


def optimizers():
    """(name, make): make(param) returns a step function over that one flat parameter."""
    kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    yield "torch AdamW foreach", lambda p: torch.optim.AdamW([p], foreach=True, **kw).step
    yield "torch AdamW fused", lambda p: torch.optim.AdamW([p], fused=True, **kw).step
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        yield "DeepSpeedCPUAdam", lambda p: DeepSpeedCPUAdam([p], adamw_mode=True, **kw).step
    except Exception as err:  # noqa: BLE001 - not installed, or its JIT build failed
        print(f"(DeepSpeedCPUAdam skipped: {type(err).__name__}: {err})", file=sys.stderr)
    yield "zeroengine CPUAdam", lambda p: CPUAdam([p], **kw).step
    # What offload needs after the step: the bf16 copy of the parameters for the device. The
    # peers take a second pass over p for it; CPUAdam writes it in the same pass.
    yield "torch AdamW fused + bf16 copy", lambda p: _then_copy(
        torch.optim.AdamW([p], fused=True, **kw), p)
    yield "zeroengine CPUAdam + fused bf16 copy-out", \
        lambda p: _with_copy_out(CPUAdam([p], **kw), p)


def _then_copy(opt, p):
    low = torch.empty_like(p, dtype=torch.bfloat16)

    def step():
        opt.step()
        low.copy_(p.detach())
    return step


def _with_copy_out(opt, p):
    low = torch.empty_like(p, dtype=torch.bfloat16)
    return lambda: opt.step(low_precision_copies={p: low})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10e6,50e6")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    print("| params | threads | optimizer | ms/step | effective GB/s | vs torch fused |")
    print("|---|---|---|---|---|---|")
    for n in sizes:
        for t in threads:
            torch.set_num_threads(t)
            bandwidth = triad_gbs(n, args.repeats)
            steps, keep = {}, []
            for name, make in optimizers():
                p = torch.nn.Parameter(torch.randn(n))
                p.grad = torch.randn(n)
                steps[name] = make(p)
                keep.append(p)
            ms_of = interleaved_ms(steps, args.repeats)
            fused_ms = ms_of["torch AdamW fused"]
            for name, ms in ms_of.items():
                ratio = "-" if name.endswith("foreach") else f"{fused_ms / ms:.2f}x"
                if name.endswith("copy-out"):  # against the peer path that also copies
                    ratio = f"{ms_of['torch AdamW fused + bf16 copy'] / ms:.2f}x vs fused+copy"
                gbs = BYTES_PER_PARAM * n / (ms / 1e3) / 1e9
                print(f"| {n / 1e6:.0f}M | {t} | {name} | {ms:.1f} | {gbs:.1f} | {ratio} |",
                      flush=True)
            del keep, steps
            print(f"| {n / 1e6:.0f}M | {t} | triad a=b+s*c | - | {bandwidth:.1f} | - |")


if __name__ == "__main__":
    main()
