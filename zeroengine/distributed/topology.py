"""Which ranks share one copy of the model states: plain or hybrid sharding.

Plain ZeRO shards every model state over all N ranks, so every gradient reduce-scatter and
every stage-3 parameter all-gather spans the whole job, inter-node links included. Hybrid
sharding (DeepSpeed's MiCS, FSDP's HYBRID_SHARD / HSDP) shards over groups of K ranks (one
node, typically) and replicates the sharded states across the N/K groups:

- gradients are reduce-scattered inside the group (fast links), then each rank all-reduces
  its 1/K shard with the ranks holding the same shard in the other groups: only 1/K of the
  gradient crosses nodes, as an all-reduce among N/K ranks;
- parameters (stage 1-2 after the step, stage 3 in forward and backward) are all-gathered
  inside the group: nothing crosses nodes;
- each rank holds 1/K of the states instead of 1/N: memory for links.

Ranks are laid out as launchers number them: node n holds ranks n*K .. n*K+K-1, so shard
group g is those ranks and replica group k is ranks k, K+k, 2K+k, ...
"""
from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass

import torch.distributed as dist

from ..config import ConfigError
from .comm import Comm

# Launchers' names for the number of processes on this node, most specific first.
_LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                    "MV2_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")


@dataclass
class Topology:
    """The three ways the engine's ranks talk: ``world`` (every rank: checks, buffers, loss,
    checkpoints), ``shard`` (the ranks one copy of the states is sharded over) and
    ``replicas`` (the ranks holding the same shard in the other groups; None when the shard
    group is the world)."""
    world: Comm
    shard: Comm
    replicas: Comm | None = None
    # ZeRO++ hpZ: the ranks of this rank's node, over which stage 3 keeps a secondary copy of
    # the parameters (None: off)
    secondary: Comm | None = None
    # ZeRO++ qgZ's two hops: this rank's node, and the ranks of its local index on the other
    # nodes (None: one hop)
    node: Comm | None = None
    across: Comm | None = None

    @property
    def hybrid(self) -> bool:
        return self.replicas is not None

    @property
    def groups(self) -> int:
        """How many copies of the sharded states the job holds."""
        return self.world.world_size // self.shard.world_size

    @property
    def shard_group_index(self) -> int:
        return self.world.rank // self.shard.world_size

    def comms(self) -> dict[str, Comm]:
        """Each distinct Comm by the name its traffic is reported under (comm_report)."""
        out = {"world": self.world}
        if self.hybrid:
            out["shard_group"] = self.shard
            out["replica_group"] = self.replicas
        if self.secondary is not None:
            out["node_group"] = self.secondary
        if self.node is not None:
            if self.node is not self.secondary:
                out["qgz_node_group"] = self.node
            out["qgz_across_group"] = self.across
        return out

    @classmethod
    def plain(cls, comm: Comm) -> "Topology":
        return cls(comm, comm, None)


def ranks_per_node(environ=os.environ) -> int | None:
    """The launcher's count of processes on this node, or None when no launcher says."""
    for name in _LOCAL_SIZE_VARS:
        value = environ.get(name, "")
        match = re.match(r"^(\d+)", value)  # SLURM writes "2(x3)" for 2 on each of 3 nodes
        if match and int(match.group(1)) > 0:
            return int(match.group(1))
    return None


def resolve_shard_size(requested, world_size: int, stage: int,
                       environ=os.environ, key: str = "zero_optimization.mics_shard_size",
                       off=(-1, 0, None)) -> int:
    """The group size for ``zero_optimization.mics_shard_size`` (or ``key``): -1/0 (``off``)
    -> the world, "auto" -> the ranks of one node, K -> K; refuses what cannot be laid
    out."""
    if requested in off:
        return world_size
    if requested == "auto":
        size = ranks_per_node(environ)
        if size is None:
            raise ConfigError(f"{key} is \"auto\" (the ranks of one node), but no launcher "
                             "variable says how many ranks a node runs ("
                             f"{', '.join(_LOCAL_SIZE_VARS)}"
                             "): give the number instead")
        where = f"\"auto\" (LOCAL_WORLD_SIZE etc.: {size} ranks per node)"
    else:
        size, where = int(requested), str(requested)
    if size >= world_size and world_size % size == 0:
        return world_size  # one group of every rank: plain ZeRO
    if stage == 0:
        raise ConfigError(f"{key} = {where} shards model states within groups of ranks, but "
                         "stage 0 shards nothing: use stage 1, 2 or 3, or drop the key")
    if size < 1 or world_size % size:
        raise ConfigError(f"{key} = {where} does not divide the world size {world_size}: "
                         "the ranks must split into equal groups (the ranks of a node each)")
    return size


