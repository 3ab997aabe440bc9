# cython: language_level=3
"""File writes that stay out of the GIL's way: ``AtomicWriter`` replaces one small file
in a thread that never takes the GIL; ``pwrite_all`` writes into the page cache
without giving the GIL up.

Why compiled
------------
The sequence map (``armdb.seqmap``, SPEC T5) is rewritten once per 1024 ids: a tmp
file, ``fsync``, ``rename``, ``fsync`` of the directory, about 0.5-0.9 ms on the CI
machine.  Written by the pushing thread, that wait is 0.5-0.9 us per push of a fixed
queue whose cycle costs 5 us.  ``SeqMap`` therefore posts the next block's
reservation here ahead of the block's end; a Python thread runs :meth:`AtomicWriter.run`,
which waits for posts and writes them entirely without the GIL.  (A Python thread
doing the same writes needed the GIL around each of its six system calls, and a
thread waiting for the GIL while another runs Python waits out the 5 ms switch
interval: half the reservations were not done when their block ran out.)

The file-system seam
--------------------
``armdb/_fs.py`` is the only module that touches the OS for storage, so that the
fault-injecting and recording file systems of the tests see every call.  ``SeqMap``
posts here only while the installed file system is ``RealFS`` itself and no
failpoint is armed; otherwise it writes through ``_fs.FS.write_file_atomic`` in the
calling thread, as before.  The steps below are those of ``RealFS.write_file_atomic``.

``msync_range``: the one sync ``mmap.flush`` cannot do with the GIL released.

``pwrite_all``: ``os.pwrite`` releases the GIL, and a thread that released it must
win it back, which beside a thread running Python without blocking takes until
CPython's switch interval (5 ms) forces a hand-over.  A var queue cycle makes three
such writes (body, log record, tombstone): beside one busy thread it ran at 2,700
cycles/s instead of 31,000.  A write into the page cache takes a microsecond or two,
so holding the GIL through it costs the other threads less than the hand-over costs
this one (``RealFS.pwrite``).  Writes above 256 KiB (compaction copies, large
values) and reads and syncs, which can wait for the disk, still release it.

State (guarded by ``mu``): ``posted`` counts posts, ``finished`` the writes done (the
one in flight is ``posted`` while ``finished < posted``); ``err`` is the errno of the
last finished write (0: it is durable).  One write at a time: :meth:`post` refuses
while one is in flight, so the buffer is never replaced under the writer.
"""

cimport cython
from libc.errno cimport EINTR, EINVAL, EIO, errno
from libc.limits cimport LLONG_MAX
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.list cimport PyList_GET_ITEM
from cpython.object cimport PyObject

cdef extern from "Python.h":
    PyObject* PyDict_GetItemWithError(object d, object key) except? NULL
    Py_ssize_t PyObject_LengthHint(object o, Py_ssize_t default) except -1
from posix.stat cimport fchmod, struct_stat
from posix.stat cimport stat as c_stat

from armdb._core.posix_sync cimport (
    pthread_cond_broadcast,
    pthread_cond_destroy,
    pthread_cond_init,
    pthread_cond_signal,
    pthread_cond_t,
    pthread_cond_wait,
    pthread_mutex_destroy,
    pthread_mutex_init,
    pthread_mutex_lock,
    pthread_mutex_t,
    pthread_mutex_unlock,
)

import os


cdef extern from "<fcntl.h>" nogil:
    int c_open "open"(const char* path, int flags, int mode)
    int O_WRONLY
    int O_RDONLY
    int O_CREAT
    int O_TRUNC
    int O_CLOEXEC
    int O_DIRECTORY
    int O_NOFOLLOW


cdef extern from "<unistd.h>" nogil:
    ssize_t c_write "write"(int fd, const void* buf, size_t n)
    ssize_t c_pwrite "pwrite"(int fd, const void* buf, size_t n, long long offset)
    int c_fsync "fsync"(int fd)
    int c_close "close"(int fd)
    int c_unlink "unlink"(const char* path)


cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void* iov_base
        size_t iov_len
    ssize_t c_pwritev "pwritev"(int fd, const iovec* iov, int iovcnt, long long offset)


cdef extern from "<sys/mman.h>" nogil:
    int c_msync "msync"(void* addr, size_t length, int flags)
    int MS_SYNC


cdef extern from "<stdio.h>" nogil:
    int c_rename "rename"(const char* old, const char* new)


cdef Py_ssize_t _BIG_WRITE = 256 * 1024


