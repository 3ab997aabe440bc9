"""The lean lone var cycle (issue 17, round 7): what its shortcuts must keep true.

- A disarmed failpoint is a compiled no-op, rebound by ``_fail._configure``: arming one
  makes ``_fail.point`` the checking function again, and every registered point still
  stops the process (tests/reliability/test_failpoints.py runs each in a child).
- A lone var ack appends its record body packed in one call (``TxLog.append_body``):
  the log record must decode to the same two rows, in the same one record, as the
  general commit writes (a header delete and the body's tombstone), so replay applies
  both or neither.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgpack

from armdb import Db, _fail, logformat, queue
from armdb._core.atomicfile import disarmed_point
from armdb.fixed import DELETED


def test_failpoint_binding_follows_configure() -> None:
    # SPEC D8: a failpoint set by name stops the process there; none set costs nothing
    assert _fail.point is disarmed_point
    try:
        _fail._configure("txlog.after_append:5")
        assert _fail.point is _fail.armed_point and _fail.armed()
        _fail.point("bitcask.after_append")  # another point: passes
    finally:
        _fail._configure(None)
    assert _fail.point is disarmed_point and not _fail.armed()


def test_armed_failpoint_exits_in_a_child(tmp_path: Path) -> None:
    # SPEC D8: with the compiled no-op in place while disarmed, an armed point still exits
    code = (
        "import sys\n"
        "from armdb import Db, queue\n"
        "db = Db.open(sys.argv[1])\n"
        "q = db.open_queue(queue('j', payload=dict, var=True))\n"
        "q.push({'a': 1})\n"
        "(l,) = q.lease(1)\n"
        "q.ack(l.token)\n"
        "print('not reached')\n"
    )
    env = dict(os.environ, ARMDB_FAILPOINT="txlog.after_append")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "db")], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == _fail.EXIT_CODE, r.stderr
    assert "not reached" not in r.stdout
    # The ack's record was appended, not applied: replay at open applies it (Q14).
    db = Db.open(tmp_path / "db")
    try:
        q = db.open_queue(queue("j", payload=dict, var=True))
        assert q.len() == 0 and q.lease(1) == []
    finally:
        db.close()


def _log_bodies(path: Path) -> list[list[object]]:
    out = []
    for f in sorted((path / "txlog").glob("*.log")):
        raw = f.read_bytes()
        _n, version = logformat._file_header_fields(raw, str(f))
        recs, _, _ = logformat._records_at(raw, logformat.records_start(version))
        out += [msgpack.unpackb(body, raw=False) for _off, _txid, _flags, body in recs]
    return out


def test_lone_var_ack_logs_both_rows_in_one_record(tmp_path: Path) -> None:
    # SPEC Q14: a var ack removes the row and its body in the same log commit
    db = Db.open(tmp_path / "db")
    try:
        q = db.open_queue(queue("jobs", payload=dict, var=True))
        seq = q.push({"doc": 7})
        (lease,) = q.lease(1)
        before = len(_log_bodies(tmp_path / "db"))
        q.ack(lease.token)
        bodies = _log_bodies(tmp_path / "db")
        assert len(bodies) == before + 1
        f_row, b_row = bodies[-1]
        assert f_row[0] == "F" and f_row[1] == "jobs" and f_row[5] == DELETED and f_row[6] == b""
        assert b_row[0] == "B" and b_row[2] == seq.to_bytes(8, "big") and b_row[3] is None
        assert isinstance(b_row[4], int) and b_row[4] > 0  # the tombstone's gsn
        assert q.len() == 0
    finally:
        db.close()
    db = Db.open(tmp_path / "db")  # replayed or not, the row and its body stay gone
    try:
        q = db.open_queue(queue("jobs", payload=dict, var=True))
        assert q.len() == 0 and q.lease(1) == []
        assert q._payload is not None and q._payload.get(seq.to_bytes(8, "big")) is None
    finally:
        db.close()