def resolve_hpz_size(requested, world_size: int, stage: int, shard_size: int,
                     environ=os.environ) -> int:
    """The node size for ZeRO++ hpZ (``zero_optimization.zero_hpz_partition_size``): 1 -> off
    (returned as the world size), "auto" -> the ranks of one node, K -> K."""
    key = "zero_optimization.zero_hpz_partition_size"
    size = resolve_shard_size(requested, world_size, max(stage, 1), environ, key=key,
                              off=(0, 1, None))
    if size >= world_size:
        return world_size
    if stage != 3:
        raise ConfigError(f"{key} = {requested} keeps a secondary copy of stage 3's sharded "
                         f"parameters, but the stage is {stage}: use stage 3, or drop the key")
    if shard_size < world_size:
        raise ConfigError(f"{key} = {requested} with zero_optimization.mics_shard_size = "
                         f"{shard_size}: hybrid sharding already gathers parameters inside a "
                         "group of ranks; use one of the two")
    return size


def check_same_sizes(comm: Comm, sizes: dict[str, int]) -> None:
    """Collective: every rank resolved the same group sizes (an "auto" reads each rank's own
    launcher variables); else every rank raises, naming the ranks and their values."""
    if comm.world_size == 1:
        return
    rows = comm.gather_ints(list(sizes.values()), what="the group sizes check")
    for i, name in enumerate(sizes):
        values = [row[i] for row in rows]
        if len(set(values)) > 1:
            by_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise ConfigError(f"the ranks resolved {name} differently ({by_rank}); every rank "
                             "must see the same node layout: give the number in the config, "
                             "or launch every node with the same processes per node")


def _groups_of(comm: Comm, size: int, kwargs: dict):
    """Collective: process groups of ``size`` consecutive ranks; (this rank's, and one per
    index within a group across the groups (the replicas))."""
    world = comm.world_size
    mine_group = mine_across = None
    # every rank creates every group, in the same order (torch.distributed requires it)
    for g in range(world // size):
        pg = dist.new_group(list(range(g * size, (g + 1) * size)), **kwargs)
        if comm.rank // size == g:
            mine_group = pg
    for k in range(size):
        pg = dist.new_group(list(range(k, world, size)), **kwargs)
        if comm.rank % size == k:
            mine_across = pg
    return mine_group, mine_across


def build_topology(comm: Comm, shard_size: int, hpz_size: int | None = None,
                   qgz_node_size: int | None = None) -> Topology:
    """Collective (every rank, same sizes): the process groups for ``shard_size`` (hybrid
    sharding), ``hpz_size`` (hpZ's node groups) and ``qgz_node_size`` (qgZ's two hops); None
    or the world size: off."""
    world = comm.world_size
    kwargs = {}
    if comm.timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=comm.timeout_s)
    if shard_size >= world:
        topology = Topology.plain(comm)
        made: dict[int, tuple[Comm, Comm]] = {}

        def node_groups(size: int) -> tuple[Comm, Comm]:
            if size not in made:
                _check_node_layout(comm, size)
                node, across = _groups_of(comm, size, kwargs)
                made[size] = (Comm(node, timeout_s=comm.timeout_s),
                              Comm(across, timeout_s=comm.timeout_s))
            return made[size]
        if hpz_size is not None and 1 < hpz_size < world:
            topology.secondary = node_groups(hpz_size)[0]
        if qgz_node_size is not None and 1 < qgz_node_size < world:
            topology.node, topology.across = node_groups(qgz_node_size)
        return topology
    _check_node_layout(comm, shard_size)
    shard, replicas = _groups_of(comm, shard_size, kwargs)
    return Topology(comm, Comm(shard, timeout_s=comm.timeout_s),
                    Comm(replicas, timeout_s=comm.timeout_s))


def _check_node_layout(comm: Comm, shard_size: int) -> None:
    """Refuse a launcher that numbers ranks other than node by node."""
    local = os.environ.get("LOCAL_RANK", "")
    if local.isdigit() and ranks_per_node() == shard_size and int(local) != comm.rank % shard_size:
        raise ConfigError(
            f"rank {comm.rank} is local rank {local} of its node, but hybrid sharding assumes "
            f"nodes hold consecutive ranks (local rank = rank % {shard_size}); launch with "
            "ranks numbered node by node (torchrun, srun and mpirun --map-by node do)")
