# cython: language_level=3, binding=False
"""A mutual-exclusion lock with the interface of ``threading.Lock`` whose uncontended
``acquire`` costs about a third of it.

Why: a lone var push→lease→ack cycle takes about nine locks (a header shard's, the body
store shard's, the payload cache's, the log's).  ``_thread.lock.acquire`` parses its
optional arguments with ``PyArg_ParseTupleAndKeywords`` at every call, about 170 of its
420 instructions; here the uncontended path is a compiled method call and one
non-blocking ``PyThread_acquire_lock_timed``.  Contended, it blocks without the GIL and
runs signal handlers between waits, as ``_thread.lock`` does (``acquire_timed`` in
CPython's ``Modules/_threadmodule.c``).  The OS lock is CPython's own
(``PyThread_allocate_lock``), through the public ``pythread.h`` API.

Like ``threading.Lock`` (not ``RLock``): not reentrant, and any thread may release it.
``threading.Condition`` accepts it (it falls back to ``acquire(False)`` to test
ownership, as for any lock without ``_is_owned``).
"""

cimport cython
from libc.math cimport ceil

from time import monotonic


cdef extern from "Python.h":
    int PyErr_CheckSignals() except -1


@cython.final
cdef class Lock:
    """``threading.Lock``'s interface: ``acquire(blocking=True, timeout=-1)``,
    ``release()``, ``locked()`` and the context manager (fields: locks.pxd)."""

    def __cinit__(self):
        self.lock = PyThread_allocate_lock()
        if self.lock == NULL:
            raise MemoryError("cannot allocate a lock")
        self.held = False

    def __dealloc__(self):
        if self.lock != NULL:
            if self.held:  # (as _thread.lock's dealloc: a held lock is released before it is freed)
                PyThread_release_lock(self.lock)
            PyThread_free_lock(self.lock)

    def acquire(self, bint blocking=True, double timeout=-1):
        """Take the lock; True once taken.  ``blocking`` False: return False at once if it
        is held.  ``timeout`` (seconds, ``-1`` for none): return False once it passed."""
        if not blocking or timeout != -1:  # _thread.lock's checks, in its order
            if timeout * 1e6 > <double>PY_TIMEOUT_MAX:
                raise OverflowError("timeout value is too large")
            if not blocking and timeout != -1:
                raise ValueError("can't specify a timeout for a non-blocking call")
            if timeout < 0 and timeout != -1:
                raise ValueError("timeout value must be a non-negative number")
        if PyThread_acquire_lock_timed(self.lock, 0, 0) == PY_LOCK_ACQUIRED:
            self.held = True
            return True
        if not blocking:
            return False
        return self._wait(timeout)

    cdef object _wait(self, double timeout):
        """A blocking ``acquire`` of a held lock: the wait of ``_thread.lock``."""
        cdef long long us
        cdef PyLockStatus r
        cdef double deadline = 0.0
        if timeout == -1:
            us = -1
        else:
            us = <long long>ceil(timeout * 1e6)
            deadline = monotonic() + timeout
        while True:
            with nogil:
                r = PyThread_acquire_lock_timed(self.lock, us, 1)
            if r != PY_LOCK_INTR:
                break
            PyErr_CheckSignals()  # a signal's handler runs (and its exception propagates)
            if us > 0:
                left = deadline - monotonic()
                if left <= 0:
                    r = PyThread_acquire_lock_timed(self.lock, 0, 0)
                    break
                us = <long long>ceil(left * 1e6)
        if r == PY_LOCK_ACQUIRED:
            self.held = True
            return True
        return False

    def release(self):
        """Release the lock (any thread may); RuntimeError if it is not held."""
        give(self)

    def locked(self):
        """Whether the lock is held."""
        return self.held

    def __enter__(self):
        # take, not self.acquire(): a with statement would otherwise pay a second
        # method call and its argument parsing at every pass (the general commit takes
        # its locks this way).
        take(self)
        return True

    def __exit__(self, exc_type, exc, tb):
        give(self)

    def __repr__(self):
        return f"<armdb lock {'locked' if self.held else 'unlocked'} at {id(self):#x}>"
