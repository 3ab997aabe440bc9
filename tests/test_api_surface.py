"""The public API surface of armdb, recorded in ``tests/api_surface.txt``.

An accidental change to what users can call (a renamed parameter, a new default, a
dropped method, an exception moved in the hierarchy) fails this test with a unified
diff of the recorded surface.  When the change is on purpose, rewrite the file and
commit it with the change, so the diff shows up in review:

    ARMDB_UPDATE_SURFACE=1 .venv/bin/python -m pytest -q tests/test_api_surface.py

What is recorded, one line per name:

* ``armdb.__all__``, and the ``__all__`` of every module it exports (``armdb.errors``);
* every function in them, with its signature;
* every class in them, every class in ``armdb.errors``, and every armdb class that a
  recorded signature, property or field names in its annotations, followed until no
  new class turns up (``Db.open_map`` returns ``Map``, so ``armdb.maps.Map`` is
  recorded), plus ``EXTRA_ROOTS`` that are public but annotated ``Any``;
* for each class: its kind and bases; its public methods (and the dunders armdb's own
  source defines, such as ``__enter__``), static and class methods with signatures;
  properties with their type; dataclass and NamedTuple fields in order with type and
  default; enum members; and the public attributes its methods assign as ``self.x``.

Annotations are rendered from their source text (every armdb module uses ``from
__future__ import annotations``), normalised by ``ast.unparse``, and defaults by
``repr`` with memory addresses removed, so the text is the same on Python 3.11-3.13.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import enum
import functools
import importlib
import inspect
import os
import pkgutil
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pytest

import armdb

ROOT = Path(__file__).resolve().parent.parent
SURFACE_FILE = ROOT / "tests" / "api_surface.txt"
UPDATE_ENV = "ARMDB_UPDATE_SURFACE"
PACKAGE_DIR = Path(armdb.__file__).resolve().parent

# Public classes that no annotation reaches: ``Db.tx()`` is annotated ``Any``; the class
# ``Db.open_bitcask`` returns is defined in a submodule (``armdb.bitcask.store``), which
# the class index of the top-level modules does not list.
EXTRA_ROOTS = ("armdb.tx.Tx", "armdb.bitcask.BitcaskStore")

# Dunders armdb's source defines that are not part of what a user calls.
_SKIPPED_DUNDERS = {"__post_init__", "__init_subclass__", "__class_getitem__", "__del__"}

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


# -- rendering ---------------------------------------------------------------------------------


def _annotation(ann: Any) -> str:
    """An annotation as source text: the string ``from __future__ import annotations``
    keeps, normalised, so that spacing or quoting in the source does not matter.
    NamedTuple wraps its field annotations in ``typing.ForwardRef``."""
    if isinstance(ann, typing.ForwardRef):
        ann = ann.__forward_arg__
    if isinstance(ann, str):
        try:
            return ast.unparse(ast.parse(ann, mode="eval"))
        except SyntaxError:
            return ann
    return inspect.formatannotation(ann)


def _default(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    return _ADDRESS.sub("", repr(value))


def _signature(func: Any, *, drop_first: bool = False, notes: list[str] | None = None) -> str:
    """``(a: int, /, b: str = 'x', *, c: bool = False) -> None``, rendered by hand so
    the text does not depend on how a Python version prints a Signature."""
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return "(<signature not available>)"
    params = list(sig.parameters.values())
    if drop_first and params:
        params = params[1:]
    out: list[str] = []
    kinds = inspect.Parameter
    need_slash = False
    star_written = False
    for p in params:
        if need_slash and p.kind is not kinds.POSITIONAL_ONLY:
            out.append("/")
            need_slash = False
        if p.kind is kinds.KEYWORD_ONLY and not star_written:
            out.append("*")
            star_written = True
        text = p.name
        if p.kind is kinds.VAR_POSITIONAL:
            text = "*" + p.name
            star_written = True
        elif p.kind is kinds.VAR_KEYWORD:
            text = "**" + p.name
        if p.annotation is not p.empty:
            text += ": " + _annotation(p.annotation)
            if notes is not None:
                notes.append(p.annotation)
        if p.default is not p.empty:
            text += (" = " if p.annotation is not p.empty else "=") + _default(p.default)
        out.append(text)
        if p.kind is kinds.POSITIONAL_ONLY:
            need_slash = True
    if need_slash:
        out.append("/")
    text = "(" + ", ".join(out) + ")"
    if sig.return_annotation is not sig.empty:
        text += " -> " + _annotation(sig.return_annotation)
        if notes is not None:
            notes.append(sig.return_annotation)
    return text


# -- what is public --------------------------------------------------------------------------


def _public_modules() -> list[types.ModuleType]:
    """armdb and its submodules without a leading underscore (not the kernels in _core)."""
    mods = [armdb]
    for info in pkgutil.iter_modules(armdb.__path__):
        if not info.name.startswith("_"):
            mods.append(importlib.import_module(f"armdb.{info.name}"))
    return mods


def _class_index(mods: list[types.ModuleType]) -> dict[str, list[type]]:
    """Public classes defined in armdb's public modules, by name."""
    index: dict[str, list[type]] = {}
    for mod in mods:
        for name, obj in vars(mod).items():
            if isinstance(obj, type) and not name.startswith("_") and obj.__module__ == mod.__name__:
                index.setdefault(name, []).append(obj)
    return index


