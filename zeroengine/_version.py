"""The package version, in one place: zeroengine.__version__ and pyproject.toml (setuptools'
[tool.setuptools.dynamic]) read it."""
__version__ = "0.1.0"
