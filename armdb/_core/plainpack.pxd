# cython: language_level=3
"""Declarations of armdb._core.plainpack, shared with armdb._core.qshard."""


cdef object pack_one(object value)
cdef object unpack_one(bytes raw, bint* ok)
