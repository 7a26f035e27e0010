"""Reading a config: JSON (or a dict) -> ``Config``, every key and value checked against the
declarations, DeepSpeed's spellings and deprecated keys read as DeepSpeed reads them, unknown
keys refused with a suggestion (or reported and ignored at the top level), and the cross-key
rules checked once the sections are read."""
from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import difflib
import json
import os
import typing
from typing import Any

from ..errors import ConfigError
from .fields import AUTO, COMMENT_PREFIX, declared_type
from .policy import NO_EFFECT, REFUSED, notice
from .rules import check_config
from .schema import Config


def _type_name(t) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            dict: "an object", list: "a list of strings"}.get(t, getattr(t, "__name__", str(t)))


def _range_text(meta, t) -> str:
    if meta["choices"]:
        return "one of " + ", ".join(repr(c) for c in meta["choices"])
    lo, hi = meta["lo"], meta["hi"]
    if lo is not None and hi is not None:
        return f"{lo}..{hi}"
    if lo is not None:
        return f">= {lo}"
    return _type_name(t)


def _coerce(value, t, path: str, meta, auto: bool = False) -> Any:
    """Check one leaf value against its declared type (``auto``: the type admits "auto") and
    range."""
    if value == AUTO and isinstance(value, str):
        if auto:
            return AUTO
        raise ConfigError(f"{path}: 'auto' is not accepted here; give {_range_text(meta, t)}")
    if isinstance(value, str) and value in meta["deprecated_values"]:
        notice(path, f"{value!r} is an old DeepSpeed spelling; read as "
               f"{meta['deprecated_values'][value]!r}")
        value = meta["deprecated_values"][value]
    if t is bool and isinstance(value, str) and value.lower() in ("true", "false"):
        # DeepSpeed's config models read the strings "true"/"false" as booleans
        notice(path, f"the string {json.dumps(value)} read as the boolean {value.lower()}")
        value = value.lower() == "true"
    if t is bool:
        ok = isinstance(value, bool)
    elif t is int:
        # JSON configs often spell sizes like 5e8: accept integral floats.
        ok = (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer())
        value = int(value) if ok else value
    elif t is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif t is str:
        ok = isinstance(value, str)
    elif t is dict:
        ok = isinstance(value, dict)
    elif t is list:
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    else:
        raise TypeError(f"schema type {t} at {path}")
    if not ok:
        raise ConfigError(f"{path}: expected {_type_name(t)} ({_range_text(meta, t)}), got "
                          f"{json.dumps(value)} ({type(value).__name__})")
    if meta["choices"] and value not in meta["choices"]:
        raise ConfigError(f"{path}: {value!r} is not allowed; use {_range_text(meta, t)}")
    if (meta["lo"] is not None and value < meta["lo"]) or (
            meta["hi"] is not None and value > meta["hi"]):
        raise ConfigError(f"{path}: {value} is out of range; allowed: {_range_text(meta, t)}")
    return value


# check-config's per-key report: (key, how zeroengine reads it), while collect_report() is open
_REPORT: contextvars.ContextVar[list[tuple[str, str]] | None] = contextvars.ContextVar(
    "zeroengine_config_report", default=None)


@contextlib.contextmanager
def collect_report():
    """Within the block, parsing records how each key of the config is read; yields the list
    of (key, verdict) rows: used as DeepSpeed means it / accepted, no effect here / refused."""
    rows: list[tuple[str, str]] = []
    token = _REPORT.set(rows)
    try:
        yield rows
    finally:
        _REPORT.reset(token)


def _say(key: str, verdict: str) -> None:
    rows = _REPORT.get()
    if rows is not None:
        rows.append((key, verdict))


# paths of the keys the config itself sets to "auto", while parse_config reads it: a default of
# "auto" (zeroengine's own sizing) and a written "auto" (the HF integration's meaning) differ
_WRITTEN_AUTO: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "zeroengine_config_written_auto", default=None)


