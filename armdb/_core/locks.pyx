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

The apply turnstile
-------------------
A shard's lock also orders the durable transactions logged on that shard
(docs/transactions.md, "The commit protocol").  A ``db.tx()`` commit takes its shards'
locks with :meth:`Lock.take_any`, plans and appends its log record, draws one ticket per
shard (:meth:`Lock.ticket`) and releases the locks before its log sync, so commits on
the same shards can plan and append while it waits for the disk.  After the sync it
waits for its turn on every shard (:meth:`Lock.wait_turn`: tickets are served in the
order they were drawn, which is the log's order on that shard), takes the locks again,
applies, and hands each turn on (:meth:`Lock.served`).

Everyone else takes the lock as before (``acquire``, ``with``, ``take``), which now also
waits until no logged commit is waiting to apply on the shard (``pending`` is 0): a
direct write must not draw its gsn or version before rows logged ahead of it are
applied (replay skips by them), and a read sees every commit that has returned.  Such
a waiter holds the OS lock only when ``pending`` is 0, never while it waits; the
``draining`` count it raises tells committers to step back rather than keep the shard
busy (armdb.tx).  The turnstile's counters change under ``ts_mu`` with the GIL held;
the waits run without the GIL.
"""

cimport cython
from libc.errno cimport ETIMEDOUT
from libc.math cimport ceil

from armdb._core._util cimport monotonic_ns
from armdb._core.posix_sync cimport (
    CLOCK_MONOTONIC,
    pthread_cond_broadcast,
    pthread_cond_destroy,
    pthread_cond_init,
    pthread_cond_timedwait,
    pthread_cond_wait,
    pthread_condattr_destroy,
    pthread_condattr_init,
    pthread_condattr_setclock,
    pthread_condattr_t,
    pthread_mutex_destroy,
    pthread_mutex_init,
    pthread_mutex_lock,
    pthread_mutex_unlock,
    timespec,
)

from time import monotonic


cdef extern from "Python.h":
    int PyErr_CheckSignals() except -1


@cython.final
cdef class Lock:
    """``threading.Lock``'s interface: ``acquire(blocking=True, timeout=-1)``,
    ``release()``, ``locked()`` and the context manager (fields: locks.pxd)."""

    def __cinit__(self):
        cdef pthread_condattr_t attr
        self.lock = PyThread_allocate_lock()
        if self.lock == NULL:
            raise MemoryError("cannot allocate a lock")
        self.held = False
        pthread_mutex_init(&self.ts_mu, NULL)
        pthread_condattr_init(&attr)
        pthread_condattr_setclock(&attr, CLOCK_MONOTONIC)
        pthread_cond_init(&self.ts_cv, &attr)
        pthread_condattr_destroy(&attr)

    def __dealloc__(self):
        if self.lock != NULL:
            if self.held:  # (as _thread.lock's dealloc: a held lock is released before it is freed)
                PyThread_release_lock(self.lock)
            PyThread_free_lock(self.lock)
            pthread_cond_destroy(&self.ts_cv)
            pthread_mutex_destroy(&self.ts_mu)

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
            if self.pending == 0:
                self.held = True
                return True
            PyThread_release_lock(self.lock)
        if not blocking:
            return False
        return self._acquire_drained(timeout)

    cdef object _acquire_drained(self, double timeout):
        """A blocking ``acquire``: wait (holding nothing) until no logged commit waits to
        apply on the shard, then for the lock; again if a commit logged in between."""
        cdef double deadline = monotonic() + timeout if timeout != -1 else 0.0
        cdef double left = -1
        while True:
            if self.pending != 0:
                if timeout != -1:
                    left = deadline - monotonic()
                if not self._drained(left):
                    return False
            if timeout != -1:
                left = max(deadline - monotonic(), 0.0)
            if not self._wait(left):
                return False
            if self.pending == 0:
                return True
            self.held = False
            PyThread_release_lock(self.lock)

    cdef bint _drained(self, double timeout) except -1:
        """Wait without the GIL until ``pending`` is 0 (at most ``timeout`` seconds unless
        it is negative); whether it is."""
        cdef timespec ts
        cdef long long deadline = 0
        cdef int rc = 0
        cdef bint done
        if timeout >= 0:
            deadline = monotonic_ns() + <long long>(min(timeout, 6e4) * 1e9)
            ts.tv_sec = deadline // 1000000000
            ts.tv_nsec = deadline % 1000000000
        self.draining += 1
        with nogil:
            pthread_mutex_lock(&self.ts_mu)
            while self.pending != 0 and rc != ETIMEDOUT:
                if timeout < 0:
                    pthread_cond_wait(&self.ts_cv, &self.ts_mu)
                else:
                    rc = pthread_cond_timedwait(&self.ts_cv, &self.ts_mu, &ts)
            done = self.pending == 0
            pthread_mutex_unlock(&self.ts_mu)
        self.draining -= 1
        return done

    # -- the apply turnstile (module docstring) -------------------------------------------
    def take_any(self):
        """Take the lock whether or not logged commits wait to apply on the shard (a
        commit that plans on top of them, or applies in its turn)."""
        if PyThread_acquire_lock_timed(self.lock, 0, 0) == PY_LOCK_ACQUIRED:
            self.held = True
            return
        self._wait(-1)

    def try_any(self):
        """:meth:`take_any` if the lock is free now; whether it was."""
        if PyThread_acquire_lock_timed(self.lock, 0, 0) == PY_LOCK_ACQUIRED:
            self.held = True
            return True
        return False

    def ticket(self):
        """Draw the next turn on this shard (the caller holds the lock and has just
        logged its commit): the commit now waits to apply here."""
        cdef Py_ssize_t t
        pthread_mutex_lock(&self.ts_mu)
        t = self.issued
        self.issued += 1
        self.pending += 1
        pthread_mutex_unlock(&self.ts_mu)
        return t

    def wait_turn(self, Py_ssize_t ticket):
        """Wait without the GIL (holding no lock) until every ticket drawn before
        ``ticket`` on this shard has been served."""
        with nogil:
            pthread_mutex_lock(&self.ts_mu)
            while self.serving != ticket:
                pthread_cond_wait(&self.ts_cv, &self.ts_mu)
            pthread_mutex_unlock(&self.ts_mu)

    def served(self):
        """The ticket whose turn it is has applied (or given up): the next one's turn."""
        pthread_mutex_lock(&self.ts_mu)
        self.serving += 1
        self.pending -= 1
        pthread_cond_broadcast(&self.ts_cv)
        pthread_mutex_unlock(&self.ts_mu)

    def wait_drained(self):
        """Wait without the GIL (holding no lock) until no logged commit waits to apply
        on this shard."""
        self._drained(-1)

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
