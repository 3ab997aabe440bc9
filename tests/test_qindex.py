"""Tests of the compiled queue key index ``armdb._core.qindex.KeyIndex`` (SPEC Q8-Q11, Q28).

The index is checked method by method, then by a Hypothesis state machine against
a pure-Python model (a dict of ``(due, seq) -> (slot, deadline)`` read in sorted
order), with tiny blocks so that splits, merges and dropped blocks happen all
the time.  ``KeyIndex.check()`` verifies the internal invariants after every step.

Run as a script for the timing figures quoted in docs/index.md::

    .venv/bin/python tests/test_qindex.py
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule


def _load_keyindex():
    try:
        from armdb._core.qindex import KeyIndex
    except ImportError:
        # Fallback while armdb/__init__.py is being written: load the built
        # extension straight from its file.  Without a built .so, re-raise.
        core = Path(__file__).resolve().parents[1] / "armdb" / "_core"
        built = sorted(core.glob("qindex.*.so")) + sorted(core.glob("qindex.*.pyd"))
        if not built:
            raise
        spec = importlib.util.spec_from_file_location("armdb._core.qindex", built[0])
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        KeyIndex = module.KeyIndex
    return KeyIndex


KeyIndex = _load_keyindex()

U64_MAX = 2**64 - 1
I64_MAX = 2**63 - 1


# --------------------------------------------------------------------------- reference model


class Model:
    """Pure-Python reference: the semantics KeyIndex must match, written plainly."""

    def __init__(self) -> None:
        self.rows: dict[tuple[int, int], tuple[int, int]] = {}

    def ordered(self) -> list[tuple[int, int, int, int]]:
        return [(d, s, *self.rows[(d, s)]) for (d, s) in sorted(self.rows)]

    def scan(self, now: int, n: int) -> list[tuple[int, int, int, int]]:
        out = []
        for due, seq, slot, deadline in self.ordered():
            if len(out) == n or due > now:
                break
            if deadline > now:
                continue
            out.append((due, seq, slot, deadline))
        return out

    def next_due(self) -> int:
        best = None
        for due, _seq, _slot, deadline in self.ordered():
            value = deadline if deadline > 0 else due
            best = value if best is None else min(best, value)
            if deadline == 0:
                break
        return -1 if best is None else min(best, I64_MAX)

    def count_due(self, now: int) -> tuple[int, int, int]:
        ready = leased = later = 0
        for due, _seq, _slot, deadline in self.ordered():
            if deadline > 0:
                leased += 1
            elif due <= now:
                ready += 1
            else:
                later += 1
        return ready, leased, later


def out_arrays(n: int):
    return (
        np.zeros(n, np.uint64),
        np.zeros(n, np.uint64),
        np.zeros(n, np.uint32),
        np.zeros(n, np.int64),
    )


def scan_list(idx, now: int, n: int) -> list[tuple[int, int, int, int]]:
    arrays = out_arrays(n)
    k = idx.scan(now, *arrays)
    return list(zip(*(a[:k].tolist() for a in arrays)))


def as_rows(arrays) -> list[tuple[int, int, int, int]]:
    return list(zip(*(a.tolist() for a in arrays)))


def filled(block_size: int, keys, deadline: int = 0):
    idx = KeyIndex(block_size)
    for i, (due, seq) in enumerate(keys):
        idx.insert(due, seq, i, deadline)
    return idx


# --------------------------------------------------------------------------- construction


def test_q8_block_size_validated():
    with pytest.raises(ValueError, match="block_size"):
        KeyIndex(3)
    with pytest.raises(ValueError, match="block_size"):
        KeyIndex(65537)
    assert KeyIndex().block_size == 256
    assert KeyIndex(4).block_size == 4


def test_q8_empty_index():
    idx = KeyIndex()
    assert len(idx) == 0
    assert idx.nblocks == 0
    assert idx.min_key() is None
    assert idx.next_due(10) == -1
    assert idx.count_due(10) == (0, 0, 0)
    assert idx.scan(10, *out_arrays(8)) == 0
    assert idx.remove(1, 1) == -1
    assert idx.get(1, 1) is None
    assert idx.set_deadline(1, 1, 5) is False
    for arrays in (idx.head(5), idx.to_arrays()):
        assert [a.dtype for a in arrays] == [np.uint64, np.uint64, np.uint32, np.int64]
        assert all(a.shape == (0,) for a in arrays)
    assert idx.nbytes() == 0
    idx.check()


def test_q8_reinit_resets_and_uninitialised_object_is_usable():
    idx = filled(4, [(i, 0) for i in range(10)])
    idx.__init__(8)
    assert len(idx) == 0 and idx.block_size == 8 and idx.nbytes() == 0
    bare = KeyIndex.__new__(KeyIndex)
    bare.insert(1, 2, 3)
    assert bare.get(1, 2) == (3, 0)
    bare.check()


# --------------------------------------------------------------------------- insert / get / remove


def test_q8_key_order_due_then_seq():
    idx = KeyIndex(4)
    keys = [(5, 1), (3, 9), (5, 0), (3, 10), (0, U64_MAX), (U64_MAX, 0), (4, 4)]
    for i, (due, seq) in enumerate(keys):
        idx.insert(due, seq, i)
    due, seq, slot, deadline = idx.to_arrays()
    assert list(zip(due.tolist(), seq.tolist())) == sorted(keys)
    assert [keys[s] for s in slot.tolist()] == sorted(keys)
    assert deadline.tolist() == [0] * len(keys)
    assert idx.min_key() == (0, U64_MAX)
    idx.check()


def test_q8_full_unsigned_range_and_bad_values():
    idx = KeyIndex()
    idx.insert(U64_MAX, U64_MAX, 2**32 - 1, I64_MAX)
    assert idx.get(U64_MAX, U64_MAX) == (2**32 - 1, I64_MAX)
    with pytest.raises(OverflowError):
        idx.insert(-1, 0, 0)
    with pytest.raises(OverflowError):
        idx.insert(0, 0, 2**32)
    with pytest.raises(ValueError, match="deadline must be >= 0"):
        idx.insert(1, 1, 1, -5)
    assert len(idx) == 1


def test_q8_duplicate_insert_raises_keyerror_and_changes_nothing():
    idx = filled(4, [(i, i) for i in range(20)])
    before = as_rows(idx.to_arrays())
    for due, seq in [(0, 0), (7, 7), (19, 19)]:  # front, middle, fast-path end
        with pytest.raises(KeyError):
            idx.insert(due, seq, 999, 5)
    assert as_rows(idx.to_arrays()) == before
    idx.check()


def test_q14_remove_returns_slot_or_minus_one():
    idx = filled(4, [(i, 0) for i in range(10)])
    assert idx.remove(3, 0) == 3
    assert idx.remove(3, 0) == -1  # already removed
    assert idx.remove(3, 1) == -1  # same due, other seq
    assert idx.remove(100, 0) == -1  # past the end
    assert len(idx) == 9
    assert idx.get(3, 0) is None
    assert (4, 0) in idx and (3, 0) not in idx
    idx.check()


def test_q13_set_deadline_and_get():
    idx = filled(4, [(i, 0) for i in range(10)])
    assert idx.set_deadline(4, 0, 1234) is True
    assert idx.get(4, 0) == (4, 1234)
    assert idx.count_due(100)[1] == 1
    assert idx.set_deadline(4, 0, 0) is True  # release the lease
    assert idx.count_due(100) == (10, 0, 0)
    assert idx.set_deadline(4, 1, 5) is False
    with pytest.raises(ValueError, match="deadline must be >= 0"):
        idx.set_deadline(4, 0, -1)
    idx.check()


# --------------------------------------------------------------------------- blocks


def test_q8_append_fast_path_fills_blocks_densely():
    idx = filled(8, [(i, i) for i in range(80)])
    assert idx.nblocks == 10
    assert idx.nbytes() >= 80 * 32
    idx.check()


def test_q14_middle_insert_splits_full_block():
    idx = filled(4, [(10 * i, 0) for i in range(8)])  # two full blocks
    assert idx.nblocks == 2
    idx.insert(15, 0, 99)  # middle of the full first block
    assert idx.nblocks == 3
    idx.check()
    assert idx.get(15, 0) == (99, 0)
    assert idx.to_arrays()[0].tolist() == [0, 10, 15, 20, 30, 40, 50, 60, 70]


def test_q9_key_between_blocks_goes_to_earlier_block_with_room():
    idx = filled(4, [(10 * i, 0) for i in range(8)])
    idx.remove(30, 0)  # first block now [0, 10, 20] with room
    n = idx.nblocks
    idx.insert(35, 0, 1)  # between block 0 (last 20) and block 1 (first 40)
    assert idx.nblocks == n
    idx.check()
    assert idx.to_arrays()[0].tolist() == [0, 10, 20, 35, 40, 50, 60, 70]


def test_q14_removals_merge_and_drop_blocks():
    idx = filled(8, [(i, 0) for i in range(64)])
    assert idx.nblocks == 8
    # Drain block 0 completely: it is dropped.
    for i in range(8):
        idx.remove(i, 0)
        idx.check()
    assert idx.nblocks == 7
    # Thin block [16..23] to 4 entries (half full: no merge), then block [8..15]
    # to 2 (a quarter): 2 + 4 fit in three quarters of a block, so they merge.
    for i in range(16, 20):
        idx.remove(i, 0)
    assert idx.nblocks == 7
    for i in range(8, 14):
        idx.remove(i, 0)
        idx.check()
    assert idx.nblocks == 6
    assert idx.to_arrays()[0].tolist() == [14, 15, 20, 21, 22, 23] + list(range(24, 64))


def test_q9_random_middle_inserts_and_removals_keep_invariants():
    rng = random.Random(7)
    idx = KeyIndex(4)
    model: dict[tuple[int, int], int] = {}
    for step in range(3000):
        key = (rng.randrange(200), rng.randrange(4))
        if rng.random() < 0.6:
            if key in model:
                with pytest.raises(KeyError):
                    idx.insert(*key, step)
            else:
                idx.insert(*key, step)
                model[key] = step
        else:
            assert idx.remove(*key) == model.pop(key, -1)
    idx.check()
    due, seq, slot, _ = idx.to_arrays()
    assert list(zip(due.tolist(), seq.tolist())) == sorted(model)
    assert slot.tolist() == [model[k] for k in sorted(model)]


def test_q8_million_rows_append_then_random_removals():
    n = 1_000_000
    idx = KeyIndex(256)
    insert = idx.insert
    for i in range(n):
        insert(1_000 + i // 4, i, i)  # four rows per millisecond
    assert len(idx) == n
    assert idx.nblocks == -(-n // 256)
    rng = np.random.default_rng(1)
    gone = rng.choice(n, size=200_000, replace=False)
    remove = idx.remove
    for i in gone.tolist():
        assert remove(1_000 + i // 4, i) == i
    keep = np.ones(n, bool)
    keep[gone] = False
    idx.check()
    due, seq, slot, deadline = idx.to_arrays()
    expect = np.flatnonzero(keep)
    assert np.array_equal(seq, expect.astype(np.uint64))
    assert np.array_equal(slot, expect.astype(np.uint32))
    assert np.array_equal(due, (1_000 + expect // 4).astype(np.uint64))
    assert not deadline.any()
    idx.clear()
    assert len(idx) == 0 and idx.nbytes() == 0


# --------------------------------------------------------------------------- scan


def test_q9_scan_stops_at_future_due():
    idx = filled(4, [(t, 0) for t in (10, 20, 30, 40, 50)])
    assert scan_list(idx, 30, 10) == [(10, 0, 0, 0), (20, 0, 1, 0), (30, 0, 2, 0)]
    assert scan_list(idx, 9, 10) == []
    assert scan_list(idx, U64_MAX >> 1, 10)[-1] == (50, 0, 4, 0)
    # An expired lease behind the first future row is not reached.
    idx.insert(60, 0, 5, deadline=1)
    assert [r[0] for r in scan_list(idx, 45, 10)] == [10, 20, 30, 40]


def test_q9_scan_returns_ready_and_expired_leases():
    idx = filled(4, [(t, 0) for t in range(10)])
    idx.set_deadline(2, 0, 100)  # expired at now=100 (deadline <= now)
    idx.set_deadline(3, 0, 101)  # not expired at now=100
    got = scan_list(idx, 100, 10)
    assert [r[0] for r in got] == [0, 1, 2, 4, 5, 6, 7, 8, 9]
    assert got[2] == (2, 0, 2, 100)  # the deadline comes back with the candidate


def test_q10_scan_skips_unexpired_leases():
    leases, ready = 10_000, 100
    idx = KeyIndex(256)
    for i in range(leases):
        idx.insert(1_000, i, i, deadline=50_000)
    for i in range(ready):
        idx.insert(2_000, i, leases + i)
    for _ in range(3):  # first walk repairs the block bounds; later ones skip blocks
        got = scan_list(idx, 10_000, 32)
        assert [(d, s) for d, s, _, _ in got] == [(2_000, i) for i in range(32)]
    # Leasing the candidates (raising deadlines) leaves stale bounds: still correct.
    for d, s, _, _ in got:
        idx.set_deadline(d, s, 60_000)
    assert [r[1] for r in scan_list(idx, 10_000, 4)] == [32, 33, 34, 35]
    # Once the clock passes the deadlines, every lease is a candidate again.
    assert scan_list(idx, 50_000, 3) == [(1_000, i, i, 50_000) for i in range(3)]
    idx.check()


def test_q10_scan_block_bound_lowered_by_insert_and_set_deadline():
    idx = filled(4, [(0, i) for i in range(16)], deadline=500)
    assert scan_list(idx, 100, 4) == []  # bounds now exact (500)
    idx.set_deadline(0, 5, 50)  # lowering a deadline lowers the bound
    assert scan_list(idx, 100, 4) == [(0, 5, 5, 50)]
    idx.insert(0, 100, 99)  # a ready row in a block of leases
    assert scan_list(idx, 100, 4) == [(0, 5, 5, 50), (0, 100, 99, 0)]
    idx.check()


@pytest.mark.parametrize("into", ["next", "previous"])
def test_q10_merge_keeps_block_bound_a_lower_bound(into):
    # Block 0: eight unexpired leases (exact bound 500 after a scan); block 1: eight
    # ready rows.  Thinning makes the blocks merge; the merged block must not keep
    # the leases' bound, or the scan would skip its ready rows.
    idx = KeyIndex(8)
    for i in range(8):
        idx.insert(0, i, i, deadline=500)
    for i in range(8, 16):
        idx.insert(0, i, i)
    assert len(scan_list(idx, 100, 16)) == 8  # walks block 0: its bound becomes 500
    if into == "next":  # block 1 down to 4, then block 0 down to 2: 0 absorbs 1
        drop = list(range(8, 12)) + list(range(6))
    else:  # block 0 down to 4, then block 1 down to 2: 1 goes into 0
        drop = list(range(4)) + list(range(8, 14))
    for i in drop:
        assert idx.remove(0, i) == i
    assert idx.nblocks == 1
    idx.check()
    ready = [i for i in range(8, 16) if i not in drop]
    assert [r[1] for r in scan_list(idx, 100, 16)] == ready


def test_q11_scan_in_key_order():
    rng = random.Random(3)
    keys = rng.sample([(d, s) for d in range(50) for s in range(20)], 400)
    idx = filled(8, keys)
    got = scan_list(idx, 1_000, 1_000)
    assert [(d, s) for d, s, _, _ in got] == sorted(keys)
    assert [keys[slot] for _, _, slot, _ in got] == sorted(keys)


def test_q9_scan_capacity_and_argument_checks():
    idx = filled(4, [(i, 0) for i in range(10)])
    assert scan_list(idx, 100, 3) == [(0, 0, 0, 0), (1, 0, 1, 0), (2, 0, 2, 0)]
    assert idx.scan(100, *out_arrays(0)) == 0
    a = out_arrays(4)
    with pytest.raises(ValueError, match="differ in length"):
        idx.scan(100, a[0], a[1], np.zeros(3, np.uint32), a[3])
    with pytest.raises(ValueError, match="now must be >= 0"):
        idx.scan(-1, *a)
    with pytest.raises(ValueError, match="dtype mismatch"):
        idx.scan(100, a[0], a[1], a[2], np.zeros(4, np.int32))
    ro = np.zeros(4, np.uint64)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        idx.scan(100, ro, a[1], a[2], a[3])
    with pytest.raises(ValueError, match="contiguous"):
        idx.scan(100, np.zeros(8, np.uint64)[::2], a[1], a[2], a[3])


def test_q28_scan_releases_gil_and_refuses_unlocked_use():
    # A long scan (every row is a candidate) runs in a thread without the GIL;
    # this thread then gets the GIL and, having "forgotten" the shard lock, is
    # refused with RuntimeError instead of racing the walk.
    n = 400_000
    idx = KeyIndex.from_arrays(
        np.zeros(n, np.uint64), np.arange(n, dtype=np.uint64), np.zeros(n, np.uint32), np.ones(n, np.int64)
    )
    out = out_arrays(n)
    stop = threading.Event()

    def scanner():
        while not stop.is_set():
            assert idx.scan(10, *out) == n

    t = threading.Thread(target=scanner)
    t.start()
    refused = False
    try:
        deadline = time.monotonic() + 20
        while not refused and time.monotonic() < deadline:
            try:
                idx.min_key()
            except RuntimeError as exc:
                assert "shard lock" in str(exc)
                refused = True
    finally:
        stop.set()
        t.join()
    assert refused
    assert idx.min_key() == (0, 0)  # usable again once the scan is over


# --------------------------------------------------------------------------- next_due / count_due / head


def test_q18_next_due():
    idx = KeyIndex(4)
    assert idx.next_due(0) == -1
    idx.insert(100, 0, 0)
    assert idx.next_due(0) == 100
    idx.set_deadline(100, 0, 5_000)
    assert idx.next_due(0) == 5_000  # only a lease: its deadline
    idx.insert(200, 0, 1)
    assert idx.next_due(0) == 200  # the ready row is due before the lease expires
    idx.set_deadline(200, 0, 150)
    assert idx.next_due(0) == 150
    idx.insert(50, 0, 2, deadline=7_000)
    idx.insert(300, 0, 3)
    assert idx.next_due(0) == 150
    # Entries after the first unleased one do not count, even leased with an earlier deadline.
    idx.insert(400, 0, 4, deadline=1)
    assert idx.next_due(0) == 150
    idx.set_deadline(300, 0, 9_000)
    assert idx.next_due(0) == 1
    with pytest.raises(ValueError, match="now must be >= 0"):
        idx.next_due(-1)
    # A due above the int64 range is reported as the int64 maximum.
    big = KeyIndex()
    big.insert(U64_MAX, 0, 0)
    assert big.next_due(0) == I64_MAX


def test_q18_next_due_many_leased_blocks():
    n = 5_000
    deadlines = np.random.default_rng(5).integers(10_000, 20_000, n)
    idx = KeyIndex.from_arrays(
        np.full(n, 100, np.uint64), np.arange(n, dtype=np.uint64), np.arange(n, dtype=np.uint32), deadlines, 8
    )
    assert idx.next_due(0) == deadlines.min()
    assert idx.next_due(0) == deadlines.min()  # again, with exact block bounds
    idx.insert(200, 0, 0)
    assert idx.next_due(0) == 200


def test_q26_count_due():
    idx = KeyIndex(4)
    assert idx.count_due(0) == (0, 0, 0)
    for i in range(12):
        idx.insert(10 * i, 0, i)
    assert idx.count_due(55) == (6, 0, 6)
    idx.set_deadline(20, 0, 999)  # leased and due
    idx.set_deadline(100, 0, 1)  # leased, not due, expired: still "leased"
    assert idx.count_due(55) == (5, 2, 5)
    assert idx.count_due(0) == (1, 2, 9)
    assert idx.count_due(10**6) == (10, 2, 0)
    with pytest.raises(ValueError, match="now must be >= 0"):
        idx.count_due(-1)


def test_q8_head_and_min_key():
    idx = filled(4, [(i, 0) for i in range(10, 0, -1)])
    due, _seq, slot, _deadline = idx.head(3)
    assert due.tolist() == [1, 2, 3] and slot.tolist() == [9, 8, 7]
    assert len(idx.head(100)[0]) == 10
    assert len(idx.head(0)[0]) == 0
    with pytest.raises(ValueError, match="n must be >= 0"):
        idx.head(-1)
    assert idx.min_key() == (1, 0)
    idx.remove(1, 0)
    assert idx.min_key() == (2, 0)


def test_q8_clear_and_nbytes():
    idx = filled(16, [(i, 0) for i in range(1000)])
    assert idx.nbytes() >= 1000 * 32
    idx.clear()
    assert len(idx) == 0 and idx.nbytes() == 0 and idx.min_key() is None
    idx.insert(5, 5, 5)
    assert idx.to_arrays()[0].tolist() == [5]
    idx.check()


# --------------------------------------------------------------------------- from_arrays


def test_q2_from_arrays_matches_inserts():
    rng = np.random.default_rng(11)
    n = 10_000
    due = rng.integers(0, 500, n).astype(np.uint64)
    seq = np.arange(n, dtype=np.uint64)
    rng.shuffle(seq)
    slot = np.arange(n, dtype=np.uint32)
    deadline = np.where(rng.random(n) < 0.3, rng.integers(1, 1000, n), 0)
    built = KeyIndex.from_arrays(due, seq, slot, deadline, block_size=16)
    built.check()
    one_by_one = KeyIndex(16)
    for row in zip(due.tolist(), seq.tolist(), slot.tolist(), deadline.tolist()):
        one_by_one.insert(*row)
    assert as_rows(built.to_arrays()) == as_rows(one_by_one.to_arrays())
    assert built.nblocks == n // 16
    for now in (0, 250, 499, 10_000):
        assert built.count_due(now) == one_by_one.count_due(now)
        assert built.next_due(now) == one_by_one.next_due(now)
        assert scan_list(built, now, 64) == scan_list(one_by_one, now, 64)


def test_q2_from_arrays_accepts_sorted_lists_and_empty():
    idx = KeyIndex.from_arrays([1, 2, 3], [0, 0, 0], [7, 8, 9], [0, 0, 5])
    assert as_rows(idx.to_arrays()) == [(1, 0, 7, 0), (2, 0, 8, 0), (3, 0, 9, 5)]
    # Read-only inputs (views of a mapped header file) are accepted as they are.
    cols = [np.arange(5, dtype=t) for t in (np.uint64, np.uint64, np.uint32, np.int64)]
    for c in cols:
        c.flags.writeable = False
    assert as_rows(KeyIndex.from_arrays(*cols).to_arrays()) == [(i, i, i, i) for i in range(5)]
    empty = KeyIndex.from_arrays([], [], [], [], block_size=4)
    assert len(empty) == 0 and empty.block_size == 4
    empty.insert(1, 1, 1)
    empty.check()


def test_q2_from_arrays_rejects_bad_input():
    ok = np.arange(4)
    with pytest.raises(ValueError, match=r"duplicate key \(due=2, seq=0\)"):
        KeyIndex.from_arrays([3, 2, 1, 2], [0, 0, 0, 0], ok, [0, 0, 0, 0])
    with pytest.raises(ValueError, match="differ in length"):
        KeyIndex.from_arrays(ok, ok, ok, ok[:3])
    with pytest.raises(ValueError, match="due has values outside"):
        KeyIndex.from_arrays([-1, 0, 1, 2], ok, ok, [0] * 4)
    with pytest.raises(ValueError, match="slot has values outside"):
        KeyIndex.from_arrays(ok, ok, [0, 1, 2, 2**32], [0] * 4)
    with pytest.raises(ValueError, match="deadline has values outside"):
        KeyIndex.from_arrays(ok, ok, ok, np.array([0, 0, 0, 2**63], np.uint64))
    with pytest.raises(ValueError, match="deadline must be >= 0"):
        KeyIndex.from_arrays(ok, ok, ok, [0, -1, 0, 0])
    with pytest.raises(TypeError, match="integer dtype"):
        KeyIndex.from_arrays(ok.astype(float), ok, ok, ok)
    with pytest.raises(ValueError, match="1-D"):
        KeyIndex.from_arrays(ok.reshape(2, 2), ok, ok, ok)
    with pytest.raises(ValueError, match="block_size"):
        KeyIndex.from_arrays(ok, ok, ok, ok, block_size=2)


# --------------------------------------------------------------------------- state machine

DUES = st.integers(0, 40)
SEQS = st.integers(0, 6)
NOWS = st.integers(0, 60)
DEADLINES = st.one_of(st.just(0), st.integers(1, 80))


class KeyIndexMachine(RuleBasedStateMachine):
    """KeyIndex against Model under inserts, removals, leases and rebuilds."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Model()
        self.idx = KeyIndex(4)
        self.next_slot = 0

    @initialize(block_size=st.sampled_from([4, 5, 8]))
    def setup(self, block_size: int) -> None:
        self.idx = KeyIndex(block_size)

    def _slot(self) -> int:
        self.next_slot += 1
        return self.next_slot

    @rule(due=DUES, seq=SEQS, deadline=DEADLINES)
    def insert(self, due: int, seq: int, deadline: int) -> None:
        slot = self._slot()
        if (due, seq) in self.model.rows:
            with pytest.raises(KeyError):
                self.idx.insert(due, seq, slot, deadline)
        else:
            self.idx.insert(due, seq, slot, deadline)
            self.model.rows[(due, seq)] = (slot, deadline)

    @rule(gap=st.integers(0, 3), deadline=DEADLINES)
    def append(self, gap: int, deadline: int) -> None:
        last = max(self.model.rows, default=(0, 0))
        key = (last[0] + gap, last[1] + 1)
        slot = self._slot()
        self.idx.insert(*key, slot, deadline)
        self.model.rows[key] = (slot, deadline)

    @rule(due=DUES, seq=SEQS)
    def remove_any(self, due: int, seq: int) -> None:
        expect = self.model.rows.pop((due, seq), (-1, 0))[0]
        assert self.idx.remove(due, seq) == expect

    @precondition(lambda self: self.model.rows)
    @rule(data=st.data())
    def remove_existing(self, data) -> None:
        key = data.draw(st.sampled_from(sorted(self.model.rows)))
        assert self.idx.remove(*key) == self.model.rows.pop(key)[0]

    @rule(due=DUES, seq=SEQS, deadline=DEADLINES)
    def set_deadline(self, due: int, seq: int, deadline: int) -> None:
        present = (due, seq) in self.model.rows
        assert self.idx.set_deadline(due, seq, deadline) is present
        if present:
            self.model.rows[(due, seq)] = (self.model.rows[(due, seq)][0], deadline)

    @rule(now=NOWS, n=st.integers(0, 12), timeout=st.integers(0, 30))
    def lease(self, now: int, n: int, timeout: int) -> None:
        """Scan, then lease what came back (deadline = now + timeout, 0 -> stays)."""
        got = scan_list(self.idx, now, n)
        assert got == self.model.scan(now, n)
        for due, seq, slot, _ in got:
            if timeout:
                assert self.idx.set_deadline(due, seq, now + timeout)
                self.model.rows[(due, seq)] = (slot, now + timeout)

    @rule(now=NOWS)
    def next_due(self, now: int) -> None:
        assert self.idx.next_due(now) == self.model.next_due()

    @rule(now=NOWS)
    def count_due(self, now: int) -> None:
        assert self.idx.count_due(now) == self.model.count_due(now)

    @rule(n=st.integers(0, 10))
    def head(self, n: int) -> None:
        assert as_rows(self.idx.head(n)) == self.model.ordered()[:n]

    @rule()
    def reopen(self) -> None:
        rows = self.model.ordered()
        random.Random(len(rows)).shuffle(rows)
        cols = [np.array([r[i] for r in rows], dtype=np.int64) for i in range(4)]
        self.idx = KeyIndex.from_arrays(*cols, block_size=self.idx.block_size)

    @rule()
    def get_min_key(self) -> None:
        assert self.idx.min_key() == (min(self.model.rows) if self.model.rows else None)

    @invariant()
    def matches_model(self) -> None:
        self.idx.check()
        assert len(self.idx) == len(self.model.rows)
        assert as_rows(self.idx.to_arrays()) == self.model.ordered()


