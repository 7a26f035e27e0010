"""``zeroengine launch``: the ``deepspeed`` command's common flags, onto torchrun.

    zeroengine launch --num_gpus 2 train.py --deepspeed_config ds.json      # one node
    zeroengine launch --hostfile hosts --master_addr node0 train.py ...     # on every node

Each process runs the script as DeepSpeed's launcher runs it: ``python script.py
--local_rank=<n> <script args>`` (``--no_local_rank`` leaves the argument out; ``--module``
runs a module, ``--no_python`` a program) with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT set by torchrun.

Several nodes: DeepSpeed's default launcher logs into every host of the hostfile with pdsh;
this one does not log in anywhere. Run the same command on each node - by hand, with srun,
mpirun or pdsh - and each finds its own node rank from its position in the hostfile (or give
``--node_rank``), as torchrun's static rendezvous does. ``--include`` / ``--exclude``
(``host1:0,1@host2``) select hosts and, on CUDA, devices (CUDA_VISIBLE_DEVICES).
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

from ..errors import LaunchError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zeroengine launch", description=__doc__.split("\n")[0],
                                allow_abbrev=False)
    p.add_argument("--num_gpus", "--num_accelerators", type=int, default=-1, dest="num_gpus",
                   help="processes per node (default: the visible GPUs, or 1 on a CPU node)")
    p.add_argument("--num_nodes", type=int, default=-1, help="nodes (default: the hostfile's, "
                   "else 1)")
    p.add_argument("--node_rank", type=int, default=-1, help="this node's rank (default: its "
                   "position in the hostfile, else 0)")
    p.add_argument("-H", "--hostfile", default="/job/hostfile", help="lines 'host slots=N'")
    p.add_argument("-i", "--include", default="", help="hosts and devices to use, "
                   "'host1:0,1@host2'")
    p.add_argument("-e", "--exclude", default="", help="hosts and devices to leave out")
    p.add_argument("--master_addr", default="", help="node 0's address (default: the first "
                   "host, or 127.0.0.1 on one node)")
    p.add_argument("--master_port", type=int, default=29500)
    p.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank")
    p.add_argument("--module", action="store_true", help="run the script as a module "
                   "(python -m)")
    p.add_argument("--no_python", action="store_true", help="run the script as a program")
    p.add_argument("--launcher", default="pdsh", help="DeepSpeed's multi-node launcher: "
                   "accepted; every node runs this command itself")
    p.add_argument("--force_multi", action="store_true")
    p.add_argument("user_script")
    p.add_argument("user_args", nargs=argparse.REMAINDER)
    return p


def read_hostfile(path: str) -> dict[str, int]:
    """{host: slots} from DeepSpeed's hostfile format ('worker-0 slots=4'; # comments)."""
    hosts: dict[str, int] = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            slots = [p for p in parts[1:] if p.startswith("slots=")]
            if len(parts) > 2 or (len(parts) == 2 and not slots) or \
                    (slots and not slots[0][6:].isdigit()):
                raise LaunchError(f"--hostfile {path} line {number}: {line!r} is not "
                                  "'<host> slots=<n>'")
            if parts[0] in hosts:
                raise LaunchError(f"--hostfile {path} line {number}: host {parts[0]} twice")
            hosts[parts[0]] = int(slots[0][6:]) if slots else 1
    return hosts


def parse_filter(text: str, flag: str) -> dict[str, list[int] | None]:
    """'host1:0,1@host2' -> {host1: [0, 1], host2: None (all)}."""
    out: dict[str, list[int] | None] = {}
    for item in filter(None, text.split("@")):
        host, _, slots = item.partition(":")
        try:
            out[host] = [int(s) for s in slots.split(",")] if slots else None
        except ValueError:
            raise LaunchError(f"--{flag} {text!r}: device ids after ':' must be integers "
                              "('host:0,1@host2')") from None
    return out