def _public_path(obj: Any) -> str:
    """``armdb.Name`` for what ``armdb`` exports, else where it is defined."""
    for name in armdb.__all__:
        if getattr(armdb, name, None) is obj:
            return f"armdb.{name}"
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    return f"{obj.__module__}.{obj.__qualname__}"


def _type_name(cls: type) -> str:
    if cls.__module__ == "builtins":
        return cls.__qualname__
    if cls.__module__.startswith("armdb"):
        return _public_path(cls)
    return f"{cls.__module__}.{cls.__qualname__}"


def _own_code(func: Any) -> bool:
    """Whether ``func`` is written in armdb's source (not made by dataclass, NamedTuple,
    enum or typing, whose generated functions come from ``<string>`` or the stdlib)."""
    code = getattr(inspect.unwrap(func), "__code__", None)
    if code is None:
        return False
    try:
        return Path(code.co_filename).resolve().is_relative_to(PACKAGE_DIR)
    except OSError:
        return False


def _unwrapped(value: Any) -> Any:
    if isinstance(value, (staticmethod, classmethod)):
        return value.__func__
    if isinstance(value, property):
        return value.fget
    if isinstance(value, functools.cached_property):
        return value.func
    return value


def _is_public(name: str, value: Any) -> bool:
    if not name.startswith("_"):
        return True
    if name.startswith("__") and name.endswith("__") and name not in _SKIPPED_DUNDERS:
        return _own_code(_unwrapped(value))
    return False


def _self_attributes(cls: type) -> set[str]:
    """Public names assigned as ``self.name`` in the class's own methods."""
    try:
        tree = ast.parse(Path(inspect.getsourcefile(cls) or "").read_text())
    except (OSError, TypeError):
        return set()
    node: ast.AST = tree
    for part in cls.__qualname__.split("."):
        node = next(
            (n for n in ast.iter_child_nodes(node) if isinstance(n, ast.ClassDef) and n.name == part),
            None,
        )  # type: ignore[assignment]
        if node is None:
            return set()
    names = set()
    for n in ast.walk(node):
        targets: list[ast.expr] = []
        if isinstance(n, ast.Assign):
            targets = n.targets
        elif isinstance(n, (ast.AnnAssign, ast.AugAssign)):
            targets = [n.target]
        for t in targets:
            for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                if (
                    isinstance(el, ast.Attribute)
                    and isinstance(el.value, ast.Name)
                    and el.value.id == "self"
                    and not el.attr.startswith("_")
                ):
                    names.add(el.attr)
    return names


# -- the surface -----------------------------------------------------------------------------


