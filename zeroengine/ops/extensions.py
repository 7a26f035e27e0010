"""Finding the compiled extensions of csrc/, in one place; every caller falls back to PyTorch
when a loader returns None.

- CPU extensions (``_cpu_adam_ext``, ``_flatten_ext``, ``_quant_ext``, ``_host_pool_ext``,
  and ``_aio_ext``, the NVMe reader/writer, loaded by ops/aio.py): built ahead of time by
  setup.py and never compiled at run time (a CPU-only install must not need a compiler to
  start). A missing one is reported once, with how to build it.
- CUDA kernels (``_cuda_ext``): the build setup.py made; else, on a machine with a GPU and nvcc,
  a JIT build of the same sources with torch.utils.cpp_extension.load (cached by torch under
  ~/.cache/torch_extensions, so only the first process pays the ~1-2 minutes); else None.
  Nothing is attempted without a GPU, and a failed build is reported once and not retried in
  the process. ZEROENGINE_NO_JIT=1 turns the JIT build off.
- ZEROENGINE_NO_EXT=1 turns every extension off at run time (setup.py also skips building
  them): the package then runs on its PyTorch fallbacks alone.
"""
from __future__ import annotations

import glob
import importlib
import json
import logging
import os
import warnings

import torch

logger = logging.getLogger("zeroengine")

_warned: set[str] = set()
_UNSET = object()
_cuda_module = _UNSET


def extensions_disabled() -> bool:
    return os.environ.get("ZEROENGINE_NO_EXT") == "1"


def load_cpu_extension(name: str):
    """The module ``zeroengine.<name>``, or None (with one warning) if it was not built."""
    if extensions_disabled():
        return None
    try:
        return importlib.import_module(f"zeroengine.{name}")
    except ImportError as err:
        if name not in _warned:
            _warned.add(name)
            warnings.warn(f"zeroengine C++ extension '{name}' is not built ({err}); using the "
                          "PyTorch fallback. Build it with `pip install -e . "
                          "--no-build-isolation` (needs a C++ compiler and ninja).",
                          RuntimeWarning, stacklevel=3)
        return None


def cuda_source_dir() -> str | None:
    """csrc/cuda of the checkout this package runs from (an editable or in-tree install)."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, os.pardir, os.pardir, "csrc", "cuda")
    return os.path.normpath(path) if os.path.isdir(path) else None


def jit_build_cuda(verbose: bool = False):
    """Compile csrc/cuda now (or take torch's cached build) and import it."""
    from torch.utils.cpp_extension import load
    src = cuda_source_dir()
    if src is None:
        raise RuntimeError("csrc/cuda is not next to the package (a wheel install): build the "
                           "extension with `pip install -e . --no-build-isolation`")
    sources = sorted(glob.glob(os.path.join(src, "*.cpp")) + glob.glob(os.path.join(src, "*.cu")))
    with open(os.path.join(src, "build_flags.json")) as f:  # the flags setup.py uses too
        flags = json.load(f)
    return load(name="zeroengine_cuda_ext", sources=sources, extra_cflags=flags["cxx"],
                extra_cuda_cflags=flags["nvcc"], verbose=verbose)


def load_cuda_kernels():
    """The CUDA kernels' module, or None where there is no GPU or no way to build them."""
    global _cuda_module
    if _cuda_module is not _UNSET:
        return _cuda_module
    _cuda_module = None
    if extensions_disabled() or not torch.cuda.is_available():
        return None
    try:
        _cuda_module = importlib.import_module("zeroengine._cuda_ext")
        return _cuda_module
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
                   "from %s (once: torch caches the build)", cuda_source_dir())
    try:
        _cuda_module = jit_build_cuda()
    except Exception as err:  # noqa: BLE001 - fall back, loudly
        warnings.warn(f"zeroengine's CUDA kernels failed to build ({err}); using PyTorch's ops",
                      RuntimeWarning, stacklevel=2)
        _cuda_module = None
    return _cuda_module
