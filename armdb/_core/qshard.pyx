# cython: language_level=3
"""A queue shard's hot path: push, lease and ack of one row in one extension call.

Why compiled: a push, a lease and an ack each read or compose one 48-byte row
(16-byte key, 32-byte header) plus the inline payload, write one slot and update
the ordered index.  Done in Python with ``struct`` and separate ``SlotFile`` and
``KeyIndex`` calls, that bookkeeping cost about 10 us per push→lease→ack cycle,
against a floor of about 3 us for the Python API surface itself (SPEC section 8,
docs/performance.md).  Here it is a few hundred nanoseconds of C.

Row layout and the rules of a push and a lease: ``qrow.pxd`` (the one definition,
which ``armdb.transitions`` gives to Python); each row is followed by ``payload_size``
bytes of inline payload (0 for a var queue).

The caller holds the shard lock around every call, as for ``KeyIndex``; the store
is closed under that lock, and every call that reads or writes the mapped file
first raises ``DbClosed`` if it was (``SlotFile._alive``), so a call racing
``Db.close`` never touches an unmapped page.  Every
slot write goes through ``SlotFile`` (redo record first, then the slot).  What a
write needs of the store behind it goes through the typed ``SlotStore`` interface of
fixed.pxd (``armdb.fixed.FixedShard`` implements it), never a method looked up by
name: on a durable store an overwrite of a live row first makes the redo record
durable (``sync_redo``, S4), exactly as ``FixedShard.write`` does; after each slot
write ``after_write`` runs when a test file system records writes, when a failpoint
is armed, or when a timed sync is due.  A sync failure it meets is kept in the typed
``sync_error`` field and raised at the end of the call, once the index matches the
slots.  Index results are status codes, turned into exceptions in one place
(``_raise_status``).
"""

cimport cython
cimport numpy as cnp
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport free
from cpython.object cimport PyTypeObject
from cpython.ref cimport Py_INCREF
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE, PyByteArray_Resize
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.dict cimport PyDict_DelItem, PyDict_SetItem
from cpython.object cimport PyObject
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE, PyTuple_SET_ITEM
from cpython.datetime cimport import_datetime, timedelta_new
from libc.string cimport memcpy

import numpy as np

cnp.import_array()
import_datetime()


from armdb._core._util cimport load_be64, load_le, monotonic_s, msgpack_u32, store_be64
from armdb._core._util cimport wall_ms as _wall_ms
from armdb._core.checked cimport malloc_array
from armdb._core.fixed cimport PutKernel, SlotFile, SlotStore, ring_step
from armdb._core.locks cimport Lock, give, take
from armdb._core.npvec cimport array_data, rows_data
from armdb._core.plainpack cimport pack_one, unpack_one

from armdb._core.bodycache import cache_pop
from armdb._core.plainpack import unpack_plain
from armdb._core.qindex cimport SCAN_WORDS, Entry, KeyIndex, raise_status
from armdb._core.qrow cimport (
    AT_ATTEMPTS,
    AT_DUE,
    AT_EPOCH,
    AT_SEQ,
    AT_STATE,
    LEASED,
    MAX_PAYLOAD,
    ROW_HEAD,
    T_EXPIRED_DEAD,
    T_RELEASED,
    lease_row,
    push_row,
)

cdef enum:
    SLOT_OCCUPIED = 1
    SLOT_DELETED = 2
    SCAN_STACK = 16          # candidates held on the stack; more are malloc'ed
    CHUNK_BYTES = 65536      # payload records are handed out of arrays of about this size

# ack() and ack_token() results
cdef enum:
    _ACKED = 0
    _ABSENT = 1      # no live row with this key: acked, nacked or dead-lettered already
    _RELEASED = 2    # the row is there but no longer holds this lease (epoch or state differs)
    _FOREIGN = 3     # ack_token: not a token of this handle and shard (the caller says why)
    _DUPLICATE = 4   # plan_ack_block: the same lease twice in one batch

ACKED = _ACKED
ABSENT = _ABSENT
RELEASED = _RELEASED
FOREIGN = _FOREIGN
DUPLICATE = _DUPLICATE


cdef struct _Sink:
    # Where QueueShard._walk writes the leases of claim_block (one entry per lease).
    uint64_t* dues
    uint64_t* seqs
    uint16_t* attempts
    uint32_t* epochs
    uint8_t* payloads        # payload_size bytes a lease (NULL when payload_size is 0)
    Py_ssize_t at


cdef extern from "Python.h":
    object PyType_GenericAlloc(PyTypeObject* t, Py_ssize_t n)
    # PyDict_GetItem without its save and restore of the error state (the keys here are
    # str, whose hash and comparison cannot fail).
    PyObject* PyDict_GetItemWithError(object d, object key) except? NULL
    Py_ssize_t PyDict_GET_SIZE(object d)

cdef extern from "numpy/arrayobject.h":
    object PyArray_Scalar(void* data, cnp.PyArray_Descr* descr, object base)


cdef inline object _tuple5(cls, a, b, c, d, e):
    """``tuple.__new__(cls, (a, b, c, d, e))`` for a NamedTuple class, without the
    argument tuple: what CPython's tuple_subtype_new does, item by item."""
    cdef object t = PyType_GenericAlloc(<PyTypeObject*>cls, 5)
    Py_INCREF(a)
    PyTuple_SET_ITEM(t, 0, a)  # steals the reference taken just before
    Py_INCREF(b)
    PyTuple_SET_ITEM(t, 1, b)
    Py_INCREF(c)
    PyTuple_SET_ITEM(t, 2, c)
    Py_INCREF(d)
    PyTuple_SET_ITEM(t, 3, d)
    Py_INCREF(e)
    PyTuple_SET_ITEM(t, 4, e)
    return t


cdef inline Py_ssize_t _frow_size(Py_ssize_t name_len, Py_ssize_t width) noexcept nogil:
    return 3 + name_len + 15 + 1 + 3 + width


cdef inline uint8_t* _frow(uint8_t* p, const uint8_t* name, Py_ssize_t name_len, uint32_t shard, uint32_t slot,
                           uint32_t version, uint8_t status, const uint8_t* image, Py_ssize_t width) noexcept nogil:
    """One logged slot write, ``["F", name, shard, slot, version, status, image]``, as the
    msgpack bytes ``msgpack.packb`` would decode to that list (armdb.txlog's row of kind
    F).  ``name`` is the queue name already packed as a msgpack str; ``width`` < 65536."""
    p[0] = 0x97              # fixarray of 7
    p[1] = 0xa1              # fixstr of 1: "F"
    p[2] = 0x46
    memcpy(p + 3, name, name_len)
    p = msgpack_u32(p + 3 + name_len, shard)
    p = msgpack_u32(p, slot)
    p = msgpack_u32(p, version)
    p[0] = status            # positive fixint
    p[1] = 0xc5              # bin 16
    p[2] = <uint8_t>(width >> 8)
    p[3] = <uint8_t>width
    if width:
        memcpy(p + 4, image, width)
    return p + 4 + width


cdef uint8_t* _grow_log(bytearray out, Py_ssize_t extra) except NULL:
    """Make room for ``extra`` more bytes at the end of ``out``; returns where they start."""
    cdef Py_ssize_t at = PyByteArray_GET_SIZE(out)
    PyByteArray_Resize(out, at + extra)
    return <uint8_t*>PyByteArray_AS_STRING(out) + at


def wall_ms():
    """Milliseconds since the Unix epoch (``time.time_ns() // 1_000_000``), as one C call:
    the default clock of a Db (armdb._clock.system_clock), read by every queue operation."""
    return _wall_ms()


def lone_token(token, token_cls, handle, Py_ssize_t nshards):
    """Whether ``token`` is a ``token_cls`` (exactly: a ``LeaseToken``) of the handle
    ``handle`` whose five fields are exact ints and whose shard is one of ``nshards``:
    the token a var queue's compiled ack (``VarFast.ack``, by ``_lone_token``) hands
    straight to its commit.  Anything else (a ``Lease``, an altered token, another
    handle's) takes the general path, which judges it.  Python's face of the check, for
    its test against the Python checks (tests/test_lone_ack_tomb.py)."""
    return _lone_token(token, token_cls, handle, nshards)


cdef inline bint _token_fields(tuple t, uint64_t* due, uint64_t* seq, uint32_t* epoch) except -1:
    """A token's due, seq and epoch in the widths they are stored in; False when one does
    not fit (an altered token: the Python body refuses it with ``NotALease``)."""
    try:
        due[0] = <object>PyTuple_GET_ITEM(t, 2)
        seq[0] = <object>PyTuple_GET_ITEM(t, 3)
        epoch[0] = <object>PyTuple_GET_ITEM(t, 4)
    except (OverflowError, TypeError):
        return False
    return True


cdef bint _lone_token(token, token_cls, handle, Py_ssize_t nshards) except -1:
    """:func:`lone_token` (and ``VarFast.ack``'s test)."""
    if type(token) is not token_cls or PyTuple_GET_SIZE(token) != 5:
        return False
    f = <object>PyTuple_GET_ITEM(token, 1)
    if (type(<object>PyTuple_GET_ITEM(token, 0)) is not int or type(f) is not int
            or type(<object>PyTuple_GET_ITEM(token, 2)) is not int
            or type(<object>PyTuple_GET_ITEM(token, 3)) is not int
            or type(<object>PyTuple_GET_ITEM(token, 4)) is not int):
        return False
    if not (<object>PyTuple_GET_ITEM(token, 0) == handle):
        return False
    return 0 <= f < nshards


