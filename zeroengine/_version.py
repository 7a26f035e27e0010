"""The package version, in one place: zeroengine.__version__ and setup.py read it."""
__version__ = "0.1.0"
