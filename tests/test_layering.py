"""armdb's modules import downward only (docs/architecture.md, "Layers").

The order is written once, in :data:`LAYERS` below (docs/architecture.md mirrors it and
this test compares the two).  Every import of an armdb module is read with ``ast`` from
the ``.py`` files (at module level and inside functions; ``if TYPE_CHECKING:`` blocks
never run and are skipped) and with a regular expression from the ``import`` and
``cimport`` lines of the ``.pyx`` and ``.pxd`` files.  The test fails when

* a module imports one of a higher layer (same-layer imports are fine);
* the imports form a cycle, even within one layer;
* an armdb module is imported inside a function (such an import only ever hid a cycle;
  an optional heavy third-party dependency may still be imported lazily, with a comment);
* a module that is not an application of the library imports ``armdb.db``: the ``Db``
  is the composition root, and only the package itself and the command-line tools that
  open a database use it;
* a module is in no layer, or the documentation's order differs from this one.

``KNOWN_UPWARD`` and ``KNOWN_LAZY`` allow the imports of modules that other people are
editing at the same time; each entry says what the line should become.  Empty them once
those edits are merged.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "armdb"
DOC = ROOT / "docs" / "architecture.md"

# Bottom first.  A module may import modules of its own layer and of the layers below.
LAYERS: list[tuple[str, list[str]]] = [
    ("errors", ["armdb.errors"]),
    ("kernels", ["armdb._core.*"]),
    ("base", ["armdb._version", "armdb._fail", "armdb._fs", "armdb._clock", "armdb.config", "armdb._pack", "armdb._crypto",
              "armdb._crcshift", "armdb._syncmark", "armdb._objdict"]),
    ("formats", ["armdb.layout", "armdb.qrows", "armdb.qspec", "armdb.mapcodec", "armdb.logformat",
                 "armdb.bitcask.format", "armdb.wire"]),
    ("stores", ["armdb.fixed", "armdb.seqmap", "armdb.bitcask", "armdb.bitcask.*", "armdb.replay", "armdb.txlog",
                "armdb.replication"]),
    ("rules", ["armdb.transitions", "armdb.plan"]),
    ("runtimes", ["armdb.queue", "armdb.maps", "armdb.streams", "armdb.tx"]),
    ("backends", ["armdb.pg", "armdb.pg.*"]),
    ("services", ["armdb.server", "armdb.client", "armdb.worker"]),
    ("root", ["armdb.db"]),
    ("tools", ["armdb.inspect", "armdb.dbkeys", "armdb.check", "armdb.salvage", "armdb._term", "armdb._pgserver", "armdb._bench_pg", "armdb._bench_repl", "armdb._bench", "armdb.cli",
               "armdb.__main__"]),
    ("package", ["armdb"]),
]

# Modules that open a database and so may import armdb.db.
DB_USERS = {"armdb", "armdb.cli", "armdb._bench", "armdb._bench_repl"}

# (importer, imported): allowed for now, each with what the import should become.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}

# (importer, imported): armdb imports still made inside a function, each with what it should become.
KNOWN_LAZY: dict[tuple[str, str], str] = {}


def _layer_of() -> dict[str, int]:
    out: dict[str, int] = {}
    for i, (_, mods) in enumerate(LAYERS):
        for m in mods:
            out[m] = i
    return out


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str, layers: dict[str, int]) -> int | None:
    if module in layers:
        return layers[module]
    if module + ".*" in layers:  # the package of a layer given as "pkg.*"
        return layers[module + ".*"]
    pkg = module.rsplit(".", 1)[0] + ".*" if "." in module else None
    return layers.get(pkg) if pkg else None


def _is_module(name: str) -> bool:
    base = ROOT / Path(*name.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists() or any(
        base.with_suffix(s).exists() for s in (".pyx", ".pxd")
    )


class _Imports(ast.NodeVisitor):
    """(imported module, line, inside a function) of every armdb import of one file."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.package = module if is_package else module.rsplit(".", 1)[0]
        self.found: list[tuple[str, int, bool]] = []
        self.depth = 0

    def _resolve(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = self.package.split(".")
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def _add(self, name: str, line: int) -> None:
        if name == "armdb" or name.startswith("armdb."):
            self.found.append((name, line, self.depth > 0))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = self._resolve(node)
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            self._add(sub if _is_module(sub) else base, node.lineno)

    def visit_If(self, node: ast.If) -> None:
        test = ast.unparse(node.test)
        if test in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def _function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function


_CYTHON_IMPORT = re.compile(r"^\s*(?:from\s+(armdb[\w.]*)\s+c?import\b|c?import\s+(armdb[\w.]*))", re.MULTILINE)


def collect() -> dict[str, list[tuple[str, int, bool, str]]]:
    """module -> [(imported, line, in a function, file)] for every armdb source file."""
    out: dict[str, list[tuple[str, int, bool, str]]] = defaultdict(list)
    for path in sorted(PKG.rglob("*")):
        if "__pycache__" in path.parts or path.suffix not in (".py", ".pyx", ".pxd"):
            continue
        module = _module_name(path)
        rel = str(path.relative_to(ROOT))
        text = path.read_text(encoding="utf-8")
        out.setdefault(module, [])
        if path.suffix == ".py":
            v = _Imports(module, path.name == "__init__.py")
            v.visit(ast.parse(text, rel))
            out[module] += [(name, line, lazy, rel) for name, line, lazy in v.found]
        else:
            for m in _CYTHON_IMPORT.finditer(text):
                name = m.group(1) or m.group(2)
                line = text.count("\n", 0, m.start()) + 1
                out[module].append((name, line, False, rel))
    return out


IMPORTS = collect()
LAYER_OF = _layer_of()


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for module, found in IMPORTS.items():
        for name, _line, _lazy, _file in found:
            if name != module:
                edges[module].add(name)
    return edges


def test_every_module_has_a_layer() -> None:
    missing = sorted(m for m in IMPORTS if _layer(m, LAYER_OF) is None)
    assert not missing, f"modules in no layer of tests/test_layering.py LAYERS: {missing}"
    listed = [m for _, mods in LAYERS for m in mods if not m.endswith(".*")]
    stale = sorted(m for m in listed if m not in IMPORTS)
    assert not stale, f"LAYERS names modules that do not exist: {stale}"


def test_imports_point_down() -> None:
    bad = []
    for module, found in IMPORTS.items():
        mine = _layer(module, LAYER_OF)
        assert mine is not None
        for name, line, _lazy, path in found:
            theirs = _layer(name, LAYER_OF)
            if theirs is None:
                bad.append(f"{path}:{line}: {module} imports {name}, which is in no layer")
            elif theirs > mine and (module, name) not in KNOWN_UPWARD:
                bad.append(f"{path}:{line}: {module} ({LAYERS[mine][0]}) imports {name} ({LAYERS[theirs][0]})")
    assert not bad, "imports that point up the layers:\n" + "\n".join(bad)


def test_no_import_cycles() -> None:
    edges = _edges()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_no_armdb_imports_inside_functions() -> None:
    bad = [
        f"{path}:{line}: {module} imports {name} inside a function"
        for module, found in IMPORTS.items()
        for name, line, lazy, path in found
        if lazy and (module, name) not in KNOWN_LAZY
    ]
    assert not bad, "\n".join(bad)


def test_only_applications_import_the_db() -> None:
    bad = [
        f"{path}:{line}: {module} imports armdb.db"
        for module, found in IMPORTS.items()
        for name, line, _lazy, path in found
        if name == "armdb.db" and module not in DB_USERS and (module, name) not in KNOWN_UPWARD
    ]
    assert not bad, "\n".join(bad)


def test_allowances_are_still_needed() -> None:
    """An entry of KNOWN_UPWARD or KNOWN_LAZY whose import is gone must be removed."""
    seen = {(m, name) for m, found in IMPORTS.items() for name, *_ in found}
    lazy = {(m, name) for m, found in IMPORTS.items() for name, _line, is_lazy, _p in found if is_lazy}
    assert not [k for k in KNOWN_UPWARD if k not in seen]
    assert not [k for k in KNOWN_LAZY if k not in lazy]


def test_the_kernels_import_only_the_errors() -> None:
    """The compiled layer stays below: armdb._core imports nothing of armdb but other
    kernels and armdb.errors (and calls no store method by name, see QueueShard)."""
    bad = [
        f"{path}:{line}: {module} imports {name}"
        for module, found in IMPORTS.items()
        if module.startswith("armdb._core")
        for name, line, _lazy, path in found
        if not (name.startswith("armdb._core") or name == "armdb.errors")
    ]
    assert not bad, "\n".join(bad)


def _doc_layers() -> list[tuple[str, list[str]]]:
    text = DOC.read_text(encoding="utf-8")
    block = re.search(r"<!-- layers: tests/test_layering.py -->\n```text\n(.*?)```", text, re.DOTALL)
    assert block, f"{DOC} has no layer block (see test_the_documentation_has_this_order)"
    out = []
    for line in block.group(1).strip().splitlines():
        name, _, mods = line.partition(":")
        out.append((name.strip(), [m.strip() for m in mods.split(",") if m.strip()]))
    return out[::-1]  # the page lists the top layer first


@pytest.mark.skipif(not DOC.exists(), reason="docs/architecture.md is not written yet")
def test_the_documentation_has_this_order() -> None:
    assert _doc_layers() == LAYERS
