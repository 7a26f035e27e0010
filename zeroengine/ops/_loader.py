"""Load a compiled extension built ahead of time by setup.py; never JIT-compile at run time.

A missing extension is not an error: the caller falls back to PyTorch, and one warning per
extension says so and how to build it.
"""
from __future__ import annotations

import importlib
import warnings

_warned: set[str] = set()


def load_extension(name: str):
    """The module ``zeroengine.<name>`` or None (with one warning) if it was not built."""
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
