"""The schema of the built-in `zeroengine train` job: the ``job`` section of a config file. The
job splits it off before the rest becomes the engine's ``Config`` (which does not declare it;
initialize() given such a file says the section has no effect there), and checks it here with
the engine config's own machinery (declarations, ranges, "did you mean" suggestions)."""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError, config_dict, option, parse_section
from ..config.reference import section_markdown


@dataclass
class JobModelConfig:
    layers: int = option(4, "Transformer blocks.", lo=1)
    heads: int = option(4, "Attention heads per block (must divide dim).", lo=1)
    dim: int = option(256, "Model width.", lo=1)
    context: int = option(128, "Tokens per training sequence.", lo=2)


@dataclass
class JobConfig:
    """Settings of the built-in `zeroengine train` job; the engine itself ignores them."""
    run_name: str = option("gpt-stdlib", "Outputs go to runs/<run_name>/.")
    model: JobModelConfig = option(JobModelConfig(), "Size of the byte-level GPT.")
    steps: int = option(200, "Optimizer steps to train.", lo=1)
    eval_interval: int = option(50, "Evaluate validation loss every this many steps.", lo=1)
    eval_batches: int = option(4, "Micro-batches per validation evaluation.", lo=1)
    checkpoint_interval: int = option(100, "Save a sharded checkpoint every this many steps "
                                      "(0: only at the end).", lo=0)
    seed: int = option(0, "Seed of model init and data order.")


JOB_SECTION = "job"


def job_config(section: dict) -> JobConfig:
    """The checked ``job`` section."""
    job = parse_section(JobConfig, section, JOB_SECTION)
    if job.model.dim % job.model.heads:
        raise ConfigError(f"job.model.heads ({job.model.heads}) must divide job.model.dim "
                          f"({job.model.dim})")
    return job


def split_job(source) -> tuple[dict, JobConfig]:
    """A config file (or dict) as (the engine's part, for parse_config; the checked job)."""
    raw = config_dict(source)
    return raw, job_config(raw.pop(JOB_SECTION, {}))


def reference_markdown() -> str:
    lines = ["# `zeroengine train` job reference", "",
             "The `job` section of a config, read by the built-in training job (`zeroengine "
             "train`, `make demo`); `zeroengine.initialize()` ignores it. Generated from "
             "`zeroengine/tools/job_config.py` by `make docs`; do not edit by hand.", ""]
    return "\n".join(lines + section_markdown(JobConfig, "job")) + "\n"
