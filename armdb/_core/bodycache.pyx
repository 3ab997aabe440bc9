# cython: language_level=3
"""A var queue's body cache (``Queue._cache``: a dict from row id to body bytes), read
and changed a batch at a time by a compiled loop.

``push_many`` puts a batch's bodies, ``lease_batch`` takes them back, ``ack_many`` drops
them: with Python's ``dict.update``, ``map`` and ``sum`` that was a few Python objects
and calls per row for each of the three.  These loops do the same dict operations; the
caller holds the cache's lock and keeps the byte count.  Nothing is ever evicted: a body
is cached only while it fits in the budget (``Queue._cache_put``), and leaves as its row
is leased or removed.
"""

from cpython.bytes cimport PyBytes_GET_SIZE
from cpython.dict cimport PyDict_SetItem
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE, PyList_New, PyList_SET_ITEM
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF
from libc.stdint cimport uint64_t

cimport numpy as cnp

from armdb._core.npvec cimport array_data

cnp.import_array()


def cache_put_ids(dict cache, list ids, list bodies, Py_ssize_t budget, Py_ssize_t held):
    """Put ``bodies[i]`` (``bytes``) under ``ids[i]`` (the ints ``push_many`` returns, so
    the cache's keys are those objects, not a new int a body) while they fit in the room
    the cache has left (``budget`` less ``held``, the bytes held before the put): the
    first body that does not fit ends the put, so a full cache keeps the bodies it holds
    (the oldest, which a queue leases first) and costs a batch one comparison.  A body
    longer than ``budget`` is never cached and is skipped.  Nothing is evicted.
    Returns the bytes held after."""
    cdef Py_ssize_t i, n = PyList_GET_SIZE(bodies), size
    cdef object body
    if PyList_GET_SIZE(ids) != n:
        raise ValueError("cache_put_ids needs one id per body")
    for i in range(n):
        body = <object>PyList_GET_ITEM(bodies, i)
        size = PyBytes_GET_SIZE(<bytes?>body)
        if size > budget - held:
            if size <= budget:
                break  # full: the rest of the batch is read back from the store when leased
            continue
        PyDict_SetItem(cache, <object>PyList_GET_ITEM(ids, i), body)
        held += size
    return held


def cache_pop(dict cache, object ids):
    """The cached bodies of ``ids`` in order, taken out of the cache (a batch lease's
    bodies, decoded once; its ack then has none to drop): ``(bodies, bytes)``, one dict
    operation a body; or None unless every one of ``ids`` is cached, with the cache
    holding what it held (the bodies taken before a missing one are put back)."""
    cdef Py_ssize_t i, j, n, freed = 0
    cdef const uint64_t* ids_
    array_data(ids, 8, False, <char**>&ids_, &n)  # (a typed memoryview argument: 1,700 instructions)
    cdef object body
    cdef list out = PyList_New(n)  # (items NULL until set, which the list's free skips)
    for i in range(n):
        body = cache.pop(ids_[i], None)  # (one lookup: CPython's _PyDict_Pop)
        if body is None:
            for j in range(i):
                PyDict_SetItem(cache, ids_[j], <object>PyList_GET_ITEM(out, j))
            return None
        freed += PyBytes_GET_SIZE(<bytes?>body)
        Py_INCREF(body)
        PyList_SET_ITEM(out, i, body)
    return out, freed


def longest(list bodies):
    """The index of the first longest of ``bodies`` (``bytes``; 0 for none), or -1 if
    one is not ``bytes``: ``push_many``'s check of the size limit, without a
    Python call a body."""
    cdef Py_ssize_t i, n = PyList_GET_SIZE(bodies), at = 0, size, most = -1
    cdef object body
    for i in range(n):
        body = <object>PyList_GET_ITEM(bodies, i)
        if type(body) is not bytes:
            return -1
        size = PyBytes_GET_SIZE(body)
        if size > most:
            most = size
            at = i
    return at


def cache_drop(dict cache, object ids):
    """Drop the bodies of ``ids`` (an id not cached is skipped); returns their bytes."""
    cdef Py_ssize_t i, n, freed = 0
    cdef const uint64_t* ids_
    array_data(ids, 8, False, <char**>&ids_, &n)
    cdef object body
    for i in range(n):
        body = cache.pop(ids_[i], None)  # (one lookup: CPython's _PyDict_Pop)
        if body is not None:
            freed += PyBytes_GET_SIZE(<bytes?>body)
    return freed
