# cython: language_level=3
"""FixedStore kernels: slot CRC, slot writes, open-time validation, version ring.

Why compiled: opening a queue validates every slot of ``fixed.data`` (100,000 per
shard with the queue preset, millions for large queues) and every push, lease and
ack writes a slot.  Doing the CRC and the copy in C keeps a slot write near the
cost of the ``memcpy`` itself (SPEC section 8: a 32-byte write into a mapped file
is 0.1-0.2 us) and lets open-time validation run without the GIL.

Slot layout (SPEC S1, docs/format.md): ``meta: u32 LE`` (``version << 2 | status``),
``crc32: u32 LE`` over the 4 meta bytes then the body (key and value), then the
body.  An all-zero slot is free (S11): a zero meta is status free, and it is never
CRC-checked, so a sparse hole or a zero-extended file can never parse as a row.

The CRC is the IEEE CRC-32 of zlib (so ``zlib.crc32`` in Python computes the same
value), table-driven "slice-by-8" as in Intel's and zlib's implementations.

Direct writes
-------------
A durable store (every write synced before it returns) binds its ``SlotFile`` with the
descriptors of ``fixed.data`` and ``fixed.redo``: slots, and the redo records a sync
will cover, go to the files by ``pwrite(2)``; the mapping still serves reads (the same
page-cache pages).  Each sync write-protects the pages it cleaned, so a store through
the mapping into them took a page fault, 5-8 us of a durable push of about 55 us
(docs/format.md, "Direct writes").  A failed ``pwrite`` is kept in ``werrno`` (no later
write reaches the file) for the sync that follows in the same call to report.
"""

from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_Resize
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.list cimport PyList_GET_ITEM, PyList_New, PyList_SET_ITEM
from cpython.ref cimport Py_INCREF, Py_XDECREF
from libc.stdint cimport int8_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.errno cimport EINTR, EIO, errno
from libc.string cimport memcpy, memset


cdef extern from "<unistd.h>" nogil:
    ssize_t pwrite(int fd, const void* buf, size_t n, long long off)

cdef extern from "Python.h":
    ctypedef struct PyObject
    void PyObject_GC_UnTrack(void* op)
    PyObject* PyDict_SetDefault(object d, object key, object default) except? NULL
    Py_ssize_t PyDict_Size(object d)
    # PyDict_GetItem without its save and restore of the error state (str keys, whose
    # hash and comparison cannot fail).
    PyObject* PyDict_GetItemWithError(object d, object key) except? NULL

import numpy as np

cimport numpy as cnp

from armdb._core.npvec cimport array_data

cnp.import_array()

from armdb._core.locks cimport Lock, give, take
from armdb._core._util cimport (
    copy_bytes,
    load_le,
    load_u32,
    load_u64,
    monotonic_s,
    msgpack_u32,
    py_uint,
    store_u32,
    store_u64,
)
from armdb._core.qrow cimport (
    AT_ATTEMPTS,
    AT_DEADLINE,
    AT_EPOCH,
    AT_FLAGS,
    AT_PAYLOAD_ID,
    AT_PUSHED,
    AT_STATE,
    HEADER_SIZE,
)
from armdb.errors import DbClosed

RING_BITS = 30

# Status values of a slot (the low 2 bits of meta).
FREE = 0
OCCUPIED = 1
DELETED = 2
TORN = 3  # only in validate() output: the slot failed its CRC
cdef uint8_t _ROW_DELETED = DELETED  # (the C copy ack_rows writes)

RING_MASK = (1 << RING_BITS) - 1
RING_HALF = 1 << (RING_BITS - 1)

# compare() results
OLDER = -1
EQUAL = 0
NEWER = 1
STALE = 2  # the difference lies exactly on the half-ring: never guessed (S3)

cdef uint32_t _MASK = 0x3FFFFFFF  # 30-bit ring
cdef uint32_t _HALF = 0x20000000  # 2^29
cdef uint32_t _ONES = 0xFFFFFFFF

cdef uint32_t _table[8][256]

# Slot statuses as C constants for the kernels (the Python names above are module globals).
cdef enum:
    _ST_OCCUPIED = 1


cdef void _init_table() noexcept:
    cdef uint32_t c, i, k
    for i in range(256):
        c = i
        for k in range(8):
            if c & 1:
                c = 0xEDB88320 ^ (c >> 1)
            else:
                c = c >> 1
        _table[0][i] = c
    for i in range(256):
        c = _table[0][i]
        for k in range(1, 8):
            c = _table[0][c & 0xFF] ^ (c >> 8)
            _table[k][i] = c


_init_table()


cdef extern from "crc_clmul.h":
    int armdb_clmul_ok() noexcept nogil
    uint32_t armdb_crc_clmul(uint32_t crc, const uint8_t* buf, size_t length) noexcept nogil

# Carry-less multiplication folds 16 bytes in a few instructions where slice-by-8 takes
# about 30 for 8 (crc_clmul.h); used when the CPU has it (x86-64 with PCLMULQDQ).
cdef bint _clmul = armdb_clmul_ok() != 0


def use_clmul(flag=None):
    """Whether CRCs use carry-less multiplication (tests turn it off to check the tables);
    ``flag`` switches it, on only where the CPU has the instruction.  Returns the setting."""
    global _clmul
    if flag is not None:
        _clmul = bool(flag) and armdb_clmul_ok() != 0
    return _clmul


cdef inline uint32_t _crc_update(uint32_t crc, const uint8_t* p, Py_ssize_t n) noexcept nogil:
    """Raw CRC update (no pre/post inversion): by carry-less multiplication over whole
    16-byte blocks where the CPU has it, slice-by-8 tables for the rest."""
    cdef uint32_t lo, hi
    cdef Py_ssize_t head
    if n >= 16 and _clmul:
        head = n & ~(<Py_ssize_t>15)
        crc = armdb_crc_clmul(crc, p, <size_t>head)
        p += head
        n -= head
    while n >= 8:
        lo = crc ^ (<uint32_t>p[0] | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16) | (<uint32_t>p[3] << 24))
        hi = <uint32_t>p[4] | (<uint32_t>p[5] << 8) | (<uint32_t>p[6] << 16) | (<uint32_t>p[7] << 24)
        crc = (_table[7][lo & 0xFF] ^ _table[6][(lo >> 8) & 0xFF] ^
               _table[5][(lo >> 16) & 0xFF] ^ _table[4][lo >> 24] ^
               _table[3][hi & 0xFF] ^ _table[2][(hi >> 8) & 0xFF] ^
               _table[1][(hi >> 16) & 0xFF] ^ _table[0][hi >> 24])
        p += 8
        n -= 8
    if n >= 4:
        # Four bytes by four lookups (slice-by-4 on the same tables), not four byte steps:
        # a slot write's 4-byte meta and its redo head's last word.
        lo = crc ^ (<uint32_t>p[0] | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16) | (<uint32_t>p[3] << 24))
        crc = (_table[3][lo & 0xFF] ^ _table[2][(lo >> 8) & 0xFF] ^
               _table[1][(lo >> 16) & 0xFF] ^ _table[0][lo >> 24])
        p += 4
        n -= 4
    while n > 0:
        crc = _table[0][(crc ^ p[0]) & 0xFF] ^ (crc >> 8)
        p += 1
        n -= 1
    return crc


# -- appending zero bytes to a CRC in four table lookups ----------------------------------------
# A slot's body is its row (n bytes) then zeros up to the slot's width, and a freed slot's
# body is all zeros; the raw CRC update over k zero bytes is a linear map of the 32-bit
# state (GF(2)), so it is four lookups in tables built once per k (zlib's crc32_combine
# computes the same map by repeated squaring).  A small cache holds the maps of the few k
# a process uses (a queue's slot width minus its row length, and the whole width).
cdef enum:
    _ZCACHE = 8
cdef uint32_t _zext[_ZCACHE][4][256]
cdef Py_ssize_t _zext_k[_ZCACHE]
cdef int _zext_used = 0
cdef int _zext_next = 0
cdef uint8_t _zeros[512]


cdef uint32_t _crc_zeros_slow(uint32_t crc, Py_ssize_t k) noexcept nogil:
    """The raw CRC update over ``k`` zero bytes, byte table by byte table."""
    cdef Py_ssize_t step
    while k > 0:
        step = k if k < 512 else 512
        crc = _crc_update(crc, _zeros, step)
        k -= step
    return crc


cdef int _zext_build(Py_ssize_t k) noexcept nogil:
    """The cache entry of the zero-extension map over ``k`` bytes (built if missing)."""
    global _zext_used, _zext_next
    cdef int c, j, b
    cdef uint32_t col[32]
    cdef uint32_t v
    for c in range(_zext_used):
        if _zext_k[c] == k:
            return c
    if _zext_used < _ZCACHE:
        c = _zext_used
        _zext_used += 1
    else:
        c = _zext_next
        _zext_next = (_zext_next + 1) % _ZCACHE
    for b in range(32):
        col[b] = _crc_zeros_slow(<uint32_t>1 << b, k)
    for j in range(4):
        _zext[c][j][0] = 0
        for v in range(1, 256):
            # v's lowest set bit, and v without it (already in the table)
            b = 0
            while not (v >> b) & 1:
                b += 1
            _zext[c][j][v] = _zext[c][j][v & (v - 1)] ^ col[8 * j + b]
    _zext_k[c] = k
    return c


cdef inline uint32_t _crc_zeros(uint32_t crc, Py_ssize_t k) noexcept nogil:
    """``_crc_update(crc, k zero bytes)`` in four lookups once the map of ``k`` is cached.
    Callers hold the GIL (the cache is shared); GIL-free code uses ``_crc_update``."""
    cdef int c
    if k <= 0:
        return crc
    if _zext_used and _zext_k[0] == k:
        c = 0
    elif _zext_used > 1 and _zext_k[1] == k:
        c = 1
    else:
        c = _zext_build(k)
    return (_zext[c][0][crc & 0xFF] ^ _zext[c][1][(crc >> 8) & 0xFF] ^
            _zext[c][2][(crc >> 16) & 0xFF] ^ _zext[c][3][crc >> 24])


