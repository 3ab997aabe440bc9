"""The sequence map's id blocks reserved ahead by a writer without the GIL (SPEC T5).

``SeqMap`` posts the next block's reservation to ``armdb._core.atomicfile.AtomicWriter``
once half a block is handed out (only on the real file system, no failpoint armed);
a reservation counts only once its write is durable.  The kill -9 tests of T5
(``test_t5_ids_never_reused_across_crashes``, the kill loop) run on this path too.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import armdb
from armdb import StorageError
from armdb._core.atomicfile import AtomicWriter
from armdb.seqmap import ID_BLOCK, decode

from .conftest import spawn_child

Pings = armdb.queue("pings", payload=np.dtype([("a", "<u8")]))


def _reserved_on_disk(db_path: Path, name: str) -> int:
    return decode((db_path / "seqmap").read_bytes(), "seqmap")[name]


def test_t5_next_block_is_reserved_ahead_and_counted_only_once_durable(db_path: Path) -> None:
    with armdb.Db.open(db_path) as d:
        q = d.open_queue(Pings)
        sm = d.seqmap
        ids = [q.push((i,)) for i in range(ID_BLOCK // 4 + 1)]
        # The first block is in use: the second block's reservation was posted, and it
        # counts only once its write is durable.
        if sm._ahead is not None:
            assert sm._ahead[1]["q:pings"] == 2 * ID_BLOCK + 1
            assert sm._reserved["q:pings"] == ID_BLOCK + 1
        else:
            assert sm._reserved["q:pings"] == 2 * ID_BLOCK + 1
        ids += [q.push((i,)) for i in range(3 * ID_BLOCK)]
        assert ids == list(range(1, len(ids) + 1))
        # Every id handed out is below what the file on disk reserves.
        assert max(ids) < _reserved_on_disk(db_path, "q:pings")
        assert sm._reserved["q:pings"] <= _reserved_on_disk(db_path, "q:pings")
        flushes = sm.flushes
        assert 3 <= flushes <= 5  # about one write per block, as T5 says
        thread = sm._writer_thread
        assert thread is not None and thread.is_alive()
    assert not thread.is_alive()  # close stops the writer before releasing the directory lock
    on_disk = _reserved_on_disk(db_path, "q:pings")
    assert on_disk - max(ids) <= 2 * ID_BLOCK  # at most the block ahead is skipped
    with armdb.Db.open(db_path) as d:
        assert d.open_queue(Pings).push((0,)) == on_disk  # counting restarts at the reserved end


def test_t5_names_advancing_together_all_reserve_ahead(db_path: Path) -> None:
    # A var queue's push draws a row id and a gsn: both blocks end together, and one
    # write ahead carries both, so neither reserves in the foreground.
    other = armdb.queue("other", payload=np.dtype([("a", "<u8")]))
    with armdb.Db.open(db_path) as d:
        q1, q2 = d.open_queue(Pings), d.open_queue(other)
        sm = d.seqmap
        q1.push((0,))
        q2.push((0,))  # each name's first block is reserved in the foreground
        foreground: list[str] = []
        reserve = sm._reserve

        def counted(name: str, end: int) -> None:
            foreground.append(name)
            reserve(name, end)

        sm._reserve = counted  # type: ignore[method-assign]
        for i in range(4 * ID_BLOCK):
            last = q1.push((i,)), q2.push((i,))
            if i % 128 == 0:
                with sm._lock:  # let the write in flight finish, however slow the disk is
                    if sm._ahead is not None:
                        sm._finish_ahead(wait=True)
        assert foreground == []
        for name, n in zip(("q:pings", "q:other"), last):
            assert n < sm._reserved[name] < n + 2 * ID_BLOCK  # at most the block ahead is skipped


def test_t5_a_failed_write_ahead_is_dropped_and_the_block_end_raises(db_path: Path) -> None:
    with armdb.Db.open(db_path) as d:
        q = d.open_queue(Pings)
        sm = d.seqmap
        first = [q.push((i,)) for i in range(ID_BLOCK // 4 + 1)]  # reserves block 1, posts block 2
        with sm._lock:
            if sm._ahead is not None:
                sm._finish_ahead(wait=True)
        assert sm._reserved["q:pings"] == 2 * ID_BLOCK + 1
        # A directory where the writer's tmp file goes: its open fails (EISDIR), as the
        # foreground's does.
        (db_path / "seqmap.tmp").mkdir()
        more = [q.push((i,)) for i in range(2 * ID_BLOCK - len(first))]  # blocks 1 and 2: block 3's posts fail
        assert more[-1] == 2 * ID_BLOCK
        with pytest.raises(StorageError, match="reserving ids failed"):
            q.push((0,))
        assert q.len() == 2 * ID_BLOCK  # nothing was written for the refused push
        (db_path / "seqmap.tmp").rmdir()
        after = q.push((0,))
        assert after == 2 * ID_BLOCK + 1 and after < _reserved_on_disk(db_path, "q:pings")
        assert len(set(first + more + [after])) == 2 * ID_BLOCK + 1
    assert armdb.check(db_path).ok


def test_atomic_writer_replaces_the_file_and_reports_errors(tmp_path: Path) -> None:
    path = tmp_path / "f"
    w = AtomicWriter(str(path))
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    ticket = w.post(b"one")
    assert ticket == 1
    assert w.wait(ticket) == 0 and w.result(ticket) == 0
    assert path.read_bytes() == b"one" and not (tmp_path / "f.tmp").exists()
    (tmp_path / "f.tmp").mkdir()
    ticket = w.post(b"two")
    assert w.wait(ticket) != 0  # an errno: the file is as it was
    assert path.read_bytes() == b"one"
    (tmp_path / "f.tmp").rmdir()
    assert w.wait(w.post(b"")) == 0 and path.read_bytes() == b""
    w.stop()
    t.join(10)
    assert not t.is_alive()
    assert w.post(b"late") == 0  # refused once stopped
    assert os.listdir(tmp_path) == ["f"]


KILL_CHILD = """
import armdb, numpy as np
db = armdb.Db.open({path!r})
q = db.open_queue(armdb.queue("pings", payload=np.dtype([("a", "<u8")])))
while True:
    print(q.push((0,)), flush=True)
