# cython: language_level=3
"""Overflow-checked buffer sizes for the kernels that size a buffer by a count their
caller gives (``KeyIndex.candidates``, ``QueueShard.claim``): a product that does not
fit a ``size_t`` must be an error, never a wrapped (tiny) allocation that the kernel
then writes past."""

from libc.stdlib cimport malloc

cdef extern from *:
    """
    static inline int armdb_mul_overflow(size_t a, size_t b, size_t *out) {
        return __builtin_mul_overflow(a, b, out);
    }
    """
    bint mul_overflow "armdb_mul_overflow" (size_t a, size_t b, size_t* out) noexcept nogil


cdef inline void* malloc_array(Py_ssize_t count, size_t item) except NULL:
    """``malloc(count * item)``, with the product checked; ``MemoryError`` when it does not
    fit or the memory is not there (callers first bound ``count`` by what they hold)."""
    cdef size_t total
    cdef void* p
    if count < 0 or mul_overflow(<size_t>count, item, &total):
        raise MemoryError(f"a buffer of {count} items of {item} bytes does not fit in memory")
    p = malloc(total if total else 1)
    if p == NULL:
        raise MemoryError(f"cannot allocate a buffer of {total} bytes")
    return p
