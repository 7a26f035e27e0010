"""How a config key is declared: ``option(default, doc, ...)`` on a dataclass field, read by
the parser (parse.py), the "did you mean" suggestions and the generated reference
(reference.py -> docs/config.md)."""
from __future__ import annotations

import dataclasses
from dataclasses import field

AUTO = "auto"
COMMENT_PREFIX = "_comment"  # JSON has no comments: keys starting with this are skipped


def option(default, doc: str, *, lo=None, hi=None, choices=None, auto: bool = False,
           no_effect: str | None = None, aliases: tuple = (), deprecated: tuple = (),
           deprecated_values: dict | None = None):
    """Declare one config key: its default, documentation and allowed values; ``aliases``:
    DeepSpeed's other spellings of it, ``deprecated``: spellings accepted with a warning,
    ``deprecated_values``: old spellings of a value (old -> current), read with a warning."""
    meta = dict(doc=doc, lo=lo, hi=hi, choices=choices, auto=auto, no_effect=no_effect,
                aliases=aliases, deprecated=deprecated,
                deprecated_values=deprecated_values or {})
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    if dataclasses.is_dataclass(default):
        return field(default_factory=type(default), metadata=meta)
    return field(default=default, metadata=meta)
