"""Shared by every test module. The model, its data and the single-process references live in
models.py (importable here and in the ranks run_ranks spawns, since tests/ is on sys.path);
this file holds what ties a multi-rank run to its cases."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from zeroengine.testing import run_ranks  # noqa: E402


def train_on_ranks(world: int, train, cases: list) -> dict[int, tuple]:
    """Run ``train(cases)`` on ``world`` ranks; return, per index into ``cases``, the tuple of
    every rank's result for that case (what a module-scoped ``trained`` fixture keeps)."""
    per_rank = run_ranks(world, train, cases)
    return {index: results for index, results in enumerate(zip(*per_rank))}


def pytest_configure(config):
    """The hypothesis profile: --hypothesis-profile, else $HYPOTHESIS_PROFILE, else "ci"
    (derandomized; tests/hypothesis_profiles.py)."""
    import hypothesis_profiles
    hypothesis_profiles.load(config.getoption("hypothesis_profile", None))