def pwrite_all(int fd, data, long long offset):
    """Write all of ``data`` (bytes, or any contiguous buffer) at ``offset`` of ``fd``,
    holding the GIL for writes of up to 256 KiB (module docstring).  Raises ``OSError`` as
    ``os.pwrite`` would.  Bytes are written from their own storage: a typed memoryview of
    them cost more than the write itself for a small record."""
    cdef const unsigned char[::1] view
    if type(data) is bytes:
        _pwrite_all(fd, <const unsigned char*>PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data), offset)
    else:
        view = data
        _pwrite_all(fd, &view[0] if view.shape[0] else NULL, view.shape[0], offset)


cdef int _pwrite_all(int fd, const unsigned char* data, Py_ssize_t n, long long offset) except -1:
    cdef Py_ssize_t done = 0
    cdef ssize_t w
    cdef int e
    if offset < 0 or offset > LLONG_MAX - n:  # offset + done must stay a valid file offset
        raise OSError(EINVAL, f"pwrite of {n} bytes at offset {offset}: {os.strerror(EINVAL)}")
    while done < n:
        if n - done > _BIG_WRITE:
            # A long copy (compaction, a large value): worth handing the GIL over.
            with nogil:
                w = c_pwrite(fd, data + done, n - done, offset + done)
                e = errno
        else:
            w = c_pwrite(fd, data + done, n - done, offset + done)
            e = errno
        if not _wrote(w, e, "pwrite"):
            continue
        done += w
    return 0


cdef inline bint _wrote(ssize_t w, int e, str call) except -1:
    """Whether a write's result ``w`` (errno ``e``) wrote bytes: False for an interrupted
    call, to retry; ``OSError`` for a failed one or one that wrote nothing."""
    if w < 0:
        if e == EINTR:
            return False
        raise OSError(e, os.strerror(e))
    if w == 0:
        raise OSError(EIO, f"{call} wrote nothing")
    return True


DEF _IOV_MAX = 64  # parts :func:`pwritev_all` writes by one pwritev(2); more are joined first


def pwritev_all(int fd, list parts not None, long long offset):
    """Write ``parts`` (``bytes`` or ``bytearray``) end to end at ``offset`` of ``fd``,
    as :func:`pwrite_all` writes their join, without the join: a batch's log record
    (its frame, then the packed rows as the plan built them) reaches the page cache
    with no copy of its ~300 KB in user space.  The GIL as :func:`pwrite_all` (given up
    above 256 KiB; the caller owns the parts, so nothing changes them meanwhile); a
    short write resumes where it stopped.  Raises ``OSError`` as ``os.pwrite`` would."""
    cdef iovec iov[_IOV_MAX]
    cdef Py_ssize_t k = len(parts), i, n = 0, done = 0, m
    cdef int first = 0, e
    cdef ssize_t w
    cdef object part
    if k > _IOV_MAX:
        pwrite_all(fd, b"".join(parts), offset)
        return
    for i in range(k):
        part = <object>PyList_GET_ITEM(parts, i)
        if type(part) is bytes:
            iov[i].iov_base = <void*>PyBytes_AS_STRING(part)
            iov[i].iov_len = <size_t>PyBytes_GET_SIZE(part)
        elif type(part) is bytearray:
            iov[i].iov_base = <void*>PyByteArray_AS_STRING(part)
            iov[i].iov_len = <size_t>PyByteArray_GET_SIZE(part)
        else:
            raise TypeError("pwritev_all takes bytes or bytearray parts")
        n += <Py_ssize_t>iov[i].iov_len
    if offset < 0 or offset > LLONG_MAX - n:  # offset + done must stay a valid file offset
        raise OSError(EINVAL, f"pwritev of {n} bytes at offset {offset}: {os.strerror(EINVAL)}")
    while done < n:
        while iov[first].iov_len == 0:  # (done < n: a part with bytes left follows)
            first += 1
        if n - done > _BIG_WRITE:
            with nogil:
                w = c_pwritev(fd, &iov[first], <int>(k - first), offset + done)
                e = errno
        else:
            w = c_pwritev(fd, &iov[first], <int>(k - first), offset + done)
            e = errno
        if not _wrote(w, e, "pwritev"):
            continue
        done += w
        while w > 0:  # past the parts written whole; into the one written in part
            m = <Py_ssize_t>iov[first].iov_len
            if w >= m:
                w -= m
                iov[first].iov_len = 0
                first += 1
            else:
                iov[first].iov_base = <void*>(<char*>iov[first].iov_base + w)
                iov[first].iov_len = <size_t>(m - w)
                w = 0


