# cython: language_level=3
"""Declarations of armdb._core.locks, for the kernels that take a Lock without a method
call (take and give: what acquire() and release() do)."""

cimport cython


cdef extern from "pythread.h":
    ctypedef void* PyThread_type_lock
    ctypedef enum PyLockStatus:
        PY_LOCK_FAILURE
        PY_LOCK_ACQUIRED
        PY_LOCK_INTR
    PyThread_type_lock PyThread_allocate_lock()
    void PyThread_free_lock(PyThread_type_lock)
    PyLockStatus PyThread_acquire_lock_timed(PyThread_type_lock, long long microseconds, int intr_flag) nogil
    void PyThread_release_lock(PyThread_type_lock) nogil
    long long PY_TIMEOUT_MAX


@cython.final
cdef class Lock:
    cdef PyThread_type_lock lock
    cdef bint held
    cdef object _wait(self, double timeout)


cdef inline int take(Lock lock) except -1:
    """``lock.acquire()``, without the method call."""
    if PyThread_acquire_lock_timed(lock.lock, 0, 0) == PY_LOCK_ACQUIRED:
        lock.held = True
        return 0
    lock._wait(-1)
    return 0


cdef inline int give(Lock lock) except -1:
    """``lock.release()``, without the method call."""
    if not lock.held:
        raise RuntimeError("release unlocked lock")
    lock.held = False
    PyThread_release_lock(lock.lock)
    return 0
