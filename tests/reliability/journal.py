"""The journal of intents and completions, the job payload format, summaries and artifacts.

A worker child writes one journal file.  Every record is one line written with a
single ``os.write`` on an ``O_APPEND`` descriptor, so a SIGKILL leaves whole lines
behind (the page cache survives a process kill; no fsync is needed).  The parent
ignores a trailing partial line.  Before each call the child writes an *intent*
(``X?``); after the call returns it writes a *completion* (``X!``, or ``X~`` when the
call was refused with ``StaleToken``).  An intent without a completion is an
operation the kill interrupted: its outcome is unknown until the reopened database
shows it (docs/reliability.md, Shared pieces).

Records (fields separated by one space; ``q`` is ``f`` for the fixed queue, ``v`` for
the var queue)::

    O?                              open started
    O! orphans                      open finished; orphan bodies collected by this open
    P? q n len                      push of job n (payload length len) invoked
    P! q n id                       push returned row id
    L? q k t_ms                     lease(k) invoked at wall time t_ms
    L! q id n att epoch shard due deadline_ms ok handle
                                    one leased row: job n (parsed from its payload),
                                    attempt att, token fields, ok=1 if the payload bytes
                                    are exactly make_payload(n, ...)
    L. q count t_ms                 lease returned count rows at wall time t_ms
    A? q id n  /  A! q id n  /  A~ q id n             ack
    N? q id n kind  /  N! q id n kind  /  N~ ...      nack, kind = retry | dead
    T? q id n fq m  /  T! q id n fq m mid  /  T~ q id n fq m
                                    outbox transaction: put(effects, n) + ack(q, token)
                                    + (m > 0) push of follow-up job m to queue fq
    X kind message                  an exception the harness did not expect
    V ...                           verifier (parent) records, same verbs

Job payloads embed the job number and a digest (``make_payload``), so a wrong,
truncated or swapped body is detected by ``parse_payload``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

FIXED_PAYLOAD = 64  # bytes of the fixed queue's inline payload
_HEAD_LEN = len(b"J0000000000:00000:")


# -- payloads ---------------------------------------------------------------------------------------


def make_payload(n: int, length: int) -> bytes:
    """The body of job ``n``: ``J<n>:<len>:`` + sha256 digest + deterministic filler."""
    length = max(length, _HEAD_LEN + 16)
    head = b"J%010d:%05d:" % (n, length)
    digest = hashlib.sha256(head).digest()
    body = head + digest * (length // 32 + 1)
    return body[:length]


def parse_payload(raw: bytes) -> int | None:
    """The job number of a well-formed body, or ``None`` for wrong bytes."""
    if len(raw) < _HEAD_LEN + 16 or raw[:1] != b"J" or raw[11:12] != b":" or raw[17:18] != b":":
        return None
    try:
        n = int(raw[1:11])
        length = int(raw[12:17])
    except ValueError:
        return None
    if length != len(raw) or make_payload(n, length) != raw:
        return None
    return n


# -- writing --------------------------------------------------------------------------------------


class Journal:
    """Append-only journal writer: one ``os.write`` per record (crash-safe lines)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, *fields: object) -> None:
        line = " ".join(str(f).replace(" ", "_").replace("\n", "|") for f in fields) + "\n"
        os.write(self.fd, line.encode())

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def now_ms() -> int:
    """Wall-clock milliseconds, the same value armdb's default clock persists."""
    return time.time_ns() // 1_000_000


# -- reading --------------------------------------------------------------------------------------


def read_journal(path: str | os.PathLike[str]) -> list[list[str]]:
    """Complete records of one journal file (a torn last line is dropped)."""
    raw = Path(path).read_bytes()
    lines = raw.split(b"\n")
    # The element after the last newline is either b"" or a torn line: drop it.
    return [ln.decode().split(" ") for ln in lines[:-1] if ln]


def journal_files(directory: str | os.PathLike[str]) -> list[Path]:
    """Journal files of a directory in the order they were written (names sort by sequence)."""
    d = Path(directory)
    return sorted(d.glob("*.log")) if d.is_dir() else []


def iter_records(paths: Iterable[Path]) -> Iterator[tuple[str, list[list[str]]]]:
    for p in paths:
        yield p.name, read_journal(p)


# -- reporting and artifacts -------------------------------------------------------------------------


@contextlib.contextmanager
def quiet_armdb_log() -> Iterator[None]:
    """Silence the ``armdb`` logger: recovery warnings are expected by the thousand in the
    crash, fault and corruption harnesses."""
    lg = logging.getLogger("armdb")
    level = lg.level
    lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        lg.setLevel(level)


def report_line(line: str, request: Any = None) -> None:
    """Print a harness's ``RELIABILITY ...`` line and append it to ``$ARMDB_RELIABILITY_REPORT``
    (which ``tests/conftest.py`` turns into the figures table).  With a pytest
    ``request``, the line is printed past output capturing."""
    capman = request.config.pluginmanager.get_plugin("capturemanager") if request is not None else None
    if capman is not None:
        with capman.global_and_fixture_disabled():
            print("\n" + line, flush=True)
    else:
        print("\n" + line, flush=True)
    target = os.environ.get("ARMDB_RELIABILITY_REPORT")
    if target:
        with open(target, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def summary_line(harness: str, fields: dict[str, object]) -> str:
    """``RELIABILITY <harness> k=v ...``, reported with :func:`report_line`."""
    line = "RELIABILITY " + harness + " " + " ".join(f"{k}={v}" for k, v in fields.items())
    report_line(line)
    return line


def save_artifacts(harness: str, seed: int, paths: Iterable[Path], replay: str, note: str = "") -> Path:
    """Copy the database directories and journals of a failed run under ``$TMPDIR/armdb-fail-*``.

    Prints (and returns) the artifact directory and a one-line replay command.
    """
    base = Path(tempfile.mkdtemp(prefix=f"armdb-fail-{harness}-{seed}-", dir=tempfile.gettempdir()))
    for p in paths:
        p = Path(p)
        if not p.exists():
            continue
        dest = base / p.name
        if p.is_dir():
            shutil.copytree(p, dest, dirs_exist_ok=True, symlinks=True)
        else:
            shutil.copy2(p, dest)
    (base / "SEED").write_text(f"{seed}\n")
    (base / "REPLAY").write_text(replay + "\n")
    if note:
        (base / "NOTES").write_text(note + "\n")
    print(f"\nARTIFACTS {base}\nREPLAY {replay}", flush=True)
    return base