def msync_range(const unsigned char[::1] mapped, Py_ssize_t offset, Py_ssize_t length):
    """``msync(MS_SYNC)`` bytes ``offset .. offset + length`` of a mapping (``offset`` a
    multiple of the page size), with the GIL released.  ``mmap.flush`` keeps the GIL
    through the sync, so a thread syncing a header store in the background stopped
    every other thread for the disk's write time.  The buffer stays exported (and so
    mapped) until the call returns.  Raises ``OSError`` as ``mmap.flush`` would."""
    cdef int rc, e
    if offset < 0 or length < 0 or offset > mapped.shape[0] - length:
        raise OSError(EINVAL, f"msync of {length} bytes at {offset} is outside a mapping of {mapped.shape[0]}")
    if length == 0:
        return
    with nogil:
        rc = c_msync(<void*>&mapped[offset], <size_t>length, MS_SYNC)
        e = errno
    if rc != 0:
        raise OSError(e, os.strerror(e))


cdef int _replace(const char* tmp, const char* path, const char* dir, const char* buf,
                  Py_ssize_t n) noexcept nogil:
    """tmp + write + fsync + close + rename + fsync of the directory; 0 or an errno.
    A failure before the rename removes the tmp file and leaves ``path`` as it was.
    The new file gets the mode ``path`` has, or 0600 (``armdb._fs.FILE_MODE``)."""
    cdef struct_stat st
    cdef int mode = 0o600
    if c_stat(path, &st) == 0:
        mode = st.st_mode & 0o7777
    cdef int fd = c_open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, mode)
    cdef int e
    cdef Py_ssize_t done = 0
    cdef ssize_t w
    if fd < 0:
        return errno
    if fchmod(fd, mode) != 0:  # a stale tmp file keeps its own mode when reopened
        e = errno
        c_close(fd)
        c_unlink(tmp)
        return e
    while done < n:
        w = c_write(fd, buf + done, n - done)
        if w < 0:
            if errno == EINTR:
                continue
            e = errno
            c_close(fd)
            c_unlink(tmp)
            return e
        done += w
    if c_fsync(fd) != 0:
        e = errno
        c_close(fd)
        c_unlink(tmp)
        return e
    if c_close(fd) != 0:
        e = errno
        c_unlink(tmp)
        return e
    if c_rename(tmp, path) != 0:
        e = errno
        c_unlink(tmp)
        return e
    fd = c_open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0)
    if fd < 0:
        return errno
    if c_fsync(fd) != 0:
        e = errno
        c_close(fd)
        return e
    c_close(fd)
    return 0