def crc32_padded(const uint8_t[::1] data, Py_ssize_t width, uint32_t crc=0):
    """``zlib.crc32(data + bytes(width - len(data)), crc)`` through the zero-extension map
    the slot writes use (a test of the map against zlib)."""
    cdef Py_ssize_t n = data.shape[0]
    if width < n:
        raise ValueError("width is below the data's length")
    crc = _crc_update(crc ^ _ONES, &data[0] if n else NULL, n)
    return _crc_zeros(crc, width - n) ^ _ONES


cdef inline uint32_t _slot_crc(uint32_t meta, const uint8_t* body, Py_ssize_t n) noexcept nogil:
    cdef uint8_t m[4]
    store_u32(m, meta)
    cdef uint32_t crc = _crc_update(_ONES, m, 4)
    crc = _crc_update(crc, body, n)
    return crc ^ _ONES


cdef inline int _ring_compare(uint32_t a, uint32_t b) noexcept nogil:
    cdef uint32_t d = (a - b) & _MASK
    if d == 0:
        return 0
    if d < _HALF:
        return 1
    if d > _HALF:
        return -1
    return 2


# Below this many bytes the CRC keeps the GIL (a MiB takes about 40 us, 440 us without
# the carry-less multiply).  Handing the GIL over and taking it back wakes every thread
# waiting for it and restarts its wait; a committer doing that once a batch kept the
# Db's flusher from running for 13-20 ms at a time (docs/performance.md, round 14,
# "the CRC keeps the GIL below 1 MiB").
cdef Py_ssize_t _CRC_NOGIL = 1 << 20


def crc32(data, uint32_t crc=0):
    """IEEE CRC-32, equal to ``zlib.crc32(data, crc)``, of ``bytes`` or any contiguous
    buffer of bytes."""
    cdef uint32_t r
    cdef const uint8_t[::1] view
    cdef const uint8_t* p
    cdef Py_ssize_t n
    if type(data) is bytes:
        # (a typed memoryview of it costs about 1,700 instructions: a Bitcask hint batch's
        # CRC, several a commit, is much shorter than that)
        p = <const uint8_t*>PyBytes_AS_STRING(data)
        n = len(<bytes>data)
    else:
        view = data
        n = view.shape[0]
        p = &view[0] if n else NULL
    if n < _CRC_NOGIL:
        return _crc_update(crc ^ _ONES, p, n) ^ _ONES
    with nogil:
        r = _crc_update(crc ^ _ONES, p, n) ^ _ONES
    return r


# -- Bitcask records and hint entries (armdb.bitcask; the same CRC kernel) ----------------------


def bitcask_record(uint64_t gsn_word, bytes key_field not None, bytes value_field not None, uint16_t magic):
    """One Bitcask data record (docs/format.md): ``gsn_word: u64``, ``crc32: u32`` over
    everything after it and the gsn word, ``value_len: u32``, ``magic: u16``,
    ``key_len: u16``, the key and value fields, zero padding to a multiple of 8.

    The fields are already sealed when the collection is encrypted; a tombstone has an
    empty value field.  The caller checked the lengths (key field at most 0xFFFF bytes).
    """
    cdef Py_ssize_t klen = len(key_field)
    cdef Py_ssize_t vlen = len(value_field)
    if klen > 0xFFFF or vlen > 0xFFFFFFFF:
        raise OverflowError("Bitcask key field above 64 KiB or value field above 4 GiB")
    cdef Py_ssize_t n = 20 + klen + vlen
    rec = PyBytes_FromStringAndSize(NULL, n + ((-n) & 7))
    _put_record(<uint8_t*>PyBytes_AS_STRING(rec), gsn_word, PyBytes_AS_STRING(key_field), klen,
                PyBytes_AS_STRING(value_field), vlen, magic)
    return rec


cdef Py_ssize_t _put_record(uint8_t* p, uint64_t word, const char* key, Py_ssize_t klen, const char* value,
                            Py_ssize_t vlen, uint16_t magic) noexcept:
    """Write one Bitcask record (:func:`bitcask_record`'s layout) at ``p``; returns its
    size with the padding."""
    cdef Py_ssize_t n = 20 + klen + vlen, i
    store_u64(p, word)
    store_u32(p + 12, <uint32_t>vlen)
    p[16] = <uint8_t>magic
    p[17] = <uint8_t>(magic >> 8)
    p[18] = <uint8_t>klen
    p[19] = <uint8_t>(klen >> 8)
    copy_bytes(p + 20, key, klen)
    copy_bytes(p + 20 + klen, value, vlen)
    for i in range(n, n + ((-n) & 7)):  # the padding (at most 7 bytes: no memset call)
        p[i] = 0
    store_u32(p + 8, _crc_update(_crc_update(_ONES, p, 8), p + 12, n - 12) ^ _ONES)
    return n + ((-n) & 7)


cdef bytes _log_frame(uint32_t magic, uint32_t flags, uint64_t txid, Py_ssize_t blen):
    """A transaction-log record of a ``blen``-byte body with its header and padding
    written: the caller copies the body to offset 24, then seals it (:func:`_log_seal`)."""
    if blen > 0xFFFFFFFF:
        raise OverflowError("log record body above 4 GiB")
    cdef Py_ssize_t n = 24 + blen
    cdef Py_ssize_t total = n + ((-n) & 7)
    rec = PyBytes_FromStringAndSize(NULL, total)
    cdef uint8_t* p = <uint8_t*>PyBytes_AS_STRING(rec)
    store_u32(p, magic)
    store_u32(p + 4, flags)
    store_u64(p + 8, txid)
    store_u32(p + 16, <uint32_t>blen)
    memset(p + n, 0, total - n)
    return rec


cdef inline void _log_seal(bytes rec, Py_ssize_t blen) noexcept:
    """The CRC of a framed record (:func:`_log_frame`) once its body is in place."""
    cdef uint8_t* p = <uint8_t*>PyBytes_AS_STRING(rec)
    store_u32(p + 20, _crc_update(_crc_update(_ONES, p, 20), p + 24, blen) ^ _ONES)


def log_record(uint32_t magic, uint32_t flags, uint64_t txid, bytes body not None):
    """One transaction-log record (docs/format.md): ``magic: u32, flags: u32, txid: u64,
    body_len: u32``, ``crc32: u32`` over those 20 bytes then the body, the body, zero
    padding to a multiple of 8.  The same bytes as ``armdb.txlog``'s reference encoder."""
    cdef Py_ssize_t blen = len(body)
    rec = _log_frame(magic, flags, txid, blen)
    memcpy(<uint8_t*>PyBytes_AS_STRING(rec) + 24, PyBytes_AS_STRING(body), blen)
    _log_seal(rec, blen)
    return rec


_PADS = [bytes(i) for i in range(8)]


def log_frame_parts(uint32_t magic, uint32_t flags, uint64_t txid, bytes head not None, list parts not None):
    """The record of the body ``head`` then each of ``parts`` (``bytes`` or ``bytearray``)
    end to end, as :func:`log_record` frames their join, left in pieces: ``(frame, pad)``
    such that ``frame``, then each of ``parts``, then ``pad`` end to end are its bytes.  ``frame`` is the record's
    header (its CRC over the whole body, taken from the parts where they lie) then
    ``head``; ``pad`` the zero padding.  A batch's record then reaches the file by one
    vectored write (``armdb._core.atomicfile.pwritev_all``) with no copy of the rows."""
    cdef Py_ssize_t i, k = len(parts), hlen = len(head), blen = len(head)
    cdef object part
    for i in range(k):
        part = <object>PyList_GET_ITEM(parts, i)
        if type(part) is bytes:
            blen += len(<bytes>part)
        elif type(part) is bytearray:
            blen += len(<bytearray>part)
        else:
            raise TypeError("log_frame_parts takes bytes or bytearray parts")
    if blen > 0xFFFFFFFF:
        raise OverflowError("log record body above 4 GiB")
    frame = PyBytes_FromStringAndSize(NULL, 24 + hlen)
    cdef uint8_t* p = <uint8_t*>PyBytes_AS_STRING(frame)
    store_u32(p, magic)
    store_u32(p + 4, flags)
    store_u64(p + 8, txid)
    store_u32(p + 16, <uint32_t>blen)
    memcpy(p + 24, PyBytes_AS_STRING(head), hlen)
    cdef uint32_t crc = _crc_update(_crc_update(_ONES, p, 20), p + 24, hlen)
    for i in range(k):
        part = <object>PyList_GET_ITEM(parts, i)
        if type(part) is bytes:
            crc = _crc_update(crc, <const uint8_t*>PyBytes_AS_STRING(part), len(<bytes>part))
        else:
            crc = _crc_update(crc, <const uint8_t*>PyByteArray_AS_STRING(part), len(<bytearray>part))
    store_u32(p + 20, crc ^ _ONES)
    return frame, _PADS[(-(24 + blen)) & 7]


def hint_append(bytearray buf not None, uint32_t crc, uint64_t gsn_word, uint64_t offset, uint32_t value_len,
                bytes key_field not None):
    """Append one hint entry (``gsn_word: u64, offset: u64, value_len: u32, key_len: u16``,
    then the key field) to ``buf``; returns the running CRC-32 of the entries with it."""
    return _hint_put(buf, crc, gsn_word, offset, value_len, key_field)


cdef inline uint8_t* _hint_entry(uint8_t* p, uint64_t gsn_word, uint64_t offset, uint32_t value_len,
                                 const char* key, Py_ssize_t klen) noexcept:
    """One hint entry at ``p`` (docs/format.md): the gsn word, the record's offset, the
    value's length, the key's length and the key; returns the byte after it."""
    store_u64(p, gsn_word)
    store_u64(p + 8, offset)
    store_u32(p + 16, value_len)
    p[20] = <uint8_t>klen
    p[21] = <uint8_t>(klen >> 8)
    copy_bytes(p + 22, key, klen)
    return p + 22 + klen


cdef uint32_t _hint_put(bytearray buf, uint32_t crc, uint64_t gsn_word, uint64_t offset, uint32_t value_len,
                        bytes key_field) except? 0xFFFFFFFF:
    """:func:`hint_append`, for the kernels (0xFFFFFFFF: maybe a MemoryError, or that CRC)."""
    cdef Py_ssize_t klen = len(key_field)
    cdef Py_ssize_t at = len(buf)
    if PyByteArray_Resize(buf, at + 22 + klen) < 0:
        raise MemoryError()
    cdef uint8_t* p = <uint8_t*>PyByteArray_AS_STRING(buf) + at
    _hint_entry(p, gsn_word, offset, value_len, PyBytes_AS_STRING(key_field), klen)
    return _crc_update(crc ^ _ONES, p, 22 + klen) ^ _ONES


