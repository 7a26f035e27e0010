"""Bytes that cross nodes per optimizer step, from the topology and the collectives' shapes.

The model of each collective is the algorithm the engine runs on gloo (and NCCL's ring), with
ranks numbered node by node (K per node, N in all, M = N/K nodes):

- ring all-gather of a T-byte result over G consecutive ranks spanning m nodes: every ring
  edge carries (G-1)/G*T, and m of the G edges join two nodes (none if m = 1);
- reduce-scatter: on NCCL a ring, as the all-gather; on gloo the engine sends point to point
  (gloo's own reduce-scatter is an all-reduce): each rank sends T/G to each of the G-1 others,
  G-K of them on other nodes -> (G-K)*T crosses in all, K times a ring's at scale;
- qgZ: an int8 all-to-all inside the node, then one among the M ranks of each local index
  across nodes, each sending (M-1)/M of its 1/K: (M-1)*T_int8 crosses in all (per node about
  a quarter of an fp32 ring's, half of bf16's);
- ring all-reduce of T over G ranks: a reduce-scatter and an all-gather phase, 2*(G-1)/G*T per
  edge.

What a step moves (P parameters, b bytes each in the compute dtype, r bytes per reduced
gradient element, A micro-steps):
- stage 3: per micro-step a forward and a backward all-gather of the parameters and a gradient
  reduce-scatter. hpZ: only the step's first forward gathers across nodes; qwZ: gathers move
  (1 + 4/256) bytes per element; qgZ: the reduce-scatter too (as an all-to-all of int8).
- stages 1-2: the reduce-scatter (stage 1: once per step; stage 2: every micro-step) and the
  all-gather of the updated parameters after the step.
- hybrid sharding (shard group = node): all of the above stays in the node; what crosses is
  the all-reduce of each rank's 1/K gradient chunk over its N/K replicas, as often as the
  reduce-scatter runs.

Not modelled: stage 3's segments kept from forward to backward (stage3_max_reuse_distance)
skip their backward gather, so the estimate is an upper bound there (a few % on the
benchmark's model); TCP/IP headers and acknowledgements (< 1% with segmentation offload).
"""
from __future__ import annotations

from dataclasses import dataclass

QUANT_BYTES = 1 + 4 / 256  # int8 value + its share of the block's fp32 scale


@dataclass(frozen=True)
class Topology:
    world: int  # N ranks
    per_node: int  # K ranks per node
    inter_gbps: float = 100.0  # each node's link to the others, Gbit/s
    intra_gbps: float = 1000.0  # between ranks of a node

    @property
    def nodes(self) -> int:
        return self.world // self.per_node


def _nodes_spanned(group: int, per_node: int, consecutive: bool) -> int:
    return max(1, group // per_node) if consecutive else group


def ring_all_gather(total: float, group: int, per_node: int, consecutive: bool = True) -> float:
    spanned = _nodes_spanned(group, per_node, consecutive)
    return 0.0 if spanned == 1 or group == 1 else spanned * (group - 1) / group * total


def p2p_reduce_scatter(total: float, group: int, per_node: int) -> float:
    return max(0, group - min(group, per_node)) * total


def ring_all_reduce(total: float, group: int, per_node: int, consecutive: bool = True) -> float:
    return 2 * ring_all_gather(total, group, per_node, consecutive)


def cross_node_bytes(params: float, topo: Topology, stage: int, precision: str = "fp32",
                     micro_steps: int = 1, hybrid: bool = False, hpz: bool = False,
                     qwz: bool = False, qgz: bool = False,
                     reduce_bytes: int | None = None,
                     backend: str = "nccl") -> dict[str, float]:
    """Bytes crossing nodes per optimizer step, summed over all ranks, by collective."""
    N, K, A = topo.world, topo.per_node, micro_steps
    b = 4 if precision == "fp32" else 2
    r = reduce_bytes or b
    gather_b = QUANT_BYTES if qwz else b
    grads_b = QUANT_BYTES if qgz else r
    out: dict[str, float] = {}
    reductions = A if stage >= 2 else 1
    if hybrid:
        # the shard group is the node: gathers and reduce-scatters stay inside it; each rank's
        # 1/K of the gradient is all-reduced across its N/K replicas (one per node)
        out["all_reduce (across groups)"] = reductions * K * ring_all_reduce(
            r * params / K, N // K, 1, consecutive=False)
        return out
    if qgz:
        out["reduce_scatter"] = reductions * (topo.nodes - 1) * grads_b * params
    elif backend == "gloo":
        out["reduce_scatter"] = reductions * p2p_reduce_scatter(grads_b * params, N, K)
    else:
        out["reduce_scatter"] = reductions * ring_all_gather(grads_b * params, N, K)
    if stage == 3:
        forward = 1 if hpz else A
        out["all_gather (forward)"] = forward * ring_all_gather(gather_b * params, N, K)
        out["all_gather (backward)"] = 0.0 if hpz else A * ring_all_gather(gather_b * params,
                                                                            N, K)
    elif stage in (1, 2):
        out["all_gather (after the step)"] = ring_all_gather(b * params, N, K)
    return out


def step_comm_seconds(bytes_by_kind: dict[str, float], topo: Topology) -> float:
    """Time the cross-node bytes take on the nodes' links, all links busy in parallel (a lower
    bound: no overlap credit, no latency)."""
    per_node = sum(bytes_by_kind.values()) / topo.nodes
    return per_node * 8 / (topo.inter_gbps * 1e9)
