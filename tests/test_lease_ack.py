"""``lease_batch(n, ack=previous)``: ack the leases given and lease the next ones (SPEC Q32,
G2).  One API on every backend: the embedded ``Queue`` (acks commit, then the lease), the
socket client (the same, through the owner) and ``armdb.pg`` (one transaction).  On all
of them the acks are all or nothing, and acks that raise leave nothing leased.

The conformance part runs on both backends through the ``backend`` fixture of
tests/test_conformance.py; the pg crash test of the same call is in
tests/test_pg_faults.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import armdb
from armdb.errors import ConfigError, NotALease, StaleToken
from tests.test_conformance import Backend, Job, Jobs, backend, cfg

__all__ = ["backend"]  # the fixture, imported for its parametrised backends


def _ready(q: armdb.Queue[Job]) -> list[int]:
    """The ids of the rows that can be leased now, leased and given back at once."""
    got = q.lease_batch(1000)
    ids = got.ids.tolist()
    for lz in got:
        q.nack(lz, delay=0)
    return ids


def test_ack_acks_the_batch_and_leases_the_next(backend: Backend) -> None:
    # SPEC Q32 G2: the leases given as ack= are acked, then the next ones are leased
    db = backend.open()
    q = db.open_queue(Jobs, cfg(lease=30))
    ids = q.push_many([Job(i, "a") for i in range(7)])
    b1 = q.lease_batch(3)
    b2 = q.lease_batch(3, ack=b1)
    assert b2.ids.tolist() == ids[3:6] and b2.payloads == [Job(i, "a") for i in range(3, 6)]
    assert q.len() == 4 and q.stats().acks == 3
    with pytest.raises(StaleToken):
        q.ack_many(b1)  # acked already
    # a list of Lease objects works as ack= as well, and the last call may lease nothing
    b3 = q.lease_batch(5, ack=list(b2))
    assert b3.ids.tolist() == ids[6:] and q.len() == 1
    b4 = q.lease_batch(5, ack=b3)
    assert len(b4) == 0 and q.len() == 0 and q.stats().acks == 7


def test_stale_ack_raises_and_leases_nothing(backend: Backend) -> None:
    # SPEC Q32 Q13: a stale lease in ack=: StaleToken, nothing acked, nothing leased
    db = backend.open()
    q = db.open_queue(Jobs, cfg(lease=30))
    q.push_many([Job(i, "s") for i in range(2)])
    held = q.lease_batch(2)
    later = q.push_many([Job(i, "t") for i in range(2, 5)])
    q.ack(held[0])
    with pytest.raises(StaleToken):
        q.lease_batch(10, ack=held)
    assert q.len() == 4 and q.stats().acks == 1
    assert _ready(q) == later  # the failed call leased none of them
    # the other lease of the refused batch is still held: it acks now
    q.ack(held[1])
    assert q.len() == 3
    # a batch given twice: its rows are acked already
    b = q.lease_batch(3)
    q.lease_batch(1, ack=b)
    with pytest.raises(StaleToken):
        q.lease_batch(1, ack=b)


def test_ack_of_an_expired_and_re_leased_row_is_stale(backend: Backend) -> None:
    # SPEC Q13 Q32: a lease whose row was leased again after its timeout fences its holder
    db = backend.open()
    q = db.open_queue(Jobs, cfg(lease=0.3))
    q.push_many([Job(1, "e"), Job(2, "e")])
    old = q.lease_batch(2, lease_timeout=0.05)
    time.sleep(0.2)
    again = q.lease_batch(2)
    assert sorted(again.ids.tolist()) == sorted(old.ids.tolist())
    with pytest.raises(StaleToken):
        q.lease_batch(1, ack=old)
    assert q.len() == 2
    assert len(q.lease_batch(1, ack=again)) == 0 and q.len() == 0


def test_empty_ack_and_bad_arguments(backend: Backend) -> None:
    # SPEC Q32: an empty ack leases only; a bad argument changes nothing
    db = backend.open()
    q = db.open_queue(Jobs, cfg(lease=30))
    other = db.open_queue(armdb.queue("conf_other_acks", payload=Job, var=True), cfg(lease=30))
    q.push_many([Job(i, "x") for i in range(4)])
    empty_elsewhere = other.lease_batch(5)  # nothing there: an empty batch of another queue
    assert len(empty_elsewhere) == 0
    b1 = q.lease_batch(1, ack=[])
    b2 = q.lease_batch(1, ack=empty_elsewhere)
    assert len(b1) == len(b2) == 1 and q.stats().acks == 0
    with pytest.raises(NotALease):
        q.lease_batch(1, ack=b1[0])  # one Lease, not a batch: nothing acked nor leased
    with pytest.raises(ConfigError):
        q.lease_batch(0, ack=b1)  # a bad n: the acks are not applied
    with pytest.raises(ConfigError):
        q.lease_batch(10**9, ack=b1)
    with pytest.raises(ConfigError):
        q.lease_batch(1, ack=b1, lease_timeout=0)
    with pytest.raises(StaleToken):
        q.lease_batch(1, ack=[b1[0], b1[0]])  # a row twice
    assert q.stats().acks == 0 and q.len() == 4 and len(_ready(q)) == 2
    other.push(Job(9, "o"))
    theirs = other.lease_batch(1)
    with pytest.raises(StaleToken):
        q.lease_batch(1, ack=theirs)  # leased through another queue's handle
    assert q.stats().acks == 0 and len(_ready(q)) == 2
    assert len(q.lease_batch(2, ack=[*b1, *b2])) == 2 and q.stats().acks == 2 and q.len() == 2


# -- the socket client (SPEC P2): the same keyword, the same rules ---------------------------------


@pytest.fixture
def client(tmp_path: Path) -> Iterator[armdb.Client]:
    db = armdb.Db.open(tmp_path / "db")
    db.serve()
    c = armdb.connect(db.path, timeout=10)
    try:
        yield c
    finally:
        c.close()
        db.shutdown()


def test_client_lease_batch_with_ack(client: armdb.Client) -> None:
    # SPEC P2 Q32: lease_batch(ack=) through the socket: acked, then leased; stale: nothing leased
    q = client.open_queue(Jobs, cfg(lease=30))
    ids = q.push_many([Job(i, "c") for i in range(5)])
    b1 = q.lease_batch(2)
    b2 = q.lease_batch(2, ack=b1)
    assert b2.ids.tolist() == ids[2:4] and q.len() == 3
    with pytest.raises(StaleToken):
        q.lease_batch(5, ack=b1)
    assert q.len() == 3 and len(q.lease_batch(5)) == 1  # the failed call leased nothing
    empty = q.lease_batch(5)
    assert len(empty) == 0 and len(q.lease_batch(1, ack=empty)) == 0
    with pytest.raises(ConfigError):
        q.lease_batch(10**9, ack=b2)  # the lease would be refused: the acks are not sent
    with pytest.raises(ConfigError):
        q.lease_batch(1, ack=b2, lease_timeout=0)
    q.ack_many(b2)
    assert q.len() == 1
