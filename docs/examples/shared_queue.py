"""A producer process and two worker processes share one queue (docs/processes.md).

The owner opens the database and serves it; the producer and the workers are other
processes that connect to it.  Run: ``python docs/examples/shared_queue.py [DIR]``.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import sys
import tempfile
import time

import armdb


@dataclasses.dataclass
class Resize:
    image: str
    width: int


Resizes = armdb.queue("resizes", payload=Resize, var=True)


def handle(job: Resize) -> None:
    """The work: here only a line per job (a real handler would resize the image)."""
    print(f"process {os.getpid()}: {job.image} -> {job.width}px", flush=True)


def producer(path: str, n: int) -> None:
    with armdb.connect(path) as client:
        q = client.open_queue(Resizes)
        q.push_many([Resize(f"img{i}.png", 256) for i in range(n)])


def worker(path: str) -> None:
    with armdb.connect(path) as client:
        # Leases in batches, acks on return, nacks on an exception; SIGTERM drains and stops.
        armdb.Worker(client, Resizes, handle, threads=2).run()


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
    with armdb.Db.open(path) as db:  # this process owns the database
        q = db.open_queue(Resizes)
        db.serve()
        ctx = multiprocessing.get_context("spawn")  # never fork a process that has a Db open
        workers = [ctx.Process(target=worker, args=(path,)) for _ in range(2)]
        for w in workers:
            w.start()
        prod = ctx.Process(target=producer, args=(path, 100))
        prod.start()
        prod.join()
        while q.len():
            time.sleep(0.05)
        for w in workers:
            w.terminate()  # SIGTERM: the worker stops leasing, finishes, and returns
            w.join()
        print(f"{q.stats().acks} jobs done by {len(workers)} worker processes")


if __name__ == "__main__":
    main()
