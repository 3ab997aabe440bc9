"""Through the socket (SPEC P1, P2) and in worker processes (P6).

``ServeCycle``: ``BATCH`` jobs of the var cycle through ``db.serve()`` and one client, one
job at a time (push → lease → ack) and in batches of 64 (push_many → lease_batch →
ack_many); ``queue.LeaseAck`` and ``batches.BatchCycle`` time the direct calls.
``WorkerCpu``: ``CPU_JOBS`` jobs of about 1 ms of pure Python each through
``Worker(processes=N)``, from the push to the last ack (the processes are started and
connected in setup).  ``python -m armdb bench --only serve/`` and ``--only worker/`` run the
same workloads beside the direct calls, localqueue and the handler alone.  At the defaults
a user gets (``QueueConfig.balanced()``).
"""

from __future__ import annotations

import tempfile
import time

import armdb
from armdb import _bench

from .common import BATCH, QUICK, WARMUP, VarJobs, body

SERVE_BATCH = 64
CPU_JOBS = 40 if QUICK else 400


class ServeCycle:
    """``BATCH`` var jobs through the socket, one client."""

    number = 1
    warmup_time = 0.0
    repeat = (3, 20, 20.0)
    params = [1, SERVE_BATCH]
    param_names = ["size"]

    def setup(self, size: int) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="armdb-asv-")
        self.db = armdb.Db.open(self.tmp.name)
        self.db.open_queue(VarJobs)
        self.db.serve()
        self.client = armdb.connect(self.tmp.name)
        self.q = self.client.open_queue(VarJobs)
        self.payloads = [body(i) for i in range(size)]
        for _ in range(max(3, WARMUP // size)):
            self._round(size)

    def _round(self, size: int) -> None:
        q = self.q
        if size == 1:
            q.push(self.payloads[0])
            (lease,) = q.lease(1)
            q.ack(lease)
        else:
            q.push_many(self.payloads)
            q.ack_many(q.lease_batch(size))

    def teardown(self, size: int) -> None:
        try:
            self.client.close()
            self.db.shutdown()
        finally:
            self.tmp.cleanup()

    def time_serve_cycle(self, size: int) -> None:
        for _ in range(max(1, BATCH // size)):
            self._round(size)


class WorkerCpu:
    """``CPU_JOBS`` CPU-bound jobs through ``Worker(processes=N)``."""

    number = 1
    warmup_time = 0.0
    repeat = (3, 10, 30.0)
    timeout = 300
    params = [1, 2]
    param_names = ["processes"]

    def setup(self, processes: int) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="armdb-asv-")
        self.db = armdb.Db.open(self.tmp.name)
        self.q = self.db.open_queue(VarJobs)
        srv = self.db.serve()
        self.worker = armdb.Worker(self.db, VarJobs, _bench.cpu_job, processes=processes, batch=4).start()
        deadline = time.monotonic() + 120
        while srv.connections() < processes:
            if time.monotonic() > deadline or self.worker.error is not None:
                raise RuntimeError(f"the worker processes did not connect: {self.worker.error!r}")
            time.sleep(0.01)
        self.payloads = [body(i) for i in range(CPU_JOBS)]
        self.time_jobs(processes)  # warm-up: every process has handled jobs

    def teardown(self, processes: int) -> None:
        try:
            self.worker.stop()
            self.worker.join(60)
            self.db.shutdown()
        finally:
            self.tmp.cleanup()

    def time_jobs(self, processes: int) -> None:
        target = self.worker.counts()[0] + CPU_JOBS
        self.q.push_many(self.payloads)
        deadline = time.monotonic() + 120
        while self.worker.counts()[0] < target:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the worker acked {self.worker.counts()[0]} of {target} jobs")
            time.sleep(0.001)
