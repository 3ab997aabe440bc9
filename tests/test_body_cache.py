"""SPEC Q31, Q32: a var queue's body cache keeps the oldest bodies and never holds a body
for a row that is gone.

A full cache takes no new body (nothing is evicted: a queue leases its oldest rows first,
and those are the ones it keeps), so an entry that no lease takes would hold its share of
the budget until the Db closes.  Each way a row or its push can end is checked here: the
cache's byte count comes back to what the remaining rows' cached bodies hold.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import msgpack
import pytest

import armdb
from armdb import Db, FixedConfig, QueueConfig, _fail
from armdb.errors import StorageError


@dataclass
class Job:
    doc: int


VarQ = armdb.queue("bcq", payload=Job, var=True)
BytesQ = armdb.queue("bcb", payload=bytes, var=True)


def _cfg(cache_bytes: int, *, shards: int = 1, **kw) -> QueueConfig:
    b = QueueConfig.balanced().payload_config(armdb.Config.balanced().cache_bytes(cache_bytes).build())
    if shards != 1:
        b = b.header_config(FixedConfig.balanced().shard_count(shards).build())
    for k, v in kw.items():
        b = getattr(b, k)(v)
    return b.build()


def _held(q) -> int:
    """The cache's byte count, checked against what it holds."""
    assert q._cache_bytes == sum(map(len, q._cache.values())) <= q._cache_budget
    return q._cache_bytes


@pytest.fixture(params=[1, 3], ids=["one-shard", "three-shards"])
def shards(request) -> int:
    return request.param


def test_q31_a_full_cache_keeps_the_oldest_bodies_and_leases_them_from_memory(db, shards, monkeypatch):
    # SPEC Q31, Q32: pushes past the budget are not cached (neither batch nor lone push), the
    # oldest stay and are leased without the data file; leases make room for new pushes
    q = db.open_queue(VarQ, _cfg(50, shards=shards))
    ids = q.push_many([Job(i) for i in range(60)])
    kept = list(q._cache)
    assert kept == ids[:len(kept)] and 0 < len(kept) < 60 and _held(q) > 50 - len(q._cache[ids[0]])
    late = [q.push(Job(60)), q.push(Job(61), delay=0)]  # the compiled push, then the Python one
    assert list(q._cache) == kept and not set(late) & set(q._cache)
    reads: list[bytes] = []
    get = q._payload.get
    monkeypatch.setattr(q._payload, "get", lambda key: reads.append(key) or get(key))
    first = q.lease_batch(len(kept) - 2)
    one = q.lease()[0]
    two = q.lease_batch(1)
    assert reads == []  # every one of the oldest came from the cache
    assert list(first.payloads) + [one.payload] + list(two.payloads) == [Job(i) for i in range(len(kept))]
    assert q._cache == {} and _held(q) == 0
    again = q.push(Job(99))  # room again
    assert list(q._cache) == [again]
    q.ack_many(first)
    q.ack(one)
    q.ack_many(two)
    rest = q.lease_batch(100)
    assert [p.doc for p in rest.payloads] == list(range(len(kept), 62)) + [99]
    assert q.ack_many(rest) == 62 - len(kept) + 1
    assert q._cache == {} and _held(q) == 0 and len(q) == 0


def test_q31_lone_push_lease_ack_nack_and_release_leave_nothing_cached(db, shards):
    # SPEC Q31: a lease takes its body out of the cache; an ack, a nack and a release of
    # the lease find nothing there, and the row leased again reads the data file
    q = db.open_queue(VarQ, _cfg(1 << 16, shards=shards))
    ids = [q.push(Job(i)) for i in range(6)]
    assert sorted(q._cache) == ids and _held(q) > 0
    a = q.lease()[0]
    q.ack(a)
    b = q.lease()[0]
    q.nack(b, delay=0)
    c = q.lease_batch(2)
    q.release_many(c)
    assert set(q._cache) == set(ids[3:])  # (the nacked row was leased again, with the next)
    got = q.lease(10)
    assert sorted(lz.payload.doc for lz in got) == [1, 2, 3, 4, 5]
    for lz in got:
        q.ack(lz)
    assert q._cache == {} and _held(q) == 0 and len(q) == 0


