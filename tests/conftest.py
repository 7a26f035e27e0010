"""Shared by every test module. The model, its data and the single-process references live in
harness.py (importable here and in the ranks run_ranks spawns: pyproject.toml puts tests/ on
sys.path); this file holds what ties a multi-rank run to its cases."""
from __future__ import annotations

from zeroengine.testing import run_ranks


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
    config.addinivalue_line("markers", "single_process: runs in the pytest process alone "
                            "(`pytest -m single_process`: the seconds-long tests)")
    config.addinivalue_line("markers", "multi_process: starts ranks or other processes")


# -- markers: which tests start other processes ---------------------------------------------------
# `pytest -m single_process` runs only the tests that stay in this process (seconds); the rest
# are marked `multi_process`. Decided from the source of the test, its fixtures and the module's
# functions they call (two levels): anything that reaches one of these starts processes.
_STARTS_PROCESSES = ("run_ranks(", "train_on_ranks(", "subprocess", "Popen", "torchrun",
                     "spawn(", "mp.Process", "multiprocessing", "ray.init", "launch_job(",
                     "sys.executable", "run_process_tree(")


def _source(obj) -> str:
    import inspect
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _names_called(func) -> set[str]:
    code = getattr(func, "__code__", None)
    names, stack = set(), [code] if code is not None else []
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if hasattr(k, "co_names"))
    return names


def _starts_processes(func, module, depth: int = 2, seen=None) -> bool:
    seen = set() if seen is None else seen
    if id(func) in seen:
        return False
    seen.add(id(func))
    if any(marker in _source(func) for marker in _STARTS_PROCESSES):
        return True
    if depth == 0:
        return False
    for name in _names_called(func):
        helper = getattr(module, name, None)
        if callable(helper) and getattr(helper, "__module__", None) in (
                module.__name__, "harness", "conftest") and \
                _starts_processes(helper, module, depth - 1, seen):
            return True
    return False


def pytest_collection_modifyitems(config, items):
    import pytest
    for item in items:
        func = getattr(item, "function", None)
        module = getattr(item, "module", None)
        starts = func is None or module is None
        if not starts:
            funcs = [func] + [d.func for defs in item._fixtureinfo.name2fixturedefs.values()
                              for d in defs]
            starts = any(_starts_processes(f, module) for f in funcs)
        item.add_marker(pytest.mark.multi_process if starts else pytest.mark.single_process)
