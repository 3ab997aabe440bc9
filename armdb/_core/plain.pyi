"""Stubs for the compiled ``armdb._core.plain`` (see plain.pyx)."""

from typing import Any

def reads_back(values: list[Any]) -> bool: ...
def reads_back_one(value: Any) -> bool: ...

KIND_ANY: int
KIND_MAP: int
KIND_ARRAY: int
KIND_FIELDS: int
KIND_STR: int
KIND_BIN: int
KIND_INT: int
KIND_FLOAT: int
KIND_BOOL: int

def bodies_decode(raws: list[Any], kind: int, arity: int = 0) -> bool: ...
