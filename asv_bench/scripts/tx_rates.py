"""Durable transaction commits: one thread vs 8 (group commit), and what bounds the ratio.

Run: .venv/bin/python asv_bench/scripts/tx_rates.py [repeats]  (figures in docs/performance.md)

The workload is the benchmark's (``armdb._bench.armdb_tx_commit``: a map put and a
fixed-queue push per commit).  Repeats are interleaved (repeat 1 of every row, then
repeat 2, ...) in fresh directories; each row prints the median.

* ``P`` (hot): µs of Python per commit, from non-durable commits in a loop.
* ``S``: µs inside one log ``fdatasync`` (timed by the native group-commit path).
* one thread, durable: ``1 / (P1 + S)``, where ``P1`` (the wall time per commit
  minus ``S``) is larger than the hot ``P``: the thread sleeps in every sync.
* 8 threads: commits per sync and the share of the wall time the disk spent syncing.
"""

from __future__ import annotations

import statistics
import sys
import tempfile

from armdb._bench import armdb_tx_commit, raw_fdatasync


def main(repeats: int = 5) -> None:
    rows: dict[str, list[dict[str, float]]] = {}

    def run(name: str, n: int, **kw: object) -> None:
        stats: dict[str, float] = {}
        with tempfile.TemporaryDirectory() as d:
            rate = armdb_tx_commit(d, n, stats=stats, **kw)  # type: ignore[arg-type]
        stats["rate"] = rate
        rows.setdefault(name, []).append(stats)

    for _ in range(repeats):
        run("non-durable, 1 thread", 5000, durable=False, warmup=200)
        run("durable, 1 thread", 400, durable=True, warmup=20)
        run("durable, 8 threads", 1600, durable=True, threads=8, warmup=20)
        run("durable, 8 threads, 64 shards", 1600, durable=True, threads=8, warmup=20, shards=64)
        with tempfile.TemporaryDirectory() as d:
            rows.setdefault("raw pwrite+fdatasync", []).append({"rate": raw_fdatasync(d, 400)})

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[name])

    for name, rs in rows.items():
        line = f"{name:32s} {med(name, 'rate'):9,.0f}/s  (min {min(r['rate'] for r in rs):,.0f}, " \
               f"max {max(r['rate'] for r in rs):,.0f})"
        if rs[0].get("syncs"):
            s_us = statistics.median(r["sync_seconds"] / r["syncs"] * 1e6 for r in rs)
            per_sync = statistics.median(r["commits"] / r["syncs"] for r in rs)
            busy = statistics.median(r["sync_seconds"] * r["rate"] / r["commits"] for r in rs)
            line += f"  S={s_us:.0f} µs  commits/sync={per_sync:.2f}  disk busy={busy:.0%}"
        print(line)
    p_hot = 1e6 / med("non-durable, 1 thread", "rate")
    one = med("durable, 1 thread", "rate")
    s1 = statistics.median(r["sync_seconds"] / r["syncs"] * 1e6 for r in rows["durable, 1 thread"])
    p1 = 1e6 / one - s1
    eight = med("durable, 8 threads", "rate")
    print(f"P (hot) = {p_hot:.1f} µs; one thread: P1 = {p1:.0f} µs + S = {s1:.0f} µs per commit")
    print(f"8 threads / 1 thread = {eight / one:.2f}x; GIL bound (P1 + S) / P = {(p1 + s1) / p_hot:.1f}x")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
