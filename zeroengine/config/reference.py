"""docs/config.md (and the job's docs/job.md), generated from the schema's declarations in
config.py and the policy tables in config/policy.py by `make docs`."""
from __future__ import annotations

import dataclasses
import json
import typing

from .fields import COMMENT_PREFIX, declared_type
from .parse import _range_text
from .policy import NO_EFFECT, REFUSED
from .schema import Config


def reference_markdown() -> str:
    lines = ["# Config reference", "", "Generated from the declarations in `zeroengine/config/` "
             "(and `config/policy.py`) by `make docs`; do not edit by hand.", ""]
    lines += section_markdown(Config, "")
    lines += [f"Keys starting with `{COMMENT_PREFIX}` are comments and are skipped at any level.",
              ""]
    lines += ["## DeepSpeed keys zeroengine does not implement", "",
              "A key that would change training results if ignored is refused, naming the "
              "feature, unless its value turns the feature off (DeepSpeed's default, an empty "
              "section or `\"enabled\": false`). A knob that only steers DeepSpeed's own "
              "logging, profiling or internals is accepted with any value and reported once. "
              "An unknown key close to a known one is refused as a typo, with the suggestion; "
              "an unknown top-level key close to nothing is reported once and ignored, as "
              "DeepSpeed ignores it. What DeepSpeed reads leniently is read the same way, each "
              "said once: booleans written as the strings \"true\"/\"false\", its older "
              "spellings (the `bfloat16` section, `communication_data_type` \"bfp16\", the "
              "deprecated `cpu_offload` keys and `stage3_gather_fp16_weights_on_model_save`), "
              "and `offload_param` below stage 3 (ignored). \"auto\" is resolved from what "
              "initialize() is given (the value said once) or refused naming what to pass.", "",
              "| key | refused when on: why |", "|---|---|"]
    lines += [f"| `{k}` | {why} |" for k, (why, _) in sorted(REFUSED.items())]
    lines += ["", "| key | accepted, no effect: why |", "|---|---|"]
    lines += [f"| `{k}` | {why} |" for k, why in sorted(NO_EFFECT.items())]
    return "\n".join(lines) + "\n"


def section_markdown(cls, path: str) -> list[str]:
    """Markdown tables of a section's keys (and of its subsections), from their declarations."""
    lines: list[str] = []
    hints = typing.get_type_hints(cls)
    rows, subs = [], []
    for f in dataclasses.fields(cls):
        t, _, auto = declared_type(hints[f.name])
        key = f"{path}.{f.name}" if path else f.name
        if dataclasses.is_dataclass(t):
            subs.append((t, key, f.metadata["doc"]))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        doc = f.metadata["doc"]
        spellings = f.metadata.get("aliases", ()) + f.metadata.get("deprecated", ())
        if spellings:
            doc += " Also spelt " + ", ".join(f"`{a}`" for a in spellings) + "."
        if f.metadata["no_effect"]:
            doc += f" *Accepted, no effect: {f.metadata['no_effect']}.*"
        allowed = _range_text(f.metadata, t) + (", 'auto'" if auto else "")
        rows.append(f"| `{key}` | `{json.dumps(default)}` | {allowed} | {doc} |")
    if rows:
        lines.extend([f"## `{path or 'top level'}`", "",
                      "| key | default | allowed | meaning |", "|---|---|---|---|", *rows, ""])
    for t, key, doc in subs:
        lines.append(f"<!-- {key}: {doc} -->")
        lines += section_markdown(t, key)
    return lines
