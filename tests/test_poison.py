"""One undecodable body never costs the healthy jobs leased with it (issue 14 item 4).

SPEC Q9/Q11 (a lease returns the due rows) and Q12 (at least once): a var body that
cannot be decoded at lease (a tuple dict key msgpack wrote but cannot read back, a
dataclass whose ``__post_init__`` now rejects a stored value, an encrypted body whose
tag fails) is dead-lettered alone, logged and counted in ``stats().poisoned``; the
rest of the batch is delivered.  And a value that would not read back is refused at
``push``/``put`` (direct and in ``db.tx()``), writing nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import struct
import typing
import zlib
from pathlib import Path
from typing import Any

import msgpack
import pytest

import armdb
from armdb import Config, FixedConfig, QueueConfig, State, TxConfig
from armdb.errors import CorruptionError, PayloadTypeError
from armdb.qrows import FLAG_DEAD_EXPLICIT, FLAG_POISONED
from armdb.streams import SchemaRegistry

from .conftest import FakeClock

KEY = bytes(range(32))
LOGKEY = bytes(range(100, 132))

AnyQ = armdb.queue("anyq", payload=typing.Any, var=True)
BytesQ = armdb.queue("encq", payload=bytes, var=True)

# The dataclass whose validation tightens between the push and the lease (a deploy of
# a new version of the class with stored rows written by the old one).
_STRICT = {"on": False}


@dataclasses.dataclass
class Doc:
    n: int
    note: str

    def __post_init__(self) -> None:
        if _STRICT["on"] and self.n == 3:
            raise ValueError("n == 3 is no longer accepted")


DocQ = armdb.queue("docq", payload=Doc, var=True)


@dataclasses.dataclass
class Pair:
    xy: tuple[int, int]

    def __post_init__(self) -> None:
        if not isinstance(self.xy, tuple):
            raise TypeError(f"xy must be a tuple, got {type(self.xy).__name__}")


PairQ = armdb.queue("pairq", payload=Pair, var=True)


@dataclasses.dataclass
class Derived:
    n: int
    twice: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.twice = 2 * self.n


DerivedQ = armdb.queue("derivedq", payload=Derived, var=True)


@dataclasses.dataclass
class Bumps:
    n: int

    def __post_init__(self) -> None:
        self.n += 1  # not idempotent: every read would give a different value


BumpsQ = armdb.queue("bumpsq", payload=Bumps, var=True)


@dataclasses.dataclass
class OwnInit:
    n: int

    def __init__(self, m: int, k: int) -> None:  # noqa: D107 - cannot take the stored [n] back
        self.n = m + k


OwnInitQ = armdb.queue("owninitq", payload=OwnInit, var=True)


@dataclasses.dataclass(kw_only=True)
class KwOnly:
    n: int


KwOnlyQ = armdb.queue("kwonlyq", payload=KwOnly, var=True)


@dataclasses.dataclass
class Plain:
    n: int
    meta: dict[Any, str]


PlainQ = armdb.queue("plainq", payload=Plain, var=True)


def qcfg(shards: int = 1, payload_config: Config | None = None) -> QueueConfig:
    b = (
        QueueConfig.balanced()
        .max_attempts(3)
        .header_config(FixedConfig.balanced().grow_step(1024).shard_count(shards).build())
    )
    if payload_config is not None:
        b = b.payload_config(payload_config)
    return b.build()


@pytest.fixture(autouse=True)
def _lenient() -> Any:
    _STRICT["on"] = False
    yield
    _STRICT["on"] = False


def _lease_all_and_check(q: armdb.Queue[Any], bad: int, good: list[int], expect: dict[int, Any],
                         caplog: pytest.LogCaptureFixture, *, batch: bool = False) -> None:
    """Lease the 5 rows in one call (``lease``, or ``lease_batch``): the 4 healthy ones
    come back, the bad one is dead."""
    with caplog.at_level(logging.WARNING, logger="armdb"):
        got = list(q.lease_batch(5)) if batch else q.lease(5)
    assert sorted(lz.id for lz in got) == good
    for lz in got:
        assert lz.payload == expect[lz.id] and lz.attempt == 1
        q.ack(lz.token)
    st = q.stats()
    assert st.poisoned == 1 and st.dead_len == 1 and st.len == 0
    assert st.to_dict()["poisoned"] == 1 and "poisoned" in st._repr_html_()
    snap = q.snapshot()
    assert snap["id"].tolist() == [bad] and snap["state"].tolist() == [State.DEAD]
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and f"row {bad}" in r.getMessage()]
    assert warned and q.name in warned[0].getMessage()
    assert q.lease(5) == []


def _reopen_clean(path: Path, spec: armdb.QueueSpec, cfg: QueueConfig, clock: FakeClock, bad: int,
                  **db_kw: Any) -> None:
    """check() is clean; after a reopen the dead row is still the only row."""
    report = armdb.check(path)
    assert report.ok, str(report)
    with armdb.Db.open(path, clock=clock, **db_kw) as db:
        q = db.open_queue(spec, cfg)
        assert q.len() == 0 and q.dead_len() == 1
        assert q.snapshot()["id"].tolist() == [bad]
        assert q.stats().poisoned == 0  # a counter since this open
        # the reason is recorded on the row: dead-lettered because its body could not be read
        flags = [q._header(sh, int(slot))[1] for sh in q._shards for slot in sh.fixed.occupied_slots()]
        assert flags == [FLAG_DEAD_EXPLICIT | FLAG_POISONED]
    assert armdb.check(path).ok


@pytest.mark.parametrize("shards", [1, 2])
def test_q9_q12_tuple_key_body_written_raw_is_dead_lettered_alone(db_path: Path, clock: FakeClock,
                                                                  caplog: pytest.LogCaptureFixture,
                                                                  shards: int) -> None:
    cfg = qcfg(shards)
    with armdb.Db.open(db_path, clock=clock) as db:
        q = db.open_queue(AnyQ, cfg)
        ids = [q.push({"i": i}) for i in range(5)]
        bad = ids[2]
        # Bypass the push check: what an older armdb (or another writer) left behind.
        assert q._payload is not None
        q._payload.put(q._key_bytes(bad), msgpack.packb({(1, 2): "x"}, use_bin_type=True))
    with armdb.Db.open(db_path, clock=clock) as db:
        q = db.open_queue(AnyQ, cfg)
        expect = {s: {"i": i} for i, s in enumerate(ids)}
        _lease_all_and_check(q, bad, [s for s in ids if s != bad], expect, caplog)
    _reopen_clean(db_path, AnyQ, cfg, clock, bad)


@pytest.mark.parametrize("batch", [False, True], ids=["lease", "lease_batch"])
@pytest.mark.parametrize("reopen", [False, True], ids=["cached_body", "body_from_disk"])
def test_q9_q12_dataclass_that_now_rejects_a_stored_value_is_dead_lettered_alone(
        db_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture, reopen: bool, batch: bool) -> None:
    # SPEC Q32 too: lease_batch hands out the healthy rows the same way.
    cfg = qcfg()
    db = armdb.Db.open(db_path, clock=clock)
    try:
        q = db.open_queue(DocQ, cfg)
        ids = [q.push(Doc(i, f"d{i}")) for i in range(5)]
        if reopen:
            db.shutdown()
            db = armdb.Db.open(db_path, clock=clock)
            q = db.open_queue(DocQ, cfg)
        _STRICT["on"] = True
        expect = {s: Doc(i, f"d{i}") for i, s in enumerate(ids) if i != 3}
        _lease_all_and_check(q, ids[3], [s for i, s in enumerate(ids) if i != 3], expect, caplog, batch=batch)
    finally:
        db.shutdown()
    _reopen_clean(db_path, DocQ, cfg, clock, ids[3])


def _records(raw: bytes) -> list[tuple[int, int, int]]:
    """(offset, key field length, value field length) of each record of a Bitcask data file."""
    from armdb.bitcask import DATA_START

    out = []
    pos = DATA_START
    while pos + 20 <= len(raw):
        _, _, vlen, magic, klen = struct.unpack_from("<QIIHH", raw, pos)
        if magic != 0xB17C:
            break
        out.append((pos, klen, vlen))
        n = 20 + klen + vlen
        pos += n + (-n % 8)
    return out


def test_q9_q12_encrypted_body_whose_tag_fails_is_dead_lettered_alone(db_path: Path, clock: FakeClock,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    pc = Config.balanced().encryption_key(KEY).shard_count(1).build()
    cfg = qcfg(payload_config=pc)
    tx = TxConfig(log_encryption_key=LOGKEY)
    with armdb.Db.open(db_path, clock=clock, tx_config=tx) as db:
        q = db.open_queue(BytesQ, cfg)
        ids = [q.push(b"body%d" % i) for i in range(5)]
    data = db_path / "collections" / "encq.payload" / "shard-000" / "00000001.data"
    raw = bytearray(data.read_bytes())
    recs = _records(bytes(raw))
    assert len(recs) == 5  # one per push, in push order
    off, klen, vlen = recs[2]
    raw[off + 20 + klen + vlen - 3] ^= 0x40  # inside the value's tag
    # Re-seal the record's CRC (it covers the sealed bytes), so only the tag can tell.
    n = 20 + klen + vlen
    crc = zlib.crc32(bytes(raw[off + 12 : off + n]), zlib.crc32(bytes(raw[off : off + 8])))
    struct.pack_into("<I", raw, off + 8, crc)
    data.write_bytes(bytes(raw))
    assert armdb.check(db_path).ok  # no key: check cannot see a tag failure
    with armdb.Db.open(db_path, clock=clock, tx_config=tx) as db:
        q = db.open_queue(BytesQ, cfg)
        expect = {s: b"body%d" % i for i, s in enumerate(ids)}
        _lease_all_and_check(q, ids[2], [s for s in ids if s != ids[2]], expect, caplog)
    _reopen_clean(db_path, BytesQ, cfg, clock, ids[2], tx_config=tx)


def test_q9_q15_row_whose_body_vanished_is_dead_lettered_alone(db_path: Path, clock: FakeClock,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """A body deleted behind the queue's back (not by a crash: open drops such rows) while
    the row holds this lease: the lease used to raise FormatError for the whole batch."""
    cfg = qcfg()
    with armdb.Db.open(db_path, clock=clock) as db:
        q = db.open_queue(AnyQ, cfg)
        ids = [q.push({"i": i}) for i in range(5)]
        assert q._payload is not None
        q._payload.delete(q._key_bytes(ids[1]))
        q._cache_drop(ids[1])
        expect = {s: {"i": i} for i, s in enumerate(ids)}
        _lease_all_and_check(q, ids[1], [s for s in ids if s != ids[1]], expect, caplog)
    with armdb.Db.open(db_path, clock=clock) as db:
        q = db.open_queue(AnyQ, cfg)  # the dead row without a body is dropped, as every such row
        assert q.len() == 0 and q.dead_len() == 0 and q.stats().repaired_on_open == 1
    assert armdb.check(db_path).ok


def test_q9_a_poisoned_row_does_not_count_as_a_nack(db: armdb.Db) -> None:
    q = db.open_queue(AnyQ, qcfg())
    a = q.push({"ok": 1})
    b = q.push({"ok": 2})
    assert q._payload is not None
    q._payload.put(q._key_bytes(b), msgpack.packb({(1,): 2}, use_bin_type=True))
    q._cache_drop(b)
    (lz,) = q.lease(2)
    assert lz.id == a
    st = q.stats()
    assert (st.poisoned, st.dead_lettered, st.nacks) == (1, 1, 0)


# -- refused at push and put --------------------------------------------------------------------------


def _nothing_written(q: armdb.Queue[Any]) -> None:
    assert q.len() == 0 and q.dead_len() == 0
    assert q._payload is not None and len(q._payload) == 0
    assert q.stats().payload_writes == 0 and q.stats().pushes == 0


@pytest.mark.parametrize(
    "value, where",
    [
        ({(1, 2): "x"}, r"payload has the key \(1, 2\)"),
        ({"a": [1, {(3,): "y"}]}, r"payload\['a'\]\[1\] has the key \(3,\)"),
    ],
)
def test_q9_push_of_a_tuple_dict_key_is_refused_and_writes_nothing(db: armdb.Db, value: Any,
                                                                   where: str) -> None:
    q = db.open_queue(AnyQ, qcfg())
    with pytest.raises(PayloadTypeError, match="dict keys must be str, int, bytes") as e:
        q.push(value)
    assert e.match(where)
    with pytest.raises(PayloadTypeError, match="dict keys"):
        db.tx().push(q, value)
    with pytest.raises(PayloadTypeError, match="dict keys"):
        db.tx().push(q, {"fine": 1}).push(q, value).commit()
    _nothing_written(q)
    assert q.lease(5) == []


def test_q9_values_that_read_back_are_still_accepted(db: armdb.Db) -> None:
    q = db.open_queue(AnyQ, qcfg())
    values = [
        {"t": (1, 2), "k": {1: "int", b"b": "bytes", 1.5: "float", None: "none", False: "bool"}},
        [1, [2, [3]], {"x": None}],
        b"raw",
        "text",
        12,
        None,
    ]
    for v in values:
        q.push(v)
    got = [lz.payload for lz in q.lease(10)]
    # Tuples come back as lists (documented msgpack behaviour), everything else as it was.
    assert got[0] == {"t": [1, 2], "k": {1: "int", b"b": "bytes", 1.5: "float", None: "none", False: "bool"}}
    assert got[1:] == values[1:]
    assert q.stats().poisoned == 0


@pytest.mark.parametrize(
    "spec, value, match",
    [
        (PairQ, Pair((1, 2)), r"cannot be rebuilt.*xy must be a tuple"),
        (DerivedQ, Derived(2), r"cannot be rebuilt.*init=False"),
        (BumpsQ, Bumps(1), r"does not read back as it was written"),
        (OwnInitQ, OwnInit(1, 2), r"cannot be rebuilt"),
        (KwOnlyQ, KwOnly(n=1), r"cannot be rebuilt"),
    ],
    ids=["post_init_rejects_the_list", "init_false_field", "post_init_not_idempotent", "own_init",
         "keyword_only_fields"],
)
def test_q9_dataclass_that_does_not_round_trip_is_refused_at_push(db: armdb.Db, spec: armdb.QueueSpec,
                                                                  value: Any, match: str) -> None:
    q = db.open_queue(spec, qcfg())
    with pytest.raises(PayloadTypeError, match=match):
        q.push(value)
    with pytest.raises(PayloadTypeError, match=match):
        db.tx().push(q, value)
    _nothing_written(q)


def test_q9_plain_dataclass_with_a_tuple_key_in_a_field_is_refused(db: armdb.Db) -> None:
    q = db.open_queue(PlainQ, qcfg())
    with pytest.raises(PayloadTypeError, match=r"dict keys must be str.*payload\.meta has the key \(1, 2\)"):
        q.push(Plain(1, {(1, 2): "x"}))
    _nothing_written(q)
    q.push(Plain(2, {"k": "v", 3: "w"}))
    assert q.lease()[0].payload == Plain(2, {"k": "v", 3: "w"})


def test_q9_dataclass_that_round_trips_is_accepted(db: armdb.Db) -> None:
    q = db.open_queue(DocQ, qcfg())
    q.push(Doc(1, "a"))
    db.tx().push(q, Doc(2, "b")).commit()
    assert [lz.payload for lz in q.lease(2)] == [Doc(1, "a"), Doc(2, "b")]


def test_d3_map_put_of_a_tuple_dict_key_is_refused_and_items_still_work(db: armdb.Db) -> None:
    m = db.open_map("m")
    m.put("good", {"a": (1, 2)})
    with pytest.raises(PayloadTypeError, match=r"dict keys must be str, int, bytes.*value has the key \(1, 2\)"):
        m.put("bad", {(1, 2): "x"})
    with pytest.raises(PayloadTypeError, match="dict keys"):
        db.tx().put(m, "bad", {(1, 2): "x"})
    assert "bad" not in m and len(m) == 1
    assert dict(m.items()) == {"good": {"a": [1, 2]}}
    assert m.get("good") == {"a": [1, 2]}


def test_t6_stream_emitting_a_value_that_does_not_round_trip_aborts_the_commit(db_path: Path,
                                                                             clock: FakeClock) -> None:
    reg = SchemaRegistry().change_stream("src", AnyQ, lambda ch: {(1, 2): ch.new})
    with armdb.Db.open(db_path, clock=clock, schema=reg) as db:
        q = db.open_queue(AnyQ, qcfg())
        m = db.open_map("src")
        with pytest.raises(PayloadTypeError, match="dict keys"):
            db.tx().put(m, "k", 1).commit()
        assert len(m) == 0
        _nothing_written(q)
    assert armdb.check(db_path).ok


def test_d3_a_stored_value_that_does_not_decode_is_a_typed_error_naming_its_key(db: armdb.Db) -> None:
    """A value written raw (by an older armdb, or around Map.put) that msgpack cannot
    read back: get and items() raise CorruptionError naming the key, never a builtin;
    putting a new value under the key heals the map."""
    m = db.open_map("m")
    m.put("good", 1)
    m.store.put(b"sbad", msgpack.packb({(1, 2): "x"}, use_bin_type=True))
    m.store.put(b"strunc", b"\x92\x01")  # an array of 2 with one element: truncated
    for key in ("bad", "trunc"):
        with pytest.raises(CorruptionError, match=rf"map 'm', key '{key}': a stored map value"):
            m.get(key)
    with pytest.raises(CorruptionError, match=r"map 'm', key '(bad|trunc)'"):
        dict(m.items())
    m.store.put(b"s\xff", msgpack.packb(1))  # a str key that is not UTF-8
    with pytest.raises(PayloadTypeError, match="not valid UTF-8"):
        list(m.keys())
    m.delete("trunc")
    m.put("bad", {"fixed": True})
    m.store.delete(b"s\xff")
    assert dict(m.items()) == {"good": 1, "bad": {"fixed": True}}
