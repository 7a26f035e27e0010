"""Rank, world size and rendezvous address from each launcher's environment variables."""
from __future__ import annotations

import pytest

from zeroengine.distributed.launch_env import (
    first_slurm_host,
    pytorchjob_procs_per_pod,
    pytorchjob_torchrun_args,
    read_launch_env,
)


def test_torchrun_and_pytorchjob():
    env = read_launch_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert (env.launcher, env.rank, env.world_size, env.local_rank) == ("torchrun", 3, 4, 1)
    assert (env.master_addr, env.master_port, env.restart_count) == ("10.0.0.1", 1234, None)


def test_torchrun_restart_count_only_with_agent_store():
    base = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1",
            "TORCHELASTIC_RESTART_COUNT": "2"}
    assert read_launch_env(base).restart_count is None
    assert read_launch_env({**base, "TORCHELASTIC_USE_AGENT_STORE": "True"}).restart_count == 2


def test_missing_master_addr_is_named():
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        read_launch_env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"})


def test_slurm():
    env = read_launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                           "SLURM_JOB_NODELIST": "gpu[03-05,9],cpu1", "SLURM_JOB_ID": "4242"})
    assert (env.launcher, env.rank, env.world_size, env.local_rank) == ("slurm", 5, 8, 1)
    assert env.master_addr == "gpu03" and env.master_port == 29500 + 242


@pytest.mark.parametrize("nodelist,first", [("node1", "node1"), ("a[1-3]", "a1"),
                                            ("x[007,9]", "x007"), ("n1,n2", "n1")])
def test_slurm_nodelist(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_openmpi_single_node_and_multi_node():
    env = read_launch_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert (env.launcher, env.rank, env.world_size, env.master_addr) == ("mpi", 1, 2,
                                                                          "127.0.0.1")
    with pytest.raises(ValueError, match="export MASTER_ADDR"):
        read_launch_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
                         "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})


def test_nothing_set_is_a_single_process():
    env = read_launch_env({})
    assert (env.launcher, env.rank, env.world_size) == ("none", 0, 1)


def test_non_integer_is_named():
    with pytest.raises(ValueError, match="WORLD_SIZE='two'"):
        read_launch_env({"RANK": "0", "WORLD_SIZE": "two"})


KUBEFLOW_POD = {"RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "job-master-0",
                "MASTER_PORT": "23456", "PET_NPROC_PER_NODE": "4", "PET_NNODES": "2",
                "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "job-master-0",
                "PET_MASTER_PORT": "23456"}


def test_pytorchjob_pod_with_several_processes_is_not_taken_as_one_rank():
    """Kubeflow sets RANK to the pod index when a pod runs several processes: read as a rank it
    would give two processes rank 1. Refused, naming the fix."""
    with pytest.raises(ValueError, match="RANK=1 is the pod's index.*torchrun"):
        read_launch_env(KUBEFLOW_POD)


def test_pytorchjob_pod_torchrun_arguments():
    assert pytorchjob_procs_per_pod(KUBEFLOW_POD) == 4
    assert pytorchjob_torchrun_args(KUBEFLOW_POD) == [
        "--nnodes=2", "--node_rank=1", "--nproc_per_node=4", "--master_addr=job-master-0",
        "--master_port=23456"]


def test_pytorchjob_worker_under_torchrun_reads_torchruns_rank():
    """Once torchrun has started the pod's processes, RANK is the global rank again."""
    worker = {**KUBEFLOW_POD, "RANK": "6", "LOCAL_RANK": "2", "TORCHELASTIC_RUN_ID": "x"}
    assert pytorchjob_procs_per_pod(worker) is None
    env = read_launch_env(worker)
    assert (env.launcher, env.rank, env.world_size, env.local_rank) == ("torchrun", 6, 8, 2)


def test_pytorchjob_one_process_per_pod_uses_rank_as_is():
    env = read_launch_env({**KUBEFLOW_POD, "PET_NPROC_PER_NODE": "1", "WORLD_SIZE": "2"})
    assert (env.rank, env.world_size, env.master_addr) == (1, 2, "job-master-0")


def test_interface_towards_a_host():
    """Loopback and unresolvable hosts name no interface; a routable one names the interface
    that carries this machine's address on that route."""
    from zeroengine.distributed.netif import interface_towards, ipv4_of
    assert interface_towards("127.0.0.1") is None and interface_towards("no-such-host.invalid") \
        is None
    assert ipv4_of("lo") == "127.0.0.1"
    name = interface_towards("10.255.255.1")
    if name is not None:  # a machine with no route at all has no answer, which is correct
        assert ipv4_of(name) not in (None, "127.0.0.1")
