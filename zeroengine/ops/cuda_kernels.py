"""The CUDA kernels of csrc/cuda (fused multi-tensor Adam, flatten/unflatten), found once.

In order: the extension setup.py built (``zeroengine._cuda_ext``); else, on a machine with a
GPU and nvcc, a JIT build of the same sources with torch.utils.cpp_extension.load (cached by
torch under ~/.cache/torch_extensions, so only the first process pays the ~1-2 minutes); else
None, and callers use PyTorch ops. Nothing is attempted without a GPU, and a failed build is
reported once and not retried in the process. ZEROENGINE_NO_JIT=1 turns the JIT build off.
"""
from __future__ import annotations

import glob
import importlib
import logging
import os
import warnings

import torch

logger = logging.getLogger("zeroengine")

_UNSET = object()
_module = _UNSET


def source_dir() -> str | None:
    """csrc/cuda of the checkout this package runs from (an editable or in-tree install)."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, os.pardir, os.pardir, "csrc", "cuda")
    return os.path.normpath(path) if os.path.isdir(path) else None


def jit_build(verbose: bool = False):
    """Compile csrc/cuda now (or take torch's cached build) and import it."""
    from torch.utils.cpp_extension import load
    src = source_dir()
    if src is None:
        raise RuntimeError("csrc/cuda is not next to the package (a wheel install): build the "
                           "extension with `pip install -e . --no-build-isolation`")
    sources = sorted(glob.glob(os.path.join(src, "*.cpp")) + glob.glob(os.path.join(src, "*.cu")))
    return load(name="zeroengine_cuda_ext", sources=sources, extra_cflags=["-O3"],
                extra_cuda_cflags=["-O3", "-lineinfo"], verbose=verbose)


def load_cuda_kernels():
    """The kernels' module, or None where there is no GPU or no way to build them."""
    global _module
    if _module is not _UNSET:
        return _module
    _module = None
    if os.environ.get("ZEROENGINE_NO_EXT") == "1" or not torch.cuda.is_available():
        return None
    try:
        _module = importlib.import_module("zeroengine._cuda_ext")
        return _module
    except ImportError:
        pass
    from torch.utils.cpp_extension import CUDA_HOME
    if os.environ.get("ZEROENGINE_NO_JIT") == "1" or CUDA_HOME is None:
        warnings.warn("zeroengine's CUDA kernels are not built and cannot be JIT-built here "
                      f"({'ZEROENGINE_NO_JIT=1' if CUDA_HOME else 'no nvcc found'}); using "
                      "PyTorch's ops (torch's fused AdamW for the step)", RuntimeWarning,
                      stacklevel=2)
        return None
    # a warning, not info: the first process waits a minute or two for nvcc, visibly
    logger.warning("zeroengine: the CUDA kernels were not built by setup.py; JIT-building them "
                   "from %s (once: torch caches the build)", source_dir())
    try:
        _module = jit_build()
    except Exception as err:  # a compiler failure must not stop training: fall back, loudly
        warnings.warn(f"zeroengine's CUDA kernels failed to build ({err}); using PyTorch's ops",
                      RuntimeWarning, stacklevel=2)
        _module = None
    return _module
