"""Where the wall clock of the bench row push_many/var-100B-1000 goes: the row's workload
(``armdb._bench.armdb_push_many``: var ``push_many(1000)`` of 100-byte dicts into a fresh,
growing queue, at the defaults) with, per repeat, the jobs per second and the shares of

- the cyclic garbage collector (timed by ``gc.callbacks``, per generation),
- the log checkpoints (``TxLog.checkpoint``: it syncs every store and starts a new log
  file in the committing thread, once the log passes ``TxConfig.checkpoint_bytes``),
- the process's user and system CPU time, and its minor page faults a batch.

Instruction counts (``push_many_instructions.sh``) see none of the checkpoints' waits or
the kernel's page faults; this script does.  The host is noisy: compare settings in
alternation, several runs each.

Run: .venv/bin/python asv_bench/scripts/push_many_wall.py [--batches 50] [--repeats 3]
     [--checkpoint-bytes N]   (50 batches is the --quick row; the full row pushes 200)
"""

from __future__ import annotations

import argparse
import gc
import resource
import tempfile
import time
from typing import Any

from armdb import Db, TxConfig
from armdb import _bench as B

SIZE = B.PUT_MANY


def one_repeat(batches: int, checkpoint_bytes: int | None) -> dict[str, float]:
    """One repeat in a fresh directory; seconds spent in each share, and the counts."""
    payloads = [B.body(i) for i in range(SIZE)]
    gc_time = [0.0, 0.0, 0.0]
    gc_runs = [0, 0, 0]
    started: list[float] = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            g = info["generation"]
            gc_time[g] += time.perf_counter() - started[0]
            gc_runs[g] += 1

    with tempfile.TemporaryDirectory() as d:
        db = Db.open(d, tx_config=None if checkpoint_bytes is None else TxConfig(checkpoint_bytes=checkpoint_bytes))
        try:
            q = db.open_queue(B.BenchVar)
            txlog = db.txlog
            checkpoint = txlog.checkpoint
            ckpt = [0.0, 0.0]

            def timed_checkpoint(*args: Any, **kwargs: Any) -> None:
                t = time.perf_counter()
                try:
                    checkpoint(*args, **kwargs)
                finally:
                    ckpt[0] += time.perf_counter() - t
                    ckpt[1] += 1

            txlog.checkpoint = timed_checkpoint  # type: ignore[method-assign]  # (this Db only)
            q.push_many(payloads)  # warm-up, as the bench row
            gc.collect()  # as armdb._bench._timed_rate
            gc.callbacks.append(on_gc)
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            try:
                for _ in range(batches):
                    q.push_many(payloads)
                wall = time.perf_counter() - t0
                r1 = resource.getrusage(resource.RUSAGE_SELF)
                ckpt_time, ckpt_runs = ckpt  # (not the one Db.shutdown runs)
            finally:
                gc.callbacks.remove(on_gc)
        finally:
            db.shutdown()
    return {
        "rate": batches * SIZE / wall, "wall": wall,
        "gc0": gc_time[0], "gc1": gc_time[1], "gc2": gc_time[2],
        "gc_runs": float(sum(gc_runs)), "gc2_runs": float(gc_runs[2]),
        "ckpt": ckpt_time, "ckpt_runs": ckpt_runs,
        "user": r1.ru_utime - r0.ru_utime, "sys": r1.ru_stime - r0.ru_stime,
        "faults": (r1.ru_minflt - r0.ru_minflt) / batches,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--checkpoint-bytes", type=int, default=None)
    args = ap.parse_args()
    cb = TxConfig().checkpoint_bytes if args.checkpoint_bytes is None else args.checkpoint_bytes
    print(f"push_many({SIZE}) var, {args.batches} batches a repeat, checkpoint_bytes={cb:,}")
    for _ in range(args.repeats):
        r = one_repeat(args.batches, args.checkpoint_bytes)
        w = r["wall"]
        print(f"  {r['rate']:>11,.0f} jobs/s  gc {100 * (r['gc0'] + r['gc1'] + r['gc2']) / w:4.1f}% "
              f"({r['gc_runs']:.0f} runs, {r['gc2_runs']:.0f} full)  "
              f"checkpoints {100 * r['ckpt'] / w:4.1f}% ({r['ckpt_runs']:.0f})  "
              f"user {100 * r['user'] / w:3.0f}% sys {100 * r['sys'] / w:3.0f}%  "
              f"{r['faults']:.0f} minor faults a batch")


if __name__ == "__main__":
    main()
