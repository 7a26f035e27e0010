"""CPU Adam step time: torch AdamW (foreach, fused), DeepSpeedCPUAdam (if installed) and
zeroengine's CPUAdam, at 10M and 50M parameters and 1 and 2 threads, beside the machine's
memory bandwidth (triad a = b + s*c). Effective GB/s counts 28 bytes per parameter (read p, g,
m, v; write p, m, v).

    python benchmarks/adam_bench.py [--sizes 10e6,50e6] [--threads 1,2] [--repeats 15]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from zeroengine.ops import CPUAdam  # noqa: E402

BYTES_PER_PARAM = 28


def median_ms(fn, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def triad_gbs(n: int, repeats: int) -> float:
    b, c, a = torch.rand(n), torch.rand(n), torch.empty(n)
    ms = median_ms(lambda: torch.add(b, c, alpha=0.5, out=a), repeats)
    return 3 * 4 * n / (ms / 1e3) / 1e9


def optimizers():
    kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    yield "torch AdamW foreach", lambda ps: torch.optim.AdamW(ps, foreach=True, **kw)
    yield "torch AdamW fused", lambda ps: torch.optim.AdamW(ps, fused=True, **kw)
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        yield "DeepSpeedCPUAdam", lambda ps: DeepSpeedCPUAdam(ps, adamw_mode=True, **kw)
    except Exception as err:  # not installed, or its JIT build failed
        print(f"(DeepSpeedCPUAdam skipped: {type(err).__name__}: {err})", file=sys.stderr)
    yield "zeroengine CPUAdam", lambda ps: CPUAdam(ps, **kw)


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
            fused_ms = None
            for name, make in optimizers():
                p = torch.nn.Parameter(torch.randn(n))
                p.grad = torch.randn(n)
                opt = make([p])
                ms = median_ms(opt.step, args.repeats)
                fused_ms = ms if name == "torch AdamW fused" else fused_ms
                ratio = f"{fused_ms / ms:.2f}x" if fused_ms else "-"
                gbs = BYTES_PER_PARAM * n / (ms / 1e3) / 1e9
                print(f"| {n / 1e6:.0f}M | {t} | {name} | {ms:.1f} | {gbs:.1f} | {ratio} |",
                      flush=True)
                del opt, p
            print(f"| {n / 1e6:.0f}M | {t} | triad a=b+s*c | - | {bandwidth:.1f} | - |")


if __name__ == "__main__":
    main()