cdef uint64_t _TOMBSTONE = 1ULL << 63
cdef uint64_t _SYNCED_BEFORE = 1ULL << 62
cdef uint64_t _SEQ_MASK = (1ULL << 60) - 1


# -- fields of the Bitcask's slotted dataclasses, by offset ---------------------------------
#
# A kernel that updates a shard's counters (PutKernel.tomb) reads and writes about twenty
# fields of three slotted classes (armdb.bitcask's _Shard, _DataFile, _HintBuilder).  From
# C each is a generic attribute lookup (the type's method cache, the member descriptor,
# its getter: about 90 instructions); the field itself is a pointer at a fixed offset in
# the object, which the member descriptor records.  The kernel takes those offsets once
# and reads and writes the pointer as the descriptor does (T_OBJECT_EX: a field never set
# raises AttributeError), for objects whose type is exactly the class it took them from.

cdef extern from "Python.h":
    ctypedef struct PyMemberDef:
        int type
        Py_ssize_t offset
        int flags
    ctypedef struct PyMemberDescrObject:
        PyMemberDef* d_member

from types import MemberDescriptorType

cdef extern from "structmember.h":
    int T_OBJECT_EX  # an object field, AttributeError when unset

cdef enum:
    _AT_ACTIVE, _AT_CLOSED, _AT_SYNCED, _AT_INDEX, _AT_HIGHEST, _AT_HINT, _AT_DIRTY, _AT_LAST_SYNC, _AT_TOMBS,
    _AT_COMPACT_DUE,
    _AT_SIZE, _AT_VERSION, _AT_TOTAL, _AT_FD, _AT_FID, _AT_DEAD,
    _AT_BROKEN, _AT_PARTS, _AT_BUF, _AT_CRC, _AT_COUNT


cdef Py_ssize_t _slot_offset(type cls, str name) except -1:
    """The offset of field ``name`` of slotted class ``cls`` (TypeError for anything but
    a plain object slot)."""
    d = cls.__dict__.get(name)
    if type(d) is not MemberDescriptorType:
        raise TypeError(f"{cls.__name__}.{name} is not a slot")
    cdef PyMemberDef* m = (<PyMemberDescrObject*><PyObject*>d).d_member
    if m.type != T_OBJECT_EX or m.flags != 0:
        raise TypeError(f"{cls.__name__}.{name} is not a plain object slot")
    return m.offset


cdef inline object _field(object o, Py_ssize_t at):
    """Field ``at`` of ``o`` (whose type gave the offset), as its member descriptor reads it."""
    cdef PyObject* v = (<PyObject**>((<char*><PyObject*>o) + at))[0]
    if v == NULL:
        raise AttributeError(f"{type(o).__name__} field at {at} is not set")
    return <object>v


cdef inline int _set_field(object o, Py_ssize_t at, object v) except -1:
    """Set field ``at`` of ``o`` to ``v``, as its member descriptor does."""
    cdef PyObject** p = <PyObject**>((<char*><PyObject*>o) + at)
    cdef PyObject* old = p[0]
    Py_INCREF(v)
    p[0] = <PyObject*>v
    Py_XDECREF(old)
    return 0


cdef class PutKernel:
    """``BitcaskStore.put`` of an unencrypted store, after its argument checks, in one
    compiled call (``put``): the shard's lock, the closed and fenced checks, the gsn
    drawn from the store's source and checked, the record written (:meth:`_put_locked`,
    or ``store._write`` when the active file must rotate first), the lock released, then
    the compaction a rotation made due.  The store makes one at open
    (``BitcaskStore._putter``) and its ``put`` hands it every put; a var queue's push
    (``armdb._core.qshard.VarFast``) calls it directly, with no Python frame between.

    What can change after open is read at each call: the store's ``_closed``,
    ``_poisoned`` and ``_gsn`` (from its instance dict), the file system
    (``armdb._fs.FS``, which tests replace), the failpoint function and the hint spill
    size.  The locks, the config's values and the constants are taken at
    construction: a store's shards, config and encryption are fixed once open.
    """

    def __init__(self, store, list shards, dict store_dict, dict fs_module, dict fail_module, dict files_module,
                 auto_compact, uint16_t magic, Py_ssize_t marked_version, Py_ssize_t max_key,
                 Py_ssize_t max_value, uint64_t seq_mask):
        cfg = store.config
        for name in ("_closed", "_poisoned", "_gsn"):
            if name not in store_dict:
                raise TypeError(f"PutKernel: the store has no instance attribute {name}")
        self.store = store
        self.shards = shards
        self.locks = [sh.lock for sh in shards]
        for lock in self.locks:
            if type(lock) is not Lock:
                raise TypeError("PutKernel needs shards whose lock is an armdb._core.locks.Lock")
        self.sd = store_dict
        self.fsd = fs_module
        self.faild = fail_module
        self.filesd = files_module
        self.auto_compact = auto_compact
        self.magic = magic
        self.marked_version = marked_version
        self.max_file_size = cfg.max_file_size
        self.max_key = max_key
        self.max_value = max_value
        self.seq_mask = seq_mask
        self.fsync = cfg.enable_fsync
        self.sync_interval = cfg.sync_interval
        sh = shards[0]
        self.shard_t = type(sh)
        self.file_t = type(sh.active)
        self.hint_t = type(sh.hint)
        for i, name in enumerate(("active", "closed", "synced", "index", "highest", "hint", "dirty", "last_sync",
                                     "tombs", "compact_due")):
            self.at[_AT_ACTIVE + i] = _slot_offset(self.shard_t, name)
        for i, name in enumerate(("size", "version", "total", "fd", "fid", "dead")):
            self.at[_AT_SIZE + i] = _slot_offset(self.file_t, name)
        for i, name in enumerate(("broken", "parts", "buf", "crc", "count")):
            self.at[_AT_BROKEN + i] = _slot_offset(self.hint_t, name)

    cpdef object put(self, Py_ssize_t i, bytes key, bytes value):
        """Put ``value`` under ``key`` in shard ``i`` (the caller picked it as
        ``BitcaskStore._shard`` does); returns the record's gsn.  A key or value past its
        limit goes to ``BitcaskStore.put``, which raises the error."""
        if key is None or value is None or len(key) > self.max_key or len(value) > self.max_value:
            return self.store.put(key, value)
        store = self.store
        cdef dict sd = self.sd
        sh = self.shards[i]
        cdef bint rotated = False
        take(<Lock>self.locks[i])
        try:
            if <object>PyDict_GetItemWithError(sd, "_closed") or <object>PyDict_GetItemWithError(sd, "_poisoned") is not None:
                store.check_writable()
            seq = (<object>PyDict_GetItemWithError(sd, "_gsn"))()
            if type(seq) is not int or not sh.highest < seq <= self.seq_mask:
                raise store._bad_gsn(sh, seq)
            if not self._put_locked(sh, key, value, seq):
                rotated = store._write(sh, key, value, seq)  # a new data file first (and the timed sync, when due)
        finally:
            give(<Lock>self.locks[i])
        if rotated or (_field(sh, self.at[_AT_COMPACT_DUE]) if type(sh) is self.shard_t else sh.compact_due):
            self.auto_compact(store, sh)
        return seq

    cpdef object tomb(self, bytes key, object gsn):
        """``BitcaskStore.tomb_locked``: the delete ``(key, None, gsn)`` of a store of one
        shard (a var queue's lone ack of its body; the caller holds the shard's lock), as
        ``write_locked`` writes it, in one compiled call: the tombstone
        (:func:`bitcask_tomb`'s record, flagged when everything before it was synced)
        appended by the file system's ``pwrite``, the file's counters, the hint entry
        (``_HintBuilder.add``), the failpoint ``bitcask.after_append``, the index change
        (:func:`bitcask_tomb_drop`, or ``store._index_update``), the shard's highest gsn,
        then the timed sync when due, in that order; the shard's, file's and hint's
        fields by their slots (:func:`_field`).  Anything else (several shards, a closed
        or fenced store, a gsn that is not a plain one, a missing key, a rotation due)
        goes to ``store.write_locked``, which judges it.  Returns what ``write_locked``
        returns: whether a record was written."""
        store = self.store
        cdef uint64_t g
        if len(self.shards) != 1 or type(gsn) is not int or key is None:
            return store.write_locked(key, None, gsn)
        try:
            g = gsn
        except OverflowError:
            return store.write_locked(key, None, gsn)
        sh = self.shards[0]
        if type(sh) is not self.shard_t:
            return store.write_locked(key, None, gsn)
        act = _field(sh, self.at[_AT_ACTIVE])
        hint = _field(sh, self.at[_AT_HINT])
        if type(act) is not self.file_t or _field(sh, self.at[_AT_CLOSED]) or \
                <object>PyDict_GetItemWithError(self.sd, "_poisoned") is not None or g > _SEQ_MASK:
            return store.write_locked(key, None, gsn)
        cdef uint64_t word = g | _TOMBSTONE
        off_ = _field(act, self.at[_AT_SIZE])
        cdef Py_ssize_t off = off_
        # Everything before this record was synced: say so (as _write does).
        if _field(act, self.at[_AT_VERSION]) >= self.marked_version and off_ == _field(sh, self.at[_AT_SYNCED]):
            word |= _SYNCED_BEFORE
        total = _field(act, self.at[_AT_TOTAL])
        index = _field(sh, self.at[_AT_INDEX])
        rec = _tomb_record(key, index, word, _field(sh, self.at[_AT_HIGHEST]), self.magic, self.max_key, off,
                           total, self.max_file_size)
        if rec is None:
            return store.write_locked(key, None, gsn)
        try:
            (<object>PyDict_GetItemWithError(self.fsd, "FS")).pwrite(_field(act, self.at[_AT_FD]), rec, off_)
        except OSError as e:
            raise store._append_failed(act, off, e) from e
        cdef Py_ssize_t size = len(<bytes>rec)
        _set_field(act, self.at[_AT_SIZE], off + size)
        _set_field(act, self.at[_AT_TOTAL], total + size)
        _set_field(sh, self.at[_AT_DIRTY], True)
        self._hint(hint, word, off, 0, key)
        (<object>PyDict_GetItemWithError(self.faild, "point"))("bitcask.after_append")
        fid = _field(act, self.at[_AT_FID])
        cdef Py_ssize_t old = _tomb_drop(index, key, fid)
        if old >= 0:
            _set_field(act, self.at[_AT_DEAD], _field(act, self.at[_AT_DEAD]) + (old + size))  # the put and its tombstone, garbage at once
        else:
            store._index_update(sh, key, fid, off, size, word)
        _set_field(sh, self.at[_AT_HIGHEST], gsn)
        cdef double now
        if self.fsync:  # _maybe_sync without its frame, as _write runs it (sh.dirty is set above)
            now = monotonic_s()  # time.monotonic()
            if not self.sync_interval or now - <double>_field(sh, self.at[_AT_LAST_SYNC]) >= self.sync_interval:
                store._sync_due(sh, now)
        return True

    cdef int _hint(self, object hint, uint64_t word, Py_ssize_t off, uint32_t vlen, bytes key) except -1:
        """``_HintBuilder.add`` of one record's entry (``put`` and ``tomb``), its steps
        without its frame, by the builder's slots; a builder of another class gets the
        method called."""
        if type(hint) is not self.hint_t:
            hint.add(word, off, vlen, key)
            return 0
        if _field(hint, self.at[_AT_BROKEN]):
            return 0
        if _field(hint, self.at[_AT_PARTS]):  # a group write's entries, parked: they come first
            hint._unpark()
        buf = _field(hint, self.at[_AT_BUF])
        _set_field(hint, self.at[_AT_CRC], _hint_put(buf, _field(hint, self.at[_AT_CRC]), word, off, vlen, key))
        _set_field(hint, self.at[_AT_COUNT], _field(hint, self.at[_AT_COUNT]) + 1)
        if len(buf) >= <Py_ssize_t>(<object>PyDict_GetItemWithError(self.filesd, "_HINT_SPILL")):
            hint._spill_or_give_up()
        return 0

    cdef bint _put_locked(self, object sh, bytes key, bytes value, object seq) except -1:
        """``BitcaskStore._write`` of one put to an unencrypted store, under ``sh.lock``,
        in one call: the same record (:func:`bitcask_record`) appended by the file
        system's ``pwrite`` (so a test's fault-injecting one sees it), the file's
        counters, the hint entry (``_HintBuilder.add``), the failpoint
        ``bitcask.after_append``, the index entry (a new key's here; any other through
        ``store._index_update``), the shard's highest gsn and the timed sync when due
        (``store._sync_due``), in that order; the shard's and file's fields by their
        slots (:func:`_field`).

        Why compiled: these steps were about 300 interpreter steps in three Python frames
        of every lone put (each var push's body).  Returns False, having done nothing,
        when the record does not fit the active file (or the shard or its file is not of
        the classes the kernel took its offsets from): the caller's ``_write`` then
        writes it, rotating first.  A failed append is undone by
        ``store._append_failed`` and raised, as ``_write`` does.
        """
        cdef Py_ssize_t klen = len(key)
        cdef Py_ssize_t vlen = len(value)
        if klen > 0xFFFF or vlen > 0xFFFFFFFF:
            raise OverflowError("Bitcask key field above 64 KiB or value field above 4 GiB")
        cdef Py_ssize_t n = 20 + klen + vlen
        cdef Py_ssize_t size = n + ((-n) & 7)
        if type(sh) is not self.shard_t:
            return False
        act = _field(sh, self.at[_AT_ACTIVE])
        if type(act) is not self.file_t:
            return False
        off_ = _field(act, self.at[_AT_SIZE])
        cdef Py_ssize_t off = off_
        total = _field(act, self.at[_AT_TOTAL])
        if total and off + size > self.max_file_size:
            return False
        cdef uint64_t word = seq
        # Everything before this record was synced: say so (as _write).
        if _field(act, self.at[_AT_VERSION]) >= self.marked_version and off_ == _field(sh, self.at[_AT_SYNCED]):
            word |= _SYNCED_BEFORE
        rec = PyBytes_FromStringAndSize(NULL, size)
        _put_record(<uint8_t*>PyBytes_AS_STRING(rec), word, PyBytes_AS_STRING(key), klen, PyBytes_AS_STRING(value),
                    vlen, self.magic)
        try:
            (<object>PyDict_GetItemWithError(self.fsd, "FS")).pwrite(_field(act, self.at[_AT_FD]), rec, off_)
        except OSError as e:
            raise self.store._append_failed(act, off, e) from e
        _set_field(act, self.at[_AT_SIZE], off + size)
        _set_field(act, self.at[_AT_TOTAL], total + size)
        _set_field(sh, self.at[_AT_DIRTY], True)
        self._hint(_field(sh, self.at[_AT_HINT]), word, off, <uint32_t>vlen, key)
        (<object>PyDict_GetItemWithError(self.faild, "point"))("bitcask.after_append")
        cdef dict index = _field(sh, self.at[_AT_INDEX])
        fid = _field(act, self.at[_AT_FID])
        if key not in index and key not in _field(sh, self.at[_AT_TOMBS]):
            index[key] = (fid, off_, size, word, None)  # a new key: nothing older to mask
        else:
            self.store._index_update(sh, key, fid, off, size, word)
        _set_field(sh, self.at[_AT_HIGHEST], seq)
        cdef double now
        if self.fsync:
            now = monotonic_s()  # time.monotonic()
            if not self.sync_interval or now - <double>_field(sh, self.at[_AT_LAST_SYNC]) >= self.sync_interval:
                self.store._sync_due(sh, now)
        return True


