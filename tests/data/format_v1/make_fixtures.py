"""How the golden databases of this folder were made (documentation: never run it here).

The databases beside this script are frozen: a later armdb must still open them, so they
are never regenerated or edited (README.md).  This script is kept to show exactly what
was done to make them; ``tests/test_format_golden.py`` does not run it.  Run it only to
study the process, into a new folder::

    .venv/bin/python tests/data/format_v1/make_fixtures.py /tmp/golden-out

It refuses an output folder that exists.  Every database is built in a child process
with a fixed clock (every persisted time below is ``T0`` plus a known offset), and the
child records, beside the database, what it must hold (``<name>.expected.json``): the
expected contents come from the operations the child performed (a small model of the
queue rules, checked against every lease the library returned), not from reading the
database back.  The parent then joins them into ``expected.json`` with the file
manifest (size and SHA-256 of every file) and the ids each ``db.meta`` holds.

The two ``pending_*`` databases end with a durable transaction whose child dies at the
``txlog.after_sync`` failpoint (SPEC D8, the one tests/test_tx.py uses): the record is
in the log and synced, nothing of it is applied.  The parent proves that from the files
(the record's Bitcask gsns are in no data file, its slot versions are newer than the
slots') before it accepts the database.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import armdb  # noqa: E402
from armdb import Config, Db, FixedConfig, QueueConfig, TxConfig  # noqa: E402

# -- what the test must agree on (tests/test_format_golden.py repeats these) -------------

T0 = 1_700_000_000_000  # 2023-11-14T22:13:20Z: every persisted time is T0 + an offset
TEST_NOW = T0 + 600_000  # the clock the test opens with (10 minutes after T0)


def _test_key(label: str) -> bytes:
    return hashlib.sha256(b"armdb format_v1 golden fixture test key: " + label.encode()).digest()


LOG_KEY = _test_key("log")  # the transaction log key of encrypted/ and pending_sealed/
PAYLOAD_KEY = _test_key("secret_jobs.payload")  # encrypted/: the var queue's bodies
SECRET_MAP_KEY = _test_key("secret_map")  # encrypted/: the map
VAULT_KEY = _test_key("vault")  # pending_sealed/: the map

FIXED_DTYPE = np.dtype([("doc", "<u8"), ("prio", "<i2"), ("score", "<f8"), ("tag", "S6")])
OUTBOX_DTYPE = np.dtype([("order", "<u8"), ("cents", "<i8")])
NOTICE_DTYPE = np.dtype([("code", "<u4"), ("level", "u1")])


@dataclass
class Job:
    doc_id: int
    reason: str
    meta: dict


@dataclass
class Invoice:
    customer: str
    amount_cents: int
    memo: bytes


FIXED_JOBS = armdb.queue("fixed_jobs", payload=FIXED_DTYPE)
VAR_JOBS = armdb.queue("var_jobs", payload=Job, var=True)
DICT_JOBS = armdb.queue("dict_jobs", payload=dict, var=True)
SECRET_JOBS = armdb.queue("secret_jobs", payload=Invoice, var=True)
OUTBOX = armdb.queue("outbox", payload=OUTBOX_DTYPE)
TASKS = armdb.queue("tasks", payload=dict, var=True)
NOTICES = armdb.queue("notices", payload=NOTICE_DTYPE)

GROW = 8  # header slots per grow step: the smallest files a handful of rows need


def header(shards: int) -> FixedConfig:
    return FixedConfig.balanced().shard_count(shards).grow_step(GROW).build()


def qconfig(shards: int = 1, payload_key: bytes | None = None, max_attempts: int = 2) -> QueueConfig:
    payload = Config.balanced().shard_count(1)
    if payload_key is not None:
        payload = payload.encryption_key(payload_key)
    return (
        QueueConfig.balanced()
        .max_attempts(max_attempts)
        .backoff_secs([5])
        .lease_timeout(30)
        .header_config(header(shards))
        .payload_config(payload.build())
        .build()
    )


# -- JSON encoding of values (README.md, "expected.json") --------------------------------


def enc(v: Any) -> Any:
    """A value as JSON: bytes as {"$bytes": hex}, a long one-character str as
    {"$repeat": [char, n]}, lists and str-keyed dicts recursively."""
    if isinstance(v, bytes):
        return {"$bytes": v.hex()}
    if isinstance(v, str) and len(v) >= 64 and len(set(v)) == 1:
        return {"$repeat": [v[0], len(v)]}
    if isinstance(v, (list, tuple)):
        return [enc(x) for x in v]
    if isinstance(v, dict):
        assert all(isinstance(k, str) for k in v), v
        return {k: enc(x) for k, x in v.items()}
    assert v is None or isinstance(v, (bool, int, float, str)), v
    return v


class Clock:
    def __init__(self, ms: int) -> None:
        self.ms = ms

    def __call__(self) -> int:
        return self.ms

    def at(self, offset_ms: int) -> None:
        assert T0 + offset_ms >= self.ms, "the fixture clock only moves forward"
        self.ms = T0 + offset_ms


# -- a model of the queue rules (SPEC Q9-Q11, Q14, Q22) ----------------------------------


class QModel:
    """Every row of one queue as the rules say it must be, driven beside the real queue;
    each lease the library returns is compared with the model's."""

    def __init__(self, q: armdb.Queue, clock: Clock, config: QueueConfig, kind: str) -> None:
        self.q, self.clock, self.config, self.kind = q, clock, config, kind
        self.rows: dict[int, dict[str, Any]] = {}
        self.tokens: dict[int, Any] = {}
        self.acked: list[int] = []

    def push(self, payload: Any, delay_s: int = 0) -> int:
        seq = self.q.push(payload, delay=delay_s or None)
        self.add_push(seq, payload, delay_s)
        return seq

    def add_push(self, seq: int, payload: Any, delay_s: int = 0, now: int | None = None) -> None:
        now = self.clock.ms if now is None else now
        assert seq not in self.rows
        self.rows[seq] = dict(id=seq, state="READY", flags=0, attempts=0, epoch=0, due=now + delay_s * 1000,
                              deadline=0, pushed=now, payload=payload)

    def lease(self, n: int = 1, timeout_s: float | None = None) -> list[int]:
        now = self.clock.ms
        lease_ms = round((self.config.lease_timeout if timeout_s is None else timeout_s) * 1000)
        got = self.q.lease(n, lease_timeout=timeout_s)
        want: list[int] = []
        for r in sorted(self.rows.values(), key=lambda r: (r["due"], r["id"])):
            if len(want) == n:
                break
            ready = r["state"] == "READY" and r["due"] <= now
            expired = r["state"] == "LEASED" and r["deadline"] <= now
            if not (ready or expired):
                continue
            if expired and r["attempts"] >= self.config.max_attempts:
                r.update(state="DEAD", due=now)  # dead-lettered by the lease scan, flags unchanged
                continue
            r.update(state="LEASED", attempts=r["attempts"] + 1, epoch=r["epoch"] + 1,
                     deadline=now + lease_ms)
            want.append(r["id"])
        assert [lz.id for lz in got] == want, ([lz.id for lz in got], want)
        for lz in got:
            r = self.rows[lz.id]
            assert lz.attempt == r["attempts"]
            assert payload_eq(lz.payload, r["payload"], self.kind), (lz.payload, r["payload"])
            self.tokens[lz.id] = lz.token
        return want

    def ack(self, seq: int) -> None:
        self.q.ack(self.tokens.pop(seq))
        self.model_ack(seq)

    def model_ack(self, seq: int) -> None:
        assert self.rows[seq]["state"] == "LEASED"
        del self.rows[seq]
        self.acked.append(seq)

    def nack(self, seq: int, delay_s: int | None = None, dead: bool = False) -> None:
        self.q.nack(self.tokens.pop(seq), delay=delay_s, dead=dead)
        self.model_nack(seq, delay_s, dead)

    def model_nack(self, seq: int, delay_s: int | None = None, dead: bool = False) -> None:
        now = self.clock.ms
        r = self.rows[seq]
        assert r["state"] == "LEASED"
        if dead or r["attempts"] >= self.config.max_attempts:
            r.update(state="DEAD", due=now, flags=r["flags"] | (1 if dead else 0))
        else:
            backoff = round(self.config.backoff_for(r["attempts"]) * 1000)
            wait = delay_s * 1000 if delay_s is not None else backoff
            r.update(state="READY", due=now + wait)

    def expected(self, spec: armdb.QueueSpec) -> dict[str, Any]:
        rows = []
        for r in sorted(self.rows.values(), key=lambda r: r["id"]):
            out = dict(r)
            out["payload"] = payload_json(r["payload"], self.kind)
            if self.kind == "fixed":
                out["payload_hex"] = np.array(r["payload"], dtype=spec.dtype).tobytes().hex()
            rows.append(out)
        return {
            "kind": self.kind,
            "fingerprint": spec.fingerprint,
            "config": config_json(self.config),
            "rows": rows,
            "acked_ids": sorted(self.acked),
            "len": sum(r["state"] != "DEAD" for r in self.rows.values()),
            "dead_len": sum(r["state"] == "DEAD" for r in self.rows.values()),
        }


