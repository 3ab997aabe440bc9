"""A var queue's compiled ``lease_batch`` and ``ack_many`` (``VarFast.lease_batch``,
``VarFast.ack_many``) against the Python methods they stand for (``Queue.lease_batch``,
``Queue.ack_many``): the same leases (ids, attempts, deadlines, payloads, tokens), acks
and refusals, the same cache accounting and the same state after a reopen, whichever path
ran; and the calls they hand to the Python methods refuse as those methods do."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import armdb
from armdb import QueueConfig, queue
from armdb.check import check
from armdb.errors import ConfigError, DbClosed, StaleToken
from armdb.queue import LeaseBatch, Queue

from .conftest import FakeClock
from .test_var_fast import _refusal

Jobs = queue("jobs", payload=dict, var=True)

values = st.one_of(st.integers(-2**63, 2**63 - 1), st.text(max_size=30), st.binary(max_size=40), st.none(),
                   st.booleans(), st.lists(st.text(max_size=5), max_size=3))
payloads = st.dictionaries(st.sampled_from(["doc_id", "reason", "tags", "text", "k"]), values, max_size=5)
ops = st.lists(st.one_of(
    st.tuples(st.just("push_many"), st.lists(payloads, min_size=1, max_size=9)),
    st.tuples(st.just("lease_batch"), st.integers(1, 12)),
    st.tuples(st.just("ack_many"), st.integers(0, 5)),
    st.tuples(st.just("ack_one"), st.integers(0, 5)),
    st.tuples(st.just("advance"), st.integers(0, 40_000)),
), max_size=30)


def _batch_view(b: LeaseBatch[Any]) -> tuple[Any, ...]:
    """Everything a batch holds but the handle (each open draws its own)."""
    leases = [(lz.id, lz.payload, lz.attempt, lz.deadline, tuple(lz.token)[1:]) for lz in b]
    return (b.ids.tolist(), b.attempts.tolist(), b.deadlines.tolist(), b.payloads, b._shards.tolist(),
            b._dues.tolist(), b._epochs.tolist(), b._deadline, b._cached, leases)


def _drive(path: Path, steps: list[tuple[str, Any]], compiled: bool, cache_bytes: int) -> list[Any]:
    clock = FakeClock()
    cfg = QueueConfig.balanced().lease_timeout(timedelta(seconds=30)).max_attempts(2).build()
    db = armdb.Db.open(path, clock=clock)
    q = db.open_queue(Jobs, cfg)
    q._cache_budget = cache_bytes  # 0: every lease reads its bodies from the store
    out: list[Any] = []
    held: list[LeaseBatch[Any]] = []
    for op, arg in steps:
        if op == "push_many":
            out.append(q.push_many(arg))
        elif op == "lease_batch":
            b = q.lease_batch(arg) if compiled else Queue.lease_batch(q, arg)
            out.append((_batch_view(b), q._cache_bytes, sorted(q._cache)))
            if len(b):
                held.append(b)
        elif op in ("ack_many", "ack_one") and held:
            b = held[arg % len(held)]
            if arg % 2:  # (an even one is acked again later: stale then)
                held.remove(b)
            try:
                if op == "ack_one":
                    out.append(q.ack(b[0]))
                else:
                    out.append(q.ack_many(b) if compiled else Queue.ack_many(q, b))
            except StaleToken as e:
                out.append(str(e).replace(str(b._handle), "H"))
        elif op == "advance":
            clock.advance(arg / 1000)
    st_ = q.stats()
    out.append((st_.len, st_.dead_len, st_.ready, st_.leased, st_.delayed, st_.payload_writes, st_.pushes, st_.acks,
                st_.dead_lettered, st_.poisoned, q._cache_bytes, sorted(q._cache)))
    db.shutdown()
    db = armdb.Db.open(path, clock=clock)
    q = db.open_queue(Jobs, cfg)
    out.append([(j.id, j.state, j.attempts, j.due, j.payload) for j in q.peek(1000) + q.peek(1000, dead=True)])
    db.shutdown()
    assert check(path).ok
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=ops, cache_bytes=st.sampled_from([0, 300, 1 << 20]))
def test_q32_compiled_lease_batch_and_ack_many_equal_the_python_methods(tmp_path_factory: pytest.TempPathFactory,
                                                          steps: list[tuple[str, Any]], cache_bytes: int) -> None:
    # SPEC Q32, Q15: the same leases, cache and state after a reopen, whichever path ran
    # (a cache of 300 bytes holds some bodies of a batch, not all: the store's path)
    base = tmp_path_factory.mktemp("vlb")
    assert _drive(base / "c", steps, True, cache_bytes) == _drive(base / "p", steps, False, cache_bytes)


def test_q32_lease_batch_and_ack_many_are_compiled_and_hand_the_rest_to_the_python_methods(db: armdb.Db,
                                                                              clock: FakeClock) -> None:
    from armdb._core.qshard import VarFast

    q = db.open_queue(Jobs)
    assert isinstance(q.lease_batch.__self__, VarFast)  # type: ignore[attr-defined]
    assert isinstance(q.ack_many.__self__, VarFast)  # type: ignore[attr-defined]
    ids = q.push_many([{"a": i} for i in range(6)])
    b = q.lease_batch(3)
    assert b.ids.tolist() == ids[:3] and b.payloads == [{"a": 0}, {"a": 1}, {"a": 2}]
    assert b._cached is False and q._cache_bytes == sum(len(x) for x in q._cache.values())
    assert b.deadlines.tolist() == [b._deadline.replace(tzinfo=None)] * 3
    # ack= and lease_timeout=: the Python method
    c = q.lease_batch(2, ack=b, lease_timeout=timedelta(seconds=5))
    assert c.ids.tolist() == ids[3:5] and q.stats().acks == 3
    assert c._deadline == armdb._clock.ms_to_datetime(clock.ms + 5000)
    assert q.ack_many(c) == 2
    (lz,) = q.lease_batch(4)  # one row left: the Python end of the batch
    assert lz.id == ids[5] and lz.payload == {"a": 5}
    assert len(q.lease_batch(4)) == 0
    assert _refusal(q.ack_many, c) == _refusal(Queue.ack_many, q, c)  # acked already: stale
    assert _refusal(q.ack_many, c)[0] is StaleToken
    assert _refusal(q.ack_many, lz) == _refusal(Queue.ack_many, q, lz)  # one Lease: NotALease
    assert q.ack_many([lz]) == 1 and q.ack_many(q.lease_batch(3)) == 0
    for n in (0, -1, True, 1.0, "1", 1_000_001):
        assert _refusal(q.lease_batch, n) == _refusal(Queue.lease_batch, q, n)
        assert _refusal(q.lease_batch, n)[0] is ConfigError
    assert _refusal(q.lease_batch, 2, lease_timeout=0) == _refusal(Queue.lease_batch, q, 2, lease_timeout=0)
    db.close()
    assert _refusal(q.lease_batch, 2) == _refusal(Queue.lease_batch, q, 2)
    assert _refusal(q.lease_batch, 2)[0] is DbClosed
    assert _refusal(q.ack_many, b) == _refusal(Queue.ack_many, q, b)
    assert np.dtype(np.uint64) == b.ids.dtype
