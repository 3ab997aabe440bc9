"""Batches (SPEC Q31, Q32) and lease extension (Q29).

``push_many`` → ``lease_batch`` → ``ack_many`` over ``BATCH`` jobs at batch sizes 1, 64
and 1024, for a fixed queue fed NumPy arrays and a var queue fed 100-byte dicts; and
``extend`` of one held lease.  Divide by ``BATCH`` for a per-job figure (asv reports the
time of the whole call).  ``python -m armdb bench --only batch`` runs the same workloads
beside SQLite doing the same batches in three transactions.  Like the bench's ``batch``
and ``extend`` rows, these run at the defaults a user gets (``QueueConfig.balanced()``,
nothing set) and warm up in setup before the timed call.
"""

from __future__ import annotations

import numpy as np

from .common import BATCH, WARMUP, FixedJobs, QueueFixture, body

SIZES = [1, 64, 1024]


class BatchCycle:
    """``BATCH`` jobs through push_many(size) → lease_batch(size) → ack_many."""

    number = 1
    warmup_time = 0.0
    repeat = (3, 20, 20.0)
    params = [["fixed", "var"], SIZES]
    param_names = ["flavour", "size"]

    def setup(self, flavour: str, size: int) -> None:
        self.fx = QueueFixture(flavour, config="defaults")
        if flavour == "fixed":
            arr = np.zeros(size, dtype=FixedJobs.dtype)
            arr["doc"] = np.arange(size)
            self.payloads: object = arr
        else:
            self.payloads = [body(i) for i in range(size)]
        self.rounds = max(1, BATCH // size)
        for _ in range(3):  # the bench's warm-up
            self.fx.queue.push_many(self.payloads)
            self.fx.queue.ack_many(self.fx.queue.lease_batch(size))

    def teardown(self, flavour: str, size: int) -> None:
        self.fx.close()

    def time_batch_cycle(self, flavour: str, size: int) -> None:
        q, payloads = self.fx.queue, self.payloads
        for _ in range(self.rounds):
            q.push_many(payloads)
            q.ack_many(q.lease_batch(size))


class LonePushBatchAck:
    """``BATCH`` jobs pushed one by one, leased and acked in batches of ``size``: a
    producer's lone pushes and a worker's batches on one queue.  Its ids and gsns are
    drawn alternately by the lone paths and the batches (``SeqMap.draw_block`` takes a
    batch's from the rest of the reserved block; when it threw that rest away, this
    workload reserved ids on disk in the foreground every few dozen calls: 337 µs a
    job at size 1, 23 µs at size 8, docs/performance.md, round 10)."""

    number = 1
    warmup_time = 0.0
    repeat = (3, 20, 20.0)
    params = [[1, 8, 64]]
    param_names = ["size"]

    def setup(self, size: int) -> None:
        self.fx = QueueFixture("var", config="defaults")
        self.payloads = [body(i) for i in range(size)]
        self.rounds = max(1, BATCH // size)
        for _ in range(3):
            self.time_lone_push_batch_ack(size)

    def teardown(self, size: int) -> None:
        self.fx.close()

    def time_lone_push_batch_ack(self, size: int) -> None:
        q, payloads = self.fx.queue, self.payloads
        for _ in range(self.rounds):
            for p in payloads:
                q.push(p)
            q.ack_many(q.lease_batch(size))


class Extend:
    """``BATCH`` extends of one held lease (a header update each)."""

    number = 1
    warmup_time = 0.0
    repeat = (3, 20, 20.0)

    def setup(self) -> None:
        self.fx = QueueFixture("fixed", config="defaults")
        self.fx.queue.push((1, 1))
        (self.lease,) = self.fx.queue.lease(1)
        for _ in range(WARMUP):  # the bench's warm-up
            self.fx.queue.extend(self.lease, by=60)

    def teardown(self) -> None:
        self.fx.close()

    def time_extend(self) -> None:
        q, lease = self.fx.queue, self.lease
        for _ in range(BATCH):
            q.extend(lease, by=60)
