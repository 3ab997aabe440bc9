"""A durable push against the raw ``pwrite`` + ``fdatasync`` loop, interleaved in one
process so that the disk's drift falls on every kind alike.

The bench row ``push/durable`` runs each system for a few hundred pushes in turn; on a
virtual disk whose sync time moves by half within seconds, its ratio to the raw loop
swings more than the few microseconds a change of the push's own path makes.  Here
blocks of ``--block`` operations of each kind alternate for ``--rounds`` rounds:

- ``direct``: the bench's durable fixed queue (``sync_interval(0)``), as a user gets it:
  its slots written by ``pwrite`` (docs/format.md, "Direct writes");
- ``mapped``: the same queue with its slot files bound without descriptors, so that
  its slots are stored through the memory map (the path before round 16);
- ``raw``: ``pwrite`` of 64 bytes + ``fdatasync`` into a preallocated file, the bench's
  ``raw_fdatasync``.

Prints each kind's median µs an operation, its faults an operation, and the ratios of the
medians to the raw loop.

Run: .venv/bin/python asv_bench/scripts/durable_push_interleaved.py [--rounds 60] [--block 100]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Callable

from armdb import _bench as B

RECORD = b"\xa5" * 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--block", type=int, default=100)
    args = ap.parse_args()
    block = args.block
    with tempfile.TemporaryDirectory() as base:
        ops: dict[str, Callable[[int], None]] = {}
        dbs = []
        for kind in ("direct", "mapped"):
            db, q = B.open_armdb(os.path.join(base, kind), B.BenchFixed, durable=True)
            dbs.append(db)
            for shard in q._headers.shards:
                if kind == "mapped":
                    shard.sf.bind(shard.slots, shard.versions, shard.status, shard.redo, -1, -1)
                else:
                    assert shard.sf.wfd >= 0, "the durable store does not write directly"
            ops[kind] = lambda i, q=q: q.push(B._fixed_payload(i))
        fd = os.open(os.path.join(base, "raw.data"), os.O_RDWR | os.O_CREAT)
        slots = 1 << 18
        os.ftruncate(fd, slots * 64)

        def raw(i: int) -> None:
            os.pwrite(fd, RECORD, (i % slots) * 64)
            os.fdatasync(fd)

        ops["raw"] = raw
        times: dict[str, list[float]] = {k: [] for k in ops}
        faults: dict[str, int] = dict.fromkeys(ops, 0)
        n = 0
        try:
            for _ in range(args.rounds):
                for kind, op in ops.items():
                    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    t0 = time.perf_counter()
                    for _ in range(block):
                        op(n)
                        n += 1
                    times[kind].append((time.perf_counter() - t0) / block * 1e6)
                    faults[kind] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        finally:
            os.close(fd)
            for db in dbs:
                db.shutdown()
    raw_median = statistics.median(times["raw"])
    for kind, values in times.items():
        median = statistics.median(values)
        print(f"{kind:7s} median {median:6.1f} µs  faults/op {faults[kind] / (args.rounds * block):5.2f}"
              f"  raw/this {raw_median / median:5.2f}x")


if __name__ == "__main__":
    main()
