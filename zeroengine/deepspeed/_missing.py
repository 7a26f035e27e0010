"""What a DeepSpeed name zeroengine does not implement says instead of a bare AttributeError:
the name, and the nearest thing zeroengine has (or that there is none, and why)."""
from __future__ import annotations

import difflib

from ..errors import NotInZeroengine


def missing(module: str, name: str, nearest: dict[str, str], present: list[str]):
    """The error for ``<module>.<name>``: ``nearest`` maps names zeroengine knows it lacks to
    what to use instead; otherwise a close spelling among ``present`` is suggested."""
    if name.startswith("__"):
        return AttributeError(name)  # dunder probes (copy, pickle, inspect): plain
    instead = nearest.get(name)
    if instead is None:
        close = difflib.get_close_matches(name, present, n=2, cutoff=0.7)
        instead = f"did you mean {' or '.join(close)}?" if close else \
            f"what it provides: {', '.join(sorted(n for n in present if not n.startswith('_')))}"
    return NotInZeroengine(f"{module}.{name} is a DeepSpeed name that zeroengine does not "
                           f"implement; {instead}")
