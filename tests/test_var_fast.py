"""The var queue's compiled push and lease(1) (``VarFast``) against the Python bodies
they stand for (``Queue._push``, ``Queue._lease``), and the compiled lone Bitcask put
(``PutKernel``) against ``BitcaskStore.put``'s Python steps and ``BitcaskStore._write``."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import armdb
from armdb import QueueConfig, queue
from armdb.bitcask import files, recovery
from armdb.bitcask import store as bstore
from armdb.bitcask.store import BitcaskStore
from armdb.check import check
from armdb.config import Config
from armdb.errors import ConfigError, DbClosed, PayloadTypeError
from armdb.seqmap import SeqMap

from .conftest import FakeClock

Jobs = queue("jobs", payload=dict, var=True)

payloads = st.dictionaries(st.text(max_size=6), st.one_of(st.integers(-2**63, 2**63 - 1), st.text(max_size=30),
                                                          st.binary(max_size=40), st.none(), st.booleans()),
                           max_size=4)
ops = st.lists(st.one_of(
    st.tuples(st.just("push"), payloads),
    st.tuples(st.just("lease"), st.none()),
    st.tuples(st.just("ack"), st.integers(0, 5)),
    st.tuples(st.just("advance"), st.integers(0, 40_000)),
), max_size=40)


def _lease_view(lz: Any) -> tuple[Any, ...]:
    t = lz.token
    return (lz.id, lz.payload, lz.attempt, lz.deadline, t.shard, t.due, t.seq, t.epoch)


def _drive(path: Path, steps: list[tuple[str, Any]], compiled: bool, cache_bytes: int) -> list[Any]:
    """Run ``steps`` on a fresh var queue, through its public (compiled) calls or through
    the Python bodies; what each step returned, then the queue's state after a reopen."""
    clock = FakeClock()
    cfg = QueueConfig.balanced().lease_timeout(timedelta(seconds=30)).max_attempts(2).build()
    db = armdb.Db.open(path, clock=clock)
    q = db.open_queue(Jobs, cfg)
    q._cache_budget = cache_bytes  # 0: every lease reads its body from the store
    out: list[Any] = []
    held: list[Any] = []
    for op, arg in steps:
        if op == "push":
            out.append(q.push(arg) if compiled else q._push(arg, None))
        elif op == "lease":
            got = q.lease(1) if compiled else q._lease(1, None)
            out.append([_lease_view(lz) for lz in got])
            held.extend(got)
        elif op == "ack" and held:
            lz = held.pop(arg % len(held))
            try:
                q.ack(lz)
                out.append("acked")
            except armdb.StaleToken as e:
                out.append(str(e).replace(str(lz.token.handle), "H"))
        elif op == "advance":
            clock.advance(arg / 1000)
    st_ = q.stats()
    out.append((st_.len, st_.dead_len, st_.ready, st_.leased, st_.delayed, st_.payload_writes, st_.pushes, st_.acks,
                st_.dead_lettered, st_.poisoned))
    db.shutdown()
    db = armdb.Db.open(path, clock=clock)
    q = db.open_queue(Jobs, cfg)
    out.append([(j.id, j.state, j.attempts, j.due, j.payload) for j in q.peek(1000) + q.peek(1000, dead=True)])
    db.shutdown()
    assert check(path).ok
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=ops, cache_bytes=st.sampled_from([0, 1 << 20]))
def test_q9_compiled_push_and_lease_equal_the_python_bodies(tmp_path_factory: pytest.TempPathFactory,
                                                           steps: list[tuple[str, Any]], cache_bytes: int) -> None:
    # SPEC Q9, Q10, Q15: the same ids, leases (payload, attempt, deadline, token) and
    # state after a reopen, whichever path ran
    base = tmp_path_factory.mktemp("vf")
    assert _drive(base / "c", steps, True, cache_bytes) == _drive(base / "p", steps, False, cache_bytes)


def _refusal(fn: Any, *args: Any, **kw: Any) -> tuple[type, str]:
    try:
        fn(*args, **kw)
    except Exception as e:  # noqa: BLE001 - the class and message are compared
        return type(e), str(e)
    raise AssertionError("no refusal")


def test_q9_var_public_calls_are_compiled_and_refuse_as_the_python_bodies(db: armdb.Db, clock: FakeClock) -> None:
    from armdb._core.qshard import VarFast

    q = db.open_queue(Jobs)
    assert isinstance(q.push.__self__, VarFast)  # type: ignore[attr-defined]
    assert isinstance(q.lease.__self__, VarFast)  # type: ignore[attr-defined]
    a = q.push(payload={"a": 1})
    b = q.push({"b": 2}, delay=1.5)  # a delay: the Python body
    (lz,) = q.lease(n=1, lease_timeout=timedelta(seconds=3))  # a timeout: the Python body
    assert lz.id == a and lz.payload == {"a": 1}
    assert lz.deadline == armdb._clock.ms_to_datetime(clock.ms + 3000)
    q.ack(lz)
    clock.advance(2)
    (lb,) = q.lease()
    assert lb.id == b and lb.payload == {"b": 2}
    assert q.lease(1) == []
    assert _refusal(q.push, [1]) == _refusal(q._push, [1], None)
    assert _refusal(q.push, {"x": object()}) == _refusal(q._push, {"x": object()}, None)
    assert _refusal(q.push, {"x": 1}, delay=-1) == _refusal(q._push, {"x": 1}, -1)
    for n in (0, -1, True, 1.0, "1"):
        assert _refusal(q.lease, n) == _refusal(q._lease, n, None)
    assert _refusal(q.lease, 1, lease_timeout=0) == _refusal(q._lease, 1, 0)
    big = {"x": b"z" * (bstore.MAX_VALUE_LEN + 1)}
    assert _refusal(q.push, big)[0] is ConfigError  # above the store's value limit: nothing written
    assert q.len() == 1 and q.stats().ready == 0
    assert _refusal(q.push, "x")[0] is PayloadTypeError
    db.close()
    assert _refusal(q.push, {"a": 1}) == _refusal(q._push, {"a": 1}, None)
    assert _refusal(q.push, {"a": 1})[0] is DbClosed
    assert _refusal(q.lease, 1) == _refusal(q._lease, 1, None)


