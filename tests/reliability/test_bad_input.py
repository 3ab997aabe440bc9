"""Harness (h): bad input raises a specific ``armdb.errors`` class, says what to do,
and changes nothing stored (docs/reliability.md, (h); SPEC section 6).

Each row of ``ROWS`` is one bad call: the exception class it must raise (exactly that
class, not a parent), a regular expression its message must match (the words that
say what to do), and optionally a ``prep`` step (close the Db, damage a file).  Every
row runs against a fresh copy of one template database, opened with a fake clock:
queues of each flavour, maps, a change-stream source, leased rows and tokens of every
kind.  Around the bad call the harness hashes every file under the database
directory (the ``LOCK`` file's pid excepted) and, while the Db is open, records every
queue's ``len``/``dead_len``/``leased`` and every map's items; both must be unchanged
afterwards, and ``armdb.check`` must still pass (rows that damage a file on purpose
skip only that last check).

A final test checks that every class of ``armdb.errors.__all__`` a user can cause
appears in at least one row, and prints the summary line.
"""

from __future__ import annotations

import collections
import dis
import hashlib
import os
import pickle
import shutil
import socket
import struct
import subprocess
import threading
import typing
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

import armdb
from armdb import Config, FixedConfig, LeaseToken, QueueConfig, TxConfig, _fs, bitcask, errors, txlog
from armdb.dbkeys import read_key_file
from armdb.errors import (
    ConfigError,
    CorruptionError,
    DbClosed,
    DbLocked,
    EncryptionKeyRequired,
    FormatError,
    KeyFileError,
    NotALease,
    PayloadTypeError,
    ProcessBound,
    QueueAlreadyOpen,
    QueueFull,
    ReadOnly,
    ReplicaMismatch,
    ReplicationError,
    ReplicationFrameError,
    SchemaMismatch,
    StaleToken,
    StorageError,
    StreamSourceRequiresTx,
    WrongKey,
)
from armdb.replication import MAGIC as REPL_MAGIC
from armdb.replication import VERSION as REPL_VERSION
from armdb.replication import _encode_state, encode_frame
from armdb.streams import SchemaRegistry

from .. import marks
from ..conftest import FakeClock, child_env, run_child
from .journal import report_line
from .test_model import TrackingFS

KEY = bytes(range(32))
OTHER = bytes(range(1, 33))
NAN, INF = float("nan"), float("inf")
PING = np.dtype([("doc", "<u8"), ("flags", "<u4")])


@dataclass
class Job:
    doc_id: int
    reason: str


@dataclass
class OtherJob:
    doc_id: int
    reason: str


@dataclass
class JobV2:  # same class name as far as the fingerprint cares: fields differ
    doc_id: int
    reason: str
    extra: int


@dataclass
class JobDocStr:  # a field's type changed: not a compatible change (SPEC Q36)
    doc_id: str
    reason: str


FixedQ = armdb.queue("pings", payload=PING)
ScalarQ = armdb.queue("counts", payload=np.dtype("<u4"))
VarQ = armdb.queue("jobs", payload=Job, var=True)
BytesQ = armdb.queue("blobs", payload=bytes, var=True)
AnyQ = armdb.queue("anything", payload=typing.Any, var=True)
FullQ = armdb.queue("full", payload=np.dtype("<u8"))
SpareQ = armdb.queue("spare", payload=PING)  # exists on disk, not opened by the world
SpareVarQ = armdb.queue("sparev", payload=Job, var=True)
SecretQ = armdb.queue("secretq", payload=bytes, var=True)  # encrypted payload, opened with its key
UnopenedStreamQ = armdb.queue("unopened", payload=Job, var=True)

RUN: collections.Counter[str] = collections.Counter()


def cfg(**kw: Any) -> QueueConfig:
    b = QueueConfig.balanced().header_config(FixedConfig.balanced().grow_step(64).build())
    for k, v in kw.items():
        b = getattr(b, k)(v)
    return b.build()


def enc_cfg(key: bytes | None = KEY) -> QueueConfig:
    pc = Config.balanced().encryption_key(key).build() if key is not None else Config()
    return QueueConfig.balanced().header_config(FixedConfig.balanced().grow_step(64).build()).payload_config(pc).build()


def registry() -> SchemaRegistry:
    def emit(change: Any) -> Any:
        if change.new is None:
            return None
        if change.new == "not-a-job":
            return {"wrong": "type"}  # PayloadTypeError inside commit
        return Job(1, str(change.new))

    reg = SchemaRegistry().change_stream("src", VarQ, emit)
    reg.change_stream("src2", UnopenedStreamQ, lambda ch: Job(2, "x"))
    return reg


# -- the world ----------------------------------------------------------------------------------


@dataclass
class World:
    path: Path
    clock: FakeClock
    db: armdb.Db
    fq: Any
    sq: Any
    vq: Any
    bq: Any
    aq: Any
    full: Any
    secretq: Any
    m: Any
    src: Any
    secret2: Any
    tok: LeaseToken  # valid, on vq
    ftok: LeaseToken  # valid, on fq
    acked: LeaseToken  # its row was acked
    nacked: LeaseToken  # its row was nacked (ready again)
    relased: LeaseToken  # its lease expired and the row was leased again
    old: LeaseToken  # from the Db that built the template (before a reopen)
    stok: LeaseToken  # valid, on the encrypted var queue
    extra: dict[str, Any] = field(default_factory=dict)

    def state(self) -> Any:
        if self.db.closed:
            return None
        qs = [self.fq, self.sq, self.vq, self.bq, self.aq, self.full, self.secretq]
        return (
            [(q.len(), q.dead_len(), q.stats().leased) for q in qs],
            sorted(map(repr, self.m.items())),
            sorted(map(repr, self.src.items())),
            sorted(map(repr, self.secret2.items())),
        )

    def close(self) -> None:
        self.db.shutdown()
        for other in self.extra.get("dbs", []):
            other.shutdown()


TEMPLATE: dict[str, Any] = {}


def build_template(path: Path) -> LeaseToken:
    """Create the template database; returns a token of its (now closed) Db."""
    clock = FakeClock()
    with armdb.Db.open(path, clock=clock, schema=registry()) as db:
        fq = db.open_queue(FixedQ, cfg())
        db.open_queue(ScalarQ, cfg())
        vq = db.open_queue(VarQ, cfg(lease_timeout=30))
        db.open_queue(BytesQ, cfg())
        db.open_queue(AnyQ, cfg())
        full = db.open_queue(FullQ, cfg(max_depth=2))
        db.open_queue(SpareQ, cfg(header_config=FixedConfig.balanced().shard_count(2).grow_step(64).build()))
        db.open_queue(SpareVarQ, cfg()).push(Job(1, "spare"))
        db.open_queue(SecretQ, enc_cfg()).push(b"secret")
        db.open_queue(UnopenedStreamQ, cfg())
        m = db.open_map("docs", Config.balanced().shard_count(2).build())
        m.put("a", 1)
        m.put(2, [1, 2])
        db.open_map("secret", Config.balanced().encryption_key(KEY).build()).put("k", "v")
        db.open_map("secret2", Config.balanced().encryption_key(KEY).build()).put("k", "v")
        plain = db.open_map("plainmap")
        plain.put("k", "v")
        plain.put("k2", "v2")
        db.open_map("src")
        db.open_map("src2")
        for i in range(6):
            vq.push(Job(i, f"r{i}"))
            fq.push((i, i))
        full.push(1)
        full.push(2)
        (old,) = vq.lease()  # stays leased on disk; its token belongs to this Db only
    return old.token


def open_world(path: Path) -> World:
    clock = FakeClock(TEMPLATE["clock_ms"])
    db = armdb.Db.open(path, clock=clock, schema=registry())
    try:
        fq = db.open_queue(FixedQ, cfg())
        vq = db.open_queue(VarQ, cfg(lease_timeout=30))
        w = World(
            path=path,
            clock=clock,
            db=db,
            fq=fq,
            sq=db.open_queue(ScalarQ, cfg()),
            vq=vq,
            bq=db.open_queue(BytesQ, cfg()),
            aq=db.open_queue(AnyQ, cfg()),
            full=db.open_queue(FullQ, cfg(max_depth=2)),
            secretq=db.open_queue(SecretQ, enc_cfg()),
            m=db.open_map("docs"),
            src=db.open_map("src"),
            secret2=db.open_map("secret2", Config.balanced().encryption_key(KEY).build()),
            tok=None,  # type: ignore[arg-type]
            ftok=None,  # type: ignore[arg-type]
            acked=None,  # type: ignore[arg-type]
            nacked=None,  # type: ignore[arg-type]
            relased=None,  # type: ignore[arg-type]
            old=TEMPLATE["old"],
            stok=None,  # type: ignore[arg-type]
        )
        a, b, c, d = vq.lease(4)
        vq.ack(a.token)
        vq.nack(b.token, delay=600)
        w.acked, w.nacked, w.tok = a.token, b.token, c.token
        first = vq.lease(1, lease_timeout=1)[0]  # expires after 1 s ...
        clock.advance(2)
        w.relased = first.token
        again = vq.lease(1)  # ... and is leased again
        assert again and again[0].id == first.id
        w.ftok = fq.lease()[0].token
        w.stok = w.secretq.lease()[0].token
        del d
        return w
    except BaseException:
        db.shutdown()
        raise