class _Surface:
    def __init__(self) -> None:
        self.mods = _public_modules()
        self.index = _class_index(self.mods)
        self.lines: dict[str, list[str]] = {}  # block path -> its lines
        self.pending: list[type] = []  # classes to record
        self.done: set[int] = set()

    # Annotations name classes; queue the armdb ones for recording.
    def _follow(self, annotations: list[Any], home: str) -> None:
        for ann in annotations:
            if isinstance(ann, typing.ForwardRef):
                ann = ann.__forward_arg__
            if not isinstance(ann, str):
                continue
            try:
                tree = ast.parse(ann, mode="eval")
            except SyntaxError:
                continue
            for n in ast.walk(tree):
                if isinstance(n, ast.Constant) and isinstance(n.value, str):
                    self._follow([n.value], home)
                elif isinstance(n, ast.Name) and n.id in self.index:
                    candidates = self.index[n.id]
                    local = [c for c in candidates if c.__module__ == home]
                    self.pending.extend(local or candidates)

    def function(self, path: str, func: Any) -> None:
        notes: list[Any] = []
        kind = "async function" if inspect.iscoroutinefunction(func) else "function"
        self.lines[path] = [f"{path}: {kind} {_signature(func, notes=notes)}"]
        self._follow(notes, getattr(func, "__module__", "") or "")

    def module(self, path: str, mod: types.ModuleType) -> None:
        names = sorted(getattr(mod, "__all__", []))
        self.lines[path] = [f"{path}: module"] + [f"{path}.__all__: {n}" for n in names]
        for n in names:
            self.root(getattr(mod, n))

    def root(self, obj: Any) -> None:
        path = _public_path(obj)
        if isinstance(obj, type):
            self.pending.append(obj)
        elif isinstance(obj, types.ModuleType):
            if path not in self.lines:
                self.module(path, obj)
        elif callable(obj):
            self.function(path, obj)
        else:
            self.lines[path] = [f"{path}: {type(obj).__name__} = {_default(obj)}"]

    def drain(self) -> None:
        while self.pending:
            cls = self.pending.pop()
            if id(cls) not in self.done:
                self.done.add(id(cls))
                self.klass(cls)

    def klass(self, cls: type) -> None:
        path = _public_path(cls)
        home = cls.__module__
        bases = [_type_name(b) for b in cls.__bases__ if b is not object]
        bases_text = f" ({', '.join(bases)})" if bases else ""
        notes: list[Any] = []
        ordered: list[str] = []  # fields and enum members, in declaration order
        members: list[str] = []  # the rest, sorted by name below
        skip: set[str] = set()
        if issubclass(cls, BaseException):
            kind = "exception"
        elif issubclass(cls, enum.Enum):
            kind = "enum"
            for name, member in cls.__members__.items():
                ordered.append(f"{path}.{name}: member = {member.value!r}")
                skip.add(name)
        elif dataclasses.is_dataclass(cls):
            frozen = cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
            kind = f"dataclass(frozen={frozen})"
            for i, f in enumerate(dataclasses.fields(cls)):
                skip.add(f.name)
                if f.name.startswith("_"):
                    continue
                text = f"{path}.{f.name}: field {i}: {_annotation(f.type)}"
                notes.append(f.type)
                if f.default is not dataclasses.MISSING:
                    text += f" = {_default(f.default)}"
                elif f.default_factory is not dataclasses.MISSING:
                    text += f" = <factory> {_default(f.default_factory())}"
                if not f.init:
                    text += " (init=False)"
                if f.kw_only:
                    text += " (keyword-only)"
                ordered.append(text)
        elif issubclass(cls, tuple) and hasattr(cls, "_fields"):
            kind = "namedtuple"
            anns = cls.__dict__.get("__annotations__", {})
            defaults = getattr(cls, "_field_defaults", {})
            for i, name in enumerate(cls._fields):  # type: ignore[attr-defined]
                skip.add(name)
                text = f"{path}.{name}: field {i}"
                if name in anns:
                    text += f": {_annotation(anns[name])}"
                    notes.append(anns[name])
                if name in defaults:
                    text += f" = {_default(defaults[name])}"
                ordered.append(text)
        else:
            kind = "class"
        seen: set[str] = set(skip)
        for klass in cls.__mro__:
            if not klass.__module__.startswith("armdb"):
                continue
            for name, value in vars(klass).items():
                if name in seen or not _is_public(name, value):
                    continue
                seen.add(name)
                line = self._member(path, name, value, notes)
                if line is not None:
                    members.append(line)
        for name in sorted(_self_attributes(cls) - seen):
            members.append(f"{path}.{name}: attribute")
        self.lines[path] = [f"{path}: {kind}{bases_text}"] + ordered + sorted(members)
        self._follow(notes, home)

    def _member(self, path: str, name: str, value: Any, notes: list[Any]) -> str | None:
        full = f"{path}.{name}"
        if isinstance(value, staticmethod):
            return f"{full}: staticmethod {_signature(value.__func__, notes=notes)}"
        if isinstance(value, classmethod):
            return f"{full}: classmethod {_signature(value.__func__, drop_first=True, notes=notes)}"
        if isinstance(value, (property, functools.cached_property)):
            getter = _unwrapped(value)
            ret = inspect.signature(getter).return_annotation if getter else inspect.Signature.empty
            text = f"{full}: property"
            if ret is not inspect.Signature.empty:
                text += f" -> {_annotation(ret)}"
                notes.append(ret)
            if isinstance(value, property) and value.fset is not None:
                text += " (settable)"
            return text
        if inspect.isfunction(value):
            if inspect.iscoroutinefunction(value):
                kind = "async method"
            elif inspect.isasyncgenfunction(value):
                kind = "async generator method"
            else:
                kind = "method"
            return f"{full}: {kind} {_signature(value, notes=notes)}"
        if isinstance(value, type):
            self.pending.append(value)
            return f"{full}: nested class"
        if callable(value):
            return f"{full}: callable {_signature(value, notes=notes)}"
        if isinstance(value, (int, float, str, bytes, bool, type(None), tuple, frozenset)):
            return f"{full}: attribute = {_default(value)}"
        return f"{full}: attribute of type {_type_name(type(value))}"


