"""The PostgreSQL workloads of ``python -m armdb bench --only postgres`` (issue 19).

One local PostgreSQL server serves every row: the bench starts it itself on first use
(``initdb`` + ``pg_ctl`` into a temporary directory on a Unix socket, as the tests do:
armdb/_pgserver.py) and stops it at exit, or uses the server of ``--dsn``.  Each repeat
of a row runs in a fresh database, created for it and dropped after it.

Workloads, each with 1 and with 4 worker processes sharing one queue (the processes
connect and warm up before the clock starts; the clock stops when the last one is done):

``postgres/cycle-var-100B``
    per job: push one payload, lease one job, ack it.
``postgres/batch-var-100B-64``
    batched: push 64 payloads in one call, lease up to 64, ack what was leased in one
    call, until the process has acked its share.

The payload is the 100-byte msgpack dict of the other var rows (``_bench.body``; for
procrastinate, whose arguments are JSON, the same dict as its task's keyword arguments).
Every row decodes the payloads it leases, and every lease is a real lease (the row
stays in its table, marked taken, until the ack deletes it or a timeout gives it back).

Systems, all through psycopg 3 on the same server at the same durability: the server's
default ``synchronous_commit = on`` with ``fsync = on`` (every commit that returned is on
disk), every statement its own transaction (autocommit) unless the library opens one:

* ``armdb.pg`` at its defaults (``armdb.pg.connect(dsn)``, ``open_queue(spec)``).
* ``armdb.pg`` with ``lease_batch(n, ack=previous)``: each lease acks the leases of the
  call before it in the same commit (per job: ``lease_batch(1, ack=previous)``); the
  last ones are acked with ``ack_many`` before the process reports (inside the clock).
* **plain SQL**: a pgmq-style table written plainly here, the honest baseline: insert;
  lease = ``UPDATE ... SET vt = now() + timeout WHERE id IN (SELECT id ... WHERE vt <=
  now() ORDER BY id LIMIT n FOR UPDATE SKIP LOCKED) RETURNING``; ack = ``DELETE ...
  WHERE id = ANY(%s)``.  Its statements are prepared (psycopg prepares a statement from
  its sixth use) like armdb's.
* **pgqueuer** (its ``Queries``: ``enqueue``, ``dequeue``, ``log_jobs``, the calls its
  worker makes; ``Durability.durable``, its default) and **procrastinate** (its
  ``JobManager``: ``batch_defer_jobs_async``, ``fetch_job``, ``finish_job(...,
  delete_job=True)``; it fetches one job per call, so its batched row defers 64 at once
  and fetches and finishes them one by one).  Both are optional (the ``bench`` extra).
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import multiprocessing
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import msgpack

from . import _pgserver
from .qspec import queue

try:
    from .pg import connect as pg_connect
except ImportError:  # no psycopg (the postgres extra): every row says how to install it
    pg_connect = None  # type: ignore[assignment]

__all__ = ["BATCH", "PROCESSES", "SYSTEMS", "WORKLOADS", "DURABILITY", "set_dsn", "run_workload"]

BATCH = 64
PROCESSES = (1, 4)
DURABILITY = "commit on disk (synchronous_commit=on, fsync=on)"
LEASE_SECONDS = 30  # the lease timeout of every system (armdb's default)
BenchPgVar = queue("bench_pg_var", payload=dict, var=True)

# Workload names; "postgres" in each, for --only postgres.
WORKLOADS: dict[tuple[str, int], str] = {
    (kind, procs): f"postgres/{kind}-var-100B{'-' + str(BATCH) if kind == 'batch' else ''}-{procs}proc"
    for kind in ("cycle", "batch") for procs in PROCESSES
}


def body(i: int) -> dict[str, Any]:
    """The var rows' payload (the same as armdb._bench.body): msgpack packs it into about 100 bytes."""
    return {"doc_id": i, "reason": "edited", "tags": ["search", "reindex"], "text": f"{i:035d}", "priority": 3}


# -- the server ---------------------------------------------------------------------------------------------


_dsn: str | None = os.environ.get("ARMDB_BENCH_PG_DSN") or None
_server: _pgserver.PgServer | None = None
_server_lock = threading.Lock()
_db_serial = itertools.count(1)


def set_dsn(dsn: str | None) -> None:
    """Use the server at ``dsn`` (a libpq string whose database may create databases)
    instead of starting one."""
    global _dsn
    _dsn = dsn or None


def _stop_server() -> None:
    global _server
    if _server is not None:
        _server.close()
        _server = None


