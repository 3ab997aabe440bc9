"""A var queue's lone ack: the compiled checks of its token (``lone_token``) against the
Python checks they replace, the compiled tombstone of its body (``bitcask_tomb``,
``bitcask_tomb_drop``) against ``bitcask_record`` and the index change of a batch's
tombstones (``test_tombs_take.settle_reference``), the store's ``tomb_locked`` against ``write_locked`` (the same
data files, hint entries and index), and the failpoints of the ack's tombstone write."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import armdb
from armdb._core.fixed import ack_rows, bitcask_record, bitcask_tomb, bitcask_tomb_drop
from armdb._core.qshard import lone_token
from armdb._pack import packb
from armdb.bitcask import RECORD_MAGIC, TOMBSTONE
from armdb.bitcask.format import DATA_START
from armdb.errors import NotALease, StaleToken
from armdb.fixed import DELETED
from armdb.queue import Lease, LeaseToken

from .conftest import child_env, run_child
from .test_bitcask import Gsn, open_store
from .test_tombs_take import settle_reference, take_reference

SEQ_MASK = (1 << 60) - 1
field = st.one_of(st.integers(-3, 2**64), st.booleans(), st.floats(allow_nan=False), st.none())


def _python_check(token: object, handle: int, nshards: int) -> bool:
    """What Queue.ack tested in Python before (and its commit's handle and shard test)."""
    if type(token) is not LeaseToken:
        return False
    h, s, d, q, e = token
    if any(type(v) is not int for v in (h, s, d, q, e)):
        return False
    return h == handle and 0 <= s < nshards


@settings(max_examples=300, deadline=None)
@given(fields=st.tuples(field, field, field, field, field), handle=st.integers(0, 5), nshards=st.integers(0, 4),
       same=st.booleans(), kind=st.sampled_from(["token", "tuple", "lease"]))
def test_q13_lone_token_accepts_exactly_what_the_python_checks_accept(fields, handle, nshards, same, kind):
    # SPEC Q13, Q30: only this handle's unaltered token takes the lean ack; anything else
    # goes to the general path (which raises NotALease or StaleToken)
    if same:
        fields = (handle, *fields[1:])
    token: object = LeaseToken(*fields)
    if kind == "tuple":
        token = tuple(fields)
    elif kind == "lease":
        token = Lease(1, b"", 1, None, token)  # type: ignore[arg-type]
    assert lone_token(token, LeaseToken, handle, nshards) is _python_check(token, handle, nshards)


@settings(max_examples=300, deadline=None)
@given(name=st.text(max_size=40), payload_name=st.text(max_size=300), shard=st.integers(0, 2**32 - 1),
       slot=st.integers(0, 2**32 - 1), version=st.integers(0, 2**32 - 1), seq=st.integers(0, 2**64 - 1),
       gsn=st.integers(0, 2**64 - 1))
def test_q14_lone_ack_record_is_the_rows_msgpack_decodes(name, payload_name, shard, slot, version, seq, gsn):
    # SPEC Q14, T2: the lone ack's record body decodes to its two rows, the header's delete
    # and the body's tombstone, with the ints at the fixed widths the log has always held
    fhead = b"\x97" + packb("F") + packb(name)
    bhead = b"\x95" + packb("B") + packb(payload_name)
    body, key = ack_rows(fhead, shard, slot, version, bhead, seq, gsn)
    assert key == seq.to_bytes(8, "big")
    assert msgpack.unpackb(body, raw=False) == [["F", name, shard, slot, version, DELETED, b""],
                                                ["B", payload_name, key, None, gsn]]
    want = struct.pack(f">B{len(fhead)}sBIBIBIBBBB{len(bhead)}sBB8sBBQ", 0x92, fhead, 0xCE, shard, 0xCE, slot,
                       0xCE, version, DELETED, 0xC5, 0, 0, bhead, 0xC4, 8, key, 0xC0, 0xCF, gsn)
    assert body == want  # (the struct the lone ack packed before)


@settings(max_examples=300, deadline=None)
@given(key=st.one_of(st.binary(max_size=40), st.text(max_size=3)), present=st.booleans(),
       gsn=st.integers(0, SEQ_MASK + 2), highest=st.integers(0, 50), flag=st.sampled_from([0, 1 << 62]),
       size=st.integers(0, 300), total=st.integers(0, 2), max_size=st.integers(0, 400))
def test_s6_lone_tombstone_is_bitcask_record_s_after_write_locked_s_checks(key, present, gsn, highest, flag, size,
                                                                           total, max_size):
    # SPEC S6: the lone ack's tombstone is the record bitcask_record gives, written only
    # in the case the lean path handles; anything else is None (write_locked judges it)
    index = {key: None} if present else {}
    word = (gsn & ((1 << 64) - 1)) | TOMBSTONE | flag
    got = bitcask_tomb(key, index, word, highest, RECORD_MAGIC, 32, size, total, max_size)
    g = word & SEQ_MASK
    ok = type(key) is bytes and len(key) <= 32 and present and 0 < g and g > highest
    if ok:
        rec = bitcask_record(word, key, b"", RECORD_MAGIC)
        ok = not (total and size + len(rec) > max_size)
    if not ok:
        assert got is None
    else:
        assert got == rec
    assert index == ({key: None} if present else {})  # nothing changed


@settings(max_examples=200, deadline=None)
@given(entry=st.one_of(st.none(), st.tuples(st.integers(1, 4), st.integers(0, 99), st.integers(24, 90),
                                            st.integers(1, 9), st.one_of(st.none(), st.just(frozenset({1}))))),
       fid=st.integers(1, 4))
def test_s6_lone_tombstone_index_change_is_the_batch_one(entry, fid):
    # SPEC S6: the lone drop changes the index as a batch's tombstones do for one key
    a = {b"k": entry} if entry is not None else {}
    b = dict(a)
    dropped = bitcask_tomb_drop(a, b"k", fid)
    if entry is None:  # a missing key: nothing to drop, for the general path
        assert dropped == -1 and a == b == {}
        return
    took = take_reference([b"k"], b, fid)
    assert took is not None
    dead, stop, _off, _word = settle_reference([b"k"], *took, 0, 5, 0, 0)
    assert a == b
    if stop == 1:
        assert dropped == dead - 24  # (a 3-byte key: a 24-byte tombstone)
    else:
        assert dropped == -1


def _tail(path: str) -> bytes:
    return Path(path).read_bytes()[DATA_START:]


@pytest.mark.parametrize("case", ["plain", "sealed", "rotation", "missing", "older_file", "shards"])
def test_s6_tomb_locked_writes_what_write_locked_writes(tmp_path: Path, case: str) -> None:
    # SPEC S6: the lone ack's delete leaves the same files, index, tombstones, dead counts
    # and hint entries as write_locked's delete, in the lean case and in those it hands on
    cfg: dict[str, object] = {}
    if case == "rotation":
        cfg["max_file_size"] = 4096
    if case == "shards":
        cfg["shard_count"] = 2
    if case == "sealed":
        cfg["encryption_key"] = b"k" * 32
    stores = []
    for name in ("lone", "general"):
        gsn = Gsn()
        s = open_store(tmp_path / name, gsn, **cfg)
        value = b"v" * (1000 if case == "rotation" else 40)
        for i in range(6):
            s.put(i.to_bytes(8, "big"), value)
        if case == "older_file":
            s._rotate(s._shards[0])
        stores.append((s, gsn))
    keys = [(i if case != "missing" else i + 3).to_bytes(8, "big") for i in range(4)]
    hint_at = [[len(sh.hint.buf) for sh in s._shards] for s, _ in stores]  # (the headers carry an identity)
    try:
        for (s, gsn), lone in zip(stores, (True, False), strict=True):
            for k in keys:
                gsn.n += 1
                with s.lock_for(k):
                    got = s.tomb_locked(k, gsn.n) if lone else s.write_locked(k, None, gsn.n)
                    assert got == (k in [i.to_bytes(8, "big") for i in range(6)])
        for a, b in zip(*(s._shards for s, _ in stores), strict=True):
            assert a.index == b.index and a.tombs == b.tombs and a.highest == b.highest
            assert {f: (x.dead, x.size, x.total) for f, x in a.files.items()} == \
                {f: (x.dead, x.size, x.total) for f, x in b.files.items()}
            assert a.hint.count == b.hint.count
        if case != "sealed":  # (a sealed record and its hint's key carry a fresh nonce)
            for i, (a, b) in enumerate(zip(*(s._shards for s, _ in stores), strict=True)):
                assert bytes(a.hint.buf[hint_at[0][i]:]) == bytes(b.hint.buf[hint_at[1][i]:])
                assert a.hint.crc == b.hint.crc
                if a.active.size > DATA_START:  # the records, after the file's header
                    assert _tail(a.active.path) == _tail(b.active.path)
    finally:
        for s, _ in stores:
            s.close()


def _shard_state(s: Any, hint_at: int) -> tuple[Any, ...]:
    sh = s._shards[0]
    return (sh.index, sh.tombs, sh.highest, {f: (x.dead, x.size, x.total) for f, x in sh.files.items()},
            sh.hint.count, sh.hint.crc, bytes(sh.hint.buf[hint_at:]) if sh.hint.count else b"",
            _tail(sh.active.path) if sh.active.size > DATA_START else b"")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "tomb", "tomb", "sync", "rotate"]), st.integers(0, 7),
                              st.integers(0, 1500)), max_size=40),
       small=st.booleans(), fsync=st.booleans())
