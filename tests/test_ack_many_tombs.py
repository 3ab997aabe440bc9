"""``ack_many``'s body deletes: the compiled tombstone kernels against their Python-side
references, the store's batch delete against its group write, and kills mid-ack_many on
the default (one payload shard) store, the common batch path."""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import armdb
from armdb import Db
from armdb._core.fixed import bitcask_tombs_settle, bitcask_tombs_take, tomb_rows
from armdb.bitcask import RECORD_MAGIC, TOMBSTONE

from .conftest import child_env, kill_and_read, run_child, spawn_child
from .test_batches import BATCH, VarQ, doc_of, payloads
from .test_bitcask import Gsn, open_store

HEAD = b"\x95\xa1B\xa4jobs"  # the packed start of ["B", "jobs", ...


@settings(max_examples=100, deadline=None)
@given(seqs=st.lists(st.integers(0, 2**64 - 1), max_size=40), g0=st.integers(1, 2**60),
       prefix=st.binary(max_size=12))
def test_q14_tomb_rows_are_the_body_rows_of_deletes(seqs, g0, prefix):
    # SPEC Q14: an ack_many logs each body's delete as the row msgpack packs for it
    ids = np.array(seqs, dtype=np.uint64)
    out = bytearray(prefix)
    keys = tomb_rows(HEAD, ids, g0, out)
    want = [q.to_bytes(8, "big") for q in seqs]
    assert bytes(out) == prefix + b"".join(msgpack.packb(["B", "jobs", k, None, g0 + i], use_bin_type=True)
                                           for i, k in enumerate(want))
    assert keys == want


def test_s6_tombstone_encoder_leaves_a_key_not_plain_to_the_checked_path():
    # SPEC S6: the compiled pass never writes what the per-record path would refuse, and
    # leaves the index as it was
    index = {"k": None}
    assert bitcask_tombs_take(["k"], index, 3, 1, 0, 0, RECORD_MAGIC, 0, 100) is None  # type: ignore[list-item]
    assert index == {"k": None}
    index2 = {b"k" * 200: (3, 0, 240, 1, None)}
    assert bitcask_tombs_take([b"k" * 200], index2, 3, 1, 0, 0, RECORD_MAGIC, 0, 100) is None
    assert index2 == {b"k" * 200: (3, 0, 240, 1, None)}


def test_s6_tombstone_index_stops_at_a_key_of_another_case():
    # SPEC S6: a put in an older file (or with older holders) goes to the general update
    index = {b"a": (3, 0, 40, 1, None), b"b": (2, 0, 40, 2, None), b"c": (3, 40, 40, 3, None)}
    keys = [b"a", b"b", b"c"]
    got = bitcask_tombs_take(keys, index, 3, 10, 0, 1 << 62, RECORD_MAGIC, 100, 100)
    assert got is not None
    _data, _hints, kinds, taken = got
    assert kinds == b"\x01\x02\x01"
    dead, stop, off, word = bitcask_tombs_settle(keys, kinds, taken, 100, 10, 1 << 62, 0)
    assert (dead, stop, off, word) == (40 + 24, 1, 124, 11 | TOMBSTONE)  # (a 1-byte key: 24-byte record)
    assert b"a" not in index and index[b"b"] == (2, 0, 40, 2, None)  # b is left for the caller
    dead, stop, off, word = bitcask_tombs_settle(keys, kinds, taken, 148, 10, 1 << 62, 2)
    assert (dead, stop, off) == (40 + 24, 3, 172) and b"c" not in index
    # the first record written carries the flag
    index = {b"a": (2, 0, 40, 1, None)}
    got = bitcask_tombs_take([b"a"], index, 3, 10, 0, 1 << 62, RECORD_MAGIC, 0, 100)
    assert got is not None
    assert bitcask_tombs_settle([b"a"], got[2], got[3], 0, 10, 1 << 62, 0) == (0, 0, 0, 10 | TOMBSTONE | 1 << 62)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 60), dels=st.lists(st.integers(0, 70), max_size=40, unique=True),
       big=st.booleans())
def test_s6_store_batch_delete_matches_the_group_write(tmp_path_factory, n, dels, big):
    # SPEC S6: BitcaskStore.delete_many_locked leaves the index, the tombstone map, the
    # dead counts and the data files as write_many_locked does for the same deletes (a
    # key missing, a put in an older file after rotations, a rotation within the batch)
    base = tmp_path_factory.mktemp("tombs")
    stores = []
    for name in ("batch", "group"):
        gsn = Gsn()
        s = open_store(base / name, gsn, max_file_size=64 * 1024)
        value = b"v" * (3000 if big else 40)
        for i in range(n):
            s.put(i.to_bytes(8, "big"), value)
        stores.append((s, gsn))
    keys = [d.to_bytes(8, "big") for d in dels]
    try:
        for (s, gsn), batch in zip(stores, (True, False), strict=True):
            g0 = gsn.n + 1
            gsn.n += len(keys)
            with s.lock_for(b""):
                if batch:
                    s.delete_many_locked(keys, g0)
                else:
                    s.write_many_locked([(k, None, g0 + i) for i, k in enumerate(keys)])
        a, b = (s._shards[0] for s, _ in stores)
        assert a.index == b.index
        assert a.tombs == b.tombs
        assert a.highest == b.highest
        assert {f: x.dead for f, x in a.files.items()} == {f: x.dead for f, x in b.files.items()}
        assert {f: x.size for f, x in a.files.items()} == {f: x.size for f, x in b.files.items()}
        assert a.active.dead == b.active.dead and a.active.size == b.active.size
        for s, _ in stores:
            assert sorted(s.keys()) == sorted(i.to_bytes(8, "big") for i in range(n) if i not in dels)
    finally:
        for s, _ in stores:
            s.close()


