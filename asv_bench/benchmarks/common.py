"""Helpers shared by the asv benchmarks: declarations, configs, sizes, seeds, RSS.

Set ``ARMDB_ASV_QUICK=1`` to shrink the sizes (batches of 100 instead of 1,000,
no 1M-row cold open); the smoke test in ``tests/test_asv_smoke.py`` does.
"""

from __future__ import annotations

import os
import random
import tempfile
from typing import Any

import numpy as np

import armdb
from armdb import Config, Db, FixedConfig, QueueConfig, TxConfig

QUICK = os.environ.get("ARMDB_ASV_QUICK") == "1"

SEED = 1234
BATCH = 100 if QUICK else 1_000
FLAVOURS = ["fixed", "var", "var-encrypted"]
CONFIGS = ["defaults", "tuned"]  # the bench's default rows and its tuned rows
WARMUP = 20 if QUICK else 200  # calls made in setup before timing, as the bench warms up

# Fixed keys so that every run encrypts the same way (benchmarks only, never real data).
PAYLOAD_KEY = bytes(range(32))
LOG_KEY = bytes(range(32, 64))

Ping = np.dtype([("doc", "<u8"), ("flags", "<u4")])
FixedJobs = armdb.queue("asv_fixed", payload=Ping)
VarJobs = armdb.queue("asv_var", payload=dict, var=True)


def body(i: int) -> dict[str, Any]:
    """A dict that msgpack packs into about 100 bytes (armdb._bench.body: two of its values differ per job)."""
    return {"doc_id": i, "reason": "edited", "tags": ["search", "reindex"], "text": f"{i:035d}", "priority": 3}


def fixed_payload(i: int) -> tuple[int, int]:
    return (i, 1)


def payload_for(flavour: str) -> Any:
    return fixed_payload if flavour == "fixed" else body


def queue_config(flavour: str = "fixed", *, durable: bool = False, lease_timeout: float = 3600.0,
                 config: str = "tuned") -> QueueConfig:
    """A benchmark configuration.

    ``config="defaults"``: what a user gets, ``QueueConfig.balanced()`` with nothing set
    (only the encryption key of ``var-encrypted``), as the default rows of ``python -m
    armdb bench``.  ``config="tuned"``: the bench's tuned rows, no fsync unless
    ``durable``, leases of ``lease_timeout``.
    """
    if config == "defaults":
        base = QueueConfig.balanced()
        if flavour == "var-encrypted":
            base = base.payload_config(Config.balanced().encryption_key(PAYLOAD_KEY).build())
        return base.build()
    header = FixedConfig.balanced().grow_step(armdb.config.QUEUE_GROW_STEP)
    header = header.sync_interval(0) if durable else header.enable_fsync(False)
    cfg = QueueConfig.balanced().lease_timeout(lease_timeout).header_config(header.build())
    if flavour != "fixed":
        payload = Config.balanced().enable_fsync(durable)
        if flavour == "var-encrypted":
            payload = payload.encryption_key(PAYLOAD_KEY)
        cfg = cfg.payload_config(payload.build())
    return cfg.build()


def spec_for(flavour: str) -> armdb.QueueSpec:
    return FixedJobs if flavour == "fixed" else VarJobs


def open_db(path: str, flavour: str = "fixed") -> Db:
    tx = TxConfig(log_encryption_key=LOG_KEY) if flavour == "var-encrypted" else None
    return Db.open(path, tx_config=tx)


class QueueFixture:
    """A fresh temporary directory, a Db and one queue of ``flavour``; ``close()`` removes it.
    ``config`` and the other keywords go to :func:`queue_config`."""

    def __init__(self, flavour: str = "fixed", **config: Any) -> None:
        random.seed(SEED)
        self.tmp = tempfile.TemporaryDirectory(prefix="armdb-asv-")
        self.db = open_db(self.tmp.name, flavour)
        try:
            self.queue = self.db.open_queue(spec_for(flavour), queue_config(flavour, **config))
        except BaseException:
            self.close()
            raise
        self.make = payload_for(flavour)

    def close(self) -> None:
        try:
            self.db.shutdown()
        finally:
            self.tmp.cleanup()


def rss_bytes() -> int:
    """Resident set size of this process (mapped pages included), from /proc."""
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")
