"""Workloads behind ``python -m armdb bench`` (SPEC C3 and the targets of section 8).

Each :class:`Case` is one system running one workload.  A repeat runs in a fresh
temporary directory; the table shows the median of the repeats, and every ratio
is computed from figures taken in the same run, so the machine's speed cancels out.

Every armdb row runs at the defaults a user gets (``Db.open(path)``,
``db.open_queue(spec)`` with no config, i.e. ``QueueConfig.balanced()``) unless its
system column names other settings: the tuned cycle rows (no fsync, leases of an
hour, a named payload cache) stand beside the default ones, the durable rows name
``sync_interval(0)``, and the transaction rows their shard count.

Durability is matched honestly.  Rows marked "process-crash safe" survive a killed
process but may lose their last writes on power loss: armdb at its defaults (the
stores fsync on a 50 ms timer) or without fsync, SQLite in WAL mode with
``synchronous=NORMAL``, litequeue (which sets the same), localqueue at its default
``DurabilityMode.RELAXED`` (WAL, ``synchronous=NORMAL``; ``DURABLE`` sets ``FULL``).  Rows marked
"power-loss safe" sync every operation: armdb with ``sync_interval(0)`` (each write
msyncs its page), SQLite with ``synchronous=FULL``, persist-queue (``SQLiteAckQueue``,
which commits every call in WAL mode at the default ``FULL``), and a raw
``pwrite`` + ``fdatasync`` of 64 bytes, the physical limit of the disk.

The raw baseline goes through ``armdb._fs.FS`` like every other file access in the
package (the file-system seam); ``RealFS.pwrite`` and ``fdatasync`` are one-line
wrappers over ``os.pwrite`` and ``os.fdatasync``, a fraction of a microsecond
against a sync of a hundred or more.

To add a workload (transactions, once ``db.tx()`` exists): write a function
``(directory, sizes) -> float`` and append :class:`Case` rows to :data:`CASES`; the
first row of a workload with ``reference=True`` is what the ratio column divides by.
"""

from __future__ import annotations

import gc
import importlib
import json
import logging
import multiprocessing
import os
import platform
import sqlite3
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from . import _bench_pg, _bench_repl, _fs
from ._term import ProgressBar
from .client import connect
from .config import QUEUE_GROW_STEP, Config, FixedConfig, QueueConfig
from .db import Db
from .queue import Queue, QueueSpec, queue
from .worker import Worker

log = logging.getLogger("armdb")

__all__ = ["CASES", "FULL", "QUICK", "TINY", "Case", "CaseResult", "Sizes", "main", "run", "run_case"]

# -- sizes -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """How much work one repeat does."""

    cycle_ops: int  # push→lease→ack cycles, no fsync
    durable_ops: int  # durable pushes (one thread)
    durable_cycle_ops: int  # durable cycles
    thread_ops: int  # durable pushes shared by the threads
    threads: int
    outstanding: int  # unexpired leases ahead of the ready rows in lease_scan
    scan_samples: int  # single leases timed per lease_scan repeat
    open_rows: int  # live rows for the cold-open workload
    repeats: int  # of each fast workload
    durable_repeats: int  # of each durable workload (disk timing is noisier)
    warmup: int = 200
    batch_jobs: int = 50_000  # jobs per repeat of a batched cycle (at least 20 batches)
    extend_ops: int = 20_000  # extends per repeat
    serve_ops: int = 5_000  # cycles per repeat through the socket, one job at a time
    cpu_jobs: int = 1_000  # jobs of about 1 ms of pure Python per repeat of worker/cpu-1ms


QUICK = Sizes(cycle_ops=8_000, durable_ops=300, durable_cycle_ops=100, thread_ops=400, threads=8,
              outstanding=10_000, scan_samples=25, open_rows=100_000, repeats=3,
              durable_repeats=5)
FULL = Sizes(cycle_ops=30_000, durable_ops=1_000, durable_cycle_ops=300, thread_ops=2_000, threads=8,
             outstanding=10_000, scan_samples=100, open_rows=1_000_000, repeats=5,
             durable_repeats=7, batch_jobs=200_000, extend_ops=50_000, serve_ops=20_000, cpu_jobs=3_000)
TINY = Sizes(cycle_ops=50, durable_ops=5, durable_cycle_ops=3, thread_ops=16, threads=4,
             outstanding=200, scan_samples=3, open_rows=500, repeats=1,
             durable_repeats=1, warmup=5, batch_jobs=200, extend_ops=50, serve_ops=50, cpu_jobs=20)

# -- durability classes --------------------------------------------------------------------------

NO_SYNC = "process-crash safe"
SYNCED = "power-loss safe"

# -- shared workload pieces ------------------------------------------------------------------------

FixedPing = np.dtype([("doc", "<u8"), ("flags", "<u4")])
BenchFixed = queue("bench_fixed", payload=FixedPing)
BenchVar = queue("bench_var", payload=dict, var=True)
LONG_LEASE = 3600.0  # seconds: leases that never expire during a run
# A var queue's payload cache: SQLite's default page cache (cache_size=-2000 KiB), so
# that both sides of a var cycle keep the same amount of recent data in memory.
PAYLOAD_CACHE_BYTES = 2000 * 1024
_PING = struct.Struct("<QI")


def body(i: int) -> dict[str, Any]:
    """The var workloads' payload: a dict that msgpack packs into 96-100 bytes (100 from
    id 65,536 on, where the id takes five bytes).

    Two of its five values differ from job to job (the id and the 35-character text), as
    a document id and its contents would; the reason, the tags and the priority repeat, as
    a job's kind and flags do.  Until round 9 the text was 26 repeated characters: the
    body packed into 86-90 bytes, under its label, and a batched lease's decode, which
    keeps a repeated immutable value's object, would have had one value more to keep
    (docs/performance.md)."""
    return {"doc_id": i, "reason": "edited", "tags": ["search", "reindex"], "text": f"{i:035d}", "priority": 3}


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def open_armdb(path: str, spec: QueueSpec, *, tuned: bool = False, durable: bool = False) -> tuple[Db, Queue[Any]]:
    """A Db and a queue configured as a benchmark row says.

    By default, what a user gets: ``Db.open(path)`` and ``db.open_queue(spec)`` with no
    config (``QueueConfig.balanced()``: header and body stores fsync on a 50 ms timer,
    a 30 s lease, a 2,000 KiB body cache).  ``tuned=True`` is the labelled tuned row:
    no fsync at all, leases of :data:`LONG_LEASE`, and a var queue's payload cache of
    :data:`PAYLOAD_CACHE_BYTES` (:data:`TUNED` names it).  ``durable=True``: the header
    store syncs on every write (``sync_interval(0)``), bodies fsync, long leases.
    """
    db = Db.open(path)
    try:
        if not tuned and not durable:
            return db, db.open_queue(spec)
        header = FixedConfig.balanced().grow_step(QUEUE_GROW_STEP)
        header = header.sync_interval(0) if durable else header.enable_fsync(False)
        cfg = QueueConfig.balanced().lease_timeout(LONG_LEASE).header_config(header.build())
        if spec.var:
            cfg = cfg.payload_config(
                Config.balanced().enable_fsync(durable).cache_bytes(PAYLOAD_CACHE_BYTES).build())
        return db, db.open_queue(spec, cfg.build())
    except BaseException:
        db.close()
        raise


def _fixed_payload(i: int) -> tuple[int, int]:
    return (i, 1)


def _timed_rate(n: int, fn: Callable[[int], None]) -> float:
    """Operations per second of ``fn(i)`` for ``i in range(n)``."""
    gc.collect()
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    return n / (time.perf_counter() - t0)


# -- armdb workloads ----------------------------------------------------------------------------------


def armdb_cycle(path: str, n: int, spec: QueueSpec, *, tuned: bool = False, durable: bool = False,
                warmup: int = 200) -> float:
    """push → lease(1) → ack, ``n`` times; cycles per second (config: :func:`open_armdb`)."""
    db, q = open_armdb(path, spec, tuned=tuned, durable=durable)
    try:
        return queue_cycle_rate(q, n, body if spec.var else _fixed_payload, warmup)
    finally:
        db.shutdown()


def queue_cycle_rate(q: Queue[Any], n: int, make: Callable[[int], Any], warmup: int) -> float:
    """push → lease(1) → ack of ``make(i)`` on ``q``, ``n`` times after ``warmup``; cycles per second."""
    def cycle(i: int) -> None:
        q.push(make(i))
        (lease,) = q.lease(1)
        q.ack(lease.token)

    for i in range(warmup):
        cycle(i)
    return _timed_rate(n, cycle)


def armdb_durable_push(path: str, n: int, *, threads: int = 1, warmup: int = 200) -> float:
    """Pushes per second with a sync on every write, from ``threads`` threads."""
    db, q = open_armdb(path, BenchFixed, durable=True)
    try:
        def push(i: int) -> None:
            q.push(_fixed_payload(i))

        for i in range(warmup):
            push(i)
        return _threaded_rate(n, threads, push)
    finally:
        db.shutdown()


