"""zeroengine: ZeRO-style sharded training for any nn.Module and any torch optimizer.

The C++ extensions are built ahead of time here. Build with `pip install -e .
--no-build-isolation` so the installed torch is used, not a fresh download. The CUDA kernels
(csrc/cuda) are built when torch has CUDA and nvcc is found; elsewhere they are skipped with a
message, and a GPU run without them JIT-builds them on first use (zeroengine/ops/extensions.py).
Set ZEROENGINE_NO_EXT=1 to skip building every extension; the same variable at run time makes
the package ignore built ones (zeroengine/ops/extensions.py) and run on its PyTorch fallbacks.
"""
from __future__ import annotations

import glob
import json
import os

from setuptools import setup

ext_modules, cmdclass = [], {}


def cuda_skip_reason(torch) -> str | None:
    """Why the CUDA kernels (csrc/cuda) are not built here, or None to build them."""
    from torch.utils.cpp_extension import CUDA_HOME
    if os.environ.get("ZEROENGINE_NO_CUDA") == "1":
        return "ZEROENGINE_NO_CUDA=1"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    if CUDA_HOME is None:
        return "nvcc was not found (set CUDA_HOME)"
    return None


def cuda_extension(torch):
    from torch.utils.cpp_extension import CUDAExtension
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        # No GPU to ask: build for A100 and H100/H200 rather than every architecture torch
        # knows (several times the compile time). Override with TORCH_CUDA_ARCH_LIST.
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"
    print(f"zeroengine: building the CUDA kernels for {os.environ.get('TORCH_CUDA_ARCH_LIST')}")
    sources = sorted(glob.glob("csrc/cuda/*.cpp") + glob.glob("csrc/cuda/*.cu"))
    with open("csrc/cuda/build_flags.json") as f:
        flags = json.load(f)
    return CUDAExtension("zeroengine._cuda_ext", sources,
                         extra_compile_args={"cxx": flags["cxx"], "nvcc": flags["nvcc"]})


def aio_backend() -> str:
    """The asynchronous file I/O backend csrc/aio is built with: io_uring where liburing's
    header and library are found (Debian: liburing-dev), else a thread pool.
    ZEROENGINE_AIO=threads forces the thread pool."""
    if os.environ.get("ZEROENGINE_AIO") == "threads":
        return "threads"
    import ctypes.util
    headers = any(os.path.exists(os.path.join(d, "liburing.h"))
                  for d in ("/usr/include", "/usr/local/include"))
    return "io_uring" if headers and ctypes.util.find_library("uring") else "threads"


def aio_extension(CppExtension):
    backend = aio_backend()
    print(f"zeroengine: building the asynchronous file I/O engine on {backend}"
          + ("" if backend == "io_uring" else " (install liburing-dev for io_uring)"))
    uring = backend == "io_uring"
    return CppExtension("zeroengine._aio_ext", ["csrc/aio/aio.cpp"],
                        extra_compile_args=["-O3", *(["-DZE_HAVE_LIBURING"] if uring else [])],
                        libraries=["uring"] if uring else [])


if os.environ.get("ZEROENGINE_NO_EXT") != "1":
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("zeroengine: torch is not importable at build time; skipping C++ extensions "
              "(install torch first and build with --no-build-isolation)")
    else:
        if os.environ.get("ZEROENGINE_CUDA_ONLY") != "1":  # .ci/compile_cuda builds only these
            for name, source, flags in [
                    ("_flatten_ext", "csrc/flatten/flatten.cpp", []),
                    # sqrt may only be vectorised when it need not set errno; no contraction
                    # of a*b+c into one rounding: torch rounds them apart (adam_coefficients.h)
                    ("_cpu_adam_ext", "csrc/adam/cpu_adam.cpp",
                     ["-fno-math-errno", "-ffp-contract=off"]),
                    # x / scale and q * scale rounded as torch rounds them (quant_common.h)
                    ("_quant_ext", "csrc/quant/quantize.cpp", ["-ffp-contract=off"]),
                    ("_host_pool_ext", "csrc/host_pool/host_pool.cpp", [])]:
                ext_modules.append(CppExtension(
                    f"zeroengine.{name}", [source],
                    extra_compile_args=["-O3", "-fopenmp", *flags],
                    extra_link_args=["-fopenmp"]))
        if os.environ.get("ZEROENGINE_CUDA_ONLY") != "1":
            ext_modules.append(aio_extension(CppExtension))
        reason = cuda_skip_reason(torch)
        if reason is None:
            ext_modules.append(cuda_extension(torch))
        else:
            print(f"zeroengine: not building the CUDA kernels: {reason}. The package uses "
                  "PyTorch ops on GPUs instead, or JIT-builds csrc/cuda on first use where nvcc "
                  "is found at run time.")
        cmdclass["build_ext"] = BuildExtension.with_options(use_ninja=True)

# The project's metadata (name, version, dependencies, extras, the command) is in pyproject.toml;
# what is left here is what a declaration cannot say: which extensions this machine can build.
setup(ext_modules=ext_modules, cmdclass=cmdclass)