cdef bint _put_earlier(list items, const uint8_t* kp, Py_ssize_t i, object key):
    """Whether the last item before ``i`` that writes ``key`` (``kp``: 1 for an item
    written) is a put: then the key exists when item ``i`` deletes it, although the index
    does not hold it yet.  A backward scan, run only for a delete of a key the index
    lacks (a queue's batches never have one: their keys are distinct)."""
    cdef Py_ssize_t j
    cdef tuple it
    for j in range(i - 1, -1, -1):
        if kp[j]:
            it = <tuple>items[j]
            if it[0] == key:
                return it[1] is not None
    return False


def bitcask_group(list items, dict index, uint64_t highest, uint64_t flag, uint16_t magic, object fid,
                  Py_ssize_t off, Py_ssize_t max_key, Py_ssize_t max_value):
    """The records of a batch for one unencrypted Bitcask shard, to append in one write
    (``armdb.bitcask``'s group write): one pass over ``items`` (``(key, value, gsn)``
    tuples, ``value`` None for a delete) instead of a Python loop per record.

    Same records as :func:`bitcask_record` and hint entries as :func:`hint_append` would
    give, record by record: the gsn word of a delete carries the tombstone bit, and the
    first record written carries ``flag`` (everything before it was synced).  A delete of
    a key ``index`` does not hold writes nothing.

    Returns ``(data, hints, keys, entries, deletes)``: the records end to end (the first
    at file offset ``off``), their hint entries end to end, the keys written and, for each,
    the index entry ``(fid, offset, size, gsn_word, None)``, and how many are deletes; or None when an item is not
    plain: not a 3-tuple, a key that is not ``bytes`` or longer than ``max_key``, a value
    neither None nor ``bytes`` or longer than ``max_value``, a gsn that is not an int
    above the one before it, above ``highest`` (the first written) and at most the gsn
    mask.  The caller's Python path then checks the batch and raises the right error.
    """
    cdef Py_ssize_t n = len(items), i, k = 0, klen, vlen, total = 0, htotal = 0, rsize, deletes = 0
    cdef uint64_t gsn, prev = 0, word
    cdef object item, key, value, g
    cdef list keys = []
    cdef list entries = []
    cdef bint first = True
    cdef bytearray kept = bytearray(n)  # 1 for the items written
    cdef uint8_t* kp = <uint8_t*>PyByteArray_AS_STRING(kept)
    for i in range(n):
        item = items[i]
        if type(item) is not tuple or len(<tuple>item) != 3:
            return None
        key = (<tuple>item)[0]
        value = (<tuple>item)[1]
        g = (<tuple>item)[2]
        if type(key) is not bytes or type(g) is not int:
            return None
        try:
            gsn = g  # (a C conversion: no Python comparison per item)
        except OverflowError:  # negative, or above 64 bits
            return None
        if gsn == 0 or gsn > _SEQ_MASK or gsn <= prev:
            return None
        prev = gsn
        klen = len(<bytes>key)
        if klen > max_key:
            return None
        if value is None:
            if key not in index and not _put_earlier(items, kp, i, key):
                continue  # deleting a missing key writes nothing
            vlen = 0
            deletes += 1
        elif type(value) is not bytes:
            return None
        else:
            vlen = len(<bytes>value)
            if vlen > max_value:
                return None
        if first:
            if gsn <= highest:
                return None
            first = False
        rsize = 20 + klen + vlen
        total += rsize + ((-rsize) & 7)
        htotal += 22 + klen
        keys.append(key)
        kp[i] = 1
    if not keys:
        return (b"", b"", keys, entries, 0)
    data = PyBytes_FromStringAndSize(NULL, total)
    hints = PyBytes_FromStringAndSize(NULL, htotal)
    cdef uint8_t* p = <uint8_t*>PyBytes_AS_STRING(data)
    cdef uint8_t* h = <uint8_t*>PyBytes_AS_STRING(hints)
    cdef Py_ssize_t at = off
    for i in range(n):
        if not kp[i]:
            continue  # a delete of a missing key
        item = items[i]
        key = (<tuple>item)[0]
        value = (<tuple>item)[1]
        k += 1
        word = <uint64_t>(<tuple>item)[2]
        klen = len(<bytes>key)
        if value is None:
            word |= _TOMBSTONE
            vlen = 0
        else:
            vlen = len(<bytes>value)
        if k == 1:
            word |= flag
        rsize = _put_record(p, word, PyBytes_AS_STRING(key), klen,
                            PyBytes_AS_STRING(value) if vlen else NULL, vlen, magic)
        h = _hint_entry(h, word, <uint64_t>at, <uint32_t>vlen, PyBytes_AS_STRING(key), klen)
        entries.append((fid, at, rsize, word, None))
        p += rsize
        at += rsize
    return (data, hints, keys, entries, deletes)


