"""Batches: push_many, lease_batch and ack_many (SPEC Q31, Q32).

Each batch is one logged commit: all or nothing, also across a kill -9 of the process.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

import armdb
from armdb import Db, FixedConfig, QueueConfig
from armdb.errors import ConfigError, NotALease, PayloadTypeError, QueueFull, StaleToken
from armdb.queue import LeaseBatch

from .conftest import child_env, kill_and_read, run_child, spawn_child

REC = np.dtype([("doc", "<u8"), ("w", "<f4")])


@dataclass
class Job:
    doc: int


FixedQ = armdb.queue("bfq", payload=REC)
VarQ = armdb.queue("bvq", payload=Job, var=True)


@pytest.fixture(params=["fixed", "var"])
def flavour(request) -> str:
    return request.param


def cfg(shards: int | None = None, **kw) -> QueueConfig:
    b = QueueConfig.balanced()
    if shards is not None:
        b = b.header_config(FixedConfig.balanced().shard_count(shards).build())
    for k, v in kw.items():
        b = getattr(b, k)(v)
    return b.build()


def open_q(db: Db, flavour: str, **kw):
    return db.open_queue(FixedQ if flavour == "fixed" else VarQ, cfg(**kw))


def payloads(flavour: str, docs):
    if flavour == "fixed":
        return [(int(d), float(d) / 2) for d in docs]
    return [Job(int(d)) for d in docs]


def doc_of(p) -> int:
    return int(p["doc"]) if isinstance(p, np.void) else p.doc


def array(docs) -> np.ndarray:
    a = np.zeros(len(docs), dtype=REC)
    a["doc"] = docs
    a["w"] = np.asarray(docs, dtype=np.float32) / 2
    return a


# -- Q31 push_many ------------------------------------------------------------------------------


def test_q31_numpy_array_push_returns_uint64_ids_in_input_order(db):
    # SPEC Q31
    q = open_q(db, "fixed")
    ids = q.push_many(array(range(1000)))
    assert isinstance(ids, np.ndarray) and ids.dtype == np.uint64
    assert ids.tolist() == list(range(int(ids[0]), int(ids[0]) + 1000))
    assert len(q) == 1000
    batch = q.lease_batch(1000)
    assert batch.ids.tolist() == ids.tolist()
    assert batch.payloads["doc"].tolist() == list(range(1000))
    assert np.array_equal(batch.payloads["w"], np.arange(1000, dtype=np.float32) / 2)


def test_q31_sequence_push_returns_a_list_and_reads_back(db, flavour):
    # SPEC Q31
    q = open_q(db, flavour)
    ids = q.push_many(payloads(flavour, range(50)))
    assert isinstance(ids, list) and ids == sorted(ids) and len(set(ids)) == 50
    got = q.lease(50)
    assert [lz.id for lz in got] == ids
    assert [doc_of(lz.payload) for lz in got] == list(range(50))
    assert q.push(payloads(flavour, [7])[0]) > ids[-1]


def test_q31_generator_and_empty_batches(db, flavour):
    # SPEC Q31
    q = open_q(db, flavour)
    assert q.push_many(p for p in payloads(flavour, range(3))) == [1, 2, 3]
    assert q.push_many([]) == []
    if flavour == "fixed":
        out = q.push_many(np.zeros(0, dtype=REC))
        assert isinstance(out, np.ndarray) and out.dtype == np.uint64 and len(out) == 0
    assert len(q) == 3


def test_q31_one_bad_payload_writes_nothing(db, flavour):
    # SPEC Q31: all or nothing; the error names the payload
    q = open_q(db, flavour)
    batch = payloads(flavour, range(5))
    batch[3] = "not a payload"
    commits = db.txlog.commits
    with pytest.raises(PayloadTypeError, match="payload 3 of the batch"):
        q.push_many(batch)
    assert len(q) == 0 and db.txlog.commits == commits


def test_q31_queue_full_is_judged_on_the_whole_batch(db, flavour):
    # SPEC Q31, Q21
    q = open_q(db, flavour, max_depth=10)
    q.push_many(payloads(flavour, range(8)))
    with pytest.raises(QueueFull, match="nothing was pushed"):
        q.push_many(payloads(flavour, range(3)))
    assert len(q) == 8
    q.push_many(payloads(flavour, range(2)))
    assert len(q) == 10


@pytest.mark.parametrize("bad", [
    np.zeros(3, dtype="<u8"),                      # another dtype
    np.zeros((2, 2), dtype=REC),                   # not 1-D
    np.zeros(3, dtype=[("doc", "<u4"), ("w", "<f4")]),
])
def test_q31_array_of_the_wrong_dtype_or_shape_is_refused(db, bad):
    # SPEC Q31
    q = open_q(db, "fixed")
    with pytest.raises(PayloadTypeError, match="dtype|1-D"):
        q.push_many(bad)
    assert len(q) == 0


@pytest.mark.parametrize("bad", [b"abc", "abc", 5, {"a": 1}, None])
def test_q31_a_single_value_is_not_a_batch(db, flavour, bad):
    # SPEC Q31
    q = open_q(db, flavour)
    with pytest.raises(PayloadTypeError, match="sequence of payloads"):
        q.push_many(bad)
    assert len(q) == 0


@pytest.mark.parametrize("bad", [-1, float("nan"), "soon"])
def test_q31_bad_delay_is_refused(db, flavour, bad):
    # SPEC Q31
    q = open_q(db, flavour)
    with pytest.raises((ConfigError, TypeError)):
        q.push_many(payloads(flavour, range(3)), delay=bad)
    assert len(q) == 0


def test_q31_delay_applies_to_every_row(db, clock, flavour):
    # SPEC Q31
    q = open_q(db, flavour)
    q.push_many(payloads(flavour, range(4)), delay=timedelta(seconds=10))
    assert len(q.lease_batch(4)) == 0
    clock.advance(10_000)
    assert len(q.lease_batch(4)) == 4


def test_q31_var_batch_is_one_log_record(db):
    # SPEC Q31: one log record per batch
    q = open_q(db, "var")
    commits = db.txlog.commits
    q.push_many(payloads("var", range(64)))
    assert db.txlog.commits == commits + 1


def test_q31_batches_survive_a_reopen_and_check_is_clean(tmp_path: Path, flavour):
    # SPEC Q31
    path = tmp_path / "db"
    with Db.open(path) as db:
        q = open_q(db, flavour, shards=3)
        ids = list(q.push_many(payloads(flavour, range(300))))
        if flavour == "fixed":
            ids += q.push_many(array(range(300, 600))).tolist()
    with Db.open(path) as db:
        q = open_q(db, flavour, shards=3)
        snap = q.snapshot()
        assert sorted(snap["id"].tolist()) == ids
        got = q.lease(len(ids))
        assert sorted(doc_of(lz.payload) for lz in got) == list(range(len(ids)))
    report = armdb.check(path)
    assert report.ok, report


def test_q31_a_large_numpy_batch(db):
    # SPEC Q31: a NumPy user pushes a large array with one call
    q = open_q(db, "fixed")
    n = 200_000
    ids = q.push_many(array(np.arange(n)))
    assert len(ids) == n and len(q) == n
    b = q.lease_batch(n)
    assert np.array_equal(b.payloads["doc"], np.arange(n, dtype=np.uint64))
    assert q.ack_many(b) == n and len(q) == 0


# -- Q32 lease_batch and ack_many ----------------------------------------------------------------


def test_q32_lease_batch_arrays_and_iteration(db, clock, flavour):
    # SPEC Q32
    q = open_q(db, flavour)
    ids = q.push_many(payloads(flavour, range(10)))
    b = q.lease_batch(6)
    assert isinstance(b, LeaseBatch) and len(b) == 6
    assert b.ids.dtype == np.uint64 and b.ids.tolist() == ids[:6]
    assert b.attempts.tolist() == [1] * 6
    assert b.deadlines.dtype == np.dtype("datetime64[ms]")
    assert (b.deadlines == np.datetime64(clock.ms + 30_000, "ms")).all()
    leases = list(b)
    assert [lz.id for lz in leases] == ids[:6]
    assert [doc_of(lz.payload) for lz in leases] == list(range(6))
    assert leases[0].deadline.timestamp() * 1000 == clock.ms + 30_000
    if flavour == "fixed":
        assert b.payloads.dtype == REC and b.payloads["doc"].tolist() == list(range(6))
    else:
        assert b.payloads == [Job(i) for i in range(6)]
    assert doc_of(b[2].payload) == 2 and "6 leases" in repr(b)


def test_q32_leases_of_a_batch_settle_one_by_one(db, flavour):
    # SPEC Q32: each Lease of a batch is a Lease
    q = open_q(db, flavour)
    q.push_many(payloads(flavour, range(3)))
    a, b, c = q.lease_batch(3)
    q.ack(a)
    q.nack(b, delay=0)
    q.extend(c, by=100)
    assert len(q) == 2


def test_q32_ack_many_acks_a_batch_in_one_commit(db, flavour):
    # SPEC Q32
    q = open_q(db, flavour)
    q.push_many(payloads(flavour, range(64)))
    b = q.lease_batch(64)
    commits = db.txlog.commits
    assert q.ack_many(b) == 64
    assert db.txlog.commits == commits + 1  # one log record for the whole batch
    assert len(q) == 0
    if flavour == "var":
        assert len(q._payload) == 0  # the bodies went with their rows


def test_q32_ack_many_takes_leases_and_tokens(db, flavour):
    # SPEC Q32, Q30
    q = open_q(db, flavour)
    q.push_many(payloads(flavour, range(6)))
    leases = q.lease(6)
    assert q.ack_many(leases[:3]) == 3
    assert q.ack_many([leases[3].token, leases[4], leases[5].token]) == 3
    assert len(q) == 0 and q.ack_many([]) == 0


def test_q32_one_stale_token_acks_none(db, clock, flavour):
    # SPEC Q32: all or nothing
    q = open_q(db, flavour)
    q.push_many(payloads(flavour, range(5)))
    b = q.lease_batch(5)
    q.ack(b[3])
    with pytest.raises(StaleToken, match="nothing of this batch was acked"):
        q.ack_many(b)
    assert len(q) == 4
    rest = [lz for i, lz in enumerate(b) if i != 3]
    assert q.ack_many(rest) == 4


def test_q32_a_re_leased_row_makes_the_batch_stale(db, clock, flavour):
    # SPEC Q32, Q13
    q = open_q(db, flavour, lease_timeout=1)
    q.push_many(payloads(flavour, range(3)))
    b = q.lease_batch(3)
    clock.advance(2_000)
    assert len(q.lease(1)) == 1
    with pytest.raises(StaleToken):
        q.ack_many(b)
    assert len(q) == 3


def test_q32_a_token_twice_in_a_batch_acks_none(db, flavour):
    # SPEC Q32
    q = open_q(db, flavour)
    q.push_many(payloads(flavour, range(2)))
    a, b = q.lease(2)
    with pytest.raises(StaleToken, match="twice"):
        q.ack_many([a, b, a.token])
    assert len(q) == 2


def test_q32_a_batch_from_another_queue_is_stale(db, flavour):
    # SPEC Q32
    q = open_q(db, flavour)
    other = db.open_queue(armdb.queue("other", payload=REC))
    other.push_many(array(range(3)))
    b = other.lease_batch(3)
    with pytest.raises(StaleToken, match="another handle"):
        q.ack_many(b)
    with pytest.raises(StaleToken):
        q.ack_many(list(b))
    assert len(other) == 3


@pytest.mark.parametrize("shape", ["lease", "token", "batch"])
def test_q32_ack_many_of_one_lease_acks_as_ack_does(db, clock, flavour, shape):
    # SPEC Q32: one lease takes the lone ack's path, with the same effects and refusals
    q = open_q(db, flavour, lease_timeout=1)
    q.push_many(payloads(flavour, range(3)))

    def one() -> object:
        if shape == "batch":
            return q.lease_batch(1)
        (lz,) = q.lease(1)
        return [lz if shape == "lease" else lz.token]

    first = one()
    assert q.ack_many(first) == 1
    assert len(q) == 2
    if flavour == "var":
        assert len(q._payload) == 2  # its body went with it
    with pytest.raises(StaleToken):
        q.ack_many(first)  # acked already: nothing changes
    second = one()
    clock.advance(2_000)
    assert len(q.lease(1)) == 1  # the same row, leased again
    with pytest.raises(StaleToken):
        q.ack_many(second)
    assert len(q) == 2
    other = db.open_queue(armdb.queue("other", payload=REC))
    other.push_many(array(range(1)))
    (theirs,) = other.lease(1)
    with pytest.raises(StaleToken):
        q.ack_many([theirs])
    assert len(other) == 1 and len(q) == 2


@pytest.mark.parametrize("bad", [5, "abc", [1, 2], [None], b"xx"])
def test_q32_ack_many_of_something_else_is_not_a_lease(db, bad):
    # SPEC Q30, Q32: a TypeError, never StaleToken
    q = open_q(db, "fixed")
    with pytest.raises(NotALease):
        q.ack_many(bad)


def test_q32_ack_many_of_a_single_lease_says_to_use_ack(db):
    # SPEC Q32
    q = open_q(db, "fixed")
    q.push_many(array([1]))
    (lease,) = q.lease(1)
    with pytest.raises(NotALease, match="ack"):
        q.ack_many(lease)
    assert isinstance(NotALease("x"), TypeError)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3", 1_000_001])
def test_q32_lease_batch_bad_n_is_a_config_error(db, flavour, bad):
    # SPEC Q32
    q = open_q(db, flavour)
    q.push_many(payloads(flavour, range(2)))
    with pytest.raises(ConfigError, match="lease_batch"):
        q.lease_batch(bad)
    assert q.stats().leased == 0


@pytest.mark.parametrize("bad", [0, -1, float("nan")])
def test_q32_lease_batch_bad_timeout_is_a_config_error(db, flavour, bad):
    # SPEC Q32
    q = open_q(db, flavour)
    q.push_many(payloads(flavour, range(2)))
    with pytest.raises((ConfigError, TypeError)):
        q.lease_batch(2, lease_timeout=bad)
    assert q.stats().leased == 0


def test_q32_custom_lease_timeout_is_remembered_by_extend(db, clock, flavour):
    # SPEC Q32, Q29
    q = open_q(db, flavour)
    q.push_many(payloads(flavour, range(2)))
    b = q.lease_batch(2, lease_timeout=5)
    assert (b.deadlines == np.datetime64(clock.ms + 5_000, "ms")).all()
    clock.advance(1_000)
    assert q.extend(b[0]).timestamp() * 1000 == clock.ms + 5_000


def test_q32_several_shards_lease_in_key_order(db, flavour):
    # SPEC Q32, Q5
    q = open_q(db, flavour, shards=4)
    ids = q.push_many(payloads(flavour, range(100)))
    b = q.lease_batch(37)
    assert b.ids.tolist() == list(ids[:37])
    assert sorted(set(b._shards.tolist())) == [0, 1, 2, 3]
    assert q.ack_many(b) == 37
    b2 = q.lease_batch(100)
    assert b2.ids.tolist() == list(ids[37:])
    assert q.ack_many(b2) == 63 and len(q) == 0


def test_q32_expired_rows_at_max_attempts_are_dead_lettered_not_leased(db, clock, flavour):
    # SPEC Q32, Q9: the same rules as lease(n)
    q = open_q(db, flavour, lease_timeout=1, max_attempts=1)
    q.push_many(payloads(flavour, range(4)))
    q.lease_batch(2)
    clock.advance(2_000)
    b = q.lease_batch(4)
    assert len(b) == 2 and q.dead_len() == 2


# -- crash safety ---------------------------------------------------------------------------------

BATCH = 40

PUSH_CHILD = """
import numpy as np, armdb
from tests.test_batches import FixedQ, VarQ, Job, array, payloads, cfg
flavour = {flavour!r}
db = armdb.Db.open({path!r})
q = db.open_queue(FixedQ if flavour == "fixed" else VarQ, cfg(shards=2))
print("open", flush=True)
for b in range(10_000):
    docs = range(b * {batch}, (b + 1) * {batch})
    if flavour == "fixed" and b % 2:
        q.push_many(array(list(docs)))
    else:
        q.push_many(payloads(flavour, docs))
    print("pushed", b, flush=True)
