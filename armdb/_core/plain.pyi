"""Stubs for the compiled ``armdb._core.plain`` (see plain.pyx)."""

from typing import Any

def reads_back(values: list[Any]) -> bool: ...