def test_s6_compiled_tomb_writes_what_write_locked_writes(tmp_path_factory: pytest.TempPathFactory,
                                                         ops: list[tuple[str, int, int]], small: bool,
                                                         fsync: bool) -> None:
    # SPEC S6: PutKernel.tomb (the compiled tomb_locked a var queue's ack calls) leaves
    # the same records, hint entries, index, tombstones and counts as write_locked's
    # delete, whatever came before (puts, deletes of missing keys, syncs, rotations, a
    # file too full for the tombstone)
    base = tmp_path_factory.mktemp("tomb")
    cfg: dict[str, object] = {"enable_fsync": fsync, "sync_interval": 0.0}
    if small:
        cfg["max_file_size"] = 4096
    stores = []
    for name in ("kernel", "general"):
        gsn = Gsn()
        stores.append((open_store(base / name, gsn, **cfg), gsn))
    hint_at = [len(s._shards[0].hint.buf) for s, _ in stores]  # (the headers carry an identity)
    try:
        for op, k, n in ops:
            key = k.to_bytes(8, "big")
            got = []
            for (s, gsn), kernel in zip(stores, (True, False), strict=True):
                if op == "put":
                    got.append(s.put(key, b"v" * n))
                elif op == "sync":
                    s.sync()
                elif op == "rotate":
                    s._rotate(s._shards[0])
                else:
                    gsn.n += 1
                    with s.lock_for(key):
                        got.append(s._putter.tomb(key, gsn.n) if kernel else s.write_locked(key, None, gsn.n))
            assert got[:1] == got[1:]
        assert _shard_state(stores[0][0], hint_at[0]) == _shard_state(stores[1][0], hint_at[1])
    finally:
        for s, _ in stores:
            s.close()


