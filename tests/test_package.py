"""The package's house rules, checked from its source: every exception the package raises is
defined in zeroengine/errors.py and importable from ``zeroengine``; no package folder carries a
name that .gitignore templates and linters skip; torch.distributed is called only from
zeroengine/distributed/ (and the DeepSpeed facade, and DCP's own save); the imports between
the package's folders run one way (no circle)."""
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


def _unit(module: str) -> str | None:
    """The package's folder (or top-level module) a dotted module name belongs to."""
    parts = module.split(".")
    if parts[0] != "zeroengine" or len(parts) < 2:
        return None  # another package, or zeroengine/__init__.py (the facade over all of them)
    return parts[1]


def _from_target(path: pathlib.Path, node: ast.ImportFrom) -> str:
    """The dotted module a ``from ... import`` in ``path`` reads from (relative ones resolved
    from the file's folder; a folder's __init__.py: the folder itself)."""
    package = ["zeroengine", *path.relative_to(PACKAGE).parent.parts]
    base = package[:len(package) - node.level + 1] if node.level else []
    return ".".join(base + ([node.module] if node.module else []))


def _imports(path: pathlib.Path, tree: ast.AST) -> set[str]:
    """Dotted names of the modules ``path`` imports (relative imports resolved)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(path, node)
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)  # `from . import x`
    return found


def test_no_import_circle_between_the_package_folders():
    """core/ may use checkpoint/, config/, distributed/, ops/ ... but none of what it uses may
    use core/ back: every arrow between the package's folders points one way."""
    arrows: dict[str, set[str]] = {}
    for path, tree in _trees():
        source = _unit(".".join(["zeroengine", *path.relative_to(PACKAGE).with_suffix("").parts]))
        if source in (None, "__init__", "__main__"):
            continue
        for module in _imports(path, tree):
            target = _unit(module)
            if target not in (None, source) and ((PACKAGE / target).is_dir()
                                                 or (PACKAGE / f"{target}.py").exists()):
                arrows.setdefault(source, set()).add(target)

    def reaches(start: str, goal: str, seen: set) -> bool:
        for nxt in arrows.get(start, ()):
            if nxt == goal or (nxt not in seen and not seen.add(nxt) and reaches(nxt, goal, seen)):
                return True
        return False

    circles = sorted(f"{a} <-> {b}" for a in arrows for b in arrows[a]
                     if a < b and reaches(b, a, set()))
    assert not circles, circles


def test_every_import_of_the_package_resolves():
    """Each ``from <zeroengine module> import name`` in the package - the ones inside functions
    too, which only run when that path is taken - names a module that exists and a name it
    has: a file moved between folders cannot leave a lazy import behind."""
    import importlib
    missing = []
    for path, tree in _trees():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            target = _from_target(path, node)
            if not target.startswith("zeroengine"):
                continue
            try:
                module = importlib.import_module(target)
            except ModuleNotFoundError as e:
                missing.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {target} ({e})")
                continue
            for alias in node.names:
                if not hasattr(module, alias.name) and importlib.util.find_spec(
                        f"{target}.{alias.name}") is None:
                    missing.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: "
                                   f"{alias.name} from {target}")
    assert not missing, missing