def payload_eq(got: Any, want: Any, kind: str) -> bool:
    if kind == "fixed":
        return bytes(np.asarray(got).tobytes()) == np.array(want, dtype=np.asarray(got).dtype).tobytes()
    return got == want


def payload_json(p: Any, kind: str) -> Any:
    if kind == "fixed":
        return list(enc(list(p)))
    if dataclasses.is_dataclass(p):
        return {"class": type(p).__name__, "fields": enc(dataclasses.asdict(p))}
    return enc(p)


def config_json(c: QueueConfig) -> dict[str, Any]:
    h, p = c.header_config, c.payload_config
    return {
        "max_attempts": c.max_attempts,
        "backoff_secs": list(c.backoff_secs),
        "lease_timeout": c.lease_timeout,
        "header_shard_count": h.shard_count,
        "header_grow_step": h.grow_step,
        "payload_shard_count": p.shard_count,
        "payload_encrypted": p.encryption_key is not None,
    }


class MapModel:
    def __init__(self, m: armdb.Map, config: Config) -> None:
        self.m, self.config = m, config
        self.items: dict[Any, Any] = {}
        self.deleted: list[Any] = []

    def put(self, k: Any, v: Any) -> None:
        self.m.put(k, v)
        self.items[(type(k).__name__, k)] = v

    def delete(self, k: Any) -> None:
        assert self.m.delete(k)
        self.model_delete(k)

    def model_delete(self, k: Any) -> None:
        del self.items[(type(k).__name__, k)]
        self.deleted.append(k)

    def expected(self) -> dict[str, Any]:
        items = [[enc(k), enc(v)] for (_t, k), v in self.items.items()]
        return {
            "shard_count": self.config.shard_count,
            "max_file_size": self.config.max_file_size,
            "encrypted": self.config.encryption_key is not None,
            "items": items,
            "deleted_keys": [enc(k) for k in self.deleted],
            "len": len(self.items),
        }