def test_q14_lone_ack_refuses_what_the_general_path_refuses(tmp_path: Path) -> None:
    # SPEC Q13, Q30: an altered, foreign or spent token is refused, nothing changed
    with armdb.Db.open(str(tmp_path / "db")) as db:
        q = db.open_queue(armdb.queue("jobs", payload=dict, var=True))
        q.push({"n": 1})
        (lz,) = q.lease(1)
        with pytest.raises(NotALease):
            q.ack(lz.token._replace(seq=float(lz.token.seq)))
        with pytest.raises(StaleToken):
            q.ack(lz.token._replace(handle=lz.token.handle + 1))
        with pytest.raises(StaleToken):
            q.ack(lz.token._replace(shard=len(q._shards)))
        assert q.len() == 1
        q.ack(lz)  # a Lease takes the general path
        with pytest.raises(StaleToken):
            q.ack(lz.token)
        assert q.len() == 0 and len(q._payload) == 0


ACK_CHILD = """
import armdb
db = armdb.Db.open({path!r})
q = db.open_queue(armdb.queue("jobs", payload=dict, var=True))
for n in range(3):
    q.push({{"n": n}})
for n in range(2):
    (lz,) = q.lease(1)
    print("leased", lz.id, flush=True)
    q.ack(lz.token)
    print("acked", lz.id, flush=True)
"""


@pytest.mark.crash
@pytest.mark.parametrize("point", ["bitcask.after_append:3", "bitcask.after_append:4", "txlog.after_apply:1"])
def test_t2_lone_ack_killed_in_its_tombstone_is_replayed_whole(tmp_path: Path, point: str) -> None:
    # SPEC T2, Q14: killed in the tombstone write of the first or second ack (the three
    # pushes' body writes pass first), or after the second ack applied: the reopen holds
    # every acked row gone, the one being acked gone too (its record was logged), and the
    # others whole, with a body per header
    path = str(tmp_path / "db")
    r = run_child(ACK_CHILD.format(path=path), env=child_env(ARMDB_FAILPOINT=point))
    assert r.returncode == 86, r.stderr
    leased = [int(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("leased")]
    assert armdb.check(path).ok
    with armdb.Db.open(path) as db:
        q = db.open_queue(armdb.queue("jobs", payload=dict, var=True))
        assert q.len() == 3 - len(leased) and len(q._payload) == q.len()
        left = {j.id: j.payload["n"] for j in q.peek(10)}
        assert not set(left) & set(leased)
        for lz in q.lease(5):
            q.ack(lz.token)
        assert q.len() == 0 and len(q._payload) == 0
    assert armdb.check(path).ok