def server_dsn() -> str:
    """The DSN of the bench's server: ``--dsn``, else one started now (once per run)."""
    global _server
    if _dsn is not None:
        return _dsn
    with _server_lock:
        if _server is None:
            _server = _pgserver.start()
            atexit.register(_stop_server)
            # A bench stopped with SIGTERM still stops its server (atexit runs on SystemExit).
            if threading.current_thread() is threading.main_thread() \
                    and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
                signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        return _server.dsn


def _with_db(dsn: str, dbname: str) -> str:
    from psycopg.conninfo import make_conninfo  # the postgres extra, imported where it is used

    return make_conninfo(dsn, dbname=dbname)


class _FreshDatabase:
    """A database of its own for one repeat, dropped afterwards."""

    def __init__(self) -> None:
        import psycopg  # the postgres extra, imported where it is used

        self._psycopg = psycopg
        self.admin = server_dsn()
        self.name = f"armdb_bench_{os.getpid()}_{next(_db_serial)}"
        with psycopg.connect(self.admin, autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{self.name}"')
        self.dsn = _with_db(self.admin, self.name)

    def __enter__(self) -> str:
        return self.dsn

    def __exit__(self, *exc: object) -> None:
        with self._psycopg.connect(self.admin, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')


# -- the systems --------------------------------------------------------------------------------------------
#
# A system is a class built in the worker process from the database's DSN, with
# ``cycle(i)`` (push one, lease until one is leased, ack it) and ``batch(i)`` (push
# BATCH, lease and ack until BATCH were acked), both returning the jobs acked, and
# ``close()``; ``setup(dsn)`` runs once per database before the processes start.


class ArmdbPg:
    """armdb.pg at its defaults."""

    @staticmethod
    def setup(dsn: str) -> None:
        with pg_connect(dsn) as db:
            db.open_queue(BenchPgVar)

    def __init__(self, dsn: str) -> None:
        self.db = pg_connect(dsn, pool_size=1)
        self.q = self.db.open_queue(BenchPgVar)

    def cycle(self, i: int) -> int:
        q = self.q
        q.push(body(i))
        while not (got := q.lease(1)):
            pass
        q.ack(got[0])
        return 1

    def batch(self, i: int) -> int:
        q = self.q
        q.push_many([body(i + k) for k in range(BATCH)])
        done = 0
        while done < BATCH:
            b = q.lease_batch(BATCH - done)
            if len(b):
                done += q.ack_many(b)
        return done

    def close(self) -> None:
        self.db.close()


class ArmdbPgAck(ArmdbPg):
    """armdb.pg at its defaults, each lease acking the previous one: ``lease_batch(n,
    ack=previous)`` (the acks and the lease in one transaction, one commit).  The leases
    of a call are acked by the next call; :meth:`finish` acks the last ones."""

    def __init__(self, dsn: str) -> None:
        super().__init__(dsn)
        self.pending: Any = None

    def _lease(self, n: int) -> int:
        """Lease up to ``n``, acking the pending leases; returns how many were acked."""
        acked = len(self.pending) if self.pending is not None else 0
        self.pending = self.q.lease_batch(n, ack=self.pending)
        return acked

    def cycle(self, i: int) -> int:
        self.q.push(body(i))
        acked = self._lease(1)
        while not len(self.pending):
            acked += self._lease(1)
        return acked

    def batch(self, i: int) -> int:
        self.q.push_many([body(i + k) for k in range(BATCH)])
        leased = acked = 0
        while leased < BATCH:
            acked += self._lease(BATCH - leased)
            leased += len(self.pending)
        return acked

    def outstanding(self) -> int:
        return len(self.pending) if self.pending is not None else 0

    def finish(self) -> int:
        """Ack what the last call leased."""
        acked = self.q.ack_many(self.pending) if self.pending is not None else 0
        self.pending = None
        return acked


class PlainSql:
    """A pgmq-style ``SKIP LOCKED`` queue: the SQL a careful user writes by hand."""

    TABLE = "plain_jobs"

    @staticmethod
    def setup(dsn: str) -> None:
        import psycopg  # the postgres extra, imported where it is used

        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(f"CREATE TABLE {PlainSql.TABLE} (id bigserial PRIMARY KEY, "
                      "vt timestamptz NOT NULL DEFAULT now(), read_ct integer NOT NULL DEFAULT 0, "
                      "enqueued_at timestamptz NOT NULL DEFAULT now(), message bytea NOT NULL)")
            c.execute(f"CREATE INDEX ON {PlainSql.TABLE} (vt)")

    def __init__(self, dsn: str) -> None:
        import psycopg  # the postgres extra, imported where it is used

        self.c = psycopg.connect(dsn, autocommit=True)
        t = self.TABLE
        self.push_sql = f"INSERT INTO {t} (message) VALUES (%s) RETURNING id"
        self.push_many_sql = f"INSERT INTO {t} (message) SELECT unnest(%s::bytea[]) RETURNING id"
        self.lease_sql = (
            f"UPDATE {t} SET vt = now() + make_interval(secs => {LEASE_SECONDS}), read_ct = read_ct + 1 "
            f"WHERE id IN (SELECT id FROM {t} WHERE vt <= now() ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED) "
            "RETURNING id, read_ct, message")
        self.ack_sql = f"DELETE FROM {t} WHERE id = ANY(%s)"

    def _lease(self, n: int) -> list[int]:
        rows = self.c.execute(self.lease_sql, (n,)).fetchall()
        for r in rows:
            msgpack.unpackb(r[2])
        return [r[0] for r in rows]

    def cycle(self, i: int) -> int:
        self.c.execute(self.push_sql, (msgpack.packb(body(i)),))
        while not (ids := self._lease(1)):
            pass
        self.c.execute(self.ack_sql, (ids,))
        return 1

    def batch(self, i: int) -> int:
        self.c.execute(self.push_many_sql, ([msgpack.packb(body(i + k)) for k in range(BATCH)],)).fetchall()
        done = 0
        while done < BATCH:
            ids = self._lease(BATCH - done)
            if ids:
                self.c.execute(self.ack_sql, (ids,))
                done += len(ids)
        return done

    def close(self) -> None:
        self.c.close()


class _Async:
    """A system with an asyncio API, driven from a synchronous loop on its own event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        self.loop.close()


class PgQueuer(_Async):
    """pgqueuer's queries, as its worker calls them."""

    ENTRYPOINT = "bench"

    @staticmethod
    def setup(dsn: str) -> None:
        async def install() -> None:
            import psycopg  # the postgres extra, imported where it is used
            from pgqueuer.db import PsycopgDriver  # an optional peer (the bench extra)
            from pgqueuer.queries import Queries

            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
                await Queries(PsycopgDriver(c)).install()

        asyncio.run(install())

    def __init__(self, dsn: str) -> None:
        super().__init__()
        import psycopg  # the postgres extra, imported where it is used
        from pgqueuer.db import PsycopgDriver  # an optional peer (the bench extra)
        from pgqueuer.queries import EntrypointExecutionParameter, Queries

        self.conn = self.run(psycopg.AsyncConnection.connect(dsn, autocommit=True))
        self.q = Queries(PsycopgDriver(self.conn))
        self.entrypoints: Any = {self.ENTRYPOINT: EntrypointExecutionParameter(concurrency_limit=0)}
        self.qm_id: Any = uuid.uuid4()
        self.heartbeat = timedelta(seconds=LEASE_SECONDS)

    async def _lease_ack(self, want: int) -> int:
        done = 0
        while done < want:
            jobs = await self.q.dequeue(want - done, self.entrypoints, self.qm_id, None, self.heartbeat)
            for j in jobs:
                msgpack.unpackb(j.payload)
            if jobs:
                await self.q.log_jobs([(j, "successful", None) for j in jobs])
                done += len(jobs)
        return done

    async def _cycle(self, i: int) -> int:
        await self.q.enqueue(self.ENTRYPOINT, msgpack.packb(body(i)))
        return await self._lease_ack(1)

    async def _batch(self, i: int) -> int:
        await self.q.enqueue([self.ENTRYPOINT] * BATCH, [msgpack.packb(body(i + k)) for k in range(BATCH)],
                             [0] * BATCH)
        return await self._lease_ack(BATCH)

    def cycle(self, i: int) -> int:
        return int(self.run(self._cycle(i)))

    def batch(self, i: int) -> int:
        return int(self.run(self._batch(i)))

    def close(self) -> None:
        self.run(self.conn.close())
        super().close()


class Procrastinate(_Async):
    """procrastinate's job manager, as its worker calls it (one fetch per job)."""

    QUEUE = "bench"
    SHARE = 0.1

    @staticmethod
    def _app(dsn: str) -> Any:
        import procrastinate  # an optional peer (the bench extra)

        return procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn, min_size=1, max_size=1))

    @staticmethod
    def setup(dsn: str) -> None:
        async def install() -> None:
            app = Procrastinate._app(dsn)
            async with app.open_async():
                await app.schema_manager.apply_schema_async()

        asyncio.run(install())

    def __init__(self, dsn: str) -> None:
        super().__init__()
        from procrastinate import jobs  # an optional peer (the bench extra)

        self.jobs = jobs
        self.app = self._app(dsn)
        self.run(self.app.open_async())
        self.mgr = self.app.job_manager
        self.worker_id = self.run(self.mgr.register_worker())

    def _job(self, i: int) -> Any:
        return self.jobs.Job(id=None, queue=self.QUEUE, lock=None, queueing_lock=None, task_name="bench",
                             task_kwargs=body(i))

    async def _fetch_finish(self, want: int) -> int:
        done = 0
        while done < want:
            job = await self.mgr.fetch_job([self.QUEUE], self.worker_id)
            if job is None:
                continue
            dict(job.task_kwargs)
            await self.mgr.finish_job(job, self.jobs.Status.SUCCEEDED, delete_job=True)
            done += 1
        return done

    async def _cycle(self, i: int) -> int:
        await self.mgr.defer_job_async(self._job(i))
        return await self._fetch_finish(1)

    async def _batch(self, i: int) -> int:
        await self.mgr.batch_defer_jobs_async([self._job(i + k) for k in range(BATCH)])
        return await self._fetch_finish(BATCH)

    def cycle(self, i: int) -> int:
        return int(self.run(self._cycle(i)))

    def batch(self, i: int) -> int:
        return int(self.run(self._batch(i)))

    def close(self) -> None:
        self.run(self.mgr.unregister_worker(self.worker_id))
        self.run(self.app.close_async())
        super().close()