def current_surface() -> list[str]:
    s = _Surface()
    all_names = sorted(armdb.__all__)
    s.lines["armdb"] = ["armdb: module"] + [f"armdb.__all__: {n}" for n in all_names]
    for name in all_names:
        s.root(getattr(armdb, name))
    for cls in vars(armdb.errors).values():
        if isinstance(cls, type) and cls.__module__ == "armdb.errors" and not cls.__name__.startswith("_"):
            s.root(cls)
    for dotted in EXTRA_ROOTS:
        mod, _, name = dotted.rpartition(".")
        s.root(getattr(importlib.import_module(mod), name))
    s.drain()
    out: list[str] = []
    for path in sorted(s.lines, key=lambda p: (p != "armdb", p)):
        out.extend(s.lines[path])
    return out


def test_public_api_surface_is_unchanged() -> None:
    current = current_surface()
    text = "\n".join(current) + "\n"
    if os.environ.get(UPDATE_ENV) == "1":
        SURFACE_FILE.parent.mkdir(parents=True, exist_ok=True)
        SURFACE_FILE.write_text(text)
        print(f"rewrote {SURFACE_FILE.relative_to(ROOT)} ({len(current)} lines)", file=sys.stderr)
        return
    expected = SURFACE_FILE.read_text().splitlines() if SURFACE_FILE.exists() else []
    if expected == current:
        return
    diff = "\n".join(
        difflib.unified_diff(
            expected, current, fromfile=f"{SURFACE_FILE.relative_to(ROOT)} (recorded)",
            tofile="armdb (now)", lineterm="", n=1,
        )
    )
    pytest.fail(
        "armdb's public API surface changed ('-' recorded, '+' now):\n\n"
        f"{diff}\n\n"
        "If this change is accidental, restore the recorded signature.  If it is on purpose, "
        "rewrite the record and commit it with the change:\n"
        f"    {UPDATE_ENV}=1 .venv/bin/python -m pytest -q tests/test_api_surface.py",
        pytrace=False,
    )


def test_surface_lines_are_unique() -> None:
    current = current_surface()
    assert len(current) == len(set(current)), [ln for ln in current if current.count(ln) > 1]
