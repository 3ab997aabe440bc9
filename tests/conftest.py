"""Shared fixtures: a fake clock, a temp database that is always closed, child runners."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest

import armdb

ROOT = Path(__file__).resolve().parent.parent

_REPORT: dict[str, object] = {}


def pytest_configure(config: pytest.Config) -> None:
    """Collect the harnesses' RELIABILITY lines of this run (children inherit the path)."""
    path = os.environ.get("ARMDB_RELIABILITY_REPORT")
    if not path:
        fd, path = tempfile.mkstemp(prefix="armdb-reliability-", suffix=".txt")
        os.close(fd)
        os.environ["ARMDB_RELIABILITY_REPORT"] = path
        _REPORT["owned"] = True
    _REPORT["path"] = path
    _REPORT["start"] = os.path.getsize(path) if os.path.exists(path) else 0


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the reliability figures table of this run (targets in tests/reliability/figures.py)."""
    from tests.reliability.figures import table

    path = str(_REPORT.get("path", ""))
    if not path or not os.path.exists(path):
        return
    with open(path) as f:
        f.seek(int(typing.cast(int, _REPORT["start"])))
        lines = [ln.strip() for ln in f if ln.startswith("RELIABILITY ")]
    if _REPORT.get("owned"):
        os.unlink(path)
    if not lines:
        return
    text, ok = table(lines)
    terminalreporter.write_sep("=", "reliability figures (docs/reliability.md)")
    terminalreporter.write_line(text)
    terminalreporter.write_line("every violation count is 0 and every size meets its CI target" if ok
                                else "SOME ROW FAILS: see the table above")


class FakeClock:
    """A settable wall clock in milliseconds (SPEC D7)."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self.ms = start_ms

    def __call__(self) -> int:
        return self.ms

    def advance(self, seconds: float) -> None:
        self.ms += int(round(seconds * 1000))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "db"


@pytest.fixture
def db(db_path: Path, clock: FakeClock) -> Iterator[armdb.Db]:
    d = armdb.Db.open(db_path, clock=clock)
    try:
        yield d
    finally:
        d.shutdown()


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("ARMDB_FAILPOINT", None)
    env.update(extra)
    return env


def run_child(code: str, *, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter with armdb importable; returns the result."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env or child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def spawn_child(code: str, *, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start ``code`` in a child with line-buffered stdout (for kill -9 tests)."""
    return subprocess.Popen(
        [sys.executable, "-u", "-c", textwrap.dedent(code)],
        env=env or child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def kill_and_read(p: subprocess.Popen[str]) -> tuple[str, str]:
    """SIGKILL a :func:`spawn_child` child and return the rest of its stdout and stderr.

    Reads through the same text wrappers a caller's ``p.stdout.readline()`` used:
    ``communicate()`` reads the raw pipes, so whatever ``readline`` had buffered past its
    line would be lost, and the first line it returned could start in the middle of one
    (a job id cut to its last digits)."""
    os.kill(p.pid, signal.SIGKILL)
    assert p.stdout is not None and p.stderr is not None
    with p.stdout, p.stderr:
        out, err = p.stdout.read(), p.stderr.read()  # the child is dead: both reach EOF
    p.wait()
    return out, err


# -- PostgreSQL (armdb.pg, SPEC G8) ---------------------------------------------------------------


@pytest.fixture(scope="session")
def pg_server() -> Iterator[typing.Any]:
    """One real PostgreSQL server for the whole run (tests/pgserver.py); fails, never
    skips, when none can be started."""
    from tests import pgserver

    try:
        srv = pgserver.start()
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)
    yield srv
    srv.close()


_pg_namespaces = iter(range(1, 1 << 30))


@pytest.fixture
def pg_namespace(pg_server: typing.Any) -> str:
    """A fresh namespace (PostgreSQL schema) for one test."""
    return f"t{os.getpid()}_{next(_pg_namespaces)}"


@pytest.fixture
def pg_dsn(pg_server: typing.Any) -> str:
    return str(pg_server.dsn)


@pytest.fixture
def owner(tmp_path: Path) -> Iterator[tuple[armdb.Db, typing.Any]]:
    """A database that serves other processes (``db.serve()``) and its server."""
    db = armdb.Db.open(tmp_path / "db")
    srv = db.serve()
    try:
        yield db, srv
    finally:
        db.shutdown()
