"""NVMe offload demonstration: train a GPT whose model states do not fit in the memory the job
may use (`make nvme-demo`).

Two ranks train a byte-level GPT at ZeRO stage 3, bf16, built sharded (zero_init), with the
model states on the drive (configs/zero3_nvme.json: fp32 master and Adam's moments in swap
files under --nvme-path, streamed a sub-group tile at a time; the bf16 parameter shard in swap
files too, read through a small cache as the modules gather it). Memory is capped two ways:
- every rank's peak resident set (the kernel's VmHWM) must stay under --cap-gb, checked at the
  end (the documented RSS cap), and
- where this machine lets us (root with a cgroup v1 memory controller or cgroup v2), the whole
  job runs in a memory cgroup limited to ranks x cap: exceeding it kills the job (OOM), so the
  cap is enforced, not just observed.
The model states per rank (fp32 master, moments and bf16 parameter shard) are reported next to
the cap; the target is >= 1.5x. Each step's time is split into compute (forward + backward,
with their communication and their waits for parameter reads), disk (time the optimizer step
waited for the drive), CPU Adam and the rest of the step. The job then saves a checkpoint, still
under the cap (unless
--no-checkpoint). Then, unless --no-compare, the same model with offload_optimizer and
offload_param 'cpu' (states in host memory) runs two steps without a cap, and its peak RSS is
what the job would need without NVMe.

    python benchmarks/nvme_demo.py [--dim 1536 --layers 18 --steps 8 --cap-gb 1.7]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONFIG = os.path.join(ROOT, "configs", "zero3_nvme.json")
GB = 1e9


def status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


# -- the rank ---------------------------------------------------------------------------------
def rank_main(args) -> None:
    import torch

    import zeroengine
    from zeroengine.examples.corpus import stdlib_corpus
    from zeroengine.examples.gpt import GPT, GPTConfig, num_params

    torch.manual_seed(0)
    config = json.load(open(CONFIG))
    for section in ("offload_optimizer", "offload_param"):
        offload = config["zero_optimization"][section]
        offload["device"] = args.device
        offload["nvme_path"] = args.nvme_path
    if args.max_in_cpu is not None:
        config["zero_optimization"]["offload_param"]["max_in_cpu"] = args.max_in_cpu
    cfg = GPTConfig(context=args.context, layers=args.layers, heads=args.heads, dim=args.dim)
    t0 = time.perf_counter()
    with zeroengine.zero_init(config):
        model = GPT(cfg)
    engine = zeroengine.initialize(model, config)
    init_s = time.perf_counter() - t0
    rank = engine.comm.rank
    after_init_kb = status_kb("VmRSS")
    swap, params = engine.optimizer.swap, engine.param_swap
    adam_s = [0.0]
    for part in engine.optimizer.parts:  # time the CPU Adam passes themselves
        inner = part.optimizer
        step = inner.step

        def timed(*a, _step=step, **k):
            t = time.perf_counter()
            try:
                return _step(*a, **k)
            finally:
                adam_s[0] += time.perf_counter() - t
        inner.step = timed
    data, _ = stdlib_corpus(4_000_000)
    gen = torch.Generator().manual_seed(1234 + rank)
    micro = config["train_micro_batch_size_per_gpu"]
    rows = []
    for step in range(args.steps):
        idx = torch.randint(0, len(data) - cfg.context - 1, (micro,), generator=gen)
        window = torch.stack([data[i:i + cfg.context + 1] for i in idx])
        param_io0 = _io(params)
        t = time.perf_counter()
        loss = model.loss(window[:, :-1], window[:, 1:])
        engine.backward(loss)
        compute = time.perf_counter() - t
        param_io = [b - a for a, b in zip(param_io0, _io(params))]
        if rank == 0 and os.environ.get("ZE_DEMO_DEBUG"):
            print(f"    rank 0 RSS after backward: now {status_kb('VmRSS') / 1e6:.2f} GB, peak "
                  f"{status_kb('VmHWM') / 1e6:.2f} GB", flush=True)
        adam0, (wait0, read0, write0) = adam_s[0], _io(swap, params)
        t = time.perf_counter()
        engine.step()
        step_s = time.perf_counter() - t
        wait1, read1, write1 = _io(swap, params)
        if rank == 0 and os.environ.get("ZE_DEMO_DEBUG"):
            print(f"    rank 0 RSS: after init {after_init_kb / 1e6:.2f} GB, now "
                  f"{status_kb('VmRSS') / 1e6:.2f} GB, peak {status_kb('VmHWM') / 1e6:.2f} GB",
                  flush=True)
        disk = wait1 - wait0
        adam = adam_s[0] - adam0
        rows.append({"step": step, "loss": loss.item(), "compute_s": compute, "step_s": step_s,
                     "disk_wait_s": disk, "adam_s": adam,
                     "other_s": step_s - disk - adam,
                     "read_gb": (read1 - read0) / GB, "write_gb": (write1 - write0) / GB,
                     # forward + backward: waits for parameter chunks and the bytes moved
                     "param_wait_s": param_io[0], "param_read_gb": param_io[1] / GB,
                     "param_write_gb": param_io[2] / GB})
        if rank == 0:
            r = rows[-1]
            print(f"  step {step}: loss {r['loss']:.3f}  compute {r['compute_s']:.2f} s (param "
                  f"reads waited {r['param_wait_s']:.2f})  step {r['step_s']:.2f} s (disk wait "
                  f"{r['disk_wait_s']:.2f}, Adam {r['adam_s']:.2f}, other "
                  f"{r['other_s']:.2f})", flush=True)
    save_s = None
    if args.checkpoint:  # under the same cap: written a tile at a time
        t = time.perf_counter()
        engine.save_checkpoint(args.checkpoint)
        save_s = time.perf_counter() - t
    report = engine.memory_report()
    # the parameters this rank owns, wherever they are (its partitioned chunks, whole groups)
    params_shard = sum(fg.layout.shard_numel * fg.dtype.itemsize if fg.partitioned
                       else fg.nbytes() + fg.nbytes(host=True) for fg in engine.flat_groups)
    out = {"rank": rank, "params": num_params(model) if rank == 0 else None,
           "init_s": init_s, "rows": rows, "memory_report": report, "save_s": save_s,
           "param_shard_bytes": params_shard,
           "optimizer_state_bytes": (swap.file_bytes() if swap else
                                     report["host_optimizer_states"]),
           "swap_host_bytes": swap.host_bytes() if swap else 0,
           "params_on_drive": params is not None,
           "param_cache_hits": [params.stats.hits, params.stats.read_ahead_hits,
                                params.stats.misses] if params else None,
           "tiles": len(swap.tiles) if swap else 0,
           "aio_backend": swap.aio.backend if swap else None,
           "rss_after_init_kb": after_init_kb, "peak_rss_kb": status_kb("VmHWM")}
    engine.close()
    with open(args.out, "w") as f:
        json.dump(out, f)


def _io(*swaps) -> tuple[float, int, int]:
    """(seconds waited, bytes read, bytes written) so far by these swaps (None: absent)."""
    swaps = [s for s in swaps if s is not None]
    return (sum(s.stats.wait_s for s in swaps), sum(s.stats.read_bytes for s in swaps),
            sum(s.stats.write_bytes for s in swaps))


# -- the launcher -------------------------------------------------------------------------------
def make_cgroup(limit_bytes: int) -> tuple[str | None, str]:
    """A memory cgroup limited to ``limit_bytes`` (v1 or v2) if this process may make one:
    (path of its procs file, how the cap is enforced)."""
    name = f"zeroengine_nvme_demo_{os.getpid()}"
    # (hierarchy root, the file that marks it, the limit file, how to say it)
    kinds = [("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.limit_in_bytes",
              "cgroup v1"),
             ("/sys/fs/cgroup", "cgroup.controllers", "memory.max", "cgroup v2")]
    try:
        for root, marker, limit_file, label in kinds:
            if os.path.exists(os.path.join(root, marker)):
                path = os.path.join(root, name)
                os.makedirs(path, exist_ok=True)
                with open(os.path.join(path, limit_file), "w") as f:
                    f.write(str(limit_bytes))
                return path, f"{label} {limit_file}={limit_bytes / GB:.2f} GB for the job"
    except OSError as e:
        return None, f"no cgroup ({e.strerror}): the per-rank peak RSS check only"
    return None, "no memory cgroup here: the per-rank peak RSS check only"


def launch(args, device: str, cgroup: str | None) -> list[dict]:
    port = _free_port()
    procs, outs = [], []
    for rank in range(args.ranks):
        out = os.path.join(args.workdir, f"{device}-rank{rank}.json")
        outs.append(out)
        # glibc serves allocations under its mmap threshold from the heap, and that
        # threshold grows to the largest block freed so far (32 MB on 64-bit): tensors of a
        # few MB freed during a step then stay in the process (RSS) instead of going back to
        # the system. A fixed 1 MB threshold returns them (docs/nvme.md).
        env = dict({"MALLOC_MMAP_THRESHOLD_": "1048576"}, **os.environ)
        env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE=str(args.ranks), LOCAL_WORLD_SIZE=str(args.ranks),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        cmd = [sys.executable, os.path.abspath(__file__), "--rank-of-job", "--device", device,
               "--out", out] + _forward(args)
        if device == "nvme" and not args.no_checkpoint:
            cmd += ["--checkpoint", os.path.join(args.nvme_path, "demo_checkpoint")]

        refused_marker = os.path.join(args.workdir, "cgroup_refused")

        def enter(cg=cgroup, failed=refused_marker):
            if cg:  # before exec: the rank's every byte is charged to the cgroup
                try:
                    with open(os.path.join(cg, "cgroup.procs"), "w") as f:
                        f.write(str(os.getpid()))
                except OSError:  # the RSS check still holds; the summary says so
                    open(failed, "w").close()
        procs.append(subprocess.Popen(cmd, env=env, preexec_fn=enter))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"{device} run failed: exit codes {codes} (-9: killed, e.g. by the "
                         "memory cgroup's OOM killer)")
    return [json.load(open(o)) for o in outs]


def _forward(args) -> list[str]:
    return ["--dim", str(args.dim), "--layers", str(args.layers), "--heads", str(args.heads),
            "--context", str(args.context), "--steps", str(args.steps),
            "--nvme-path", args.nvme_path] + \
        ([] if args.max_in_cpu is None else ["--max-in-cpu", str(args.max_in_cpu)])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fio_mixed(directory: str, ranks: int) -> dict | None:
    """What the drive gives to the demo's traffic pattern: ``ranks`` jobs each reading and
    writing (50/50) 1 MB blocks with O_DIRECT through io_uring, measured by fio on the same
    directory (None where fio is not installed)."""
    if shutil.which("fio") is None:
        return None
    work = os.path.join(directory, "fio_mixed")
    os.makedirs(work, exist_ok=True)
    try:
        proc = subprocess.run(
            ["fio", "--name=mixed", f"--directory={work}", "--rw=rw", "--rwmixread=50",
             "--bs=1m", "--size=2g", f"--numjobs={ranks}", "--direct=1", "--ioengine=io_uring",
             "--iodepth=8", "--group_reporting", "--output-format=json"],
            capture_output=True, text=True, check=True)
        job = json.loads(proc.stdout[proc.stdout.index("{"):])["jobs"][0]
        return {"read_gbps": job["read"]["bw_bytes"] / GB,
                "write_gbps": job["write"]["bw_bytes"] / GB}
    except (subprocess.CalledProcessError, ValueError, KeyError) as e:
        print(f"fio failed ({e}); no drive reference", flush=True)
        return None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def summarize(args, nvme: list[dict], cpu: list[dict] | None, enforced: str,
              fio: dict | None) -> dict:
    cap = args.cap_gb * GB
    r0 = nvme[0]
    states = [r["optimizer_state_bytes"] + r["param_shard_bytes"] for r in nvme]
    peaks = [r["peak_rss_kb"] * 1024 for r in nvme]
    rows = r0["rows"]
    steady = rows[1:] or rows  # the first step also creates the moments
    # each rank's loss is on its own batch: the job's loss is their mean
    losses = [sum(r["rows"][i]["loss"] for r in nvme) / len(nvme) for i in range(len(rows))]

    def median(key):
        values = sorted(r[key] for r in steady)
        return values[len(values) // 2]
    summary = {
        "params": r0["params"], "ranks": args.ranks, "cap_per_rank_gb": args.cap_gb,
        "enforced_by": enforced, "aio_backend": r0["aio_backend"], "tiles": r0["tiles"],
        "model_states_per_rank_gb": [s / GB for s in states],
        "states_over_cap": min(states) / cap,
        "peak_rss_per_rank_gb": [p / GB for p in peaks],
        "under_cap": all(p <= cap for p in peaks),
        "losses": losses,
        "loss_went_down": losses[-1] < losses[0],
        "median_step": {k: median(k) for k in ("compute_s", "step_s", "disk_wait_s", "adam_s",
                                               "other_s", "read_gb", "write_gb",
                                               "param_wait_s", "param_read_gb",
                                               "param_write_gb")},
        "params_on_drive": r0["params_on_drive"],
        "param_cache_hits_ahead_misses": r0["param_cache_hits"],
        "init_s": r0["init_s"], "nvme_rows": rows, "checkpoint_save_s": r0["save_s"],
    }
    m = summary["median_step"]
    moved = sum(sorted(r["read_gb"] + r["write_gb"] for r in rank["rows"][1:] or rank["rows"])[
        len(rank["rows"][1:] or rank["rows"]) // 2] for rank in nvme)
    summary["job_disk_gbps_over_step"] = moved / m["step_s"]  # read + written, all ranks
    summary["fio_mixed"] = fio
    if fio is not None:
        summary["vs_fio_mixed"] = summary["job_disk_gbps_over_step"] / (
            fio["read_gbps"] + fio["write_gbps"])
    if cpu is not None:
        summary["without_nvme_peak_rss_per_rank_gb"] = [r["peak_rss_kb"] * 1024 / GB
                                                        for r in cpu]
        summary["without_nvme_step"] = {k: sorted(r[k] for r in cpu[0]["rows"][1:] or
                                                  cpu[0]["rows"])[0]
                                        for k in ("compute_s", "step_s", "adam_s")}
    return summary


def print_summary(s: dict) -> None:
    print(f"\nGPT {s['params'] / 1e6:.0f}M parameters, {s['ranks']} ranks, stage 3 bf16, "
          f"optimizer {'and parameters ' if s['params_on_drive'] else ''}on NVMe "
          f"({s['aio_backend']}, {s['tiles']} tiles per rank)")
    print(f"cap: {s['cap_per_rank_gb']:.2f} GB per rank ({s['enforced_by']})")
    print("| rank | model states (GB) | states / cap | peak RSS (GB) | under cap |")
    print("|---|---|---|---|---|")
    for r, (st, pk) in enumerate(zip(s["model_states_per_rank_gb"], s["peak_rss_per_rank_gb"])):
        print(f"| {r} | {st:.2f} | {st / s['cap_per_rank_gb']:.2f}x | {pk:.2f} | "
              f"{'yes' if pk <= s['cap_per_rank_gb'] else 'NO'} |")
    m = s["median_step"]
    print(f"\nloss (mean over ranks) {' -> '.join(f'{x:.3f}' for x in s['losses'])}")
    print("\nmedian step after the first (rank 0, s):")
    print("| compute (fwd+bwd) | of which: param reads | optimizer step | of which: disk wait |"
          " CPU Adam | rest | read GB | written GB |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {m['compute_s']:.2f} | {m['param_wait_s']:.2f} ({m['param_read_gb']:.2f} GB) | "
          f"{m['step_s']:.2f} | {m['disk_wait_s']:.2f} | {m['adam_s']:.2f} | "
          f"{m['other_s']:.2f} | {m['read_gb']:.2f} | {m['write_gb']:.2f} |")
    line = (f"\nthe job moved {s['job_disk_gbps_over_step']:.2f} GB/s (read + written, both "
            "ranks) over the optimizer step")
    if s.get("fio_mixed"):
        f = s["fio_mixed"]
        line += (f"; fio, {s['ranks']} jobs of 50/50 sequential read/write on the same "
                 f"directory: {f['read_gbps']:.2f} + {f['write_gbps']:.2f} GB/s -> "
                 f"{s['vs_fio_mixed']:.2f}x fio")
    print(line)
    if s.get("checkpoint_save_s") is not None:
        print(f"checkpoint saved under the cap in {s['checkpoint_save_s']:.1f} s "
              "(a tile at a time)")
    if "without_nvme_peak_rss_per_rank_gb" in s:
        peaks = s["without_nvme_peak_rss_per_rank_gb"]
        w = s["without_nvme_step"]
        listed = ", ".join(f"{p:.2f}" for p in peaks)
        print(f"\nwithout NVMe (offload_optimizer and offload_param cpu, no cap): peak RSS per "
              f"rank {listed} GB = {max(peaks) / s['cap_per_rank_gb']:.2f}x "
              f"the cap; step {w['step_s']:.2f} s (Adam {w['adam_s']:.2f}), compute "
              f"{w['compute_s']:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--cap-gb", type=float, default=1.7, help="peak RSS allowed per rank")
    ap.add_argument("--nvme-path", default=None, help="default: a directory under the repo")
    ap.add_argument("--max-in-cpu", type=int, default=None,
                    help="offload_param.max_in_cpu (default: the config's)")
    ap.add_argument("--no-compare", action="store_true",
                    help="skip the run without NVMe (states in host memory)")
    ap.add_argument("--no-fio", action="store_true", help="skip fio's reference measurement")
    ap.add_argument("--no-checkpoint", action="store_true",
                    help="skip saving a checkpoint at the end (under the cap)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--rank-of-job", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="nvme", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_of_job:
        rank_main(args)
        return
    args.nvme_path = args.nvme_path or os.path.join(ROOT, ".nvme_swap")
    os.makedirs(args.nvme_path, exist_ok=True)
    with tempfile.TemporaryDirectory() as workdir:
        args.workdir = workdir
        cgroup, enforced = make_cgroup(int(args.cap_gb * GB * args.ranks))
        print(f"training under a cap of {args.cap_gb:.2f} GB per rank: {enforced}", flush=True)
        try:
            nvme = launch(args, "nvme", cgroup)
        finally:
            if cgroup:
                os.rmdir(cgroup)
        if os.path.exists(os.path.join(workdir, "cgroup_refused")):
            enforced = "the cgroup refused the ranks: the per-rank peak RSS check only"
        shutil.rmtree(os.path.join(args.nvme_path, "demo_checkpoint"), ignore_errors=True)
        cpu = None
        if not args.no_compare:
            print("the same model without NVMe (model states in host memory), no cap:",
                  flush=True)
            args.steps = 2
            cpu = launch(args, "cpu", None)
    fio = fio_mixed(args.nvme_path, args.ranks) if not args.no_fio else None
    summary = summarize(args, nvme, cpu, enforced, fio)
    print_summary(summary)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    ok = summary["under_cap"] and summary["loss_went_down"]
    if not ok:
        raise SystemExit("FAILED: " + ("peak RSS over the cap" if not summary["under_cap"]
                                       else "the loss did not go down"))


if __name__ == "__main__":
    main()