def test_q34_dead_letters_purge_and_retention_leave_nothing_cached(db, clock):
    # SPEC Q22, Q34: rows dead-lettered (by nack, or by an expired lease out of attempts)
    # then purged or swept by retention leave no entry; the rows still waiting keep theirs
    q = db.open_queue(VarQ, _cfg(1 << 16, max_attempts=1, dead_retention=60, lease_timeout=5))
    q.push_many([Job(i) for i in range(4)])
    a, b = q.lease(2)
    q.nack(a, dead=True)
    q.nack(b, dead=True)
    q.lease_batch(2)  # expires, out of attempts
    clock.advance(6)
    rest = q.push_many([Job(i) for i in range(4, 8)])
    want = sum(len(q._cache[i]) for i in rest[1:])
    got = q.lease_batch(1)  # the scan dead-letters the two expired leases, then leases rest[0]
    assert got.ids.tolist() == [rest[0]] and q.dead_len() == 4
    assert q.purge_dead([a.id]) == 1
    clock.advance(61)
    db.sweep_expired_now()  # the retention pass
    assert q.dead_len() == 0
    assert set(q._cache) == set(rest[1:]) and _held(q) == want


def test_q31_a_purge_or_retention_drops_a_dead_row_s_cached_body(db, clock):
    # SPEC Q22, Q34: a dead row whose body is still cached (a lease that claimed it but
    # did not take its body, e.g. one cut short by an error) loses it with the row
    q = db.open_queue(VarQ, _cfg(1 << 16, max_attempts=1, dead_retention=60))
    ids = q.push_many([Job(i) for i in range(4)])
    bodies = dict(q._cache)
    for lz in q.lease(4):
        q.nack(lz, dead=True)
    for i in ids:
        q._cache_put(i, bodies[i])  # as if no lease had taken them
    assert _held(q) == sum(map(len, bodies.values()))
    assert q.purge_dead(ids[:2]) == 2
    assert set(q._cache) == set(ids[2:]) and _held(q) == sum(len(bodies[i]) for i in ids[2:])
    clock.advance(61)
    db.sweep_expired_now()
    assert q.dead_len() == 0 and q._cache == {} and _held(q) == 0


def test_q31_a_batch_ack_of_bodies_no_lease_took_drops_them(db):
    # SPEC Q32: ack_many of leases whose bodies are still cached drops them
    q = db.open_queue(VarQ, _cfg(1 << 16))
    ids = q.push_many([Job(i) for i in range(5)])
    bodies = dict(q._cache)
    got = q.lease_batch(5)
    for i in ids:
        q._cache_put(i, bodies[i])
    leases = list(got)  # acked as leases: the cache may hold their bodies
    assert q.ack_many(leases) == 5
    assert q._cache == {} and _held(q) == 0


def test_q32_encoded_leases_and_tx_paths_leave_nothing_cached(db):
    # SPEC Q32, T1: lease_batch of encoded bodies (the server's), a transaction's push and
    # push_many, and its ack take and drop the bodies as the direct calls do
    q = db.open_queue(BytesQ, _cfg(1 << 16))
    ids = q.push_many([b"a" * 10, b"b" * 20, b"c"])
    enc = q._lease_batch_encoded(2)
    assert sorted(q._cache) == ids[2:]
    q.ack_many(enc)
    with db.tx() as tx:
        tx.push(q, b"d" * 7)
    assert len(q._cache) == 2 and _held(q) > 0
    ids2 = q._push_many_encoded([msgpack.packb(b"e")] * 3)  # (a client's encoded batch)
    assert set(ids2) <= set(q._cache)
    leases = q.lease(10)
    assert q._cache == {} and _held(q) == 0
    tx = db.tx()
    for lz in leases:
        tx.ack(q, lz)
    tx.commit()
    assert q._cache == {} and _held(q) == 0 and len(q) == 0