"""


def _docs_by_batch(q) -> dict[int, int]:
    """Live rows (ready or leased: a killed child may hold leases) per push batch."""
    counts: dict[int, int] = {}
    for job in q.peek(1_000_000):
        counts[doc_of(job.payload) // BATCH] = counts.get(doc_of(job.payload) // BATCH, 0) + 1
    return counts


@pytest.mark.crash
def test_q31_kill_mid_batch_leaves_each_batch_whole_or_absent(tmp_path: Path, flavour):
    # SPEC Q31: after a crash all rows of a batch exist or none
    rng = random.Random(f"push-many-{flavour}")
    rounds = int(os.environ.get("ARMDB_BATCH_ROUNDS", "20"))
    for r in range(rounds):
        path = tmp_path / f"round-{r}"
        p = spawn_child(PUSH_CHILD.format(flavour=flavour, path=str(path), batch=BATCH))
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "open"
        time.sleep(rng.uniform(0.005, 0.06))
        out, _err = kill_and_read(p)
        # Only whole lines: the kill may cut the last one.
        returned = [int(line.split()[1]) for line in out.split("\n")[:-1] if line.startswith("pushed")]
        with Db.open(path) as db:
            q = open_q(db, flavour, shards=2)
            counts = _docs_by_batch(q)
        assert all(c == BATCH for c in counts.values()), counts  # whole or absent
        assert set(returned) <= set(counts), "a batch whose push_many returned is missing"
        report = armdb.check(path)
        assert report.ok, report
        shutil.rmtree(path)


ACK_CHILD = """
import armdb
from tests.test_batches import FixedQ, VarQ, cfg
flavour = {flavour!r}
db = armdb.Db.open({path!r})
q = db.open_queue(FixedQ if flavour == "fixed" else VarQ, cfg(shards=2))
print("open", flush=True)
while True:
    b = q.lease_batch({batch})
    if not len(b):
        break
    q.ack_many(b if flavour == "fixed" else list(b))