KILL_CHILD = """
import armdb
from tests.test_batches import VarQ
db = armdb.Db.open({path!r})
q = db.open_queue(VarQ)
print("open", flush=True)
while True:
    b = q.lease_batch({batch})
    if not len(b):
        break
    q.ack_many(b)
"""


def _live_by_batch(q) -> dict[int, int]:
    counts: dict[int, int] = {}
    for job in q.peek(1_000_000):
        counts[doc_of(job.payload) // BATCH] = counts.get(doc_of(job.payload) // BATCH, 0) + 1
    return counts


@pytest.mark.crash
def test_q14_q32_kill_mid_ack_many_on_the_default_store(tmp_path: Path):
    # SPEC Q14, Q32: killed at any point of ack_many (the LeaseBatch path, one payload
    # shard: the compiled tombstone write), each batch is acked whole or not at all, and
    # a row leaves with its body
    golden = tmp_path / "golden"
    with Db.open(golden) as db:
        q = db.open_queue(VarQ)
        for b in range(30):
            q.push_many(payloads("var", range(b * BATCH, (b + 1) * BATCH)))
    rng = random.Random("ack-many-default")
    for r in range(6):
        path = tmp_path / f"round-{r}"
        shutil.copytree(golden, path)
        p = spawn_child(KILL_CHILD.format(path=str(path), batch=BATCH))
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "open"
        time.sleep(rng.uniform(0, 0.03))
        kill_and_read(p)
        with Db.open(path) as db:
            q = db.open_queue(VarQ)
            counts = _live_by_batch(q)
            assert len(q._payload) == sum(counts.values())  # no body lost, none left behind
        assert all(c == BATCH for c in counts.values()), counts
        report = armdb.check(path)
        assert report.ok, report
        shutil.rmtree(path)


FAIL_CHILD = """
import armdb
from tests.test_batches import VarQ
db = armdb.Db.open({path!r})
q = db.open_queue(VarQ)
q.ack_many(q.lease_batch(100))
"""


@pytest.mark.crash
@pytest.mark.parametrize("point", ["txlog.after_append", "bitcask.after_append", "txlog.after_apply"])
def test_q14_q32_death_inside_ack_many_is_finished_by_replay(tmp_path: Path, point):
    # SPEC Q14, Q32: dead after the log append (nothing applied), after the tombstones'
    # append (headers applied, the body index not yet) or after the apply: the next open
    # finishes the whole batch, rows and bodies
    path = tmp_path / "db"
    with Db.open(path) as db:
        q = db.open_queue(VarQ)
        q.push_many(payloads("var", range(150)))
    r = run_child(FAIL_CHILD.format(path=str(path)), env=child_env(ARMDB_FAILPOINT=point))
    assert r.returncode == 86, r.stderr
    with Db.open(path) as db:
        q = db.open_queue(VarQ)
        assert len(q) == 50
        assert len(q._payload) == 50
        assert sorted(doc_of(j.payload) for j in q.peek(100)) == list(range(100, 150))
    report = armdb.check(path)
    assert report.ok, report


@pytest.mark.parametrize("spill", [200, 4 << 20])
def test_s6_hint_files_of_mixed_lone_and_group_writes_match_their_data_files(tmp_path, monkeypatch, spill):
    # SPEC S6: a hint file built from lone puts (add) and group writes' entries (add_raw,
    # parked and joined at the spill), spilled often or once, lists its data file's records
    from armdb.bitcask import files
    from armdb.bitcask.check import check_dir

    monkeypatch.setattr(files, "_HINT_SPILL", spill)
    gsn = Gsn()
    s = open_store(tmp_path / "c", gsn, max_file_size=64 * 1024)
    value = b"w" * 700
    n = 0
    try:
        for r in range(60):
            s.put(n.to_bytes(8, "big"), value)  # a lone put: its hint entry by add
            n += 1
            keys = [(n + i).to_bytes(8, "big") for i in range(7)]
            g0 = gsn.n + 1
            gsn.n += len(keys)
            with s.lock_for(b""):
                s.write_puts_locked(keys, [value] * len(keys), g0)
            n += len(keys)
            dels = keys[r % 3::3]
            g0 = gsn.n + 1
            gsn.n += len(dels)
            with s.lock_for(b""):
                s.delete_many_locked(dels, g0)
    finally:
        s.close()
    assert len(list((tmp_path / "c").rglob("*.hint"))) >= 3  # the data files rotated, each with its hint
    assert check_dir(str(tmp_path / "c")) == []
    s = open_store(tmp_path / "c", Gsn())
    try:
        live = sorted(s.keys())
        assert len(live) == 60 + 60 * 7 - sum(len(range(r % 3, 7, 3)) for r in range(60))
    finally:
        s.close()
