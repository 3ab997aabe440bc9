"""A connection's token set (by queue handle, then row id) and ``lease_batch(ack=)`` as
one request through the socket (SPEC P3, P5, Q32)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest

import armdb
from armdb import server as server_mod
from armdb import wire
from armdb.errors import ConfigError, NotALease, StaleToken
from armdb.queue import LeaseToken


@dataclasses.dataclass
class Job:
    n: int
    text: str


Jobs = armdb.queue("jobs", payload=Job, var=True)



def _conn_of(srv: server_mod.Server, before: set[Any]) -> Any:
    with srv._lock:
        (conn,) = srv._conns - before
    return conn


def _requests(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The operations the server runs from now on, in order."""
    seen: list[str] = []
    orig = server_mod._Conn._request

    def spy(self: Any, req: Any, out: list[bytes]) -> None:
        seen.append(req[1])
        orig(self, req, out)

    monkeypatch.setattr(server_mod._Conn, "_request", spy)
    return seen


def test_q32_lease_batch_with_acks_is_one_request(owner: tuple[armdb.Db, server_mod.Server],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # SPEC P5, Q32: lease_batch(ack=) through a client acks and leases in one request
    db, _ = owner
    with armdb.connect(db.path) as c:
        q = c.open_queue(Jobs)
        q.push_many([Job(i, "a") for i in range(6)])
        first = q.lease_batch(3)
        seen = _requests(monkeypatch)
        second = q.lease_batch(3, ack=first)
        assert seen == ["lease_batch"]
        assert [j.n for j in second.payloads] == [3, 4, 5]
        assert q.len() == 3  # the first three were acked
        third = q.lease_batch(3, ack=list(second))  # a list of leases: the token-list form
        assert len(third) == 0 and q.len() == 0
        assert seen == ["lease_batch", "len", "lease_batch", "len"]
        # an empty batch as ack leases only, as the direct call does
        q.push(Job(9, "b"))
        assert len(q.lease_batch(1, ack=third)) == 1


def test_q32_refused_acks_lease_nothing(owner: tuple[armdb.Db, server_mod.Server]) -> None:
    # SPEC Q32, P3: acks that are refused (one already acked; a batch of another
    # connection) make the lease_batch(ack=) request acknowledge nothing and lease nothing
    db, _ = owner
    with armdb.connect(db.path) as a, armdb.connect(db.path) as b:
        qa, qb = a.open_queue(Jobs), b.open_queue(Jobs)
        qa.push_many([Job(i, "x") for i in range(4)])
        batch = qa.lease_batch(2)
        qa.ack(batch[0])
        with pytest.raises(StaleToken, match="nothing was acked"):
            qa.lease_batch(2, ack=batch)
        assert qa.stats().leased == 1 and qa.len() == 3  # b[1] still leased, the other two not leased
        with pytest.raises(StaleToken):
            qb.lease_batch(2, ack=[batch[1]])  # another connection's lease
        assert qb.stats().leased == 1
        with pytest.raises(NotALease):
            qa.lease_batch(1, ack=5)
        # a bad lease argument is refused before any ack
        with pytest.raises(ConfigError):
            qa.lease_batch(1, ack=[batch[1]], lease_timeout=0.0001)
        assert qa.stats().leased == 1
        assert [j.n for j in qa.lease_batch(2, ack=[batch[1]]).payloads] == [2, 3]
        assert qa.len() == 2


def test_p3_a_token_must_match_whole(owner: tuple[armdb.Db, server_mod.Server]) -> None:
    # SPEC P3: the set is keyed by handle and row id, but a token must match all its
    # fields: a held row's id with another epoch, shard or due is not this connection's
    db, srv = owner
    with armdb.connect(db.path) as c:
        q = c.open_queue(Jobs)
        q.push(Job(1, "t"))
        (lz,) = q.lease(1)
        t = lz.token
        for forged in (t._replace(epoch=t.epoch + 1), t._replace(shard=t.shard + 1), t._replace(due=t.due + 1),
                       t._replace(handle=t.handle + 1)):
            with pytest.raises(StaleToken, match="not held by this connection"):
                q.ack(forged)
            with pytest.raises(StaleToken, match="not held by this connection"):
                q.ack_many([forged])
        q.ack(t)
        assert q.len() == 0


def test_p3_a_batch_forged_from_another_connections_fields_is_stale(owner: tuple[armdb.Db, server_mod.Server]) -> None:
    # SPEC P3: a token batch naming rows another connection holds, with their epochs, is
    # refused whole (handle, ids and epochs are right; the connection is not)
    db, _ = owner
    with armdb.connect(db.path) as a, armdb.connect(db.path) as b:
        qa, qb = a.open_queue(Jobs), b.open_queue(Jobs)
        qa.push_many([Job(i, "x") for i in range(4)])
        mine = qb.lease_batch(1)
        theirs = qa.lease_batch(3)
        tb = armdb.client._token_batch(theirs)
        with pytest.raises(StaleToken, match="not held by this connection"):
            b._call("ack_many", q="jobs", tb=tb)
        with pytest.raises(StaleToken):
            b._call("release_many", q="jobs", tb=tb)
        assert qa.stats().leased == 4
        assert qb.ack_many(mine) == 1 and qa.ack_many(theirs) == 3


def test_p3_released_and_pruned_leases_leave_the_set(owner: tuple[armdb.Db, server_mod.Server]) -> None:
    # SPEC P3: settled leases leave the connection's set, whatever way they were settled;
    # a prune drops a lease that expired and was taken by another connection
    db, srv = owner
    with armdb.connect(db.path) as a:
        conn = _conn_of(srv, set())
        b = armdb.connect(db.path)
        qa, qb = a.open_queue(Jobs), b.open_queue(Jobs)
        qa.push_many([Job(i, "x") for i in range(10)])
        b1 = qa.lease_batch(4)
        b2 = qa.lease_batch(3, ack=b1)
        lz = qa.lease(2)
        with conn.lock:
            assert conn._count() == 5
        assert qa.release_many(b2) == 3
        qa.nack(lz[0])
        with conn.lock:
            assert conn._count() == 1
        short = qa.lease(1, lease_timeout=0.002)
        time.sleep(0.01)
        taken = qb.lease(10)
        assert short[0].id in {x.id for x in taken}
        assert conn.prune() == 1
        with conn.lock:
            assert conn._count() == 1  # lz[1], still held
        held = list(server_mod._held_tokens(conn.held))
        assert [t for t, _q in held] == [lz[1].token] and isinstance(held[0][0], LeaseToken)
        qa.ack(lz[1])
        qb.ack_many(taken)
        b.close()


def test_p3_a_closed_connection_gives_back_its_batch_leases_at_once(owner: tuple[armdb.Db,
                                                                                 server_mod.Server]) -> None:
    # SPEC P3: leases taken by lease_batch (and by lease_batch(ack=)) come back as soon as
    # their connection closes, with the attempt counted
    db, _ = owner
    db.open_queue(Jobs, armdb.QueueConfig.balanced().backoff_secs([0.0]).build())
    with armdb.connect(db.path) as a:
        qa = a.open_queue(Jobs)
        qa.push_many([Job(i, "x") for i in range(6)])
        first = qa.lease_batch(3, lease_timeout=60)
        qa.lease_batch(3, lease_timeout=60, ack=first)
    with armdb.connect(db.path) as b:
        qb = b.open_queue(Jobs)
        # the server gives the leases back one row at a time as it notices the close, so
        # a lease may take some of them before the rest are back: gather them
        seen: list[tuple[int, int]] = []
        for _ in range(200):
            got = qb.lease_batch(10)
            seen += [(j.n, int(a)) for j, a in zip(got.payloads, got.attempts)]
            if len(got):
                assert qb.ack_many(got) == len(got)
            if len(seen) >= 3:
                break
            time.sleep(0.01)
        assert sorted(seen) == [(3, 2), (4, 2), (5, 2)]


def test_p5_lease_batch_acks_of_a_wrong_shape_close_the_connection(owner: tuple[armdb.Db,
                                                                               server_mod.Server]) -> None:
    # SPEC P5: ack_tb that is not a token batch is a bad frame, as for ack_many
    db, _ = owner
    with armdb.connect(db.path) as c:
        q = c.open_queue(Jobs)
        q.push(Job(1, "x"))
        with pytest.raises(armdb.errors.ServerGone):
            c._call("lease_batch", q="jobs", n=1, ack_tb=[b"x"])
    with armdb.connect(db.path) as c:
        assert c.open_queue(Jobs).stats().leased == 0
    assert wire.VERSION == 4
