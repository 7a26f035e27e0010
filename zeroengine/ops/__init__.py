"""Python front of the C++/CUDA extensions in csrc/, each with a pure-PyTorch fallback."""
from .cpu_adam import CPUAdam
from .extensions import load_cuda_kernels
from .flatten import flatten_into, unflatten_from, using_extension
from .fused_adam import FusedAdam
from .lamb import Lamb

__all__ = ["CPUAdam", "FusedAdam", "Lamb", "load_cuda_kernels", "flatten_into", "unflatten_from",
           "using_extension"]
