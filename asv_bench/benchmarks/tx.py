"""Transaction benchmarks: 2-row commits (a map put and a fixed-queue push), with and
without ``durable()``, from one thread and from 8 threads (group commit)."""

from __future__ import annotations

import tempfile
import threading

import numpy as np

from armdb import Config, Db, FixedConfig, QueueConfig, queue

from .common import BATCH, fixed_payload

TxPing = queue("asv_tx", payload=np.dtype([("doc", "<u8"), ("flags", "<u4")]))


class _TxFixture:
    def __init__(self) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="armdb-asv-")
        self.db = Db.open(self.tmp.name)
        self.map = self.db.open_map("effects", Config.balanced().shard_count(8).enable_fsync(False).build())
        header = FixedConfig.balanced().shard_count(8).grow_step(16_384).enable_fsync(False).build()
        self.q = self.db.open_queue(TxPing, QueueConfig.balanced().header_config(header).build())

    def commit(self, i: int, durable: bool) -> None:
        tx = self.db.tx().put(self.map, i, "effect").push(self.q, fixed_payload(i))
        if durable:
            tx.durable()
        tx.commit()

    def close(self) -> None:
        try:
            self.db.shutdown()
        finally:
            self.tmp.cleanup()


class TxCommit:
    """``n`` commits from one thread (``n`` = BATCH, or BATCH // 10 when durable)."""

    params = [[False, True]]
    param_names = ["durable"]
    number = 1

    def setup(self, durable: bool) -> None:
        self.fx = _TxFixture()
        self.n = BATCH // 10 if durable else BATCH

    def teardown(self, durable: bool) -> None:
        self.fx.close()

    def time_commit(self, durable: bool) -> None:
        for i in range(self.n):
            self.fx.commit(i, durable)


class TxCommitThreads:
    """BATCH // 10 durable commits shared by 8 threads (several share one log sync)."""

    number = 1
    threads = 8

    def setup(self) -> None:
        self.fx = _TxFixture()
        self.n = BATCH // 10

    def teardown(self) -> None:
        self.fx.close()

    def _run(self) -> None:
        def work(t: int) -> None:
            for i in range(t, self.n, self.threads):
                self.fx.commit(i, True)

        pool = [threading.Thread(target=work, args=(t,)) for t in range(self.threads)]
        for th in pool:
            th.start()
        for th in pool:
            th.join()

    def time_commit_8_threads(self) -> None:
        self._run()

    def track_commits_per_log_sync(self) -> float:
        """Durable commits per log ``fdatasync`` with 8 threads (1.0: no group commit)."""
        log = self.fx.db.txlog
        c0, s0 = log.commits, log.syncs
        self._run()
        return (log.commits - c0) / max(1, log.syncs - s0)
