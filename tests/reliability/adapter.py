"""The only place that maps the harness verbs to the armdb API (docs/reliability.md, Shared pieces).

Harness verbs: open a database in a *profile* (encryption on/off, durable on/off,
shard count, file sizes), push a job, lease, ack, nack, run the outbox transaction,
take a snapshot of every row with its decoded job number, read the effects map,
rebuild a token as a fresh process would hold it, collect orphan counts, run
``armdb.check``.  When the SPEC renames a call, only this file changes.

A few verbs read private state (``peek`` reads a row's stored payload, including a
dead row's, which no public call returns; ``disk_rows`` counts occupied header slots
in the files).  They are marked and used only by the checkers.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np

import armdb
from armdb import Config, FixedConfig, QueueConfig, StaleToken, TxConfig
from armdb.queue import LeaseToken

from .journal import FIXED_PAYLOAD, make_payload, parse_payload

PAYLOAD_KEY = bytes(range(32))  # payload and effects collections
LOG_KEY = bytes(range(32, 64))  # transaction log

FIXED_DTYPE = np.dtype([("raw", f"V{FIXED_PAYLOAD}")])
FIXED_SPEC = armdb.queue("rq_fixed", payload=FIXED_DTYPE)
VAR_SPEC = armdb.queue("rq_var", payload=bytes, var=True)
EFFECTS = "effects"
KV = "kv"
QUEUE_KINDS = ("f", "v")

READY, LEASED, DEAD = int(armdb.State.READY), int(armdb.State.LEASED), int(armdb.State.DEAD)


@dataclass(frozen=True)
class Profile:
    """How a harness database is configured.  Serialisable to JSON for the children."""

    enc: bool = False
    durable: bool = False
    shards: int = 1
    grow_step: int = 64
    max_file_size: int = 64 * 1024
    compaction_threshold: float = 0.2
    max_attempts: int = 4
    backoff: tuple[float, ...] = (0.005, 0.02)
    lease_timeout: float = 0.25
    dead_retention: float | None = None
    sync_interval: float = 0.05
    # Small, so that harness runs cross it and checkpoint mid-run (a 4 MiB log never filled
    # in a harness run, which hid a checkpoint deadlock until 2026-12-03).
    checkpoint_bytes: int = 64 * 1024

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @staticmethod
    def from_json(raw: str) -> Profile:
        d = json.loads(raw)
        d["backoff"] = tuple(d["backoff"])
        return Profile(**d)

    def label(self) -> str:
        return f"{'enc' if self.enc else 'plain'}-{'durable' if self.durable else 'default'}-s{self.shards}"


# -- opening ------------------------------------------------------------------------------------------


def tx_config(p: Profile) -> TxConfig:
    return TxConfig(durable=p.durable, log_encryption_key=LOG_KEY if p.enc else None,
                    checkpoint_bytes=p.checkpoint_bytes)


def bitcask_config(p: Profile) -> Config:
    b = (
        Config.balanced()
        .max_file_size(p.max_file_size)
        .compaction_threshold(p.compaction_threshold)
        .sync_interval(p.sync_interval)
    )
    if p.enc:
        b = b.encryption_key(PAYLOAD_KEY)
    return b.build()


def queue_config(p: Profile, var: bool) -> QueueConfig:
    hdr = FixedConfig.balanced().grow_step(p.grow_step).shard_count(p.shards).sync_interval(p.sync_interval).build()
    b = (
        QueueConfig.balanced()
        .max_attempts(p.max_attempts)
        .backoff_secs(list(p.backoff))
        .lease_timeout(p.lease_timeout)
        .header_config(hdr)
    )
    if p.dead_retention is not None:
        b = b.dead_retention(p.dead_retention)
    if var:
        b = b.payload_config(bitcask_config(p))
    return b.build()


def open_db(path: Any, p: Profile, clock: Any = None) -> armdb.Db:
    return armdb.Db.open(path, tx_config=tx_config(p), clock=clock)


def open_queues(db: armdb.Db, p: Profile) -> dict[str, armdb.Queue]:
    return {
        "f": db.open_queue(FIXED_SPEC, queue_config(p, var=False)),
        "v": db.open_queue(VAR_SPEC, queue_config(p, var=True)),
    }


def open_effects(db: armdb.Db, p: Profile) -> Any:
    return db.open_map(EFFECTS, bitcask_config(p))


def open_all(path: Any, p: Profile, clock: Any = None) -> tuple[armdb.Db, dict[str, armdb.Queue], Any]:
    db = open_db(path, p, clock)
    try:
        return db, open_queues(db, p), open_effects(db, p)
    except BaseException:
        db.shutdown()
        raise


def close(db: armdb.Db) -> None:
    db.shutdown()


# -- queue verbs --------------------------------------------------------------------------------------


def job_payload(kind: str, n: int, length: int) -> Any:
    if kind == "f":
        return (make_payload(n, FIXED_PAYLOAD),)
    return make_payload(n, length)


def payload_bytes(kind: str, payload: Any) -> bytes:
    if kind == "f":
        return bytes(payload["raw"].tobytes())
    return bytes(payload)


def push(q: armdb.Queue, kind: str, n: int, length: int) -> int:
    return int(q.push(job_payload(kind, n, length)))


def tx_push(db: armdb.Db, q: armdb.Queue, kind: str, n: int, length: int, durable: bool = False) -> int:
    t = db.tx().push(q, job_payload(kind, n, length))
    if durable:
        t = t.durable()
    return int(t.commit()[0])


@dataclass(frozen=True)
class Leased:
    """One leased row as the harness sees it."""

    id: int
    n: int  # job number parsed from the payload, -1 when the bytes are wrong
    ok: bool  # payload bytes are exactly make_payload(n, ...)
    attempt: int
    epoch: int
    shard: int
    due: int
    deadline_ms: int
    token: Any
    raw: bytes
    handle: int = 0  # the id of the handle that leased it (part of the token)


def lease(q: armdb.Queue, kind: str, k: int, timeout: float | None = None) -> list[Leased]:
    out = []
    for lz in q.lease(k, lease_timeout=timeout):
        raw = payload_bytes(kind, lz.payload)
        n = parse_payload(raw)
        t = lz.token
        out.append(
            Leased(int(lz.id), -1 if n is None else n, n is not None, int(lz.attempt), int(t.epoch), int(t.shard),
                   int(t.due), round(lz.deadline.timestamp() * 1000), t, raw, int(t.handle))
        )
    return out


def ack(q: armdb.Queue, token: Any) -> bool:
    """True when acked, False when refused as stale (nothing changed)."""
    try:
        q.ack(token)
        return True
    except StaleToken:
        return False


def nack(q: armdb.Queue, token: Any, dead: bool, delay: float | None = None) -> bool:
    try:
        q.nack(token, dead=dead, delay=delay)
        return True
    except StaleToken:
        return False


def outbox(db: armdb.Db, effects: Any, q: armdb.Queue, token: Any, n: int, fq: armdb.Queue | None, fkind: str,
           m: int, mlen: int, durable: bool) -> tuple[bool, int]:
    """``db.tx().put(effects, n, digest).ack(q, token)[.push(fq, job m)]``; (committed, id of m)."""
    t = db.tx().put(effects, n, make_payload(n, 40)).ack(q, token)
    if m > 0 and fq is not None:
        t = t.push(fq, job_payload(fkind, m, mlen))
    if durable:
        t = t.durable()
    try:
        ids = t.commit()
    except StaleToken:
        return False, 0
    return True, int(ids[0]) if ids else 0


def open_kv(db: armdb.Db, p: Profile) -> Any:
    """A plain key/value map (the map workload of the failpoint harness)."""
    return db.open_map(KV, bitcask_config(p))


def kv_value(i: int) -> bytes:
    return make_payload(i, 900)


def kv_put(m: Any, key: int, i: int) -> None:
    m.put(key, kv_value(i))


def kv_items(db: armdb.Db, p: Profile) -> dict[int, Any]:
    return {int(k): v for k, v in open_kv(db, p).items()}


def effects_items(effects: Any) -> dict[int, bytes]:
    return {int(k): v for k, v in effects.items()}


def effect_ok(n: int, value: Any) -> bool:
    return value == make_payload(n, 40)


# -- observation (checkers only) ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    id: int
    state: int
    attempts: int
    epoch: int
    n: int  # -1: payload wrong or missing
    ok: bool
    body_missing: bool


def peek(q: armdb.Queue, kind: str) -> list[Row]:
    """Every stored row (live and dead) with the job number read from its stored payload.

    PRIVATE STATE: a dead row's payload is not readable through the public API, so
    this reads the header slots (fixed) or the payload store (var) directly.
    """
    snap = q.snapshot()
    out: list[Row] = []
    slot_of: dict[int, tuple[Any, int]] = {}
    if kind == "f":
        for sh in q._shards:
            with sh.lock:
                for idx in (sh.live, sh.dead):
                    _due, seq, slot, _dl = idx.to_arrays()
                    for s, sl in zip(seq.tolist(), slot.tolist()):
                        slot_of[int(s)] = (sh, int(sl))
    for r in snap:
        rid = int(r["id"])
        missing = False
        raw: bytes | None
        if kind == "f":
            sh, sl = slot_of[rid]
            raw = q._payload_bytes(sh, sl)
        else:
            body = q._payload.get(rid.to_bytes(8, "big"))
            missing = body is None
            raw = None if body is None else payload_bytes(kind, q._codec.decode(body))
        n = parse_payload(raw) if raw is not None else None
        out.append(Row(rid, int(r["state"]), int(r["attempts"]), int(r["epoch"]), -1 if n is None else n,
                       n is not None, missing))
    return out


def counts(q: armdb.Queue) -> tuple[int, int]:
    return q.len(), q.dead_len()


def orphans_collected(q: armdb.Queue) -> int:
    return int(q.stats().orphans_collected)


def repaired_on_open(q: armdb.Queue) -> int:
    return int(q.stats().repaired_on_open)


def token_from_journal(handle: int, shard: int, due: int, seq: int, epoch: int) -> Any:
    """The token a killed process held, rebuilt from its journal (as if it had been pickled).

    Presented to a handle of the new process after the restart, it must be refused
    (Q13: "one from before a reopen raises StaleToken").
    """
    return LeaseToken(handle, shard, due, seq, epoch)


def disk_rows(db_path: Any) -> dict[str, int]:
    """Occupied header slots per queue, read from the closed database's ``fixed.data`` files.

    PRIVATE FORMAT: counts what is on disk, independently of the in-RAM indexes that
    ``len()``/``dead_len()``/``snapshot()`` read, so I5 compares the two.
    """
    from pathlib import Path

    from armdb._core import fixed as kernels
    from armdb.fixed import HEADER_PAGE, OCCUPIED, decode_header

    out: dict[str, int] = {}
    for kind, sp in (("f", FIXED_SPEC), ("v", VAR_SPEC)):
        total = 0
        for f in sorted((Path(db_path) / "collections" / sp.name).glob("shard-*/fixed.data")):
            raw = f.read_bytes()
            slot_size = decode_header(raw[:HEADER_PAGE], str(f))[0]
            n = (len(raw) - HEADER_PAGE) // slot_size
            if n <= 0:
                continue
            slots = np.frombuffer(raw, np.uint8, n * slot_size, HEADER_PAGE).reshape(n, slot_size).copy()
            status = np.zeros(n, np.uint8)
            kernels.validate(slots, np.zeros(n, np.uint32), status)
            total += int((status == OCCUPIED).sum())
        out[kind] = total
    return out


def check(path: Any) -> tuple[bool, list[str]]:
    rep = armdb.check(path)
    return bool(rep.ok), list(rep.findings)


def far_future_clock(days: float = 30.0) -> Any:
    """A clock beyond every lease deadline and backoff the children could have set."""
    from .journal import now_ms

    offset = int(timedelta(days=days).total_seconds() * 1000)
    return lambda: now_ms() + offset
