"""How a config key is declared: ``option(default, doc, ...)`` on a dataclass field, read by
the parser (parse.py), the "did you mean" suggestions and the generated reference
(reference.py -> docs/config.md)."""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import field
from typing import Literal

AUTO = "auto"
# A key that also takes "auto" says so in its type: ``Union[int, Auto]`` (the parser accepts
# the string there and nowhere else; resolve_auto replaces it before the engine reads it).
Auto = Literal["auto"]
COMMENT_PREFIX = "_comment"  # JSON has no comments: keys starting with this are skipped


def option(default, doc: str, *, lo=None, hi=None, choices=None,
           no_effect: str | None = None, aliases: tuple = (), deprecated: tuple = (),
           deprecated_values: dict | None = None):
    """Declare one config key: its default, documentation and allowed values; ``aliases``:
    DeepSpeed's other spellings of it, ``deprecated``: spellings accepted with a warning,
    ``deprecated_values``: old spellings of a value (old -> current), read with a warning."""
    meta = dict(doc=doc, lo=lo, hi=hi, choices=choices, no_effect=no_effect,
                aliases=aliases, deprecated=deprecated,
                deprecated_values=deprecated_values or {})
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    if dataclasses.is_dataclass(default):
        return field(default_factory=type(default), metadata=meta)
    return field(default=default, metadata=meta)


def declared_type(annotation) -> tuple[type, bool, bool]:
    """A field's annotation read as (value type, None allowed, "auto" allowed):
    ``Optional[Union[int, Auto]]`` -> (int, True, True)."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) is typing.Union \
        else (annotation,)
    optional = type(None) in args
    auto = Auto in args
    rest = [a for a in args if a is not type(None) and a is not Auto]
    if len(rest) != 1:
        raise TypeError(f"config field type {annotation}: one value type, optionally with "
                        "Optional[...] and Auto")
    return rest[0], optional, auto