def _threaded_rate(n: int, threads: int, op: Callable[[int], None]) -> float:
    """Operations per second of ``op`` run ``n`` times in total by ``threads`` threads."""
    if threads <= 1:
        return _timed_rate(n, op)
    errors: list[BaseException] = []
    start = threading.Barrier(threads + 1)

    def worker(ids: range) -> None:
        start.wait()
        try:
            for i in ids:
                op(i)
        except BaseException as e:  # noqa: BLE001 - re-raised by the caller after join
            errors.append(e)

    pool = [threading.Thread(target=worker, args=(range(t, n, threads),)) for t in range(threads)]
    for t in pool:
        t.start()
    gc.collect()
    start.wait()
    t0 = time.perf_counter()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return n / elapsed


def armdb_tx_commit(path: str, n: int, *, durable: bool, threads: int = 1, warmup: int = 50, shards: int = 8,
                    stats: dict[str, float] | None = None) -> float:
    """2-row transactions (a map put and a fixed-queue push) per second.

    The map and the queue have ``shards`` shards each (8 by default); a durable
    commit's log sync can serve several threads (group commit), and a durable commit
    releases its shard locks before its sync, so commits on one shard share syncs too
    and apply in log order after them (docs/transactions.md, "The apply turnstile").
    The stores themselves do not fsync: the log carries the durability of
    ``.durable()`` commits.  ``stats``, when given, receives the log's counters for
    the timed run: ``commits``, ``syncs`` and ``sync_seconds`` (time inside
    ``fdatasync``, counted by the native group-commit path only).
    """
    db = Db.open(path)
    try:
        m = db.open_map("effects", Config.balanced().shard_count(shards).enable_fsync(False).build())
        header = FixedConfig.balanced().shard_count(shards).grow_step(16_384).enable_fsync(False).build()
        q = db.open_queue(BenchFixed, QueueConfig.balanced().header_config(header).build())

        def commit(i: int) -> None:
            tx = db.tx().put(m, i, "effect").push(q, _fixed_payload(i))
            if durable:
                tx.durable()
            tx.commit()

        for i in range(warmup):
            commit(n + i)  # keys the timed run does not use
        txlog = db.txlog
        c0, s0, t0 = txlog.commits, txlog.syncs, txlog._group.sync_seconds
        rate = _threaded_rate(n, threads, commit)
        if stats is not None:
            stats.update(commits=txlog.commits - c0, syncs=txlog.syncs - s0,
                         sync_seconds=txlog._group.sync_seconds - t0)
        return rate
    finally:
        db.shutdown()


def armdb_lease_scan(path: str, outstanding: int, samples: int) -> float:
    """Median µs of one ``lease(1)`` that must skip ``outstanding`` unexpired leases."""
    db, q = open_armdb(path, BenchFixed)
    try:
        for i in range(outstanding):
            q.push(_fixed_payload(i))
        leased = 0
        while leased < outstanding:  # leases that stay unexpired for the whole run
            leased += len(q.lease(min(1000, outstanding - leased), lease_timeout=LONG_LEASE))
        for i in range(samples):
            q.push(_fixed_payload(outstanding + i))
        times = []
        gc.collect()
        for _ in range(samples):
            t0 = time.perf_counter_ns()
            got = q.lease(1)
            times.append((time.perf_counter_ns() - t0) / 1000)
            assert len(got) == 1
        return statistics.median(times)
    finally:
        db.shutdown()


def armdb_cold_open(path: str, rows: int, repeats: int = 1) -> float:
    """Seconds to open a Db and a queue holding ``rows`` live rows (best of ``repeats``)."""
    db, q = open_armdb(path, BenchFixed)
    try:
        for i in range(rows):
            q.push(_fixed_payload(i))
    finally:
        db.shutdown()
    best = float("inf")
    for _ in range(max(1, repeats)):
        gc.collect()
        t0 = time.perf_counter()
        db, q = open_armdb(path, BenchFixed)
        elapsed = time.perf_counter() - t0
        try:
            assert q.len() == rows
        finally:
            db.shutdown()
        best = min(best, elapsed)
    return best


def armdb_idle_shard_bytes(path: str) -> int:
    """RAM of one idle queue shard's version vector (``QueueStats.version_vector_bytes``)."""
    db, q = open_armdb(path, BenchFixed)
    try:
        s = q.stats()
        return s.version_vector_bytes // s.shards
    finally:
        db.shutdown()


BATCH_SIZES = (1, 64, 1024)