def resources(hosts: dict[str, int], include: str, exclude: str) -> dict[str, list[int]]:
    """Each host's device ids after --include / --exclude (DeepSpeed's semantics)."""
    if include and exclude:
        raise LaunchError("--include and --exclude together: give one of them")
    pool = {h: list(range(n)) for h, n in hosts.items()}
    if include:
        chosen = {}
        for host, slots in parse_filter(include, "include").items():
            if host not in pool:
                raise LaunchError(f"--include names host {host!r}, which is not in the "
                                  f"hostfile ({', '.join(pool)})")
            bad = [s for s in (slots or []) if s not in pool[host]]
            if bad:
                raise LaunchError(f"--include {host}:{bad} : {host} has devices {pool[host]}")
            chosen[host] = slots if slots is not None else pool[host]
        return chosen
    for host, slots in parse_filter(exclude, "exclude").items():
        if host not in pool:
            raise LaunchError(f"--exclude names host {host!r}, which is not in the hostfile")
        if slots is None:
            del pool[host]
        else:
            pool[host] = [s for s in pool[host] if s not in slots]
    return {h: s for h, s in pool.items() if s}


def _local_devices() -> int:
    try:
        import torch
        return torch.cuda.device_count() or 1
    except ImportError:
        return 1


def _this_host(hosts) -> str | None:
    names = {socket.gethostname(), socket.getfqdn(), "localhost", "127.0.0.1"}
    try:
        names.add(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    matches = [h for h in hosts if h in names]
    return matches[0] if len(matches) == 1 else None


def plan(args) -> tuple[list[str], dict[str, str]]:
    """(the torchrun arguments, extra environment) for ``args``."""
    env: dict[str, str] = {}
    if os.path.exists(args.hostfile):
        pool = resources(read_hostfile(args.hostfile), args.include, args.exclude)
        hosts = list(pool)
        if args.num_nodes > 0:
            hosts = hosts[:args.num_nodes]
        node_rank = args.node_rank
        if node_rank < 0:
            me = _this_host(hosts) if len(hosts) > 1 else hosts[0]
            if me is None:
                raise LaunchError(f"this host ({socket.gethostname()}) is not one of the "
                                  f"hostfile's {hosts}: give --node_rank")
            node_rank = hosts.index(me)
        devices = pool[hosts[node_rank]]
        nproc = args.num_gpus if args.num_gpus > 0 else len(devices)
        nnodes = len(hosts)
        master = args.master_addr or (hosts[0] if nnodes > 1 else "127.0.0.1")
        if args.include or args.exclude:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices[:nproc])
    else:
        if args.include or args.exclude:
            local = {"localhost": _local_devices()}
            devices = resources(local, args.include.replace("127.0.0.1", "localhost"),
                                args.exclude.replace("127.0.0.1", "localhost"))
            if "localhost" not in devices:
                raise LaunchError("--include/--exclude without a hostfile name 'localhost'")
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices["localhost"])
            default = len(devices["localhost"])
        else:
            default = _local_devices()
        nproc = args.num_gpus if args.num_gpus > 0 else default
        nnodes = args.num_nodes if args.num_nodes > 0 else 1
        node_rank = max(args.node_rank, 0)
        if nnodes > 1 and not args.master_addr:
            raise LaunchError(f"--num_nodes {nnodes} without a hostfile: give --master_addr "
                              "(node 0's address) and --node_rank on each node")
        master = args.master_addr or "127.0.0.1"
    if not 0 <= node_rank < nnodes:
        raise LaunchError(f"--node_rank {node_rank} with {nnodes} node(s)")
    torchrun = [f"--nnodes={nnodes}", f"--node_rank={node_rank}", f"--nproc_per_node={nproc}",
                f"--master_addr={master}", f"--master_port={args.master_port}"]
    return torchrun, env


def entry_args(args) -> list[str]:
    """What each torchrun process runs: this module's ``worker`` with the script and options."""
    how = "module" if args.module else "program" if args.no_python else "script"
    return ["-m", "zeroengine.tools.launch", "--worker", how,
            "0" if args.no_local_rank else "1", args.user_script, *args.user_args]


def launch(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.module and args.no_python:
        raise LaunchError("--module and --no_python together: give one")
    torchrun, extra = plan(args)
    env = {**os.environ, **extra}
    cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun, *entry_args(args)]
    return subprocess.call(cmd, env=env)


def worker(how: str, pass_local_rank: bool, script: str, script_args: list[str]) -> None:
    """One torchrun process: run the user's script as DeepSpeed's launcher would."""
    import runpy
    local = [f"--local_rank={os.environ.get('LOCAL_RANK', '0')}"] if pass_local_rank else []
    argv = [script, *local, *script_args]
    if how == "program":
        os.execvp(script, argv)
    sys.argv = argv
    if how == "module":
        runpy.run_module(script, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3] == "1", sys.argv[4], sys.argv[5:])
    else:
        sys.exit(launch(sys.argv[1:]))
