"""Per-rank memory and step time of a ZeRO configuration at any world size, from first
principles: the ZeRO formulas (``estimate.model_state_bytes``) plus zeroengine's own buffers, and
a compute + ring-communication time model with overlap.

Memory per rank (bytes), on top of the model states:
  gradient buckets   stage 0-2: two buckets of ``reduce_bucket_size`` in the communication dtype
                     in flight (stage 0-1 reduce in place in the full gradient buffer, so none)
  stage-3 gathers    what is gathered at once: the prefetch window plus the module in use,
                     at most ``stage3_max_live_parameters``, in the compute dtype
  padding            each flat buffer is padded to a multiple of N (< N elements per buffer)
Activations are not model states and are left to the user (``activation_bytes``).

Step time: compute is 6 FLOPs per parameter per token (forward 2, backward 4) at ``flops``
per second. Every collective on B bytes over N ranks costs the ring algorithm's
(N-1)/N * B / bandwidth (reduce-scatter, all-gather; twice that for all-reduce) plus (N-1)
latencies per call. What overlaps:
  stage 0-2    gradient reduction runs during backward (bucket by bucket); only the last
               bucket's collective is exposed. The parameter all-gather of stages 1-2 follows the
               optimizer step and is exposed.
  stage 3      forward all-gathers are prefetched under forward compute, backward all-gathers
               and the reduce-scatter under backward compute; the first module's gather is
               exposed.
  optimizer    Adam reads/writes ~(4 + 4 + 8 + b) bytes per owned parameter at
               ``memory_bandwidth``; offloaded, it runs on the host at ``host_adam_rate``
               parameters per second, after the fp32 gradient shard is copied down and before
               the updated parameters are copied up at ``host_bandwidth``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import ZeroConfig, auto_stage3_window
from ..core.sharding import Sharding
from .estimate import model_state_bytes


@dataclass(frozen=True)
class Hardware:
    """Per-rank machine figures (defaults: an H100/H200-class GPU node with 8x400 Gb/s IB)."""
    flops: float = 400e12  # achieved dense bf16 FLOP/s (~40% of an H100's peak)
    bandwidth: float = 45e9  # bytes/s per rank for collectives (inter-node)
    latency: float = 20e-6  # seconds per ring step
    memory_bandwidth: float = 3e12  # device memory, bytes/s
    host_bandwidth: float = 25e9  # device <-> host copies, bytes/s
    host_adam_rate: float = 1e9  # parameters/s the host's CPU Adam steps (per rank's cores)
    device_memory: float = 80 * 2**30  # bytes


@dataclass(frozen=True)
class Job:
    params: float
    stage: int
    world_size: int
    precision: str = "bf16"
    states: int = 2
    offload_optimizer: bool = False
    offload_param: bool = False
    tokens_per_rank: int = 8 * 4096  # tokens each rank processes per optimizer step
    # the config's defaults (config/zero.py declares them); prefetch None: "auto"
    reduce_bucket_size: int = ZeroConfig.reduce_bucket_size
    prefetch_bucket_size: int | None = None
    max_live_parameters: int = ZeroConfig.stage3_max_live_parameters
    largest_module: float = 0.0  # elements of the biggest layer (stage 3 gathers it whole)
    activation_bytes: float = 0.0
    buffers: int = 1  # flat buffers (padding)


@dataclass(frozen=True)
class Prediction:
    model_states: float  # device bytes, ZeRO formula
    buffers: float  # device bytes of buckets, gathers and padding
    host: float  # host bytes (offload)
    comm_bytes: float  # bytes each rank sends per step
    compute_s: float
    comm_s: float  # all collectives, if nothing overlapped
    exposed_comm_s: float  # the part compute does not hide
    optimizer_s: float
    step_s: float

    @property
    def device_total(self) -> float:
        return self.model_states + self.buffers

    def fits(self, hw: Hardware, activation_bytes: float = 0.0) -> bool:
        return self.device_total + activation_bytes <= hw.device_memory


def _ring(nbytes: float, world: int, calls: int, hw: Hardware, factor: float = 1.0) -> float:
    if world == 1:
        return 0.0
    return factor * ((world - 1) / world * nbytes / hw.bandwidth + calls * (world - 1)
                     * hw.latency)


def predict(job: Job, hw: Hardware = Hardware()) -> Prediction:
    P, N, stage = float(job.params), job.world_size, job.stage
    sharding = Sharding.of_stage(stage)
    b = 4 if job.precision == "fp32" else 2
    prefetch = job.prefetch_bucket_size if job.prefetch_bucket_size is not None \
        else auto_stage3_window(P, job.largest_module)
    states = model_state_bytes(P, stage, N, job.precision, job.states, job.offload_optimizer,
                               job.offload_param)
    # -- buffers
    bucket = min(job.reduce_bucket_size, P)
    # stage 2's buckets in flight (two); stage 3 frees them as it goes, but gathers
    buffers = 2 * bucket * b if sharding.gradients and not sharding.parameters else 0.0
    if sharding.parameters:
        live = min(prefetch + max(job.largest_module, bucket),
                   job.max_live_parameters, P)
        buffers += live * b + 2 * bucket * b / N  # gathered window + reduce-scatter outputs
    buffers += job.buffers * N * b  # padding, at most N elements per flat buffer
    # -- communication (bytes sent per rank, ring; number of calls for the latency term)
    grad_calls = max(1, math.ceil(P / bucket))
    param_calls = max(1, math.ceil(P / max(prefetch, 1)))
    if not sharding.optimizer_state:
        comm_bytes = 2 * (N - 1) / N * b * P
        grad_s = _ring(b * P, N, grad_calls, hw, factor=2.0)
        tail_s = 0.0
        fwd_gather_s = bwd_gather_s = 0.0
    else:
        grad_s = _ring(b * P, N, grad_calls, hw)
        if not sharding.parameters:
            comm_bytes = 2 * (N - 1) / N * b * P
            tail_s = _ring(b * P, N, param_calls, hw)  # all-gather after the step
            fwd_gather_s = bwd_gather_s = 0.0
        else:
            comm_bytes = 3 * (N - 1) / N * b * P
            tail_s = 0.0
            fwd_gather_s = bwd_gather_s = _ring(b * P, N, param_calls, hw)
    comm_s = grad_s + tail_s + fwd_gather_s + bwd_gather_s
    # -- compute and overlap
    compute = 6 * P * job.tokens_per_rank / hw.flops
    fwd, bwd = compute / 3, 2 * compute / 3
    first_gather = fwd_gather_s / param_calls
    last_bucket = grad_s / grad_calls
    exposed = first_gather + max(0.0, fwd_gather_s - fwd) + \
        max(0.0, bwd_gather_s + grad_s - bwd) + last_bucket + tail_s
    # -- optimizer
    owned = P / N if sharding.optimizer_state else P
    if job.offload_optimizer:
        optimizer_s = owned / hw.host_adam_rate + (4 * owned + b * owned) / hw.host_bandwidth
    else:
        optimizer_s = owned * (16 + 4 + b) / hw.memory_bandwidth
    if job.offload_param:  # every gather first copies the shard up from the host
        optimizer_s += 2 * b * owned / hw.host_bandwidth
    return Prediction(states.device_total, buffers, states.host_total, comm_bytes, compute,
                      comm_s, exposed, optimizer_s, fwd + bwd + exposed + optimizer_s)


# What to try, cheapest first: less sharding communicates less; offload costs host time.
LADDER = [(0, False, False), (1, False, False), (2, False, False), (3, False, False),
          (3, True, False), (3, True, True)]


def recommend(params: float, world_size: int, hw: Hardware = Hardware(), tolerance: float = 0.05,
              **job_args):
    """The least sharded (stage, offload_optimizer, offload_param) whose device memory fits and
    whose predicted step is within ``tolerance`` of the fastest that fits (less sharding is
    simpler and more robust than a prediction's last few percent), with its prediction;
    (None, None) when nothing fits."""
    fitting = []
    for stage, off_opt, off_param in LADDER:
        job = Job(params, stage, world_size, offload_optimizer=off_opt,
                  offload_param=off_param, **job_args)
        pred = predict(job, hw)
        if pred.fits(hw, job.activation_bytes):
            fitting.append((job, pred))
    if not fitting:
        return None, None
    fastest = min(pred.step_s for _, pred in fitting)
    return next((job, pred) for job, pred in fitting if pred.step_s <= fastest * (1 + tolerance))
