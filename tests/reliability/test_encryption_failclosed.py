"""Harness (g): encryption fails closed and leaks no plaintext (SPEC S10, Q7, T4; docs/reliability.md, (g)).

Every case runs through the public ``Db`` API on a real directory:

* an encrypted map or var-queue payload opened without its key
  (``EncryptionKeyRequired``), with a wrong key (``WrongKey``), a plain one opened with
  a key (``ConfigError``); nothing on disk changes and the same ``Db`` can then open
  the collection with the right key;
* a tampered ciphertext byte (CRC fixed, so only the GCM tag can notice) raises
  ``CorruptionError`` on read (value) or at open (key); an unfixed flip is corruption
  at open;
* a transaction (or a var ``ack``/``nack``, Q7) touching an encrypted collection
  without a log key raises ``EncryptionKeyRequired`` and writes nothing: every file's
  bytes are compared before and after;
* a sealed transaction log that must be replayed, opened without the log key or with
  a wrong one, fails closed at ``Db.open`` and changes nothing;
* a canary scan: distinctive plaintext written through every path (direct push, tx
  push, stream emission, map put, compaction, hint files, the txlog, a crash image)
  never appears in any file under the database directory;
* nonce uniqueness: 10^5 seals through real operations and 100 crash/reopen cycles,
  no nonce twice; and no two different sealed fields on disk share a nonce.
"""

from __future__ import annotations

import collections
import os
import struct
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import armdb
from armdb import Config, FixedConfig, QueueConfig, TxConfig, _crypto, _fs
from armdb.bitcask import DATA_START
from armdb.errors import ConfigError, CorruptionError, EncryptionKeyRequired, WrongKey
from armdb.streams import SchemaRegistry
from armdb.txlog import FLAG_SEALED, parse_records
from armdb.txlog import RECORDS_START as LOG_HEADER_SIZE

from .. import marks
from ..conftest import FakeClock, child_env, run_child
from .journal import report_line
from .test_model import TrackingFS, abandon

KEY = bytes(range(32))
OTHER = bytes(range(1, 33))
LOG_KEY = bytes(range(64, 96))
OTHER_LOG = bytes(range(65, 97))
SMALL = 64 * 1024  # the smallest max_file_size: rotation, hints and compaction come quickly

VarQ = armdb.queue("jobs", payload=bytes, var=True)
RUN: collections.Counter[str] = collections.Counter()


@dataclass
class Doc:
    body: str


def pcfg(key: bytes | None = KEY, **kw: Any) -> Config:
    b = Config.balanced().enable_fsync(False)
    if key is not None:
        b = b.encryption_key(key)
    for k, v in kw.items():
        b = getattr(b, k)(v)
    return b.build()


def qcfg(key: bytes | None = KEY, **kw: Any) -> QueueConfig:
    return (
        QueueConfig.balanced()
        .header_config(FixedConfig.balanced().grow_step(64).enable_fsync(False).build())
        .payload_config(pcfg(key, **kw))
        .build()
    )


def logcfg(key: bytes | None = LOG_KEY) -> TxConfig | None:
    return TxConfig(log_encryption_key=key) if key is not None else None