# -- the databases -------------------------------------------------------------------------


def build_queues(path: str) -> dict[str, Any]:
    """queues/: a fixed queue (two shards), a dataclass var queue, a dict var queue, and two
    maps (one rotated past its file size, with hint files), no key anywhere."""
    clock = Clock(T0)
    fcfg, vcfg = qconfig(shards=2), qconfig()
    dcfg = qconfig(max_attempts=3)
    plain_cfg = Config.balanced().shard_count(2).build()
    rot_cfg = Config.balanced().shard_count(1).max_file_size(64 * 1024).build()
    out: dict[str, Any] = {"queues": {}, "maps": {}}
    with Db.open(path, clock=clock) as db:
        fq = QModel(db.open_queue(FIXED_JOBS, fcfg), clock, fcfg, "fixed")
        a = fq.push((1, -1, 0.5, b"ack"))
        assert fq.lease() == [a]
        fq.ack(a)  # acked: its slot is a deleted tombstone
        clock.at(1_000)
        b = fq.push((7, 3, 1.25, b"dead"))
        fq.lease()
        fq.nack(b, dead=True)  # dead, explicitly (flag bit 0)
        clock.at(2_000)
        c = fq.push((8, 0, -2.0, b"max"))
        fq.lease()
        fq.nack(c)  # ready again at +5 s, attempts 1
        clock.at(7_000)
        assert fq.lease() == [c]
        fq.nack(c)  # attempts 2 = max_attempts: dead by max_attempts (no flag)
        clock.at(8_000)
        d = fq.push((9, 1, 1e-3, b"expire"))
        assert fq.lease(timeout_s=1) == [d]
        clock.at(10_000)
        assert fq.lease(timeout_s=1) == [d]  # its lease expired: delivered again, attempts 2
        clock.at(12_000)
        assert fq.lease() == []  # expired again at max_attempts: the lease scan dead-letters it
        clock.at(13_000)
        f = fq.push((4, 2, 4.0, b"long"))
        assert fq.lease(timeout_s=86_400) == [f]  # leased, deadline a day later
        clock.at(14_000)
        g = fq.push((5, -3, 5.5, b"short"))
        assert fq.lease() == [g]  # leased for 30 s: expired at TEST_NOW
        clock.at(15_000)
        e = fq.push((3, 7, 3.0, b"re\x00try"))
        assert fq.lease() == [e]
        fq.nack(e)  # ready again (due at +5 s), attempts 1
        clock.at(16_000)
        j = fq.push((10, 0, 10.0, b"later"))
        assert fq.lease() == [j]
        fq.nack(j, delay_s=7_200)  # ready again in two hours: delayed at TEST_NOW
        clock.at(17_000)
        fq.push((2, 32767, 2.0, b"ready"))  # ready, never leased
        clock.at(18_000)
        fq.push((6, -32768, 6.0, b"delay"), delay_s=3_600)  # delayed by an hour
        out["queues"]["fixed_jobs"] = fq.expected(FIXED_JOBS)

        clock.at(20_000)
        vq = QModel(db.open_queue(VAR_JOBS, vcfg), clock, vcfg, "var")
        a = vq.push(Job(1, "acked", {}))
        vq.lease()
        vq.ack(a)  # header and body deleted in one log commit (Q14)
        clock.at(21_000)
        b = vq.push(Job(2, "dead-explicit", {"why": "bad input"}))
        vq.lease()
        vq.nack(b, dead=True)
        clock.at(22_000)
        c = vq.push(Job(3, "dead-max", {"tries": [1, 2]}))
        vq.lease()
        vq.nack(c)
        clock.at(27_000)
        assert vq.lease() == [c]
        vq.nack(c)  # dead by max_attempts
        clock.at(28_000)
        g = vq.push(Job(7, "expired", {"k": "v"}))
        assert vq.lease(timeout_s=1) == [g]
        clock.at(30_000)
        assert vq.lease(timeout_s=1) == [g]
        clock.at(32_000)
        assert vq.lease() == []  # dead-lettered by the lease scan at max_attempts
        clock.at(33_000)
        d = vq.push(Job(4, "leased", {"n": None, "f": 0.25}))
        assert vq.lease(timeout_s=86_400) == [d]
        clock.at(34_000)
        vq.push(Job(5, "ready", {"bytes": b"\x00\xff", "nested": {"list": [True, False]}}))
        clock.at(35_000)
        vq.push(Job(6, "delayed", {}), delay_s=3_600)
        out["queues"]["var_jobs"] = vq.expected(VAR_JOBS)

        clock.at(40_000)
        dq = QModel(db.open_queue(DICT_JOBS, dcfg), clock, dcfg, "var")
        p1 = dq.push({"k": "v1"})
        dq.lease()
        dq.nack(p1, dead=True)
        clock.at(41_000)
        p2 = dq.push({"k": "v2", "n": [1, 2, 3]})
        dq.lease()
        dq.ack(p2)
        clock.at(42_000)
        dq.push({"nested": {"a": [1, {"b": b"x"}]}, "float": -0.5, "big": 2**64 - 1})
        out["queues"]["dict_jobs"] = dq.expected(DICT_JOBS)

        clock.at(50_000)
        m = MapModel(db.open_map("plain_map", plain_cfg), plain_cfg)
        m.put(b"raw-bytes", b"\x00\x01\x02")
        m.put("str", "h\u00e9llo \u2713")
        m.put(0, 0)
        m.put(-1, -1.5)
        m.put(2**70, [1, "two", 3.0])
        m.put(-(2**63), {"nested": {"list": [True, False, None]}})
        m.put("none", None)
        m.put("max-u64", 2**64 - 1)
        m.put("min-i64", -(2**63))
        m.put("", b"")
        m.put(b"", "")
        m.put("overwritten", "v1")
        m.put("overwritten", "v2")
        m.put("deleted", "gone")
        m.delete("deleted")
        m.put("deleted-in-tx", "gone too")
        db.tx().put(m.m, "tx-key", {"tx": 1}).delete(m.m, "deleted-in-tx").commit()
        m.items[("str", "tx-key")] = {"tx": 1}
        m.model_delete("deleted-in-tx")
        out["maps"]["plain_map"] = m.expected()

        clock.at(51_000)
        r = MapModel(db.open_map("rotated_map", rot_cfg), rot_cfg)
        # ~2.5 kB records in 64 KiB files: three rounds of overwrites rotate the active
        # file and let compaction rewrite the first files (hint files, a compaction output).
        for rnd, keys in enumerate((range(24), range(12), range(6), range(24, 30), range(30, 34))):
            for i in keys:
                r.put(f"k{i:02d}", {"i": i, "round": rnd, "pad": "p" * 2_500})
        r.delete("k23")
        out["maps"]["rotated_map"] = r.expected()
    return out