def parse_section(cls, raw, path: str):
    """A dataclass of ``option`` fields from a JSON object, every key and value checked; the
    engine's sections and the job's (tools/job_config.py) are read with it."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{path or 'config'}: expected an object, got {json.dumps(raw)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    spelling = {name: name for name in fields}  # any accepted spelling -> field name
    for name, f in fields.items():
        for alias in f.metadata.get("aliases", ()) + f.metadata.get("deprecated", ()):
            spelling[alias] = name
    values, given_as = {}, {}
    for key, value in raw.items():
        full = f"{path}.{key}" if path else key
        if key.startswith(COMMENT_PREFIX):
            continue
        if key not in spelling:
            _not_a_field(full, key, value, list(spelling), top_level=not path)
            continue
        name = spelling[key]
        if name in given_as:
            raise ConfigError(f"'{full}' and '{path + '.' if path else ''}{given_as[name]}' "
                              "are the same setting, given twice; keep one")
        given_as[name] = key
        meta = fields[name].metadata
        if key in meta.get("deprecated", ()):
            notice(full, f"deprecated by DeepSpeed; read as '{name}'")
        t, optional, auto = declared_type(hints[name])
        if not dataclasses.is_dataclass(t):
            _say(full, f"accepted, no effect here: {meta['no_effect']}" if meta["no_effect"]
                 else "used" + ("" if key == name else f" (as {name})"))
        if value is None and optional:
            values[name] = None
        elif dataclasses.is_dataclass(t):
            values[name] = parse_section(t, value, f"{path}.{name}" if path else name)
        else:
            values[name] = _coerce(value, t, full, fields[name].metadata, auto)
            written = _WRITTEN_AUTO.get()
            if values[name] is AUTO and written is not None:  # under the schema's name
                written.append(f"{path}.{name}" if path else name)
    return cls(**values)


def _not_a_field(full: str, key: str, value, known: list[str], top_level: bool) -> None:
    """A key that is not in the schema: refused (a feature that would change results, or a
    typo), or accepted and reported once (a DeepSpeed knob with no effect here, or an unknown
    top-level key close to nothing, which DeepSpeed ignores too)."""
    if full in REFUSED:
        why, is_off = REFUSED[full]
        if is_off(value):
            _say(full, "accepted: the feature is off")
            return  # the feature's off value: nothing to implement
        _say(full, f"refused: {why}")
        raise ConfigError(f"'{full}': {why}; remove it from the config (or turn the feature "
                          "off)")
    if full in NO_EFFECT:
        notice(full, f"accepted, no effect in zeroengine: {NO_EFFECT[full]}")
        _say(full, f"accepted, no effect here: {NO_EFFECT[full]}")
        return
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    if close:
        raise ConfigError(f"unknown config key '{full}'; did you mean "
                          f"{' or '.join(repr(c) for c in close)}?")
    if top_level:
        notice(full, "unknown to zeroengine and ignored (DeepSpeed ignores unknown top-level "
               "keys too)")
        _say(full, "ignored: unknown top-level key")
        return
    raise ConfigError(f"unknown config key '{full}'; valid keys here: {', '.join(sorted(known))}")


def load_json(path: str | os.PathLike) -> dict:
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not valid JSON: {err.msg} at line {err.lineno}, "
                          f"column {err.colno}") from None


def config_dict(source, what: str = "config") -> dict:
    """A config given as a JSON path, a dict or None, as a dict of its own (the caller may
    change it: the user's dict is left alone). ``what`` names the argument in the error."""
    if isinstance(source, (str, os.PathLike)):
        raw = load_json(source)
    else:
        raw = copy.deepcopy(source) if source is not None else {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{what}: a JSON object (a path to one, or a dict), got "
                          f"{type(raw).__name__}")
    return raw


def _deprecated_offload(raw: dict) -> dict:
    """DeepSpeed's deprecated zero_optimization.cpu_offload / cpu_offload_param(s) /
    cpu_offload_use_pin_memory, read as DeepSpeed reads them: offload_optimizer / offload_param
    {"device": "cpu"} (and their pin_memory). A copy; the caller's dict is left alone."""
    zero = raw.get("zero_optimization")
    old = ("cpu_offload", "cpu_offload_param", "cpu_offload_params", "cpu_offload_use_pin_memory")
    if not isinstance(zero, dict) or not any(k in zero for k in old):
        return raw
    zero = dict(zero)
    pin = zero.pop("cpu_offload_use_pin_memory", None)
    for key, section in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param",
                                                                  "offload_param"),
                         ("cpu_offload_params", "offload_param")):
        if key not in zero:
            continue
        on = zero.pop(key)
        notice(f"zero_optimization.{key}", f"deprecated by DeepSpeed; read as "
               f"zero_optimization.{section}" + (' {"device": "cpu"}' if on is True else ""))
        if on is True:
            if section in zero:
                raise ConfigError(f"zero_optimization.{key} and zero_optimization.{section} "
                                  "both given; keep the second")
            zero[section] = {"device": "cpu", **({"pin_memory": pin} if pin is not None
                                                 else {})}
        elif on is not False:
            raise ConfigError(f"zero_optimization.{key}: expected a boolean, got "
                              f"{json.dumps(on)}")
    return {**raw, "zero_optimization": zero}


def parse_config(source: "str | os.PathLike | dict | Config") -> Config:
    """Validate a config given as a path to a JSON file, a dict, or an already-parsed Config."""
    if isinstance(source, Config):
        return source
    raw = load_json(source) if isinstance(source, (str, os.PathLike)) else source
    if not isinstance(raw, dict):
        raise ConfigError(f"a config must be a JSON object or dict, got {type(raw).__name__}")
    written: list[str] = []
    token = _WRITTEN_AUTO.set(written)
    try:
        cfg = parse_section(Config, _deprecated_offload(raw), "")
        cfg.written_auto = frozenset(written)  # read by resolve_auto
    finally:
        _WRITTEN_AUTO.reset(token)
    return check_config(cfg)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
