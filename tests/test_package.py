"""The package's house rules, checked from its source: every exception the package raises is
defined in zeroengine/errors.py and importable from ``zeroengine``; no package folder carries a
name that .gitignore templates and linters skip; torch.distributed is called only from
zeroengine/distributed/ (and the DeepSpeed facade, and DCP's own save)."""
from __future__ import annotations

import ast
import builtins
import pathlib

import zeroengine
from zeroengine import errors

PACKAGE = pathlib.Path(zeroengine.__file__).parent
SOURCES = sorted(PACKAGE.rglob("*.py"))


def _trees():
    for path in SOURCES:
        yield path, ast.parse(path.read_text(), str(path))


def test_every_exception_class_lives_in_errors_and_is_exported():
    defined_elsewhere = []
    for path, tree in _trees():
        if path.name == "errors.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(b, ast.Name) and (b.id.endswith(("Error", "Exception", "Warning"))
                                                 or b.id in errors.__all__)
                    for b in node.bases):
                defined_elsewhere.append(f"{path.relative_to(PACKAGE)}: {node.name}")
    assert not defined_elsewhere, f"define these in zeroengine/errors.py: {defined_elsewhere}"
    for name in errors.__all__:
        assert getattr(zeroengine, name) is getattr(errors, name)
        assert name in zeroengine.__all__


def test_every_raised_name_is_a_builtin_or_ours():
    """``raise X(...)``: X is a builtin exception or one of errors.py's (no third kind; fastai's
    own control-flow exceptions are its callback protocol, not errors)."""
    ours = set(errors.__all__) | {"CancelBackwardException", "CancelStepException"}
    strays = set()
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and \
                    isinstance(node.exc.func, ast.Name):
                name = node.exc.func.id
                if name.endswith(("Error", "Exception")) and name not in ours and \
                        not isinstance(getattr(builtins, name, None), type):
                    strays.add(f"{path.relative_to(PACKAGE)}: {name}")
    assert not strays, strays


def test_no_folder_named_like_build_output():
    skipped = {"dist", "build", "lib", "env", "venv", "var", "parts", "wheels", "eggs"}
    folders = {p.name for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__"}
    assert not folders & skipped


def test_torch_distributed_is_called_from_the_distributed_folder_only():
    allowed = {"deepspeed/comm.py", "checkpoint/dcp_save.py"}
    callers = set()
    for path, tree in _trees():
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("distributed/") or rel in allowed:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""]
                if any(n == "torch.distributed" for n in names):
                    callers.add(rel)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and \
                    isinstance(node.value.value, ast.Name) and node.value.value.id == "torch" \
                    and node.value.attr == "distributed" and node.attr[:1].islower() and \
                    node.attr not in ("checkpoint", "fsdp"):
                callers.add(rel)
    assert not callers, f"call torch.distributed through zeroengine/distributed/: {callers}"