def bitcask_index_apply(dict index, dict tombs, list keys, list entries, object fid, Py_ssize_t start):
    """The index changes of a group write once its records are appended (``armdb.bitcask``'s
    ``_write_group``), from ``keys[start]`` on, for the two common cases with no Python
    loop: a put of a key neither ``index`` nor ``tombs`` holds (inserted), and a delete of
    a key whose put lies in the same file ``fid`` with no older holder (``entry[4]`` None),
    where both records are garbage at once (the put removed from ``index``, both sizes
    counted dead).  Stops at the first key of another case, which the caller updates the
    general way before calling again from the next one, so keys are applied in order.

    Returns ``(dead, stop)``: the bytes found dead and where it stopped (``len(keys)`` when
    done).
    """
    cdef Py_ssize_t n = len(keys), i
    cdef Py_ssize_t dead = 0
    cdef object key, old
    cdef tuple entry
    for i in range(start, n):
        key = keys[i]
        entry = <tuple?>entries[i]
        if <uint64_t>entry[3] & _TOMBSTONE:
            old = index.get(key)
            if old is None or type(old) is not tuple or (<tuple>old)[4] is not None or not ((<tuple>old)[0] == fid):
                return dead, i
            del index[key]
            dead += <Py_ssize_t>(<tuple>old)[2] + <Py_ssize_t>entry[2]
        elif key in index or key in tombs:
            return dead, i
        else:
            index[key] = entry
    return dead, n


cdef inline uint8_t* _pack_uint(uint8_t* p, uint64_t v) noexcept:
    """``v`` as msgpack packs a non-negative int: the shortest form."""
    cdef int i, w
    if v < 0x80:
        p[0] = <uint8_t>v
        return p + 1
    if v < 0x100:
        p[0] = 0xcc
        w = 1
    elif v < 0x10000:
        p[0] = 0xcd
        w = 2
    elif v < 0x100000000ULL:  # (a C literal: unsuffixed, Cython compares Python ints)
        p[0] = 0xce
        w = 4
    else:
        p[0] = 0xcf
        w = 8
    for i in range(w):
        p[1 + i] = <uint8_t>(v >> (8 * (w - 1 - i)))
    return p + 1 + w


cdef inline uint64_t _bswap64(uint64_t v) noexcept nogil:
    """``v`` with its bytes reversed: stored little-endian, it reads as big-endian."""
    cdef uint64_t r = 0
    cdef int i
    for i in range(8):
        r = (r << 8) | (v & 0xFF)
        v >>= 8
    return r


def slot_crc(uint32_t meta, const uint8_t[::1] body):
    """The CRC a slot with this meta and body must carry."""
    return _slot_crc(meta, &body[0] if body.shape[0] else NULL, body.shape[0])


def ring_next(uint32_t version):
    """The version after ``version`` on the 30-bit ring (never 0, so meta != 0 once written)."""
    return ring_step(version)


def compare(uint32_t a, uint32_t b):
    """Compare two 30-bit ring versions (S3): NEWER (1) if ``a`` is ahead of ``b`` by less
    than 2^29, OLDER (-1) if behind by less than 2^29, EQUAL (0), or STALE (2) when the
    distance is exactly half the ring and the order cannot be known."""
    return _ring_compare(a & _MASK, b & _MASK)


def compare_many(const uint32_t[::1] a, const uint32_t[::1] b, int8_t[::1] out):
    """Vectorised :func:`compare` (``out[i] = compare(a[i], b[i])``), without the GIL."""
    cdef Py_ssize_t i, n = a.shape[0]
    if b.shape[0] != n or out.shape[0] != n:
        raise ValueError("compare_many needs three arrays of one length")
    with nogil:
        for i in range(n):
            out[i] = <int8_t>_ring_compare(a[i] & _MASK, b[i] & _MASK)


cdef Py_ssize_t _validate(uint8_t[:, ::1] slots, uint32_t[::1] versions, uint8_t[::1] status,
                          Py_ssize_t* torn) noexcept nogil:
    cdef Py_ssize_t i, j, n = slots.shape[0], width = slots.shape[1], occupied = 0
    cdef uint32_t meta, crc
    cdef const uint8_t* row
    cdef int st
    cdef bint zero
    torn[0] = 0
    for i in range(n):
        row = &slots[i, 0]
        meta = load_u32(row)
        if meta == 0:
            # Never written (a sparse hole or zero extension) unless any byte is set,
            # which means a body landed before its header: a torn first write.
            zero = True
            for j in range(4, width):
                if row[j] != 0:
                    zero = False
                    break
            versions[i] = 0
            if zero:
                status[i] = 0
            else:
                status[i] = 3
                torn[0] += 1
            continue
        crc = load_u32(row + 4)
        st = meta & 3
        versions[i] = meta >> 2
        if st == 3 or _slot_crc(meta, row + 8, width - 8) != crc:
            status[i] = 3
            torn[0] += 1
        else:
            status[i] = <uint8_t>st
            if st == 1:
                occupied += 1
    return occupied


def validate(uint8_t[:, ::1] slots, uint32_t[::1] versions, uint8_t[::1] status):
    """Check every slot's CRC (S4) and fill the version vector.

    ``status[i]`` becomes FREE, OCCUPIED, DELETED or TORN.  Returns
    ``(occupied, torn)``.  Runs without the GIL.
    """
    if versions.shape[0] < slots.shape[0] or status.shape[0] < slots.shape[0]:
        raise ValueError("versions and status need one entry per slot")
    if slots.shape[1] < 8:
        raise ValueError("a slot is at least its 8-byte header")
    cdef Py_ssize_t occupied, torn = 0
    with nogil:
        occupied = _validate(slots, versions, status, &torn)
    return occupied, torn


# Redo record (docs/format.md, "fixed.redo"): at REDO_OFFSET of the shard's redo map,
#   u32 REDO_MAGIC | u32 slot | u32 image length | u32 crc32(the 12 bytes before it + image) | image
# where the image is the complete slot (meta, crc, body).  SlotFile.put composes the
# new image there first and only then copies it into the slot, so a process killed
# halfway through the in-place copy leaves a torn slot *and* a valid redo record of
# what it was becoming; open restores it (S4) instead of losing the row.
REDO_OFFSET = 64
REDO_HEAD = 16
REDO_MAGIC = 0x4F444552  # "REDO"
cdef uint32_t _REDO_MAGIC = 0x4F444552
cdef Py_ssize_t _REDO_OFFSET = 64
cdef Py_ssize_t _REDO_HEAD = 16


cdef inline uint32_t _redo_crc(const uint8_t* rec) noexcept nogil:
    """The record's CRC: its 12-byte head and the image's meta and slot CRC.

    That binds the head to one image: the image's own slot CRC covers its meta and
    body, and restore_slot checks it, so a record torn anywhere fails one of the two.
    Hashing the whole image again would only repeat the slot CRC's work.
    """
    return _crc_update(_crc_update(_ONES, rec, 12), rec + _REDO_HEAD, 8) ^ _ONES


def redo_record(const uint8_t[::1] redo, Py_ssize_t slot_size):
    """``(slot, image)`` of a valid redo record, or ``None`` (never written, or torn)."""
    if slot_size < 8 or slot_size > redo.shape[0] - REDO_OFFSET - REDO_HEAD:
        return None
    cdef const uint8_t* rec = &redo[_REDO_OFFSET]
    if load_u32(rec) != _REDO_MAGIC or load_u32(rec + 8) != <uint32_t>slot_size:
        return None
    cdef uint32_t crc = load_u32(rec + 12)
    # Records written before the short CRC covered the whole image; both are accepted.
    if crc != _redo_crc(rec) and crc != _crc_update(_crc_update(_ONES, rec, 12), rec + _REDO_HEAD, slot_size) ^ _ONES:
        return None
    return load_u32(rec + 4), bytes(redo[REDO_OFFSET + REDO_HEAD:REDO_OFFSET + REDO_HEAD + slot_size])


def restore_slot(uint8_t[:, ::1] slots, uint32_t[::1] versions, Py_ssize_t i, const uint8_t[::1] image):
    """Copy a complete slot image (from a redo record) into slot ``i``; returns its status,
    or -1 when the image does not pass its own CRC."""
    cdef Py_ssize_t size = slots.shape[1]
    if i < 0 or i >= slots.shape[0] or image.shape[0] != size:
        return -1
    cdef uint32_t meta = load_u32(&image[0])
    if meta == 0 or (meta & 3) == 3 or _slot_crc(meta, &image[8], size - 8) != load_u32(&image[4]):
        return -1
    memcpy(&slots[i, 0], &image[0], size)
    versions[i] = meta >> 2
    return <int>(meta & 3)


