# cython: language_level=3
"""Byte-order, clock and int helpers shared by the kernels: ``cdef inline`` functions only
(``noexcept nogil`` but :func:`py_uint`), so each call compiles to a few instructions in
the module that uses it.

Every on-disk integer is loaded and stored through these, byte by byte with an explicit
byte order (docs/format.md): the kernels never cast a file pointer to a wider type,
so an unaligned field or a big-endian host reads the same bytes.
"""

from cpython.long cimport PyLong_FromLong, PyLong_FromUnsignedLongLong
from libc.limits cimport LONG_MAX
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy

from armdb._core.posix_sync cimport CLOCK_MONOTONIC, CLOCK_REALTIME, clock_gettime, timespec


# -- byte order ---------------------------------------------------------------------------

cdef inline uint32_t load_u32(const uint8_t* p) noexcept nogil:
    """A little-endian u32."""
    return <uint32_t>p[0] | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16) | (<uint32_t>p[3] << 24)


cdef inline void store_u32(uint8_t* p, uint32_t v) noexcept nogil:
    p[0] = v & 0xFF
    p[1] = (v >> 8) & 0xFF
    p[2] = (v >> 16) & 0xFF
    p[3] = (v >> 24) & 0xFF


cdef inline uint64_t load_u64(const uint8_t* p) noexcept nogil:
    """A little-endian u64."""
    return <uint64_t>load_u32(p) | (<uint64_t>load_u32(p + 4) << 32)


cdef inline void store_u64(uint8_t* p, uint64_t v) noexcept nogil:
    store_u32(p, <uint32_t>v)
    store_u32(p + 4, <uint32_t>(v >> 32))


cdef inline uint8_t* msgpack_u32(uint8_t* p, uint32_t v) noexcept nogil:
    """``v`` as msgpack's uint 32 (0xce, then 4 big-endian bytes), valid for any value, so
    every compiled row that writes it has the same width; returns the byte after it."""
    p[0] = 0xce
    p[1] = <uint8_t>(v >> 24)
    p[2] = <uint8_t>(v >> 16)
    p[3] = <uint8_t>(v >> 8)
    p[4] = <uint8_t>v
    return p + 5


cdef inline uint64_t load_le(const uint8_t* p, int n) noexcept nogil:
    """The ``n``-byte little-endian unsigned integer at ``p`` (``n`` at most 8)."""
    cdef uint64_t v = 0
    cdef int k
    for k in range(n - 1, -1, -1):
        v = (v << 8) | p[k]
    return v


cdef inline void store_le(uint8_t* p, uint64_t v, int n) noexcept nogil:
    """The low ``n`` bytes of ``v``, little-endian."""
    cdef int k
    for k in range(n):
        p[k] = v & 0xFF
        v >>= 8


cdef inline uint64_t load_be64(const uint8_t* p) noexcept nogil:
    """A big-endian u64 (a queue row key word)."""
    cdef uint64_t v = 0
    cdef int k
    for k in range(8):
        v = (v << 8) | p[k]
    return v


cdef inline void store_be64(uint8_t* p, uint64_t v) noexcept nogil:
    cdef int k
    for k in range(7, -1, -1):
        p[k] = v & 0xFF
        v >>= 8


# -- clocks ---------------------------------------------------------------------------------

cdef inline double monotonic_s() noexcept nogil:
    """``time.monotonic()``: seconds on the monotonic clock."""
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef inline long long monotonic_ns() noexcept nogil:
    """``time.monotonic_ns()``."""
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <long long>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef inline int64_t wall_ms() noexcept nogil:
    """``time.time_ns() // 1_000_000``: milliseconds since the Unix epoch."""
    cdef timespec ts
    clock_gettime(CLOCK_REALTIME, &ts)
    return <int64_t>ts.tv_sec * 1000 + ts.tv_nsec // 1000000


# -- copies ---------------------------------------------------------------------------------

cdef inline void copy_bytes(void* dst, const void* src, Py_ssize_t n) noexcept nogil:
    """``memcpy(dst, src, n)``; a few bytes (a key, a short string, a row's head) by 8- and
    4-byte moves, overlapping at the tail, without the library call (whose dispatch
    costs more than such a copy)."""
    cdef uint8_t* d = <uint8_t*>dst
    cdef const uint8_t* s = <const uint8_t*>src
    cdef uint64_t w, t
    cdef uint32_t x, y
    cdef Py_ssize_t i = 0
    if n > 64:
        memcpy(d, s, n)
    elif n >= 8:
        while i + 8 < n:
            memcpy(&w, s + i, 8)
            memcpy(d + i, &w, 8)
            i += 8
        memcpy(&t, s + n - 8, 8)
        memcpy(d + n - 8, &t, 8)
    elif n >= 4:
        memcpy(&x, s, 4)
        memcpy(&y, s + n - 4, 4)
        memcpy(d, &x, 4)
        memcpy(d + n - 4, &y, 4)
    else:
        while i < n:
            d[i] = s[i]
            i += 1


# -- ints ---------------------------------------------------------------------------------

cdef inline object py_uint(uint64_t v):
    """The Python int ``v``.  CPython's ``PyLong_FromLong`` makes an int below 2**30 (an
    id, a gsn, a file offset) by its one-digit path; ``PyLong_FromUnsignedLong`` (what
    Cython converts a ``uint64_t`` with) and ``PyLong_FromSsize_t`` always run the general
    one, about twice the instructions (60 more an int)."""
    if v <= <uint64_t>LONG_MAX:
        return PyLong_FromLong(<long>v)
    return PyLong_FromUnsignedLongLong(v)