def build_encrypted(path: str) -> dict[str, Any]:
    """encrypted/: a var queue with encrypted bodies and an encrypted map, with a log key."""
    clock = Clock(T0 + 60_000)
    cfg = qconfig(payload_key=PAYLOAD_KEY)
    map_cfg = Config.balanced().shard_count(1).encryption_key(SECRET_MAP_KEY).build()
    out: dict[str, Any] = {"queues": {}, "maps": {}}
    with Db.open(path, clock=clock, tx_config=TxConfig(log_encryption_key=LOG_KEY)) as db:
        q = QModel(db.open_queue(SECRET_JOBS, cfg), clock, cfg, "var")
        a = q.push(Invoice("ACME", 12_500, b"paid"))
        q.lease()
        q.ack(a)
        clock.at(61_000)
        b = q.push(Invoice("Initech", 9_900, b"\x00"))
        q.lease()
        q.nack(b, dead=True)
        clock.at(62_000)
        c = q.push(Invoice("Globex", 100, b""))
        q.lease()
        q.nack(c)
        clock.at(67_000)
        assert q.lease() == [c]
        q.nack(c)  # dead by max_attempts
        clock.at(68_000)
        d = q.push(Invoice("Hooli", 4_200, b"lease"))
        assert q.lease(timeout_s=86_400) == [d]
        clock.at(69_000)
        e = q.push(Invoice("Umbrella", 1, b"short"))
        assert q.lease() == [e]  # leased for 30 s: expired at TEST_NOW
        clock.at(70_000)
        q.push(Invoice("Stark", 2, b"ready"))
        clock.at(71_000)
        q.push(Invoice("Wayne", 3, b"later"), delay_s=3_600)
        out["queues"]["secret_jobs"] = q.expected(SECRET_JOBS)

        clock.at(72_000)
        m = MapModel(db.open_map("secret_map", map_cfg), map_cfg)
        m.put("service-a", "s3cr3t")
        m.put(42, {"token": b"\x01\x02"})
        m.put(b"k", [1, 2])
        m.put("service-a", "rotated")
        m.put("gone", "x")
        db.tx().put(m.m, "service-b", "hunter2").delete(m.m, "gone").commit()
        m.items[("str", "service-b")] = "hunter2"
        m.model_delete("gone")
        out["maps"]["secret_map"] = m.expected()
    return out