TestKeyIndexMachine = KeyIndexMachine.TestCase
TestKeyIndexMachine.settings = settings(
    max_examples=int(os.environ.get("ARMDB_HYP_EXAMPLES", "150")),
    stateful_step_count=60,
    deadline=None,
)


# --------------------------------------------------------------------------- timing (not a test)


def _timing() -> None:  # pragma: no cover - run by hand, figures go to docs/index.md
    def best(fn, repeat=5):
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    print(f"python {sys.version.split()[0]}, numpy {np.__version__}")
    # scan: 10,000 unexpired leases at the front, then 100,000 ready rows.
    leases, ready = 10_000, 100_000
    for bs in (256, 512):
        idx = KeyIndex(bs)
        for i in range(leases):
            idx.insert(1_000, i, i, 10**12)
        for i in range(ready):
            idx.insert(2_000, i, leases + i)
        out = out_arrays(32)
        t0 = time.perf_counter()
        assert idx.scan(10**6, *out) == 32
        first = time.perf_counter() - t0
        reps = 10_000
        t0 = time.perf_counter()
        for _ in range(reps):
            idx.scan(10**6, *out)
        later = (time.perf_counter() - t0) / reps
        t0 = time.perf_counter()
        for _ in range(reps):
            idx.next_due(10**6)
        nd = (time.perf_counter() - t0) / reps
        print(
            f"block {bs}: scan(n=32) past 10k leases: first {first * 1e6:.0f} us, "
            f"then {later * 1e6:.2f} us/scan; next_due {nd * 1e6:.2f} us"
        )

    n = 1_000_000
    for bs in (256, 512):
        rng = np.random.default_rng(0)
        idx = KeyIndex(bs)
        ins = idx.insert
        t0 = time.perf_counter()
        for i in range(n):
            ins(i, i, i)
        t_append = time.perf_counter() - t0
        mid = (rng.integers(0, n, 200_000) * 1).tolist()
        t0 = time.perf_counter()
        for j, m in enumerate(mid):  # middle inserts: (m, n + j) sorts right after (m, m)
            ins(m, n + j, 0)
        t_mid = time.perf_counter() - t0
        rem = idx.remove
        order = rng.permutation(n).tolist()[:200_000]
        t0 = time.perf_counter()
        for i in order:
            rem(i, i)
        t_rem = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(n):
            rem(i, i)  # FIFO acks (some already gone: -1)
        t_fifo = time.perf_counter() - t0
        print(
            f"block {bs}: 1M appends {n / t_append / 1e6:.2f} M/s; 200k middle inserts at 1M "
            f"{200_000 / t_mid / 1e6:.2f} M/s; 200k random removes {200_000 / t_rem / 1e6:.2f} M/s; "
            f"1M front removes {n / t_fifo / 1e6:.2f} M/s"
        )

    rng = np.random.default_rng(0)
    due = rng.integers(1_700_000_000_000, 1_700_000_100_000, n).astype(np.uint64)
    seq = rng.permutation(n).astype(np.uint64)
    slot = np.arange(n, dtype=np.uint32)
    deadline = np.where(rng.random(n) < 0.01, 1_700_000_200_000, 0).astype(np.int64)
    t = best(lambda: KeyIndex.from_arrays(due, seq, slot, deadline), 3)
    idx = KeyIndex.from_arrays(due, seq, slot, deadline)
    print(f"from_arrays 1M unsorted rows: {t * 1e3:.0f} ms; nbytes {idx.nbytes() / 1e6:.1f} MB")
    t = best(lambda: idx.count_due(1_700_000_050_000), 5)
    print(f"count_due at 1M rows: {t * 1e6:.0f} us")


if __name__ == "__main__":  # pragma: no cover
    _timing()