# -- file helpers ---------------------------------------------------------------------------------


def file_hashes(root: Path) -> dict[str, str]:
    # Without the synced marks (a file's mark area): sync bookkeeping that the background
    # flusher moves forward on its own; without a log file's allocated zeros, which a
    # clean close cuts.
    return {
        str(p.relative_to(root)): hashlib.sha256(marks.comparable(p.name, p.read_bytes())).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "LOCK"
    }


def patch_file(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


def close_and(fn: Callable[[World], None]) -> Callable[[World], None]:
    def prep(w: World) -> None:
        w.db.shutdown()
        fn(w)

    return prep


def closed(w: World) -> None:
    w.db.shutdown()


def bump_db_meta_version(w: World) -> None:
    p = w.path / "db.meta"
    body = struct.pack("<8sI", b"ARMDBMT1", 99)
    p.write_bytes(body + struct.pack("<I", zlib.crc32(body)))


def newer_log_file(w: World) -> None:
    """A log file (not the newest) whose header says format version 99."""
    head = struct.pack("<8sIIQ", b"ARMTXLG1", 99, 0, 0)
    head += struct.pack("<I", zlib.crc32(head))
    (w.path / "txlog" / "00000000.log").write_bytes(head + bytes(32 - len(head)))


def newer_bitcask_header(path: Path) -> None:
    """A complete data file header (valid CRC) of format version 99: a newer armdb's."""
    raw = bytearray(path.read_bytes())
    struct.pack_into("<H", raw, 8, 99)
    struct.pack_into("<I", raw, 28, zlib.crc32(raw[:28]))
    path.write_bytes(bytes(raw))


def bump_queue_meta_version(w: World) -> None:
    p = w.path / "collections" / "spare" / "queue.meta"
    raw = bytearray(p.read_bytes())
    struct.pack_into("<I", raw, 8, 99)
    p.write_bytes(bytes(raw))


def first_data_file(w: World, coll: str) -> Path:
    return min((w.path / "collections" / coll).glob("shard-*/*.data"))


def tamper_record(w: World) -> None:
    """Flip the first key byte of the first of two records of 'plainmap' (CRC left stale):
    a bad record with a valid one after it is corruption, not a torn tail (S7)."""
    f = first_data_file(w, "plainmap")
    raw = bytearray(f.read_bytes())
    raw[bitcask.DATA_START + 20] ^= 0xFF
    f.write_bytes(bytes(raw))


def log_rows(w: World, rows: list[Any]) -> None:
    """Append one CRC-valid log record holding ``rows`` to the newest log file."""
    log = sorted((w.path / "txlog").glob("*.log"))[-1]
    with open(log, "ab") as out:
        out.write(txlog.encode_record(10**6, msgpack.packb(rows, use_bin_type=True), 0))


def rewrite_spare_meta(w: World, **changes: Any) -> None:
    """Rewrite the closed spare queue's meta file (a valid CRC) with ``changes``."""
    from armdb.qrows import META_MAGIC, META_VERSION
    from armdb.qrows import decode_meta as _decode_meta

    path = w.path / "collections" / "spare" / "queue.meta"
    meta = {**_decode_meta(path.read_bytes(), str(path)), **changes}
    packed = msgpack.packb(meta, use_bin_type=True)
    raw = META_MAGIC + struct.pack("<II", META_VERSION, len(packed)) + packed
    path.write_bytes(raw + struct.pack("<I", zlib.crc32(raw)))


def _plainmap_active(w: World) -> Path:
    return sorted((w.path / "collections" / "plainmap" / "shard-000").glob("*.data"))[-1]


def forge_marker(w: World) -> None:
    """A compaction marker naming the shard's active file (a real one never does)."""
    active = _plainmap_active(w)
    (active.parent / bitcask.PENDING_NAME).write_bytes(bitcask._encode_pending([int(active.stem)]))


def append_plainmap_record(w: World, gsn_word: int) -> None:
    from armdb._core.fixed import bitcask_record

    with open(_plainmap_active(w), "ab") as out:
        out.write(bitcask_record(gsn_word, b"\x01k9", msgpack.packb("v"), bitcask.RECORD_MAGIC))


def foreign_dir(w: World) -> Path:
    """A non-empty directory beside the world's database that holds no database."""
    d = w.path.parent / "foreign"
    d.mkdir(exist_ok=True)
    (d / "notes.txt").write_text("not a database\n")
    return d


# -- replication (R1, R2): a loopback server that answers one hello, and follower directories ------
def fake_primary(w: World, **hello: Any) -> tuple[str, int]:
    """A server on loopback that answers every connection with one hello frame."""
    reply = {"magic": REPL_MAGIC, "version": REPL_VERSION, "db_id": b"P" * 16, "stream": b"s" * 16,
             "mode": "resume", "seq": 0}
    reply.update(hello)
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.recv(4096)
                    conn.sendall(encode_frame(reply))
                    conn.recv(1)  # until the follower hangs up
                except OSError:
                    pass

    threading.Thread(target=serve, daemon=True).start()
    w.extra.setdefault("cleanup", []).append(srv.close)
    return srv.getsockname()[:2]


def follower_dir(w: World, db_id: bytes, *, with_db: bool = False) -> Path:
    """A follower's directory beside the world's database (its copy complete), following ``db_id``."""
    d = w.path.parent / "follower"
    if with_db:
        armdb.Db.open(d).close()
    d.mkdir(exist_ok=True)
    (d / "replica.state").write_bytes(_encode_state({"db_id": db_id, "stream": b"s" * 16, "seq": 0, "complete": True}))
    return d


def follow_then(w: World, path: Path, address: tuple[str, int], then: Callable[[Any], Any] | None = None) -> Any:
    try:
        f = armdb.Db.follow(path, primary=address)
        try:
            if then is not None:
                with f.reader() as r:
                    return then(r)
        finally:
            f.close()
        return f
    finally:
        for close in w.extra.pop("cleanup", []):
            close()


def open_with_clock(w: World, clock: Callable[[], Any]) -> armdb.Db:
    return armdb.Db.open(w.path.parent / "clocked", clock=clock)


def symlinked_lock_dir(w: World) -> Path:
    """A closed database beside the world's whose LOCK is a symlink to a victim file."""
    d = w.path.parent / "linked"
    with armdb.Db.open(d):
        pass
    (d / "LOCK").unlink()
    victim = w.path.parent / "victim"
    victim.write_text("precious")
    (d / "LOCK").symlink_to(victim)
    w.extra["victim"] = victim
    return d


def second_db(w: World) -> armdb.Db:
    other = armdb.Db.open(w.path.parent / "other-db")  # outside the directory being hashed
    w.extra.setdefault("dbs", []).append(other)
    return other


def foreign_handles(w: World) -> None:
    other = second_db(w)
    w.extra["queue"] = other.open_queue(VarQ, cfg())
    w.extra["map"] = other.open_map("docs")


def committed_tx(w: World) -> None:
    tx = w.db.tx().put(w.m, "x", 1)
    tx.commit()
    w.extra["tx"] = tx


def aborted_tx(w: World) -> None:
    tx = w.db.tx().put(w.m, "x", 1)
    tx.abort()
    w.extra["tx"] = tx


def tx_then_close(w: World) -> None:
    w.extra["tx"] = w.db.tx().put(w.m, "x", 1)
    w.db.shutdown()


def expired_then_relased(w: World) -> None:
    w.vq.ack(w.relased)


def _lease_fbatch(w: World) -> None:
    w.extra["fbatch"] = w.fq.lease_batch(1)


# -- the table --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class R:
    id: str
    call: Callable[[World], Any]
    exc: type[BaseException]
    match: str
    prep: Callable[[World], None] | None = None
    check: bool = True  # armdb.check must pass afterwards (False: the row damages a file on purpose)


def qb() -> Any:
    return QueueConfig.balanced()


ROWS: list[R] = [
    # -- QueueConfig builder (Q4): ConfigError naming the field -------------------------------------
    R("q4_max_attempts_zero", lambda w: qb().max_attempts(0).build(), ConfigError, r"max_attempts must be at least 1"),
    R("q4_max_attempts_negative", lambda w: qb().max_attempts(-1).build(), ConfigError, r"max_attempts must be at least 1"),
    R("q4_max_attempts_float", lambda w: qb().max_attempts(1.5).build(), ConfigError, r"max_attempts must be an int"),
    R("q4_max_attempts_str", lambda w: qb().max_attempts("3").build(), ConfigError, r"max_attempts must be an int"),
    R("q4_max_attempts_none", lambda w: qb().max_attempts(None).build(), ConfigError, r"max_attempts must be an int"),
    R("q4_max_attempts_bool", lambda w: qb().max_attempts(True).build(), ConfigError, r"max_attempts must be an int"),
    R("q4_max_attempts_over_u16", lambda w: qb().max_attempts(65536).build(), ConfigError, r"max_attempts must be at most 65535"),
    R("q4_backoff_empty", lambda w: qb().backoff_secs([]).build(), ConfigError, r"backoff_secs must not be empty.*give at least one"),
    R("q4_backoff_negative", lambda w: qb().backoff_secs([1, -1]).build(), ConfigError, r"backoff_secs must not hold negative"),
    R("q4_backoff_not_a_list", lambda w: qb().backoff_secs(5).build(), ConfigError, r"backoff_secs must be a list of seconds"),
    R("q4_backoff_item_none", lambda w: qb().backoff_secs([None]).build(), ConfigError, r"backoff_secs.*timedelta or a number of seconds"),
    R("q4_backoff_item_str", lambda w: qb().backoff_secs(["1"]).build(), ConfigError, r"backoff_secs.*timedelta or a number of seconds"),
    R("q4_backoff_nan", lambda w: qb().backoff_secs([NAN]).build(), ConfigError, r"backoff_secs.*(finite|NaN|nan)"),
    R("q4_backoff_inf", lambda w: qb().backoff_secs([1, INF]).build(), ConfigError, r"backoff_secs.*(finite|inf)"),
    R("q4_lease_timeout_zero", lambda w: qb().lease_timeout(0).build(), ConfigError, r"lease_timeout must be positive"),
    R("q4_lease_timeout_negative", lambda w: qb().lease_timeout(-1).build(), ConfigError, r"lease_timeout must be positive"),
    R("q4_lease_timeout_zero_timedelta", lambda w: qb().lease_timeout(timedelta(0)).build(), ConfigError, r"lease_timeout must be positive"),
    R("q4_lease_timeout_str", lambda w: qb().lease_timeout("30").build(), ConfigError, r"lease_timeout must be a datetime\.timedelta or a number of seconds"),
    R("q4_lease_timeout_nan", lambda w: qb().lease_timeout(NAN).build(), ConfigError, r"lease_timeout.*(finite|NaN|nan)"),
    R("q4_lease_timeout_inf", lambda w: qb().lease_timeout(INF).build(), ConfigError, r"lease_timeout.*(finite|inf)"),
    R("q4_lease_timeout_below_1ms", lambda w: qb().lease_timeout(0.0004).build(), ConfigError, r"lease_timeout.*(millisecond|1 ms|0\.001)"),
    R("q4_wakeup_recheck_zero", lambda w: qb().wakeup_recheck(0).build(), ConfigError, r"wakeup_recheck must be positive"),
    R("q4_wakeup_recheck_negative", lambda w: qb().wakeup_recheck(-5).build(), ConfigError, r"wakeup_recheck must be positive"),
    R("q4_wakeup_recheck_nan", lambda w: qb().wakeup_recheck(NAN).build(), ConfigError, r"wakeup_recheck.*(finite|NaN|nan)"),
    R("q4_max_depth_zero", lambda w: qb().max_depth(0).build(), ConfigError, r"max_depth must be at least 1"),
    R("q4_max_depth_negative", lambda w: qb().max_depth(-1).build(), ConfigError, r"max_depth must be at least 1"),
    R("q4_max_depth_float", lambda w: qb().max_depth(2.5).build(), ConfigError, r"max_depth must be an int"),
    R("q22_dead_retention_zero", lambda w: qb().dead_retention(0).build(), ConfigError, r"dead_retention must be positive"),
    R("q22_dead_retention_negative", lambda w: qb().dead_retention(timedelta(seconds=-1)).build(), ConfigError, r"dead_retention must be positive"),
    R("q22_dead_retention_nan", lambda w: qb().dead_retention(NAN).build(), ConfigError, r"dead_retention.*(finite|NaN|nan)"),
    R("q5_header_config_not_built", lambda w: qb().header_config(FixedConfig.balanced()).build(), ConfigError, r"header_config takes a built FixedConfig"),
    R("q5_header_config_wrong_type", lambda w: qb().header_config(Config()).build(), ConfigError, r"header_config takes a built FixedConfig"),
    R("q6_payload_config_not_built", lambda w: qb().payload_config(Config.balanced()).build(), ConfigError, r"payload_config takes a built Config"),
    # -- FixedConfig / Config / TxConfig builders (S5, S9, T3, T4) -----------------------------------
    R("s5_shard_count_zero", lambda w: FixedConfig.balanced().shard_count(0).build(), ConfigError, r"shard_count must be at least 1"),
    R("s5_shard_count_str", lambda w: FixedConfig.balanced().shard_count("2").build(), ConfigError, r"shard_count must be an int"),
    R("s5_grow_step_zero", lambda w: FixedConfig.balanced().grow_step(0).build(), ConfigError, r"grow_step must be at least 1"),
    R("s5_sync_interval_negative", lambda w: FixedConfig.balanced().sync_interval(-1).build(), ConfigError, r"sync_interval must not be negative"),
    R("s5_sync_interval_nan", lambda w: FixedConfig.balanced().sync_interval(NAN).build(), ConfigError, r"sync_interval.*(finite|NaN|nan)"),
    R("s5_enable_fsync_str", lambda w: FixedConfig.balanced().enable_fsync("yes").build(), ConfigError, r"enable_fsync must be True or False"),
    R("s5_reversed_int", lambda w: FixedConfig.balanced().reversed(1).build(), ConfigError, r"reversed must be True or False"),
    R("s9_max_file_size_small", lambda w: Config.balanced().max_file_size(1000).build(), ConfigError, r"max_file_size must be at least 65536"),
    R("s9_compaction_threshold_zero", lambda w: Config.balanced().compaction_threshold(0).build(), ConfigError, r"compaction_threshold must be a number in \(0, 1\]"),
    R("s9_compaction_threshold_big", lambda w: Config.balanced().compaction_threshold(1.5).build(), ConfigError, r"compaction_threshold must be a number in \(0, 1\]"),
    R("s9_compaction_threshold_nan", lambda w: Config.balanced().compaction_threshold(NAN).build(), ConfigError, r"compaction_threshold must be a number in \(0, 1\]"),
    R("s9_cache_bytes_negative", lambda w: Config.balanced().cache_bytes(-1).build(), ConfigError, r"cache_bytes must be at least 0"),
    R("s9_shard_count_negative", lambda w: Config.balanced().shard_count(-2).build(), ConfigError, r"shard_count must be at least 1"),
    R("s9_sync_interval_inf", lambda w: Config.balanced().sync_interval(INF).build(), ConfigError, r"sync_interval.*(finite|inf)"),
    R("s9_encryption_key_short", lambda w: Config.balanced().encryption_key(b"short").build(), ConfigError, r"encryption_key must be 32 bytes.*os\.urandom\(32\)"),
    R("s9_encryption_key_str", lambda w: Config.balanced().encryption_key("k" * 32).build(), ConfigError, r"encryption_key must be 32 bytes"),
    R("t3_durable_str", lambda w: TxConfig(durable="yes"), ConfigError, r"durable must be True or False"),
    R("t4_log_key_short", lambda w: TxConfig(log_encryption_key=bytes(31)), ConfigError, r"log_encryption_key must be 32 bytes"),
    R("t2_checkpoint_bytes_small", lambda w: TxConfig(checkpoint_bytes=100), ConfigError, r"checkpoint_bytes must be at least 4096"),
    # -- Db.open and the directory (D1, D5, D7) ---------------------------------------------------------
    R("d1_tx_config_wrong_type", lambda w: armdb.Db.open(w.path / "new", tx_config={"durable": True}), ConfigError, r"tx_config must be an armdb\.TxConfig"),
    R("d7_clock_not_callable", lambda w: armdb.Db.open(w.path / "new", clock=123), ConfigError, r"clock must be a callable returning wall-clock milliseconds"),
    R("d1_path_is_a_file", lambda w: armdb.Db.open(w.path / "db.meta"), ConfigError, r"is not a directory; give armdb a directory path"),
    R("d1_path_under_a_file", lambda w: armdb.Db.open(w.path / "db.meta" / "sub"), StorageError, r"(not a directory|directory path|exists).*(check|directory)"),
    R("d1_path_name_too_long", lambda w: armdb.Db.open(w.path.parent / ("x" * 300)), StorageError, r"(too long|name).*(check|choose|shorter|path)"),
    R("d1_path_unwritable", lambda w: armdb.Db.open("/proc/armdb-cannot-create-here"), StorageError, r"(check|choose|permission|writable|directory)"),
    R("d1_locked_same_process", lambda w: armdb.Db.open(w.path), DbLocked, rf"already open by process {os.getpid()}; close that Db first"),
    R("d6_check_while_open", lambda w: armdb.check(w.path), DbLocked, r"already open by process .*close that Db first"),
    R("d5_db_meta_foreign", lambda w: armdb.Db.open(w.path), FormatError, r"not an armdb database.*point armdb at its own directory",
      prep=close_and(lambda w: (w.path / "db.meta").write_bytes(b"hello, I am a text file\n")), check=False),
    R("d5_db_meta_newer_version", lambda w: armdb.Db.open(w.path), FormatError, r"format version 99 is not supported.*upgrade armdb",
      prep=close_and(bump_db_meta_version), check=False),
    R("d5_seqmap_foreign", lambda w: armdb.Db.open(w.path), FormatError, r"not an armdb sequence map",
      prep=close_and(lambda w: (w.path / "seqmap").write_bytes(b"\x00" * 40)), check=False),
    R("d5_txlog_foreign", lambda w: armdb.Db.open(w.path), FormatError, r"not an armdb transaction log",
      prep=close_and(lambda w: (w.path / "txlog" / "00000000.log").write_bytes(b"GARBAGE!" * 8)), check=False),
    R("d5_txlog_newer_version", lambda w: armdb.Db.open(w.path), FormatError, r"format 99 is not supported; upgrade armdb",
      prep=close_and(newer_log_file), check=False),
    R("d5_queue_meta_foreign", lambda w: w.db.open_queue(SpareQ, cfg()), FormatError, r"not an armdb queue meta file",
      prep=lambda w: (w.path / "collections" / "spare" / "queue.meta").write_bytes(b"{}" * 20), check=False),
    R("d5_queue_meta_newer", lambda w: w.db.open_queue(SpareQ, cfg()), FormatError, r"queue meta format 99 is not supported; upgrade armdb",
      prep=bump_queue_meta_version, check=False),
    R("d5_fixed_data_foreign", lambda w: w.db.open_queue(SpareQ, cfg()), FormatError, r"fixed\.data",
      prep=lambda w: patch_file(w.path / "collections" / "spare" / "shard-000" / "fixed.data", 0, b"NOTFIXED"), check=False),
    R("d5_bitcask_meta_foreign", lambda w: w.db.open_map("plainmap"), FormatError, r"collection\.meta",
      prep=lambda w: (w.path / "collections" / "plainmap" / "collection.meta").write_bytes(b"x" * 64), check=False),
    R("d5_bitcask_data_newer", lambda w: w.db.open_map("plainmap"), FormatError, r"\.data.*(upgrade|not supported)",
      prep=lambda w: newer_bitcask_header(first_data_file(w, "plainmap")), check=False),
    R("s7_bitcask_record_corrupt", lambda w: w.db.open_map("plainmap"), CorruptionError, rf"\.data.*offset {bitcask.DATA_START}",
      prep=tamper_record, check=False),
    # -- queue declarations (Q1, D3) ----------------------------------------------------------------------
    R("d3_queue_name_empty", lambda w: armdb.queue("", payload=PING), ConfigError, r"invalid collection name.*use 1-128 characters"),
    R("d3_queue_name_upper", lambda w: armdb.queue("Jobs", payload=PING), ConfigError, r"invalid collection name.*a-z"),
    R("d3_queue_name_slash", lambda w: armdb.queue("a/b", payload=PING), ConfigError, r"invalid collection name"),
    R("d3_queue_name_dotdot", lambda w: armdb.queue("..", payload=PING), ConfigError, r"invalid collection name.*starting with a letter"),
    R("d3_queue_name_nul", lambda w: armdb.queue("a\0b", payload=PING), ConfigError, r"invalid collection name"),
    R("d3_queue_name_space", lambda w: armdb.queue("a b", payload=PING), ConfigError, r"invalid collection name"),
    R("d3_queue_name_121", lambda w: armdb.queue("q" * 121, payload=PING), ConfigError, r"longer than 120 characters"),
    R("d3_queue_name_payload_suffix", lambda w: armdb.queue("jobs.payload", payload=PING), ConfigError, r"must not end in '\.payload'"),
    R("d3_queue_name_int", lambda w: armdb.queue(123, payload=PING), ConfigError, r"invalid collection name"),
    R("q1_fixed_payload_str", lambda w: armdb.queue("q", payload="u8"), ConfigError, r"must be a NumPy dtype.*declare the queue with var=True"),
    R("q1_fixed_payload_object_dtype", lambda w: armdb.queue("q", payload=np.dtype("O")), ConfigError, r"cannot hold Python objects; use var=True"),
    R("q1_fixed_payload_too_big", lambda w: armdb.queue("q", payload=np.dtype(("u1", 4097))), ConfigError, r"1\.\.4096 bytes.*var=True"),
    R("q1_fixed_payload_empty_dtype", lambda w: armdb.queue("q", payload=np.dtype([])), ConfigError, r"1\.\.4096 bytes"),
    R("q1_fixed_payload_dataclass", lambda w: armdb.queue("q", payload=Job), ConfigError, r"var=True"),
    R("q1_var_payload_instance", lambda w: armdb.queue("q", payload={}, var=True), ConfigError, r"var queue's payload must be a dataclass, bytes"),
    R("q1_var_payload_set", lambda w: armdb.queue("q", payload=set, var=True), ConfigError, r"var queue's payload must be a dataclass, bytes"),
    R("q1_var_flag_str", lambda w: armdb.queue("q", payload=bytes, var="yes"), ConfigError, r"var must be True or False"),
    # -- open_queue / open_map (Q2, D3, S5) --------------------------------------------------------------------
    R("q2_open_queue_not_a_spec", lambda w: w.db.open_queue("pings", cfg()), ConfigError, r"takes the QueueSpec returned by armdb\.queue"),
    R("q2_open_queue_unbuilt_config", lambda w: w.db.open_queue(SpareQ, QueueConfig.balanced()), ConfigError, r"takes a built QueueConfig"),
    R("q2_open_queue_twice", lambda w: w.db.open_queue(FixedQ, cfg()), QueueAlreadyOpen, r"already open in this Db; share the handle"),
    R("q2_reopen_fixed_as_var", lambda w: w.db.open_queue(armdb.queue("spare", payload=Job, var=True), cfg()), SchemaMismatch, r"created as a fixed queue.*declare it as it was created"),
    R("q2_reopen_var_as_fixed", lambda w: w.db.open_queue(armdb.queue("sparev", payload=PING), cfg()), SchemaMismatch, r"created as a var queue"),
    R("q2_reopen_other_dtype", lambda w: w.db.open_queue(armdb.queue("spare", payload=np.dtype("<u8")), cfg()), SchemaMismatch, r"payload schema.*declare the original payload type"),
    R("q2_reopen_other_dataclass_fields", lambda w: w.db.open_queue(armdb.queue("sparev", payload=JobV2, var=True), cfg()), SchemaMismatch, r"declare the original payload type"),
    R("q36_reopen_dataclass_field_type_changed", lambda w: w.db.open_queue(armdb.queue("sparev", payload=JobDocStr, var=True), cfg()), SchemaMismatch, r"field 'doc_id' of JobDocStr was stored as int and is now str"),
    R("q2_reopen_var_bytes_as_str", lambda w: w.db.open_queue(armdb.queue("sparev", payload=str, var=True), cfg()), SchemaMismatch, r"payload schema"),
    R("s5_queue_shard_count_changed", lambda w: w.db.open_queue(SpareQ, cfg(header_config=FixedConfig.balanced().shard_count(3).grow_step(64).build())), ConfigError, r"fixed at creation: leave it unset"),
    R("s9_map_shard_count_changed", lambda w: w.db.open_map("plainmap", Config.balanced().shard_count(4).build()), ConfigError, r"shard"),
    R("q2_queue_named_like_a_map", lambda w: w.db.open_queue(armdb.queue("plainmap", payload=PING), cfg()), ConfigError, r"another kind|open as a map|choose another name"),
    R("q3_map_named_like_a_queue", lambda w: w.db.open_map("spare"), ConfigError, r"is a queue; a queue's collections cannot be opened as maps"),
    R("q3_map_named_like_a_payload", lambda w: w.db.open_map("jobs.payload"), ConfigError, r"reserved for var queues"),
    R("d3_map_name_empty", lambda w: w.db.open_map(""), ConfigError, r"invalid collection name"),
    R("d3_map_name_upper", lambda w: w.db.open_map("Docs"), ConfigError, r"invalid collection name"),
    R("d3_map_name_129", lambda w: w.db.open_map("m" * 129), ConfigError, r"invalid collection name.*1-128 characters"),
    R("d3_map_name_none", lambda w: w.db.open_map(None), ConfigError, r"invalid collection name"),
    R("d3_map_config_wrong_type", lambda w: w.db.open_map("newmap", "fast"), ConfigError, r"open_map takes a built Config"),
    # -- S10 keys (harness g has the full set) ------------------------------------------------------------------
    R("s10_map_without_key", lambda w: w.db.open_map("secret"), EncryptionKeyRequired, r"encrypted; open it with Config\.balanced\(\)\.encryption_key"),
    R("c4_check_wrong_key", lambda w: armdb.check(w.path, encryption_key=OTHER), WrongKey,
      r"opens none of its encrypted collections .* give the key its encrypted collections were created with", prep=closed),
    R("c4_check_log_key_never_given", lambda w: armdb.check(w.path, log_encryption_key=OTHER), WrongKey,
      r"never given a log key .* leave it out", prep=closed),
    R("c4_check_key_of_16_bytes", lambda w: armdb.check(w.path, encryption_key=bytes(16)), ConfigError,
      r"a key must be 32 bytes", prep=closed),
    R("c4_salvage_wrong_key", lambda w: armdb.salvage(w.path, encryption_key=[KEY, OTHER]), WrongKey,
      r"encryption_key\[1\] opens none", prep=closed),
    R("c4_key_file_missing", lambda w: read_key_file(w.path.parent / "no.key"), KeyFileError,
      r"cannot read the key file .*give the path of the file that holds the key"),
    R("c4_key_file_a_password", lambda w: read_key_file(w.path.parent / "pw.key"), KeyFileError,
      r"not a 32-byte key; write 32 random bytes \(head -c 32 /dev/urandom",
      prep=lambda w: (w.path.parent / "pw.key").write_bytes(b"hunter2\n")),
    R("s10_map_wrong_key", lambda w: w.db.open_map("secret", Config.balanced().encryption_key(OTHER).build()), WrongKey, r"open it with the original key"),
    R("s10_plain_map_with_key", lambda w: w.db.open_map("plainmap", Config.balanced().encryption_key(KEY).build()), ConfigError, r"not encrypted"),
    R("t4_tx_encrypted_map_without_log_key", lambda w: w.db.tx().put(w.secret2, "k", "x").commit(), EncryptionKeyRequired, r"TxConfig\(log_encryption_key=\.\.\.\)"),
    R("q7_var_ack_without_log_key", lambda w: w.secretq.ack(w.stok), EncryptionKeyRequired, r"TxConfig\(log_encryption_key=\.\.\.\)"),
    # -- payloads (Q1) ------------------------------------------------------------------------------------------
    R("q1_fixed_push_str", lambda w: w.fq.push("ping"), PayloadTypeError, r"record of that dtype or a tuple of 2 fields"),
    R("q1_fixed_push_list", lambda w: w.fq.push([1, 2]), PayloadTypeError, r"tuple of 2 fields, not list"),
    R("q1_fixed_push_short_tuple", lambda w: w.fq.push((1,)), PayloadTypeError, r"tuple of 2 fields"),
    R("q1_fixed_push_long_tuple", lambda w: w.fq.push((1, 2, 3)), PayloadTypeError, r"tuple of 2 fields"),
    R("q1_fixed_push_none", lambda w: w.fq.push(None), PayloadTypeError, r"tuple of 2 fields, not NoneType"),
    R("q1_fixed_push_other_dtype_record", lambda w: w.fq.push(np.zeros(1, np.dtype([("a", "<u8"), ("b", "<u8")]))[0]), PayloadTypeError, r"record of that dtype"),
    R("q1_fixed_push_negative_into_unsigned", lambda w: w.fq.push((-1, 0)), PayloadTypeError, r"does not fit dtype"),
    R("q1_fixed_push_str_field", lambda w: w.fq.push(("x", 0)), PayloadTypeError, r"does not fit dtype"),
    R("q1_fixed_push_overflow_field", lambda w: w.fq.push((2**64, 0)), PayloadTypeError, r"does not fit dtype"),
    R("q35_fixed_push_fractional_into_int", lambda w: w.fq.push((6.7, 0)), PayloadTypeError, r"does not fit dtype.*field 'doc'"),
    R("q35_fixed_push_np_int_wrapping", lambda w: w.fq.push((0, np.int64(2**33))), PayloadTypeError, r"does not fit dtype.*field 'flags'"),
    R("q1_scalar_push_float", lambda w: w.sq.push(1.5), PayloadTypeError, r"must be a matching scalar"),
    R("q1_scalar_push_str", lambda w: w.sq.push("1"), PayloadTypeError, r"must be a matching scalar"),
    R("q1_scalar_push_overflow", lambda w: w.sq.push(2**40), PayloadTypeError, r"does not fit dtype"),
    R("q1_scalar_push_bool", lambda w: w.sq.push(True), PayloadTypeError, r"must be a matching scalar"),
    R("q1_var_push_dict_for_dataclass", lambda w: w.vq.push({"doc_id": 1, "reason": "x"}), PayloadTypeError, r"Job.*not dict"),
    R("q1_var_push_other_dataclass", lambda w: w.vq.push(OtherJob(1, "x")), PayloadTypeError, r"Job.*not OtherJob"),
    R("q1_var_push_unencodable_field", lambda w: w.vq.push(Job(1, object())), PayloadTypeError, r"cannot be serialised with msgpack"),
    R("q1_var_push_huge_int_field", lambda w: w.vq.push(Job(2**70, "x")), PayloadTypeError, r"cannot be serialised with msgpack"),
    R("q1_bytes_push_str", lambda w: w.bq.push("text"), PayloadTypeError, r"must be of type bytes, not str"),
    R("q1_bytes_push_str", lambda w: w.bq.push("text"), PayloadTypeError, r"must be of type bytes, not str"),
    R("d1_pickle_a_queue_handle", lambda w: pickle.dumps(w.fq), ProcessBound, r"belongs to the process that opened the database"),
    R("q1_any_push_object", lambda w: w.aq.push(object()), PayloadTypeError, r"cannot be serialised with msgpack"),
    R("q1_any_push_set", lambda w: w.aq.push({1, 2}), PayloadTypeError, r"cannot be serialised with msgpack"),
    R("q1_tx_push_wrong_type", lambda w: w.db.tx().push(w.vq, {"x": 1}), PayloadTypeError, r"instance.*Job|Job.*instance"),
    R("t6_stream_emit_wrong_type", lambda w: w.db.tx().put(w.src, "k", "not-a-job").commit(), PayloadTypeError, r"Job.*not dict"),
    # -- delays (Q9, Q14) --------------------------------------------------------------------------------------
    R("q9_push_delay_negative", lambda w: w.fq.push((1, 1), delay=-1), ConfigError, r"delay must not be negative"),
    R("q9_push_delay_negative_timedelta", lambda w: w.vq.push(Job(1, "x"), delay=timedelta(seconds=-3)), ConfigError, r"delay must not be negative"),
    R("q9_push_delay_str", lambda w: w.fq.push((1, 1), delay="5"), ConfigError, r"delay must be a datetime\.timedelta or a number of seconds"),
    R("q9_push_delay_datetime", lambda w: w.fq.push((1, 1), delay=datetime.now()), ConfigError, r"delay must be a datetime\.timedelta or a number of seconds"),
    R("q9_push_delay_nan", lambda w: w.fq.push((1, 1), delay=NAN), ConfigError, r"delay.*(finite|NaN|nan)"),
    R("q9_push_delay_inf", lambda w: w.fq.push((1, 1), delay=INF), ConfigError, r"delay.*(finite|inf)"),
    R("q9_push_delay_beyond_2_63_ms", lambda w: w.vq.push(Job(1, "x"), delay=1e20), ConfigError, r"delay.*(too large|range|at most)"),
    R("q14_nack_delay_negative", lambda w: w.vq.nack(w.tok, delay=-1), ConfigError, r"delay must not be negative"),
    R("q14_nack_delay_nan", lambda w: w.fq.nack(w.ftok, delay=NAN), ConfigError, r"delay.*(finite|NaN|nan)"),
    R("q14_nack_dead_str", lambda w: w.vq.nack(w.tok, dead="yes"), ConfigError, r"dead must be True or False"),
    R("t1_tx_push_delay_negative", lambda w: w.db.tx().push(w.vq, Job(1, "x"), delay=-5), ConfigError, r"delay must not be negative"),
    R("t1_tx_nack_dead_str", lambda w: w.db.tx().nack(w.vq, w.tok, dead=1), ConfigError, r"dead must be True or False"),
    # -- lease arguments (Q9) -------------------------------------------------------------------------------------
    R("q9_lease_n_zero", lambda w: w.vq.lease(0), ConfigError, r"lease\(n\) needs an int n >= 1"),
    R("q9_lease_n_negative", lambda w: w.vq.lease(-3), ConfigError, r"lease\(n\) needs an int n >= 1"),
    R("q9_lease_n_float", lambda w: w.vq.lease(1.5), ConfigError, r"lease\(n\) needs an int n >= 1"),
    R("q9_lease_n_str", lambda w: w.vq.lease("2"), ConfigError, r"lease\(n\) needs an int n >= 1"),
    R("q9_lease_n_bool", lambda w: w.vq.lease(True), ConfigError, r"lease\(n\) needs an int n >= 1"),
    R("q9_lease_n_2_62", lambda w: w.fq.lease(2**62), ConfigError, r"lease\(n\) takes at most 1,000,000 rows"),
    R("q9_lease_n_2_31", lambda w: w.vq.lease(2**31), ConfigError, r"lease\(n\) takes at most 1,000,000 rows"),
    R("q9_lease_n_above_max", lambda w: w.fq.lease(1_000_001), ConfigError, r"lease\(n\) takes at most 1,000,000 rows"),
    R("q9_lease_timeout_zero", lambda w: w.fq.lease(1, lease_timeout=0), ConfigError, r"lease_timeout must be positive"),
    R("q9_lease_timeout_negative", lambda w: w.fq.lease(1, lease_timeout=timedelta(seconds=-1)), ConfigError, r"lease_timeout must be positive"),
    R("q9_lease_timeout_str", lambda w: w.fq.lease(1, lease_timeout="10"), ConfigError, r"lease_timeout must be a datetime\.timedelta"),
    R("q9_lease_timeout_nan", lambda w: w.fq.lease(1, lease_timeout=NAN), ConfigError, r"lease_timeout.*(finite|NaN|nan)"),
    R("q9_lease_timeout_inf", lambda w: w.fq.lease(1, lease_timeout=INF), ConfigError, r"lease_timeout.*(finite|inf)"),
    R("q9_lease_timeout_below_1ms", lambda w: w.fq.lease(3, lease_timeout=0.0004), ConfigError, r"lease_timeout.*(millisecond|1 ms|0\.001)"),
    R("q19_wait_due_timeout_str", lambda w: w.vq.wait_due_timeout("1"), ConfigError, r"timeout must be a datetime\.timedelta"),
    # -- extend, peek, redrive, purge (Q29, Q33, Q34) ------------------------------------------------------------------
    R("q29_extend_by_zero", lambda w: w.vq.extend(w.tok, by=0), ConfigError, r"by must be positive"),
    R("q29_extend_by_negative", lambda w: w.fq.extend(w.ftok, by=-5), ConfigError, r"by must be positive"),
    R("q29_extend_by_nan", lambda w: w.fq.extend(w.ftok, by=NAN), ConfigError, r"by.*(finite|NaN|nan)"),
    R("q29_extend_by_str", lambda w: w.fq.extend(w.ftok, by="10"), ConfigError, r"by must be a datetime\.timedelta"),
    R("q29_extend_acked", lambda w: w.vq.extend(w.acked), StaleToken, r"already acked, nacked or dead-lettered"),
    R("q29_extend_relased", lambda w: w.vq.extend(w.relased), StaleToken, r"leased again"),
    R("q30_extend_int", lambda w: w.vq.extend(7), NotALease, r"expected a Lease.*got int"),
    R("q33_peek_n_zero", lambda w: w.vq.peek(0), ConfigError, r"peek"),
    R("q33_peek_n_float", lambda w: w.fq.peek(2.5), ConfigError, r"peek"),
    R("q33_peek_n_above_max", lambda w: w.fq.peek(1_000_001), ConfigError, r"peek"),
    R("q34_redrive_ids_str", lambda w: w.vq.redrive("1,2"), ConfigError, r"ids"),
    R("q34_redrive_ids_floats", lambda w: w.vq.redrive([1.5]), ConfigError, r"ids"),
    R("q34_redrive_delay_negative", lambda w: w.vq.redrive(delay=-1), ConfigError, r"delay"),
    R("q34_purge_ids_none_item", lambda w: w.fq.purge_dead([None]), ConfigError, r"ids"),
    # -- batches (Q31, Q32) ---------------------------------------------------------------------------------------------
    R("q31_push_many_bad_item", lambda w: w.vq.push_many([Job(1, "a"), "oops", Job(2, "b")]), PayloadTypeError,
      r"payload 1 of the batch.*nothing was pushed"),
    R("q31_push_many_fixed_bad_item", lambda w: w.fq.push_many([(1, 1), (2, "x")]), PayloadTypeError,
      r"payload 1 of the batch"),
    R("q31_push_many_wrong_dtype", lambda w: w.fq.push_many(np.zeros(4, dtype="<u8")), PayloadTypeError,
      r"stores .*got an array of uint64.*dtype=queue\.spec\.dtype"),
    R("q31_push_many_2d_array", lambda w: w.fq.push_many(np.zeros((2, 2), dtype=PING)), PayloadTypeError,
      r"1-D array.*shape \(2, 2\)"),
    R("q31_push_many_str", lambda w: w.vq.push_many("abc"), PayloadTypeError, r"sequence of payloads.*not str"),
    R("q31_push_many_int", lambda w: w.fq.push_many(5), PayloadTypeError, r"sequence of payloads.*not int"),
    R("q31_push_many_delay_negative", lambda w: w.vq.push_many([Job(1, "a")], delay=-1), ConfigError,
      r"delay must not be negative"),
    R("q31_push_many_delay_nan", lambda w: w.fq.push_many([(1, 1)], delay=NAN), ConfigError, r"delay.*(finite|NaN|nan)"),
    R("q31_push_many_full", lambda w: w.full.push_many([3]), QueueFull, r"max_depth=2; nothing was pushed"),
    R("q31_push_many_encrypted_without_log_key", lambda w: w.secretq.push_many([b"x"]), EncryptionKeyRequired,
      r"TxConfig\(log_encryption_key=\.\.\.\)"),
    R("q32_lease_batch_n_zero", lambda w: w.vq.lease_batch(0), ConfigError, r"lease_batch\(n\) needs an int n >= 1"),
    R("q32_lease_batch_n_float", lambda w: w.fq.lease_batch(1.5), ConfigError, r"lease_batch\(n\) needs an int"),
    R("q32_lease_batch_n_above_max", lambda w: w.fq.lease_batch(1_000_001), ConfigError, r"lease_batch\(n\) takes at most"),
    R("q32_lease_batch_timeout_nan", lambda w: w.fq.lease_batch(2, lease_timeout=NAN), ConfigError,
      r"lease_timeout.*(finite|NaN|nan)"),
    R("q32_lease_batch_timeout_zero", lambda w: w.vq.lease_batch(2, lease_timeout=0), ConfigError,
      r"lease_timeout must be positive"),
    R("q32_ack_many_ints", lambda w: w.vq.ack_many([1, 2]), NotALease, r"expected a Lease.*got int"),
    R("q32_ack_many_int", lambda w: w.vq.ack_many(3), NotALease, r"ack_many takes a LeaseBatch"),
    R("q32_ack_many_single_token", lambda w: w.vq.ack_many(w.tok), NotALease, r"ack one lease with ack\(\)"),
    R("q32_ack_many_one_stale", lambda w: w.vq.ack_many([w.tok, w.acked]), StaleToken,
      r"already acked.*nothing of this batch was acked"),
    R("q32_ack_many_twice", lambda w: w.vq.ack_many([w.tok, w.tok]), StaleToken, r"appears twice.*nothing was acked"),
    R("q32_ack_many_other_queue", lambda w: w.vq.ack_many([w.tok, w.ftok]), StaleToken, r"another queue handle"),
    R("q32_ack_many_batch_of_other_queue", lambda w: w.vq.ack_many(w.extra["fbatch"]), StaleToken,
      r"this batch was leased from queue 'pings'.*nothing was acked", prep=_lease_fbatch),
    # -- tokens (Q13) ------------------------------------------------------------------------------------------------
    R("q30_ack_none", lambda w: w.vq.ack(None), NotALease, r"expected a Lease \(or its LeaseToken.*from Queue\.lease\(\), got NoneType"),
    R("q30_ack_int", lambda w: w.vq.ack(42), NotALease, r"expected a Lease.*got int"),
    R("q30_ack_str", lambda w: w.vq.ack("token"), NotALease, r"expected a Lease.*got str"),
    R("q30_nack_none", lambda w: w.fq.nack(None), NotALease, r"expected a Lease"),
    R("q13_ack_token_of_other_queue", lambda w: w.vq.ack(w.ftok), StaleToken, r"another queue handle.*lease the row again"),
    R("q13_fixed_ack_token_of_var_queue", lambda w: w.fq.ack(w.tok), StaleToken, r"another queue handle.*lease the row again"),
    R("q13_ack_token_from_before_reopen", lambda w: w.vq.ack(w.old), StaleToken, r"another queue handle \(another queue, or before a reopen\)"),
    R("q13_nack_token_from_before_reopen", lambda w: w.vq.nack(w.old, dead=True), StaleToken, r"before a reopen"),
    R("q13_double_ack", lambda w: w.vq.ack(w.acked), StaleToken, r"already acked, nacked or dead-lettered"),
    R("q13_nack_after_ack", lambda w: w.vq.nack(w.acked), StaleToken, r"already acked, nacked or dead-lettered"),
    R("q13_ack_after_nack", lambda w: w.vq.ack(w.nacked), StaleToken, r"already acked, nacked or dead-lettered|leased again"),
    R("q13_ack_after_expiry_and_relase", expired_then_relased, StaleToken, r"leased again since this token was issued"),
    R("q13_forged_epoch", lambda w: w.fq.ack(LeaseToken(w.ftok.handle, w.ftok.shard, w.ftok.due, w.ftok.seq, w.ftok.epoch + 1)), StaleToken, r"leased again"),
    R("q13_forged_shard", lambda w: w.fq.ack(LeaseToken(w.ftok.handle, 7, w.ftok.due, w.ftok.seq, w.ftok.epoch)), StaleToken, r"lease the row again|nothing changed"),
    R("q13_forged_due", lambda w: w.fq.ack(LeaseToken(w.ftok.handle, 0, w.ftok.due + 1, w.ftok.seq, w.ftok.epoch)), StaleToken, r"already acked|nothing changed"),
    R("t1_tx_ack_stale", lambda w: w.db.tx().ack(w.vq, w.acked).commit(), StaleToken, r"nothing (was written|changed)"),
    R("t1_tx_ack_twice", lambda w: w.db.tx().ack(w.vq, w.tok).ack(w.vq, w.tok).commit(), StaleToken, r"settled twice in one transaction; nothing was written"),
    R("t1_tx_ack_none", lambda w: w.db.tx().ack(w.vq, None).commit(), NotALease, r"expected a Lease"),
    R("t1_tx_ack_stale_with_push", lambda w: w.db.tx().push(w.vq, Job(9, "x")).ack(w.vq, w.relased).commit(), StaleToken, r"leased again"),
    # -- maps (D3) -----------------------------------------------------------------------------------------------------
    R("d3_map_key_float", lambda w: w.m.put(1.5, 1), PayloadTypeError, r"map keys are bytes, str or int, not float"),
    R("d3_map_key_bool", lambda w: w.m.put(True, 1), PayloadTypeError, r"map keys are bytes, str or int, not bool"),
    R("d3_map_key_none", lambda w: w.m.put(None, 1), PayloadTypeError, r"not NoneType"),
    R("d3_map_key_bytearray", lambda w: w.m.put(bytearray(b"k"), 1), PayloadTypeError, r"not bytearray"),
    R("d3_map_key_tuple", lambda w: w.m.put((1, 2), 1), PayloadTypeError, r"not tuple"),
    R("d3_map_key_lone_surrogate", lambda w: w.m.put("\ud800", 1), PayloadTypeError, r"not valid Unicode"),
    R("d3_map_value_object", lambda w: w.m.put("k", object()), PayloadTypeError, r"cannot be serialised with msgpack.*store dicts, lists"),
    R("d3_map_value_huge_int", lambda w: w.m.put("k", 2**64), PayloadTypeError, r"cannot be serialised with msgpack"),
    R("d3_map_value_set", lambda w: w.m.put("a", {1}), PayloadTypeError, r"cannot be serialised with msgpack"),
    R("d3_map_key_too_long", lambda w: w.m.put(b"k" * 70_000, 1), ConfigError, r"longer than the limit"),
    R("d3_map_get_bad_key", lambda w: w.m.get(1.5), PayloadTypeError, r"map keys are bytes, str or int"),
    R("d3_map_contains_bad_key", lambda w: 1.5 in w.m, PayloadTypeError, r"map keys are bytes, str or int"),
    R("d3_map_delete_bad_key", lambda w: w.m.delete([1]), PayloadTypeError, r"not list"),
    R("t1_tx_put_bad_key", lambda w: w.db.tx().put(w.m, 1.5, 1), PayloadTypeError, r"map keys are bytes, str or int"),
    R("t1_tx_put_bad_value", lambda w: w.db.tx().put(w.m, "k", object()), PayloadTypeError, r"cannot be serialised"),
    # -- change streams (T6) -------------------------------------------------------------------------------------------
    R("t6_direct_put_on_source", lambda w: w.src.put("k", "v"), StreamSourceRequiresTx, r"change-stream source; write it inside db\.tx\(\)"),
    R("t6_direct_delete_on_source", lambda w: w.src.delete("k"), StreamSourceRequiresTx, r"write it inside db\.tx\(\)"),
    R("t6_destination_not_open", lambda w: w.db.tx().put(w.extra["src2"], "k", 1).commit(), ConfigError, r"open the queue before committing",
      prep=lambda w: w.extra.__setitem__("src2", w.db.open_map("src2"))),
    R("t6_stream_source_bad_name", lambda w: SchemaRegistry().change_stream("Bad Name", VarQ, lambda c: None), ConfigError, r"invalid collection name"),
    R("t6_stream_queue_not_spec", lambda w: SchemaRegistry().change_stream("src", "jobs", lambda c: None), ConfigError, r"takes the QueueSpec"),
    R("t6_stream_emit_not_callable", lambda w: SchemaRegistry().change_stream("src", VarQ, 5), ConfigError, r"emit must be callable"),
    R("t6_stream_source_is_the_queue", lambda w: SchemaRegistry().change_stream("jobs", VarQ, lambda c: None), ConfigError, r"cannot be a stream source"),
    R("t6_register_queue_not_spec", lambda w: SchemaRegistry().register_queue("jobs"), ConfigError, r"takes the QueueSpec"),
    # -- transaction misuse (T1) ---------------------------------------------------------------------------------------
    R("t1_tx_push_not_a_queue", lambda w: w.db.tx().push("jobs", Job(1, "x")), ConfigError, r"tx steps take a Queue handle opened on this Db"),
    R("t1_tx_put_not_a_map", lambda w: w.db.tx().put({}, "k", 1), ConfigError, r"tx steps take a Map handle opened on this Db"),
    R("t1_tx_push_queue_of_other_db", lambda w: w.db.tx().push(w.extra["queue"], Job(1, "x")), ConfigError, r"opened on this Db",
      prep=foreign_handles),
    R("t1_tx_put_map_of_other_db", lambda w: w.db.tx().put(w.extra["map"], "k", 1), ConfigError, r"opened on this Db",
      prep=foreign_handles),
    R("q13_ack_token_of_other_db", lambda w: w.vq.ack(w.extra["tok"]), StaleToken, r"another queue handle",
      prep=lambda w: (foreign_handles(w), w.extra["queue"].push(Job(1, "x")),
                      w.extra.__setitem__("tok", w.extra["queue"].lease()[0].token))[0]),
    R("t1_tx_commit_twice", lambda w: w.extra["tx"].commit(), ConfigError, r"already committed or aborted; start a new db\.tx\(\)",
      prep=committed_tx),
    R("t1_tx_step_after_commit", lambda w: w.extra["tx"].put(w.m, "y", 1), ConfigError, r"start a new db\.tx\(\)", prep=committed_tx),
    R("t1_tx_step_after_abort", lambda w: w.extra["tx"].push(w.vq, Job(1, "x")), ConfigError, r"start a new db\.tx\(\)", prep=aborted_tx),
    # -- capacity (Q20, Q21) ----------------------------------------------------------------------------------------------
    R("q20_push_full_queue", lambda w: w.full.push(3), QueueFull, r"max_depth.*ack or dead-letter work, or open it with a larger max_depth"),
    R("q21_tx_push_full_queue", lambda w: w.db.tx().push(w.full, 3).commit(), QueueFull, r"above max_depth=2; nothing was written"),
    R("q21_tx_two_pushes_one_ack", lambda w: w.db.tx().push(w.full, 3).push(w.full, 4).ack(w.full, w.extra["full_tok"]).commit(),
      QueueFull, r"above max_depth=2; nothing was written", prep=lambda w: w.extra.__setitem__("full_tok", w.full.lease()[0].token)),
    R("q21_tx_dead_nack_grants_no_credit", lambda w: w.db.tx().push(w.full, 3).nack(w.full, w.extra["full_tok"], dead=True).commit(),
      QueueFull, r"nothing was written", prep=lambda w: w.extra.__setitem__("full_tok", w.full.lease()[0].token)),
    # -- closed Db (D2) -----------------------------------------------------------------------------------------------------
    R("d2_tx_after_close", lambda w: w.db.tx(), DbClosed, r"is closed; open the database again with armdb\.Db\.open", prep=closed),
    R("d2_push_after_close", lambda w: w.fq.push((1, 1)), DbClosed, r"open the database again", prep=closed),
    R("d2_lease_after_close", lambda w: w.vq.lease(), DbClosed, r"open the database again", prep=closed),
    R("d2_ack_after_close", lambda w: w.fq.ack(w.ftok), DbClosed, r"open the database again", prep=closed),
    R("d2_nack_after_close", lambda w: w.vq.nack(w.tok), DbClosed, r"open the database again", prep=closed),
    R("d2_len_after_close", lambda w: w.vq.len(), DbClosed, r"open the database again", prep=closed),
    R("d2_dead_len_after_close", lambda w: w.vq.dead_len(), DbClosed, r"open the database again", prep=closed),
    R("d2_next_delay_after_close", lambda w: w.vq.next_delay(), DbClosed, r"open the database again", prep=closed),
    R("d2_stats_after_close", lambda w: w.vq.stats(), DbClosed, r"open the database again", prep=closed),
    R("d2_snapshot_after_close", lambda w: w.fq.snapshot(), DbClosed, r"open the database again", prep=closed),
    R("d2_wait_due_after_close", lambda w: w.fq.wait_due_timeout(0), DbClosed, r"open the database again", prep=closed),
    R("d2_map_get_after_close", lambda w: w.m.get("a"), DbClosed, r"open the database again", prep=closed),
    R("d2_map_put_after_close", lambda w: w.m.put("a", 2), DbClosed, r"open the database again", prep=closed),
    R("d2_map_items_after_close", lambda w: list(w.m.items()), DbClosed, r"open the database again", prep=closed),
    R("d2_open_map_after_close", lambda w: w.db.open_map("docs"), DbClosed, r"open the database again", prep=closed),
    R("d2_open_queue_after_close", lambda w: w.db.open_queue(SpareQ, cfg()), DbClosed, r"open the database again", prep=closed),
    R("d2_db_stats_after_close", lambda w: w.db.stats(), DbClosed, r"open the database again", prep=closed),
    R("d4_sweep_after_close", lambda w: w.db.sweep_expired_now(), DbClosed, r"open the database again", prep=closed),
    R("d2_commit_after_close", lambda w: w.extra["tx"].commit(), DbClosed, r"open the database again", prep=tx_then_close),
    # -- hardening (issue 14): values that would not read back, paths, clocks, locks, bounds --------
    R("q9_push_tuple_dict_key", lambda w: w.aq.push({"a": {(1, 2): "x"}}), PayloadTypeError, r"dict keys must be .* payload\['a'\] has the key \(1, 2\)"),
    R("d3_put_tuple_dict_key", lambda w: w.m.put("bad", {(1, 2): "x"}), PayloadTypeError, r"dict keys must be .* map value has the key \(1, 2\)"),
    R("d9_open_empty_path", lambda w: armdb.Db.open(""), ConfigError, r"the database path is empty"),
    R("d9_open_foreign_directory", lambda w: armdb.Db.open(foreign_dir(w)), ConfigError, r"is not empty .* holds no armdb database"),
    R("d7_clock_microseconds", lambda w: open_with_clock(w, lambda: 1_700_000_000_000_000), ConfigError, r"the clock returned 1700000000000000 \(int\)"),
    R("d7_clock_negative", lambda w: open_with_clock(w, lambda: -5), ConfigError, r"the clock returned -5 \(int\)"),
    R("d7_clock_none", lambda w: open_with_clock(w, lambda: None), ConfigError, r"the clock returned None"),
    R("d7_clock_str", lambda w: open_with_clock(w, lambda: "now"), ConfigError, r"the clock returned 'now' \(str\)"),
    R("d7_clock_float", lambda w: open_with_clock(w, lambda: 1.7e12), ConfigError, r"the clock returned 1700000000000.0 \(float\)"),
    R("d1_lock_is_a_symlink", lambda w: armdb.Db.open(symlinked_lock_dir(w)), ConfigError, r"LOCK is a symbolic link.*remove"),
    R("s5_shard_count_over_max", lambda w: FixedConfig.balanced().shard_count(257).build(), ConfigError, r"shard_count must be at most 256"),
    R("s9_shard_count_over_max", lambda w: Config.balanced().shard_count(257).build(), ConfigError, r"shard_count must be at most 256"),
    # -- hostile files (issue 14): CRC-valid content armdb never writes ------------------------------
    R("t2_log_row_names_a_path_outside", lambda w: armdb.Db.open(w.path), CorruptionError, r"not a valid collection name",
      prep=close_and(lambda w: log_rows(w, [["F", "../../x", 0, 0, 5, 1, b""]])), check=False),
    R("t2_log_row_names_an_absolute_path", lambda w: armdb.Db.open(w.path), CorruptionError, r"not a valid collection name",
      prep=close_and(lambda w: log_rows(w, [["F", "/abs/path", 0, 0, 5, 1, b""]])), check=False),
    R("t2_log_slot_far_past_the_file", lambda w: armdb.Db.open(w.path), CorruptionError, r"slot 2147483648",
      prep=close_and(lambda w: log_rows(w, [["F", "pings", 0, 2**31, 5, 1, b""]])), check=False),
    R("t2_log_row_shard_out_of_range", lambda w: armdb.Db.open(w.path), CorruptionError, r"names shard 7",
      prep=close_and(lambda w: log_rows(w, [["F", "pings", 7, 0, 5, 1, b""]])), check=False),
    R("d5_queue_meta_shard_count_zero", lambda w: w.db.open_queue(SpareQ, cfg()), FormatError, r"shard",
      prep=lambda w: rewrite_spare_meta(w, shard_count=0), check=False),
    R("d5_queue_meta_shard_count_2000", lambda w: w.db.open_queue(SpareQ, cfg()), FormatError, r"shard",
      prep=lambda w: rewrite_spare_meta(w, shard_count=2000), check=False),
    R("s8_compaction_marker_names_the_active_file", lambda w: w.db.open_map("plainmap"), CorruptionError, r"compaction",
      prep=forge_marker, check=False),
    R("t5_map_record_gsn_at_the_top", lambda w: w.db.open_map("plainmap"), CorruptionError, r"gsn",
      prep=lambda w: append_plainmap_record(w, (1 << 60) - 1), check=False),
    # -- replication (R1, R2): a follower's bad inputs ------------------------------------------------
    R("r1_follow_a_database_of_its_own", lambda w: armdb.Db.follow(w.path, primary=("127.0.0.1", 9)), ReplicationError,
      r"is a database of its own, not a follower"),
    R("r1_follow_a_primary_of_another_database", lambda w: follow_then(w, follower_dir(w, b"F" * 16), fake_primary(w)),
      ReplicaMismatch, r"another database than the one"),
    R("r1_follow_a_primary_of_another_version",
      lambda w: follow_then(w, w.path.parent / "newf", fake_primary(w, version=REPL_VERSION + 1)),
      ReplicationFrameError, r"replication version"),
    R("r2_write_to_a_followers_reader",
      lambda w: follow_then(w, follower_dir(w, b"P" * 16, with_db=True), fake_primary(w), lambda r: r.tx()),
      ReadOnly, r"read-only view of the follower .* promote the follower first"),
]

#: Error classes no bad *input* can cause (raised by storage faults and interrupted commits);
#: harnesses (c) and (a2) cover them.
# ServerGone: a client finding no serving owner; tests/test_server.py and
# tests/test_processes.py cause it (no server, a closed Db, a killed owner).
NOT_FROM_BAD_INPUT = {"ArmdbError", "TxFailedAfterLog", "ServerGone"}


@pytest.fixture(scope="module", autouse=True)
def _no_sync_fs() -> Any:
    """fsync and msync are no-ops here (they change no outcome of a refused call) so that
    the per-row world costs milliseconds, not disk flushes on a busy CI machine."""
    with _fs.use(TrackingFS()):
        yield


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "db"
    TEMPLATE["old"] = build_template(path)
    TEMPLATE["clock_ms"] = FakeClock().ms
    return path


def _hash_state(w: World) -> Any:
    return w.state()


def uses_world(row: R) -> bool:
    """Whether the row's call touches the world (builder and declaration rows do not)."""
    if row.prep is not None:
        return True
    return any(i.opname.startswith("LOAD_") and i.argval == "w" for i in dis.get_instructions(row.call))


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_h_bad_input_row(row: R, template: Path, tmp_path: Path) -> None:
    RUN["rows"] += 1
    if not uses_world(row):  # a pure builder / declaration call: no database involved
        RUN["pure_rows"] += 1
        with pytest.raises(row.exc, match=row.match) as ei:
            row.call(None)  # type: ignore[arg-type]
        assert type(ei.value) is row.exc, f"raised {type(ei.value).__name__}, a subclass, not {row.exc.__name__}"
        RUN["rows_passed"] += 1
        RUN["class:" + row.exc.__name__] += 1
        return
    path = tmp_path / "db"
    shutil.copytree(template, path)
    w = open_world(path)
    try:
        if row.prep is not None:
            row.prep(w)
        state = _hash_state(w)
        before = file_hashes(path)
        with pytest.raises(row.exc, match=row.match) as ei:
            row.call(w)
        assert type(ei.value) is row.exc, f"raised {type(ei.value).__name__}, a subclass, not {row.exc.__name__}"
        after = file_hashes(path)
        diff = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        now_state = _hash_state(w)
        if diff or now_state != state:
            RUN["state_changes"] += 1
        assert diff == [], f"the refused call changed stored files: {diff}"
        assert now_state == state, "the refused call changed the queues or maps"
    finally:
        w.close()
    if row.check:
        report_ = armdb.check(path)
        assert report_.ok, str(report_)
    RUN["rows_passed"] += 1
    RUN["class:" + row.exc.__name__] += 1


def test_q19_wait_due_timeout_nan_returns_promptly() -> None:
    """A NaN timeout must be refused (ConfigError), not spin or block forever.

    Run in a child so that a hang cannot leave a spinning thread in this process."""
    code = """
import tempfile, armdb, numpy as np
from armdb.errors import ConfigError
db = armdb.Db.open(tempfile.mkdtemp())
q = db.open_queue(armdb.queue("q", payload=np.dtype("<u8")))
try:
    q.wait_due_timeout(float("nan"))
    print("RETURNED")
except ConfigError as e:
    print("CONFIGERROR", e)
db.close()
"""
    RUN["rows"] += 1
    try:
        r = run_child(code, env=child_env(), timeout=8)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"wait_due_timeout(nan) did not return within 8 s: {type(e).__name__}")
    assert r.stdout.startswith("CONFIGERROR"), r.stdout + r.stderr
    RUN["rows_passed"] += 1
    RUN["class:ConfigError"] += 1