"""


@pytest.mark.crash
def test_t5_no_id_comes_back_after_kills_during_writes_ahead(db_path: Path) -> None:
    # SIGKILL at random points of a push loop that crosses many blocks, so kills land
    # before, during and after writes ahead; every id printed (returned) is unique.
    rng = random.Random(5)
    seen: set[int] = set()
    for _ in range(int(os.environ.get("ARMDB_KILLS_T5", "8"))):
        p = spawn_child(KILL_CHILD.format(path=str(db_path)))
        time.sleep(rng.uniform(0.8, 1.6))
        os.kill(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        ids = [int(x) for x in out.split()]
        assert not seen.intersection(ids)
        seen.update(ids)
    assert len(seen) > 2 * ID_BLOCK  # the runs crossed block boundaries (each restart opens a new block)
    assert armdb.check(db_path).ok


def test_t5_tx_ids_come_from_the_reserved_block_and_mix_with_direct_pushes(db_path: Path) -> None:
    """A commit draws its ids (``SeqMap.draw``) from the reserved block as a direct push
    does, without the lock while a refill lasts: tx and direct pushes interleaved get
    increasing, distinct ids, every one below the reservation on disk once its call
    returned, and the file is written about once a block, not once a commit."""
    with armdb.Db.open(db_path) as d:
        q = d.open_queue(Pings)
        sm = d.seqmap
        ids: list[int] = []
        for i in range(3 * ID_BLOCK):
            if i % 3 == 0:
                ids.append(q.push((i,)))
            else:
                ids += d.tx().push(q, (i,)).commit()
            if i % 500 == 0:
                assert ids[-1] < _reserved_on_disk(db_path, "q:pings")
        assert ids == sorted(set(ids))
        assert ids == list(range(1, len(ids) + 1))  # no commit was refused: no gap
        assert max(ids) < _reserved_on_disk(db_path, "q:pings")
        assert sm.flushes <= 8  # the queue's ids and the log's gsns, about a block each


def test_t5_batches_take_their_ids_from_the_rest_of_the_block(db_path: Path) -> None:
    """A batch's ids come from the rest of the reserved block when it holds them, so lone
    draws and small batches in turn (a producer's pushes and a worker's ``ack_many``)
    hand out every id once, with no gap, and the file is written about once a block:
    a batch that left the rest unused burnt up to a quarter of a block a call and made
    the map reserve in the foreground every few dozen calls."""
    with armdb.Db.open(db_path) as d:
        sm = d.seqmap
        flushes = sm.flushes
        ids: list[int] = []
        rng = random.Random(7)
        for _ in range(4 * ID_BLOCK):
            ids.append(sm.next("t"))
            k = rng.choice((1, 1, 2, 3, 8))
            first = sm.draw_block("t", k)
            sm.reserve_through("t", first + k - 1)
            ids += range(first, first + k)
        # Ids are consecutive but for what a batch larger than the rest skips (the rest:
        # fewer than 8 ids, once per quarter of a block).
        assert ids == sorted(set(ids))
        assert max(ids) - len(ids) < 8 * (max(ids) // (ID_BLOCK // 4) + 1)
        assert max(ids) < _reserved_on_disk(db_path, "t")
        assert sm.flushes - flushes <= max(ids) // ID_BLOCK + 2


def test_t5_threads_drawing_ids_and_batches_never_share_an_id(db_path: Path) -> None:
    """Threads mixing lone draws (lock-free while the rest lasts) and batches (taken from
    the rest in one step, or after it) get distinct ids, each batch consecutive."""
    with armdb.Db.open(db_path) as d:
        sm = d.seqmap
        got: list[list[int]] = [[] for _ in range(4)]

        def work(t: int) -> None:
            rng = random.Random(t)
            mine = got[t]
            for _ in range(3000):
                if rng.random() < 0.5:
                    mine.append(sm.next("t"))
                else:
                    k = rng.choice((1, 2, 5, 40, 300))
                    first = sm.draw_block("t", k)
                    sm.reserve_through("t", first + k - 1)
                    mine += range(first, first + k)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        every = [i for mine in got for i in mine]
        assert len(every) == len(set(every))
        for mine in got:
            assert mine == sorted(mine)  # each thread's ids increase
        assert max(every) < _reserved_on_disk(db_path, "t")
