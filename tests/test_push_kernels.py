"""The compiled loops of a var queue's ``push_many`` (armdb._core.fixed.push_body_rows and
bitcask_puts, and ``BitcaskStore.write_puts_locked`` that runs the second): the same log
rows, Bitcask records, hint entries and index as the general batch kernels
(msgpack, ``bitcask_group``, ``write_many_locked``) give for the same batch, which
tests/test_bitcask.py checks record by record.  They only skip the item tuple a row.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import armdb
from armdb import Db
from armdb._core.fixed import bitcask_group, bitcask_index_put_new, bitcask_puts, push_body_rows
from armdb.bitcask import DATA_START, RECORD_MAGIC, BitcaskStore
from armdb.config import Config

HEAD = b"\x95" + msgpack.packb("B") + msgpack.packb("jobs.payload")
MAX_KEY = 0xFFFF - 28


@settings(max_examples=150, deadline=None)
@given(bodies=st.lists(st.binary(max_size=300), max_size=20),
       first=st.integers(0, 2**64 - 21), g0=st.integers(0, 2**64 - 21))
def test_q31_push_body_rows_are_the_log_rows_msgpack_packs(bodies, first, g0):
    # SPEC Q31: a push batch's log record holds every row, packed as msgpack packs it
    packed, keys = push_body_rows(HEAD, first, bodies, g0)
    want = [(first + i).to_bytes(8, "big") for i in range(len(bodies))]
    assert packed == b"".join(msgpack.packb(["B", "jobs.payload", k, b, g0 + i], use_bin_type=True)
                              for i, (k, b) in enumerate(zip(want, bodies, strict=True)))
    assert keys == want
    rows = msgpack.unpackb(bytes([0xDD]) + len(bodies).to_bytes(4, "big") + packed,  # an array 32 of the rows
                           raw=False)
    assert rows == [["B", "jobs.payload", (first + i).to_bytes(8, "big"), b, g0 + i] for i, b in enumerate(bodies)]


def test_q31_push_body_rows_refuses_a_body_that_is_not_bytes():
    # SPEC Q31: the caller hands bytes only; anything else is a bug, never a silent row
    with pytest.raises(TypeError):
        push_body_rows(HEAD, 1, [b"a", "b"], 1)


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(st.tuples(st.binary(max_size=40), st.binary(max_size=500)), min_size=1, max_size=30),
       g0=st.integers(1, 2**40), flag=st.sampled_from([0, 1 << 62]), off=st.integers(0, 2**40))
def test_s6_bitcask_puts_writes_what_the_group_encoder_writes(rows, g0, flag, off):
    # SPEC S6: the records, hint entries and index entries of a batch of puts are those of
    # the group encoder (itself checked record by record in tests/test_bitcask.py)
    keys = [k for k, _ in rows]
    values = [v for _, v in rows]
    items = [(k, v, g0 + i) for i, (k, v) in enumerate(rows)]
    want = bitcask_group(items, {}, 0, flag, RECORD_MAGIC, 7, off, MAX_KEY, 2**32)
    assert want is not None
    got = bitcask_puts(keys, values, g0, g0 - 1, flag, RECORD_MAGIC, 7, off, MAX_KEY, 2**32)
    assert got == (want[0], want[1], want[3])


@pytest.mark.parametrize(("keys", "values", "g0", "highest"), [
    (["k"], [b"v"], 1, 0),                  # a key that is not bytes
    ([b"k"], ["v"], 1, 0),                  # a value that is not bytes
    ([b"k"], [None], 1, 0),                 # a delete: not a put
    ([b"k", b"j"], [b"v"], 1, 0),           # lists of two lengths
    ([b"k"], [b"v"], 0, 0),                 # gsn 0
    ([b"k", b"j"], [b"v", b"w"], (1 << 60) - 1, 0),  # the last gsn above the gsn mask
    ([b"k"], [b"v"], 5, 5),                 # not above the shard's highest gsn
    ([b"k" * 70000], [b"v"], 1, 0),         # a key above the limit
    ([b"k"], [b"v" * 11], 1, 0),            # a value above the limit (10 here)
    ([], [], 1, 0),                         # nothing to write
])
def test_s6_bitcask_puts_leaves_anything_not_plain_to_the_checked_path(keys, values, g0, highest):
    # SPEC S6: the compiled pass never writes what the per-record path would refuse
    assert bitcask_puts(keys, values, g0, highest, 0, RECORD_MAGIC, 1, 0, MAX_KEY, 10) is None


class _Gsn:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> int:
        self.n += 1
        return self.n


def _open(path: Path, gsn: _Gsn, **cfg: object) -> BitcaskStore:
    cfg.setdefault("enable_fsync", False)
    store = BitcaskStore.open(str(path), Config(**cfg), gsn)  # type: ignore[arg-type]
    gsn.n = max(gsn.n, store.max_gsn)
    return store


def _records(root: Path) -> dict[str, bytes]:
    """The records of every data file (after the file header, whose nonce is random)."""
    return {str(p.relative_to(root)): p.read_bytes()[DATA_START:] for p in sorted(root.rglob("*.data"))}


@pytest.mark.parametrize("shards", [1, 2])
def test_s6_write_puts_locked_leaves_the_files_and_index_write_many_locked_leaves(tmp_path: Path, shards: int):
    # SPEC S6, S8: batches of new keys through write_puts_locked (its compiled path, and the
    # general one for two shards and for a batch that rotates the active file) leave the
    # same data and hint files and index as the same batches through write_many_locked,
    # and a reopen reads every value back
    rng = random.Random(shards)
    cfg = {"max_file_size": 64 * 1024, "shard_count": shards}
    a, b = _Gsn(), _Gsn()
    sa, sb = _open(tmp_path / "a", a, **cfg), _open(tmp_path / "b", b, **cfg)
    model: dict[bytes, bytes] = {}
    n = 0
    try:
        for _ in range(40):
            size = rng.choice([1, 5, 64, 300])
            keys = [(n + i).to_bytes(8, "big") for i in range(size)]
            if model and rng.random() < 0.2:  # overwrite some keys: the index's general update
                old = rng.sample(sorted(model), min(len(model), 3))
                keys = [k for k in keys if k not in old] + old
            values = [rng.randbytes(rng.randrange(0, 200)) for _ in keys]
            n += size
            g0 = a.n + 1
            a.n += len(keys)
            sa.write_puts_locked(keys, values, g0)
            sb.write_many_locked([(k, v, b()) for k, v in zip(keys, values, strict=True)])
            model.update(zip(keys, values, strict=True))
        assert [dict(sh.index) for sh in sa._shards] == [dict(sh.index) for sh in sb._shards]
        assert ([{fid: f.dead for fid, f in sh.files.items()} for sh in sa._shards]
                == [{fid: f.dead for fid, f in sh.files.items()} for sh in sb._shards])  # the garbage accounted
        assert len(sa._shards[0].files) > 1  # a batch rotated the active file
    finally:
        sa.close()
        sb.close()
    assert _records(tmp_path / "a") == _records(tmp_path / "b") != {}
    with _open(tmp_path / "a", _Gsn(), **cfg) as ra, _open(tmp_path / "b", _Gsn(), **cfg) as rb:
        assert [dict(sh.index) for sh in ra._shards] == [dict(sh.index) for sh in rb._shards]  # the hints agree
        assert all(ra.get(k) == v for k, v in model.items())


def test_s8_index_put_new_inserts_new_keys_and_stops_at_one_the_index_or_tombs_holds():
    # SPEC S8: a key already held (a put or a tombstone) is left to the general update, which
    # accounts its older record; the keys before it are inserted, the ones after untouched
    keys = [b"a", b"b", b"c", b"d"]
    entries = [(1, i, 10, i + 1, None) for i in range(4)]
    index = {b"c": "old"}
    assert bitcask_index_put_new(index, {}, keys, entries) == 2
    assert index == {b"a": entries[0], b"b": entries[1], b"c": "old"}
    index = {}
    assert bitcask_index_put_new(index, {b"b": "tomb"}, keys, entries) == 1
    assert index == {b"a": entries[0]}
    index = {}
    assert bitcask_index_put_new(index, {}, keys, entries) == 4
    assert index == dict(zip(keys, entries, strict=True))
    with pytest.raises(ValueError):
        bitcask_index_put_new({}, {}, keys, entries[:3])


@pytest.mark.crash
@pytest.mark.parametrize("point", ["txlog.after_append", "bitcask.after_append", "txlog.after_apply"])
def test_q31_a_kill_after_the_bodies_group_write_is_finished_by_replay(tmp_path: Path, point: str):
    # SPEC Q31, T2: a var push batch killed once its record (framed from its blocks of rows)
    # is appended to the log and nothing applied, once its bodies are appended to Bitcask
    # by the compiled group write (its headers not yet applied), or once all of it is
    # applied, reopens with the whole batch: replay applies the logged rows and skips the
    # bodies the store already holds; check finds nothing wrong
    from .conftest import child_env, run_child
    from .test_batches import REPLAY_CHILD, doc_of, open_q, payloads

    path = tmp_path / "db"
    with Db.open(path) as db:
        q = open_q(db, "var", shards=2)
        q.push_many(payloads("var", range(100)))
    r = run_child(REPLAY_CHILD.format(flavour="var", path=str(path), op="q.push_many(payloads(flavour, range(100, 200)))"),
                  env=child_env(ARMDB_FAILPOINT=point))
    assert r.returncode == 86, r.stderr
    with Db.open(path) as db:
        q = open_q(db, "var", shards=2)
        assert len(q) == 200 and len(q._payload) == 200
        assert sorted(doc_of(j.payload) for j in q.peek(1000)) == list(range(200))
    report = armdb.check(path)
    assert report.ok, report


@settings(max_examples=200, deadline=None)
@given(txid=st.integers(0, 2**64 - 1), flags=st.integers(0, 2**32 - 1), head=st.binary(max_size=5),
       parts=st.lists(st.tuples(st.binary(max_size=700), st.booleans()), max_size=5))
def test_t2_log_frame_parts_and_the_parts_are_the_framed_record(txid, flags, head, parts):
    # SPEC T2: the frame (header, CRC over the parts where they lie, head), the parts and
    # the padding end to end are the record of the joined body (log_record, itself checked
    # against the format), byte for byte
    from armdb._core.fixed import log_frame_parts, log_record
    from armdb.txlog import REC_MAGIC, encode_record

    blocks = [bytearray(b) if mutable else b for b, mutable in parts]
    frame, pad = log_frame_parts(REC_MAGIC, flags, txid, head, blocks)
    body = head + b"".join(b for b, _ in parts)
    want = log_record(REC_MAGIC, flags, txid, body)
    assert frame + b"".join(blocks) + pad == want == encode_record(txid, body, flags)
    assert len(frame) == 24 + len(head) and pad == bytes(len(pad)) and len(want) % 8 == 0


def test_t2_log_frame_parts_refuses_a_part_that_is_not_bytes():
    from armdb._core.fixed import log_frame_parts

    with pytest.raises(TypeError):
        log_frame_parts(1, 0, 1, b"\x91", [b"a", memoryview(b"a")])


@settings(max_examples=60, deadline=None)
@given(parts=st.lists(st.tuples(st.binary(max_size=300), st.booleans()), max_size=80),
       big=st.sampled_from([0, 300 * 1024]), offset=st.integers(0, 5000))
def test_pwritev_all_writes_the_join_of_its_parts(tmp_path_factory, parts, big, offset):
    # atomicfile.pwritev_all (TxLog's write of a batch's record) writes what pwrite_all
    # writes for the join: any mix of bytes and bytearray, empty parts, more parts than
    # one vectored call takes (joined), and a write above 256 KiB (without the GIL)
    from armdb._core.atomicfile import pwrite_all, pwritev_all

    blocks: list[bytes | bytearray] = [bytearray(b) if mutable else b for b, mutable in parts]
    if big:
        blocks.insert(len(blocks) // 2, bytes(range(256)) * (big // 256))
    d = tmp_path_factory.mktemp("pwv")
    fa = os.open(d / "a", os.O_RDWR | os.O_CREAT)
    fb = os.open(d / "b", os.O_RDWR | os.O_CREAT)
    try:
        pwritev_all(fa, blocks, offset)
        pwrite_all(fb, b"".join(blocks), offset)
        assert (d / "a").read_bytes() == (d / "b").read_bytes()
        assert os.fstat(fa).st_size == (offset + sum(map(len, blocks)) if any(blocks) else 0)
    finally:
        os.close(fa)
        os.close(fb)


def test_pwritev_all_raises_oserror_and_refuses_other_parts(tmp_path: Path):
    import errno

    from armdb._core.atomicfile import pwritev_all

    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        with pytest.raises(TypeError):
            pwritev_all(fd, [b"a", memoryview(b"b")], 0)
        with pytest.raises(OSError) as err:
            pwritev_all(fd, [b"a"], -1)
        assert err.value.errno == errno.EINVAL
    finally:
        os.close(fd)
    with pytest.raises(OSError) as err:
        pwritev_all(fd, [b"a", b"b"], 0)  # closed descriptor
    assert err.value.errno == errno.EBADF


def test_realfs_pwritev_goes_through_an_overriding_pwrite_as_one_joined_write(tmp_path: Path):
    # A file system that overrides pwrite (fault injection, recording, replication) sees a
    # batch's record as it saw it before: one pwrite of the whole record
    from armdb import _fs

    calls: list[tuple[bytes, int]] = []

    class Recording(_fs.RealFS):
        def pwrite(self, fd: int, data, offset: int) -> None:
            calls.append((bytes(data), offset))
            super().pwrite(fd, data, offset)

    fs = Recording()
    fd = fs.open(str(tmp_path / "f"), os.O_RDWR | os.O_CREAT)
    try:
        fs.pwritev(fd, [b"ab", bytearray(b"cd"), b""], 3)
        _fs.RealFS().pwritev(fd, [b"x", bytearray(b"yz")], 0)
        assert fs.pread(fd, 100, 0) == b"xyzabcd"
    finally:
        fs.close(fd)
    assert calls == [(b"abcd", 3)]


def _old_body(rows: list, packed: list[tuple[int, bytes]]) -> bytes:
    """The record body as TxLog.append joined it before it framed the parts (88bebb7)."""
    from armdb._pack import packb
    from armdb.txlog import _list_header

    if not rows and len(packed) == 1:
        return _list_header(packed[0][0]) + packed[0][1]
    parts = [_list_header(len(rows) + sum(c for c, _ in packed))]
    if rows:
        parts.append(packb(rows)[len(_list_header(len(rows))):])
    parts.extend(b for _, b in packed)
    return b"".join(parts)


@pytest.mark.parametrize("shards", [1, 3])
def test_t2_a_var_batch_logs_the_record_it_logged_when_its_body_was_joined(tmp_path: Path, shards: int):
    # SPEC Q31, T2: the record of a push_many (its body blocks and a bytearray of header
    # rows, framed without a join) holds the bytes the joined body gave; and a commit of
    # rows plus blocks (TxLog.append's general case) too
    from armdb.txlog import parse_records

    from .test_batches import open_q, payloads

    with Db.open(tmp_path / "db") as db:
        q = open_q(db, "var", shards=shards)
        txlog = db.txlog
        seen: list[tuple[int, bytes]] = []
        append = txlog.append

        def spy(rows, packed=None, behind=False):
            start = txlog._end
            want = _old_body(rows, [(c, bytes(b)) for c, b in packed]) if packed else None
            end = append(rows, packed, behind)
            if want is not None:
                seen.append((start, want))
            return end

        txlog.append = spy
        q.push_many(payloads("var", range(40)))
        q.push_many(payloads("var", range(40, 42)))  # (one job takes the lone push: no record)
        raw = Path(txlog._path).read_bytes()
    assert len(seen) == 2
    for start, want in seen:
        recs, _, err = parse_records(raw[start:], 0)
        assert err is None and recs[0][2] == want