@cython.final
cdef class QueueShard:
    """The slot file and the two ordered indexes of one queue shard.

    Parameters
    ----------
    fixed : armdb.fixed.FixedShard
        The shard's header store; its ``SlotFile`` is shared, not copied.
    payload_size : int
        Inline payload bytes per row (the fixed queue's dtype size; 0 for var).
    hooked : bool
        Call ``fixed.after_write(slot)`` after every slot write (a recording file
        system or an armed failpoint); otherwise only when a timed sync is due.
    """

    cdef SlotFile sf
    cdef public KeyIndex live, dead
    cdef public SlotStore fixed          # armdb.fixed.FixedShard, through its typed interface
    cdef public object lock
    cdef Py_ssize_t psize
    cdef bint ordered, hooked
    cdef bint hook_ran       # after_write ran during this call: it may have stashed a sync error
    cdef bint batching       # a loop of writes: the timed-sync check runs once, at its end
    cdef Py_ssize_t pending  # the last slot written while batching (-1: none)
    cdef double sync_every
    # Lease building (set_lease_types): fixed queues get their Lease objects from here.
    cdef object lease_cls, token_cls, handle, dtype
    cdef cnp.ndarray chunk
    cdef Py_ssize_t chunk_len, chunk_next
    # Counters since open (summed by Queue.stats); armdb.tx updates them too.
    cdef public Py_ssize_t pushes, acks, nacks, dead_lettered, expired_leases

    def __init__(self, fixed, Py_ssize_t payload_size, bint hooked):
        if payload_size < 0 or payload_size > MAX_PAYLOAD or ROW_HEAD + payload_size > fixed.body_size:
            raise ValueError(f"payload_size {payload_size} does not fit the shard's slots")
        self.fixed = fixed
        self.lock = fixed.lock   # the shard lock: held around every call
        self.sf = fixed.sf
        self.live = KeyIndex()
        self.dead = KeyIndex()
        self.psize = payload_size
        self.ordered = fixed.ordered
        self.hooked = hooked
        self.sync_every = -1.0 if fixed.sync_every is None else fixed.sync_every
        self.pending = -1

    def set_lease_types(self, lease_cls, token_cls, handle, dtype):
        """Make the lease calls return ``lease_cls(id, payload, attempt, deadline,
        token_cls(handle, shard, due, seq, epoch))`` for a fixed queue (``dtype`` is
        its payload dtype), instead of raw tuples.

        Both classes must be tuple subclasses (NamedTuples).  Each payload is a
        record of a fresh array of about 64 KiB of records, written once here and
        never handed out twice: as private and writable as ``.copy()`` of a view,
        without an allocation per lease.
        """
        for cls in (lease_cls, token_cls):
            if not (issubclass(cls, tuple) and cls.__new__(cls, *range(5)) == tuple(range(5))):
                raise TypeError("lease and token classes must be tuple subclasses of 5 fields")
        if dtype.itemsize != self.psize:
            raise ValueError(f"dtype of {dtype.itemsize} bytes, the queue stores {self.psize}")
        self.lease_cls = lease_cls
        self.token_cls = token_cls
        self.handle = handle
        self.dtype = dtype
        self.chunk_len = max(1, CHUNK_BYTES // self.psize)
        self.chunk = None
        self.chunk_next = self.chunk_len

    cdef object _record(self, const uint8_t* payload):
        """A fresh record of ``dtype`` holding ``payload`` (see set_lease_types)."""
        if self.chunk_next == self.chunk_len:
            self.chunk = np.empty(self.chunk_len, dtype=self.dtype)
            self.chunk_next = 0
        cdef char* p = <char*>cnp.PyArray_DATA(self.chunk) + self.chunk_next * self.psize
        memcpy(p, payload, self.psize)
        self.chunk_next += 1
        # What chunk[i] returns (a record viewing the array), without the indexing call.
        return PyArray_Scalar(p, cnp.PyArray_DESCR(self.chunk), self.chunk)

    # -- slot writes ------------------------------------------------------------
    cdef int _check(self) except -1:
        """Refuse a write to a closed shard (DbClosed) or a poisoned one (StorageError)."""
        self.sf._alive()
        if self.fixed.poisoned is not None:
            (<object>self.fixed).check_writable()
        return 0

    cdef int _write(self, Py_ssize_t slot, int st, const uint8_t* row, Py_ssize_t n,
                    uint32_t version=0) except -1:
        """One slot write (``version`` 0: the next on the ring), ordered on a durable
        store, then the write hook if due."""
        cdef SlotFile sf = self.sf
        if self.ordered and sf.status[slot] == SLOT_OCCUPIED:
            sf._put(slot, st, row, n, version, False)
            (<object>self.fixed).sync_redo()
            sf.commit()
        else:
            sf._put(slot, st, row, n, version, True)
        if self.hooked:
            self.hook_ran = True
            (<object>self.fixed).after_write(slot)
        elif self.sync_every >= 0:
            if self.batching:
                self.pending = slot  # one clock read for the whole loop (_end_batch)
            elif monotonic_s() - sf.last_sync >= self.sync_every:
                self.hook_ran = True
                (<object>self.fixed).after_write(slot)
        return 0

    cdef int _end_batch(self) except -1:
        """The end of a loop of writes: the timed-sync check they deferred, once."""
        cdef Py_ssize_t slot = self.pending
        self.batching = False
        self.pending = -1
        if slot >= 0 and monotonic_s() - self.sf.last_sync >= self.sync_every:
            self.hook_ran = True
            (<object>self.fixed).after_write(slot)
        return 0

    cdef int _raise_stashed(self) except -1:
        """Raise a sync failure after_write stashed, once the index matches the slots."""
        if self.hook_ran:
            self.hook_ran = False
            if self.fixed.sync_error is not None:
                self.fixed.raise_sync_error()
        return 0

    cdef inline const uint8_t* _row(self, Py_ssize_t slot) noexcept:
        return &self.sf.slots[slot, 8]

    # -- push ---------------------------------------------------------------------
    def push(self, uint64_t due, uint64_t seq, int64_t now, uint64_t payload_id, bytes payload):
        """Write a new ready row into a free slot (growing the file if none is left)
        and index it; returns the slot."""
        return self._push_row(due, seq, now, payload_id, payload)

    cdef Py_ssize_t _push_row(self, uint64_t due, uint64_t seq, int64_t now, uint64_t payload_id,
                              bytes payload) except -1:
        cdef uint8_t row[ROW_HEAD + MAX_PAYLOAD]
        cdef Py_ssize_t n = len(payload), slot
        if n != self.psize:
            raise ValueError(f"payload is {n} bytes, the queue stores {self.psize}")
        self._check()
        slot = self.sf._pop_free()
        if slot < 0:
            (<object>self.fixed).grow()
            slot = self.sf._pop_free()
        push_row(row, due, seq, now, payload_id)
        if n:
            memcpy(row + ROW_HEAD, <const char*>payload, n)
        try:
            self._write(slot, SLOT_OCCUPIED, row, ROW_HEAD + n)   # a free slot: never ordered
        except BaseException:
            if self.sf.status[slot] != SLOT_OCCUPIED:
                self.sf._push_free(slot)
            raise
        raise_status(self.live._insert(due, seq, <uint32_t>slot, 0), due, seq)
        self.pushes += 1
        self._raise_stashed()
        return slot

    # -- lease --------------------------------------------------------------------
    cdef bint _lease_slot(self, uint64_t due, uint64_t seq, Py_ssize_t slot, int64_t now, int64_t deadline,
                          uint32_t max_attempts, uint8_t* row) except -1:
        """Lease (or dead-letter) one due row that is in the index with this slot, leaving
        its new image in ``row``; False when the row's lease had expired after
        ``max_attempts`` deliveries and it went to the dead letters instead."""
        cdef Py_ssize_t n = ROW_HEAD + self.psize
        cdef uint64_t dkey
        cdef int outcome
        memcpy(row, self._row(slot), n)
        outcome = lease_row(row, now, deadline, max_attempts)
        if outcome == T_EXPIRED_DEAD:
            dkey = load_be64(row + AT_DUE)  # the dead key the rule gave the row
            self._write(slot, SLOT_OCCUPIED, row, n)
            self.live._remove(due, seq)
            raise_status(self.dead._insert(dkey, seq, <uint32_t>slot, 0), dkey, seq)
            self.dead_lettered += 1
            self.expired_leases += 1
            return False
        self._write(slot, SLOT_OCCUPIED, row, n)
        self.live._set_deadline(due, seq, deadline)
        if outcome == T_RELEASED:
            self.expired_leases += 1
        return True

    cdef object _claim(self, uint64_t due, uint64_t seq, Py_ssize_t slot, int64_t now, int64_t deadline,
                       uint32_t max_attempts, Py_ssize_t shard_no, object dl):
        """Lease (or dead-letter) one due row that is in the index with this slot.

        Returns the Lease (see :meth:`set_lease_types`; ``dl`` is the deadline as a
        datetime) or else ``(due, seq, shard_no, attempts, epoch, payload)``; or False
        when the row's lease had expired after ``max_attempts`` deliveries and it went
        to the dead letters instead.
        """
        cdef uint8_t row[ROW_HEAD + MAX_PAYLOAD]
        cdef uint32_t attempts, epoch
        if not self._lease_slot(due, seq, slot, now, deadline, max_attempts, row):
            return False
        attempts = <uint32_t>load_le(row + AT_ATTEMPTS, 2)
        epoch = <uint32_t>load_le(row + AT_EPOCH, 4)
        if self.lease_cls is not None:
            token = _tuple5(self.token_cls, self.handle, shard_no, due, seq, epoch)
            return _tuple5(self.lease_cls, seq, self._record(row + ROW_HEAD), attempts, dl, token)
        return (due, seq, shard_no, attempts, epoch, (<char*>row + ROW_HEAD)[:self.psize])

    def claim(self, int64_t now, int64_t deadline, Py_ssize_t n, uint32_t max_attempts, Py_ssize_t shard_no,
              list out, dl=None):
        """Scan and lease up to ``n`` due rows in key order, appending to ``out``
        (see :meth:`_claim`); returns how many rows were dead-lettered instead."""
        cdef Py_ssize_t dead = 0
        if n <= 0 or now < 0:
            return 0
        self._walk(now, deadline, n, max_attempts, shard_no, out, dl, NULL, &dead)
        return dead

    cdef Py_ssize_t _walk(self, int64_t now, int64_t deadline, Py_ssize_t n, uint32_t max_attempts,
                          Py_ssize_t shard_no, list out, object dl, _Sink* sink, Py_ssize_t* dead) except -1:
        """Lease up to ``n`` due rows in key order: into ``out`` (Lease objects or tuples,
        see :meth:`_claim`), or, with a ``sink``, into its arrays at ``sink.at`` on; counts
        the rows dead-lettered instead in ``dead``; returns how many were leased.

        The walk releases the GIL when unexpired leases may have to be skipped.  The
        scan buffer is sized by ``min(n, rows in the index)``: nothing is added to the
        index during the call (the caller holds the lock), so no more can be leased.
        """
        cdef uint64_t stack[SCAN_WORDS * SCAN_STACK]
        cdef uint64_t* buf = stack
        cdef uint8_t row[ROW_HEAD + MAX_PAYLOAD]
        cdef Py_ssize_t got = 0, cnt, k, w
        cdef KeyIndex live = self.live
        cdef object r
        self._check()
        if n > live.n:
            n = live.n
        if n > SCAN_STACK:
            buf = <uint64_t*>malloc_array(n, SCAN_WORDS * sizeof(uint64_t))
        self.batching = True
        try:
            while got < n and live.n:
                live._enter()
                cnt = live._scan_into(now, buf, n, n - got)
                if cnt == 0:
                    break
                for k in range(cnt):
                    if sink == NULL:
                        r = self._claim(buf[k], buf[n + k], (<uint32_t*>(buf + 3 * n))[k], now, deadline,
                                        max_attempts, shard_no, dl)
                        if r is False:
                            dead[0] += 1
                        else:
                            out.append(r)
                            got += 1
                        continue
                    if not self._lease_slot(buf[k], buf[n + k], (<uint32_t*>(buf + 3 * n))[k], now, deadline,
                                            max_attempts, row):
                        dead[0] += 1
                        continue
                    w = sink.at + got
                    sink.dues[w] = buf[k]
                    sink.seqs[w] = buf[n + k]
                    sink.attempts[w] = <uint16_t>load_le(row + AT_ATTEMPTS, 2)
                    sink.epochs[w] = <uint32_t>load_le(row + AT_EPOCH, 4)
                    if self.psize:
                        memcpy(sink.payloads + w * self.psize, row + ROW_HEAD, self.psize)
                    got += 1
        finally:
            self.batching = False
            if buf != stack:
                free(buf)
        self._end_batch()
        self._raise_stashed()
        return got

    def claim_one(self, uint64_t due, uint64_t seq, uint32_t slot, int64_t now, int64_t deadline,
                  uint32_t max_attempts, Py_ssize_t shard_no, dl=None):
        """:meth:`_claim` for a candidate found by an earlier scan (several shards):
        None when the row changed since (another caller took it first)."""
        cdef Py_ssize_t b = 0, pos = 0
        cdef Entry* e
        self.sf._alive()
        self.live._enter()
        e = self.live._find(due, seq, &b, &pos)
        if e == NULL or e.slot != slot or e.deadline > now:
            return None
        self._check()
        r = self._claim(due, seq, slot, now, deadline, max_attempts, shard_no, dl)
        self._raise_stashed()
        return r

    # -- ack ----------------------------------------------------------------------
    cdef int _leased(self, uint64_t due, uint64_t seq, uint32_t epoch, Py_ssize_t* slot) except -1:
        """0 with the row's slot if it still holds the lease ``epoch``, else ABSENT or RELEASED."""
        cdef Py_ssize_t b = 0, pos = 0
        cdef const uint8_t* p
        cdef Entry* e
        self.sf._alive()  # the row is read from the mapped file
        self.live._enter()
        e = self.live._find(due, seq, &b, &pos)
        if e == NULL:
            return _ABSENT
        slot[0] = e.slot
        p = self._row(e.slot)
        if p[AT_STATE] != LEASED or <uint32_t>load_le(p + AT_EPOCH, 4) != epoch:
            return _RELEASED
        return 0

    def ack_token(self, token):
        """:meth:`ack` of a lease token (``token_cls(handle, shard, due, seq, epoch)``,
        see :meth:`set_lease_types`); FOREIGN when it is not one of this handle and
        shard, and then nothing changes."""
        if self.token_cls is None or not isinstance(token, self.token_cls):
            return _FOREIGN
        cdef tuple t = <tuple>token
        if t[0] != self.handle or t[1] != self.fixed.index:
            return _FOREIGN
        cdef uint64_t due, seq
        cdef uint32_t epoch
        try:
            due, seq, epoch = t[2], t[3], t[4]
        except (OverflowError, TypeError):  # fields out of range: never issued by us
            return _FOREIGN
        return self._ack(due, seq, epoch)

    def ack(self, uint64_t due, uint64_t seq, uint32_t epoch):
        """Delete the row if it still holds the lease ``epoch``; returns ACKED, ABSENT
        or RELEASED (nothing changes unless ACKED)."""
        return self._ack(due, seq, epoch)

    def settle_slot(self, uint64_t due, uint64_t seq, uint32_t epoch):
        """For a logged ack (``db.tx()``, and a var queue's own ack): ``(slot, version)``
        of the row keyed ``(due, seq)`` if it still holds the lease ``epoch``,
        ``version`` being the one the logged row gives the freed slot; ``(-1, code)``
        with code ABSENT or RELEASED otherwise.  Changes nothing; :meth:`ack_slot`
        applies, under the same hold of the lock."""
        cdef Py_ssize_t slot = -1
        cdef int r = self._leased(due, seq, epoch, &slot)
        if r:
            return -1, r
        return slot, ring_step(self.sf.versions[slot])

    def ack_slot(self, uint64_t due, uint64_t seq, Py_ssize_t slot, uint32_t version):
        """Apply a logged ack that :meth:`settle_slot` found: free ``slot`` with
        ``version`` and drop its key.  A failed timed sync stays stashed on the shard
        (``FixedShard.raise_sync_error``) for the caller to raise once the whole
        commit is applied."""
        self._free_row(due, seq, slot, version)
        self.hook_ran = False  # a stashed sync error is now the caller's to raise

    cdef int _free_row(self, uint64_t due, uint64_t seq, Py_ssize_t slot, uint32_t version) except -1:
        """Delete an acked row: its slot (``version`` 0: the next), free stack, key, count."""
        self._check()
        self._write(slot, SLOT_DELETED, NULL, 0, version)
        self.sf._push_free(slot)
        self.live._remove(due, seq)
        self.acks += 1
        return 0

    cdef int _ack(self, uint64_t due, uint64_t seq, uint32_t epoch) except -1:
        cdef Py_ssize_t slot = -1
        cdef int r = self._leased(due, seq, epoch, &slot)
        if r:
            return r
        self._free_row(due, seq, slot, 0)
        self._raise_stashed()
        return _ACKED

    # -- batches (Q31, Q32) -------------------------------------------------------
    # A batch is one logged commit (armdb.tx): its plan allocates slots and builds every
    # row image and the log's F rows here, without a Python object per row; once the
    # record is logged, apply_* writes the slots and the index.

    def plan_push_block(self, bytes name_field not None, uint64_t first_seq, Py_ssize_t i0, Py_ssize_t step,
                        Py_ssize_t n, object payloads, uint64_t due, int64_t now, bint var,
                        bytearray log_out not None):
        """Plan the pushes of rows ``i0, i0 + step, ... < n`` of a batch whose row ``i``
        gets id ``first_seq + i`` and, for a fixed queue, the payload bytes
        ``payloads[i * payload_size:][:payload_size]`` (a var row's payload id is its id).

        Takes a free slot for each (growing the file when none is left), appends one
        msgpack F row per push to ``log_out``, and returns ``(slots, versions, images)``
        for :meth:`apply_push_block`; nothing is written to the slots.  The slots go back
        with :meth:`unalloc_block` if the commit does not go ahead.
        """
        cdef Py_ssize_t count = 0 if i0 >= n else (n - 1 - i0) // step + 1
        cdef Py_ssize_t width = ROW_HEAD + self.psize, j, i, taken = 0, slot
        cdef Py_ssize_t name_len = len(name_field)
        cdef const uint8_t* name = <const uint8_t*>(<char*>name_field)
        cdef uint64_t seq
        cdef uint8_t* img
        cdef uint8_t* out
        # A var batch has no inline payload (its payloads are b""): no buffer to take (a
        # typed memoryview argument costs about 1,700 instructions a call).
        cdef const uint8_t[::1] pv = None if var else payloads
        if step < 1 or i0 < 0 or (not var and pv.shape[0] < n * self.psize):
            raise ValueError("plan_push_block: the rows do not match the payload buffer")
        if width >= 65536:
            raise ValueError("plan_push_block: row too long for a logged F row")
        self._check()
        # (PyArray_EMPTY: np.empty's call and keyword parsing cost about 1,400 instructions
        # an array, a typed memoryview of it 1,700 more)
        cdef cnp.npy_intp dims[2]
        dims[0] = count
        dims[1] = width
        slots = cnp.PyArray_EMPTY(1, dims, cnp.NPY_UINT32, 0)
        versions = cnp.PyArray_EMPTY(1, dims, cnp.NPY_UINT32, 0)
        images = cnp.PyArray_EMPTY(2, dims, cnp.NPY_UINT8, 0)
        cdef uint32_t* sl = <uint32_t*>cnp.PyArray_DATA(slots)
        cdef uint32_t* vs = <uint32_t*>cnp.PyArray_DATA(versions)
        cdef uint8_t* im = <uint8_t*>cnp.PyArray_DATA(images)
        cdef SlotFile sf
        try:
            for j in range(count):
                slot = self.sf._pop_free()
                if slot < 0:
                    (<object>self.fixed).grow()
                    slot = self.sf._pop_free()
                sl[j] = <uint32_t>slot
                taken += 1
        except BaseException:
            for j in range(taken - 1, -1, -1):
                self.sf._push_free(sl[j])
            raise
        sf = self.sf  # grow() may have remapped: read its arrays only now
        out = _grow_log(log_out, count * _frow_size(name_len, width))
        for j in range(count):
            i = i0 + j * step
            seq = first_seq + <uint64_t>i
            img = im + j * width
            push_row(img, due, seq, now, seq if var else 0)
            if not var and self.psize:
                memcpy(img + ROW_HEAD, &pv[i * self.psize], self.psize)
            vs[j] = ring_step(sf.versions[sl[j]])
            out = _frow(out, name, name_len, <uint32_t>self.fixed.index, sl[j], vs[j], SLOT_OCCUPIED, img, width)
        return slots, versions, images

    def unalloc_block(self, const uint32_t[::1] slots):
        """Give back the slots of a planned batch whose commit did not go ahead."""
        cdef Py_ssize_t j
        self.sf._alive()
        for j in range(slots.shape[0] - 1, -1, -1):
            self.sf._push_free(slots[j])

    def apply_push_block(self, object slots_a, object versions_a, object images_a):
        """Write the planned rows of :meth:`plan_push_block` (logged) and index them.  A
        failed timed sync stays stashed for the caller (as for :meth:`ack_slot`)."""
        cdef Py_ssize_t j, count, nv, nrows, width
        cdef const uint32_t* slots
        cdef const uint32_t* versions
        cdef const uint8_t* images
        array_data(slots_a, 4, False, <char**>&slots, &count)
        array_data(versions_a, 4, False, <char**>&versions, &nv)
        rows_data(images_a, <char**>&images, &nrows, &width)
        if nv != count or nrows != count:
            raise ValueError("apply_push_block: arrays of different lengths")
        cdef const uint8_t* img
        cdef uint64_t due, seq
        self._check()
        self.batching = True
        try:
            for j in range(count):
                img = images + j * width
                self._write(slots[j], SLOT_OCCUPIED, img, width, versions[j])
                due = load_be64(img + AT_DUE)
                seq = load_be64(img + AT_SEQ)
                raise_status(self.live._insert(due, seq, slots[j], 0), due, seq)
                self.pushes += 1
        finally:
            self.batching = False
        self._end_batch()
        self.hook_ran = False

    def plan_ack_block(self, bytes name_field not None, object dues_a, object seqs_a, object epochs_a,
                       bytearray log_out not None):
        """Plan acks of the leases ``(dues[j], seqs[j], epochs[j])`` of this shard:
        ``(slots, versions, -1, 0)`` with one msgpack F row per ack appended to ``log_out``,
        or ``(None, None, j, code)`` for the first lease ``j`` that is no longer held (code
        ABSENT or RELEASED) or that an earlier ``j`` already named (DUPLICATE), and then
        nothing changed and ``log_out`` is left as it was."""
        cdef Py_ssize_t j, k, count, name_len = len(name_field)
        cdef Py_ssize_t b = 0, pos = 0
        cdef int r = 0
        cdef const uint8_t* name = <const uint8_t*>(<char*>name_field)
        cdef const uint8_t* p
        cdef uint8_t* out
        cdef Entry* e
        cdef Entry** found
        cdef const uint64_t* dues
        cdef const uint64_t* seqs
        cdef const uint32_t* epochs
        cdef Py_ssize_t nd, ne
        array_data(dues_a, 8, False, <char**>&dues, &nd)
        array_data(seqs_a, 8, False, <char**>&seqs, &count)
        array_data(epochs_a, 4, False, <char**>&epochs, &ne)
        if nd != count or ne != count:
            raise ValueError("plan_ack_block: arrays of different lengths")
        cdef cnp.npy_intp dim = count
        # (PyArray_EMPTY: np.empty's call, its keyword parsing and module lookups cost
        # about 1,400 instructions an array)
        cdef cnp.ndarray slots = cnp.PyArray_EMPTY(1, &dim, cnp.NPY_UINT32, 0)
        cdef cnp.ndarray versions = cnp.PyArray_EMPTY(1, &dim, cnp.NPY_UINT32, 0)
        cdef uint32_t* sl = <uint32_t*>cnp.PyArray_DATA(slots)
        cdef uint32_t* vs = <uint32_t*>cnp.PyArray_DATA(versions)
        self.sf._alive()  # the rows are read from the mapped file
        self.live._enter()
        found = <Entry**>malloc_array(count + 1, sizeof(Entry*))
        # Each row found is marked (its index deadline d becomes -d - 1, never negative
        # otherwise) so that a lease given twice is seen; every mark is undone (the same
        # map again) before returning.
        for j in range(count):
            e = self.live._find(dues[j], seqs[j], &b, &pos)
            if e == NULL:
                r = _ABSENT
            elif e.deadline < 0:
                r = _DUPLICATE
            else:
                p = self._row(e.slot)
                if p[AT_STATE] != LEASED or <uint32_t>load_le(p + AT_EPOCH, 4) != epochs[j]:
                    r = _RELEASED
            if r:
                for k in range(j):
                    found[k].deadline = -found[k].deadline - 1
                free(found)
                return None, None, j, r
            found[j] = e
            e.deadline = -e.deadline - 1
            sl[j] = e.slot
            vs[j] = ring_step(self.sf.versions[e.slot])
        for j in range(count):
            found[j].deadline = -found[j].deadline - 1
        free(found)
        out = _grow_log(log_out, count * _frow_size(name_len, 0))
        for j in range(count):
            out = _frow(out, name, name_len, <uint32_t>self.fixed.index, sl[j], vs[j], SLOT_DELETED, NULL, 0)
        return slots, versions, -1, 0

    def apply_ack_block(self, object dues_a, object seqs_a, object slots_a, object versions_a):
        """Apply the logged acks :meth:`plan_ack_block` planned (see :meth:`ack_slot`): the
        slots first, then their keys leave the index in one pass (``KeyIndex._remove_keys``),
        also when a write fails midway (for the rows written)."""
        cdef Py_ssize_t j, done = 0, count, nd, nq, nv
        cdef int64_t one
        cdef int64_t* gone
        cdef const uint64_t* dues
        cdef const uint64_t* seqs
        cdef const uint32_t* slots
        cdef const uint32_t* versions
        array_data(dues_a, 8, False, <char**>&dues, &nd)
        array_data(seqs_a, 8, False, <char**>&seqs, &nq)
        array_data(slots_a, 4, False, <char**>&slots, &count)
        array_data(versions_a, 4, False, <char**>&versions, &nv)
        if nd != count or nq != count or nv != count:
            raise ValueError("apply_ack_block: arrays of different lengths")
        if count == 0:
            return
        self._check()
        gone = <int64_t*>malloc_array(count, sizeof(int64_t))
        self.batching = True
        try:
            for j in range(count):
                self._write(slots[j], SLOT_DELETED, NULL, 0, versions[j])
                self.sf._push_free(slots[j])
                done += 1
        finally:
            self.batching = False
            if done:
                self.live._remove_keys(&dues[0], &seqs[0], done, gone)
                self.acks += done
            free(gone)
        self._end_batch()
        self.hook_ran = False

    def claim_block(self, int64_t now, int64_t deadline, Py_ssize_t n, uint32_t max_attempts,
                    object dues_a, object seqs_a, object attempts_a, object epochs_a, object payloads_a,
                    Py_ssize_t at):
        """:meth:`claim` into arrays: lease up to ``n`` due rows in key order, writing the
        j-th lease at index ``at + j`` of ``dues``, ``seqs``, ``attempts``, ``epochs``
        and (its inline payload) of ``payloads`` (``payload_size`` bytes a row).
        Returns ``(leased, dead_lettered)``; no Python object is made per row."""
        cdef _Sink sink
        cdef Py_ssize_t dead = 0, got, nd, nq, na, ne, npl
        array_data(dues_a, 8, True, <char**>&sink.dues, &nd)
        array_data(seqs_a, 8, True, <char**>&sink.seqs, &nq)
        array_data(attempts_a, 2, True, <char**>&sink.attempts, &na)
        array_data(epochs_a, 4, True, <char**>&sink.epochs, &ne)
        array_data(payloads_a, 1, True, <char**>&sink.payloads, &npl)
        if n <= 0 or now < 0:
            return 0, 0
        if at < 0 or at + n > nq or nd < at + n or na < at + n or ne < at + n or npl < (at + n) * self.psize:
            raise ValueError("claim_block: the output arrays are too short")
        if not npl:
            sink.payloads = NULL
        sink.at = at
        got = self._walk(now, deadline, n, max_attempts, 0, None, None, &sink, &dead)
        return got, dead

    def claim_new(self, int64_t now, int64_t deadline, Py_ssize_t n, uint32_t max_attempts):
        """:meth:`claim_block` of a shard with no inline payload (a var queue's), into
        arrays made here, one entry per lease taken: ``(dead_lettered, shard_nos, dues,
        seqs, attempts, epochs)``, ``shard_nos`` all 0 (a queue of one shard).  A var
        ``lease_batch`` made the five arrays by five NumPy calls, then cut them to the
        leases taken by five more when fewer were due."""
        return self._claim_new(now, deadline, n, max_attempts)

    cdef tuple _claim_new(self, int64_t now, int64_t deadline, Py_ssize_t n, uint32_t max_attempts):
        """:meth:`claim_new` (also called by ``VarFast.lease_batch``, under the shard's lock)."""
        cdef _Sink sink
        cdef Py_ssize_t dead = 0, got = 0
        cdef cnp.npy_intp dim = n if n > 0 else 0
        if self.psize:
            raise ValueError("claim_new: a shard with inline payloads leases by claim_block")
        dues = cnp.PyArray_EMPTY(1, &dim, cnp.NPY_UINT64, 0)
        seqs = cnp.PyArray_EMPTY(1, &dim, cnp.NPY_UINT64, 0)
        attempts = cnp.PyArray_EMPTY(1, &dim, cnp.NPY_UINT16, 0)
        epochs = cnp.PyArray_EMPTY(1, &dim, cnp.NPY_UINT32, 0)
        sink.dues = <uint64_t*>cnp.PyArray_DATA(dues)
        sink.seqs = <uint64_t*>cnp.PyArray_DATA(seqs)
        sink.attempts = <uint16_t*>cnp.PyArray_DATA(attempts)
        sink.epochs = <uint32_t*>cnp.PyArray_DATA(epochs)
        sink.payloads = NULL
        sink.at = 0
        if n > 0 and now >= 0:
            got = self._walk(now, deadline, n, max_attempts, 0, None, None, &sink, &dead)
        if got < dim:
            dues, seqs, attempts, epochs = dues[:got].copy(), seqs[:got].copy(), attempts[:got].copy(), epochs[:got].copy()
            dim = got
        shard_nos = cnp.PyArray_ZEROS(1, &dim, cnp.NPY_UINT32, 0)
        return dead, shard_nos, dues, seqs, attempts, epochs


cdef class FixedFast:  # (not final: VarFast extends it)
    """A fixed queue's ``push``, ``lease`` and ``ack`` in one compiled call each
    (armdb.queue.Queue hands them here): the same steps as the Python bodies of those
    methods (``Queue._push``, ``Queue._lease``, ``Queue._ack``), for the common
    arguments, with no Python frame of their own and no object made per call but the
    results.  Anything else (a closed queue, a custom clock's refusals, ``max_depth``, a
    payload the plain struct cannot pack, a lease of several shards, a stale token) goes
    to those Python bodies, which judge it and raise what they raise, so each rule keeps
    one place: the queue rules are in qrow.pxd (through QueueShard), the checks in
    armdb.queue.

    ``plain`` is the codec's struct when ``struct.pack(*value)`` of a plain tuple of
    ``nfields`` is exactly its encoding (``FixedCodec.plain_struct``), else None.
    """

    cdef object queue, db, clock, to_datetime, gens, seq_name, rest, next_id, encode, plain, pack, lease_timeouts
    cdef dict qd, dbd                # the instance dicts of the queue and its Db (plain attributes)
    cdef list locks                  # each shard's lock (armdb._core.locks.Lock: taken without a method call)
    cdef object lease_cls, token_cls, handle, dl, sweep, note_dead, push_py, lease_py, ack_py
    cdef list shards
    cdef Py_ssize_t nsh, nfields, max_lease
    cdef bint sysclock
    cdef int64_t lease_ms, dl_ms
    cdef uint64_t max_due
    cdef uint32_t max_attempts

    def __init__(self, queue, db, list shards, bint sysclock, clock, to_datetime, seqmap, seq_name, encode, plain,
                 Py_ssize_t nfields, int64_t lease_ms, uint32_t max_attempts, Py_ssize_t max_lease, uint64_t max_due,
                 bint push_ok, dict lease_timeouts, gens, lease_cls, token_cls, handle):
        for sh in shards:
            if not isinstance(sh, QueueShard):
                raise TypeError("FixedFast needs QueueShard shards")
        self.queue = queue
        self.db = db
        # The attributes read and written on every call (Queue._closed, _next_retention,
        # _gen, _nwaiters; Db._closed, _waker) are plain instance attributes: read from
        # the instance dicts, without the attribute protocol's type walk.  Both classes
        # install those dicts in their __init__ (armdb._objdict: asked for here first,
        # a dict would be made as a split table, which slows their Python).
        self.qd = queue.__dict__
        self.dbd = db.__dict__
        for name in ("_closed", "_next_retention", "_gen", "_nwaiters"):
            if name not in self.qd:
                raise TypeError(f"FixedFast: the queue has no instance attribute {name}")
        for name in ("_closed", "_waker"):
            if name not in self.dbd:
                raise TypeError(f"FixedFast: the Db has no instance attribute {name}")
        self.locks = [sh.lock for sh in shards]
        for lock in self.locks:
            if type(lock) is not Lock:
                raise TypeError("FixedFast needs shards whose lock is an armdb._core.locks.Lock")
        self.shards = shards
        self.nsh = len(shards)
        self.sysclock = sysclock
        self.clock = clock
        self.to_datetime = to_datetime
        self.rest = seqmap._rest    # the rest of each name's reserved block (armdb.seqmap.SeqMap.next)
        self.next_id = seqmap.next
        self.seq_name = seq_name
        self.encode = encode
        self.plain = plain
        self.pack = plain.pack if plain is not None else None
        self.nfields = nfields
        self.lease_ms = lease_ms
        self.max_attempts = max_attempts
        self.max_lease = max_lease
        self.max_due = max_due if push_ok else 0  # max_depth set: every push takes the Python body
        self.lease_timeouts = lease_timeouts
        self.gens = gens
        self.lease_cls = lease_cls
        self.token_cls = token_cls
        self.handle = handle
        self.dl_ms = -1
        self.sweep = queue._sweep
        self.note_dead = queue._note_dead
        self.push_py = queue._push
        self.lease_py = queue._lease
        self.ack_py = queue._ack

    cdef int64_t _now(self) except? -1:
        """``Queue._check`` for an open queue: the clock, and the retention pass when due;
        -1 when the queue or its Db is closed (the Python body raises DbClosed)."""
        cdef int64_t now, due
        cdef PyObject* a = PyDict_GetItemWithError(self.qd, "_closed")
        cdef PyObject* b = PyDict_GetItemWithError(self.dbd, "_closed")
        if a == NULL or b == NULL or <object>a or <object>b:
            return -1
        now = _wall_ms() if self.sysclock else self.clock()
        a = PyDict_GetItemWithError(self.qd, "_next_retention")
        if a == NULL:
            return -1
        due = <object>a
        if now >= due:
            self.sweep(raise_errors=False, now=now)
        return now

    cdef object _draw_seq(self):
        """The pushed row's id: from the reserved block's rest (no lock), else the id
        source's ``next`` (which reserves on disk as needed)."""
        cdef PyObject* p = PyDict_GetItemWithError(self.rest, self.seq_name)
        seq = next(<object>p, None) if p != NULL else None
        if seq is None:
            seq = self.next_id(self.seq_name)
        return seq

    cdef int _insert(self, object seq, int64_t now, uint64_t payload_id, bytes inline) except -1:
        """A push's ready row ``seq``, due ``now``, into its shard under the shard's lock,
        then the waiters woken (the end of both pushes, fixed and var)."""
        cdef Py_ssize_t k = 0 if self.nsh == 1 else seq % self.nsh
        take(<Lock>self.locks[k])
        try:
            (<QueueShard>self.shards[k])._push_row(now, seq, now, payload_id, inline)
        finally:
            give(<Lock>self.locks[k])
        self._notify()
        return 0

    cdef int _notify(self) except -1:
        """``Queue._notify``: a new generation first, then the waiters, if any (the
        Python method, which bumps the generation again: harmless, any change wakes)."""
        cdef PyObject* p
        PyDict_SetItem(self.qd, "_gen", next(self.gens))
        p = PyDict_GetItemWithError(self.qd, "_nwaiters")
        if p == NULL or <object>p:
            self.queue._notify()
            return 0
        p = PyDict_GetItemWithError(self.dbd, "_waker")
        if p != NULL and <object>p is not None and (<object>p)._waiters:
            self.queue._notify()
        return 0

    cdef int _deadline_dt(self, int64_t deadline) except -1:
        """Make ``self.dl`` the datetime of ``deadline`` (ms): one per millisecond of deadlines."""
        cdef int64_t step
        if deadline != self.dl_ms:
            step = deadline - self.dl_ms
            if self.dl_ms >= 0 and -86_400_000 < step < 86_400_000:
                # The last deadline plus the step: integer microseconds, so the same
                # datetime as to_datetime (armdb._clock.ms_to_datetime, exact to the
                # microsecond for any deadline before the year 2200), at a fraction of
                # its cost.
                self.dl = self.dl + timedelta_new(0, <int>(step // 1000), <int>(step % 1000) * 1000)
            else:
                self.dl = self.to_datetime(deadline)
            self.dl_ms = deadline
        return 0

    def push(self, payload, *, delay=None):
        """Insert a ready row due at ``now + delay``; return its id (``Queue.push``, whose
        documentation says what it raises: a delay, or anything but the common case,
        goes to its Python body ``Queue._push``)."""
        cdef int64_t now
        cdef bytes body
        cdef object seq, it
        if delay is not None:
            return self.push_py(payload, delay)
        now = self._now()
        if now < 0 or <uint64_t>now >= self.max_due:
            return self.push_py(payload, None)
        if self.plain is not None and type(payload) is tuple and len(<tuple>payload) == self.nfields:
            try:
                body = self.pack(*payload)
            except Exception:  # out of range, or a field of another type: the codec says why
                body = self.encode(payload)
        else:
            body = self.encode(payload)
        seq = self._draw_seq()
        self._insert(seq, now, 0, body)
        return seq

    def lease(self, n=1, *, lease_timeout=None):
        """Lease up to ``n`` due rows in key order; a list of ``Lease`` (``Queue.lease``,
        whose documentation says what it raises: a lease timeout, or anything but the
        common case, goes to its Python body ``Queue._lease``)."""
        cdef int64_t now, deadline
        cdef Py_ssize_t k, dead = 0
        cdef QueueShard sh
        cdef list out
        if lease_timeout is not None:
            return self.lease_py(n, lease_timeout)
        if self.nsh != 1 or type(n) is not int or not 1 <= n <= self.max_lease:  # Python ints: no overflow
            return self.lease_py(n, None)
        k = n
        now = self._now()
        if now < 0:
            return self.lease_py(n, None)
        deadline = now + self.lease_ms
        self._deadline_dt(deadline)
        out = []
        sh = <QueueShard>self.shards[0]
        take(<Lock>self.locks[0])
        try:
            sh._walk(now, deadline, k, self.max_attempts, 0, out, self.dl, NULL, &dead)
        finally:
            give(<Lock>self.locks[0])
        if dead:
            self.note_dead(now)
        return out

    def ack(self, token):
        """Remove a leased row: ``token`` is a ``Lease`` or a ``LeaseToken`` of this
        handle (``Queue.ack``, whose documentation says what it raises: a stale or foreign
        token, or anything but the common case, goes to its Python body ``Queue._ack``)."""
        cdef object t, f
        cdef int64_t now
        cdef int r
        cdef QueueShard sh
        cdef uint64_t due, seq
        cdef uint32_t epoch
        cdef Py_ssize_t k
        # The token's fields read as the tuple items they are (the classes are NamedTuples
        # of five, checked exactly): no __getitem__ through the class per field.
        if type(token) is self.token_cls:
            t = token
        elif type(token) is self.lease_cls and PyTuple_GET_SIZE(token) == 5:
            t = <object>PyTuple_GET_ITEM(token, 4)
            if type(t) is not self.token_cls:
                return self.ack_py(token)
        else:
            return self.ack_py(token)
        if PyTuple_GET_SIZE(t) != 5:
            return self.ack_py(token)
        if self.lease_timeouts:
            (<dict>self.lease_timeouts).pop((<object>PyTuple_GET_ITEM(t, 3), <object>PyTuple_GET_ITEM(t, 4)), None)
        f = <object>PyTuple_GET_ITEM(t, 1)
        # Every field an exact int (a float would convert to a C integer by truncation:
        # an altered token must go to the Python body, which refuses it).
        if (type(f) is not int or type(<object>PyTuple_GET_ITEM(t, 2)) is not int
                or type(<object>PyTuple_GET_ITEM(t, 3)) is not int or type(<object>PyTuple_GET_ITEM(t, 4)) is not int
                or <object>PyTuple_GET_ITEM(t, 0) != self.handle):
            return self.ack_py(token)
        try:
            k = f
            due = <object>PyTuple_GET_ITEM(t, 2)
            seq = <object>PyTuple_GET_ITEM(t, 3)
            epoch = <object>PyTuple_GET_ITEM(t, 4)
        except (OverflowError, TypeError):
            return self.ack_py(token)
        if k < 0 or k >= self.nsh:
            return self.ack_py(token)
        now = self._now()
        if now < 0:
            return self.ack_py(token)
        sh = <QueueShard>self.shards[k]
        take(<Lock>self.locks[k])
        try:
            r = sh._ack(due, seq, epoch)
        finally:
            give(<Lock>self.locks[k])
        if r != _ACKED:
            return self.ack_py(token)  # stale: the Python body says why (nothing changed)
        return None


@cython.final
cdef class VarFast(FixedFast):
    """A var queue's ``push`` and ``lease`` in one compiled call each (armdb.queue.Queue
    hands them here, as a fixed queue's to :class:`FixedFast`, whose checks, clock,
    retention pass, id draw, deadline and notification they share): the same steps as
    ``Queue._push`` and ``Queue._lease`` for the common arguments.  A push writes its
    body first (``BitcaskStore.put``), counts and caches it (``Queue._put_body``'s steps,
    under the cache's lock), fires ``queue.var_push.after_body``, then writes the header
    slot: the order of writes on disk is the Python body's.  ``lease(1)`` of one header
    shard at the queue's timeout takes its body out of the cache; a body not cached, or
    that does not decode, goes through ``Queue._read_payloads`` (which dead-letters a
    poisoned one).  Anything else goes to the Python bodies, which raise what the
    methods document.  The ack hands the common token to ``armdb.tx.commit_settle``.
    """

    cdef object store_put, decode, read_payloads, fail, gone, settle
    cdef Lock cache_lock
    cdef dict faild  # the armdb._fail module's dict: its ``point``, read at each call
    cdef PutKernel putter
    cdef dict cache
    # The lone ack's commit (set_ack): the body store and its instance dict, each header
    # shard's two locks in the global order, the packed starts of the ack's log rows and
    # armdb.tx._fence_after_log.  ack_first None: every ack goes to ``settle``.
    cdef object payload, fence, rows
    # The codec's plain case (set_plain): a payload of exactly ``plain_type`` packs by
    # the compiled plain codec, and with ``decodes_as_is`` a plain body is the payload.
    cdef object plain_type
    cdef bint decodes_as_is
    cdef dict pd
    cdef list ack_first, ack_second
    cdef bytes fhead, bhead
    # The lone ack's log append and its end (_log_append, _log_done): the Db's TxLog and
    # its instance dict (re-read when the Db's ``txlog`` is another object), armdb._fs's
    # dict (a test's file system is read at each call), the record framer and constants.
    cdef object tlog, frame_record
    cdef dict td, fsd
    cdef uint32_t rec_magic, synced_flag
    # lease_batch (set_batch): the LeaseBatch class, the queue's name, the Python
    # ``Queue.lease_batch`` and ``Queue._lease_batch_var`` and the codec's ``decode_many``.
    # batch_cls None: every lease_batch goes to the Python method.
    cdef object batch_cls, qname, lease_batch_py, lease_batch_var, decode_many
    # ack_many (set_ack_many): the Python ``Queue.ack_many`` and the commit it hands a
    # batch to (armdb.tx.commit_ack_many).
    cdef object ack_many_py, commit_ack_many

    def set_var(self, store_put, PutKernel putter, dict cache, Lock cache_lock not None, decode,
                read_payloads, fail, gone, settle):
        """The var queue's parts: its body store's ``put`` and, when that store has one
        shard and is not encrypted, its compiled put (``BitcaskStore._putter``, called
        without the Python frame of ``put``), its body cache (the dict and its lock), the
        codec's ``decode``, ``Queue._read_payloads``, the
        ``armdb._fail`` module (its ``point`` is looked up at each call, as the Python
        callers do), the ``_GONE`` marker and the ack's commit (``armdb.tx.commit_settle``)."""
        for name in ("_cache_bytes", "_cache_budget", "_pushed_bodies"):
            if name not in self.qd:
                raise TypeError(f"VarFast: the queue has no instance attribute {name}")
        self.store_put = store_put
        self.putter = putter
        self.cache = cache
        self.cache_lock = cache_lock
        self.decode = decode
        self.read_payloads = read_payloads
        self.fail = fail
        self.faild = vars(fail)
        self.gone = gone
        self.settle = settle

    def set_plain(self, plain_type, bint decodes_as_is):
        """The codec's common case (``VarCodec._plain_type``, ``VarCodec._decodes_as_is``),
        which push and ``lease(1)`` run here without the Python frames of the codec's
        ``encode`` and ``decode``: the same compiled codec those call first
        (``armdb._core.plainpack``); anything it does not take goes to them."""
        self.plain_type = plain_type
        self.decodes_as_is = decodes_as_is

    def set_batch(self, batch_cls, qname, lease_batch_py, lease_batch_var, decode_many):
        """:meth:`lease_batch`'s parts: ``armdb.queue.LeaseBatch``, the queue's name, the
        Python ``Queue.lease_batch`` (bound before this method shadows it) and
        ``Queue._lease_batch_var``, and the codec's ``decode_many``."""
        self.batch_cls = batch_cls
        self.qname = qname
        self.lease_batch_py = lease_batch_py
        self.lease_batch_var = lease_batch_var
        self.decode_many = decode_many

    def lease_batch(self, n=1, *, lease_timeout=None, ack=None):
        """``Queue.lease_batch`` (whose documentation says what it raises) in one compiled
        call for the common batch: no ``ack``, the queue's lease timeout, one header shard,
        a payload type whose plain body is the payload.  The claim under the shard's lock
        (``QueueShard.claim_new``), then, when every claimed row's body is cached, the
        bodies taken out of the cache under its lock (``bodycache.cache_pop``, the byte
        count with them) and decoded together (``plainpack.unpack_plain``, else the codec's
        ``decode_many``): the steps of ``Queue._lease_batch`` and ``Queue._batch_bodies``,
        without their Python frames.  Any other batch (one row, none, a body not cached or
        not decoded) goes to ``Queue._lease_batch_var`` with the claimed arrays, and any
        other call to the Python method, which judge it."""
        cdef int64_t now, deadline
        cdef QueueShard sh
        cdef tuple got
        cdef object popped = None
        if ack is not None or lease_timeout is not None or self.batch_cls is None or self.nsh != 1 \
                or type(n) is not int or not 1 <= n <= self.max_lease or not self.decodes_as_is:
            return self.lease_batch_py(n, lease_timeout=lease_timeout, ack=ack)
        now = self._now()
        if now < 0:
            return self.lease_batch_py(n)  # closed: DbClosed
        deadline = now + self.lease_ms
        self._deadline_dt(deadline)
        last = (deadline, self.dl)
        sh = <QueueShard>self.shards[0]
        take(<Lock>self.locks[0])
        try:
            got = sh._claim_new(now, deadline, n, self.max_attempts)
        finally:
            give(<Lock>self.locks[0])
        dead, shard_nos, dues, seqs, attempts, epochs = got
        if dead:
            self.note_dead(now)
        if len(seqs) > 1 and PyDict_GET_SIZE(self.cache):
            # Queue._batch_bodies's common batch: the bodies leave the cache as they are
            # taken (its ack_many has none to drop).
            take(self.cache_lock)
            try:
                popped = cache_pop(self.cache, seqs)
                if popped is not None:
                    PyDict_SetItem(self.qd, "_cache_bytes",
                                   <object>PyDict_GetItemWithError(self.qd, "_cache_bytes") - (<tuple>popped)[1])
            finally:
                give(self.cache_lock)
            if popped is not None:
                bodies = (<tuple>popped)[0]
                payloads = unpack_plain(bodies)  # VarCodec.decode_many's first step
                if payloads is None:
                    payloads = self.decode_many(bodies)
                if payloads is not None:
                    batch = self.batch_cls(self.qname, self.handle, shard_nos, dues, seqs, attempts, epochs, last,
                                           payloads)
                    batch._cached = False
                    return batch
        return self.lease_batch_var(shard_nos, dues, seqs, attempts, epochs, self.lease_ms, last, None)

    def set_ack_many(self, ack_many_py, commit_ack_many):
        """:meth:`ack_many`'s parts: the Python ``Queue.ack_many`` (bound before this
        method shadows it) and ``armdb.tx.commit_ack_many``."""
        self.ack_many_py = ack_many_py
        self.commit_ack_many = commit_ack_many

    def ack_many(self, leases):
        """``Queue.ack_many`` (whose documentation says what it raises) without its Python
        frame for the common call: a ``LeaseBatch`` of this handle of two leases or more,
        none leased with its own timeout, handed to its commit (``commit_ack_many``, which
        checks every lease under the locks) once the queue's checks passed (open; the
        retention pass when due).  Anything else goes to the Python method, which judges it."""
        if type(leases) is not self.batch_cls or self.lease_timeouts:
            return self.ack_many_py(leases)
        b = leases
        if b._handle != self.handle:
            return self.ack_many_py(leases)  # StaleToken: the method says why
        seqs = b.ids
        if len(seqs) < 2:
            return self.ack_many_py(leases)  # none, or the lone ack
        if self._now() < 0:
            return self.ack_many_py(leases)  # closed: DbClosed
        return self.commit_ack_many(self.db, self.queue, b._shards, b._dues, seqs, b._epochs, b._cached)

    def set_ack(self, payload, list pairs not None, bytes fhead not None, bytes bhead not None, fence, rows,
                frame_record, dict fs_module not None, uint32_t rec_magic, uint32_t synced_flag):
        """The lone ack's commit in this call (:meth:`_commit_ack`), for a body store of
        one shard that is not encrypted: the store, each header shard's two locks in the
        global order (``Queue._ack_locks``, both ``armdb._core.locks.Lock``), the packed
        starts of the ack's two log rows (``Queue._ack_heads``), the shared failure
        handling after a log append (``armdb.tx._fence_after_log``) and the record body's
        encoder (``armdb._core.fixed.ack_rows``); for the log append (:meth:`_log_append`),
        the record's framer (``armdb._core.fixed.log_record``), ``armdb._fs``'s dict and
        the log's ``REC_MAGIC`` and ``FLAG_SYNCED_BEFORE`` (``armdb.logformat``)."""
        pd = payload.__dict__  # (installed by BitcaskStore.__init__, as the Db's above)
        for name in ("_poisoned", "_closed", "_gsn", "_compact_deferred"):
            if name not in pd:
                raise TypeError(f"VarFast: the body store has no instance attribute {name}")
        for name in ("txlog", "tx_config"):
            if name not in self.dbd:
                raise TypeError(f"VarFast: the Db has no instance attribute {name}")
        if len(pairs) != self.nsh:
            raise ValueError("VarFast: one lock pair per header shard")
        first = []
        second = []
        for a, b in pairs:
            if type(a) is not Lock or type(b) is not Lock:
                raise TypeError("VarFast needs ack locks that are armdb._core.locks.Lock")
            first.append(a)
            second.append(b)
        self.fsd = fs_module
        self.frame_record = frame_record
        self.rec_magic = rec_magic
        self.synced_flag = synced_flag
        self.tlog = None
        self.td = None
        self.payload = payload
        self.pd = pd
        self.fhead = fhead
        self.bhead = bhead
        self.fence = fence
        self.rows = rows
        self.ack_first = first
        self.ack_second = second

    cdef dict _log_dict(self, object txlog):
        """The instance dict of the Db's log, or None when its ``append_body`` or ``done``
        is set on the instance (a test's): the ack then calls them."""
        if txlog is not self.tlog:
            td = vars(txlog)  # (installed by TxLog.__init__, as the Db's: see FixedFast)
            for name in ("_lock", "_idle", "_idle_waiting", "_fd", "poisoned", "_group", "sealer", "_next_txid",
                         "_end", "_inflight", "commits", "_checkpoint_bytes", "pending"):
                if name not in td:
                    raise TypeError(f"VarFast: the log has no instance attribute {name}")
            if type(td["_lock"]) is not Lock:
                raise TypeError("VarFast needs a log whose lock is an armdb._core.locks.Lock")
            self.td = td
            self.tlog = txlog
        if PyDict_GetItemWithError(self.td, "append_body") != NULL or PyDict_GetItemWithError(self.td, "done") != NULL:
            return None
        return self.td

    cdef object _log_append(self, object txlog, dict td, bytes body):
        """``TxLog.append_body(body)`` of a record body packed whole, without its frame: in
        the common case (an unsealed log that is open, not poisoned, with no checkpoint
        waiting) the same record (``log_record``: the flag when everything before it was
        synced) written by the file system's ``pwrite`` at the log's end, under the log's
        lock, then its counters, the group sync told, and the failpoint
        ``txlog.after_append`` once the lock is released.  A failed write goes through
        ``TxLog._append_failed``, as the method's does.  Any other case, and a log whose
        methods a test set on the instance (``td`` None: see :meth:`_log_dict`), calls
        the method, which judges it."""
        if td is None:
            return txlog.append_body(body)
        cdef Lock lock = <Lock>PyDict_GetItemWithError(td, "_lock")
        cdef bint common = False
        take(lock)
        try:
            group = <object>PyDict_GetItemWithError(td, "_group")
            fd = <object>PyDict_GetItemWithError(td, "_fd")
            if not <object>PyDict_GetItemWithError(td, "_idle_waiting") and fd >= 0 and \
                    <object>PyDict_GetItemWithError(td, "poisoned") is None and \
                    <object>PyDict_GetItemWithError(td, "sealer") is None and not group.err:
                common = True
                txid = <object>PyDict_GetItemWithError(td, "_next_txid")
                end = <object>PyDict_GetItemWithError(td, "_end")
                # The flag says that everything before this record was synced (append_body).
                raw = self.frame_record(self.rec_magic, self.synced_flag if end == group.synced else 0, txid, body)
                try:
                    (<object>PyDict_GetItemWithError(self.fsd, "FS")).pwrite(fd, raw, end)
                except OSError as e:
                    raise txlog._append_failed(end, e) from e
                PyDict_SetItem(td, "_next_txid", txid + 1)
                end += len(<bytes>raw)
                PyDict_SetItem(td, "_end", end)
                group.wrote(end)
                PyDict_SetItem(td, "_inflight", <object>PyDict_GetItemWithError(td, "_inflight") + 1)
                PyDict_SetItem(td, "commits", <object>PyDict_GetItemWithError(td, "commits") + 1)
        finally:
            give(lock)
        if not common:
            return txlog.append_body(body)  # (nothing written: the method waits or raises)
        (<object>PyDict_GetItemWithError(self.faild, "point"))("txlog.after_append")
        return end

    cdef bint _log_done(self, object txlog, dict td) except -1:
        """``TxLog.done()`` without its frame (see :meth:`_log_append`): one commit fewer
        in flight, a waiting checkpoint woken when none is left; whether the log is due a
        checkpoint."""
        if td is None:
            return txlog.done()
        cdef Lock lock = <Lock>PyDict_GetItemWithError(td, "_lock")
        take(lock)
        try:
            inflight = <object>PyDict_GetItemWithError(td, "_inflight") - 1
            PyDict_SetItem(td, "_inflight", inflight)
            if <object>PyDict_GetItemWithError(td, "_idle_waiting") and inflight == 0:
                (<object>PyDict_GetItemWithError(td, "_idle")).notify_all()
            return <object>PyDict_GetItemWithError(td, "_end") > <object>PyDict_GetItemWithError(td, "_checkpoint_bytes") \
                and not <object>PyDict_GetItemWithError(td, "pending")
        finally:
            give(lock)

    cdef int _put_body(self, object seq, uint64_t id_, bytes body) except -1:
        """``Queue._put_body``: the body written first, then counted and cached under the
        cache's lock if it fits in the room left (the byte count is read and written only
        under it; a full cache keeps the oldest bodies, which are leased first)."""
        cdef bytes key = PyBytes_FromStringAndSize(NULL, 8)
        store_be64(<uint8_t*>PyBytes_AS_STRING(key), id_)  # qrows.body_key
        if self.putter is not None:
            self.putter.put(0, key, body)  # BitcaskStore.put of a store of one shard
        else:
            self.store_put(key, body)
        cdef Py_ssize_t n = len(body)
        cdef object size
        take(self.cache_lock)
        try:
            PyDict_SetItem(self.qd, "_pushed_bodies", <object>PyDict_GetItemWithError(self.qd, "_pushed_bodies") + 1)
            size = <object>PyDict_GetItemWithError(self.qd, "_cache_bytes") + n
            if size <= <object>PyDict_GetItemWithError(self.qd, "_cache_budget"):
                self.cache[seq] = body
                PyDict_SetItem(self.qd, "_cache_bytes", size)
        finally:
            give(self.cache_lock)
        (<object>PyDict_GetItemWithError(self.faild, "point"))("queue.var_push.after_body")
        return 0

    def push(self, payload, *, delay=None):
        """Insert a ready row due at ``now + delay``; return its id (``Queue.push``, whose
        documentation says what it raises: a delay, or anything but the common case,
        goes to its Python body ``Queue._push``)."""
        cdef int64_t now
        cdef object seq
        cdef uint64_t id_
        if delay is not None:
            return self.push_py(payload, delay)
        now = self._now()
        if now < 0 or <uint64_t>now >= self.max_due:
            return self.push_py(payload, None)
        body = None
        if type(payload) is self.plain_type and self.plain_type is not None:
            body = pack_one(payload)  # VarCodec.encode's first step
        if body is None:
            body = self.encode(payload)
        if type(body) is not bytes:  # (VarCodec.encode returns bytes) nothing written yet: the Python body
            return self.push_py(payload, None)
        seq = self._draw_seq()
        id_ = seq
        cdef bint pushed = False
        try:  # (try/finally: no cost on the way through, where try/except saves the exception state)
            self._put_body(seq, id_, body)  # the body first (Q15)
            self._insert(seq, now, id_, b"")
            pushed = True
        finally:
            if not pushed:
                self._uncache(seq)  # (Queue._push_body's reason)
        return seq

    cdef int _uncache(self, object seq) except -1:
        """``Queue._cache_drop``: ``seq``'s cached body, if any, dropped."""
        cdef object body
        take(self.cache_lock)
        try:
            body = self.cache.pop(seq, None)
            if body is not None:
                PyDict_SetItem(self.qd, "_cache_bytes",
                               <object>PyDict_GetItemWithError(self.qd, "_cache_bytes") - len(<bytes>body))
        finally:
            give(self.cache_lock)
        return 0

    def lease(self, n=1, *, lease_timeout=None):
        """Lease up to ``n`` due rows in key order; a list of ``Lease`` (``Queue.lease``,
        whose documentation says what it raises: a lease timeout, several rows or
        shards, or anything but the common case, goes to its Python body ``Queue._lease``)."""
        cdef int64_t now, deadline
        cdef Py_ssize_t dead = 0
        cdef QueueShard sh
        cdef list out
        cdef tuple row
        if lease_timeout is not None or self.nsh != 1 or type(n) is not int or n != 1:
            return self.lease_py(n, lease_timeout)
        now = self._now()
        if now < 0:
            return self.lease_py(n, None)
        deadline = now + self.lease_ms
        self._deadline_dt(deadline)
        dl = self.dl
        out = []
        sh = <QueueShard>self.shards[0]
        take(<Lock>self.locks[0])
        try:
            sh._walk(now, deadline, 1, self.max_attempts, 0, out, dl, NULL, &dead)
        finally:
            give(<Lock>self.locks[0])
        if dead:
            self.note_dead(now)
        if not out:
            return out
        row = <tuple>out[0]  # (due, seq, shard_no, attempt, epoch, b""): see QueueShard._claim
        due, seq, shard_no, attempt, epoch = row[0], row[1], row[2], row[3], row[4]
        # The body leaves the cache as it is leased (Queue._take_cached), so that the ack
        # has none to drop; a lease that ends without an ack reads it back from the store.
        cdef object body = None
        cdef PyObject* b
        if PyDict_GET_SIZE(self.cache):
            take(self.cache_lock)
            try:
                b = PyDict_GetItemWithError(self.cache, seq)
                if b != NULL:
                    body = <object>b
                    PyDict_DelItem(self.cache, seq)
                    PyDict_SetItem(self.qd, "_cache_bytes",
                                   <object>PyDict_GetItemWithError(self.qd, "_cache_bytes") - len(<bytes>body))
            finally:
                give(self.cache_lock)
        payload = self.gone
        cdef bint ok = False
        if body is not None:
            try:
                if self.decodes_as_is:
                    payload = unpack_one(<bytes>body, &ok)  # VarCodec.decode's first step
                if not ok:
                    payload = self.decode(body)
            except Exception:  # Queue._read_payloads dead-letters it
                payload = self.gone
        if payload is self.gone:
            payload = self.read_payloads([(shard_no, due, seq, epoch)])[0]
            if payload is self.gone:
                return []
        return [_tuple5(self.lease_cls, seq, payload, attempt, dl,
                        _tuple5(self.token_cls, self.handle, shard_no, due, seq, epoch))]

    def ack(self, token):
        """Remove a leased row and its body (``Queue.ack``, whose documentation says what
        it raises): this handle's unaltered ``LeaseToken`` goes straight to its commit
        (``armdb.tx.commit_settle``, which checks the lease under the locks) once the
        queue's checks passed (open; the retention pass when due).  Anything else (a
        ``Lease``, an altered or foreign token, a closed queue) goes to the Python body
        ``Queue._ack``, which judges it."""
        cdef object t
        cdef uint64_t due, seq
        cdef uint32_t epoch
        if not _lone_token(token, self.token_cls, self.handle, self.nsh):
            return self.ack_py(token)
        if self.lease_timeouts:
            t = token
            (<dict>self.lease_timeouts).pop((<object>PyTuple_GET_ITEM(t, 3), <object>PyTuple_GET_ITEM(t, 4)), None)
        if self._now() < 0:
            return self.ack_py(token)  # closed: DbClosed
        if self.ack_first is None:
            if not _token_fields(<tuple>token, &due, &seq, &epoch):
                return self.ack_py(token)  # NotALease: an altered token
            self.settle(self.db, self.queue, token, True)
        elif not self._commit_ack(token):
            return self.ack_py(token)  # (its fields do not fit: NotALease)
        return None

    cdef bint _commit_ack(self, object token) except -1:
        """``armdb.tx.commit_settle`` of an ack, for this handle's unaltered token of
        shard ``k``: the same steps in the same order, with the typed shard, slot file,
        header store and locks held here instead of about a dozen attribute reads and the
        Python frame of that function (a third of the ack's instructions).  Both locks
        (in the global order); the lease check; the refusals of a fenced or closed store
        before anything is logged; the body tombstone's gsn; one log record with the
        header's delete and the body's tombstone (``ack_rows``), synced first when the
        commit is durable; then the header row freed and the tombstone written
        (``BitcaskStore.tomb_locked``), in that order (header before body), and a failure
        after the log append handed to the shared ``_fence_after_log``.  False, having
        done nothing, for a token whose fields do not fit (``Queue._ack`` refuses it)."""
        cdef tuple t = <tuple>token
        cdef Py_ssize_t k = <object>PyTuple_GET_ITEM(t, 1)
        cdef uint64_t due, seq
        cdef uint32_t epoch
        if not _token_fields(t, &due, &seq, &epoch):
            return False
        cdef QueueShard sh = <QueueShard>self.shards[k]
        cdef SlotStore fixed = sh.fixed
        cdef Lock first = <Lock>self.ack_first[k]
        cdef Lock second = <Lock>self.ack_second[k]
        cdef dict pd = self.pd
        cdef Py_ssize_t slot = -1
        cdef uint32_t version
        cdef int r
        cdef bint checkpoint_due = False
        payload = self.payload
        txlog = <object>PyDict_GetItemWithError(self.dbd, "txlog")
        cdef dict td = self._log_dict(txlog)  # (None: the log's methods are called)
        take(first)
        try:
            take(second)
            try:
                r = sh._leased(due, seq, epoch, &slot)
                if r:
                    raise self.queue._stale(token, r == _ABSENT)
                version = ring_step(sh.sf.versions[slot])
                # Refused before anything is logged: a store fenced by a failed sync, a closed one.
                if fixed.poisoned is not None or sh.sf.closed:
                    (<object>fixed).check_writable()
                if <object>PyDict_GetItemWithError(pd, "_poisoned") is not None or \
                        <object>PyDict_GetItemWithError(pd, "_closed"):
                    payload.check_writable()
                # The tombstone's gsn, reserved on disk before it is returned (see
                # commit_settle: only a failed log append can leave it unused, a gap).
                gsn = (<object>PyDict_GetItemWithError(pd, "_gsn"))()
                body, key = self.rows(self.fhead, fixed.index, slot, version, self.bhead, seq, gsn)
                end = self._log_append(txlog, td, body)
                if (<object>PyDict_GetItemWithError(self.dbd, "tx_config")).durable:
                    try:
                        txlog.sync_to(end)  # write-ahead: on disk before anything is applied
                    except BaseException as e:
                        err = self.fence((self.queue,), [fixed], [payload], e, True)
                        self._log_done(txlog, td)
                        raise err from e
                try:
                    sh._free_row(due, seq, slot, version)  # QueueShard.ack_slot
                    sh.hook_ran = False
                    # (No cache entry to drop: a lease takes its row's body out of the cache.)
                    if self.putter is not None and PyDict_GetItemWithError(pd, "tomb_locked") == NULL:
                        self.putter.tomb(key, gsn)  # BitcaskStore.tomb_locked, without its frame
                    else:  # (several shards; or a test's tomb_locked, set on the instance)
                        payload.tomb_locked(key, gsn)
                    (<object>PyDict_GetItemWithError(self.faild, "point"))("txlog.after_apply")
                    fixed.raise_sync_error()  # applied in full; its sync failed
                except BaseException as e:
                    err = self.fence((self.queue,), [fixed], [payload], e)
                    self._log_done(txlog, td)  # only once the stores are fenced: a checkpoint may follow
                    raise err from e
                checkpoint_due = self._log_done(txlog, td)
            finally:
                give(second)
        finally:
            give(first)
        if checkpoint_due:
            txlog.checkpoint_after_commit()
        if <object>PyDict_GetItemWithError(pd, "_compact_deferred"):  # maybe_compact's own test
            payload.maybe_compact()
        return True
