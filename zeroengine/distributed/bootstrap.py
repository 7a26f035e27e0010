"""Joining and leaving the process group: ``init_distributed`` builds the group the launcher's
environment describes (torchrun, SLURM, MPI, PyTorchJob; launch_env.py reads them), and the
group we built is taken down at exit with every rank still connected."""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from . import stop_report
from .launch_env import LaunchEnv, read_launch_env


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(timeout_s: float | None = None) -> LaunchEnv:
    """Join the process group described by the launcher's environment variables.

    A no-op when a default group already exists (Ray Train, a user who called
    ``init_process_group`` first). With no launcher variables at all this is a single process and
    no group is created: every collective is then a local no-op.
    """
    if dist.is_available() and dist.is_initialized():
        # The group's own rank and size are the truth here; the environment may describe a
        # launcher the group was not built from (Ray's workers, a notebook).
        local = os.environ.get("LOCAL_RANK", "0")
        return LaunchEnv("existing", dist.get_rank(), dist.get_world_size(),
                         int(local) if local.isdigit() else 0,
                         os.environ.get("MASTER_ADDR", "127.0.0.1"),
                         int(port) if (port := os.environ.get("MASTER_PORT", "")).isdigit()
                         else 0)
    env = read_launch_env(os.environ)
    if env.launcher == "none":
        return env
    stop_report.install(env.rank)  # a rank its launcher stops says so in its log
    backend = default_backend()
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank)
    elif "GLOO_SOCKET_IFNAME" not in os.environ:
        from .netif import interface_towards
        interface = interface_towards(env.master_addr)
        if interface is not None:
            # else gloo binds what the hostname resolves to, which peers may not reach
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    kwargs = {}
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    _destroy_group_at_exit()
    if env.restart_count is not None:
        # After a torchrun restart, a group built from env:// reuses the old rendezvous keys and
        # gloo dials dead workers (pytorch issues 135712, 167288). A per-restart key prefix on
        # the agent's store gives every incarnation a clean namespace.
        store = dist.TCPStore(env.master_addr, env.master_port, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s or 300))
        store = dist.PrefixStore(f"restart{env.restart_count}", store)
        dist.init_process_group(backend, store=store, rank=env.rank,
                                world_size=env.world_size, **kwargs)
    else:
        os.environ.setdefault("MASTER_ADDR", env.master_addr)
        os.environ.setdefault("MASTER_PORT", str(env.master_port))
        dist.init_process_group(backend, init_method="env://", rank=env.rank,
                                world_size=env.world_size, **kwargs)
    return env


def _destroy_group_at_exit() -> None:
    """The group we build, we take down at interpreter exit: a gloo group left to the C++
    static destructors can abort the process ("terminate called without an active exception")
    after the job itself succeeded, which a launcher then reports as a failed rank. The ranks
    meet first (as shutdown_distributed does): one that tears its group down while a faster
    peer has already closed its sockets aborts the same way (seen with scripts that end
    without destroying the group, tests/test_ds_scripts.py). A peer that never arrives (it
    crashed; its launcher stops the rest anyway) costs at most 30 s here, and a rank leaving
    on an uncaught exception does not wait for the others at all."""
    import atexit
    import sys

    def destroy():
        if not dist.is_initialized():
            return
        failed = getattr(sys, "last_type", None) is not None  # set for an uncaught exception
        try:
            if dist.get_world_size() > 1 and not failed:
                if dist.get_backend() == "gloo":
                    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
                else:
                    dist.barrier()
        except Exception:  # noqa: BLE001 - exiting anyway; the group still goes
            pass
        dist.destroy_process_group()
    atexit.register(destroy)


def shutdown_distributed(comm) -> None:
    """End of a job that joined the group itself: every rank reaches this point, then the group
    is taken down while all peers are still connected. A rank whose peers closed their sockets
    while it was still tearing its gloo group down can abort ("terminate called without an
    active exception") after the job itself succeeded."""
    if dist.is_available() and dist.is_initialized():
        comm.barrier(what="the end of the job")
        dist.destroy_process_group()


def process_rank_and_world() -> tuple[int, int]:
    """The default group's rank and size; (0, 1) where no group exists."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def destroy_group() -> None:
    """Take the default group down now, if there is one (a test harness between jobs)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