def test_q15_a_cached_body_is_counted_and_evicted_under_the_budget(db: armdb.Db) -> None:
    # SPEC Q15: the compiled push counts and caches each body as _put_body did, within budget
    q = db.open_queue(Jobs)
    q._cache_budget = 1000
    for i in range(200):
        q.push({"i": i, "pad": "p" * (i % 50)})
        assert q._cache_bytes == sum(map(len, q._cache.values())) <= 1000
    assert q._cache and q._pushed_bodies == 200
    for i in range(200):
        (lz,) = q.lease(1)
        assert lz.payload == {"i": i, "pad": "p" * (i % 50)}  # from the cache or the store
        q.ack(lz)


# -- the compiled lone put ------------------------------------------------------------------


def _store_state(path: Path) -> dict[str, bytes]:
    """The data and hint files of a closed store, by name (not its metadata: its id is random)."""
    files: dict[str, bytes] = {}
    for root, _, names in os.walk(path):
        for n in names:
            if not n.endswith((".data", ".hint")):
                continue
            with open(os.path.join(root, n), "rb") as f:
                files[os.path.relpath(os.path.join(root, n), path)] = f.read()
    return files


puts = st.lists(st.tuples(st.binary(min_size=0, max_size=12), st.one_of(st.none(), st.binary(max_size=700))),
                min_size=1, max_size=60)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=puts, small=st.booleans(), fsync=st.booleans())
def test_s7_compiled_put_writes_what_write_writes(tmp_path_factory: pytest.TempPathFactory,
                                                  items: list[tuple[bytes, bytes | None]], small: bool,
                                                  fsync: bool) -> None:
    # SPEC S7: the same records, hint entries, index and counters as BitcaskStore._write,
    # through rotations, overwrites and deletes (a value of None: a delete)
    base = tmp_path_factory.mktemp("bp")
    got = []
    for name, kernel in (("k", True), ("p", False)):
        with pytest.MonkeyPatch.context() as m:
            for mod in (files, bstore, recovery):  # the same file headers in both stores
                m.setattr(mod, "_new_nonce", lambda: 7)
            gsn = iter(range(1, 10_000))
            cfg = Config(enable_fsync=fsync, max_file_size=4096 if small else 1 << 20, compaction_threshold=0.99)
            st_ = BitcaskStore.open(str(base / name), cfg, lambda: next(gsn))
            assert st_._putter is not None
            if not kernel:
                st_._putter = None  # every put through put's Python steps and _write
            for key, value in items:
                if value is None:
                    st_.delete(key)
                else:
                    assert st_.put(key, value) > 0
            sh = st_._shards[0]
            state = (dict(sh.index), dict(sh.tombs), sh.highest, sh.hint.count, sh.hint.crc, bytes(sh.hint.buf),
                     {fid: (f.size, f.total, f.dead) for fid, f in sh.files.items()})
            st_.close()
        got.append((state, _store_state(base / name)))
    assert got[0] == got[1]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls=st.lists(st.tuples(st.sampled_from(["gsn", "q:a"]), st.booleans()), max_size=700))
def test_t5_compiled_drawer_hands_out_what_next_does(tmp_path_factory: pytest.TempPathFactory,
                                                     calls: list[tuple[str, bool]]) -> None:
    # SPEC T5: SeqMap.drawer's compiled draw gives the ids next() gives, across block refills
    base = tmp_path_factory.mktemp("sm")
    (base / "a").mkdir()
    (base / "b").mkdir()
    a, b = SeqMap(str(base / "a")), SeqMap(str(base / "b"))
    draw = {name: a.drawer(name) for name in ("gsn", "q:a")}
    try:
        for name, compiled in calls:
            assert (draw[name]() if compiled else a.next(name)) == b.next(name)
        assert a._reserved == b._reserved or a._ahead is not None or b._ahead is not None
    finally:
        a.close()
        b.close()


def test_q15_a_lease_takes_its_body_out_of_the_cache_and_a_retry_reads_the_store(db: armdb.Db) -> None:
    # SPEC Q15: the compiled lease(1) takes the body out of the cache (the ack has none to
    # drop); the nacked row's next lease reads its body back from Bitcask
    q = db.open_queue(Jobs)
    ids = [q.push({"i": i}) for i in range(3)]
    assert set(q._cache) == set(ids)
    (lz,) = q.lease(1)
    assert lz.payload == {"i": 0} and set(q._cache) == set(ids[1:])
    assert q._cache_bytes == sum(map(len, q._cache.values()))
    q.nack(lz, delay=0)
    again = q.lease(3)
    assert sorted(x.payload["i"] for x in again) == [0, 1, 2]
    assert q._cache == {} and q._cache_bytes == 0
    for x in again:
        q.ack(x.token)
    assert q.len() == 0 and len(q._payload) == 0