def build_pending_tx(path: str, expected_path: str) -> None:
    """pending_tx/: the last, durable commit is in the log and synced but not applied."""
    clock = Clock(T0 + 80_000)
    ocfg, tcfg = qconfig(), qconfig(max_attempts=3)
    lcfg = Config.balanced().shard_count(1).build()
    db = Db.open(path, clock=clock)
    outbox = QModel(db.open_queue(OUTBOX, ocfg), clock, ocfg, "fixed")
    tasks = QModel(db.open_queue(TASKS, tcfg), clock, tcfg, "var")
    ledger = MapModel(db.open_map("ledger", lcfg), lcfg)
    ledger.put("old", "to be deleted")
    ledger.put("balance", 100)
    for order, cents in ((1, 500), (2, 700)):  # logged commits, applied
        clock.at(80_000 + order * 1_000)
        tx = db.tx().put(ledger.m, f"order-{order}", {"cents": cents}).push(outbox.q, (order, cents))
        (seq,) = tx.commit()
        ledger.items[("str", f"order-{order}")] = {"cents": cents}
        outbox.add_push(seq, (order, cents))
    clock.at(83_000)
    t1 = tasks.push({"task": "email", "to": "a@example.com"})
    tasks.push({"task": "sms"})
    clock.at(84_000)
    (o1,) = outbox.lease()
    assert tasks.lease() == [t1]
    clock.at(85_000)
    tx = (
        db.tx()
        .put(ledger.m, "order-3", {"cents": 900})
        .put(ledger.m, "balance", 2_100)
        .delete(ledger.m, "old")
        .push(outbox.q, (3, 900))
        .ack(outbox.q, outbox.tokens[o1])
        .nack(tasks.q, tasks.tokens[t1], delay=60)
        .push(tasks.q, {"task": "audit", "order": 3})
        .durable()
    )
    # What the commit will leave once replayed.  Its push ids are drawn at commit; they
    # are the next ids of each queue (no other id is drawn in between).
    ledger.items[("str", "order-3")] = {"cents": 900}
    ledger.items[("str", "balance")] = 2_100
    ledger.model_delete("old")
    outbox.add_push(max(outbox.rows) + 1, (3, 900))
    outbox.model_ack(o1)
    tasks.model_nack(t1, delay_s=60)
    tasks.add_push(max(tasks.rows) + 1, {"task": "audit", "order": 3})
    write_json(expected_path, {
        "queues": {"outbox": outbox.expected(OUTBOX), "tasks": tasks.expected(TASKS)},
        "maps": {"ledger": ledger.expected()},
        "pending_commit_ms": clock.ms,
    })
    tx.commit()  # ARMDB_FAILPOINT=txlog.after_sync ends the process here: logged, synced, not applied
    raise SystemExit("the failpoint did not fire")