cdef class AtomicWriter:
    """Durable replacement of the file ``path``, done by whichever thread runs :meth:`run`."""

    cdef pthread_mutex_t mu
    cdef pthread_cond_t cv_post  # the writer sleeps here until a post (or stop)
    cdef pthread_cond_t cv_done  # waiters for a write sleep here
    cdef bytes _path, _tmp, _dir  # file-system encoded; their buffers outlive every write
    cdef char* buf
    cdef Py_ssize_t n
    cdef long long posted, finished
    cdef int err
    cdef bint stopping

    def __cinit__(self, str path):
        pthread_mutex_init(&self.mu, NULL)
        pthread_cond_init(&self.cv_post, NULL)
        pthread_cond_init(&self.cv_done, NULL)
        self.buf = NULL
        self.n = 0
        self.posted = self.finished = 0
        self.err = 0
        self.stopping = False

    def __init__(self, str path):
        self._path = os.fsencode(path)
        self._tmp = os.fsencode(path + ".tmp")
        self._dir = os.fsencode(os.path.dirname(path) or ".")

    def __dealloc__(self):
        pthread_cond_destroy(&self.cv_post)
        pthread_cond_destroy(&self.cv_done)
        pthread_mutex_destroy(&self.mu)
        free(self.buf)

    def post(self, bytes data not None):
        """Hand ``data`` to the writer; returns its ticket, or 0 (nothing posted) while an
        earlier write is still in flight or the writer was stopped."""
        cdef Py_ssize_t n = len(data)
        cdef char* copy = <char*>malloc(n if n else 1)
        if copy == NULL:
            raise MemoryError()
        memcpy(copy, <const char*>data, n)
        cdef long long ticket = 0
        # The GIL stays held: the writer holds mu only for a few stores and never takes
        # the GIL, and releasing it here would make this thread wait for it again
        # behind any thread running Python (up to the 5 ms switch interval).
        pthread_mutex_lock(&self.mu)
        if self.finished == self.posted and not self.stopping:
            free(self.buf)
            self.buf = copy
            self.n = n
            self.posted += 1
            ticket = self.posted
            pthread_cond_signal(&self.cv_post)
        pthread_mutex_unlock(&self.mu)
        if ticket == 0:
            free(copy)
        return ticket

    def result(self, long long ticket):
        """-1 while write ``ticket`` is in flight, else its errno (0: the file is durable)."""
        cdef int r
        pthread_mutex_lock(&self.mu)  # with the GIL, as in post()
        r = self.err if self.finished >= ticket else -1
        pthread_mutex_unlock(&self.mu)
        return r

    def wait(self, long long ticket):
        """Wait (without the GIL) for write ``ticket``; returns its errno (0: durable)."""
        cdef int r
        with nogil:
            pthread_mutex_lock(&self.mu)
            while self.finished < ticket:
                pthread_cond_wait(&self.cv_done, &self.mu)
            r = self.err
            pthread_mutex_unlock(&self.mu)
        return r

    def run(self):
        """The writer loop: returns once :meth:`stop` was called and no write is left."""
        cdef const char* buf
        cdef Py_ssize_t n
        cdef int e
        cdef const char* tmp = self._tmp
        cdef const char* path = self._path
        cdef const char* dir = self._dir
        with nogil:
            pthread_mutex_lock(&self.mu)
            while True:
                while self.finished == self.posted and not self.stopping:
                    pthread_cond_wait(&self.cv_post, &self.mu)
                if self.finished == self.posted:
                    break  # stopping, nothing left
                buf = self.buf
                n = self.n
                pthread_mutex_unlock(&self.mu)
                e = _replace(tmp, path, dir, buf, n)
                pthread_mutex_lock(&self.mu)
                self.err = e
                self.finished = self.posted
                pthread_cond_broadcast(&self.cv_done)
            pthread_mutex_unlock(&self.mu)

    def stop(self):
        """Make :meth:`run` return after the write in flight (if any); later posts are refused."""
        pthread_mutex_lock(&self.mu)
        self.stopping = True
        pthread_cond_signal(&self.cv_post)
        pthread_mutex_unlock(&self.mu)


@cython.always_allow_keywords(False)
def disarmed_point(name):
    """``armdb._fail.point`` while no failpoint is set: a compiled call that does nothing
    (a var queue cycle passes five points; with ``RealFS.pwrite`` made compiled too, the
    Python frames gone saved about 2,000 instructions a cycle)."""


def draw_id(dict rest not None, name, slow):
    """``SeqMap.next(name)`` with its common case compiled (``SeqMap.drawer``): the next id
    of the rest of the name's reserved block (``rest``, the map's ``_rest``: a range
    iterator, whose next() is one atomic step under the GIL), else ``slow(name)``, the
    Python method, which refills it under the map's lock.  No Python frame for the
    common case: every Bitcask write draws a gsn."""
    cdef PyObject* p = PyDict_GetItemWithError(rest, name)
    if p != NULL:
        n = next(<object>p, None)
        if n is not None:
            return n
    return slow(name)


def draw_run(dict rest not None, name, Py_ssize_t n):
    """The first of ``n`` consecutive ids taken from the rest of the name's reserved block
    (``rest``, as for :func:`draw_id`), or None when the rest holds fewer than ``n``.

    ``SeqMap.draw_block`` (a batch's ids or gsns) takes them here first: without it, a
    batch started after the rest and left the rest unused, so a lone draw and a small
    batch in turn (a producer's push and a worker's ``ack_many``) burnt up to a quarter
    of a block each time and made the map reserve on disk every few dozen calls.

    The whole take is one C call with the GIL held, so no other thread's ``next()`` on
    the same iterator (lock-free, in ``SeqMap.next``, ``Plan.draw`` or :func:`draw_id`,
    possibly holding the iterator from before) can take an id in the middle of the run:
    it gets an id after it."""
    cdef PyObject* p = PyDict_GetItemWithError(rest, name)
    if p == NULL or n < 1:
        return None
    it = <object>p
    if PyObject_LengthHint(it, 0) < n:
        return None
    first = next(it)
    cdef Py_ssize_t i
    for i in range(n - 1):
        next(it)
    return first
