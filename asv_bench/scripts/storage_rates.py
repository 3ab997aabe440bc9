"""Map put/get (100-byte values, plain and AES-GCM) and FixedStore slot write rates.

Run: .venv/bin/python asv_bench/scripts/storage_rates.py  (figures in docs/performance.md)
"""
import os
import tempfile
import time

import armdb
from armdb import Config, FixedConfig
from armdb.fixed import FixedStore


def rate(n, f):
    t=time.perf_counter()
    for i in range(n): f(i)
    return n/(time.perf_counter()-t)
v=b"x"*100
for enc in (False, True):
    with armdb.Db.open(tempfile.mkdtemp()) as db:
        c=Config.balanced()
        if enc: c=c.encryption_key(os.urandom(32))
        m=db.open_map("m", c.build())
        p=rate(50000, lambda i: m.put(i, v)); g=rate(50000, lambda i: m.get(i))
        print(f"map {'AES-GCM' if enc else 'plain'}: put {p:,.0f}/s get {g:,.0f}/s")
d=tempfile.mkdtemp()
fs=FixedStore(d, 1, 16, 32, FixedConfig(grow_step=100_000))
sh=fs.shards[0]; body=bytes(48)
slots=[sh.alloc() for _ in range(50000)]
print(f"FixedStore slot write: {rate(50000, lambda i: sh.write(slots[i], body)):,.0f}/s")
fs.close()