def build_pending_sealed(path: str, expected_path: str) -> None:
    """pending_sealed/: as pending_tx/, with a log key: the unapplied record is sealed, and
    it writes an encrypted map whose rows wait until the map is opened with its key."""
    clock = Clock(T0 + 90_000)
    ncfg = qconfig()
    vcfg = Config.balanced().shard_count(1).encryption_key(VAULT_KEY).build()
    acfg = Config.balanced().shard_count(1).build()
    db = Db.open(path, clock=clock, tx_config=TxConfig(log_encryption_key=LOG_KEY))
    notices = QModel(db.open_queue(NOTICES, ncfg), clock, ncfg, "fixed")
    vault = MapModel(db.open_map("vault", vcfg), vcfg)
    audit = MapModel(db.open_map("audit", acfg), acfg)
    vault.put("api", "old-token")
    vault.put("stale", "x")
    audit.put(1, "created")
    clock.at(91_000)
    tx = db.tx().put(vault.m, "db-password", "pa55").push(notices.q, (1, 0)).put(audit.m, 2, "rotated")
    (n1,) = tx.commit()
    vault.items[("str", "db-password")] = "pa55"
    audit.items[("int", 2)] = "rotated"
    notices.add_push(n1, (1, 0))
    clock.at(92_000)
    tx = (
        db.tx()
        .put(vault.m, "api", "new-token")
        .delete(vault.m, "stale")
        .put(audit.m, 3, "rotated again")
        .push(notices.q, (2, 3))
        .durable()
    )
    vault.items[("str", "api")] = "new-token"
    vault.model_delete("stale")
    audit.items[("int", 3)] = "rotated again"
    notices.add_push(n1 + 1, (2, 3))
    write_json(expected_path, {
        "queues": {"notices": notices.expected(NOTICES)},
        "maps": {"vault": vault.expected(), "audit": audit.expected()},
        "pending_commit_ms": clock.ms,
    })
    tx.commit()  # ARMDB_FAILPOINT=txlog.after_sync ends the process here
    raise SystemExit("the failpoint did not fire")


