"""zeroengine's asynchronous file I/O (ops/aio.py, csrc/aio) against fio on the same file
system, sizes, block size and queue depth: sequential write, then sequential read, O_DIRECT.

    python benchmarks/io_bench.py --dir /work/nvme --size-gib 2 --repeats 3 --json out.json

fio (Debian package `fio`) runs with ioengine=io_uring (libaio where fio lacks it), direct=1,
the same --bs and --iodepth; ours with block_size = bs, queue_depth = iodepth. Prints the
median bandwidth of each and ours as a fraction of fio's (the issue's target: >= 0.8).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def fio_bandwidth(path: str, rw: str, size: int, bs: int, depth: int, engine: str) -> float:
    out = subprocess.run(
        ["fio", "--name=zeroengine", f"--filename={path}", f"--rw={rw}", f"--bs={bs}",
         f"--size={size}", f"--ioengine={engine}", f"--iodepth={depth}", "--direct=1",
         "--end_fsync=1" if rw == "write" else "--end_fsync=0", "--output-format=json"],
        check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    return float(job["write" if rw == "write" else "read"]["bw_bytes"])


def ours_bandwidth(io, buffer, path: str, rw: str) -> float:
    if rw == "write":  # laid out first, as fio lays out its file (fallocate) before timing
        io.allocate(path, buffer.numel())
    start = time.perf_counter()
    if rw == "write":
        io.write(buffer, path).wait()
        io.sync()
    else:
        io.read(buffer, path).wait()
    return buffer.numel() / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/zeroengine-io-bench")
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--bs", type=int, default=1 << 20)
    ap.add_argument("--iodepth", type=int, default=32)
    ap.add_argument("--threads", type=int, default=4, help="our thread backend's workers")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if shutil.which("fio") is None:
        sys.exit("io_bench: fio is not installed (Debian: apt-get install fio)")
    import torch

    from zeroengine.ops.aio import AsyncFileIO, aligned_empty
    os.makedirs(args.dir, exist_ok=True)
    size = int(args.size_gib * (1 << 30)) // args.bs * args.bs
    engines = subprocess.run(["fio", "--enghelp"], capture_output=True, text=True).stdout
    fio_engine = "io_uring" if "io_uring" in engines else "libaio"
    io = AsyncFileIO(block_size=args.bs, queue_depth=args.iodepth, thread_count=args.threads)
    buffer = aligned_empty(size)
    buffer.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
    runs: dict[str, list[float]] = {}
    for repeat in range(args.repeats):  # interleaved: fio and ours alternate
        for rw in ("write", "read"):
            path_fio = os.path.join(args.dir, "fio.bin")
            path_ours = os.path.join(args.dir, "ours.bin")
            if rw == "write":
                for p in (path_fio, path_ours):
                    io.forget(p)
                    if os.path.exists(p):
                        os.remove(p)
            runs.setdefault(f"fio {rw}", []).append(
                fio_bandwidth(path_fio, rw, size, args.bs, args.iodepth, fio_engine))
            runs.setdefault(f"ours {rw}", []).append(ours_bandwidth(io, buffer, path_ours, rw))
            print(f"repeat {repeat + 1} {rw}: fio {runs[f'fio {rw}'][-1] / 1e9:.2f} GB/s, ours "
                  f"{runs[f'ours {rw}'][-1] / 1e9:.2f} GB/s", flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"\n{size / 2**30:.2f} GiB file in {args.dir}, block {args.bs} B, queue depth "
          f"{args.iodepth}, O_DIRECT; fio {fio_engine}, ours {io.backend}; median of "
          f"{args.repeats}\n")
    print("| | fio (GB/s) | zeroengine (GB/s) | ours / fio |")
    print("|---|---|---|---|")
    for rw in ("write", "read"):
        print(f"| sequential {rw} | {med[f'fio {rw}'] / 1e9:.2f} | "
              f"{med[f'ours {rw}'] / 1e9:.2f} | {med[f'ours {rw}'] / med[f'fio {rw}']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "fio_engine": fio_engine, "backend": io.backend,
                       "runs": runs, "median": med}, f, indent=1)
    for p in ("fio.bin", "ours.bin"):
        path = os.path.join(args.dir, p)
        io.forget(path)
        if os.path.exists(path):
            os.remove(path)


if __name__ == "__main__":
    main()