def files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` by relative path, except the LOCK file's pid, with the synced
    marks (each log and data file's mark area) zeroed and each log file's allocated zeros
    cut: sync bookkeeping that a background sync or the Db's own close moves forward,
    whatever a refused call did."""
    return {
        str(p.relative_to(root)): marks.comparable(p.name, p.read_bytes())
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "LOCK"
    }


def changed(before: dict[str, bytes], after: dict[str, bytes]) -> list[str]:
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


def note(name: str) -> None:
    """Count one checked fail-closed case."""
    RUN["cases"] += 1
    RUN["case:" + name] += 1


def case(name: str) -> None:
    """Count a case and mark the running test as having reached its end (see ``_outcome``)."""
    note(name)
    _DONE[0] = True


_DONE = [False]


@pytest.fixture(autouse=True)
def _outcome(request: pytest.FixtureRequest) -> Any:
    """Count a test that did not reach its final ``case()`` as a violation for the summary."""
    _DONE[0] = False
    yield
    if request.node.name != "test_zz_summary_line":
        RUN["tests"] += 1
        if not _DONE[0]:
            RUN["violations"] += 1
            RUN["failed:" + request.node.name] += 1


def data_records(path: Path) -> list[tuple[int, int, int]]:
    """(offset, key field length, value field length) of each record of a Bitcask data file."""
    raw = path.read_bytes()
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


def flip(path: Path, at: int, *, fix_crc_of: int | None = None) -> None:
    """Flip one bit at ``at``; optionally recompute the CRC of the record at ``fix_crc_of``."""
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x01
    if fix_crc_of is not None:
        off = fix_crc_of
        _, _, vlen, _, klen = struct.unpack_from("<QIIHH", raw, off)
        n = 20 + klen + vlen
        crc = zlib.crc32(bytes(raw[off + 12 : off + n]), zlib.crc32(bytes(raw[off : off + 8])))
        struct.pack_into("<I", raw, off + 8, crc)
    path.write_bytes(bytes(raw))


def only_data_file(coll: Path) -> Path:
    (f,) = sorted(coll.glob("shard-*/*.data"))
    return f


@pytest.fixture
def tfs() -> Any:
    with _fs.use(TrackingFS()) as fs:
        yield fs


# -- S10: missing key, wrong key, key on a plain collection ----------------------------------------------


def test_s10_encrypted_map_without_key_wrong_key_fail_closed(tmp_path: Path) -> None:
    with armdb.Db.open(tmp_path) as db:
        m = db.open_map("secrets", pcfg())
        m.put("k", {"v": 1})
    with armdb.Db.open(tmp_path) as db:
        before = files(tmp_path)  # after the open itself (it starts a fresh log file)
        with pytest.raises(EncryptionKeyRequired, match=r"encrypted.*encryption_key"):
            db.open_map("secrets")
        note("map_no_key")
        with pytest.raises(EncryptionKeyRequired, match="encryption_key"):
            db.open_map("secrets", pcfg(None))
        note("map_no_key_explicit_config")
        with pytest.raises(WrongKey, match="original key"):
            db.open_map("secrets", pcfg(OTHER))
        note("map_wrong_key")
        assert changed(before, files(tmp_path)) == []
        # The failures left nothing half-open: the right key still works in this Db.
        assert db.open_map("secrets", pcfg()).get("k") == {"v": 1}
    case("map_reopened_with_right_key")


def test_s10_plain_map_opened_with_key_is_config_error(tmp_path: Path) -> None:
    with armdb.Db.open(tmp_path) as db:
        db.open_map("plain", pcfg(None)).put("k", 1)
    with armdb.Db.open(tmp_path) as db:
        before = files(tmp_path)  # after the open itself (it starts a fresh log file)
        with pytest.raises(ConfigError, match="not encrypted"):
            db.open_map("plain", pcfg(KEY))
        note("map_key_on_plain")
        assert changed(before, files(tmp_path)) == []
        assert db.open_map("plain").get("k") == 1
    case("plain_map_reopened")


def test_q7_var_payload_without_key_wrong_key_fail_closed(tmp_path: Path) -> None:
    with armdb.Db.open(tmp_path) as db:
        q = db.open_queue(VarQ, qcfg())
        q.push(b"secret body")
    with armdb.Db.open(tmp_path) as db:
        before = files(tmp_path)  # after the open itself (it starts a fresh log file)
        with pytest.raises(EncryptionKeyRequired, match="encryption_key"):
            db.open_queue(VarQ, qcfg(None))
        note("var_payload_no_key")
        with pytest.raises(WrongKey, match="original key"):
            db.open_queue(VarQ, qcfg(OTHER))
        note("var_payload_wrong_key")
        assert changed(before, files(tmp_path)) == []
        q = db.open_queue(VarQ, qcfg())  # nothing was left registered by the failures
        (lz,) = q.lease()
        assert lz.payload == b"secret body"
    assert armdb.check(tmp_path).ok
    case("var_payload_reopened_with_right_key")


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(None, id="default-config"),
        pytest.param(
            QueueConfig.balanced().header_config(FixedConfig.balanced().grow_step(5000).build()).build(),
            id="no-key-larger-grow-step",
        ),
        pytest.param(
            QueueConfig.balanced().payload_config(Config.balanced().encryption_key(OTHER).build()).build(),
            id="wrong-key-default-grow-step",
        ),
    ],
)
def test_q7_refused_open_queue_changes_nothing_on_disk(tmp_path: Path, config: QueueConfig | None) -> None:
    """Fail closed means untouched: a refused open must not grow the header file first."""
    with armdb.Db.open(tmp_path) as db:
        db.open_queue(VarQ, qcfg()).push(b"secret body")  # created with grow_step 64
    with armdb.Db.open(tmp_path) as db:
        before = files(tmp_path)
        with pytest.raises((EncryptionKeyRequired, WrongKey), match="key"):
            db.open_queue(VarQ, config)
        assert changed(before, files(tmp_path)) == [], "a refused open_queue changed the header file"
    case("refused_open_queue_untouched")


def test_q7_plain_var_payload_opened_with_key_is_config_error(tmp_path: Path) -> None:
    with armdb.Db.open(tmp_path) as db:
        db.open_queue(VarQ, qcfg(None)).push(b"x")
    with armdb.Db.open(tmp_path) as db:
        before = files(tmp_path)  # after the open itself (it starts a fresh log file)
        with pytest.raises(ConfigError, match="not encrypted"):
            db.open_queue(VarQ, qcfg(KEY))
        note("var_payload_key_on_plain")
        assert changed(before, files(tmp_path)) == []
        assert db.open_queue(VarQ, qcfg(None)).len() == 1
    case("plain_var_payload_reopened")


@pytest.mark.parametrize("bad", [bytes(31), bytes(33), "k" * 32, bytearray(16), 12345])
def test_s9_bad_key_is_config_error_naming_the_parameter(bad: Any) -> None:
    with pytest.raises(ConfigError, match=r"encryption_key must be 32 bytes"):
        Config.balanced().encryption_key(bad).build()
    with pytest.raises(ConfigError, match=r"log_encryption_key must be 32 bytes"):
        TxConfig(log_encryption_key=bad)
    case("bad_key_length_or_type")


# -- S10: tampering ---------------------------------------------------------------------------------------


def _map_with_three(tmp_path: Path) -> Path:
    with armdb.Db.open(tmp_path) as db:
        m = db.open_map("secrets", pcfg())
        for i in range(3):
            m.put(f"key{i}", f"value{i}" * 5)
    return only_data_file(tmp_path / "collections" / "secrets")


def test_s10_tampered_map_value_fails_its_tag_on_read(tmp_path: Path) -> None:
    f = _map_with_three(tmp_path)
    off, klen, _ = data_records(f)[1]
    flip(f, off + 20 + klen + 12 + 3, fix_crc_of=off)  # a ciphertext byte of the value
    with armdb.Db.open(tmp_path) as db:
        m = db.open_map("secrets", pcfg())
        assert m.get("key0") == "value0" * 5 and m.get("key2") == "value2" * 5
        with pytest.raises(CorruptionError, match=r"\.data: value at offset .*tag"):
            m.get("key1")
        with pytest.raises(CorruptionError, match="tag"):
            dict(m.items())
    case("tampered_value")


@pytest.mark.parametrize("where", ["nonce", "ciphertext", "tag"])
def test_s10_tampered_map_key_fails_its_tag_at_open(tmp_path: Path, where: str) -> None:
    f = _map_with_three(tmp_path)
    off, klen, _ = data_records(f)[1]
    at = {"nonce": off + 20 + 2, "ciphertext": off + 20 + 12 + 1, "tag": off + 20 + klen - 3}[where]
    flip(f, at, fix_crc_of=off)
    with armdb.Db.open(tmp_path) as db:
        before = files(tmp_path)  # after the open itself (it starts a fresh log file)
        with pytest.raises(CorruptionError, match=rf"key at offset {off}.*tag"):
            db.open_map("secrets", pcfg())
    assert changed(before, files(tmp_path)) == []
    case("tampered_key_" + where)


def test_s7_tampered_byte_without_crc_fix_is_corruption_at_open(tmp_path: Path) -> None:
    f = _map_with_three(tmp_path)
    off, klen, _ = data_records(f)[0]
    flip(f, off + 20 + klen + 20)
    with armdb.Db.open(tmp_path) as db, pytest.raises(CorruptionError, match=rf"offset {off}\b"):
        db.open_map("secrets", pcfg())
    assert not armdb.check(tmp_path).ok
    case("tampered_crc")


def test_s10_tampered_var_payload_fails_closed_on_lease(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with armdb.Db.open(tmp_path) as db:
        q = db.open_queue(VarQ, qcfg())
        for i in range(3):
            q.push(b"body-%d" % i * 4)
    f = only_data_file(tmp_path / "collections" / "jobs.payload")
    recs = data_records(f)
    off, klen, _ = recs[0]
    flip(f, off + 20 + klen + 14, fix_crc_of=off)
    with armdb.Db.open(tmp_path) as db:
        q = db.open_queue(VarQ, qcfg())
        # Never garbage plaintext: the row is not handed out, and the tag failure is logged
        # (without a log key it stays leased rather than dead; tests/test_poison.py has
        # the dead-letter).  The other rows stay deliverable.
        with caplog.at_level("WARNING", logger="armdb"):
            assert q.lease() == []
        assert any("tag" in r.getMessage() for r in caplog.records)
        got = q.lease(5)
        assert sorted(lz.payload for lz in got) == [b"body-1" * 4, b"body-2" * 4]
    case("tampered_var_payload")


def test_s10_swapped_sealed_values_fail(tmp_path: Path) -> None:
    """Cut and paste: a sealed value moved to another record fails its tag (AAD binds the gsn)."""
    with armdb.Db.open(tmp_path) as db:
        m = db.open_map("secrets", pcfg())
        m.put("a", "x" * 10)
        m.put("b", "y" * 10)
    f = only_data_file(tmp_path / "collections" / "secrets")
    (o1, k1, v1), (o2, k2, v2) = data_records(f)
    raw = bytearray(f.read_bytes())
    a = bytes(raw[o1 + 20 + k1 : o1 + 20 + k1 + v1])
    raw[o1 + 20 + k1 : o1 + 20 + k1 + v1] = raw[o2 + 20 + k2 : o2 + 20 + k2 + v2]
    raw[o2 + 20 + k2 : o2 + 20 + k2 + v2] = a
    f.write_bytes(bytes(raw))
    for off in (o1, o2):
        flip(f, 0, fix_crc_of=off)
        flip(f, 0)
    with armdb.Db.open(tmp_path) as db:
        m = db.open_map("secrets", pcfg())
        for k in ("a", "b"):
            with pytest.raises(CorruptionError, match="tag"):
                m.get(k)
    case("swapped_values")


@pytest.mark.parametrize("field", ["key", "value"])
def test_s10_every_byte_of_a_sealed_field_is_authenticated(tmp_path: Path, field: str) -> None:
    """Flip each byte of the sealed key or value (nonce, ciphertext, tag) of 3 records at
    once, CRC fixed: every read fails with CorruptionError, never garbage plaintext."""
    with armdb.Db.open(tmp_path) as db:
        m = db.open_map("secrets", pcfg())
        for i in range(3):
            m.put(f"k{i}", f"v{i}-0123456789")
    f = only_data_file(tmp_path / "collections" / "secrets")
    pristine = f.read_bytes()
    recs = data_records(f)
    width = recs[0][1] if field == "key" else recs[0][2]
    assert all((r[1] if field == "key" else r[2]) == width for r in recs)
    flips = 0
    for i in range(width):
        f.write_bytes(pristine)
        for off, klen, _ in recs:
            flip(f, off + 20 + (0 if field == "key" else klen) + i, fix_crc_of=off)
        with armdb.Db.open(tmp_path) as db:
            if field == "key":
                with pytest.raises(CorruptionError, match="key at offset .*tag"):
                    db.open_map("secrets", pcfg())
            else:
                m = db.open_map("secrets", pcfg())
                for k in range(3):
                    with pytest.raises(CorruptionError, match="value at offset .*tag"):
                        m.get(f"k{k}")
        flips += 3
    RUN["byte_flips"] += flips
    case("every_byte_" + field)


def test_s10_sealed_value_moved_between_collections_fails(tmp_path: Path) -> None:
    """The AAD binds the collection (its salt): a sealed value pasted into another
    collection under the same key fails its tag even with the same key and gsn slot."""
    with armdb.Db.open(tmp_path) as db:
        a = db.open_map("a", pcfg())
        b = db.open_map("b", pcfg())
        a.put("k", "from-a")
        b.put("k", "from-b")
    fa = only_data_file(tmp_path / "collections" / "a")
    fb = only_data_file(tmp_path / "collections" / "b")
    ((oa, ka, va),), ((ob, kb, vb),) = data_records(fa), data_records(fb)
    ra, rb = bytearray(fa.read_bytes()), bytearray(fb.read_bytes())
    ra[oa + 20 + ka : oa + 20 + ka + va] = rb[ob + 20 + kb : ob + 20 + kb + vb]
    fa.write_bytes(bytes(ra))
    flip(fa, 0, fix_crc_of=oa)
    flip(fa, 0)
    with armdb.Db.open(tmp_path) as db:
        with pytest.raises(CorruptionError, match="tag"):
            db.open_map("a", pcfg()).get("k")
        assert db.open_map("b", pcfg()).get("k") == "from-b"
    case("value_moved_between_collections")


# -- T4 / Q7: no log key, nothing written -----------------------------------------------------------------


FreshQ = armdb.queue("fresh", payload=bytes, var=True)


@dataclass
class World:
    db: armdb.Db
    q: Any  # encrypted var queue with one leased row (token in ``lz``)
    fresh: Any  # encrypted var queue nothing was ever pushed to
    em: Any  # encrypted map
    pm: Any  # plain map
    feed: Any  # plain map, source of a change stream into ``q``
    lz: Any


def _enc_world(path: Path) -> World:
    """A Db without a log key holding encrypted var queues, an encrypted map and plain maps."""
    reg = SchemaRegistry().change_stream("feed", VarQ, lambda ch: None if ch.new is None else ch.new.encode())
    db = armdb.Db.open(path, schema=reg, clock=FakeClock())
    q = db.open_queue(VarQ, qcfg())
    fresh = db.open_queue(FreshQ, qcfg())
    em = db.open_map("emap", pcfg())
    pm = db.open_map("pmap", pcfg(None))
    feed = db.open_map("feed", pcfg(None))
    em.put("existing", 1)
    q.push(b"to lease")
    (lz,) = q.lease()
    return World(db, q, fresh, em, pm, feed, lz)


def _with_tx(w: World) -> None:
    with w.db.tx() as tx:
        tx.push(w.q, b"in a with block")


NO_LOG_KEY_CASES = {
    "tx_push": lambda w: w.db.tx().push(w.q, b"body").commit(),
    "tx_push_delayed": lambda w: w.db.tx().push(w.q, b"body", delay=5).commit(),
    "tx_push_fresh_queue": lambda w: w.db.tx().push(w.fresh, b"body").commit(),
    "tx_put_encrypted_map": lambda w: w.db.tx().put(w.em, "k", "v").commit(),
    "tx_delete_encrypted_map": lambda w: w.db.tx().delete(w.em, "existing").commit(),
    "tx_plain_put_plus_encrypted_push": lambda w: w.db.tx().put(w.pm, "k", 1).push(w.q, b"b").commit(),
    "tx_encrypted_put_plus_plain_put": lambda w: w.db.tx().put(w.pm, "k", 1).put(w.em, "k", 2).commit(),
    "tx_ack": lambda w: w.db.tx().ack(w.q, w.lz.token).commit(),
    "tx_nack": lambda w: w.db.tx().nack(w.q, w.lz.token).commit(),
    "tx_nack_dead": lambda w: w.db.tx().nack(w.q, w.lz.token, dead=True).commit(),
    "tx_ack_plus_push": lambda w: w.db.tx().ack(w.q, w.lz.token).push(w.q, b"next").commit(),
    "direct_ack_q7": lambda w: w.q.ack(w.lz.token),
    "direct_nack_q7": lambda w: w.q.nack(w.lz.token),
    "direct_nack_delay_q7": lambda w: w.q.nack(w.lz.token, delay=3),
    "direct_nack_dead_q7": lambda w: w.q.nack(w.lz.token, dead=True),
    "stream_emission_into_encrypted_queue": lambda w: w.db.tx().put(w.feed, "k", "new").commit(),
    "context_manager_tx": _with_tx,
}


@pytest.mark.parametrize("name", sorted(NO_LOG_KEY_CASES))
def test_t4_tx_touching_encrypted_collection_without_log_key_writes_nothing(tmp_path: Path, name: str) -> None:
    w = _enc_world(tmp_path)
    try:
        def state() -> Any:
            return (w.q.len(), w.q.dead_len(), w.q.stats().leased, w.fresh.len(),
                    dict(w.pm.items()), dict(w.em.items()), dict(w.feed.items()))

        before_state = state()
        before = files(tmp_path)
        with pytest.raises(EncryptionKeyRequired, match=r"TxConfig\(log_encryption_key=\.\.\.\)"):
            NO_LOG_KEY_CASES[name](w)
        assert changed(before, files(tmp_path)) == [], "a refused transaction wrote to disk (T4: writes nothing)"
        assert state() == before_state
        # Direct pushes and leases write no log record and need no log key (T4), and the
        # token refused above is still good for a later, keyed, settlement.
        w.q.push(b"direct is fine")
    finally:
        w.db.shutdown()
    assert armdb.check(tmp_path).ok
    case("no_log_key_" + name)


def test_t4_direct_push_and_lease_need_no_log_key(tmp_path: Path) -> None:
    with armdb.Db.open(tmp_path) as db:
        q = db.open_queue(VarQ, qcfg())
        ids = [q.push(b"p%d" % i) for i in range(3)]
        assert [lz.id for lz in q.lease(3)] == ids
    case("direct_push_lease_no_log_key")


# -- T4: a sealed log that must be replayed ------------------------------------------------------------------

CRASH_AFTER_APPEND = """
import armdb
from armdb import Config, FixedConfig, QueueConfig, TxConfig
pc = Config.balanced().encryption_key({key!r}).build()
db = armdb.Db.open({path!r}, tx_config=TxConfig(log_encryption_key={logkey!r}))
q = db.open_queue(armdb.queue("jobs", payload=bytes, var=True),
    QueueConfig.balanced().header_config(FixedConfig.balanced().grow_step(64).build()).payload_config(pc).build())
m = db.open_map("emap", pc)
q.push(b"direct")
db.tx().push(q, b"logged body").put(m, "k", "logged value").commit()   # os._exit(86) after the append
"""


def test_t4_sealed_log_needing_replay_fails_closed_without_or_with_wrong_log_key(tmp_path: Path) -> None:
    r = run_child(
        CRASH_AFTER_APPEND.format(path=str(tmp_path), key=KEY, logkey=LOG_KEY),
        env=child_env(ARMDB_FAILPOINT="txlog.after_append"),
    )
    assert r.returncode == 86, r.stderr
    before = files(tmp_path)
    with pytest.raises(EncryptionKeyRequired, match=r"log_encryption_key"):
        armdb.Db.open(tmp_path)
    note("sealed_log_no_key")
    with pytest.raises(WrongKey, match="log key"):
        armdb.Db.open(tmp_path, tx_config=logcfg(OTHER_LOG))
    note("sealed_log_wrong_key")
    assert changed(before, files(tmp_path)) == [], "a refused open changed the database"
    # The log key alone replays the header rows; the encrypted bodies wait for their key.
    with armdb.Db.open(tmp_path, tx_config=logcfg()) as db:
        with pytest.raises(EncryptionKeyRequired):
            db.open_queue(VarQ, qcfg(None))
        with pytest.raises(WrongKey):
            db.open_queue(VarQ, qcfg(OTHER))
        note("deferred_rows_wrong_payload_key")
    # Closed without opening the encrypted collections: the owed rows are still in the log.
    with armdb.Db.open(tmp_path, tx_config=logcfg()) as db:
        q = db.open_queue(VarQ, qcfg())
        m = db.open_map("emap", pcfg())
        assert sorted(lz.payload for lz in q.lease(5)) == [b"direct", b"logged body"]
        assert m.get("k") == "logged value"
    report_ = armdb.check(tmp_path)
    assert report_.ok, str(report_)
    case("sealed_log_replayed_with_right_keys")


def test_t4_in_process_crash_with_sealed_log(tmp_path: Path, tfs: TrackingFS) -> None:
    db = armdb.Db.open(tmp_path, tx_config=logcfg())
    q = db.open_queue(VarQ, qcfg())
    m = db.open_map("emap", pcfg())
    db.tx().push(q, b"b1").put(m, "k", "v").commit()
    abandon(db, tfs)
    with pytest.raises(EncryptionKeyRequired):
        armdb.Db.open(tmp_path)
    with pytest.raises(WrongKey):
        armdb.Db.open(tmp_path, tx_config=logcfg(OTHER_LOG))
    with armdb.Db.open(tmp_path, tx_config=logcfg()) as db:
        assert db.open_queue(VarQ, qcfg()).lease()[0].payload == b"b1"
        assert db.open_map("emap", pcfg()).get("k") == "v"
    assert armdb.check(tmp_path).ok
    case("crash_sealed_log")


# -- canary scan ---------------------------------------------------------------------------------------------


def scan(root: Path, needles: list[bytes]) -> list[str]:
    """Files under ``root`` (every file, LOCK and temporaries included) holding any needle."""
    hits = []
    for p in sorted(root.rglob("*")):
        if p.is_file():
            raw = p.read_bytes()
            hits += [f"{p.relative_to(root)}: {n[:24]!r}" for n in needles if n in raw]
    return hits


def canary_workload(path: Path, canary: str, fs: TrackingFS, *, encrypted: bool) -> dict[str, Any]:
    """Write ``canary`` into keys and values through every path; return what must read back."""
    key = KEY if encrypted else None
    log = logcfg() if encrypted else None
    reg = SchemaRegistry().change_stream("feed", VarQ, lambda ch: None if ch.new is None else ch.new.encode())
    expect: dict[str, Any] = {}
    db = armdb.Db.open(path, tx_config=log, schema=reg, clock=FakeClock())
    q = db.open_queue(VarQ, qcfg(key, max_file_size=SMALL))
    m = db.open_map("emap", pcfg(key, max_file_size=SMALL))
    feed = db.open_map("feed", pcfg(key, max_file_size=SMALL))
    filler = "." * 200
    for i in range(600):  # direct puts, overwritten: rotation, hint files and compaction
        m.put(f"{canary}-direct-key-{i % 40}", f"{canary}-direct-value-{i}-{filler}")
    expect["map_direct"] = (f"{canary}-direct-key-39", f"{canary}-direct-value-599-{filler}")
    for i in range(300):  # direct pushes, leased and acked/nacked/dead-lettered
        q.push(f"{canary}-push-{i}-{filler}".encode())
    for i, lz in enumerate(q.lease(200)):
        if i % 3 == 0:
            q.ack(lz.token)
        elif i % 3 == 1:
            q.nack(lz.token, delay=0)
        else:
            q.nack(lz.token, dead=True)
    for i in range(150):  # transactions: pushes, map puts and deletes, stream emissions
        tx = db.tx().push(q, f"{canary}-txpush-{i}".encode()).put(m, f"{canary}-tx-key-{i % 20}", f"{canary}-tx-v-{i}")
        tx.put(feed, f"{canary}-feed-key-{i % 10}", f"{canary}-stream-{i}")
        if i % 5 == 0:
            tx.delete(m, f"{canary}-direct-key-{i % 40}")
        tx.commit()
    expect["map_tx"] = (f"{canary}-tx-key-9", f"{canary}-tx-v-149")
    q._payload.compact()  # the var queue's payload collection (no public handle)
    m.store.compact()
    st = m.stats()
    expect["compactions"] = st.get("compactions", 0)
    # A crash image with an untrimmed (sealed) log, then recovery.
    db.tx().push(q, f"{canary}-last-logged".encode()).put(m, f"{canary}-last-key", f"{canary}-last-value").commit()
    abandon(db, fs)
    expect["crash_image"] = scan(path, [canary.encode()])
    db = armdb.Db.open(path, tx_config=log, schema=reg, clock=FakeClock())
    q = db.open_queue(VarQ, qcfg(key, max_file_size=SMALL))
    m = db.open_map("emap", pcfg(key, max_file_size=SMALL))
    db.open_map("feed", pcfg(key, max_file_size=SMALL))
    assert m.get(expect["map_direct"][0]) == expect["map_direct"][1]
    assert m.get(expect["map_tx"][0]) == expect["map_tx"][1]
    assert m.get(f"{canary}-last-key") == f"{canary}-last-value"
    payloads = [lz.payload for lz in q.lease(1000)]
    assert any(p.startswith(f"{canary}-stream-".encode()) for p in payloads), "the stream emitted nothing"
    assert any(p == f"{canary}-last-logged".encode() for p in payloads)
    assert any(p.startswith(f"{canary}-push-".encode()) for p in payloads)
    db.close()
    if encrypted:  # compacted, rotated collections still refuse a wrong key
        with armdb.Db.open(path, tx_config=log, schema=reg) as db:
            with pytest.raises(WrongKey):
                db.open_map("emap", pcfg(OTHER, max_file_size=SMALL))
            with pytest.raises(WrongKey):
                db.open_queue(VarQ, qcfg(OTHER, max_file_size=SMALL))
    return expect


def test_s10_canary_scan_every_file_every_path(tmp_path: Path, tfs: TrackingFS) -> None:
    canary = "CANARY-" + uuid.uuid4().hex
    needles = [canary.encode(), canary.encode("utf-16-le"), canary[7:].encode()]
    expect = canary_workload(tmp_path / "enc", canary, tfs, encrypted=True)
    assert expect["compactions"] > 0, "the workload must exercise compaction"
    assert list((tmp_path / "enc").rglob("*.hint")), "the workload must write hint files"
    assert expect["crash_image"] == [], f"plaintext in the crash image: {expect['crash_image']}"
    hits = scan(tmp_path / "enc", needles)
    RUN["canary_hits"] += len(hits) + len(expect["crash_image"])
    RUN["canary_files"] += sum(1 for p in (tmp_path / "enc").rglob("*") if p.is_file())
    assert hits == [], f"plaintext of an encrypted collection on disk: {hits}"
    # Positive control: the same workload unencrypted does leave the canary on disk,
    # so the scan above can see it.
    control = canary_workload(tmp_path / "plain", canary, tfs, encrypted=False)
    assert control["crash_image"] and scan(tmp_path / "plain", needles[:1])
    case("canary_scan")


# -- nonce uniqueness -----------------------------------------------------------------------------------------


def test_s10_nonce_uniqueness_over_1e5_seals_and_100_crashes(tmp_path: Path, tfs: TrackingFS, monkeypatch: pytest.MonkeyPatch) -> None:
    target = int(os.environ.get("ARMDB_NONCE_SEALS", "100000"))
    cycles = int(os.environ.get("ARMDB_NONCE_CYCLES", "100"))
    nonces: list[bytes] = []
    real_seal = _crypto.Sealer.seal

    def spy(self: _crypto.Sealer, plain: bytes, aad: bytes = b"") -> bytes:
        out = real_seal(self, plain, aad)
        nonces.append(out[: _crypto.NONCE_LEN])
        return out

    monkeypatch.setattr(_crypto.Sealer, "seal", spy)
    per_cycle = max(1, target // cycles // 4)
    cycle = 0
    while len(nonces) < target or cycle < cycles:
        db = armdb.Db.open(tmp_path, tx_config=logcfg())
        q = db.open_queue(VarQ, qcfg(max_file_size=SMALL))
        m = db.open_map("emap", pcfg(max_file_size=SMALL))
        for i in range(per_cycle):
            m.put(i % 50, b"v")  # 2 seals (key, value)
            if i % 4 == 0:
                db.tx().push(q, b"t").put(m, "tx", i).commit()  # log + 2 records: 5 seals
        for lz in q.lease(per_cycle // 8 + 1):
            q.ack(lz.token)  # a logged var ack: log seal + tombstone key seal
        if cycle % 2:
            abandon(db, tfs)
        else:
            db.close()
        cycle += 1
    assert armdb.check(tmp_path).ok
    repeats = len(nonces) - len(set(nonces))
    # What reached the disk: every sealed field of every data file and log record.
    on_disk: dict[bytes, bytes] = {}
    disk_repeats = 0
    for f in sorted(tmp_path.rglob("*.data")):
        raw = f.read_bytes()
        for off, klen, vlen in data_records(f):
            for start, n in ((off + 20, klen), (off + 20 + klen, vlen)):
                if n >= _crypto.OVERHEAD:
                    field = raw[start : start + n]
                    if on_disk.setdefault(field[:12], field) != field:
                        disk_repeats += 1
    for f in sorted(tmp_path.rglob("txlog/*.log")):
        for _txid, flags, body in parse_records(f.read_bytes(), LOG_HEADER_SIZE)[0]:
            assert flags & FLAG_SEALED
            if on_disk.setdefault(body[:12], body) != body:
                disk_repeats += 1
    RUN["seals"] += len(nonces)
    RUN["seal_cycles"] += cycle
    RUN["nonce_repeats"] += repeats + disk_repeats
    RUN["disk_fields"] += len(on_disk)
    assert len(nonces) >= target and cycle >= cycles
    assert repeats == 0, f"{repeats} repeated nonces in {len(nonces)} seals"
    assert disk_repeats == 0, f"{disk_repeats} different sealed fields on disk share a nonce"
    case("nonce_uniqueness")


# -- summary -------------------------------------------------------------------------------------------------


def test_zz_summary_line(capsys: pytest.CaptureFixture[str]) -> None:
    """One summary line for the harness (runs last in this module)."""
    line = (
        f"RELIABILITY g-encryption cases={RUN['cases']} distinct={sum(1 for k in RUN if k.startswith('case:'))} "
        f"canary_files={RUN['canary_files']} canary_hits={RUN['canary_hits']} seals={RUN['seals']} "
        f"seal_cycles={RUN['seal_cycles']} disk_sealed_fields={RUN['disk_fields']} byte_flips={RUN['byte_flips']} "
        f"nonce_repeats={RUN['nonce_repeats']} tests={RUN['tests']} violations={RUN['violations']}"
    )
    failed = sorted(k[7:] for k in RUN if k.startswith("failed:"))
    if failed:
        line += " failed=" + ",".join(failed)
    with capsys.disabled():
        report_line(line)
    assert RUN["canary_hits"] == 0 and RUN["nonce_repeats"] == 0
