# cython: language_level=3
"""Declarations of armdb._core.fixed, shared with armdb._core.qshard."""

from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t


cdef inline uint32_t ring_step(uint32_t version) noexcept nogil:
    """The slot version after ``version`` on the 30-bit ring, never 0 (S3)."""
    cdef uint32_t v = (version + 1) & 0x3FFFFFFF
    return v if v else 1


cdef class SlotFile:
    cdef uint8_t[:, ::1] slots
    cdef uint32_t[::1] versions
    cdef uint8_t[::1] status
    cdef uint8_t[::1] redo
    cdef uint32_t[::1] free_stack
    cdef Py_ssize_t size
    cdef Py_ssize_t base
    cdef public Py_ssize_t occupied, dirty_lo, dirty_hi, hwm, writes, free_top
    cdef public double last_sync    # time.monotonic() of the last msync (FixedShard)
    cdef public bint closed         # release() ran: the views are gone, every access refuses
    # Direct writes (a durable store whose maps carry no hook, FixedShard._bind): slots
    # and redo records reach the files by pwrite(2), not through the mapping; -1: mapped.
    cdef public int wfd, rfd
    cdef public int werrno          # the errno of the first direct write that failed; 0: none
    cdef bytearray scratch          # a redo record composed off the mapping (direct writes)
    cdef public object name         # the shard's folder, for the DbClosed message

    cdef int _alive(self) except -1

    cdef void _set_status(self, Py_ssize_t i, uint8_t st) noexcept
    cdef uint32_t _put(self, Py_ssize_t i, int st, const uint8_t* body, Py_ssize_t n,
                       uint32_t version, bint copy) noexcept
    cdef void _mark(self, Py_ssize_t i) noexcept
    cdef void _pwrite(self, int fd, const uint8_t* src, Py_ssize_t n, Py_ssize_t off) noexcept
    cdef Py_ssize_t _pop_free(self) noexcept
    cdef void _push_free(self, Py_ssize_t i) noexcept
    cpdef uint32_t put(self, Py_ssize_t i, int st, bytes body, uint32_t version=*, bint copy=*) except? 0
    cpdef Py_ssize_t commit(self) except -1


cdef class SlotStore:
    # The store behind a SlotFile, as a kernel sees it: armdb.fixed.FixedShard derives from
    # it.  A kernel that writes slots (armdb._core.qshard) reads these typed fields.
    cdef public Py_ssize_t index         # the shard's number
    cdef public object poisoned          # the failure that fences the store (S12), or None
    cdef public object sync_error        # a timed sync's failure that after_write kept, or None
    cpdef raise_sync_error(self)         # raise and forget the kept failure, if any
    # Called by name, off the hot path (FixedShard, in Python): check_writable() (DbClosed
    # once closed, StorageError once poisoned), grow() (the free stack was empty),
    # sync_redo() (an ordered store's redo record), after_write(slot) (a hooked write or a
    # due timed sync).


cdef class PutKernel:
    # BitcaskStore.put of an unencrypted store in one call (armdb._core.qshard.VarFast
    # calls put directly).
    cdef object store, auto_compact, sync_interval
    cdef list shards, locks              # each shard and its lock (armdb._core.locks.Lock)
    cdef dict sd, fsd, faild, filesd     # the store's instance dict; armdb._fs's, _fail's, bitcask.files' dicts
    cdef uint16_t magic
    cdef Py_ssize_t marked_version, max_file_size, max_key, max_value
    cdef uint64_t seq_mask
    cdef bint fsync
    # The fields tomb reads and writes by their slot's offset (see _slot_offset): the
    # classes of the shard, its data file and its hint builder, and the offsets (_AT_*).
    cdef type shard_t, file_t, hint_t
    cdef Py_ssize_t at[24]
    cdef int _hint(self, object hint, uint64_t word, Py_ssize_t off, uint32_t vlen, bytes key) except -1
    cdef bint _put_locked(self, object sh, bytes key, bytes value, object seq) except -1
    cpdef object put(self, Py_ssize_t i, bytes key, bytes value)
    cpdef object tomb(self, bytes key, object gsn)
