# cython: language_level=3
"""Declarations of armdb._core.qindex, shared with armdb._core.qshard."""

cimport cython
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t


cdef struct Entry:
    uint64_t due
    uint64_t seq
    int64_t deadline      # 0: not leased; > 0: lease deadline (ms)
    uint32_t slot         # the row's slot in the header file


cdef struct BlockMeta:
    Entry* e              # malloc'ed array of `block_size` entries
    uint64_t last_due     # key of e[n - 1]; valid while n > 0
    uint64_t last_seq
    int64_t bmin          # lower bound of min(eff(e[i])) (see the module docstring)
    int32_t n             # entries in use
    int32_t nleased       # entries with deadline > 0


cdef enum:
    SCAN_WORDS = 4        # 64-bit words per candidate in a _scan_into buffer

# Status codes of the nogil kernels; raise_status turns them into exceptions.
cdef enum:
    OK = 0
    DUPLICATE = 1         # the key is already in the index (IndexConflict)
    NOMEM = -1            # a block could not be allocated (MemoryError)
    BUSY = 2              # called while a GIL-free walk of the index runs (InternalError)


cdef int raise_status(int rc, uint64_t due, uint64_t seq) except -1


@cython.final
cdef class KeyIndex:
    cdef BlockMeta* meta
    cdef Py_ssize_t nblocks_
    cdef Py_ssize_t cap            # allocated length of `meta`
    cdef Py_ssize_t n              # total entries
    cdef Py_ssize_t nleased        # total entries with deadline > 0
    cdef int32_t B
    cdef bint busy                 # a GIL-free walk is running (see "Concurrency")
    cdef Py_ssize_t fb, fp         # block and position of the entry _find found last (a hint)

    cdef int _enter(self) except -1
    cdef void _free_all(self) noexcept nogil
    cdef int _new_block(self, Py_ssize_t at) noexcept nogil
    cdef void _drop_block(self, Py_ssize_t b) noexcept nogil
    cdef void _set_last(self, BlockMeta* m) noexcept nogil
    cdef int _split(self, Py_ssize_t b) noexcept nogil
    cdef void _maybe_merge(self, Py_ssize_t b) noexcept nogil
    cdef Py_ssize_t _find_block(self, uint64_t due, uint64_t seq) noexcept nogil
    cdef Entry* _find(self, uint64_t due, uint64_t seq, Py_ssize_t* bout, Py_ssize_t* pout) noexcept nogil
    cdef int _insert(self, uint64_t due, uint64_t seq, uint32_t slot, int64_t deadline) noexcept nogil
    cdef int64_t _remove(self, uint64_t due, uint64_t seq) noexcept nogil
    cdef Py_ssize_t _remove_keys(self, const uint64_t* dues, const uint64_t* seqs, Py_ssize_t count,
                                 int64_t* slots_out) noexcept nogil
    cdef bint _set_deadline(self, uint64_t due, uint64_t seq, int64_t deadline) noexcept nogil
    cdef Py_ssize_t _scan(self, int64_t now, uint64_t* out_due, uint64_t* out_seq,
                          uint32_t* out_slot, int64_t* out_deadline, Py_ssize_t cap) noexcept nogil
    cdef Py_ssize_t _scan_into(self, int64_t now, uint64_t* buf, Py_ssize_t cap, Py_ssize_t want) except -1
    cdef int64_t _next_due(self) noexcept nogil
    cdef void _count_due(self, int64_t now, Py_ssize_t* ready_out) noexcept nogil
    cdef void _copy_out(self, Py_ssize_t count, uint64_t* od, uint64_t* os,
                        uint32_t* osl, int64_t* odl) noexcept nogil
    cdef int _fill(self, const uint64_t* due, const uint64_t* seq, const uint32_t* slot,
                   const int64_t* deadline, Py_ssize_t count) noexcept nogil
