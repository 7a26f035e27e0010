"""Python front of the C++/CUDA extensions in csrc/, each with a pure-PyTorch fallback."""
from .cpu_adam import CPUAdam
from .flatten import flatten_into, unflatten_from, using_extension

__all__ = ["CPUAdam", "flatten_into", "unflatten_from", "using_extension"]
