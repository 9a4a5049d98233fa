"""The package version (one place; `slidedp.__version__` and plans read it)."""

__version__ = "0.1.0"
