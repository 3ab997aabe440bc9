"""``lease(n)`` with a huge ``n``, and the kernels that size buffers by a caller's count
(issue 14, item 2; SPEC Q9-Q11).

``lease(2**62)`` used to compute ``malloc(4 * n * 8)``, which wraps to a tiny buffer:
rows were corrupted in memory and on disk, and the process could crash.  Now ``n``
above ``armdb.queue.MAX_LEASE`` is a ``ConfigError`` that changes nothing, and the
kernels size their scan buffers by what the index holds, with checked arithmetic.
The kernel probes run in a child process, so a crash is an exit code.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

import armdb
from armdb import ConfigError, FixedConfig, QueueConfig, State
from armdb.queue import MAX_LEASE

from .conftest import FakeClock, run_child

PING = np.dtype([("doc", "<u8"), ("flags", "<u4")])
FixedQ = armdb.queue("pings", payload=PING)
VarQ = armdb.queue("jobs", payload=dict, var=True)
ROWS = 200


def _cfg(shards: int) -> QueueConfig:
    return QueueConfig.balanced().header_config(FixedConfig(shard_count=shards, grow_step=256)).build()


def _fill(db: armdb.Db, flavour: str, shards: int) -> armdb.Queue:
    q = db.open_queue(FixedQ if flavour == "fixed" else VarQ, _cfg(shards))
    for i in range(ROWS):
        q.push((i, 1) if flavour == "fixed" else {"i": i})
    return q


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("flavour", ["fixed", "var"])
@pytest.mark.parametrize("n", [2**62, 2**63 - 1, 2**64, 2**31, MAX_LEASE + 1])
def test_q9_lease_above_the_maximum_is_refused_and_changes_nothing(
    tmp_path: Path, clock: FakeClock, flavour: str, shards: int, n: int
) -> None:
    path = tmp_path / "db"
    with armdb.Db.open(path, clock=clock) as db:
        q = _fill(db, flavour, shards)
        before = q.snapshot()
        with pytest.raises(ConfigError, match=f"at most {MAX_LEASE:,}"):
            q.lease(n)
        after = q.snapshot()
        assert after.tobytes() == before.tobytes()  # (NaT deadlines compare unequal as values)
        assert (after["state"] == State.READY).all() and (after["attempts"] == 0).all()
        assert q.len() == ROWS and q.dead_len() == 0
        got = q.lease(ROWS)  # every row still leases, once
        assert sorted(lz.id for lz in got) == sorted(before["id"].tolist())
    report = armdb.check(path)
    assert report.ok, str(report)


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("flavour", ["fixed", "var"])
def test_q9_lease_of_the_maximum_works(tmp_path: Path, clock: FakeClock, flavour: str, shards: int) -> None:
    path = tmp_path / "db"
    with armdb.Db.open(path, clock=clock) as db:
        q = _fill(db, flavour, shards)
        got = q.lease(MAX_LEASE)
        assert len(got) == ROWS and len({lz.id for lz in got}) == ROWS
        assert q.lease(MAX_LEASE) == []
        for lz in got:
            q.ack(lz.token)
        assert q.len() == 0
    report = armdb.check(path)
    assert report.ok, str(report)


def test_q9_lease_n_must_be_an_int_in_range(db: armdb.Db) -> None:
    q = db.open_queue(FixedQ, _cfg(1))
    for bad in (0, -1, -(2**70), 1.5, "3", True, None):
        with pytest.raises(ConfigError):
            q.lease(bad)  # type: ignore[arg-type]


def test_kernels_size_buffers_by_what_they_hold_and_check_their_arithmetic(tmp_path: Path) -> None:
    """The compiled entry points that take a count or a size from their caller."""
    code = f"""
        import os, numpy as np
        from armdb._core.qindex import KeyIndex
        from armdb._core.qshard import QueueShard
        from armdb._core import fixed as k
        from armdb._core.atomicfile import pwrite_all
        from armdb.config import FixedConfig
        from armdb.fixed import FixedShard

        idx = KeyIndex()
        for i in range(50):
            idx.insert(1, i, i, 0)
        for cap in (2**62, 2**61 + 1, 2**31, 1 << 40, 51, 50):
            got = idx.candidates(10, cap)
            assert len(got) == 50 and got[0] == (1, 0, 0), (cap, len(got))
        assert len(idx.candidates(10, 3)) == 3
        assert len(idx.head(2**62)[0]) == 50

        fx = FixedShard({str(tmp_path / "shard")!r}, 0, 16, 44, FixedConfig(grow_step=64))
        sh = QueueShard(fx, 12, False)
        for i in range(20):
            sh.push(5, i + 1, 5, 0, bytes(12))
        out = []
        for n in (2**62, 2**63 - 1, 2**61 + 1, 2**31):
            with fx.lock:
                assert sh.claim(10, 10 + 60_000, n, 5, 0, out) == 0
        assert len(out) == 20, len(out)
        assert sorted(r[1] for r in out) == list(range(1, 21))
        sf = fx.sf
        for off, n in ((0, 2**62), (2**62, 8), (2**63 - 1, 2**63 - 1), (-1, 4), (4, -1)):
            try:
                sf.body(0, off, n)
            except IndexError:
                pass
            else:
                raise AssertionError(("body", off, n))
        for off in (2**62, 2**63 - 1, -1):
            try:
                sf.header(0, off)
            except IndexError:
                pass
            else:
                raise AssertionError(("header", off))
        assert k.redo_record(np.zeros(4096, np.uint8), 2**62) is None
        assert k.redo_record(np.zeros(4096, np.uint8), -5) is None
        fx.close()

        fd = os.open({str(tmp_path / "w")!r}, os.O_RDWR | os.O_CREAT)
        for off in (2**63 - 4, -1):
            try:
                pwrite_all(fd, b"abcdefgh", off)
            except OSError:
                pass
            else:
                raise AssertionError(("pwrite_all", off))
        os.close(fd)
        print("ok")
    """
    res = run_child(code)
    assert res.returncode == 0, (
        f"child exited with {res.returncode} (negative: killed by signal {-res.returncode})\n"
        f"{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    )
    assert res.stdout.strip().endswith("ok")


@pytest.mark.parametrize("timeout", [2**62, 2**70, timedelta(days=3_000_000)])
def test_q11_a_lease_timeout_past_the_year_9999_is_a_config_error(tmp_path, timeout):
    # SPEC Q11: a Lease's deadline is a datetime; a timeout that would put it past the last
    # one is refused before anything is leased (it escaped as OverflowError or OSError)
    with armdb.Db.open(tmp_path / "db") as db:
        for spec in (armdb.queue("v", payload=dict, var=True), armdb.queue("f", payload=np.dtype([("k", "<u8")]))):
            q = db.open_queue(spec)
            q.push({"n": 1} if spec.var else (1,))
            for call in (lambda: q.lease(1, lease_timeout=timeout), lambda: q.lease_batch(1, lease_timeout=timeout)):
                with pytest.raises(armdb.ConfigError, match="year 9999"):
                    call()
            (lz,) = q.lease(1)
            with pytest.raises(armdb.ConfigError, match="year 9999"):
                q.extend(lz, by=timeout)
            q.ack(lz)
