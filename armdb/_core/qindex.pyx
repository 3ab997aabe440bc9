# cython: language_level=3
"""KeyIndex: the per-shard, in-RAM ordered index of a queue's live rows.

Why compiled
------------
Every queue operation goes through this index: ``push`` appends a key, ``ack``
removes one, ``nack`` and delayed pushes insert in the middle, and ``lease``
walks the front of the key order looking for rows that are due (SPEC Q9, Q10).
With a million rows per shard those must stay at a few hundred nanoseconds
each, and the lease scan must be able to step over thousands of outstanding
leases without creating a Python object per row and without holding the GIL
(Q10, Q28).  A ``sortedcontainers.SortedList`` of tuples would cost several
hundred bytes and five Python objects per row; here a row costs 32 bytes of C
memory.

Layout: sorted blocks
---------------------
Entries ``{due, seq, deadline, slot}`` are kept in key order ``(due, seq)``
(due first, both unsigned; the same order as the 16-byte big-endian key of
SPEC Q8) in a list of blocks.  Each block is a C array of at most
``block_size`` entries; a ``BlockMeta`` array holds, per block, the entry
pointer, the count, the block's last key (so a lookup binary-searches the
metadata array, which is contiguous, then binary-searches inside one block),
the number of leased entries and ``bmin`` (below).  This is the classic
"sorted list of sorted arrays" layout (B-tree leaves without the inner nodes,
as in Grant Jenks's ``sortedcontainers.SortedList``, here in C): an insert or a
remove moves at most ``block_size`` entries with one ``memmove``, plus, rarely,
one pointer-sized ``memmove`` of the metadata array when a block is split,
merged or dropped.

* Appending past the current last key (the common ``push``: due and seq grow)
  is a fast path: no search, and the last block is filled completely before a
  new one is started, so an append-only index is 100% dense.
* A full block that receives a key in its middle is split in two halves.
* A key that falls between two blocks goes to the end of the earlier block if
  that one has room (delayed pushes landing between blocks do not split).
* A block that falls to a quarter of ``block_size`` is merged with a neighbour
  when the two fit in three quarters of a block; an empty block is freed.  So
  after arbitrary removals blocks stay at least ~1/4 full on average.

Block summary for the lease skip-scan (Q10)
-------------------------------------------
Define ``eff(e) = e.deadline if e.deadline > 0 else 0`` (a ready row counts as
0).  Each block keeps ``bmin``, a LOWER BOUND of ``min(eff(e))`` over its
entries:

* inserting an entry, or lowering a deadline, does ``bmin = min(bmin, eff)``;
* raising a deadline (leasing) or removing an entry leaves ``bmin`` alone: it
  is still a lower bound, only possibly a stale one;
* the scan (and ``next_due``), when it walks a whole block and finds nothing
  to return, writes the exact minimum it computed back into ``bmin``.

Hence a block with ``bmin > now`` contains only leases that have not expired
(a ready entry would force ``bmin <= 0``, an expired one ``bmin <= now``), and
the scan skips it in O(1).  The cost of ``scan`` is therefore
O(blocks of unexpired leases at the front + entries of the blocks it must
walk), and the stale bounds are repaired by the first scan that pays for them.

Concurrency
-----------
A ``KeyIndex`` has no lock of its own.  Its owner (the queue shard) holds the
per-shard lock around every call; ``scan``, ``next_due`` and ``count_due``
release only the GIL, so consumers on other threads keep running (Q28) while
no one can modify the index under the walk.  As a safety net against a
caller that forgets the lock, every method refuses, with ``InternalError`` (a
``RuntimeError``), to
run while a GIL-free walk of the same index is in progress, instead of
corrupting memory.  (The flag is set and checked under the GIL; it is not a
lock and does not make unlocked use correct.)

Deadlines are wall-clock milliseconds (Q17); ``0`` means "not leased" and a
negative deadline is refused.  ``now`` is refused when negative and compared
with ``due`` as an unsigned value.
"""

cimport cython
from libc.stdint cimport INT64_MAX, int32_t, int64_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc, qsort, realloc
from libc.string cimport memcpy, memmove
from armdb._core.checked cimport malloc_array

import numpy as np

from armdb.errors import IndexConflict, InternalError

__all__ = ["KeyIndex"]


# Entry and BlockMeta are declared in qindex.pxd (armdb._core.qshard uses them).


cdef enum:
    MIN_BLOCK = 4
    MAX_BLOCK = 65536

# Status codes (OK, DUPLICATE, NOMEM, BUSY) are declared in qindex.pxd.


cdef int raise_status(int rc, uint64_t due, uint64_t seq) except -1:
    """The one place a status code of this module becomes an exception (armdb._core.qshard
    uses it too).  ``due`` and ``seq`` name the key a DUPLICATE is about.  Memory stays
    Python's ``MemoryError``: armdb.errors has no class of its own for it."""
    if rc == OK:
        return 0
    if rc == DUPLICATE:
        raise IndexConflict(f"the queue index already holds row {seq} (due {due}); armdb hands out a "
                            f"row id once: reopen the database and run armdb.check")
    if rc == NOMEM:
        raise MemoryError("KeyIndex: cannot allocate a block")
    if rc == BUSY:
        raise InternalError(
            "KeyIndex used while a scan of it runs without the GIL: "
            "callers must hold the shard lock around every call"
        )
    raise InternalError(f"KeyIndex: unknown status {rc}")