# (system column, class, module the row requires beyond psycopg).  A class's ``SHARE``
# scales the jobs of a repeat: procrastinate does a few hundred a second, and a rate
# needs no more than a few seconds of work.
SYSTEMS: list[tuple[str, Any, str | None]] = [
    ("armdb.pg (defaults)", ArmdbPg, None),
    ("armdb.pg (lease_batch(n, ack=previous): ack and lease in one commit)", ArmdbPgAck, None),
    ("plain SQL: pgmq-style SKIP LOCKED table", PlainSql, None),
    ("pgqueuer (Queries: enqueue/dequeue/log_jobs)", PgQueuer, "pgqueuer"),
    ("procrastinate (JobManager: defer/fetch_job/finish_job, one fetch per job)", Procrastinate, "procrastinate"),
]


# -- running ------------------------------------------------------------------------------------------------


def _child(cls: Any, dsn: str, kind: str, jobs: int, warmup: int, offset: int, ready: Any, start: Any,
           done: Any) -> None:
    """One worker process: connect, warm up, wait for the start, do ``jobs`` jobs."""
    system = cls(dsn)
    try:
        step: Callable[[int], int] = system.cycle if kind == "cycle" else system.batch
        per = 1 if kind == "cycle" else BATCH
        # A system that acks a call's leases in its next call (ArmdbPgAck) holds some
        # leases between calls: ``outstanding()`` of them, acked by ``finish()``.
        finish: Callable[[], int] = getattr(system, "finish", lambda: 0)
        outstanding: Callable[[], int] = getattr(system, "outstanding", lambda: 0)
        for w in range(warmup):
            step(offset + w * per)
        finish()
        ready.release()
        start.wait()
        acked = 0
        i = offset + warmup * per
        while acked < jobs:
            acked += step(i)
            i += per
            if acked + outstanding() >= jobs:  # the last leases are acked now, not by a next call
                acked += finish()
        with done.get_lock():
            done.value += acked
    finally:
        system.close()


