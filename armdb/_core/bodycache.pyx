# cython: language_level=3
"""A var queue's body cache (``Queue._cache``: a dict from row id to body bytes), read
and changed a batch at a time by a compiled loop.

``push_many`` puts a batch's bodies, ``lease_batch`` takes them back, ``ack_many`` drops
them: with Python's ``dict.update``, ``map`` and ``sum`` that was a few Python objects
and calls per row for each of the three.  These loops do the same dict operations (the
dict stays a plain dict in insertion order, which ``Queue._cache_evict`` relies on); the
caller holds the cache's lock and keeps the byte count.
"""

from cpython.bytes cimport PyBytes_GET_SIZE
from cpython.dict cimport PyDict_DelItem, PyDict_Next, PyDict_SetItem
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE, PyList_New, PyList_SET_ITEM
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF
from cpython.pyport cimport PY_SSIZE_T_MAX
from libc.stdint cimport uint64_t


def cache_put_ids(dict cache, list ids, list bodies, Py_ssize_t budget, Py_ssize_t held):
    """Put ``bodies[i]`` (``bytes``) under ``ids[i]`` (the ints ``push_many`` returns, so
    the cache's keys are those objects, not a new int a body), each no longer than
    ``budget`` (a longer one is not cached); then, while the cache
    holds more than ``budget`` bytes (``held`` before the put), the oldest bodies dropped
    (dict order, as :func:`cache_evict`): a push batch's put and eviction in one call.
    Returns the bytes held after."""
    cdef Py_ssize_t i, n = PyList_GET_SIZE(bodies), size
    cdef object body
    if PyList_GET_SIZE(ids) != n:
        raise ValueError("cache_put_ids needs one id per body")
    for i in range(n):
        body = <object>PyList_GET_ITEM(bodies, i)
        size = PyBytes_GET_SIZE(<bytes?>body)
        if size <= budget:
            PyDict_SetItem(cache, <object>PyList_GET_ITEM(ids, i), body)
            held += size
    if held <= budget:
        return held
    return held - _drop_oldest(cache, PY_SSIZE_T_MAX, held - budget)


cdef Py_ssize_t _drop_oldest(dict cache, Py_ssize_t k, Py_ssize_t excess) except -1:
    """Drop the oldest bodies of ``cache`` (dict order: push order) until ``k`` are gone
    or their bytes reach ``excess``, whichever comes first; returns their bytes.  The
    eviction of :func:`cache_evict` (by count) and :func:`cache_put_ids` (by bytes)."""
    cdef Py_ssize_t pos = 0, i, freed = 0
    cdef PyObject* key
    cdef PyObject* value
    cdef list victims = []
    while len(victims) < k and freed < excess and PyDict_Next(cache, &pos, &key, &value):
        freed += PyBytes_GET_SIZE(<bytes?><object>value)
        victims.append(<object>key)
    for i in range(len(victims)):  # (not while iterating: a dict must not change under PyDict_Next)
        PyDict_DelItem(cache, <object>PyList_GET_ITEM(victims, i))
    return freed


def cache_pop(dict cache, const uint64_t[::1] ids):
    """The cached bodies of ``ids`` in order, taken out of the cache (a batch lease's
    bodies, decoded once; its ack then has none to drop): ``(bodies, bytes)``, one dict
    operation a body; or None unless every one of ``ids`` is cached, with the cache
    holding what it held (the bodies taken before a missing one are put back, at the
    end of the eviction order)."""
    cdef Py_ssize_t i, j, n = ids.shape[0], freed = 0
    cdef object body
    cdef list out = PyList_New(n)  # (items NULL until set, which the list's free skips)
    for i in range(n):
        body = cache.pop(ids[i], None)  # (one lookup: CPython's _PyDict_Pop)
        if body is None:
            for j in range(i):
                PyDict_SetItem(cache, ids[j], <object>PyList_GET_ITEM(out, j))
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


def cache_drop(dict cache, const uint64_t[::1] ids):
    """Drop the bodies of ``ids`` (an id not cached is skipped); returns their bytes."""
    cdef Py_ssize_t i, n = ids.shape[0], freed = 0
    cdef object body
    for i in range(n):
        body = cache.pop(ids[i], None)  # (one lookup: CPython's _PyDict_Pop)
        if body is not None:
            freed += PyBytes_GET_SIZE(<bytes?>body)
    return freed


def cache_evict(dict cache, Py_ssize_t k):
    """Drop the first ``k`` bodies of ``cache`` (its oldest: the dict is in push order),
    all if it holds fewer; returns their bytes.  ``Queue._cache_evict``'s round, which
    took an ``islice``, a ``pop`` and a ``len`` call a body."""
    return _drop_oldest(cache, k, PY_SSIZE_T_MAX)