@pytest.mark.parametrize("where", ["after_body", "header"])
@pytest.mark.parametrize("how", ["compiled", "python"])
def test_q15_a_push_that_fails_after_its_body_leaves_it_uncached(db, monkeypatch, where, how):
    # SPEC Q15, Q31: a lone push that raises after caching its body (the body's failpoint,
    # a header store that refuses the write) drops the entry: no lease would ever take it
    q = db.open_queue(VarQ, _cfg(1 << 16))
    keep = q.push(Job(0))
    before = dict(q._cache)
    if where == "after_body":
        def point(name: str) -> None:
            if name == "queue.var_push.after_body":
                raise OSError("injected after the body")
        monkeypatch.setattr(_fail, "point", point)
        err: type[BaseException] = OSError
    else:
        q._shards[0].fixed.poisoned = OSError("injected header failure")
        err = StorageError
    with pytest.raises(err):
        if how == "compiled":
            q.push(Job(1))
        else:
            q.push(Job(1), delay=0)  # (a delay: the Python push)
    assert q._cache == before and _held(q) == len(before[keep])
    monkeypatch.undo()
    q._shards[0].fixed.poisoned = None
    q.push_many([Job(2), Job(3)])
    got = q.lease_batch(10)
    assert [p.doc for p in got.payloads] == [0, 2, 3]
    q.ack_many(got)
    assert q._cache == {} and _held(q) == 0


def test_q31_close_empties_the_cache(db_path):
    # SPEC Q31: a handle kept after its Db closed holds no bodies
    with Db.open(db_path) as db:
        q = db.open_queue(VarQ, _cfg(1 << 16))
        q.push_many([Job(i) for i in range(10)])
        q.push(Job(10))
        assert _held(q) > 0
    assert q._cache == {} and q._cache_bytes == 0


@pytest.mark.parametrize("seed", range(3))
def test_q31_random_operations_keep_only_never_leased_rows_cached(db, clock, seed):
    # SPEC Q31, Q32, Q34: through random pushes, leases, acks, nacks, releases, dead
    # letters, purges, redrives and expiries, the cache holds only bodies of rows never
    # leased, within its budget, its count right; draining the queue empties it
    rng = random.Random(seed)
    q = db.open_queue(VarQ, _cfg(80, max_attempts=2, lease_timeout=5, dead_retention=30,
                                 shards=rng.choice([1, 2])))
    never: set[int] = set()
    held: list = []
    n = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.25:
            k = rng.choice([1, 2, 10, 40])
            ids = q.push_many([Job(n + i) for i in range(k)]) if rng.random() < 0.6 else \
                [q.push(Job(n + i)) for i in range(k)]
            never.update(ids)
            n += k
        elif op < 0.45:
            got = q.lease_batch(rng.choice([1, 3, 20])) if rng.random() < 0.5 else q.lease(rng.choice([1, 4]))
            items = list(got)
            never.difference_update(lz.id for lz in items)
            held.extend(items)
        elif op < 0.6 and held:
            rng.shuffle(held)
            k = rng.randrange(1, len(held) + 1)
            take, held = held[:k], held[k:]
            what = rng.choice(["ack", "ack_many", "nack", "dead", "release"])
            try:
                if what == "ack":
                    for lz in take:
                        q.ack(lz)
                elif what == "ack_many":
                    q.ack_many(take)
                elif what == "nack":
                    for lz in take:
                        q.nack(lz, delay=0)
                elif what == "dead":
                    for lz in take:
                        q.nack(lz, dead=True)
                else:
                    q.release_many(take)
            except armdb.errors.StaleToken:
                pass  # an expired lease another call took
        elif op < 0.7:
            clock.advance(rng.choice([1, 6, 31]))
        elif op < 0.75:
            q.purge_dead() if rng.random() < 0.5 else q.redrive()
        assert set(q._cache) <= never
        _held(q)
    for _ in range(100):  # drain: expired leases come back, dead rows are redriven
        clock.advance(10)
        q.redrive()
        got = q.lease_batch(50)
        if len(got):
            q.ack_many(got)
        if len(q) == 0 and q.dead_len() == 0:
            break
    assert len(q) == 0 and q._cache == {} and _held(q) == 0