def run_workload(cls: Any, kind: str, jobs: int, processes: int, warmup: int = 20) -> float:
    """Jobs per second of ``processes`` processes running ``kind`` on ``cls`` in a fresh
    database; ``jobs`` in all (times the class's ``SHARE``), split evenly (each share
    rounded up to whole batches)."""
    per = 1 if kind == "cycle" else BATCH
    jobs = int(jobs * getattr(cls, "SHARE", 1.0))
    share = max(1, -(-jobs // (processes * per))) * per
    with _FreshDatabase() as dsn:
        cls.setup(dsn)
        ctx = multiprocessing.get_context("spawn")
        ready, start, done = ctx.Semaphore(0), ctx.Event(), ctx.Value("q", 0)
        procs = [ctx.Process(target=_child, args=(cls, dsn, kind, share, warmup, p * 10_000_000, ready, start, done),
                             daemon=True) for p in range(processes)]
        for p in procs:
            p.start()
        try:
            deadline = time.monotonic() + 120
            for _ in procs:
                while not ready.acquire(timeout=0.5):
                    if any(p.exitcode is not None for p in procs) or time.monotonic() > deadline:
                        raise RuntimeError(f"a benchmark process failed to start: exit codes "
                                           f"{[p.exitcode for p in procs]}")
            t0 = time.perf_counter()
            start.set()
            for p in procs:
                p.join(600)
            elapsed = time.perf_counter() - t0
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"benchmark processes exited with {[p.exitcode for p in procs]}")
        if done.value < share * processes:
            raise RuntimeError(f"the processes acked {done.value} of {share * processes} jobs")
        return done.value / elapsed
