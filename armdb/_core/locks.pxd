# cython: language_level=3
"""Declarations of armdb._core.locks, for the kernels that take a Lock without a method
call (take and give: what acquire() and release() do)."""

cimport cython

from armdb._core.posix_sync cimport pthread_cond_t, pthread_mutex_t


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
    # The apply turnstile of a shard (module docstring): tickets of logged commits.
    cdef readonly Py_ssize_t pending  # tickets issued and not yet served
    cdef readonly Py_ssize_t draining  # threads waiting to take it once pending is 0
    cdef Py_ssize_t issued  # the next ticket
    cdef Py_ssize_t serving  # the ticket whose turn it is
    cdef pthread_mutex_t ts_mu
    cdef pthread_cond_t ts_cv
    cdef object _wait(self, double timeout)
    cdef object _acquire_drained(self, double timeout)
    cdef void _draining(self, int step) noexcept
    cdef bint _drained(self, double timeout, bint stepped_back) except -1


cdef inline int take(Lock lock) except -1:
    """``lock.acquire()``, without the method call: the lock, once no logged commit
    waits to apply on its shard."""
    if PyThread_acquire_lock_timed(lock.lock, 0, 0) == PY_LOCK_ACQUIRED:
        if lock.pending == 0:
            lock.held = True
            return 0
        PyThread_release_lock(lock.lock)
    lock._acquire_drained(-1)
    return 0


cdef inline int give(Lock lock) except -1:
    """``lock.release()``, without the method call."""
    if not lock.held:
        raise RuntimeError("release unlocked lock")
    lock.held = False
    PyThread_release_lock(lock.lock)
    return 0
