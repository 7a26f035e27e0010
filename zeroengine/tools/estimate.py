"""Model-state memory per rank from the ZeRO paper's formulas, as zeroengine lays it out.

With P parameters, N ranks, b bytes per parameter in the compute dtype (2 in bf16/fp16, 4 in
fp32) and S elementwise optimizer states (Adam: 2; SGD with momentum: 1):
  params      b*P (stage 3: b*P/N)
  grads       b*P (stages 2-3: b*P/N)
  optimizer   (m + 4*S)*P / N   (stage 0: not divided), m = 4 for the fp32 master copy (mixed
              precision, or any offloaded run), 0 in fp32 where the parameter is the master
The bf16/fp16 master keys change m and the 4 of each state: a low-precision master
(bf16_master_weights_and_grads) is the weights themselves, m = 0 (2 with offload: the host
copy); remainders (store_param_remainders) m = 2 (4 with offload: host weights + remainders);
bf16_optimizer_states 2 bytes per state instead of 4.
Offload moves the optimizer part to host memory, plus an fp32 host copy of the gradient shard
(4*P/N; b*P/N beside a low-precision master); offload_param moves the stage-3 parameter shard
there. To "nvme", the same parts go to
the drive instead (``nvme_*``) and no host gradient copy is kept (converted a tile at a time);
the tiles and cache in host memory are buffers, not counted. Mixed-precision Adam gives the
paper's 16P, 4P + 12P/N, 2P + 14P/N and 16P/N for stages 0-3.
Not included: bucket/prefetch buffers, padding (< N*16 elements per bucket), activations.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..core.sharding import Sharding

STATES_PER_PARAM = {"adam": 2, "adamw": 2, "cpuadam": 2, "adamax": 2, "nadam": 2, "radam": 2,
                    "sgd": 1, "adagrad": 1, "rmsprop": 1, "adadelta": 2, "asgd": 2, "rprop": 2}


@dataclass(frozen=True)
class MemoryEstimate:
    params: float
    grads: float
    optimizer_states: float
    host_params: float = 0.0
    host_grads: float = 0.0
    host_optimizer_states: float = 0.0
    nvme_params: float = 0.0
    nvme_optimizer_states: float = 0.0

    @property
    def device_total(self) -> float:
        return self.params + self.grads + self.optimizer_states

    @property
    def host_total(self) -> float:
        return self.host_params + self.host_grads + self.host_optimizer_states

    @property
    def nvme_total(self) -> float:
        return self.nvme_params + self.nvme_optimizer_states

    def as_dict(self) -> dict:
        return {**asdict(self), "device_total": self.device_total, "host_total": self.host_total,
                "nvme_total": self.nvme_total}


def states_per_param(optimizer: str, momentum: float = 0.9) -> int:
    key = optimizer.lower()
    if key not in STATES_PER_PARAM:
        raise ValueError(f"unknown optimizer {optimizer!r} for the estimate; known: "
                         f"{', '.join(sorted(STATES_PER_PARAM))}")
    if key == "sgd" and not momentum:
        return 0
    return STATES_PER_PARAM[key]


def model_state_bytes(num_params: float, stage: int, world_size: int, precision: str = "fp32",
                      states: int = 2, offload_optimizer: bool | str = False,
                      offload_param: bool | str = False, master: str = "fp32",
                      state_bytes: int = 4) -> MemoryEstimate:
    """Bytes of model states per rank (see the module docstring for the formulas).
    ``offload_*``: False/"none", True/"cpu" or "nvme". ``master``: "fp32", "low" (the
    bf16/fp16 weights are the master) or "remainder"; ``state_bytes``: 4 (fp32) or 2 (bf16)."""
    if master not in ("fp32", "low", "remainder"):
        raise ValueError(f"master must be fp32, low or remainder, got {master!r}")
    if master != "fp32" and precision == "fp32":
        raise ValueError(f"a {master} master needs bf16 or fp16 training")
    offload_optimizer, offload_param = _where(offload_optimizer), _where(offload_param)
    sharding = Sharding.of_stage(stage)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"precision must be fp32, bf16 or fp16, got {precision!r}")
    if offload_optimizer and not sharding.optimizer_state:
        raise ValueError("offload_optimizer needs stage 1-3")
    if offload_param and not sharding.parameters:
        raise ValueError("offload_param needs stage 3")
    P, N = float(num_params), world_size
    b = 4 if precision == "fp32" else 2
    shard = P / N
    params = b * shard if sharding.parameters else b * P
    grads = b * shard if sharding.gradients else b * P
    master_bytes = {"fp32": 4 if (precision != "fp32" or offload_optimizer) else 0,
                    "low": 2 if offload_optimizer else 0,
                    "remainder": 4 if offload_optimizer else 2}[master]
    optimizer = (master_bytes + state_bytes * states) * \
        (shard if sharding.optimizer_state else P)
    moved = {}
    if offload_optimizer:
        moved[f"{offload_optimizer}_optimizer_states"], optimizer = optimizer, 0.0
        if offload_optimizer == "host":  # fp32, or as reduced beside a low-precision master
            moved["host_grads"] = (2 if master == "low" else 4) * shard
    if offload_param:
        moved[f"{offload_param}_params"], params = params, 0.0
    return MemoryEstimate(params, grads, optimizer, **moved)


def _where(offload: bool | str) -> str | None:
    """Where an offload setting puts its part: None (the device), "host" or "nvme"."""
    if offload in (False, None, "none"):
        return None
    if offload in (True, "cpu"):
        return "host"
    if offload == "nvme":
        return "nvme"
    raise ValueError(f"offload must be 'none', 'cpu' or 'nvme', got {offload!r}")


def gpt_num_params(vocab: int, context: int, layers: int, dim: int) -> int:
    """Parameters of zeroengine.examples.gpt.GPT (tied embedding and head)."""
    block = 2 * 2 * dim + (3 * dim * dim + 3 * dim) + (dim * dim + dim) + \
        (4 * dim * dim + 4 * dim) + (4 * dim * dim + dim)
    return vocab * dim + context * dim + layers * block + 2 * dim
