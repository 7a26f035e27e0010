"""``deepspeed.ops.adam``: ``DeepSpeedCPUAdam`` and ``FusedAdam`` with DeepSpeed's arguments,
as zeroengine's Adam (ops/cpu_adam.py: the C++ kernel on host memory; the engine swaps in the
CUDA FusedAdam for shards on a GPU). ``adamw_mode`` / ``adam_w_mode`` decouple the weight
decay as DeepSpeed's do; ``bias_correction=False`` leaves the moments uncorrected."""
from __future__ import annotations

from ...ops.cpu_adam import CPUAdam


def _no_amsgrad(amsgrad: bool, cls: str) -> None:
    if amsgrad:
        raise ValueError(f"{cls}(amsgrad=True): not supported (DeepSpeed refuses it too); use "
                         "torch.optim.AdamW(amsgrad=True)")


class DeepSpeedCPUAdam(CPUAdam):
    def __init__(self, model_params, lr: float = 1e-3, bias_correction: bool = True,
                 betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True,
                 fp32_optimizer_states: bool = True):
        _no_amsgrad(amsgrad, "DeepSpeedCPUAdam")
        if not fp32_optimizer_states:
            raise ValueError("DeepSpeedCPUAdam(fp32_optimizer_states=False): zeroengine keeps "
                             "Adam's moments in fp32")
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         adamw_mode=adamw_mode, bias_correction=bias_correction)


class FusedAdam(CPUAdam):
    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True,
                 betas=(0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True):
        _no_amsgrad(amsgrad, "FusedAdam")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         adamw_mode=adam_w_mode, bias_correction=bias_correction)