cdef class SlotFile:
    """One shard's slot arrays, held as typed memoryviews between calls.

    The module functions above acquire a buffer for every array argument on every
    call (about a microsecond each time); a queue operation writes a slot and reads
    a header several times, so :class:`armdb.fixed.FixedShard` keeps one
    ``SlotFile``, rebinds it after every remap, and the hot path calls its methods.
    It also keeps the shard's counters that every write touches: occupied slots,
    the dirty byte range (file offsets) and the high-water mark.
    """

    # Attributes are declared in fixed.pxd.  ``free_stack[:free_top]`` is the shard's
    # stack of free slots, lowest index on top (FixedShard builds and rebinds it).

    def __init__(self, Py_ssize_t base, name=""):
        self.base = base  # file offset of slot 0
        self.dirty_lo = self.dirty_hi = -1
        self.name = name
        self.wfd = self.rfd = -1

    cdef int _alive(self) except -1:
        """Raise DbClosed once :meth:`release` ran (the caller holds the shard lock,
        under which the store is closed): a call racing ``Db.close`` never touches the
        unmapped file.  The cdef methods do not check; their callers do."""
        if self.closed:
            raise DbClosed(f"the database of {self.name!r}")
        return 0

    def bind(self, uint8_t[:, ::1] slots, uint32_t[::1] versions, uint8_t[::1] status, uint8_t[::1] redo,
             int wfd=-1, int rfd=-1):
        """Hold the arrays; ``wfd`` and ``rfd`` (the slot and redo files' descriptors, or
        -1): write slots and the redo records a sync will cover by ``pwrite(2)`` rather
        than through the mapping (module docstring, "Direct writes")."""
        if versions.shape[0] < slots.shape[0] or status.shape[0] < slots.shape[0]:
            raise ValueError("versions and status need one entry per slot")
        if redo.shape[0] < REDO_OFFSET + REDO_HEAD + slots.shape[1]:
            raise ValueError("the redo map is smaller than one record")
        if (wfd < 0) != (rfd < 0):
            raise ValueError("direct writes need both descriptors")
        self.slots = slots
        self.versions = versions
        self.status = status
        self.redo = redo
        self.size = slots.shape[1]
        self.wfd = wfd
        self.rfd = rfd
        self.scratch = bytearray(REDO_HEAD + self.size) if wfd >= 0 else None

    cdef void _pwrite(self, int fd, const uint8_t* src, Py_ssize_t n, Py_ssize_t off) noexcept:
        """A direct write; a failure is kept in ``werrno`` (the first one) for the sync
        that follows every write of a durable store to report, and poison the store."""
        if self.werrno:
            return  # the store is failing: nothing more reaches the file
        cdef ssize_t done = pwrite(fd, src, <size_t>n, off)
        while done < 0 and errno == EINTR:  # (a regular file's write is not interrupted on Linux)
            done = pwrite(fd, src, <size_t>n, off)
        if done != n:
            self.werrno = errno if done < 0 and errno else EIO

    def bind_free(self, uint32_t[::1] stack, Py_ssize_t top):
        """Use ``stack[:top]`` as the free-slot stack; it has room for every slot."""
        self._alive()
        if top < 0 or top > stack.shape[0] or stack.shape[0] < self.slots.shape[0]:
            raise ValueError("the free stack needs room for every slot")
        self.free_stack = stack
        self.free_top = top

    cdef Py_ssize_t _pop_free(self) noexcept:
        if self.free_top == 0:
            return -1
        self.free_top -= 1
        return self.free_stack[self.free_top]

    cdef void _push_free(self, Py_ssize_t i) noexcept:
        self.free_stack[self.free_top] = <uint32_t>i
        self.free_top += 1

    def pop_free(self):
        """Take the free slot on top of the stack; -1 when none is left."""
        self._alive()
        return self._pop_free()

    def push_free(self, Py_ssize_t i):
        """Give slot ``i`` back to the free stack."""
        self._alive()
        if i < 0 or i >= self.slots.shape[0] or self.free_top >= self.free_stack.shape[0]:
            raise IndexError(f"slot {i} cannot go back on the free stack")
        self._push_free(i)

    def release(self):
        """Drop the views (the file is being closed); every later call raises DbClosed."""
        self.closed = True
        self.wfd = self.rfd = -1  # the descriptors are closed next
        self.slots = None
        self.versions = None
        self.status = None
        self.redo = None
        self.free_stack = None

    cdef void _set_status(self, Py_ssize_t i, uint8_t st) noexcept:
        cdef uint8_t old = self.status[i]
        if old == _ST_OCCUPIED and st != _ST_OCCUPIED:
            self.occupied -= 1
        elif old != _ST_OCCUPIED and st == _ST_OCCUPIED:
            self.occupied += 1
        self.status[i] = st

    cpdef uint32_t put(self, Py_ssize_t i, int st, bytes body, uint32_t version=0, bint copy=True) except? 0:
        """:func:`write_slot` through the redo record, plus the status and counters.

        With ``copy=False`` only the redo record is composed (see :meth:`commit`).
        """
        cdef Py_ssize_t n = len(body)
        self._alive()
        if i < 0 or i >= self.slots.shape[0]:
            raise IndexError(f"slot {i} out of range")
        if n > self.size - 8:
            raise ValueError(f"body of {n} bytes does not fit a {self.size - 8}-byte slot body")
        if st < 0 or st > 2:
            raise ValueError("status must be FREE, OCCUPIED or DELETED")
        return self._put(i, st, <const uint8_t*>(<char*>body), n, version, copy)

    cdef uint32_t _put(self, Py_ssize_t i, int st, const uint8_t* src, Py_ssize_t n,
                       uint32_t version, bint copy) noexcept:
        """:meth:`put` for a checked slot, status and body length."""
        cdef Py_ssize_t size = self.size, width = size - 8
        cdef uint32_t v = version & _MASK
        if v == 0:
            v = ring_step(self.versions[i])
        cdef uint32_t meta = (v << 2) | <uint32_t>st
        # Direct writes compose a record the caller will sync (``copy=False``) off the
        # mapping: that sync cleans the page, and the next store into it would fault.
        cdef bint direct = self.wfd >= 0
        cdef uint8_t* rec = (<uint8_t*>PyByteArray_AS_STRING(self.scratch) if direct and not copy
                             else &self.redo[_REDO_OFFSET])
        cdef uint8_t* img = rec + _REDO_HEAD
        cdef uint8_t m[4]
        cdef uint32_t crc
        if n:
            memcpy(img + 8, src, n)
        if n < width:
            memset(img + 8 + n, 0, width - n)
        # The slot CRC (_slot_crc) over the meta, the n body bytes, then the zero tail.
        # With carry-less multiplication, whole 16-byte blocks (the zeros after the row
        # included) are cheaper than a table tail.
        cdef Py_ssize_t head = n
        if _clmul and n & 15:
            head = (n + 15) & ~(<Py_ssize_t>15)
            if head > width:
                head = width
        store_u32(m, meta)
        crc = _crc_update(_crc_update(_ONES, m, 4), img + 8, head)
        store_u32(img + 4, _crc_zeros(crc, width - head) ^ _ONES)
        store_u32(img, meta)
        store_u32(rec, _REDO_MAGIC)
        store_u32(rec + 4, <uint32_t>i)
        store_u32(rec + 8, <uint32_t>size)
        store_u32(rec + 12, _redo_crc(rec))
        if direct and not copy:
            self._pwrite(self.rfd, rec, _REDO_HEAD + size, _REDO_OFFSET)
        if copy:
            if direct:
                self._pwrite(self.wfd, img, size, self.base + i * size)
            else:
                memcpy(&self.slots[i, 0], img, size)
            self.versions[i] = v
            self._set_status(i, <uint8_t>st)
            self._mark(i)
        return v

    cpdef Py_ssize_t commit(self) except -1:
        """Copy the composed redo record into its slot; returns the slot."""
        self._alive()
        cdef const uint8_t* rec = &self.redo[_REDO_OFFSET]
        cdef Py_ssize_t i = load_u32(rec + 4)
        cdef uint32_t meta = load_u32(rec + _REDO_HEAD)
        if load_u32(rec) != _REDO_MAGIC or i >= self.slots.shape[0]:
            raise ValueError("no redo record to commit")
        if self.wfd >= 0:
            self._pwrite(self.wfd, rec + _REDO_HEAD, self.size, self.base + i * self.size)
        else:
            memcpy(&self.slots[i, 0], rec + _REDO_HEAD, self.size)
        self.versions[i] = meta >> 2
        self._set_status(i, <uint8_t>(meta & 3))
        self._mark(i)
        return i

    cdef void _mark(self, Py_ssize_t i) noexcept:
        cdef Py_ssize_t off = self.base + i * self.size
        if i >= self.hwm:
            self.hwm = i + 1
        if self.dirty_lo < 0 or off < self.dirty_lo:
            self.dirty_lo = off
        if off + self.size > self.dirty_hi:
            self.dirty_hi = off + self.size
        self.writes += 1

    def mark(self, Py_ssize_t i):
        """Count a write of slot ``i`` made some other way (dirty range, mark)."""
        self._alive()
        self._mark(i)

    def header(self, Py_ssize_t i, Py_ssize_t off):
        """The queue row header at byte ``off`` of slot ``i``'s body: ``(state, flags,
        attempts, epoch, deadline, payload_id, pushed)`` (the layout of qrow.pxd)."""
        self._alive()
        if i < 0 or i >= self.slots.shape[0] or off < 0 or off > self.size - 8 - HEADER_SIZE:
            raise IndexError(f"slot {i} out of range")
        cdef const uint8_t* p = &self.slots[i, 8 + off]  # the header: row offsets minus AT_STATE
        return (p[0], p[AT_FLAGS - AT_STATE], <uint32_t>load_le(p + AT_ATTEMPTS - AT_STATE, 2),
                load_u32(p + AT_EPOCH - AT_STATE), <int64_t>load_u64(p + AT_DEADLINE - AT_STATE),
                load_u64(p + AT_PAYLOAD_ID - AT_STATE), <int64_t>load_u64(p + AT_PUSHED - AT_STATE))

    def body(self, Py_ssize_t i, Py_ssize_t off, Py_ssize_t n):
        """``n`` bytes of slot ``i``'s body from byte ``off``."""
        self._alive()
        # Written as subtractions: off + n may not fit a Py_ssize_t.
        if i < 0 or i >= self.slots.shape[0] or off < 0 or n < 0 or n > self.size - 8 or off > self.size - 8 - n:
            raise IndexError(f"slot {i} out of range")
        return (<char*>&self.slots[i, 8 + off])[:n]


cdef class SlotStore:
    """The part of a FixedStore shard that the kernels writing its slots reach without a
    name lookup (declared in fixed.pxd): its typed fields and :meth:`raise_sync_error`.
    ``armdb.fixed.FixedShard`` derives from it and adds, in Python, the calls a kernel
    makes only off the hot path: ``check_writable`` (a poisoned store), ``grow`` (an
    empty free stack), ``sync_redo`` (an ordered store) and ``after_write`` (a hooked
    write or a due timed sync).
    """

    cpdef raise_sync_error(self):
        """Raise a sync failure kept by the last write, and forget it (caller holds the lock)."""
        e, self.sync_error = self.sync_error, None
        if e is not None:
            raise e


cdef inline int _uint_width(uint64_t v) noexcept nogil:
    """How many bytes :func:`_pack_uint` writes for ``v``."""
    if v < 0x80:
        return 1
    if v < 0x100:
        return 2
    if v < 0x10000:
        return 3
    if v < (<uint64_t>1 << 32):
        return 5
    return 9


