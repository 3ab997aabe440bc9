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
(docs/transactions.md, "The apply turnstile").  A ``db.tx()`` commit takes its shards'
locks with :func:`take_for_plan`, plans and appends its log record, draws one ticket per
shard and releases the locks (:func:`draw_turns`) before its log sync, so commits on the
same shards can plan and append while it waits for the disk.  After the sync it waits
for its turn on every shard (tickets are served in the order they were drawn, which is
the log's order on that shard) and takes the locks again (:func:`take_turns`), applies,
and hands each turn on (:func:`serve_turns`).

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
        apply on the shard, then for the lock; again if a commit logged in between.  The
        wait counts in ``draining`` until the lock is taken, so that committers step
        back meanwhile (:func:`take_for_plan`): a steady stream of commits on the shard
        cannot keep this thread out."""
        cdef double deadline = monotonic() + timeout if timeout != -1 else 0.0
        cdef double left = -1
        self._draining(1)
        try:
            while True:
                if self.pending != 0:
                    if timeout != -1:
                        left = deadline - monotonic()
                    if not self._drained(left, False):
                        return False
                if timeout != -1:
                    left = max(deadline - monotonic(), 0.0)
                if not self._wait(left):
                    return False
                if self.pending == 0:
                    return True
                self.held = False
                PyThread_release_lock(self.lock)
        finally:
            self._draining(-1)

    cdef void _draining(self, int step) noexcept:
        pthread_mutex_lock(&self.ts_mu)
        self.draining += step
        if self.draining == 0:
            pthread_cond_broadcast(&self.ts_cv)  # committers that stepped back
        pthread_mutex_unlock(&self.ts_mu)

    cdef bint _drained(self, double timeout, bint stepped_back) except -1:
        """Wait without the GIL until ``pending`` is 0 (and, for a committer that
        ``stepped_back``, ``draining`` too), at most ``timeout`` seconds unless it is
        negative; whether it is."""
        cdef timespec ts
        cdef long long deadline = 0
        cdef int rc = 0
        cdef bint done
        if self.pending == 0 and not (stepped_back and self.draining):
            return True
        if timeout >= 0:
            deadline = monotonic_ns() + <long long>(min(timeout, 6e4) * 1e9)
            ts.tv_sec = deadline // 1000000000
            ts.tv_nsec = deadline % 1000000000
        with nogil:
            pthread_mutex_lock(&self.ts_mu)
            while (self.pending != 0 or (stepped_back and self.draining != 0)) and rc != ETIMEDOUT:
                if timeout < 0:
                    pthread_cond_wait(&self.ts_cv, &self.ts_mu)
                else:
                    rc = pthread_cond_timedwait(&self.ts_cv, &self.ts_mu, &ts)
            done = self.pending == 0 and not (stepped_back and self.draining != 0)
            pthread_mutex_unlock(&self.ts_mu)
        return done

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


# -- a db.tx() commit's steps through the turnstile, one call each (armdb.tx) --------------------
cdef inline void _release_first(list locks, Py_ssize_t held):
    cdef Lock lock
    while held:
        held -= 1
        lock = <Lock>locks[held]
        lock.held = False
        PyThread_release_lock(lock.lock)


def take_for_plan(list locks not None, bint blind, object txlog):
    """Take every lock of ``locks`` (``Lock`` objects, in their global order) for a
    ``db.tx()`` commit to plan under, whether or not logged commits wait to apply on
    those shards.  Two rules keep the turnstile free of deadlocks: a thread that holds a
    shard with such commits never blocks on another lock (whose holder may be waiting
    for them to apply): it releases what it holds and starts again once that lock was
    free; and a commit that reads stored state (``blind`` False), or finds a thread
    waiting for the shard to drain, or a checkpoint of ``txlog`` waiting for the log's
    commits to finish, waits, holding nothing, until those commits applied.  Returns
    whether it holds a shard with such commits (the commit is logged behind them)."""
    cdef Py_ssize_t n = len(locks), held, i
    cdef Lock lock, busy, drain
    cdef bint behind
    for i in range(n):
        if type(locks[i]) is not Lock:
            raise TypeError("take_for_plan takes armdb._core.locks.Lock objects")
    while True:
        held = 0
        busy = drain = None
        behind = False
        try:
            for i in range(n):
                lock = <Lock>locks[i]
                if PyThread_acquire_lock_timed(lock.lock, 0, 0) != PY_LOCK_ACQUIRED:
                    if behind:
                        busy = lock
                        break
                    lock._wait(-1)
                lock.held = True
                held += 1
                if lock.pending:
                    behind = True
                if lock.draining and drain is None:
                    drain = lock  # a thread waits to take it once drained: step back
            if busy is None:
                if drain is None:
                    if not behind:
                        return False
                    for i in range(n):
                        lock = <Lock>locks[i]
                        if lock.pending and (not blind or txlog._idle_waiting):
                            drain = lock
                            break
                    if drain is None:
                        return True
        except BaseException:
            _release_first(locks, held)
            raise
        _release_first(locks, held)
        if busy is None:
            drain._drained(-1, True)
        else:
            busy._wait(-1)  # its holder is done with it: start again
            busy.held = False
            PyThread_release_lock(busy.lock)


def draw_turns(list locks not None):
    """Draw a turn on every lock of ``locks`` (held, right after the commit's log
    append), then release them; returns the tickets."""
    cdef Py_ssize_t n = len(locks), i
    cdef Lock lock
    cdef list tickets = []
    for i in range(n):
        lock = <Lock>locks[i]
        pthread_mutex_lock(&lock.ts_mu)
        tickets.append(lock.issued)
        lock.issued += 1
        lock.pending += 1
        pthread_mutex_unlock(&lock.ts_mu)
    _release_first(locks, n)
    return tickets


def take_turns(list locks not None, list tickets not None):
    """Wait (holding nothing) for the commit's turn on every lock, then take them all
    in their order."""
    cdef Py_ssize_t n = len(locks), i
    cdef Lock lock
    _wait_turns(locks, tickets)
    for i in range(n):
        lock = <Lock>locks[i]
        if PyThread_acquire_lock_timed(lock.lock, 0, 0) != PY_LOCK_ACQUIRED:
            try:
                lock._wait(-1)
            except BaseException:
                _release_first(locks, i)
                raise
        lock.held = True


cdef int _wait_turns(list locks, list tickets) except -1:
    cdef Py_ssize_t n = len(locks), i, t
    cdef Lock lock
    for i in range(n):
        lock = <Lock>locks[i]
        t = tickets[i]
        if lock.serving != t:
            with nogil:
                pthread_mutex_lock(&lock.ts_mu)
                while lock.serving != t:
                    pthread_cond_wait(&lock.ts_cv, &lock.ts_mu)
                pthread_mutex_unlock(&lock.ts_mu)
    return 0


def serve_turns(list locks not None, list tickets not None):
    """Hand on the commit's turn on every lock (waiting for it first, which costs
    nothing once it has it): once, in its turn, whatever happened to the commit."""
    cdef Py_ssize_t n = len(locks), i
    cdef Lock lock
    _wait_turns(locks, tickets)
    for i in range(n):
        lock = <Lock>locks[i]
        pthread_mutex_lock(&lock.ts_mu)
        lock.serving += 1
        lock.pending -= 1
        pthread_cond_broadcast(&lock.ts_cv)
        pthread_mutex_unlock(&lock.ts_mu)