"""


@pytest.mark.crash
def test_q32_kill_mid_ack_many_acks_each_batch_whole_or_not_at_all(tmp_path: Path, flavour):
    # SPEC Q32: ack_many is all or nothing across a crash
    golden = tmp_path / "golden"
    with Db.open(golden) as db:
        q = open_q(db, flavour, shards=2)
        for b in range(30):
            q.push_many(payloads(flavour, range(b * BATCH, (b + 1) * BATCH)))
    rng = random.Random(f"ack-many-{flavour}")
    rounds = int(os.environ.get("ARMDB_BATCH_ROUNDS", "20"))
    for r in range(rounds):
        path = tmp_path / f"round-{r}"
        shutil.copytree(golden, path)
        p = spawn_child(ACK_CHILD.format(flavour=flavour, path=str(path), batch=BATCH))
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "open"
        time.sleep(rng.uniform(0, 0.03))
        kill_and_read(p)
        with Db.open(path) as db:
            q = open_q(db, flavour, shards=2)
            counts = _docs_by_batch(q)
            if flavour == "var":
                assert len(q._payload) == sum(counts.values())  # no body lost, none left behind
        # Lease batches are the push batches (key order), so each is acked whole or not at all.
        assert all(c == BATCH for c in counts.values()), counts
        report = armdb.check(path)
        assert report.ok, report
        shutil.rmtree(path)


REPLAY_CHILD = """
import armdb
from tests.test_batches import FixedQ, VarQ, array, payloads, cfg
flavour = {flavour!r}
db = armdb.Db.open({path!r})
q = db.open_queue(FixedQ if flavour == "fixed" else VarQ, cfg(shards=2))
{op}
"""


@pytest.mark.crash
@pytest.mark.parametrize("op", ["push", "ack"])
def test_q31_q32_crash_after_the_log_append_is_finished_by_replay(tmp_path: Path, flavour, op):
    # SPEC Q31, Q32: the record is logged, nothing is applied; the next open applies all of it
    path = tmp_path / "db"
    with Db.open(path) as db:
        q = open_q(db, flavour, shards=2)
        q.push_many(payloads(flavour, range(100)))
    code = ("q.push_many(array(list(range(100, 200))) if flavour == 'fixed' else payloads(flavour, range(100, 200)))"
            if op == "push" else "q.ack_many(q.lease_batch(100))")
    r = run_child(REPLAY_CHILD.format(flavour=flavour, path=str(path), op=code),
                  env=child_env(ARMDB_FAILPOINT="txlog.after_append"))
    assert r.returncode == 86, r.stderr
    with Db.open(path) as db:
        q = open_q(db, flavour, shards=2)
        assert len(q) == (200 if op == "push" else 0)
        if flavour == "var":
            assert len(q._payload) == len(q)
    report = armdb.check(path)
    assert report.ok, report


def _body_cfg(cache_bytes: int) -> QueueConfig:
    return QueueConfig.balanced().payload_config(armdb.Config.balanced().cache_bytes(cache_bytes).build()).build()


def test_q31_q32_batches_keep_the_payload_cache_within_budget(db):
    # SPEC Q31, Q32: push_many fills the body cache within its budget, a full cache taking
    # no more (it keeps the oldest, leased first); lease_batch reads cached bodies without
    # the data file and the others from it (a partly cached batch); ack_many empties the cache
    qq = db.open_queue(VarQ, _body_cfg(300))
    ids = qq.push_many([Job(10**12 + i) for i in range(100)])
    body = len(qq._cache[ids[0]])  # every body has this size (a uint64 in an array)
    assert qq._cache_bytes == sum(map(len, qq._cache.values())) <= 300
    assert list(qq._cache) == ids[:len(qq._cache)]  # the oldest bodies, and as many as fit
    assert len(qq._cache) == 300 // body
    more = qq.push_many([Job(i) for i in range(5)]) + [qq.push(Job(5))]  # full: neither batch nor lone push cached
    assert list(qq._cache) == ids[:300 // body] and not set(more) & set(qq._cache)
    ids += more
    got = qq.lease_batch(200)
    assert list(got.payloads) == [Job(10**12 + i) for i in range(100)] + [Job(i) for i in range(6)]
    assert got.ids.tolist() == ids
    assert qq.ack_many(got) == 106
    assert len(qq._cache) == 0 and qq._cache_bytes == 0


def test_q32_lease_batch_of_cached_bodies_reads_no_data_file(db, monkeypatch):
    # SPEC Q32: a batch whose bodies are all cached is decoded from the cache alone
    qq = db.open_queue(VarQ, _body_cfg(1 << 20))
    qq.push_many([Job(i) for i in range(50)])

    def no_disk(key):
        raise AssertionError("lease_batch read the data file although every body was cached")

    monkeypatch.setattr(qq._payload, "get", no_disk)
    got = qq.lease_batch(50)
    assert list(got.payloads) == [Job(i) for i in range(50)]
    monkeypatch.undo()
    qq.ack_many(got)


def test_q32_a_body_larger_than_the_cache_is_not_cached(db):
    # SPEC Q31: a batch whose bodies together pass the budget caches only those that fit
    qq = db.open_queue(armdb.queue("bvb", payload=bytes, var=True), _body_cfg(64))
    big, small = b"b" * 100, b"s"
    ids = qq.push_many([small, big, small])
    assert sorted(qq._cache) == [ids[0], ids[2]] and qq._cache_bytes == 2 * len(qq._cache[ids[0]])
    got = qq.lease_batch(3)
    assert list(got.payloads) == [small, big, small]
    qq.ack_many(got)
    assert qq._cache_bytes == 0 and not qq._cache


# -- one-job batches -------------------------------------------------------------------------------


def test_q31_q32_a_one_job_batch_takes_the_lone_paths_with_the_same_outcome(tmp_path: Path, flavour):
    # SPEC Q31, Q32: push_many of one payload and ack_many of one lease do what the lone
    # push and ack do (no log record), with the batch calls' results and errors
    with Db.open(tmp_path / "db") as db:
        q = open_q(db, flavour, max_depth=3)
        commits = db.txlog.commits
        ids = q.push_many(payloads(flavour, [7]))
        assert ids == [1] and type(ids) is list
        assert db.txlog.commits == commits  # the lone push: a body record and a header slot
        q.push_many(payloads(flavour, [8]), delay=60)
        assert q.push_many(payloads(flavour, [9])) == [3]
        with pytest.raises(QueueFull, match="max_depth=3; nothing was pushed"):
            q.push_many(payloads(flavour, [10]))
        b = q.lease_batch(1)
        assert b.ids.tolist() == [1] and doc_of(b.payloads[0]) == 7
        assert q.ack_many(b) == 1
        with pytest.raises(StaleToken):
            q.ack_many(b)
        (lz,) = q.lease(1)
        assert q.ack_many([lz]) == 1
        with pytest.raises(StaleToken):
            q.ack_many([lz.token])
        with pytest.raises(NotALease):
            q.ack_many([object()])
        assert len(q) == 1
    with Db.open(tmp_path / "db") as db:
        q = open_q(db, flavour, max_depth=3)
        assert [j.id for j in q.peek(10)] == [2]
    assert armdb.check(tmp_path / "db").ok


def test_q31_a_one_job_batch_of_an_encrypted_queue_still_needs_the_log_key(tmp_path: Path):
    # SPEC Q31, S10: the batch's commit is logged with the bodies, so an encrypted queue's
    # push_many needs the log key whatever its length (the lone push needs none)
    from armdb.config import Config
    from armdb.errors import EncryptionKeyRequired

    sealed = QueueConfig.balanced().payload_config(Config.balanced().encryption_key(bytes(range(32))).build()).build()
    with Db.open(tmp_path / "db") as db:
        q = db.open_queue(VarQ, sealed)
        for n in (1, 2):
            with pytest.raises(EncryptionKeyRequired, match="log_encryption_key"):
                q.push_many(payloads("var", range(n)))
        assert len(q) == 0
        assert q.push(Job(5)) == 1


@pytest.mark.parametrize("field, value", [("due", -1), ("seq", 2**70), ("epoch", 2**40), ("epoch", -3)])
def test_q30_a_token_altered_out_of_range_is_not_a_lease(db, flavour, field, value):
    # SPEC Q30: an altered token is NotALease, named by its field, for ack and ack_many alike
    # (a value too wide for its stored field once escaped as a bare OverflowError)
    q = open_q(db, flavour)
    q.push_many(payloads(flavour, range(2)))
    a, b = q.lease(2)
    forged = a.token._replace(**{field: value})
    for call in (q.ack, q.nack, q.extend, lambda t: q.ack_many([t, b.token]), lambda t: q.release_many([t, b.token])):
        with pytest.raises(NotALease, match=f"its {field} is {value}, out of range"):
            call(forged)
    assert len(q) == 2 and q.ack_many([a, b]) == 2  # nothing changed: both still held