def test_q9_sub_millisecond_lease_timeout_never_hands_a_row_out_twice(tmp_path: Path) -> None:
    """Regression for the rounding of lease_timeout to whole ms: a positive timeout below
    0.5 ms rounds to a deadline equal to now, so the lease is expired at once and the same
    lease() call hands the row out again (Q9, Q28: an unexpired lease is never handed to
    two callers).  Whatever the fix (refuse it, or round up), one call must not return a
    row twice."""
    with armdb.Db.open(tmp_path, clock=FakeClock()) as db:
        q = db.open_queue(armdb.queue("q", payload=np.dtype("<u8")), cfg())
        q.push(1)
        try:
            got = q.lease(3, lease_timeout=0.0004)
        except ConfigError:
            return
        assert [lz.id for lz in got] == [1], f"one lease() call delivered the same row {len(got)} times"
        assert got[0].attempt == 1


def test_h_every_error_class_has_a_row() -> None:
    covered = {r.exc.__name__ for r in ROWS} | {"ConfigError"}
    missing = set(errors.__all__) - covered - NOT_FROM_BAD_INPUT
    assert missing == set(), f"error classes with no bad-input row: {sorted(missing)}"


def test_zz_summary_line(capsys: pytest.CaptureFixture[str]) -> None:
    classes = sorted(k[6:] for k in RUN if k.startswith("class:"))
    failed = RUN["rows"] - RUN["rows_passed"]
    line = (
        f"RELIABILITY h-bad-input rows={RUN['rows']} rows_passed={RUN['rows_passed']} table_rows={len(ROWS)} "
        f"db_rows={RUN['rows'] - RUN['pure_rows']} "
        f"classes={len(classes)}[{','.join(classes)}] state_changes={RUN['state_changes']} violations={failed}"
    )
    with capsys.disabled():
        report_line(line)
    assert len(ROWS) >= 80
