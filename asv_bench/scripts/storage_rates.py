"""Map put/get (100-byte values, plain and AES-GCM) and FixedStore slot write rates.

Run: .venv/bin/python asv_bench/scripts/storage_rates.py  (figures in docs/performance.md)
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import armdb
from armdb import Config, FixedConfig
from armdb.fixed import FixedStore

N = 50_000
VALUE = b"x" * 100


def rate(n: int, fn: Callable[[int], Any]) -> float:
    """Calls per second of ``fn(i)`` for ``i in range(n)``."""
    t = time.perf_counter()
    for i in range(n):
        fn(i)
    return n / (time.perf_counter() - t)


def map_rates() -> None:
    for encrypted in (False, True):
        with tempfile.TemporaryDirectory() as d, armdb.Db.open(d) as db:
            cfg = Config.balanced()
            if encrypted:
                cfg = cfg.encryption_key(os.urandom(32))
            m = db.open_map("m", cfg.build())
            put = rate(N, lambda i: m.put(i, VALUE))
            get = rate(N, lambda i: m.get(i))
            print(f"map {'AES-GCM' if encrypted else 'plain'}: put {put:,.0f}/s get {get:,.0f}/s")


def slot_write_rate() -> None:
    with tempfile.TemporaryDirectory() as d:
        store = FixedStore(d, 1, 16, 32, FixedConfig(grow_step=100_000))
        try:
            shard = store.shards[0]
            body = bytes(48)
            slots = [shard.alloc() for _ in range(N)]
            print(f"FixedStore slot write: {rate(N, lambda i: shard.write(slots[i], body)):,.0f}/s")
        finally:
            store.close()


if __name__ == "__main__":
    map_rates()
    slot_write_rate()
