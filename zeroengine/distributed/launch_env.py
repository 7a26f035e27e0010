"""Read rank, world size and rendezvous address from whatever launcher started us (pure: no
torch.distributed here, so it is tested with plain dicts).

Recognised, in this order: torchrun / Kubernetes PyTorchJob (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), SLURM (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_JOB_NODELIST),
OpenMPI (OMPI_COMM_WORLD_*). Nothing set means a single process.

A PyTorchJob pod that runs several processes (``nprocPerNode`` > 1) sets ``RANK`` to the *pod*
index and ``PET_NPROC_PER_NODE``/``PET_NNODES``/``PET_NODE_RANK`` for torchrun to read: a process
started there without torchrun would take the pod index for its rank, so that case is refused and
``pytorchjob_torchrun_args`` gives the torchrun arguments instead.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class LaunchEnv:
    launcher: str  # "torchrun", "slurm", "mpi", "none", or "existing" (a group already built)
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    restart_count: int | None = None  # torchelastic restart number, when under torchrun's agent


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list: 'gpu[03-05,9],cpu1' -> 'gpu03'."""
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ValueError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}")
    prefix, _, ranges = match.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ValueError(f"environment variable {key}={env[key]!r} is not an integer") from None


def _under_torchrun(env: Mapping[str, str]) -> bool:
    # torchrun's agent sets these for every worker; a pod's own environment never has them.
    return "TORCHELASTIC_RUN_ID" in env or "LOCAL_RANK" in env


def pytorchjob_procs_per_pod(env: Mapping[str, str]) -> int | None:
    """Processes per pod a Kubernetes PyTorchJob asked for, when it asked for several and this
    process is the pod's own (not yet a torchrun worker); None otherwise."""
    value = env.get("PET_NPROC_PER_NODE")
    if value is None or _under_torchrun(env):
        return None
    if value == "auto":
        return -1  # torchrun resolves "auto" from the devices it sees
    n = _int(env, "PET_NPROC_PER_NODE")
    return n if n > 1 else None


def pytorchjob_torchrun_args(env: Mapping[str, str]) -> list[str]:
    """torchrun arguments that start this pod's share of a multi-process PyTorchJob."""
    nproc = env["PET_NPROC_PER_NODE"]
    addr = env.get("PET_MASTER_ADDR", env.get("MASTER_ADDR"))
    port = env.get("PET_MASTER_PORT", env.get("MASTER_PORT", str(DEFAULT_PORT)))
    if addr is None:
        raise ValueError("PyTorchJob pod without PET_MASTER_ADDR or MASTER_ADDR: cannot find "
                         "the master pod")
    nnodes = env.get("PET_NNODES", env.get("WORLD_SIZE", "1"))
    node_rank = env.get("PET_NODE_RANK", env.get("RANK", "0"))
    return [f"--nnodes={nnodes}", f"--node_rank={node_rank}", f"--nproc_per_node={nproc}",
            f"--master_addr={addr}", f"--master_port={port}"]


def read_launch_env(env: Mapping[str, str]) -> LaunchEnv:
    procs = pytorchjob_procs_per_pod(env)
    if procs is not None:
        raise ValueError(
            f"this Kubernetes PyTorchJob runs {env['PET_NPROC_PER_NODE']} processes per pod, so "
            f"RANK={env.get('RANK', '?')} is the pod's index, not this process's rank: start "
            "the container with torchrun (it reads the PET_* variables), or with "
            "`zeroengine train CONFIG`, which does that itself")
    if "RANK" in env and "WORLD_SIZE" in env:
        restart = env.get("TORCHELASTIC_RESTART_COUNT")
        use_agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
        world = _int(env, "WORLD_SIZE")
        if missing and world > 1:
            raise ValueError(f"RANK and WORLD_SIZE are set but {', '.join(missing)} is not: "
                             "set the rendezvous address of rank 0 (torchrun sets all four)")
        return LaunchEnv("torchrun", _int(env, "RANK"), world,
                         _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
                         env.get("MASTER_ADDR", "127.0.0.1"),
                         _int(env, "MASTER_PORT") if "MASTER_PORT" in env else DEFAULT_PORT,
                         int(restart) if restart is not None and use_agent_store else None)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        addr = env.get("MASTER_ADDR")
        if addr is None:
            if "SLURM_JOB_NODELIST" not in env:
                raise ValueError("under SLURM without MASTER_ADDR, SLURM_JOB_NODELIST is needed "
                                 "to find rank 0's host")
            addr = first_slurm_host(env["SLURM_JOB_NODELIST"])
        # A port derived from the job id keeps two jobs on one node from colliding.
        port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else (
            DEFAULT_PORT + int(env.get("SLURM_JOB_ID", "0")) % 1000)
        return LaunchEnv("slurm", _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS"),
                         _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0, addr, port)
    if "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        world = _int(env, "OMPI_COMM_WORLD_SIZE")
        local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE") if \
            "OMPI_COMM_WORLD_LOCAL_SIZE" in env else world
        addr = env.get("MASTER_ADDR")
        if addr is None:
            if local_size != world:
                raise ValueError("OpenMPI across several nodes gives no rendezvous address: "
                                 "export MASTER_ADDR (rank 0's host) to every rank, e.g. "
                                 "mpirun -x MASTER_ADDR=<host> -x MASTER_PORT=29500")
            addr = "127.0.0.1"
        return LaunchEnv("mpi", _int(env, "OMPI_COMM_WORLD_RANK"), world,
                         _int(env, "OMPI_COMM_WORLD_LOCAL_RANK") if
                         "OMPI_COMM_WORLD_LOCAL_RANK" in env else 0,
                         addr, _int(env, "MASTER_PORT") if "MASTER_PORT" in env else DEFAULT_PORT)
    return LaunchEnv("none", 0, 1, 0, "127.0.0.1", DEFAULT_PORT)