def push_body_rows(bytes head not None, uint64_t first, list bodies not None, uint64_t g0):
    """The log rows of a push batch's bodies (ids ``first``, ``first + 1``, ...; every body
    a ``bytes``): row ``i`` is ``head`` (the packed start of ``["B", payload_name, ...``)
    then the key (msgpack ``bin 8``), the body (msgpack ``bin``) and the gsn ``g0 + i``,
    the bytes ``msgpack.packb`` gives for the row, written at their exact size; and the
    bodies' keys (``armdb.qrows.body_key`` of each id).  No item tuple and no gsn int a
    row.  Returns ``(packed, keys)``."""
    cdef Py_ssize_t n = len(bodies), i, hlen = len(head), total = 0, blen
    cdef object body
    for i in range(n):
        body = bodies[i]
        if type(body) is not bytes:
            raise TypeError("push_body_rows takes bytes bodies")
        blen = len(<bytes>body)
        total += hlen + 10 + (2 if blen < 0x100 else 3 if blen < 0x10000 else 5) + blen + _uint_width(g0 + i)
    out = PyBytes_FromStringAndSize(NULL, total)
    cdef uint8_t* p = <uint8_t*>PyBytes_AS_STRING(out)
    cdef list keys = PyList_New(n)
    for i in range(n):
        key = PyBytes_FromStringAndSize(NULL, 8)
        store_u64(<uint8_t*>PyBytes_AS_STRING(key), _bswap64(first + <uint64_t>i))
        copy_bytes(p, PyBytes_AS_STRING(head), hlen)
        p += hlen
        p[0] = 0xc4
        p[1] = 8
        copy_bytes(p + 2, PyBytes_AS_STRING(key), 8)
        p += 10
        body = bodies[i]
        blen = len(<bytes>body)
        if blen < 0x100:
            p[0] = 0xc4
            p[1] = <uint8_t>blen
            p += 2
        elif blen < 0x10000:
            p[0] = 0xc5
            p[1] = <uint8_t>(blen >> 8)
            p[2] = <uint8_t>blen
            p += 3
        else:
            p[0] = 0xc6
            p[1] = <uint8_t>(blen >> 24)
            p[2] = <uint8_t>(blen >> 16)
            p[3] = <uint8_t>(blen >> 8)
            p[4] = <uint8_t>blen
            p += 5
        copy_bytes(p, PyBytes_AS_STRING(body), blen)
        p += blen
        p = _pack_uint(p, g0 + <uint64_t>i)
        Py_INCREF(key)
        PyList_SET_ITEM(keys, i, key)
    PyObject_GC_UnTrack(<PyObject*>keys)  # bytes only: the collector need not traverse it
    return out, keys


def bitcask_puts(list keys not None, list values not None, uint64_t g0, uint64_t highest, uint64_t flag,
                 uint16_t magic, object fid, Py_ssize_t off, Py_ssize_t max_key, Py_ssize_t max_value):
    """:func:`bitcask_group` of puts given as two lists, ``keys[i]`` written with
    ``values[i]`` and gsn ``g0 + i`` (a push batch's bodies): the same records, hint
    entries and index entries, without an item tuple a row.  Returns ``(data, hints,
    entries)``, or None when a key or value is not a ``bytes`` within its limit, the
    lists differ in length, or ``g0`` is 0, not above ``highest`` or the gsns pass the
    gsn mask (the caller then takes the general path, which raises the right error)."""
    cdef Py_ssize_t n = len(keys), i, klen, vlen, total = 0, htotal = 0, rsize
    cdef uint64_t word
    cdef object key, value
    if len(values) != n or n == 0 or g0 == 0 or g0 <= highest or g0 + <uint64_t>n - 1 > _SEQ_MASK:
        return None
    for i in range(n):
        key = keys[i]
        value = values[i]
        if type(key) is not bytes or type(value) is not bytes:
            return None
        klen = len(<bytes>key)
        vlen = len(<bytes>value)
        if klen > max_key or vlen > max_value:
            return None
        rsize = 20 + klen + vlen
        total += rsize + ((-rsize) & 7)
        htotal += 22 + klen
    data = PyBytes_FromStringAndSize(NULL, total)
    hints = PyBytes_FromStringAndSize(NULL, htotal)
    cdef uint8_t* p = <uint8_t*>PyBytes_AS_STRING(data)
    cdef uint8_t* h = <uint8_t*>PyBytes_AS_STRING(hints)
    cdef Py_ssize_t at = off
    cdef list entries = PyList_New(n)
    for i in range(n):
        key = keys[i]
        value = values[i]
        word = g0 + <uint64_t>i
        if i == 0:
            word |= flag
        klen = len(<bytes>key)
        vlen = len(<bytes>value)
        rsize = _put_record(p, word, PyBytes_AS_STRING(key), klen, PyBytes_AS_STRING(value), vlen, magic)
        h = _hint_entry(h, word, <uint64_t>at, <uint32_t>vlen, PyBytes_AS_STRING(key), klen)
        entry = (fid, py_uint(<uint64_t>at), rsize, py_uint(word), None)
        # Ints and None: no cycle can run through it, so the collector need not see it
        # (what its first collection would conclude, _PyTuple_MaybeUntrack, done now).
        PyObject_GC_UnTrack(<PyObject*>entry)
        Py_INCREF(entry)
        PyList_SET_ITEM(entries, i, entry)
        p += rsize
        at += rsize
    PyObject_GC_UnTrack(<PyObject*>entries)  # untracked tuples only: the collector need not traverse it
    return data, hints, entries


def bitcask_index_put_new(dict index not None, dict tombs not None, list keys not None, list entries not None):
    """The index change of a group write of puts (``armdb.bitcask``'s
    ``write_puts_locked``) for keys neither ``index`` nor ``tombs`` holds: each inserted
    with one dict operation (``dict.setdefault``: one probe, where a membership test then
    an insert take two).  Stops at the first key either holds, leaving it untouched, for
    the caller's general update; returns where it stopped (``len(keys)`` when done)."""
    cdef Py_ssize_t n = len(keys), i
    cdef object key, entry
    cdef PyObject* got
    if len(entries) != n:
        raise ValueError("bitcask_index_put_new needs one entry per key")
    for i in range(n):
        key = keys[i]
        if PyDict_Size(tombs) and key in tombs:
            return i
        entry = entries[i]
        got = PyDict_SetDefault(index, key, entry)
        if got == NULL:
            raise MemoryError()
        if got != <PyObject*>entry:
            return i
    return n


# -- a var batch's body deletes (Queue.ack_many): keys, log rows, tombstones, index -------------

def tomb_rows(bytes head not None, object seqs, uint64_t g0, bytearray out not None):
    """The log rows of a var batch's body deletes appended to ``out``: the bytes
    ``msgpack.packb`` gives for ``[B, name, key, nil, gsn]`` (gsn ``g0 + i``, the rest as
    :func:`push_body_rows` packs them); returns the keys (row ``seqs[i]`` as 8 big-endian bytes,
    ``armdb.qrows.body_key``) for the store's :func:`bitcask_tombs_take`.  No item tuple and no
    gsn int per row."""
    cdef Py_ssize_t n, i, hlen = len(head), at = len(out)
    cdef const uint64_t* seqs_
    array_data(seqs, 8, False, <char**>&seqs_, &n)  # (a typed memoryview argument: 1,700 instructions)
    cdef uint8_t* p
    cdef uint8_t* start
    cdef list keys = PyList_New(n)  # (items NULL until set, which the list's free skips)
    if PyByteArray_Resize(out, at + n * (hlen + 20)) < 0:
        raise MemoryError()
    start = <uint8_t*>PyByteArray_AS_STRING(out)
    p = start + at
    for i in range(n):
        key = PyBytes_FromStringAndSize(NULL, 8)
        store_u64(<uint8_t*>PyBytes_AS_STRING(key), _bswap64(seqs_[i]))
        Py_INCREF(key)
        PyList_SET_ITEM(keys, i, key)
        copy_bytes(p, PyBytes_AS_STRING(head), hlen)
        p += hlen
        p[0] = 0xc4
        p[1] = 8
        copy_bytes(p + 2, PyBytes_AS_STRING(key), 8)
        p[10] = 0xc0
        p = _pack_uint(p + 11, g0 + <uint64_t>i)
    if PyByteArray_Resize(out, p - start) < 0:
        raise MemoryError()
    return keys


cdef tuple _tomb_records(list keys, Py_ssize_t total, Py_ssize_t htotal, uint64_t g0, uint64_t flag, uint16_t magic,
                         Py_ssize_t off):
    """The tombstones of ``keys[i]`` at gsn ``g0 + i``, end to end from file offset ``off``
    (the first carries ``flag``), and their hint entries: ``(data, hints)`` of ``total``
    and ``htotal`` bytes (:func:`bitcask_tombs_take`)."""
    cdef Py_ssize_t i, klen, rsize, n = len(keys)
    cdef uint64_t word
    cdef object key
    data = PyBytes_FromStringAndSize(NULL, total)
    hints = PyBytes_FromStringAndSize(NULL, htotal)
    cdef uint8_t* p = <uint8_t*>PyBytes_AS_STRING(data)
    cdef uint8_t* h = <uint8_t*>PyBytes_AS_STRING(hints)
    cdef Py_ssize_t at = off
    for i in range(n):
        key = <object>PyList_GET_ITEM(keys, i)
        klen = len(<bytes>key)
        word = (g0 + <uint64_t>i) | _TOMBSTONE
        if i == 0:
            word |= flag
        rsize = _put_record(p, word, PyBytes_AS_STRING(key), klen, NULL, 0, magic)
        h = _hint_entry(h, word, <uint64_t>at, 0, PyBytes_AS_STRING(key), klen)
        p += rsize
        at += rsize
    return data, hints


