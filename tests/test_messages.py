"""Messages a user reads speak to users: no rule ids of the rule book in them.

Rule ids (``S7``, ``Q14``, ``SPEC D3``) belong in docstrings and comments, where a
reader looks them up in ``docs/spec.md``.  A user who sees an exception, a log line
or ``python -m armdb --help`` needs to read what happened and what to do instead.

This test parses every module of ``armdb/`` with ``ast`` and collects the string
literals (including the literal parts of f-strings, and module-level string constants
a message names, such as ``errors.SALVAGE_HINT``) that reach a user through:

* ``raise X(...)``, and any call that builds an exception (``StorageError(...)`` kept
  in a variable, ``super().__init__(...)`` in an exception class);
* a log or warning call: ``log.warning(...)``, ``logging.error(...)``, ``warnings.warn(...)``;
* argparse texts: ``help=``, ``description=``, ``epilog=``, ``usage=``, ``title=``, and
  ``parser.error(...)`` / ``sys.exit("...")``;
* what the command line prints: ``print(...)``, and what ``__str__`` returns (the CLI
  prints ``SalvageReport`` and ``CheckReport``).

It fails on a rule id in any of them, naming ``file:line`` and the text.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import pkgutil
import re
from collections.abc import Iterator
from pathlib import Path

import armdb

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "armdb"

# A rule id of the rule book (docs/spec.md): a family letter and a number.
RULE_ID = re.compile(r"\b[DSQTCPGR][0-9]{1,2}\b")
# "SPEC" or "spec section" wording sends the user to a document they may not have.
SPEC_WORD = re.compile(r"\bSPEC\b")

LOG_RECEIVERS = {"log", "logger", "_log", "_logger", "LOG", "logging", "warnings"}
LOG_METHODS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "log"}
TEXT_KEYWORDS = {"help", "description", "epilog", "usage", "title"}


def _exception_names() -> set[str]:
    """Names of every exception class: builtins, and the classes armdb defines."""
    names = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
    mods = [armdb] + [
        importlib.import_module(f"armdb.{m.name}") for m in pkgutil.iter_modules(armdb.__path__)
        if m.name != "__main__"
    ]
    for mod in mods:
        for n, v in vars(mod).items():
            if isinstance(v, type) and issubclass(v, BaseException):
                names.add(n)
    return names


def _module_constants(files: list[Path]) -> dict[str, list[str]]:
    """Module-level string constants (``NAME = "..."``) of every module, by name."""
    out: dict[str, list[str]] = {}
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        for node in tree.body:
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            texts = [s for s, _ in _strings(value, {})]
            if not texts:
                continue
            for t in targets:
                if isinstance(t, ast.Name) and t.id.isupper():
                    out.setdefault(t.id, []).extend(texts)
    return out


def _strings(node: ast.AST, constants: dict[str, list[str]]) -> Iterator[tuple[str, int]]:
    """Every string literal inside ``node`` (f-string parts included), and the string
    constants it names, with their line numbers."""
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            yield n.value, n.lineno
        elif isinstance(n, ast.Name) and n.id in constants:
            for text in constants[n.id]:
                yield text, n.lineno
        elif isinstance(n, ast.Attribute) and n.attr in constants and n.attr.isupper():
            for text in constants[n.attr]:
                yield text, n.lineno


def _callee(call: ast.Call) -> tuple[str | None, str]:
    """(receiver name, function name) of ``recv.f(...)`` or (None, "f") of ``f(...)``."""
    f = call.func
    if isinstance(f, ast.Name):
        return None, f.id
    if isinstance(f, ast.Attribute):
        recv = f.value
        if isinstance(recv, ast.Name):
            return recv.id, f.attr
        if isinstance(recv, ast.Call) and isinstance(recv.func, ast.Name):
            return recv.func.id + "()", f.attr  # super().__init__
        if isinstance(recv, ast.Attribute):
            return recv.attr, f.attr
        return "?", f.attr
    return None, ""


class _Finder(ast.NodeVisitor):
    def __init__(self, path: Path, exceptions: set[str], constants: dict[str, list[str]]) -> None:
        self.path = path
        self.exceptions = exceptions
        self.constants = constants
        self.classes: list[bool] = []  # whether each enclosing class is an exception
        self.functions: list[str] = []  # names of the enclosing functions
        self.found: list[tuple[int, str, str]] = []  # (line, what, text)

    def _take(self, node: ast.AST, what: str) -> None:
        for text, line in _strings(node, self.constants):
            self.found.append((line, what, text))

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        base_names = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
        self.classes.append(bool(base_names & self.exceptions))
        self.generic_visit(node)
        self.classes.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_Return(self, node: ast.Return) -> None:
        if node.value is not None and self.functions and self.functions[-1] == "__str__":
            self._take(node.value, "__str__")
        self.generic_visit(node)

    def visit_Raise(self, node: ast.Raise) -> None:
        # ``raise SomeError(...)`` is read by visit_Call; this reads ``raise helper(...)``.
        if isinstance(node.exc, ast.Call) and _callee(node.exc)[1] not in self.exceptions:
            for arg in [*node.exc.args, *(k.value for k in node.exc.keywords)]:
                self._take(arg, "raise")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        recv, name = _callee(node)
        args = [*node.args, *(k.value for k in node.keywords)]
        if recv is None and name in self.exceptions:
            for arg in args:
                self._take(arg, f"{name}(...)")
        elif recv == "super()" and name == "__init__" and self.classes and self.classes[-1]:
            for arg in args:
                self._take(arg, "exception message")
        elif recv in LOG_RECEIVERS and name in LOG_METHODS:
            for arg in args:
                self._take(arg, f"{recv}.{name}")
        elif name == "error" and recv is not None and "parser" in recv:
            for arg in args:
                self._take(arg, "parser.error")
        elif recv == "sys" and name == "exit":
            for arg in args:
                self._take(arg, "sys.exit")
        elif recv is None and name == "print":
            for arg in node.args:
                self._take(arg, "print")
        for k in node.keywords:
            if k.arg in TEXT_KEYWORDS:
                self._take(k.value, f"{k.arg}=")
        self.generic_visit(node)


def _package_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def user_messages() -> list[tuple[str, int, str, str]]:
    """(file, line, where it goes, text) of every string a user can read."""
    files = _package_files()
    exceptions = _exception_names()
    constants = _module_constants(files)
    out = []
    for path in files:
        finder = _Finder(path, exceptions, constants)
        finder.visit(ast.parse(path.read_text(), str(path)))
        rel = str(path.relative_to(ROOT))
        out.extend((rel, line, what, text) for line, what, text in finder.found)
    return out


def rule_ids(text: str) -> list[str]:
    return RULE_ID.findall(text) + SPEC_WORD.findall(text)


def test_user_messages_cite_no_rule_ids() -> None:
    bad = [
        f"{rel}:{line}: {what} {text!r} cites {', '.join(rule_ids(text))}"
        for rel, line, what, text in user_messages()
        if rule_ids(text)
    ]
    assert not bad, (
        "user-facing messages must say what happened and what to do, without rule ids "
        "(cite the rule in a comment or docstring instead):\n" + "\n".join(bad)
    )


def test_the_scan_sees_messages() -> None:
    """The collector is not vacuous: it finds known messages of each kind."""
    found = {(rel, what, text) for rel, _, what, text in user_messages()}
    texts_by_kind: dict[str, set[str]] = {}
    for rel, what, text in found:
        texts_by_kind.setdefault(what, set()).add(text)
    assert any("is closed; open the database again" in t for t in texts_by_kind.get("exception message", ()))
    assert any("must be an int, not " in t for t in texts_by_kind.get("ConfigError(...)", ()))
    assert any("failed: " in t for t in texts_by_kind.get("StorageError(...)", ()))  # kept in a variable
    assert any(k.startswith(("log.", "logging.")) for k in texts_by_kind)
    assert texts_by_kind.get("help=")
    # A module-level constant a message names is read too.
    assert any("python -m armdb salvage" in t for ts in texts_by_kind.values() for t in ts)


def test_the_pattern_finds_rule_ids() -> None:
    assert rule_ids("the log was refused (S7); see SPEC D3") == ["S7", "D3", "SPEC"]
    assert rule_ids("Q14: settle") == ["Q14"]
    assert rule_ids("dtype '<u8' of 16 bytes, at most 4096") == []