def _batches(jobs: int, size: int) -> int:
    return max(20, jobs // size)


def armdb_batch_cycle(path: str, jobs: int, size: int, spec: QueueSpec) -> float:
    """``push_many(size)`` → ``lease_batch(size)`` → ``ack_many``, at the defaults a user
    gets (``Db.open(path)``, ``QueueConfig.balanced()``); jobs per second.  A fixed queue
    pushes a NumPy array of its dtype, a var queue a list of 100-byte dicts."""
    db = Db.open(path)
    try:
        q = db.open_queue(spec)
        if spec.var:
            payloads: Any = [body(i) for i in range(size)]
        else:
            payloads = np.zeros(size, dtype=spec.dtype)
            payloads["doc"] = np.arange(size)

        return batch_cycle_rate(q, payloads, jobs)
    finally:
        db.shutdown()


def batch_cycle_rate(q: Any, payloads: Any, jobs: int, ack_with_lease: bool = False) -> float:
    """Jobs per second of ``push_many(payloads)`` → ``lease_batch(len(payloads))`` →
    ``ack_many``, or with ``ack_with_lease`` the acks given to the next lease
    (``lease_batch(size, ack=the last batch)``), on ``q`` (a queue, or a client's);
    after three untimed cycles."""
    size = len(payloads)
    last: list[Any] = [None]

    def cycle(_: int) -> None:
        q.push_many(payloads)
        if ack_with_lease:
            last[0] = q.lease_batch(size, ack=last[0])
        else:
            q.ack_many(q.lease_batch(size))

    for i in range(3):
        cycle(i)
    return _timed_rate(_batches(jobs, size), cycle) * size


def armdb_extend(path: str, n: int, warmup: int = 200) -> float:
    """``extend`` of one held lease, ``n`` times, at the defaults; extends per second."""
    db = Db.open(path)
    try:
        q: Queue[Any] = db.open_queue(BenchFixed)
        q.push(_fixed_payload(1))
        (lease,) = q.lease(1)

        def extend(_: int) -> None:
            q.extend(lease, by=60)

        for i in range(warmup):
            extend(i)
        return _timed_rate(n, extend)
    finally:
        db.shutdown()


# -- raw SQLite ------------------------------------------------------------------------------------------


class SqliteQueue:
    """A queue table the way one writes it by hand: WAL, a state index, one commit per op."""

    SCHEMA = (
        (
            "CREATE TABLE q (id INTEGER PRIMARY KEY, due INTEGER NOT NULL, state INTEGER NOT NULL, "
            "attempts INTEGER NOT NULL DEFAULT 0, deadline INTEGER, body BLOB)"
        ),
        "CREATE INDEX q_state ON q (state, due, id)",
    )
    LEASE = (
        "UPDATE q SET state = 1, attempts = attempts + 1, deadline = ? "
        "WHERE id = (SELECT id FROM q WHERE state = 0 AND due <= ? ORDER BY due, id LIMIT 1) "
        "RETURNING id, body, attempts"
    )

    def __init__(self, path: str, synchronous: str) -> None:
        # isolation_level=None: autocommit, so every statement is its own transaction.
        self.conn = sqlite3.connect(os.path.join(path, "q.sqlite"), isolation_level=None, check_same_thread=False)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute(f"PRAGMA synchronous={synchronous}")
        for stmt in self.SCHEMA:
            self.conn.execute(stmt)

    def push(self, body: bytes, due: int) -> int:
        cur = self.conn.execute("INSERT INTO q (due, state, body) VALUES (?, 0, ?)", (due, body))
        return int(cur.lastrowid or 0)

    def lease(self, now: int, timeout_ms: int = int(LONG_LEASE * 1000)) -> tuple[int, bytes, int] | None:
        rows = self.conn.execute(self.LEASE, (now + timeout_ms, now)).fetchall()
        return rows[0] if rows else None

    def ack(self, job_id: int) -> None:
        self.conn.execute("DELETE FROM q WHERE id = ?", (job_id,))

    def close(self) -> None:
        self.conn.close()


def sqlite_cycle(path: str, n: int, synchronous: str, var: bool, warmup: int = 200) -> float:
    q = SqliteQueue(path, synchronous)
    try:
        def cycle(i: int) -> None:
            q.push(msgpack.packb(body(i)) if var else _PING.pack(i, 1), _now_ms())
            row = q.lease(_now_ms())
            assert row is not None
            if var:
                msgpack.unpackb(row[1])
            q.ack(row[0])

        for i in range(warmup):
            cycle(i)
        return _timed_rate(n, cycle)
    finally:
        q.close()


def sqlite_batch_cycle(path: str, jobs: int, size: int, var: bool) -> float:
    """The batched cycle written by hand: ``size`` inserts in one transaction, one
    ``UPDATE ... RETURNING`` leasing ``size`` rows, one ``DELETE`` of them (WAL,
    synchronous=NORMAL); jobs per second."""
    q = SqliteQueue(path, "NORMAL")
    lease = ("UPDATE q SET state = 1, attempts = attempts + 1, deadline = ? WHERE id IN "
             "(SELECT id FROM q WHERE state = 0 AND due <= ? ORDER BY due, id LIMIT ?) RETURNING id, body, attempts")
    try:
        conn = q.conn

        def cycle(i: int) -> None:
            now = _now_ms()
            rows = [(now, msgpack.packb(body(i * size + k)) if var else _PING.pack(i * size + k, 1))
                    for k in range(size)]
            conn.execute("BEGIN")
            conn.executemany("INSERT INTO q (due, state, body) VALUES (?, 0, ?)", rows)
            conn.execute("COMMIT")
            got = conn.execute(lease, (now + int(LONG_LEASE * 1000), _now_ms(), size)).fetchall()
            if var:
                for row in got:
                    msgpack.unpackb(row[1])
            conn.execute("BEGIN")
            conn.executemany("DELETE FROM q WHERE id = ?", ((row[0],) for row in got))
            conn.execute("COMMIT")

        for i in range(3):
            cycle(i)
        return _timed_rate(_batches(jobs, size), cycle) * size
    finally:
        q.close()


def sqlite_extend(path: str, n: int, warmup: int = 200) -> float:
    """A lease's deadline moved by hand: one ``UPDATE`` per extend (WAL, NORMAL)."""
    q = SqliteQueue(path, "NORMAL")
    try:
        q.push(_PING.pack(1, 1), _now_ms())
        row = q.lease(_now_ms())
        assert row is not None
        job_id = row[0]

        def extend(_: int) -> None:
            q.conn.execute("UPDATE q SET deadline = ? WHERE id = ? AND state = 1", (_now_ms() + 60_000, job_id))

        for i in range(warmup):
            extend(i)
        return _timed_rate(n, extend)
    finally:
        q.close()


def sqlite_durable_push(path: str, n: int, warmup: int = 200) -> float:
    q = SqliteQueue(path, "FULL")
    try:
        def push(i: int) -> None:
            q.push(_PING.pack(i, 1), _now_ms())

        for i in range(warmup):
            push(i)
        return _timed_rate(n, push)
    finally:
        q.close()


def sqlite_lease_scan(path: str, outstanding: int, samples: int) -> float:
    q = SqliteQueue(path, "NORMAL")
    try:
        now = _now_ms()
        q.conn.execute("BEGIN")
        q.conn.executemany(
            "INSERT INTO q (due, state, attempts, deadline, body) VALUES (?, 1, 1, ?, ?)",
            ((now - outstanding + i, now + int(LONG_LEASE * 1000), _PING.pack(i, 1)) for i in range(outstanding)),
        )
        q.conn.execute("COMMIT")
        for i in range(samples):
            q.push(_PING.pack(outstanding + i, 1), now)
        times = []
        gc.collect()
        for _ in range(samples):
            t0 = time.perf_counter_ns()
            row = q.lease(_now_ms())
            times.append((time.perf_counter_ns() - t0) / 1000)
            assert row is not None
        return statistics.median(times)
    finally:
        q.close()


# -- raw fdatasync -----------------------------------------------------------------------------------------


def raw_fdatasync(path: str, n: int, *, threads: int = 1, warmup: int = 50) -> float:
    """``pwrite`` of 64 bytes + ``fdatasync`` per op into a preallocated (sparse) file."""
    fs = _fs.FS
    fd = fs.open(os.path.join(path, "raw.data"), os.O_RDWR | os.O_CREAT)
    record = b"\xa5" * 64
    try:
        fs.ftruncate(fd, (n + warmup + 1) * 64)

        def op(i: int) -> None:
            fs.pwrite(fd, record, (warmup + i) * 64)
            fs.fdatasync(fd)

        for i in range(warmup):
            fs.pwrite(fd, record, i * 64)
            fs.fdatasync(fd)
        return _threaded_rate(n, threads, op)
    finally:
        fs.close(fd)


# -- litequeue and persist-queue ----------------------------------------------------------------------------


def litequeue_cycle(path: str, n: int, var: bool, warmup: int = 200) -> float:
    from litequeue import LiteQueue

    q = LiteQueue(os.path.join(path, "lq.sqlite"))
    try:
        def cycle(i: int) -> None:
            q.put(msgpack.packb(body(i)) if var else _PING.pack(i, 1))
            msg = q.pop()
            assert msg is not None
            if var:
                msgpack.unpackb(msg.data)
            q.done(msg.message_id)

        for i in range(warmup):
            cycle(i)
        return _timed_rate(n, cycle)
    finally:
        q.close()


def litequeue_lease_scan(path: str, outstanding: int, samples: int) -> float:
    from litequeue import LiteQueue

    q = LiteQueue(os.path.join(path, "lq.sqlite"))
    try:
        # The state 10,000 pops would leave (rows locked, i.e. leased), built in one
        # statement: each pop sorts every ready row, so popping them one by one is
        # quadratic and would dominate the run.
        with q.transaction():
            for i in range(outstanding):
                q.put(_PING.pack(i, 1))
            q.conn.execute(f"UPDATE {q.table} SET status = 1, lock_time = ? WHERE status = 0", (time.time_ns(),))
        for i in range(samples):
            q.put(_PING.pack(outstanding + i, 1))
        times = []
        gc.collect()
        for _ in range(samples):
            t0 = time.perf_counter_ns()
            msg = q.pop()
            times.append((time.perf_counter_ns() - t0) / 1000)
            assert msg is not None
        return statistics.median(times)
    finally:
        q.close()


def _persist_queue(path: str) -> Any:
    from persistqueue import SQLiteAckQueue

    return SQLiteAckQueue(os.path.join(path, "pq"), auto_commit=True)


def persistqueue_cycle(path: str, n: int, warmup: int = 20) -> float:
    q = _persist_queue(path)
    try:
        def cycle(i: int) -> None:
            q.put(_PING.pack(i, 1))
            item = q.get(block=False, raw=True)
            q.ack(id=item["pqid"])

        for i in range(warmup):
            cycle(i)
        return _timed_rate(n, cycle)
    finally:
        q.close()


def persistqueue_durable_push(path: str, n: int, warmup: int = 20) -> float:
    q = _persist_queue(path)
    try:
        def push(i: int) -> None:
            q.put(_PING.pack(i, 1))

        for i in range(warmup):
            push(i)
        return _timed_rate(n, push)
    finally:
        q.close()


def persistqueue_lease_scan(path: str, outstanding: int, samples: int) -> float:
    """persist-queue's ``get`` (which fsyncs its status update) past unacked rows.

    Building 10,000 unacked rows through ``put``/``get`` would take 20,000 synced
    commits, so the state is inserted in one transaction on the queue's own
    connection, with the status ``get`` gives a row (unack).
    """
    from persistqueue.sqlackqueue import AckStatus

    q = _persist_queue(path)
    try:
        with q.tran_lock, q._putter as conn:
            conn.executemany(
                f"INSERT INTO {q._table_name} (data, timestamp, status) VALUES (?, ?, ?)",
                ((q._serializer.dumps(_PING.pack(i, 1)), time.time(), AckStatus.unack) for i in range(outstanding)),
            )
        for i in range(samples):
            q.put(_PING.pack(outstanding + i, 1))
        times = []
        gc.collect()
        for _ in range(samples):
            t0 = time.perf_counter_ns()
            item = q.get(block=False, raw=True)
            times.append((time.perf_counter_ns() - t0) / 1000)
            assert item is not None
        return statistics.median(times)
    finally:
        q.close()


# -- localqueue ---------------------------------------------------------------------------------------------


class _RawBytes:
    """A localqueue serializer that stores the bytes it is given, so that localqueue
    carries the same payloads as the other SQLite peers (12-byte records, or msgpack
    bodies packed by the workload) instead of its default JSON."""

    def dumps(self, obj: bytes, /) -> bytes:
        return obj

    def loads(self, data: bytes, /) -> bytes:
        return data


def _localqueue(path: str) -> Any:
    """A ``localqueue.SimpleQueue`` at its defaults (``DurabilityMode.RELAXED``: WAL with
    ``synchronous=NORMAL``, a 60 s lease)."""
    from localqueue import SimpleQueue

    return SimpleQueue(os.path.join(path, "lq"), serializer=_RawBytes())


def localqueue_cycle(path: str, n: int, var: bool, warmup: int = 200) -> float:
    """localqueue's put → get (a lease) → ack, ``n`` times; cycles per second."""
    q = _localqueue(path)
    try:
        def cycle(i: int) -> None:
            q.put(msgpack.packb(body(i)) if var else _PING.pack(i, 1))
            job = q.get(block=False)
            if var:
                msgpack.unpackb(job.data)
            q.ack(job)

        for i in range(warmup):
            cycle(i)
        return _timed_rate(n, cycle)
    finally:
        q.close()


PUT_MANY = 1000  # payloads per push_many / put_many call


def armdb_push_many(path: str, jobs: int, size: int, spec: QueueSpec) -> float:
    """``push_many(size)`` at the defaults a user gets, into a growing queue; jobs per
    second.  A fixed queue pushes one NumPy array of its dtype (built once), a var queue
    a list of 100-byte dicts (packed by the call)."""
    db = Db.open(path)
    try:
        q = db.open_queue(spec)
        if spec.var:
            payloads: Any = [body(i) for i in range(size)]
        else:
            payloads = np.zeros(size, dtype=spec.dtype)
            payloads["doc"] = np.arange(size)
        q.push_many(payloads)  # warm-up
        return _timed_rate(_batches(jobs, size), lambda _: q.push_many(payloads)) * size
    finally:
        db.shutdown()


def localqueue_put_many(path: str, jobs: int, size: int, var: bool) -> float:
    """localqueue's ``put_many(size)`` (one transaction per call); jobs per second.  Fixed
    records are packed once, as armdb's NumPy array is built once; var bodies are
    packed with msgpack in each call, as armdb's ``push_many`` packs its dicts."""
    q = _localqueue(path)
    try:
        records = [_PING.pack(i, 1) for i in range(size)]
        dicts = [body(i) for i in range(size)]

        def put(_: int) -> None:
            q.put_many([msgpack.packb(d) for d in dicts] if var else records)

        put(0)  # warm-up
        return _timed_rate(_batches(jobs, size), put) * size
    finally:
        q.close()


def sqlite_push_many(path: str, jobs: int, size: int, var: bool) -> float:
    """``size`` inserts in one transaction (WAL, synchronous=NORMAL); jobs per second."""
    q = SqliteQueue(path, "NORMAL")
    try:
        records = [_PING.pack(i, 1) for i in range(size)]
        dicts = [body(i) for i in range(size)]
        conn = q.conn

        def put(_: int) -> None:
            now = _now_ms()
            conn.execute("BEGIN")
            conn.executemany("INSERT INTO q (due, state, body) VALUES (?, 0, ?)",
                             [(now, msgpack.packb(d)) for d in dicts] if var else [(now, r) for r in records])
            conn.execute("COMMIT")

        put(0)  # warm-up
        return _timed_rate(_batches(jobs, size), put) * size
    finally:
        q.close()


# -- through the socket (SPEC P1, P2) and worker processes (P6) --------------------------------------------


SERVE_BATCH = 64


def serve_cycle(path: str, jobs: int, batch: int, warmup: int = 200, ack_with_lease: bool = False) -> float:
    """The var cycle through ``db.serve()`` and one client, at the defaults: with ``batch``
    0, push → lease(1) → ack per job; else push_many(batch) → lease_batch(batch) →
    ack_many, or with ``ack_with_lease`` push_many(batch) → lease_batch(batch, ack=the
    last batch).  Jobs per second.  The direct rows of the same workload are
    :func:`armdb_cycle`, :func:`armdb_batch_cycle` and :func:`armdb_batch_cycle_ack`."""
    db = Db.open(path)
    try:
        db.open_queue(BenchVar)
        db.serve()
        with connect(path) as client:
            q = client.open_queue(BenchVar)
            if batch:
                return batch_cycle_rate(q, [body(i) for i in range(batch)], jobs, ack_with_lease)

            def one(i: int) -> None:
                q.push(body(i))
                (lease,) = q.lease(1)
                q.ack(lease.token)

            for i in range(warmup):
                one(i)
            return _timed_rate(jobs, one)
    finally:
        db.shutdown()


def armdb_batch_cycle_ack(path: str, jobs: int, size: int) -> float:
    """:func:`armdb_batch_cycle` of the var queue with the acks given to the next lease:
    push_many(size) → lease_batch(size, ack=the last batch), direct calls; jobs per second."""
    db = Db.open(path)
    try:
        return batch_cycle_rate(db.open_queue(BenchVar), [body(i) for i in range(size)], jobs, ack_with_lease=True)
    finally:
        db.shutdown()


def _serve_child(path: str, jobs: int, batch: int, ready: Any, start: Any, rate: Any) -> None:
    """The client of :func:`serve_cycle_remote`, in a process of its own."""
    with connect(path) as client:
        q = client.open_queue(BenchVar)
        payloads = [body(i) for i in range(max(batch, 1))]

        def cycle(i: int) -> None:
            if batch:
                q.push_many(payloads)
                q.ack_many(q.lease_batch(batch))
            else:
                q.push(body(i))
                (lease,) = q.lease(1)
                q.ack(lease.token)

        for i in range(20):
            cycle(i)
        ready.release()
        start.wait()
        n = _batches(jobs, batch) if batch else jobs
        rate.value = _timed_rate(n, cycle) * max(batch, 1)


def serve_cycle_remote(path: str, jobs: int, batch: int) -> float:
    """:func:`serve_cycle` with the client in another process (started with ``spawn``,
    connected and warmed up before the clock starts): what a process sharing the owner's
    queue sees, its own work on its own core.  Jobs per second."""
    db = Db.open(path)
    try:
        db.open_queue(BenchVar)
        db.serve()
        ctx = multiprocessing.get_context("spawn")
        ready, start, rate = ctx.Semaphore(0), ctx.Event(), ctx.Value("d", 0.0)
        proc = ctx.Process(target=_serve_child, args=(path, jobs, batch, ready, start, rate), daemon=True)
        _run_processes([proc], ready, start)
        if proc.exitcode != 0 or not rate.value:
            raise RuntimeError(f"the client process failed (exit code {proc.exitcode})")
        return float(rate.value)
    finally:
        db.shutdown()


CPU_LOOP = 10_000  # iterations of cpu_job: about 1 ms of pure Python on an idle core of the bench machine


def cpu_job(payload: Any) -> int:
    """The CPU-bound handler of worker/cpu-1ms: a fixed amount of pure-Python work (never a
    wait on the clock, which would overlap on one core as well as on two)."""
    x = int(payload["doc_id"]) if isinstance(payload, dict) else 0
    for i in range(CPU_LOOP):
        x += i * i
    return x


def worker_cpu(path: str, jobs: int, processes: int) -> float:
    """``jobs`` CPU-bound jobs through ``Worker(db, ..., processes=N)`` (N=0: handler
    threads in the owner); jobs per second from the push to the last ack, the child
    processes' start-up not timed (they are connected and waiting before the push)."""
    db = Db.open(path)
    try:
        q = db.open_queue(BenchVar)
        srv = db.serve() if processes else None
        w = Worker(db, BenchVar, cpu_job, processes=processes).start()  # the defaults (batch=16)
        try:
            deadline = time.monotonic() + 120
            while srv is not None and srv.connections() < processes:
                if time.monotonic() > deadline or w.error is not None:
                    raise RuntimeError(f"the worker processes did not connect: {w.error!r}")
                time.sleep(0.01)
            time.sleep(0.05)  # the children are in their first wait for a due row
            payloads = [body(i) for i in range(jobs)]
            gc.collect()
            t0 = time.perf_counter()
            q.push_many(payloads)
            while w.counts()[0] < jobs:
                if time.monotonic() > deadline or w.error is not None:
                    raise RuntimeError(f"the worker acked {w.counts()[0]} of {jobs} jobs: {w.error!r}")
                time.sleep(0.005)  # the owner's own polling would take CPU from the workers it times
            return jobs / (time.perf_counter() - t0)
        finally:
            w.stop()
            w.join(60)
    finally:
        db.shutdown()


def _localqueue_child(path: str, ready: Any, start: Any, done: Any) -> None:
    """A localqueue worker process: get → cpu_job → ack until the queue is empty."""
    from localqueue import Empty  # an optional peer (the bench extra), imported where it is used

    q = _localqueue(path)
    try:
        ready.release()
        start.wait()
        n = 0
        while True:
            try:
                job = q.get(block=False)
            except Empty:
                break
            cpu_job(msgpack.unpackb(job.data))
            q.ack(job)
            n += 1
        with done.get_lock():
            done.value += n
    finally:
        q.close()


def localqueue_cpu(path: str, jobs: int, processes: int) -> float:
    """The same jobs and handler over localqueue, one SQLite file shared by ``processes``
    processes (started with ``spawn`` and waiting before the clock starts); jobs per second
    until every process found the queue empty."""
    q = _localqueue(path)
    try:
        q.put_many([msgpack.packb(body(i)) for i in range(jobs)])
    finally:
        q.close()
    ctx = multiprocessing.get_context("spawn")
    ready, start, done = ctx.Semaphore(0), ctx.Event(), ctx.Value("q", 0)
    procs = [ctx.Process(target=_localqueue_child, args=(path, ready, start, done), daemon=True)
             for _ in range(processes)]
    elapsed = _run_processes(procs, ready, start)
    if done.value != jobs:
        raise RuntimeError(f"localqueue's processes acked {done.value} of {jobs} jobs")
    return jobs / elapsed


def _run_processes(procs: list[Any], ready: Any, start: Any) -> float:
    """Start ``procs``, wait until each has released ``ready``, set ``start`` and return
    the seconds until all have exited (a process still alive after 300 s is killed)."""
    for p in procs:
        p.start()
    try:
        for _ in procs:
            if not ready.acquire(timeout=120):
                raise RuntimeError("a benchmark process did not start")
        t0 = time.perf_counter()
        start.set()
        for p in procs:
            p.join(300)
        return time.perf_counter() - t0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


def _bare_child(jobs: int, ready: Any, start: Any) -> None:
    ready.release()
    start.wait()
    for i in range(jobs):
        cpu_job({"doc_id": i})


def bare_cpu(path: str, jobs: int, processes: int) -> float:
    """No queue: ``jobs`` calls of the handler split over ``processes`` processes; jobs per
    second.  The ceiling the machine allows at this moment: on a loaded 2-core machine two
    processes get less than two cores, whatever the queue."""
    ctx = multiprocessing.get_context("spawn")
    ready, start = ctx.Semaphore(0), ctx.Event()
    share = [jobs // processes + (1 if i < jobs % processes else 0) for i in range(processes)]
    procs = [ctx.Process(target=_bare_child, args=(n, ready, start), daemon=True) for n in share]
    elapsed = _run_processes(procs, ready, start)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"exit codes {[p.exitcode for p in procs]}")
    return jobs / elapsed


# -- the case table -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One system on one workload.

    ``run(directory, sizes)`` does one repeat in a fresh directory and returns the
    figure in ``unit``.  ``higher_is_better`` says how to read it; ``requires``
    names the module a peer needs (missing: the row says how to install it).
    """

    workload: str
    system: str
    durability: str
    unit: str
    run: Callable[[str, Sizes], float]
    higher_is_better: bool = True
    reference: bool = False
    requires: str | None = None
    repeats: int | None = None  # a fixed count (e.g. an expensive build), else from Sizes

    def repeats_in(self, sizes: Sizes) -> int:
        if self.repeats is not None:
            return self.repeats
        return sizes.durable_repeats if self.durability.startswith(SYNCED) else sizes.repeats


def _bind(fn: Callable[[str, int, int, Any], float], size: int, arg: Any) -> Callable[[str, Sizes], float]:
    """``run`` of a batch row: ``fn(directory, sizes.batch_jobs, size, arg)``."""
    return lambda d, s: fn(d, s.batch_jobs, size, arg)


LITEQUEUE = "litequeue"
LOCALQUEUE = "localqueue"
PERSISTQUEUE = "persistqueue"
INSTALL_HINT = "pip install -e '.[bench]'"

# System names: a row at the defaults a user gets says so; a tuned row names its settings.
ARMDB_FIXED = "armdb fixed queue (defaults)"
ARMDB_VAR = "armdb var queue (defaults)"
TUNED = "tuned: no fsync, 3600 s leases"
ARMDB_FIXED_TUNED = f"armdb fixed queue ({TUNED})"
ARMDB_VAR_TUNED = f"armdb var queue ({TUNED}, payload cache {PAYLOAD_CACHE_BYTES // 1024:,} KiB)"
ARMDB_DURABLE = "armdb fixed queue (header sync_interval(0))"
TIMED = f"{NO_SYNC} (fsync every 50 ms)"
LOCALQUEUE_DURABILITY = f"{NO_SYNC} (RELAXED: synchronous=NORMAL)"

CASES: list[Case] = [
    # push → lease → ack, fixed 12-byte payload: the defaults, raw SQLite, the tuned row, the peers.
    Case("cycle/fixed", ARMDB_FIXED, TIMED, "cycles/s",
         lambda d, s: armdb_cycle(d, s.cycle_ops, BenchFixed, warmup=s.warmup), reference=True),
    Case("cycle/fixed", "sqlite3 WAL", f"{NO_SYNC} (synchronous=NORMAL)", "cycles/s",
         lambda d, s: sqlite_cycle(d, s.cycle_ops, "NORMAL", False, s.warmup)),
    Case("cycle/fixed", ARMDB_FIXED_TUNED, f"{NO_SYNC} (no fsync)", "cycles/s",
         lambda d, s: armdb_cycle(d, s.cycle_ops, BenchFixed, tuned=True, warmup=s.warmup)),
    Case("cycle/fixed", "localqueue", LOCALQUEUE_DURABILITY, "cycles/s",
         lambda d, s: localqueue_cycle(d, s.cycle_ops, False, s.warmup), requires=LOCALQUEUE),
    Case("cycle/fixed", "litequeue", f"{NO_SYNC} (synchronous=NORMAL)", "cycles/s",
         lambda d, s: litequeue_cycle(d, s.cycle_ops, False, s.warmup), requires=LITEQUEUE),
    # push → lease → ack with a 100-byte msgpack body.
    Case("cycle/var-100B", ARMDB_VAR, TIMED, "cycles/s",
         lambda d, s: armdb_cycle(d, s.cycle_ops, BenchVar, warmup=s.warmup), reference=True),
    Case("cycle/var-100B", "sqlite3 WAL", f"{NO_SYNC} (synchronous=NORMAL)", "cycles/s",
         lambda d, s: sqlite_cycle(d, s.cycle_ops, "NORMAL", True, s.warmup)),
    Case("cycle/var-100B", ARMDB_VAR_TUNED, f"{NO_SYNC} (no fsync)", "cycles/s",
         lambda d, s: armdb_cycle(d, s.cycle_ops, BenchVar, tuned=True, warmup=s.warmup)),
    Case("cycle/var-100B", "localqueue", LOCALQUEUE_DURABILITY, "cycles/s",
         lambda d, s: localqueue_cycle(d, s.cycle_ops, True, s.warmup), requires=LOCALQUEUE),
    Case("cycle/var-100B", "litequeue", f"{NO_SYNC} (synchronous=NORMAL)", "cycles/s",
         lambda d, s: litequeue_cycle(d, s.cycle_ops, True, s.warmup), requires=LITEQUEUE),
    # push_many(1000) beside localqueue's put_many(1000), into a growing queue.
    *[c for kind, spec in (("fixed-numpy", BenchFixed), ("var-100B", BenchVar)) for c in (
        Case(f"push_many/{kind}-{PUT_MANY}", ARMDB_VAR if spec.var else ARMDB_FIXED, TIMED, "jobs/s",
             _bind(armdb_push_many, PUT_MANY, spec), reference=True),
        Case(f"push_many/{kind}-{PUT_MANY}", "localqueue put_many", LOCALQUEUE_DURABILITY, "jobs/s",
             _bind(localqueue_put_many, PUT_MANY, spec.var), requires=LOCALQUEUE),
        Case(f"push_many/{kind}-{PUT_MANY}", "sqlite3 WAL", f"{NO_SYNC} (synchronous=NORMAL)", "jobs/s",
             _bind(sqlite_push_many, PUT_MANY, spec.var)),
    )],
    # One lease that must skip 10,000 unexpired leases.
    Case("lease_scan/10k_outstanding", ARMDB_FIXED, TIMED, "µs/lease",
         lambda d, s: armdb_lease_scan(d, s.outstanding, s.scan_samples), higher_is_better=False, reference=True),
    Case("lease_scan/10k_outstanding", "sqlite3 WAL + state index", f"{NO_SYNC} (synchronous=NORMAL)", "µs/lease",
         lambda d, s: sqlite_lease_scan(d, s.outstanding, s.scan_samples), higher_is_better=False),
    Case("lease_scan/10k_outstanding", "litequeue", f"{NO_SYNC} (synchronous=NORMAL)", "µs/lease",
         lambda d, s: litequeue_lease_scan(d, s.outstanding, s.scan_samples), higher_is_better=False,
         requires=LITEQUEUE),
    Case("lease_scan/10k_outstanding", "persist-queue SQLiteAckQueue", f"{SYNCED} (fsync per op)", "µs/lease",
         lambda d, s: persistqueue_lease_scan(d, s.outstanding, s.scan_samples), higher_is_better=False,
         requires=PERSISTQUEUE),
    # Durable push: every operation reaches the disk before the call returns.
    Case("push/durable", ARMDB_DURABLE, f"{SYNCED} (msync per push)", "pushes/s",
         lambda d, s: armdb_durable_push(d, s.durable_ops, warmup=s.warmup), reference=True),
    Case("push/durable", "sqlite3 WAL", f"{SYNCED} (synchronous=FULL)", "pushes/s",
         lambda d, s: sqlite_durable_push(d, s.durable_ops, s.warmup)),
    Case("push/durable", "persist-queue SQLiteAckQueue", f"{SYNCED} (fsync per op)", "pushes/s",
         lambda d, s: persistqueue_durable_push(d, s.durable_ops, min(20, s.warmup)), requires=PERSISTQUEUE),
    Case("push/durable", "raw pwrite+fdatasync, 64 B", f"{SYNCED} (the disk's limit)", "writes/s",
         lambda d, s: raw_fdatasync(d, s.durable_ops, warmup=min(50, s.warmup))),
    # The same with 8 threads: what group commit could win.
    Case("push/durable-8-threads", ARMDB_DURABLE, f"{SYNCED} (msync per push)", "pushes/s",
         lambda d, s: armdb_durable_push(d, s.thread_ops, threads=s.threads, warmup=s.warmup), reference=True),
    Case("push/durable-8-threads", "raw pwrite+fdatasync, 64 B", f"{SYNCED} (the disk's limit)", "writes/s",
         lambda d, s: raw_fdatasync(d, s.thread_ops, threads=s.threads, warmup=min(50, s.warmup))),
    # Durable cycles, to place persist-queue (it fsyncs every call).
    Case("cycle/durable", ARMDB_DURABLE, f"{SYNCED} (msync per op)", "cycles/s",
         lambda d, s: armdb_cycle(d, s.durable_cycle_ops, BenchFixed, durable=True, warmup=min(20, s.warmup)),
         reference=True),
    Case("cycle/durable", "sqlite3 WAL", f"{SYNCED} (synchronous=FULL)", "cycles/s",
         lambda d, s: sqlite_cycle(d, s.durable_cycle_ops, "FULL", False, min(20, s.warmup))),
    Case("cycle/durable", "persist-queue SQLiteAckQueue", f"{SYNCED} (fsync per op)", "cycles/s",
         lambda d, s: persistqueue_cycle(d, s.durable_cycle_ops, min(20, s.warmup)), requires=PERSISTQUEUE),
    # Transactions: a map put + a queue push in one commit (the outbox shape).
    Case("tx/2-row", "armdb db.tx() (8 shards, stores without fsync)", f"{NO_SYNC} (log appended, not synced)", "commits/s",
         lambda d, s: armdb_tx_commit(d, s.cycle_ops // 4, durable=False, warmup=s.warmup), reference=True),
    Case("tx/2-row-durable", "armdb db.tx().durable() (8 shards, stores without fsync)", f"{SYNCED} (log fdatasync per commit)", "commits/s",
         lambda d, s: armdb_tx_commit(d, s.durable_ops, durable=True, warmup=min(20, s.warmup)), reference=True),
    Case("tx/2-row-durable-8-threads", "armdb db.tx().durable() (8 shards, stores without fsync)", f"{SYNCED} (group commit)", "commits/s",
         lambda d, s: armdb_tx_commit(d, s.thread_ops, durable=True, threads=s.threads, warmup=min(20, s.warmup)),
         reference=True),
    Case("tx/2-row-durable", "raw pwrite+fdatasync, 64 B", f"{SYNCED} (the disk's limit)", "writes/s",
         lambda d, s: raw_fdatasync(d, s.durable_ops, warmup=min(50, s.warmup))),
    # Batches at the defaults a user gets: push_many → lease_batch → ack_many (Q31, Q32).
    *[c for size in BATCH_SIZES for c in (
        Case(f"batch/fixed-numpy-{size}", ARMDB_FIXED, TIMED, "jobs/s",
             _bind(armdb_batch_cycle, size, BenchFixed), reference=True),
        Case(f"batch/fixed-numpy-{size}", "sqlite3 WAL", f"{NO_SYNC} (synchronous=NORMAL)", "jobs/s",
             _bind(sqlite_batch_cycle, size, False)),
        Case(f"batch/var-100B-{size}", ARMDB_VAR, TIMED, "jobs/s",
             _bind(armdb_batch_cycle, size, BenchVar), reference=True),
        Case(f"batch/var-100B-{size}", "sqlite3 WAL", f"{NO_SYNC} (synchronous=NORMAL)", "jobs/s",
             _bind(sqlite_batch_cycle, size, True)),
    )],
    # Through the socket, one client (P1, P2), beside the direct calls in the same run.
    Case("serve/cycle-var-100B", "armdb var queue through db.serve(), one client (defaults)", TIMED, "jobs/s",
         lambda d, s: serve_cycle(d, s.serve_ops, 0, s.warmup), reference=True),
    Case("serve/cycle-var-100B", "armdb var queue through db.serve(), the client in another process", TIMED,
         "jobs/s", lambda d, s: serve_cycle_remote(d, s.serve_ops, 0)),
    Case("serve/cycle-var-100B", "armdb var queue, direct calls (defaults)", TIMED, "jobs/s",
         lambda d, s: armdb_cycle(d, s.serve_ops, BenchVar, warmup=s.warmup)),
    Case(f"serve/batch-var-100B-{SERVE_BATCH}", "armdb var queue through db.serve(), one client (defaults)", TIMED,
         "jobs/s", lambda d, s: serve_cycle(d, s.batch_jobs, SERVE_BATCH), reference=True),
    Case(f"serve/batch-var-100B-{SERVE_BATCH}", "armdb var queue through db.serve(), the client in another process",
         TIMED, "jobs/s", lambda d, s: serve_cycle_remote(d, s.batch_jobs, SERVE_BATCH)),
    Case(f"serve/batch-var-100B-{SERVE_BATCH}", "armdb var queue, direct calls (defaults)", TIMED, "jobs/s",
         _bind(armdb_batch_cycle, SERVE_BATCH, BenchVar)),
    # The same cycle with each batch's acks sent in the next lease (lease_batch(ack=)): one
    # round trip fewer through the socket.
    Case(f"serve/batch-var-100B-{SERVE_BATCH}", "armdb var queue with lease_batch(ack=), through db.serve(), one client",
         TIMED, "jobs/s", lambda d, s: serve_cycle(d, s.batch_jobs, SERVE_BATCH, ack_with_lease=True)),
    Case(f"serve/batch-var-100B-{SERVE_BATCH}", "armdb var queue with lease_batch(ack=), direct calls", TIMED,
         "jobs/s", lambda d, s: armdb_batch_cycle_ack(d, s.batch_jobs, SERVE_BATCH)),
    # A CPU-bound handler (about 1 ms of pure Python per job) in worker processes (P6).
    Case("worker/cpu-1ms", "armdb Worker(processes=2)", TIMED, "jobs/s",
         lambda d, s: worker_cpu(d, s.cpu_jobs, 2), reference=True),
    Case("worker/cpu-1ms", "armdb Worker(processes=1)", TIMED, "jobs/s",
         lambda d, s: worker_cpu(d, s.cpu_jobs, 1)),
    Case("worker/cpu-1ms", "armdb Worker(processes=0): a thread of the owner", TIMED, "jobs/s",
         lambda d, s: worker_cpu(d, s.cpu_jobs, 0)),
    Case("worker/cpu-1ms", "localqueue, 2 processes", LOCALQUEUE_DURABILITY, "jobs/s",
         lambda d, s: localqueue_cpu(d, s.cpu_jobs, 2), requires=LOCALQUEUE),
    Case("worker/cpu-1ms", "localqueue, 1 process", LOCALQUEUE_DURABILITY, "jobs/s",
         lambda d, s: localqueue_cpu(d, s.cpu_jobs, 1), requires=LOCALQUEUE),
    Case("worker/cpu-1ms", "no queue: the handler alone, 2 processes", "-", "jobs/s",
         lambda d, s: bare_cpu(d, s.cpu_jobs, 2)),
    Case("worker/cpu-1ms", "no queue: the handler alone, 1 process", "-", "jobs/s",
         lambda d, s: bare_cpu(d, s.cpu_jobs, 1)),
    # Extending a held lease (the heartbeat of a long handler, Q29).
    Case("extend", ARMDB_FIXED, TIMED, "extends/s",
         lambda d, s: armdb_extend(d, s.extend_ops, s.warmup), reference=True),
    Case("extend", "sqlite3 WAL", f"{NO_SYNC} (synchronous=NORMAL)", "extends/s",
         lambda d, s: sqlite_extend(d, s.extend_ops, s.warmup)),
    # Opening a queue full of live rows (index rebuild from the header file).
    Case("cold_open", ARMDB_FIXED, TIMED, "s",
         lambda d, s: armdb_cold_open(d, s.open_rows, repeats=2), higher_is_better=False, reference=True,
         repeats=1),
]


def _pg_run(cls: Any, kind: str, processes: int) -> Callable[[str, Sizes], float]:
    """``run`` of a postgres row (armdb/_bench_pg.py): a tenth of the cycle size per job (each
    job waits for three WAL flushes), a fifth of the batch size batched."""
    def run(_d: str, s: Sizes) -> float:
        jobs = s.cycle_ops // 10 if kind == "cycle" else s.batch_jobs // 5
        return _bench_pg.run_workload(cls, kind, jobs, processes, warmup=min(20, s.warmup))
    return run


# PostgreSQL (issue 19): armdb.pg beside plain SKIP LOCKED SQL, pgqueuer and procrastinate on
# one local server; the first system of each workload is armdb.pg, the reference.
PG_CASES: list[Case] = [
    Case(_bench_pg.WORKLOADS[(kind, procs)], system, _bench_pg.DURABILITY, "jobs/s", _pg_run(cls, kind, procs),
         reference=cls is _bench_pg.ArmdbPg, requires=requires or "psycopg")
    for kind in ("cycle", "batch") for procs in _bench_pg.PROCESSES for system, cls, requires in _bench_pg.SYSTEMS
]


def _lag_row(spec: QueueSpec, make: Callable[[int], Any], pct: int) -> Callable[[str, Sizes], float]:
    """``run`` of a replication lag row: the ``pct`` percentile under the cycle workload."""
    return lambda d, s: _bench_repl.lag_ms(d, s.cycle_ops, spec, make, pct, warmup=s.warmup)


# Replication (issue 20): a follower in a child process on loopback (armdb._bench_repl).
REPL_FOLLOWER = "a follower on loopback, in another process"
REPL_DURABILITY = f"{NO_SYNC} (fsync every 50 ms); the follower fsyncs each batch it applies"
CASES += [
    *[Case(f"replication/lag-{kind}-p{pct}", f"{system}, {REPL_FOLLOWER}", REPL_DURABILITY, "ms",
           _lag_row(spec, make, pct), higher_is_better=False)
      for kind, system, spec, make in (("fixed", ARMDB_FIXED, BenchFixed, _fixed_payload),
                                       ("var-100B", ARMDB_VAR, BenchVar, body))
      for pct in (50, 99)],
    Case("replication/cycle-fixed", f"{ARMDB_FIXED}, {REPL_FOLLOWER}", TIMED, "cycles/s",
         lambda d, s: _bench_repl.cycle_rate(
             d, BenchFixed, lambda q: queue_cycle_rate(q, s.cycle_ops, _fixed_payload, s.warmup))),
    Case("replication/cycle-fixed", f"{ARMDB_FIXED}, no replica", TIMED, "cycles/s",
         lambda d, s: armdb_cycle(d, s.cycle_ops, BenchFixed, warmup=s.warmup), reference=True),
    Case("replication/durable-commit", "armdb map tx, sync_replicas(1), " + REPL_FOLLOWER,
         f"{SYNCED} (log fdatasync per commit, then the follower's)", "commits/s",
         lambda d, s: _bench_repl.durable_commit_rate(d, s.durable_ops, sync_replica=True, warmup=s.warmup)),
    Case("replication/durable-commit", "armdb map tx, no replica", f"{SYNCED} (log fdatasync per commit)",
         "commits/s",
         lambda d, s: _bench_repl.durable_commit_rate(d, s.durable_ops, sync_replica=False, warmup=s.warmup),
         reference=True),
]


# -- running ---------------------------------------------------------------------------------------------------------


@dataclass
class CaseResult:
    """The figures of one case (``values`` empty when it did not run; ``status`` says why)."""

    case: Case
    values: list[float] = field(default_factory=list)
    status: str = "ok"
    elapsed_s: float = 0.0

    @property
    def median(self) -> float | None:
        return statistics.median(self.values) if self.values else None

    def to_dict(self) -> dict[str, Any]:
        c = self.case
        return {
            "workload": c.workload, "system": c.system, "durability": c.durability, "unit": c.unit,
            "higher_is_better": c.higher_is_better, "reference": c.reference, "status": self.status,
            "values": self.values, "median": self.median, "elapsed_s": round(self.elapsed_s, 3),
        }


def peer_available(module: str | None) -> bool:
    if module is None:
        return True
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def run_case(case: Case, sizes: Sizes) -> CaseResult:
    """Run every repeat of ``case``, each in a fresh temporary directory; never raises."""
    result = CaseResult(case)
    for _ in range(case.repeats_in(sizes)):
        run_repeat(result, sizes)
    return result


def run_repeat(result: CaseResult, sizes: Sizes) -> None:
    """One more repeat of ``result.case`` in a fresh directory, unless it cannot run.

    A missing peer or an earlier failure leaves the result as it is; an exception
    becomes the row's status (one broken peer must not end the run).
    """
    case = result.case
    if result.status != "ok":
        return
    if not peer_available(case.requires):
        result.status = f"not installed: {INSTALL_HINT}"
        return
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="armdb-bench-") as d:
            result.values.append(float(case.run(d, sizes)))
    except Exception as e:  # noqa: BLE001 - reported in the table instead
        log.warning("bench %s / %s failed: %r", case.workload, case.system, e)
        result.status = f"error: {type(e).__name__}: {e}"
        result.values.clear()
    finally:
        result.elapsed_s += time.perf_counter() - started


def select(cases: Sequence[Case], only: str | None) -> list[Case]:
    return [c for c in cases if only is None or only in c.workload]


def run(sizes: Sizes, cases: Sequence[Case] = CASES, progress: Callable[[int, int, str], None] | None = None
        ) -> list[CaseResult]:
    """Run ``cases``; ``progress(done, total, label)`` after each repeat.

    Repeats are interleaved within a workload (repeat 1 of every system, then
    repeat 2, ...), so that a burst of background load on a shared machine lands
    on all the systems being compared rather than on one of them.
    """
    results = [CaseResult(c) for c in cases]
    total = sum(c.repeats_in(sizes) for c in cases)
    done = 0
    workloads = list(dict.fromkeys(c.workload for c in cases))
    for workload in workloads:
        group = [r for r in results if r.case.workload == workload]
        for i in range(max(r.case.repeats_in(sizes) for r in group)):
            for r in group:
                if i >= r.case.repeats_in(sizes):
                    continue
                label = f"{r.case.workload} / {r.case.system}"
                if progress:
                    progress(done, total, label)
                run_repeat(r, sizes)
                done += 1
                if progress:
                    progress(done, total, label)
    return results


# -- reporting ---------------------------------------------------------------------------------------------------------


def _fmt_value(v: float, unit: str) -> str:
    if unit == "s":
        return f"{v:.3f}"
    if unit.startswith("µs"):
        return f"{v:,.1f}"
    return f"{v:,.0f}"


def speedup(ref: CaseResult, other: CaseResult) -> float | None:
    """How many times faster the reference (armdb) row is than ``other``."""
    a, b = ref.median, other.median
    if a is None or b is None or a <= 0 or b <= 0:
        return None
    return a / b if ref.case.higher_is_better else b / a


def markdown_table(results: Sequence[CaseResult]) -> str:
    """The results as a markdown table; ratios divide within a workload."""
    lines = [
        "| workload | system | durability | median | unit | min – max | armdb speed ÷ this |",
        "|---|---|---|---:|---|---:|---:|",
    ]
    refs: dict[str, CaseResult] = {}
    for r in results:
        if r.case.reference and r.case.workload not in refs:
            refs[r.case.workload] = r
    for r in results:
        c = r.case
        if r.values:
            med = _fmt_value(r.median or 0.0, c.unit)
            rng = f"{_fmt_value(min(r.values), c.unit)} – {_fmt_value(max(r.values), c.unit)}"
            ref = refs.get(c.workload)
            ratio = speedup(ref, r) if ref is not None and ref is not r else None
            ratio_s = "reference" if ref is r else (f"{ratio:.2f}×" if ratio is not None else "n/a")
        else:
            med, rng, ratio_s = r.status, "", ""
        lines.append(f"| {c.workload} | {c.system} | {c.durability} | {med} | {c.unit} | {rng} | {ratio_s} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class Target:
    """One section-8 target judged from this run's figures."""

    name: str
    goal: str
    measured: str
    met: bool | None  # None: could not be judged (a figure is missing)


def _find(results: Sequence[CaseResult], workload: str, system_prefix: str) -> float | None:
    for r in results:
        if r.case.workload == workload and r.case.system.startswith(system_prefix) and r.values:
            return r.median
    return None


def targets(results: Sequence[CaseResult], idle_shard_bytes: int | None, open_rows: int) -> list[Target]:
    """Judge the SPEC section 8 targets from figures of this run."""
    out: list[Target] = []
    scan = _find(results, "lease_scan/10k_outstanding", "armdb")
    scan_sql = _find(results, "lease_scan/10k_outstanding", "sqlite3")
    if scan is not None:
        faster = scan_sql is not None and scan < scan_sql
        peer = f", SQLite {scan_sql:,.1f} µs" if scan_sql is not None else ""
        out.append(Target("lease_scan/10k_outstanding", "≤ 20 µs and faster than raw SQLite",
                          f"{scan:,.1f} µs{peer}", scan <= 20 and faster))
    # Each target is judged on the row it names: "no fsync" on the tuned rows, "at the
    # defaults" on the default rows (docs/spec.md, section 8).
    for name, workload, system, floor, times in (
            ("cycle/fixed, no fsync (tuned row)", "cycle/fixed", ARMDB_FIXED_TUNED, 200_000, 15),
            ("cycle/var-100B, no fsync (tuned row)", "cycle/var-100B", ARMDB_VAR_TUNED, 80_000, 6),
            ("cycle/var-100B at the defaults", "cycle/var-100B", ARMDB_VAR, None, 4)):
        a = _find(results, workload, system)
        s = _find(results, workload, "sqlite3")
        if a is not None:
            ratio = a / s if s else None
            ratio_s = f" = {ratio:.2f}× SQLite NORMAL" if ratio is not None else ""
            goal = (f"≥ {floor:,} cycles/s and " if floor else "") + f"≥ {times}× raw SQLite"
            met = (floor is None or a >= floor) and (ratio >= times if ratio is not None else None)
            out.append(Target(name, goal, f"{a:,.0f} cycles/s{ratio_s}", met))
    for name, workload, system, peer, times in (
            ("cycle/fixed at the defaults vs localqueue", "cycle/fixed", ARMDB_FIXED, "localqueue", 5),
            ("cycle/var-100B at the defaults vs localqueue", "cycle/var-100B", ARMDB_VAR, "localqueue", 5),
            (f"push_many({PUT_MANY}) fixed NumPy vs put_many", f"push_many/fixed-numpy-{PUT_MANY}", ARMDB_FIXED,
             "localqueue", 3),
            (f"push_many({PUT_MANY}) var vs put_many", f"push_many/var-100B-{PUT_MANY}", ARMDB_VAR, "localqueue", 3)):
        a = _find(results, workload, system)
        p = _find(results, workload, peer)
        if a is not None and p is not None:
            out.append(Target(name, f"≥ {times}× localqueue", f"{a:,.0f}/s vs {p:,.0f}/s = {a / p:.2f}×",
                              a / p >= times))
    batch_targets: tuple[tuple[str, int, int | None], ...] = (
        ("batch/var-100B-64", 300_000, 3), ("batch/fixed-numpy-1024", 2_000_000, None))
    for workload, floor, least in batch_targets:
        a = _find(results, workload, "armdb")
        s = _find(results, workload, "sqlite3")
        if a is not None:
            ratio = a / s if s else None
            ratio_s = f" = {ratio:.2f}× SQLite batched" if ratio is not None else ""
            goal = f"≥ {floor:,} jobs/s" + (f" (≥ {least}× SQLite batched)" if least else "")
            out.append(Target(workload, goal, f"{a:,.0f} jobs/s{ratio_s}",
                              a >= floor and (least is None or ratio is None or ratio >= least)))
    sb = _find(results, f"serve/batch-var-100B-{SERVE_BATCH}", "armdb var queue through db.serve(), one client")
    if sb is not None:
        direct = _find(results, f"serve/batch-var-100B-{SERVE_BATCH}", "armdb var queue, direct")
        remote = _find(results, f"serve/batch-var-100B-{SERVE_BATCH}", "armdb var queue through db.serve(), the client in")
        beside = f" (direct calls {direct:,.0f} jobs/s: {sb / direct:.2f}× them)" if direct else ""
        if remote is not None:
            beside += f"; the client in another process {remote:,.0f} jobs/s"
        out.append(Target(f"serve/batch-var-100B-{SERVE_BATCH}, one client through the socket", "≥ 100,000 jobs/s",
                          f"{sb:,.0f} jobs/s{beside}", sb >= 100_000))
    acked = _find(results, f"serve/batch-var-100B-{SERVE_BATCH}", "armdb var queue with lease_batch(ack=), through")
    if acked is not None:
        # The same jobs, pushes, leases and acks, with the acks carried by the next lease
        # request (two round trips a batch instead of three): judged on its own line.
        out.append(Target(f"serve/batch-var-100B-{SERVE_BATCH}, one client through the socket, the acks carried by "
                          f"lease_batch(ack=)", "≥ 100,000 jobs/s", f"{acked:,.0f} jobs/s", acked >= 100_000))
    w2 = _find(results, "worker/cpu-1ms", "armdb Worker(processes=2)")
    w1 = _find(results, "worker/cpu-1ms", "armdb Worker(processes=1)")
    if w2 is not None and w1 is not None:
        b2 = _find(results, "worker/cpu-1ms", "no queue: the handler alone, 2")
        b1 = _find(results, "worker/cpu-1ms", "no queue: the handler alone, 1")
        ceiling = f" (the machine allowed {b2 / b1:.2f}× to the handler alone)" if b2 and b1 else ""
        # Judged only when two processes of the bare handler get the speed-up themselves: on
        # a machine whose cores are busy elsewhere no queue can show it.
        judged: bool | None = w2 / w1 >= 1.8
        if b2 and b1 and b2 / b1 < 1.8:
            judged = None
        out.append(Target("worker/cpu-1ms, Worker(processes=2) vs one process", "≥ 1.8×",
                          f"{w2:,.0f}/s vs {w1:,.0f}/s = {w2 / w1:.2f}×{ceiling}", judged))
    for procs in _bench_pg.PROCESSES:  # issue 19: armdb.pg batched vs the best PostgreSQL peer
        workload = _bench_pg.WORKLOADS[("batch", procs)]
        a = _find(results, workload, "armdb.pg")
        peers = [(r.median, r.case.system.split(" (")[0].split(":")[0]) for r in results
                 if r.case.workload == workload and not r.case.system.startswith("armdb") and r.median]
        if a is not None and peers:
            best, name = max(peers)
            out.append(Target(f"{workload}, armdb.pg vs the best peer", "≥ 1.5× the best peer",
                              f"{a:,.0f} jobs/s vs {name} {best:,.0f} = {a / best:.2f}×", a / best >= 1.5))
        a_ack = _find(results, workload, "armdb.pg (lease_batch(n, ack=")
        if a_ack is not None and peers:
            best, name = max(peers)
            out.append(Target(f"{workload}, armdb.pg with lease_batch(ack=) vs the best peer", "≥ 1.5× the best peer",
                              f"{a_ack:,.0f} jobs/s vs {name} {best:,.0f} = {a_ack / best:.2f}×", a_ack / best >= 1.5))
    d = _find(results, "push/durable", "armdb")
    raw = _find(results, "push/durable", "raw")
    if d is not None and raw is not None:
        out.append(Target("push/durable, one thread", "≥ 0.8× raw fdatasync",
                          f"{d:,.0f}/s vs {raw:,.0f}/s = {d / raw:.2f}×", d / raw >= 0.8))
    t1 = _find(results, "tx/2-row-durable", "armdb")
    t8 = _find(results, "tx/2-row-durable-8-threads", "armdb")
    if t1 is not None and t8 is not None:
        out.append(Target("durable commits, 8 threads (group commit)", "≥ 4× the one-thread durable rate",
                          f"{t8:,.0f}/s vs {t1:,.0f}/s = {t8 / t1:.2f}×", t8 / t1 >= 4))
    if idle_shard_bytes is not None:
        out.append(Target("RAM per idle queue shard", "exactly 400,000 bytes", f"{idle_shard_bytes:,} bytes",
                          idle_shard_bytes == 400_000))
    secs = _find(results, "cold_open", "armdb")
    if secs is not None:
        # Judged only at the target's size; a smaller run is reported, not judged.
        out.append(Target("cold open", "≤ 2 s with 1M live rows", f"{secs:.3f} s with {open_rows:,} rows",
                          secs <= 2.0 if open_rows >= 1_000_000 else None))
    return out


def targets_table(ts: Sequence[Target]) -> str:
    lines = ["| target | goal | measured | met |", "|---|---|---|---|"]
    for t in ts:
        met = "yes" if t.met else ("not judged" if t.met is None else "no")
        lines.append(f"| {t.name} | {t.goal} | {t.measured} | {met} |")
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "sqlite": sqlite3.sqlite_version,
        "numpy": np.__version__,
    }