def bitcask_tombs_take(list keys, dict index, object fid, uint64_t g0, uint64_t highest, uint64_t flag,
                       uint16_t magic, Py_ssize_t off, Py_ssize_t max_key):
    """The tombstones of a batch of deletes (key ``keys[i]`` at gsn ``g0 + i``) for one
    unencrypted Bitcask shard, to append in one write (the records and hint entries that
    :func:`bitcask_group` gives for the items ``(keys[i], None, g0 + i)``; the first
    carries ``flag``), and the index side with one lookup a key: each key's entry is taken
    out of ``index`` while its tombstone is built.  The caller appends the records and
    then settles the counts (:func:`bitcask_tombs_settle`), or, if the append fails, puts
    the entries back (:func:`bitcask_tombs_restore`) and the index is as it was.

    A key whose put lies in file ``fid`` with no older holder (entry[4] None: the common
    delete, both records garbage at once) stays out of the index; one of another case is
    put back at once (its tombstone is still written: the caller's general update judges
    it, in order).  Returns ``(data, hints, kinds, taken)``: the records end to end
    (the first at file offset ``off``), their hint entries end to end (one a key),
    ``kinds`` ``n`` bytes (1 for a key taken, 2 for a key of another case), and the
    entries taken (None for the others).  None, with the index as it was, for a key that
    is not ``bytes`` or longer than ``max_key``, a gsn that is 0, above the gsn mask or
    not above ``highest``, or a key ``index`` does not hold (deleting a missing key writes
    nothing, and a key named twice is missing the second time): the caller's general
    path checks the batch and raises the right error."""
    cdef Py_ssize_t n = len(keys), i, klen, total = 0, htotal = 0, rsize
    cdef object key, old
    if n == 0 or g0 == 0 or g0 > _SEQ_MASK or <uint64_t>(n - 1) > _SEQ_MASK - g0 or g0 <= highest:
        return None
    kinds = PyBytes_FromStringAndSize(NULL, n)
    cdef uint8_t* kp = <uint8_t*>PyBytes_AS_STRING(kinds)
    cdef list taken = PyList_New(n)  # (items NULL until set, which the list's free skips)
    for i in range(n):
        key = <object>PyList_GET_ITEM(keys, i)
        if type(key) is not bytes or len(<bytes>key) > max_key:
            bitcask_tombs_restore(index, keys, kinds, taken, i)
            return None
        old = index.pop(key, None)  # (one lookup: CPython's _PyDict_Pop)
        if old is None:
            bitcask_tombs_restore(index, keys, kinds, taken, i)
            return None
        if _common_delete(old, fid):
            kp[i] = 1
        else:
            index[key] = old  # another case: the general update takes it out again
            kp[i] = 2
            old = None
        Py_INCREF(old)
        PyList_SET_ITEM(taken, i, old)
        klen = len(<bytes>key)
        rsize = 20 + klen
        total += rsize + ((-rsize) & 7)
        htotal += 22 + klen
    data, hints = _tomb_records(keys, total, htotal, g0, flag, magic, off)
    return (data, hints, kinds, taken)


def bitcask_tombs_restore(dict index, list keys, bytes kinds not None, list taken not None, Py_ssize_t stop=-1):
    """Put back the entries :func:`bitcask_tombs_take` took out of ``index`` (of the keys
    before ``stop``; -1: all): the index as it was before (its order aside)."""
    cdef Py_ssize_t i, n = len(keys) if stop < 0 else stop
    cdef const uint8_t* kp = <const uint8_t*>PyBytes_AS_STRING(kinds)
    for i in range(n):
        if kp[i] == 1:
            index[<object>PyList_GET_ITEM(keys, i)] = <object>PyList_GET_ITEM(taken, i)


def bitcask_tombs_settle(list keys, bytes kinds not None, list taken not None, Py_ssize_t off, uint64_t g0,
                         uint64_t flag, Py_ssize_t start):
    """The dead bytes of :func:`bitcask_tombs_take`'s records once appended at file
    offset ``off`` (the record of ``keys[start]``), from ``keys[start]`` on: a taken key's
    put and tombstone are both garbage.  Stops at the first key of another case.

    Returns ``(dead, stop, off, word)``: the bytes found dead, the key it stopped at
    (``len(keys)`` when done), and that key's record offset and gsn word, for the
    caller's general update of it."""
    cdef Py_ssize_t n = len(keys), i, rsize, dead = 0
    cdef const uint8_t* kp = <const uint8_t*>PyBytes_AS_STRING(kinds)
    cdef uint64_t word
    if len(kinds) != n or len(taken) != n:
        raise ValueError("bitcask_tombs_settle: one kind and one entry per key")
    for i in range(start, n):
        rsize = 20 + len(<bytes><object>PyList_GET_ITEM(keys, i))
        rsize += (-rsize) & 7
        if kp[i] != 1:
            word = (g0 + <uint64_t>i) | _TOMBSTONE
            if i == 0:
                word |= flag
            return dead, i, off, word
        dead += <Py_ssize_t>(<tuple><object>PyList_GET_ITEM(taken, i))[2] + rsize
        off += rsize
    return dead, n, off, 0


cdef Py_ssize_t _tomb_drop(dict index, object key, object fid) except -2:
    """The index change of a tombstone of ``key`` written to file ``fid``, for the common
    delete: a key whose put lies in that same file with no older holder (entry[4] None)
    leaves the index, both records garbage at once (what ``bitcask_index_apply`` does for
    such a delete); returns that put's record size.  -1 for any other case, the index
    left as it was, for the caller's general update."""
    old = index.pop(key, None)  # (one lookup: CPython's _PyDict_Pop)
    if old is None or not _common_delete(old, fid):
        if old is not None:
            # Back for the caller's general update, which takes it out again (a
            # tombstone never leaves its key in the index), so its place is moot.
            index[key] = old
        return -1
    return <Py_ssize_t>(<tuple>old)[2]


cdef inline bint _common_delete(object old, object fid) except -1:
    """Whether a tombstone written to file ``fid`` is the common delete of the put whose
    index entry is ``old``: the put lies in that same file with no older holder
    (entry[4] None), so the key leaves the index and both records are garbage at once.
    (The entry's fid is the active file's own int object, as the put stored it: the
    identity test spares a comparison call.)"""
    return type(old) is tuple and (<tuple>old)[4] is None and ((<tuple>old)[0] is fid or (<tuple>old)[0] == fid)


# -- a var queue's lone ack (armdb.tx.commit_settle) -------------------------------------------

def ack_rows(bytes fhead not None, uint32_t shard, uint32_t slot, uint32_t version, bytes bhead not None,
             uint64_t seq, uint64_t gsn):
    """A var queue's lone ack, its log record body and its body's key: the msgpack bytes
    of the list of its two rows ``["F", name, shard, slot, version, DELETED, b""]`` and
    ``["B", payload name, key, None, gsn]`` (``fhead`` and ``bhead``: the packed starts of
    the rows, to the name; the ints at a fixed width: uint 32, and uint 64 for the gsn),
    and ``key``, row ``seq`` as 8 big-endian bytes (``armdb.qrows.body_key``).  Returns
    ``(body, key)``: one call for what a struct pack of 21 fields and ``int.to_bytes`` did."""
    cdef Py_ssize_t fl = len(fhead), bl = len(bhead)
    body = PyBytes_FromStringAndSize(NULL, 1 + fl + 15 + 4 + bl + 10 + 10)
    key = PyBytes_FromStringAndSize(NULL, 8)
    cdef uint8_t* k = <uint8_t*>PyBytes_AS_STRING(key)
    store_u64(k, _bswap64(seq))
    cdef uint8_t* p = <uint8_t*>PyBytes_AS_STRING(body)
    p[0] = 0x92
    memcpy(p + 1, PyBytes_AS_STRING(fhead), fl)
    p = msgpack_u32(p + 1 + fl, shard)
    p = msgpack_u32(p, slot)
    p = msgpack_u32(p, version)
    p[0] = _ROW_DELETED
    p[1] = 0xc5  # bin 16 of length 0: b""
    p[2] = 0
    p[3] = 0
    p += 4
    memcpy(p, PyBytes_AS_STRING(bhead), bl)
    p += bl
    p[0] = 0xc4  # bin 8 of length 8: the key
    p[1] = 8
    memcpy(p + 2, k, 8)
    p[10] = 0xc0  # nil: a delete
    p[11] = 0xcf
    store_u64(p + 12, _bswap64(gsn))
    return body, key


# -- a var queue's lone ack of its body (BitcaskStore.tomb_locked) ---------------------------

def bitcask_tomb(key, dict index, uint64_t word, uint64_t highest, uint16_t magic, Py_ssize_t max_key,
                 Py_ssize_t size, Py_ssize_t total, Py_ssize_t max_size):
    """The tombstone record of a lone delete of ``key`` with gsn word ``word`` (the
    tombstone bit and any flag set) for one unencrypted Bitcask shard whose active file
    is ``size`` bytes long (``total`` written to it) of at most ``max_size``: the record
    :func:`bitcask_record` gives for it, once the checks of the common case passed.

    None for anything else, with nothing changed, for the caller's general write to
    judge: a key not ``bytes``, longer than ``max_key`` or not in ``index`` (deleting a
    missing key writes nothing), a gsn 0, above the gsn mask or not above ``highest``,
    or a record that would need a rotation first."""
    return _tomb_record(key, index, word, highest, magic, max_key, size, total, max_size)


cdef object _tomb_record(object key, dict index, uint64_t word, uint64_t highest, uint16_t magic,
                         Py_ssize_t max_key, Py_ssize_t size, Py_ssize_t total, Py_ssize_t max_size):
    """:func:`bitcask_tomb`, for :meth:`PutKernel.tomb`."""
    cdef uint64_t gsn = word & _SEQ_MASK
    if type(key) is not bytes or gsn == 0 or gsn <= highest:
        return None
    cdef Py_ssize_t klen = len(<bytes>key)
    if klen > max_key or key not in index:
        return None
    cdef Py_ssize_t n = 20 + klen
    n += (-n) & 7
    if total and size + n > max_size:
        return None
    rec = PyBytes_FromStringAndSize(NULL, n)
    _put_record(<uint8_t*>PyBytes_AS_STRING(rec), word, PyBytes_AS_STRING(<bytes>key), klen, NULL, 0, magic)
    return rec


def bitcask_tomb_drop(dict index, object key, object fid):
    """The index change of a lone tombstone of ``key`` written to file ``fid`` for the
    common delete (as :func:`bitcask_tombs_take` takes a key of a batch): the dropped
    put's record size, or -1 (nothing changed) for the caller's general update."""
    return _tomb_drop(index, key, fid)