cdef int _cmp_ssize(const void* a, const void* b) noexcept nogil:
    cdef Py_ssize_t x = (<const Py_ssize_t*>a)[0], y = (<const Py_ssize_t*>b)[0]
    return (x > y) - (x < y)


cdef inline bint key_lt(uint64_t ad, uint64_t aseq, uint64_t bd, uint64_t bseq) noexcept nogil:
    return ad < bd or (ad == bd and aseq < bseq)


cdef inline int64_t eff(int64_t deadline) noexcept nogil:
    return deadline if deadline > 0 else 0


cdef inline Py_ssize_t lower_bound(const Entry* e, Py_ssize_t n, uint64_t due, uint64_t seq) noexcept nogil:
    """Index of the first entry of ``e[:n]`` whose key is >= (due, seq)."""
    cdef Py_ssize_t lo = 0, hi = n, mid
    while lo < hi:
        mid = (lo + hi) >> 1
        if key_lt(e[mid].due, e[mid].seq, due, seq):
            lo = mid + 1
        else:
            hi = mid
    return lo


@cython.final
cdef class KeyIndex:
    """Ordered index of queue rows keyed by ``(due_ms, seq)``; see the module docstring.

    Parameters
    ----------
    block_size : int, default 256
        Maximum entries per block (4 to 65536).  256-512 suits a million rows.

    Notes
    -----
    Not thread-safe by itself: the caller holds the shard lock around every call.
    """

    # Attributes and cdef methods are declared in qindex.pxd.

    def __cinit__(self, *args, **kwargs):
        # C attributes start zeroed; a block size is set even if __init__ never runs.
        self.B = 256

    def __init__(self, int block_size=256):
        if block_size < MIN_BLOCK or block_size > MAX_BLOCK:
            raise ValueError(f"block_size must be in [{MIN_BLOCK}, {MAX_BLOCK}], got {block_size}")
        self._enter()
        self._free_all()
        self.B = block_size

    def __dealloc__(self):
        self._free_all()

    # ------------------------------------------------------------------ helpers

    cdef int _enter(self) except -1:
        if self.busy:
            return raise_status(BUSY, 0, 0)
        return 0

    cdef void _free_all(self) noexcept nogil:
        cdef Py_ssize_t b
        if self.meta != NULL:
            for b in range(self.nblocks_):
                free(self.meta[b].e)
            free(self.meta)
        self.meta = NULL
        self.nblocks_ = 0
        self.cap = 0
        self.n = 0
        self.nleased = 0

    cdef int _new_block(self, Py_ssize_t at) noexcept nogil:
        """Insert an empty block at position ``at`` of the block list."""
        cdef Py_ssize_t newcap
        cdef BlockMeta* m
        cdef Entry* e
        if self.nblocks_ == self.cap:
            newcap = self.cap * 2 if self.cap else 16
            m = <BlockMeta*>realloc(self.meta, newcap * sizeof(BlockMeta))
            if m == NULL:
                return NOMEM
            self.meta = m
            self.cap = newcap
        e = <Entry*>malloc(self.B * sizeof(Entry))
        if e == NULL:
            return NOMEM
        memmove(&self.meta[at + 1], &self.meta[at], (self.nblocks_ - at) * sizeof(BlockMeta))
        self.nblocks_ += 1
        m = &self.meta[at]
        m.e = e
        m.n = 0
        m.nleased = 0
        m.bmin = INT64_MAX
        m.last_due = 0
        m.last_seq = 0
        return OK

    cdef void _drop_block(self, Py_ssize_t b) noexcept nogil:
        free(self.meta[b].e)
        memmove(&self.meta[b], &self.meta[b + 1], (self.nblocks_ - b - 1) * sizeof(BlockMeta))
        self.nblocks_ -= 1

    cdef void _set_last(self, BlockMeta* m) noexcept nogil:
        m.last_due = m.e[m.n - 1].due
        m.last_seq = m.e[m.n - 1].seq

    cdef int _split(self, Py_ssize_t b) noexcept nogil:
        """Move the upper half of block ``b`` into a new block ``b + 1``."""
        cdef BlockMeta* lo
        cdef BlockMeta* hi
        cdef Py_ssize_t h, i
        cdef int32_t moved_leased = 0
        if self._new_block(b + 1) != OK:
            return NOMEM
        lo = &self.meta[b]          # re-read: _new_block may have moved `meta`
        hi = &self.meta[b + 1]
        h = lo.n >> 1
        memcpy(hi.e, &lo.e[h], (lo.n - h) * sizeof(Entry))
        hi.n = <int32_t>(lo.n - h)
        for i in range(hi.n):
            if hi.e[i].deadline > 0:
                moved_leased += 1
        hi.nleased = moved_leased
        lo.nleased -= moved_leased
        lo.n = <int32_t>h
        hi.last_due = lo.last_due
        hi.last_seq = lo.last_seq
        self._set_last(lo)
        hi.bmin = lo.bmin           # still a lower bound for both halves
        return OK

    cdef void _maybe_merge(self, Py_ssize_t b) noexcept nogil:
        """Merge a block that fell to a quarter full into a neighbour, if they fit in 3/4."""
        cdef BlockMeta* m = &self.meta[b]
        cdef BlockMeta* other
        cdef Py_ssize_t lim = (3 * <Py_ssize_t>self.B) >> 2
        if m.n > (self.B >> 2):
            return
        if b + 1 < self.nblocks_ and m.n + self.meta[b + 1].n <= lim:
            other = &self.meta[b + 1]           # append b+1 to b, drop b+1
        elif b > 0 and self.meta[b - 1].n + m.n <= lim:
            other = m                           # append b to b-1, drop b
            b -= 1
            m = &self.meta[b]
        else:
            return
        memcpy(&m.e[m.n], other.e, other.n * sizeof(Entry))
        m.n += other.n
        m.nleased += other.nleased
        m.last_due = other.last_due
        m.last_seq = other.last_seq
        if other.bmin < m.bmin:
            m.bmin = other.bmin
        self._drop_block(b + 1)

    cdef Py_ssize_t _find_block(self, uint64_t due, uint64_t seq) noexcept nogil:
        """First block whose last key is >= (due, seq); ``nblocks`` if none."""
        cdef Py_ssize_t lo = 0, hi = self.nblocks_, mid
        while lo < hi:
            mid = (lo + hi) >> 1
            if key_lt(self.meta[mid].last_due, self.meta[mid].last_seq, due, seq):
                lo = mid + 1
            else:
                hi = mid
        return lo

    cdef Entry* _find(self, uint64_t due, uint64_t seq, Py_ssize_t* bout, Py_ssize_t* pout) noexcept nogil:
        """The entry with key (due, seq), or NULL; its block and position go to bout/pout."""
        cdef Py_ssize_t b, pos
        cdef BlockMeta* m
        cdef Entry* e
        if self.n == 0:
            return NULL
        # The finger: the entry found last, then its successor in key order (a batch's
        # keys in order, a plan then its apply, a lease walk): two comparisons instead of
        # two binary searches.  Bounds are checked, and keys are unique, so a stale
        # finger only misses.
        b = self.fb
        if b < self.nblocks_:
            m = &self.meta[b]
            pos = self.fp
            if pos < m.n:
                e = &m.e[pos]
                if e.seq == seq and e.due == due:
                    bout[0] = b
                    pout[0] = pos
                    return e
                pos += 1
                if pos == m.n and b + 1 < self.nblocks_:
                    b += 1
                    m = &self.meta[b]
                    pos = 0
                if pos < m.n:
                    e = &m.e[pos]
                    if e.seq == seq and e.due == due:
                        self.fb = b
                        self.fp = pos
                        bout[0] = b
                        pout[0] = pos
                        return e
        b = self._find_block(due, seq)
        if b == self.nblocks_:
            return NULL
        m = &self.meta[b]
        pos = lower_bound(m.e, m.n, due, seq)
        if pos == m.n or m.e[pos].due != due or m.e[pos].seq != seq:
            return NULL
        self.fb = b
        self.fp = pos
        bout[0] = b
        pout[0] = pos
        return &m.e[pos]

    # ------------------------------------------------------------------ kernels

    cdef int _insert(self, uint64_t due, uint64_t seq, uint32_t slot, int64_t deadline) noexcept nogil:
        cdef Py_ssize_t b, pos, half
        cdef BlockMeta* m
        cdef Entry* e
        if self.nblocks_ == 0:
            if self._new_block(0) != OK:
                return NOMEM
            b = 0
            pos = 0
        else:
            m = &self.meta[self.nblocks_ - 1]
            if key_lt(m.last_due, m.last_seq, due, seq):
                # Fast path: append past the last key (push with growing due/seq).
                b = self.nblocks_ - 1
                if m.n == self.B:
                    if self._new_block(self.nblocks_) != OK:
                        return NOMEM
                    b = self.nblocks_ - 1
                pos = self.meta[b].n
            else:
                b = self._find_block(due, seq)      # < nblocks: key <= last key
                m = &self.meta[b]
                pos = lower_bound(m.e, m.n, due, seq)
                if m.e[pos].due == due and m.e[pos].seq == seq:   # pos < n here
                    return DUPLICATE
                if pos == 0 and b > 0 and self.meta[b - 1].n < self.B:
                    # The key falls between blocks b-1 and b: append to b-1, no split.
                    b -= 1
                    pos = self.meta[b].n
                elif m.n == self.B:
                    if self._split(b) != OK:
                        return NOMEM
                    half = self.meta[b].n
                    if pos > half:
                        b += 1
                        pos -= half
        m = &self.meta[b]
        memmove(&m.e[pos + 1], &m.e[pos], (m.n - pos) * sizeof(Entry))
        e = &m.e[pos]
        e.due = due
        e.seq = seq
        e.slot = slot
        e.deadline = deadline
        m.n += 1
        if pos == m.n - 1:
            m.last_due = due
            m.last_seq = seq
        if eff(deadline) < m.bmin:
            m.bmin = eff(deadline)
        if deadline > 0:
            m.nleased += 1
            self.nleased += 1
        self.n += 1
        return OK

    cdef int64_t _remove(self, uint64_t due, uint64_t seq) noexcept nogil:
        cdef Py_ssize_t b = 0, pos = 0
        cdef Entry* e = self._find(due, seq, &b, &pos)
        cdef BlockMeta* m
        cdef int64_t slot
        if e == NULL:
            return -1
        slot = e.slot
        m = &self.meta[b]
        if e.deadline > 0:
            m.nleased -= 1
            self.nleased -= 1
        memmove(e, e + 1, (m.n - pos - 1) * sizeof(Entry))
        m.n -= 1
        self.n -= 1
        if m.n == 0:
            self._drop_block(b)
        else:
            if pos == m.n:
                self._set_last(m)
            self._maybe_merge(b)
        return slot

    cdef Py_ssize_t _remove_keys(self, const uint64_t* dues, const uint64_t* seqs, Py_ssize_t count,
                                 int64_t* slots_out) noexcept nogil:
        """Remove the keys ``(dues[j], seqs[j])`` (a batch of acks) with one compaction per
        block they fall in, instead of one ``memmove`` of the block's tail per key;
        ``slots_out[j]`` gets the key's slot, or -1 when it is absent (or given twice).
        Returns how many were removed, or NOMEM (nothing removed)."""
        cdef Py_ssize_t j, b = 0, pos = 0, nt = 0, removed = 0, t, i, k
        cdef Py_ssize_t* touched
        cdef bint ordered = True
        cdef Entry* e
        cdef BlockMeta* m
        if count <= 0 or self.n == 0:
            for j in range(count):
                slots_out[j] = -1
            return 0
        touched = <Py_ssize_t*>malloc(count * sizeof(Py_ssize_t))
        if touched == NULL:
            return NOMEM
        # Mark: a removed entry's deadline becomes -1 (a real one is never negative).
        for j in range(count):
            e = self._find(dues[j], seqs[j], &b, &pos)
            if e == NULL or e.deadline < 0:
                slots_out[j] = -1
                continue
            slots_out[j] = e.slot
            if e.deadline > 0:
                self.meta[b].nleased -= 1
                self.nleased -= 1
            e.deadline = -1
            removed += 1
            if nt == 0 or touched[nt - 1] != b:
                if nt and touched[nt - 1] > b:
                    ordered = False
                touched[nt] = b
                nt += 1
        if not ordered:
            qsort(touched, nt, sizeof(Py_ssize_t), _cmp_ssize)
        # Sweep the marked blocks from the last: dropping or merging block b moves only
        # blocks after it, which are done.
        t = nt - 1
        while t >= 0:
            b = touched[t]
            t -= 1
            while t >= 0 and touched[t] == b:
                t -= 1
            m = &self.meta[b]
            k = 0
            for i in range(m.n):
                if m.e[i].deadline >= 0:
                    if k != i:
                        m.e[k] = m.e[i]
                    k += 1
            self.n -= m.n - k
            m.n = <int32_t>k
            if k == 0:
                self._drop_block(b)
            else:
                self._set_last(m)
                self._maybe_merge(b)
        free(touched)
        return removed

    cdef Py_ssize_t _scan(self, int64_t now, uint64_t* out_due, uint64_t* out_seq,
                          uint32_t* out_slot, int64_t* out_deadline, Py_ssize_t cap) noexcept nogil:
        """Lease skip-scan (Q9, Q10): candidates in key order, at most ``cap``."""
        cdef uint64_t nowu = <uint64_t>now
        cdef Py_ssize_t b, i, cnt = 0
        cdef BlockMeta* m
        cdef Entry* e
        cdef int64_t d, exact
        cdef bint found
        if cap <= 0:
            return 0
        for b in range(self.nblocks_):
            m = &self.meta[b]
            e = m.e
            if e[0].due > nowu:
                return cnt                  # Q9: stop at the first key not yet due
            if m.bmin > now:
                continue                    # only unexpired leases in this block
            exact = INT64_MAX
            found = False
            for i in range(m.n):
                if e[i].due > nowu:
                    return cnt
                d = e[i].deadline
                if d > now:                 # leased, not expired: skip
                    if d < exact:
                        exact = d
                    continue
                # d == 0: ready and due; 0 < d <= now: expired lease
                out_due[cnt] = e[i].due
                out_seq[cnt] = e[i].seq
                out_slot[cnt] = e[i].slot
                out_deadline[cnt] = d
                cnt += 1
                found = True
                if cnt == cap:
                    return cnt
            if not found:
                m.bmin = exact              # walked the whole block: bound is now exact
        return cnt

    cdef int64_t _next_due(self) noexcept nogil:
        cdef Py_ssize_t b, i
        cdef BlockMeta* m
        cdef Entry* e
        cdef int64_t best = INT64_MAX, exact, d
        if self.n == 0:
            return -1
        for b in range(self.nblocks_):
            m = &self.meta[b]
            # bmin > 0 means every entry is leased (a ready one forces bmin <= 0), so
            # the block holds no walk-ending entry and nothing below bmin.
            if m.bmin > 0 and m.bmin >= best:
                continue
            e = m.e
            exact = INT64_MAX
            for i in range(m.n):
                d = e[i].deadline
                if d == 0:
                    # First unleased entry: later entries are due no earlier.
                    if exact < best:
                        best = exact
                    if e[i].due < <uint64_t>best:
                        return <int64_t>e[i].due
                    return best
                if d < exact:
                    exact = d
            m.bmin = exact                  # walked the whole block: exact
            if exact < best:
                best = exact
        return best

    cdef void _count_due(self, int64_t now, Py_ssize_t* ready_out) noexcept nogil:
        cdef uint64_t nowu = <uint64_t>now
        cdef Py_ssize_t b, i, ready = 0
        cdef BlockMeta* m
        for b in range(self.nblocks_):
            m = &self.meta[b]
            if m.last_due <= nowu:
                ready += m.n - m.nleased
                continue
            for i in range(m.n):
                if m.e[i].due > nowu:
                    break
                if m.e[i].deadline == 0:
                    ready += 1
            break
        ready_out[0] = ready

    cdef void _copy_out(self, Py_ssize_t count, uint64_t* od, uint64_t* os,
                        uint32_t* osl, int64_t* odl) noexcept nogil:
        cdef Py_ssize_t b, i, k = 0
        cdef BlockMeta* m
        for b in range(self.nblocks_):
            m = &self.meta[b]
            for i in range(m.n):
                if k == count:
                    return
                od[k] = m.e[i].due
                os[k] = m.e[i].seq
                osl[k] = m.e[i].slot
                odl[k] = m.e[i].deadline
                k += 1

    cdef int _fill(self, const uint64_t* due, const uint64_t* seq, const uint32_t* slot,
                   const int64_t* deadline, Py_ssize_t count) noexcept nogil:
        """Fill an empty index from entries already sorted by key, blocks 100% full."""
        cdef Py_ssize_t k = 0, i, take
        cdef BlockMeta* m
        cdef Entry* e
        cdef int64_t bmin
        cdef int32_t nl
        while k < count:
            if self._new_block(self.nblocks_) != OK:
                return NOMEM
            m = &self.meta[self.nblocks_ - 1]
            e = m.e
            take = count - k
            if take > self.B:
                take = self.B
            bmin = INT64_MAX
            nl = 0
            for i in range(take):
                e[i].due = due[k + i]
                e[i].seq = seq[k + i]
                e[i].slot = slot[k + i]
                e[i].deadline = deadline[k + i]
                if eff(e[i].deadline) < bmin:
                    bmin = eff(e[i].deadline)
                if e[i].deadline > 0:
                    nl += 1
            m.n = <int32_t>take
            m.nleased = nl
            m.bmin = bmin
            self._set_last(m)
            self.n += take
            self.nleased += nl
            k += take
        return OK

    # ------------------------------------------------------------------ Python API

    def __len__(self):
        return self.n

    def __repr__(self):
        return (f"KeyIndex(len={self.n}, leased={self.nleased}, blocks={self.nblocks_}, "
                f"block_size={self.B})")

    @property
    def block_size(self):
        """Maximum entries per block."""
        return self.B

    @property
    def nblocks(self):
        """Number of blocks in use (for tests and ``stats``)."""
        return self.nblocks_

    def insert(self, uint64_t due, uint64_t seq, uint32_t slot, int64_t deadline=0):
        """Insert the row ``(due, seq)`` held in ``slot``.

        Parameters
        ----------
        due, seq : int
            The key (unsigned 64-bit each); order is due first, then seq.
        slot : int
            Slot number of the row in the header file (unsigned 32-bit).
        deadline : int, default 0
            0 for a row that is not leased, else the lease deadline in ms.

        Raises
        ------
        armdb.errors.IndexConflict
            The key is already present (the index is unchanged); a ``KeyError``.
        ValueError
            ``deadline`` is negative.
        MemoryError
            A block could not be allocated (the index is unchanged).
        """
        self._enter()
        if deadline < 0:
            raise ValueError(f"deadline must be >= 0 (0 = not leased), got {deadline}")
        raise_status(self._insert(due, seq, slot, deadline), due, seq)

    def remove(self, uint64_t due, uint64_t seq):
        """Remove the row ``(due, seq)``.

        Returns
        -------
        int
            The removed row's slot, or -1 when the key is absent.
        """
        self._enter()
        return self._remove(due, seq)

    def remove_many(self, const uint64_t[::1] dues, const uint64_t[::1] seqs):
        """Remove the rows ``(dues[j], seqs[j])`` in one pass (a batch of acks); returns an
        ``int64`` array of their slots, -1 where a key is absent or repeated."""
        cdef Py_ssize_t n = seqs.shape[0], r
        if dues.shape[0] != n:
            raise ValueError("remove_many: dues and seqs differ in length")
        self._enter()
        out = np.empty(n, dtype=np.int64)
        cdef int64_t[::1] o = out
        if n:
            r = self._remove_keys(&dues[0], &seqs[0], n, &o[0])
            if r < 0:
                raise_status(<int>r, 0, 0)
        return out

    def get(self, uint64_t due, uint64_t seq):
        """``(slot, deadline)`` of the row ``(due, seq)``, or None when absent."""
        cdef Py_ssize_t b = 0, pos = 0
        cdef Entry* e
        self._enter()
        e = self._find(due, seq, &b, &pos)
        if e == NULL:
            return None
        return (e.slot, e.deadline)

    def __contains__(self, key):
        cdef Py_ssize_t b = 0, pos = 0
        cdef uint64_t due, seq
        self._enter()
        due, seq = key
        return self._find(due, seq, &b, &pos) != NULL

    def set_deadline(self, uint64_t due, uint64_t seq, int64_t deadline):
        """Set the lease deadline of row ``(due, seq)`` (0 releases the lease).

        Returns
        -------
        bool
            False when the key is absent (nothing changes).

        Raises
        ------
        ValueError
            ``deadline`` is negative.
        """
        self._enter()
        if deadline < 0:
            raise ValueError(f"deadline must be >= 0 (0 = not leased), got {deadline}")
        return self._set_deadline(due, seq, deadline)

    cdef bint _set_deadline(self, uint64_t due, uint64_t seq, int64_t deadline) noexcept nogil:
        cdef Py_ssize_t b = 0, pos = 0
        cdef Entry* e = self._find(due, seq, &b, &pos)
        cdef BlockMeta* m
        if e == NULL:
            return False
        m = &self.meta[b]
        if (e.deadline > 0) != (deadline > 0):
            if deadline > 0:
                m.nleased += 1
                self.nleased += 1
            else:
                m.nleased -= 1
                self.nleased -= 1
        e.deadline = deadline
        if eff(deadline) < m.bmin:      # raising leaves the lower bound valid
            m.bmin = eff(deadline)
        return True

    def scan(self, int64_t now, uint64_t[::1] out_due, uint64_t[::1] out_seq,
             uint32_t[::1] out_slot, int64_t[::1] out_deadline):
        """Lease skip-scan (SPEC Q9, Q10, Q11), without the GIL.

        Walks entries in key order from the front, stops at the first entry
        whose due is after ``now``, skips leases that have not expired
        (``deadline > now``; whole blocks at once when their ``bmin > now``)
        and collects candidates: ready rows (``deadline == 0``) and expired
        leases (``0 < deadline <= now``), until the output arrays are full.

        Parameters
        ----------
        now : int
            Current time in ms (>= 0).
        out_due, out_seq, out_slot, out_deadline : ndarray
            C-contiguous, writable ``uint64``, ``uint64``, ``uint32``, ``int64``
            arrays of one length ``n``: the capacity.

        Returns
        -------
        int
            The number of candidates written to the front of the arrays, in key order.

        Raises
        ------
        ValueError
            ``now`` is negative or the arrays differ in length.
        """
        cdef Py_ssize_t cap = out_due.shape[0], cnt
        self._enter()
        if now < 0:
            raise ValueError(f"now must be >= 0, got {now}")
        if out_seq.shape[0] != cap or out_slot.shape[0] != cap or out_deadline.shape[0] != cap:
            raise ValueError(
                f"output arrays differ in length: {cap}, {out_seq.shape[0]}, "
                f"{out_slot.shape[0]}, {out_deadline.shape[0]}"
            )
        if cap == 0 or self.n == 0:
            return 0
        self.busy = True
        try:
            with nogil:
                cnt = self._scan(now, &out_due[0], &out_seq[0], &out_slot[0], &out_deadline[0], cap)
        finally:
            self.busy = False
        return cnt

    def candidates(self, int64_t now, Py_ssize_t cap):
        """:meth:`scan` for a few rows, returned as a list of ``(due, seq, slot)`` tuples.

        The queue's lease path asks for ``n`` rows at a time (usually one); this form
        needs no output arrays from the caller, whose buffer acquisition would cost
        more than the walk.
        """
        cdef Py_ssize_t cnt, i
        cdef uint64_t* buf
        self._enter()
        if now < 0:
            raise ValueError(f"now must be >= 0, got {now}")
        if cap <= 0 or self.n == 0:
            return []
        if cap > self.n:
            cap = self.n  # the buffer is sized by what the index holds, not by the request
        buf = <uint64_t*>malloc_array(cap, SCAN_WORDS * sizeof(uint64_t))
        try:
            cnt = self._scan_into(now, buf, cap, cap)
            return [(buf[i], buf[cap + i], (<uint32_t*>(buf + 3 * cap))[i]) for i in range(cnt)]
        finally:
            free(buf)

    cdef Py_ssize_t _scan_into(self, int64_t now, uint64_t* buf, Py_ssize_t cap, Py_ssize_t want) except -1:
        """:meth:`_scan` of up to ``want`` rows into one buffer of ``SCAN_WORDS * cap``
        words: dues at ``buf``, seqs at ``buf + cap``, deadlines at ``buf + 2 * cap``,
        slots (uint32) from ``buf + 3 * cap``.  The GIL is released while unexpired
        leases may have to be skipped; with none, the first entry is the answer and
        releasing it would cost more than the walk.  The caller checked ``_enter``."""
        cdef Py_ssize_t cnt
        cdef uint32_t* slots = <uint32_t*>(buf + 3 * cap)
        cdef int64_t* deadlines = <int64_t*>(buf + 2 * cap)
        if not self.nleased:
            return self._scan(now, buf, buf + cap, slots, deadlines, want)
        self.busy = True
        try:
            with nogil:
                cnt = self._scan(now, buf, buf + cap, slots, deadlines, want)
        finally:
            self.busy = False
        return cnt

    def next_due(self, int64_t now):
        """Earliest moment (ms) at which a row is or becomes due; -1 when empty.

        Exact: the minimum over entries in key order, where a leased entry
        contributes its deadline (expired or not) and the first unleased entry
        contributes its due and ends the walk.  A result ``<= now`` means a row
        is due now.  ``now`` does not change the result; it is validated and
        kept for symmetry with ``scan`` and ``count_due``.  A due beyond
        2**63 - 1 is reported as 2**63 - 1.
        """
        cdef int64_t r
        self._enter()
        if now < 0:
            raise ValueError(f"now must be >= 0, got {now}")
        if self.n == 0:
            return -1
        self.busy = True
        try:
            with nogil:
                r = self._next_due()
        finally:
            self.busy = False
        return r

    def count_due(self, int64_t now):
        """``(ready_due, leased, not_yet_due)`` over all entries.

        ``ready_due``: not leased and ``due <= now``; ``leased``: ``deadline > 0``,
        expired or not; ``not_yet_due``: not leased and ``due > now``.
        Cost O(blocks with due <= now), using per-block leased counts.
        """
        cdef Py_ssize_t ready = 0
        self._enter()
        if now < 0:
            raise ValueError(f"now must be >= 0, got {now}")
        self.busy = True
        try:
            with nogil:
                self._count_due(now, &ready)
        finally:
            self.busy = False
        return (ready, self.nleased, self.n - self.nleased - ready)

    def min_key(self):
        """``(due, seq)`` of the first entry, or None when empty."""
        self._enter()
        if self.n == 0:
            return None
        return (self.meta[0].e[0].due, self.meta[0].e[0].seq)

    def head(self, Py_ssize_t n):
        """The first ``n`` entries (fewer if the index is shorter) in key order.

        Returns
        -------
        tuple of ndarray
            ``(due uint64, seq uint64, slot uint32, deadline int64)``.
        """
        self._enter()
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > self.n:
            n = self.n
        due = np.empty(n, dtype=np.uint64)
        seq = np.empty(n, dtype=np.uint64)
        slot = np.empty(n, dtype=np.uint32)
        deadline = np.empty(n, dtype=np.int64)
        cdef uint64_t[::1] vd = due
        cdef uint64_t[::1] vs = seq
        cdef uint32_t[::1] vsl = slot
        cdef int64_t[::1] vdl = deadline
        if n > 0:
            self._copy_out(n, &vd[0], &vs[0], &vsl[0], &vdl[0])
        return due, seq, slot, deadline

    def to_arrays(self):
        """All entries in key order as ``(due uint64, seq uint64, slot uint32, deadline int64)``."""
        return self.head(self.n)

    def clear(self):
        """Remove every entry and free all blocks."""
        self._enter()
        self._free_all()

    def nbytes(self):
        """Bytes of C memory held (block arrays and the block metadata array)."""
        return self.cap * sizeof(BlockMeta) + self.nblocks_ * self.B * sizeof(Entry)

    def check(self):
        """Verify every internal invariant; raise ``InternalError`` (a ``RuntimeError``) on the first violation.

        O(n).  For tests and for ``Db.check()``: key order within and across
        blocks, counts, last keys, leased counts, and that each ``bmin`` is a
        lower bound of its block.
        """
        cdef Py_ssize_t b, i, total = 0, tleased = 0
        cdef BlockMeta* m
        cdef int32_t nl
        cdef int64_t lo
        cdef bint have_prev = False
        cdef uint64_t pd = 0, ps = 0
        self._enter()
        if self.nblocks_ > self.cap:
            raise InternalError("KeyIndex: more blocks than allocated metadata")
        for b in range(self.nblocks_):
            m = &self.meta[b]
            if m.n <= 0 or m.n > self.B:
                raise InternalError(f"KeyIndex: block {b} holds {m.n} entries (block_size {self.B})")
            nl = 0
            lo = INT64_MAX
            for i in range(m.n):
                if have_prev and not key_lt(pd, ps, m.e[i].due, m.e[i].seq):
                    raise InternalError(
                        f"KeyIndex: key order broken at block {b} entry {i}: "
                        f"{(pd, ps)} then {(m.e[i].due, m.e[i].seq)}"
                    )
                pd = m.e[i].due
                ps = m.e[i].seq
                have_prev = True
                if m.e[i].deadline < 0:
                    raise InternalError(f"KeyIndex: negative deadline at block {b} entry {i}")
                if m.e[i].deadline > 0:
                    nl += 1
                if eff(m.e[i].deadline) < lo:
                    lo = eff(m.e[i].deadline)
            if m.last_due != pd or m.last_seq != ps:
                raise InternalError(f"KeyIndex: block {b} last key is stale")
            if m.nleased != nl:
                raise InternalError(f"KeyIndex: block {b} leased count {m.nleased} != {nl}")
            if m.bmin > lo:
                raise InternalError(f"KeyIndex: block {b} bmin {m.bmin} above its minimum {lo}")
            total += m.n
            tleased += nl
        if total != self.n or tleased != self.nleased:
            raise InternalError(
                f"KeyIndex: totals {self.n}/{self.nleased} != counted {total}/{tleased}"
            )

    @staticmethod
    def from_arrays(due, seq, slot, deadline, int block_size=256):
        """Build an index from unsorted arrays in one pass (cold open).

        Parameters
        ----------
        due, seq : array_like of unsigned (or non-negative) integers
        slot : array_like of integers in [0, 2**32)
        deadline : array_like of integers >= 0 (0 = not leased)
        block_size : int, default 256

        Returns
        -------
        KeyIndex
            Blocks filled completely, ``bmin`` exact.

        Raises
        ------
        ValueError
            Lengths differ, an array is not 1-D, a value is out of range, or a
            key ``(due, seq)`` occurs twice.
        TypeError
            An array is not of an integer dtype.
        """
        idx = KeyIndex(block_size)      # validates block_size before any work
        d = _as_int_array(due, "due", np.uint64)
        s = _as_int_array(seq, "seq", np.uint64)
        sl = _as_int_array(slot, "slot", np.uint32)
        dl = _as_int_array(deadline, "deadline", np.int64)
        cdef Py_ssize_t count = d.shape[0]
        if s.shape[0] != count or sl.shape[0] != count or dl.shape[0] != count:
            raise ValueError(
                f"arrays differ in length: due {count}, seq {s.shape[0]}, "
                f"slot {sl.shape[0]}, deadline {dl.shape[0]}"
            )
        if count > 1 and not _strictly_increasing(d, s):
            order = np.lexsort((s, d))
            d = d[order]
            s = s[order]
            sl = sl[order]
            dl = dl[order]
            if not _strictly_increasing(d, s):
                dup = np.flatnonzero((d[1:] == d[:count - 1]) & (s[1:] == s[:count - 1]))[0]
                raise ValueError(f"duplicate key (due={int(d[dup])}, seq={int(s[dup])})")
        if count == 0:
            return idx
        cdef const uint64_t[::1] vd = d
        cdef const uint64_t[::1] vs = s
        cdef const uint32_t[::1] vsl = sl
        cdef const int64_t[::1] vdl = dl
        cdef KeyIndex k = idx
        cdef int rc
        with nogil:     # `k` is new and private to this call: nobody else can see it yet
            rc = k._fill(&vd[0], &vs[0], &vsl[0], &vdl[0], count)
        if rc != OK:
            k._free_all()
            raise_status(rc, 0, 0)
        return idx


def _strictly_increasing(d, s):
    """True when the keys (d[i], s[i]) strictly increase."""
    cdef Py_ssize_t m = len(d) - 1     # explicit: wraparound is off in this module
    return bool(np.all((d[1:] > d[:m]) | ((d[1:] == d[:m]) & (s[1:] > s[:m]))))


def _as_int_array(a, str name, dtype):
    """``a`` as a C-contiguous 1-D array of ``dtype``, refusing values that would wrap."""
    arr = np.asarray(a)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=dtype)
    if arr.dtype.kind not in "ui":
        raise TypeError(f"{name} must have an integer dtype, got {arr.dtype}")
    info = np.iinfo(dtype)
    if arr.dtype != np.dtype(dtype):
        # Compare in Python ints so that mixed signedness cannot wrap.
        if int(arr.min()) < info.min or int(arr.max()) > info.max:
            raise ValueError(f"{name} has values outside [{info.min}, {info.max}]")
    if name == "deadline" and int(arr.min()) < 0:
        raise ValueError("deadline must be >= 0 (0 = not leased)")
    return np.ascontiguousarray(arr, dtype=dtype)