def main(*, quick: bool = False, json_path: str | None = None, only: str | None = None,
         sizes: Sizes | None = None, dsn: str | None = None) -> int:
    """``python -m armdb bench``: run, print the markdown tables, optionally write JSON.
    ``dsn``: the PostgreSQL server of the postgres rows (else the bench starts one)."""
    sizes = sizes or (QUICK if quick else FULL)
    _bench_pg.set_dsn(dsn)
    cases = select(CASES + PG_CASES, only)
    if not cases:
        print(f"armdb bench: no workload matches {only!r}", file=sys.stderr)
        return 2
    bar = ProgressBar(sum(c.repeats_in(sizes) for c in cases), "bench")
    started = time.perf_counter()
    results = run(sizes, cases, lambda done, total, label: bar.update(done, label))
    bar.close(bar.total, "done")
    idle: int | None = None
    if only is None:
        with tempfile.TemporaryDirectory(prefix="armdb-bench-") as d:
            idle = armdb_idle_shard_bytes(d)
    ts = targets(results, idle, sizes.open_rows)
    elapsed = time.perf_counter() - started
    info = machine_info()
    print(f"armdb bench{' --quick' if quick else ''}: {info['cpus']} CPUs, Python {info['python']}, "
          f"SQLite {info['sqlite']}; median of {sizes.repeats} repeats ({sizes.durable_repeats} for power-loss "
          f"safe rows), each in a fresh directory "
          f"(cold_open: one build of {sizes.open_rows:,} rows, best of 2 opens); {elapsed:.0f} s")
    print()
    print(markdown_table(results))
    print()
    print(targets_table(ts))
    missing = sorted({r.case.requires for r in results if r.status.startswith("not installed") and r.case.requires})
    if missing:
        print()
        print(f"Peers not installed ({', '.join(missing)}): {INSTALL_HINT}")
    if json_path:
        doc = {
            "command": "python -m armdb bench" + (" --quick" if quick else ""),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": info,
            "sizes": sizes.__dict__,
            "results": [r.to_dict() for r in results],
            "targets": [t.__dict__ for t in ts],
            "idle_shard_bytes": idle,
            "elapsed_s": elapsed,
        }
        Path(json_path).write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"\nraw figures written to {json_path}")
    return 0
