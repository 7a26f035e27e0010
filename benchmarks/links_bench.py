"""Two "nodes" on one machine, joined by a real link: cross-node bytes and step time of plain
stage 3, hybrid sharding, ZeRO++ (hpZ, qwZ, qgZ) and FSDP2 (plain and HSDP).

Each node is a network namespace holding 2 ranks (torchrun --nnodes=2 --nproc_per_node=2);
the namespaces are joined by a veth pair, optionally rate-limited with ``tc ... tbf`` to make
it the slow link. Gloo binds the veth's address (GLOO_SOCKET_IFNAME), so the ranks of one node
talk through the kernel's local route and only inter-node traffic crosses the veth: the bytes
per step are read from its interface counters (/proc/net/dev inside each namespace), not from
our own accounting. Needs root (ip netns, tc); cleans up the namespaces on exit.

    sudo python benchmarks/links_bench.py --rates none,1gbit --json benchmarks/results_links.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NS = ("zelink0", "zelink1")
IFS = ("zev0", "zev1")
ADDRS = ("10.231.0.1", "10.231.0.2")
RANKS_PER_NODE = 2
OURS_ZERO_ENV = "ZEROENGINE_LINKS_ZERO"  # --ours-zero, on its way to the ranks

# variant -> (engine, zero_optimization overrides). "fsdp2" shards over all 4 ranks; "hsdp"
# over each node, replicated across the two (FSDP2 with a 2-D DeviceMesh).
VARIANTS = {
    "ze3": ("ours", {}),
    "ze3-hybrid": ("ours", {"mics_shard_size": "auto"}),
    "ze3-hpz": ("ours", {"zero_hpz_partition_size": "auto"}),
    "ze3-qwz": ("ours", {"zero_quantized_weights": True}),
    "ze3-qwz-qgz": ("ours", {"zero_quantized_weights": True, "zero_quantized_gradients": True}),
    "ze3-hpz-qwz": ("ours", {"zero_hpz_partition_size": "auto",
                             "zero_quantized_weights": True}),
    "ze3-zeropp": ("ours", {"zero_hpz_partition_size": "auto", "zero_quantized_weights": True,
                            "zero_quantized_gradients": True}),
    "ze1": ("ours", {"stage": 1}),
    "ze2": ("ours", {"stage": 2}),
    "ze2-hybrid": ("ours", {"stage": 2, "mics_shard_size": "auto"}),
    "ze2-qgz": ("ours", {"stage": 2, "zero_quantized_gradients": True}),
    "fsdp2": ("fsdp2", None),
    "fsdp2-hsdp": ("hsdp", None),
}


# -- inside a rank ---------------------------------------------------------------------------
def link_bytes(interface: str) -> tuple[int, int]:
    """(received, transmitted) bytes of ``interface`` in this network namespace."""
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == interface:
                fields = rest.split()
                return int(fields[0]), int(fields[8])
    raise RuntimeError(f"no interface {interface} here")


def build(variant: str, precision: str, size: str, micro: int):
    import torch
    from compare import LR, SIZES, plain_step

    from zeroengine.examples.gpt import GPT
    kind, zero = VARIANTS[variant]
    cfg = SIZES[size]
    bf16 = precision == "bf16"
    torch.manual_seed(0)
    if kind == "ours":
        import zeroengine
        config = {"train_micro_batch_size_per_gpu": micro, "bf16": {"enabled": bf16},
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                        **zero,
                                        **json.loads(os.environ.get(OURS_ZERO_ENV, "{}"))}}
        model = GPT(cfg)
        engine = zeroengine.initialize(model, config,
                                       optimizer=torch.optim.AdamW(model.parameters(), **LR))

        def step(tokens, targets):
            loss = model.loss(tokens, targets)
            engine.backward(loss)
            engine.step()
            return loss
        step.report = engine.comm_report
        return step, cfg
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // RANKS_PER_NODE, RANKS_PER_NODE),
                            mesh_dim_names=("replicate", "shard")) if kind == "hsdp" \
        else init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if bf16 else MixedPrecisionPolicy()
    model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    step = plain_step(model, torch.optim.AdamW(model.parameters(), **LR))
    step.report = lambda reset=True: {}
    return step, cfg


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import zeroengine
    zeroengine.init_distributed()
    rank = dist.get_rank()
    step, cfg = build(args.variant, args.precision, args.size, args.micro)
    gen = torch.Generator().manual_seed(100 + rank)
    times, losses = [], []
    interface = os.environ["ZE_LINK_IF"]
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            dist.barrier()
            step.report(reset=True)
            rx0, tx0 = link_bytes(interface)
        window = torch.randint(0, cfg.vocab, (args.micro, cfg.context + 1), generator=gen)
        start = time.perf_counter()
        losses.append(step(window[:, :-1], window[:, 1:]).item())
        times.append(time.perf_counter() - start)
    dist.barrier()
    rx1, tx1 = link_bytes(interface)
    report = step.report(reset=True)
    if int(os.environ["LOCAL_RANK"]) == 0:
        with open(os.path.join(args.out, f"node{rank // RANKS_PER_NODE}.json"), "w") as f:
            json.dump({"step_s": statistics.median(times[args.warmup:]),
                       "link_tx_per_step": (tx1 - tx0) / args.steps,
                       "link_rx_per_step": (rx1 - rx0) / args.steps,
                       "comm_report_per_step": {k: {n: v / args.steps for n, v in c.items()}
                                                for k, c in report.items()},
                       "losses": losses}, f)
    dist.destroy_process_group()


# -- the orchestrator (root) -----------------------------------------------------------------------
def sh(*cmd: str, check: bool = True) -> str:
    return subprocess.run(cmd, check=check, capture_output=True, text=True).stdout


@contextlib.contextmanager
def two_nodes(rate: str | None):
    teardown()
    try:
        for ns in NS:
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "link", "add", IFS[0], "netns", NS[0], "type", "veth", "peer", "name", IFS[1],
           "netns", NS[1])
        for ns, dev, addr in zip(NS, IFS, ADDRS):
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            if rate:
                # token bucket: `rate` sustained, 256 kB bursts, packets queue up to 100 ms
                sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                   "rate", rate, "burst", "256kb", "latency", "100ms")
        yield
    finally:
        teardown()


def teardown() -> None:
    for ns in NS:
        sh("ip", "netns", "del", ns, check=False)


def run_variant(variant: str, args, port: int) -> dict:
    out = tempfile.mkdtemp(prefix="links_")
    procs = []
    for node, (ns, dev) in enumerate(zip(NS, IFS)):
        env = dict(os.environ, GLOO_SOCKET_IFNAME=dev, ZE_LINK_IF=dev, OMP_NUM_THREADS="1",
                   **{OURS_ZERO_ENV: args.ours_zero},
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run",
               "--nnodes=2", f"--node_rank={node}", f"--nproc_per_node={RANKS_PER_NODE}",
               f"--master_addr={ADDRS[0]}", f"--master_port={port}",
               os.path.abspath(__file__), "--worker", "--variant", variant,
               "--precision", args.precision, "--size", args.size, "--micro", str(args.micro),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", out]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{variant} failed:\n" + "\n".join(log[-3000:] for log in logs))
    nodes = [json.load(open(os.path.join(out, f"node{n}.json"))) for n in range(2)]
    return {"step_s": max(n["step_s"] for n in nodes),
            # every byte that crossed: what each node sent over its end of the link
            "cross_bytes_per_step": sum(n["link_tx_per_step"] for n in nodes),
            "comm_report_per_step": nodes[0]["comm_report_per_step"],
            "first_loss": nodes[0]["losses"][0], "last_loss": nodes[0]["losses"][-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="ze3")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rates", default="none,1gbit", help="comma list: none or a tc rate")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--size", default="small")
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--ours-zero", default="{}", help="JSON merged into our variants' "
                    "zero_optimization, e.g. '{\"stage3_check_gather_order\": false}'")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if os.geteuid() != 0:
        sys.exit("links_bench: needs root (ip netns, tc)")
    results = []
    port = 29600
    for rate in args.rates.split(","):
        with two_nodes(None if rate == "none" else rate):
            runs: dict[str, list[dict]] = {}
            for repeat in range(args.repeats):  # interleaved: each repeat runs every variant
                for variant in args.variants.split(","):
                    port += 1
                    r = run_variant(variant, args, port)
                    runs.setdefault(variant, []).append(r)
                    print(f"{rate:>6} {variant:<13} {args.precision} repeat {repeat + 1}: "
                          f"{r['step_s']:.3f} s/step, {r['cross_bytes_per_step'] / 1e6:.2f} MB "
                          "across per step", flush=True)
            for variant, rs in runs.items():
                results.append({"rate": rate, "variant": variant, "precision": args.precision,
                                "step_s": statistics.median(r["step_s"] for r in rs),
                                "cross_bytes_per_step": statistics.median(
                                    r["cross_bytes_per_step"] for r in rs),
                                "runs": rs})
    print_table(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


def print_table(results: list[dict], args) -> None:
    print(f"\nGPT {args.size}, 2 nodes x 2 ranks (network namespaces + veth), {args.precision}, "
          f"median of {args.repeats} x {args.steps} steps\n")
    print("| link | variant | step (s) | vs ze3 | cross-node MB/step | vs ze3 |")
    print("|---|---|---|---|---|---|")
    for r in results:
        base = next(b for b in results if b["rate"] == r["rate"] and b["variant"] == "ze3") \
            if any(b["variant"] == "ze3" for b in results) else r
        print(f"| {r['rate']} | {r['variant']} | {r['step_s']:.3f} | "
              f"{r['step_s'] / base['step_s']:.2f}x | {r['cross_bytes_per_step'] / 1e6:.2f} | "
              f"{r['cross_bytes_per_step'] / max(base['cross_bytes_per_step'], 1):.2f}x |")


if __name__ == "__main__":
    main()
