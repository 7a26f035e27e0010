"""The property tests' two ways of running (hypothesis profiles).

- ``ci`` (the default; what ``make test`` and CI run): derandomized, so every run draws the
  same cases and a submission's CI cannot turn red on a case its change did not touch; no
  example database (a clean clone has none, and a local one would make runs differ).
- ``explore``: fresh random cases on every run, 50x as many per test, and the example database
  under .hypothesis/ so a failure found is replayed first the next time. Run it for a while
  before landing anything that touches configs, partitioning or kernels:
  ``HYPOTHESIS_PROFILE=explore .venv/bin/python -m pytest tests/test_fuzz.py``
  (or ``--hypothesis-profile=explore``). What it finds goes into the test as an ``@example``.

Tests write their own budget as ``max_examples=examples(N)``: N under ``ci``, scaled under
``explore`` (a per-test max_examples would otherwise override the profile's).
"""
from __future__ import annotations

import os

from hypothesis import settings

BASE = 100  # hypothesis' own default max_examples: the ci profile's
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", max_examples=50 * BASE, print_blob=True)


def load(name: str | None = None) -> None:
    settings.load_profile(name or os.environ.get("HYPOTHESIS_PROFILE") or "ci")


def examples(n: int) -> int:
    """A test's example budget: ``n`` under the ci profile, scaled with the loaded profile."""
    return max(1, n * settings.default.max_examples // BASE)