# -- proving the pending record is not applied ---------------------------------------------


def log_records(db: Path, log_key: bytes | None) -> list[dict[str, Any]]:
    """Every record of the database's log files, with its rows (unsealed with ``log_key``)."""
    import msgpack

    from armdb import txlog
    from armdb._crypto import Sealer
    from armdb.db import check_meta

    meta = check_meta((db / "db.meta").read_bytes(), "db.meta")
    out = []
    for f in sorted((db / "txlog").glob("*.log")):
        raw = f.read_bytes()
        _number, version = txlog._file_header_fields(raw, str(f))
        recs, end, bad = txlog.parse_records(raw, txlog.FILE_HEADER_SIZE)
        assert bad is None and end == len(raw), f"{f}: the log must end with whole records"
        for txid, flags, body in recs:
            if flags & txlog.FLAG_SEALED:
                assert log_key is not None
                body = Sealer(log_key).open(body, txlog.record_aad(version, meta.db_id, txid))
            out.append({"file": f.name, "version": version, "txid": txid, "flags": flags,
                        "rows": msgpack.unpackb(body, raw=False)})
    return out


def bitcask_gsns(collection: Path) -> set[int]:
    """The gsn of every record in every data file of a Bitcask collection (docs/format.md)."""
    gsns = set()
    for f in sorted(collection.glob("shard-*/*.data")):
        raw = f.read_bytes()
        pos = 32
        while pos < len(raw):
            word, _crc, vlen, magic, klen = struct.unpack_from("<QIIHH", raw, pos)
            assert magic == 0xB17C, f"{f}: no record at {pos}"
            gsns.add(word & ((1 << 60) - 1))
            size = 20 + klen + vlen
            pos += size + (-size % 8)
        assert pos == len(raw)
    return gsns


def slot_meta(db: Path, queue: str, shard: int, slot: int) -> int:
    """The meta word (version << 2 | status) of one slot of a queue's ``fixed.data``."""
    raw = (db / "collections" / queue / f"shard-{shard:03d}" / "fixed.data").read_bytes()
    slot_size = struct.unpack_from("<I", raw, 12)[0]
    off = 4096 + slot * slot_size
    if off >= len(raw):
        return 0
    return struct.unpack_from("<I", raw, off)[0]


def prove_unapplied(db: Path, log_key: bytes | None) -> dict[str, Any]:
    """The last log record is synced and none of its rows is in a store; the records before
    it are applied.  Returns what the README and the test state about the log."""
    recs = log_records(db, log_key)
    assert recs, "no log record"
    last = recs[-1]
    for row in last["rows"]:
        if row[0] == "B":
            _, coll, _key, _value, gsn = row
            assert gsn not in bitcask_gsns(db / "collections" / coll), (coll, gsn)
        else:
            _, coll, shard, slot, version, _status, _body = row
            meta = slot_meta(db, coll, shard, slot)
            assert meta >> 2 != version, (coll, slot, meta, version)  # the slot holds an older image
            assert (version - (meta >> 2)) % (1 << 30) < (1 << 29), "the logged image is the newer one"
    for rec in recs[:-1]:  # applied before the crash
        for row in rec["rows"]:
            if row[0] == "B":
                assert row[4] in bitcask_gsns(db / "collections" / row[1]), row[:2]
    mark = (db / "txlog" / "synced.mark")
    assert mark.exists()
    return {
        "log_files": sorted({r["file"] for r in recs}),
        "records": len(recs),
        "unapplied_txid": last["txid"],
        "unapplied_sealed": bool(last["flags"] & 1),
        "unapplied_rows": [[r[0], r[1]] for r in last["rows"]],
    }


# -- driver ---------------------------------------------------------------------------------

BUILDERS = {"queues": build_queues, "encrypted": build_encrypted}
PENDING = {"pending_tx": (build_pending_tx, None), "pending_sealed": (build_pending_sealed, LOG_KEY)}


