"""The same training script (tests/resume_job.py) runs unchanged under each launcher users
have, and ends where plain single-process training ends: torchrun across two "nodes" (two Linux
network namespaces joined by a veth pair, static and c10d rendezvous), and plain processes given
the environment SLURM's srun, OpenMPI's mpirun or a Kubernetes PyTorchJob pod would give them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest
import torch
from harness import max_relative_error, reference_train

from zeroengine.testing import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "resume_job.py")
STEPS = 4
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
               "GLOO_SOCKET_IFNAME")


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS
           and not k.startswith(("SLURM_", "OMPI_", "PET_", "TORCHELASTIC_"))}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def check_result(out) -> None:
    result = torch.load(out, weights_only=True)
    err, where = max_relative_error(result["state"], reference_train("adamw", 2, STEPS, 1, 0.0))
    assert err < 1e-5, (err, where)


def run_all(commands, timeout=180) -> None:
    """Start every (argv, env) at once, as a launcher would; all must exit 0."""
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for argv, env in commands]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            p.kill()
    for p, text in zip(procs, outputs):
        assert p.returncode == 0, text[-4000:]


# -- two nodes ------------------------------------------------------------------------------------
@pytest.fixture
def two_namespaces():
    """Two network namespaces ("nodes") joined by a veth pair: 10.231.0.1 and 10.231.0.2."""
    tag = uuid.uuid4().hex[:6]
    ns, dev = [f"ze{tag}{i}" for i in "ab"], [f"zv{tag}{i}" for i in "ab"]
    steps = [["ip", "netns", "add", ns[0]], ["ip", "netns", "add", ns[1]],
             ["ip", "link", "add", dev[0], "type", "veth", "peer", "name", dev[1]]]
    for i in (0, 1):
        steps += [["ip", "link", "set", dev[i], "netns", ns[i]],
                  ["ip", "-n", ns[i], "addr", "add", f"10.231.0.{i + 1}/24", "dev", dev[i]],
                  ["ip", "-n", ns[i], "link", "set", "lo", "up"],
                  ["ip", "-n", ns[i], "link", "set", dev[i], "up"]]
    try:
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True)
            if done.returncode != 0:
                if step == steps[0]:
                    pytest.skip(f"`ip netns` is not permitted here ({done.stderr.strip()}): "
                                "the two-node test needs root and iproute2")
                raise RuntimeError(f"{' '.join(step)}: {done.stderr}")
        yield ns
    finally:
        for name in ns:  # deleting a namespace deletes the veth end inside it
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_torchrun_across_two_nodes(two_namespaces, tmp_path, rendezvous):
    """No GLOO_SOCKET_IFNAME is given: init_distributed picks the interface towards the master
    (plain torch binds what the hostname resolves to here and hangs)."""
    port, out = free_port(), tmp_path / "out.pt"
    commands = []
    for node, ns in enumerate(two_namespaces):
        if rendezvous == "static":
            launch = [f"--node_rank={node}", "--master_addr=10.231.0.1", f"--master_port={port}"]
        else:
            launch = ["--rdzv-backend=c10d", f"--rdzv-endpoint=10.231.0.1:{port}",
                      "--rdzv-id=two-node", f"--rdzv-conf=is_host={1 - node}",
                      f"--local-addr=10.231.0.{node + 1}"]
        commands.append((["ip", "netns", "exec", ns, sys.executable, "-m",
                          "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", *launch,
                          JOB, str(tmp_path / "ckpt"), str(out), str(STEPS), "-1"],
                         clean_env()))
    run_all(commands)
    check_result(out)


# -- launcher environments, one process per rank -----------------------------------------------
def test_slurm_srun_environment(tmp_path):
    port, out = free_port(), tmp_path / "out.pt"
    run_all([([sys.executable, JOB, str(tmp_path / "ckpt"), str(out), str(STEPS), "-1"],
              clean_env(SLURM_PROCID=str(r), SLURM_LOCALID=str(r), SLURM_NTASKS="2",
                        SLURM_NODEID="0", SLURM_JOB_NODELIST="localhost",
                        SLURM_JOB_ID="77", MASTER_PORT=str(port))) for r in (0, 1)])
    check_result(out)


def test_openmpi_mpirun_environment(tmp_path):
    port, out = free_port(), tmp_path / "out.pt"
    run_all([([sys.executable, JOB, str(tmp_path / "ckpt"), str(out), str(STEPS), "-1"],
              clean_env(OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_LOCAL_RANK=str(r),
                        OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_SIZE="2",
                        MASTER_PORT=str(port))) for r in (0, 1)])
    check_result(out)


def test_pytorchjob_pod_with_two_processes_runs_the_job(tmp_path):
    """A one-pod PyTorchJob with nprocPerNode 2: RANK is the pod index (0), so `zeroengine
    train` starts the pod's two ranks through torchrun from the PET_* variables."""
    from harness import TINY_JOB
    port = free_port()
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({**TINY_JOB, "job": {**TINY_JOB["job"], "steps": 2}}))
    env = clean_env(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                    PET_NPROC_PER_NODE="2", PET_NNODES="1", PET_NODE_RANK="0",
                    PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=str(port))
    run_all([([sys.executable, "-m", "zeroengine", "train", str(config), "--runs-dir",
               str(tmp_path / "runs")], env)])
    rows = [json.loads(line) for line in open(tmp_path / "runs" / "tiny" / "metrics.jsonl")]
    assert [len(r["model_state_mb_per_rank"]) for r in rows] == [2, 2]
