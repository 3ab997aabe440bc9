"""The package version, in one place (pyproject.toml repeats it; tests/test_cli.py ties them)."""

__version__ = "0.1.0"
