# cython: language_level=3
"""GroupSync: group commit for the transaction log, coordinated without the GIL.

Why compiled
------------
Durable commits share ``fdatasync`` calls (docs/transactions.md, "The commit
protocol", step 6): a committer that finds no sync running becomes the leader
and syncs everything appended so far; committers that arrive meanwhile wait,
and when the sync ends one of those it did not cover leads the next.  Written
in Python (a ``threading.Condition``), every hand-over needs the GIL twice: the
leader must get it back after ``os.fdatasync`` returns before it can wake
anyone, and the next leader must get it before it can start its sync.  With
eight committing threads those threads hold the GIL for their own Python work,
so the disk sat idle 100-140 us between syncs of 250-350 us (measured, see
docs/performance.md).  Here the wait, the hand-over and the ``fdatasync(2)``
itself run in C with the GIL released, so a new sync starts as soon as the
previous one returns, whoever holds the GIL.

The file-system seam
--------------------
``armdb/_fs.py`` is the only module that touches the OS for storage, so that
fault-injecting and recording file systems see every call.  This module calls
``fdatasync(2)`` itself only when the caller passes no ``sync_fn``, which
``TxLog.sync_to`` does only while the installed file system says so
(``RealFS.native_fdatasync()``: its ``fdatasync`` is the plain one).  Any file
system that overrides ``fdatasync`` gets its own method called, with the GIL,
from the same coordination loop.

Gathering
---------
With the leader starting a new sync the moment the previous one returns, the
committers split into two alternating cohorts: the group a sync releases
applies, returns and commits again while the next sync (of the other cohort)
runs, so each sync covered about half of the committing threads.  So a new
leader first waits, without the GIL and for at most ``gather_fraction`` (1.5)
of the previous sync's duration, until as many records arrived as the group
just released (``_mark``): one sync then covers both cohorts.  The bound is
longer than a sync because the released committers come back one at a time:
each needs the GIL for its apply, its next commit's plan and its append, about
40 us a commit with eight threads on a 2-core host (measured: 8 commits
gathered in 310-340 us beside syncs of 200-250 us).  At half a sync (the earlier
bound) the gather timed out with about 6 of 8 back, and the rest
waited a whole cycle: 8 threads made 10.5-12.5k commits/s, at 1.5 syncs
12.2-13.7k; 2, 4 and 16 threads were unchanged (docs/performance.md).  A lone
committer does not wait (its own append reaches the mark; only the first
commit after a burst of several may wait once), nor does the first sync (no
previous duration), nor the Python path (``sync_fn``; not timed).  The cost:
when some of the released committers are blocked on shard locks held by
commits waiting for this very sync, the leader waits the whole bound.

Wake-ups: a waiter whose record the running sync covers sleeps on
``cv[gen & 1]``; one that needs the next sync sleeps on ``cv[(gen + 1) & 1]``.
When generation ``gen`` ends, its waiters are woken together and exactly one
waiter of the next generation is woken to lead it; the others sleep on until
their own sync ends.  So each committer is woken once (a single condition
woke every waiter at the end of every sync: with eight threads, about one
useless wake-up and context switch per commit).

State (guarded by ``mu``): ``written`` is the log's end offset after the last
completed append (records below it are fully written); ``synced`` the offset
the last successful sync covered; ``syncing`` whether a leader is syncing;
``err`` the errno of a failed sync.  A failed sync is never retried (S12,
"fsyncgate": after an error Linux may report later syncs as successful
although the data never reached the disk): ``err`` stays set, and every
waiter whose record the sync did not cover gets it back.
"""

from libc.errno cimport EINTR, EIO, errno
from libc.limits cimport LLONG_MAX

from armdb._core._util cimport monotonic_ns
from armdb._core.posix_sync cimport (
    CLOCK_MONOTONIC,
    pthread_cond_broadcast,
    pthread_cond_destroy,
    pthread_cond_init,
    pthread_cond_signal,
    pthread_cond_t,
    pthread_cond_timedwait,
    pthread_cond_wait,
    pthread_condattr_destroy,
    pthread_condattr_init,
    pthread_condattr_setclock,
    pthread_condattr_t,
    pthread_mutex_destroy,
    pthread_mutex_init,
    pthread_mutex_lock,
    pthread_mutex_t,
    pthread_mutex_unlock,
    timespec,
)


