"""zeroengine: ZeRO-style sharded training for any nn.Module and elementwise torch optimizer.

The C++ extensions are built ahead of time here (never JIT-compiled inside initialize()). Build
with `pip install -e . --no-build-isolation` so the installed torch is used, not a fresh download.
Set ZEROENGINE_NO_EXT=1 to skip them; the package then runs on its PyTorch fallbacks.
"""
import os

from setuptools import find_packages, setup

ext_modules, cmdclass = [], {}
if os.environ.get("ZEROENGINE_NO_EXT") != "1":
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("zeroengine: torch is not importable at build time; skipping C++ extensions "
              "(install torch first and build with --no-build-isolation)")
    else:
        for name, source, flags in [
                ("_flatten_ext", "csrc/flatten/flatten.cpp", []),
                # sqrt may only be vectorised when it need not set errno
                ("_cpu_adam_ext", "csrc/adam/cpu_adam.cpp", ["-fno-math-errno"])]:
            ext_modules.append(CppExtension(
                f"zeroengine.{name}", [source],
                extra_compile_args=["-O3", "-fopenmp", *flags], extra_link_args=["-fopenmp"]))
        cmdclass["build_ext"] = BuildExtension.with_options(use_ninja=True)

setup(
    name="zeroengine",
    version="0.1.0",
    description="ZeRO-style memory-sharding training engine for PyTorch",
    packages=find_packages(include=["zeroengine", "zeroengine.*"]),
    python_requires=">=3.9",
    install_requires=["torch>=2.4", "numpy", "safetensors"],
    extras_require={
        "test": ["pytest", "hypothesis", "psutil"],
        "bench": ["psutil", "deepspeed"],
        "train": ["tqdm", "matplotlib"],  # zeroengine train: progress bar and the loss plot
        "tensorboard": ["tensorboard"],  # zeroengine train also writes TensorBoard scalars
        "ray": ["ray[train]"],  # zeroengine.integrations.ray
        "hf": ["transformers"],  # Hugging Face models (tests/test_hf.py)
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={"console_scripts": ["zeroengine=zeroengine.cli:main"]},
)