def write_json(path: str, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")


def child(name: str, path: str, expected_path: str) -> None:
    if name in BUILDERS:
        write_json(expected_path, BUILDERS[name](path))
    else:
        PENDING[name][0](path, expected_path)


def manifest(folder: Path) -> dict[str, Any]:
    files = {}
    for p in sorted(folder.rglob("*")):
        if p.is_dir():
            assert any(p.iterdir()), f"{p}: git keeps no empty folder"
            continue
        raw = p.read_bytes()
        rel = p.relative_to(folder).as_posix()
        files[rel] = {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    return files


def main(out: Path) -> None:
    if out.exists():
        raise SystemExit(f"{out} exists; give a new folder (the committed fixtures are never regenerated)")
    git = ["git", "-C", str(ROOT)]
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--", "armdb", "setup.py", "pyproject.toml", __file__],
                           capture_output=True, text=True, check=True).stdout
    if dirty:  # the commit recorded in expected.json must be the code that made the files
        raise SystemExit(f"commit these changes first:\n{dirty}")
    out.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("ARMDB_FAILPOINT", None)
    import importlib

    from armdb.db import check_meta

    bitcask, dbmod, fixed, queue, seqmap, txlog = (
        importlib.import_module(f"armdb.{m}") for m in ("bitcask", "db", "fixed", "queue", "seqmap", "txlog")
    )

    expected: dict[str, Any] = {
        "made_by": {
            "armdb_commit": commit,
            "armdb_version": armdb.__version__,
            "numpy_version": np.__version__,
            "msgpack_version": __import__("msgpack").version,
            "python": sys.version.split()[0],
        },
        "format_versions": {
            "db.meta": dbmod.FORMAT_VERSION,
            "seqmap": seqmap.FORMAT_VERSION,
            "queue.meta": queue.META_VERSION,
            "fixed.data": fixed.FORMAT_VERSION,
            "fixed.redo": fixed.FORMAT_VERSION,
            "txlog": txlog.FORMAT_VERSION,
            "bitcask.data": bitcask.DATA_VERSION,
            "bitcask.meta_hint_pending": bitcask.FORMAT_VERSION,
        },
        "t0_ms": T0,
        "test_now_ms": TEST_NOW,
        "keys": {"log": LOG_KEY.hex(), "secret_jobs.payload": PAYLOAD_KEY.hex(),
                 "secret_map": SECRET_MAP_KEY.hex(), "vault": VAULT_KEY.hex()},
        "databases": {},
    }
    for name in [*BUILDERS, *PENDING]:
        path = out / name
        exp_path = out / f"{name}.expected.json"
        cenv = dict(env)
        if name in PENDING:
            cenv["ARMDB_FAILPOINT"] = "txlog.after_sync"
        r = subprocess.run([sys.executable, __file__, "--child", name, str(path), str(exp_path)], env=cenv,
                           capture_output=True, text=True)
        code = 86 if name in PENDING else 0
        if r.returncode != code:
            raise SystemExit(f"{name}: child exited {r.returncode}, expected {code}:\n{r.stdout}\n{r.stderr}")
        entry = json.loads(exp_path.read_text())
        exp_path.unlink()
        if name in PENDING:
            entry["log"] = prove_unapplied(path, PENDING[name][1])
        meta = check_meta((path / "db.meta").read_bytes(), "db.meta")
        entry["db_id"] = meta.db_id.hex()
        entry["log_key_check"] = bool(meta.log_key_check)
        entry["seqmap"] = seqmap.decode((path / "seqmap").read_bytes(), "seqmap")
        entry["files"] = manifest(path)
        expected["databases"][name] = entry
    write_json(str(out / "expected.json"), expected)
    total = sum(f["size"] for d in expected["databases"].values() for f in d["files"].values())
    count = sum(len(d["files"]) for d in expected["databases"].values())
    print(f"wrote {out}: {total:,} bytes in {count} files")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4])
    elif len(sys.argv) == 2:
        main(Path(sys.argv[1]).resolve())
    else:
        raise SystemExit(__doc__)