cdef extern from "<unistd.h>" nogil:
    int fdatasync(int fd)


cdef class GroupSync:
    """Leader/follower ``fdatasync`` of one log file descriptor (see the module docstring)."""

    cdef pthread_mutex_t mu
    cdef pthread_cond_t cv[2]  # waiters for sync generation g sleep on cv[g & 1]
    cdef pthread_cond_t cv_lead  # a gathering leader sleeps here
    cdef int fd
    cdef long long _written
    cdef long long _synced
    cdef long long _syncs
    cdef long long _sync_ns
    cdef int _err
    cdef bint syncing
    cdef long long _gen  # syncs started; the running one (if syncing) is generation _gen
    cdef long long _target  # the running sync covers records below this (LLONG_MAX while gathering)
    cdef long long _appends  # wrote() calls: one per commit record
    cdef long long _covered  # _appends when the running (or last) sync started
    cdef long long _group  # records the running (or last) sync covers
    cdef long long _mark  # the next leader gathers until _appends reaches this...
    cdef long long _last_ns  # ...for at most gather_fraction of the last sync's duration
    cdef public double gather_fraction
    cdef long long _gathers, _gathered_ns

    def __cinit__(self, int fd, long long end):
        cdef pthread_condattr_t attr
        pthread_mutex_init(&self.mu, NULL)
        pthread_condattr_init(&attr)
        pthread_condattr_setclock(&attr, CLOCK_MONOTONIC)
        pthread_cond_init(&self.cv[0], &attr)
        pthread_cond_init(&self.cv[1], &attr)
        pthread_cond_init(&self.cv_lead, &attr)
        pthread_condattr_destroy(&attr)
        self._gen = 0
        self._target = 0
        self._appends = self._covered = self._group = self._mark = self._last_ns = 0
        self._gathers = self._gathered_ns = 0
        self.gather_fraction = 1.5
        self.fd = fd
        self._written = end
        self._synced = end
        self._syncs = 0
        self._sync_ns = 0
        self._err = 0
        self.syncing = False

    def __dealloc__(self):
        pthread_cond_destroy(&self.cv[0])
        pthread_cond_destroy(&self.cv[1])
        pthread_cond_destroy(&self.cv_lead)
        pthread_mutex_destroy(&self.mu)

    @property
    def synced(self) -> int:
        """The log offset the last successful sync covered."""
        return self._synced

    @property
    def syncs(self) -> int:
        """Successful syncs since this object was made."""
        return self._syncs

    @property
    def sync_seconds(self) -> float:
        """Time spent inside ``fdatasync(2)`` by the native path (for the benchmarks)."""
        return self._sync_ns / 1e9

    @property
    def gathers(self) -> tuple[int, float]:
        """How often a leader waited for the previous group's next commits, and for how long (s)."""
        return self._gathers, self._gathered_ns / 1e9

    @property
    def err(self) -> int:
        """The errno of a failed sync (0: none failed)."""
        return self._err

    # reset() and wrote() take ``mu`` while holding the GIL: releasing the GIL for a
    # few instructions would hand it to another thread, and wrote() runs under the
    # log's append lock.  That cannot deadlock: ``mu`` is only ever held by code
    # that does not wait for the GIL (the nogil blocks below), and only briefly
    # (a gathering leader waits on ``cv_lead``, which releases it).

    def reset(self, int fd, long long end) -> None:
        """A new, synced log file starts at ``end`` (no commit may be in flight)."""
        pthread_mutex_lock(&self.mu)
        self.fd = fd
        self._written = end
        self._synced = end
        pthread_mutex_unlock(&self.mu)

    def wrote(self, long long end) -> None:
        """An append ending at ``end`` has been written (call after its pwrite returned)."""
        pthread_mutex_lock(&self.mu)
        if end > self._written:
            self._written = end
        self._appends += 1
        if self.syncing and self._appends == self._mark:
            pthread_cond_signal(&self.cv_lead)  # a gathering leader has its group
        pthread_mutex_unlock(&self.mu)

    cdef long long _start(self) noexcept nogil:
        """Become the leader (caller holds mu): gather the commits of the group just
        released, then return the offset the sync will cover."""
        cdef long long deadline
        cdef timespec ts
        cdef long long t0
        self.syncing = True
        self._gen += 1
        self._target = LLONG_MAX  # whoever arrives while we gather is in this sync
        if self._appends < self._mark and self.gather_fraction > 0 and self._last_ns > 0:
            t0 = monotonic_ns()
            # Bounded (at most a minute) before the cast: a fraction set to a huge value
            # must not overflow the deadline.
            deadline = t0 + <long long>min(self._last_ns * self.gather_fraction, 6e10)
            ts.tv_sec = deadline // 1000000000
            ts.tv_nsec = deadline % 1000000000
            while self._appends < self._mark and self._err == 0:
                if pthread_cond_timedwait(&self.cv_lead, &self.mu, &ts) != 0:
                    break  # timed out (or an error): sync what is there
            self._gathers += 1
            self._gathered_ns += monotonic_ns() - t0
        self._group = self._appends - self._covered  # commits this sync covers (about)
        self._covered = self._appends
        self._target = self._written
        return self._written

    cdef inline void _finish(self, long long target, int e) noexcept nogil:
        # Caller holds mu.  The group released now will commit again: the next leader
        # may wait for it, on top of what was appended during this sync.
        self._mark = self._appends + self._group
        self.syncing = False
        if e == 0:
            self._syncs += 1
            if target > self._synced:
                self._synced = target
        elif self._err == 0:
            self._err = e
        # Everyone waiting for this generation is done (or failed); one waiter of the
        # next generation leads it (after a failure, all of them return the error).
        pthread_cond_broadcast(&self.cv[self._gen & 1])
        if e == 0:
            pthread_cond_signal(&self.cv[(self._gen + 1) & 1])
        else:
            pthread_cond_broadcast(&self.cv[(self._gen + 1) & 1])

    def sync_to(self, long long end, object sync_fn=None) -> int:
        """Block until the log is durable up to ``end``.

        Returns 0 once a successful sync covered ``end``, else the errno of the
        failed sync (sticky: every later call returns it too).  ``sync_fn``:
        ``None`` calls ``fdatasync(2)`` here without the GIL; otherwise
        ``sync_fn(fd)`` is called with the GIL (a test file system).  An
        ``OSError`` it raises fails the group (and is re-raised to the leader);
        any other exception is re-raised to the leader only, and another
        waiter leads the next sync.
        """
        cdef long long target = 0
        cdef long long t0
        cdef int rc, e
        cdef bint native = sync_fn is None
        cdef bint lead = False
        cdef int fd = -1
        while True:
            with nogil:
                pthread_mutex_lock(&self.mu)
                lead = False
                while True:
                    if self._synced >= end or self._err != 0:
                        break
                    if not self.syncing:
                        target = self._start()
                        fd = self.fd
                        if not native:
                            lead = True  # sync through Python, outside this block
                            break
                        pthread_mutex_unlock(&self.mu)
                        t0 = monotonic_ns()
                        while True:
                            rc = fdatasync(fd)
                            e = errno if rc != 0 else 0
                            if e != EINTR:
                                break
                        pthread_mutex_lock(&self.mu)
                        self._last_ns = monotonic_ns() - t0
                        self._sync_ns += self._last_ns
                        self._finish(target, e)
                        continue
                    if end <= self._target:
                        pthread_cond_wait(&self.cv[self._gen & 1], &self.mu)  # the running sync
                    else:
                        pthread_cond_wait(&self.cv[(self._gen + 1) & 1], &self.mu)  # the next one
                pthread_mutex_unlock(&self.mu)
            if not lead:
                break
            try:
                sync_fn(fd)
            except OSError as ex:
                e = ex.errno if isinstance(ex.errno, int) and ex.errno > 0 else EIO
                with nogil:
                    pthread_mutex_lock(&self.mu)
                    self._finish(target, e)
                    pthread_mutex_unlock(&self.mu)
                raise
            except BaseException:
                with nogil:
                    pthread_mutex_lock(&self.mu)
                    self.syncing = False  # not a failed sync: someone else leads
                    pthread_cond_broadcast(&self.cv[0])
                    pthread_cond_broadcast(&self.cv[1])
                    pthread_mutex_unlock(&self.mu)
                raise
            with nogil:
                pthread_mutex_lock(&self.mu)
                self._finish(target, 0)
                pthread_mutex_unlock(&self.mu)
        if self._synced >= end:
            return 0
        return self._err

