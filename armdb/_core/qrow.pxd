# cython: language_level=3
"""A queue row as the kernels see it, and the rules that change it.

The row (docs/format.md, armdb/qrows.py): key ``due: u64 BE, seq: u64 BE``; header
``state: u8, flags: u8, attempts: u16 LE, epoch: u32 LE, deadline: i64 LE,
payload_id: u64 LE, pushed: i64 LE``; then the inline payload of a fixed queue.  The
offsets below are the only ones Cython code uses; tests/test_transitions.py ties them
to ``armdb.qrows.ROW_DTYPE``.

The rules are ``cdef inline ... noexcept nogil`` functions over a row image in memory:
each rewrites the image in place and returns what happened, so the caller knows which
index and counter updates follow.  They are the one definition of a queue transition:
the compiled push and claim (armdb._core.qshard) call them on the hot path, and
``armdb.transitions`` gives them to Python (the direct nack, the transaction planner)
through the thin wrappers of armdb._core.qrow.  Parameters that come from the
configuration or the clock (the lease deadline, a retry's due time from the backoff)
are computed by ``armdb.transitions`` and passed in.
"""

from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t

from armdb._core._util cimport load_le, store_be64, store_le

cdef enum:
    KEY_SIZE = 16            # due, seq
    HEADER_SIZE = 32
    ROW_HEAD = 48            # a row without its inline payload
    AT_DUE = 0
    AT_SEQ = 8
    AT_STATE = 16
    AT_FLAGS = 17
    AT_ATTEMPTS = 18         # u16
    AT_EPOCH = 20            # u32
    AT_DEADLINE = 24         # i64
    AT_PAYLOAD_ID = 32       # u64
    AT_PUSHED = 40           # i64
    MAX_PAYLOAD = 4096       # armdb.qrows.MAX_FIXED_PAYLOAD
    READY = 0
    LEASED = 1
    DEAD = 2
    FLAG_DEAD_EXPLICIT = 1
    FLAG_POISONED = 2

# What a transition did.
cdef enum:
    T_LEASED = 0             # lease: a ready row is leased
    T_RELEASED = 1           # lease: an expired lease is leased again (one more expired lease)
    T_EXPIRED_DEAD = 2       # lease: an expired lease with max_attempts deliveries is dead-lettered
    T_RETRY = 3              # nack: ready again, re-keyed at its retry time
    T_NACK_DEAD = 4          # nack: dead-lettered (asked for, or its attempts are used up)


cdef inline uint64_t dead_key(int64_t now) noexcept nogil:
    """The key word of a row dead-lettered at ``now``: bit 63 set, so the dead key class
    sorts after every live row."""
    return ((<uint64_t>1) << 63) | <uint64_t>now


cdef inline void push_row(uint8_t* row, uint64_t due, uint64_t seq, int64_t now, uint64_t payload_id) noexcept nogil:
    """A new ready row keyed ``(due, seq)``: never leased, no attempts, epoch 0 (Q9)."""
    store_be64(row + AT_DUE, due)
    store_be64(row + AT_SEQ, seq)
    store_le(row + AT_STATE, READY, 8)                 # state; flags, attempts, epoch 0
    store_le(row + AT_DEADLINE, 0, 8)
    store_le(row + AT_PAYLOAD_ID, payload_id, 8)
    store_le(row + AT_PUSHED, <uint64_t>now, 8)


cdef inline void dead_letter(uint8_t* row, int64_t now, uint8_t flags) noexcept nogil:
    """Move a row to the dead key class at ``now``; everything else it holds stays (Q22)."""
    store_be64(row + AT_DUE, dead_key(now))
    row[AT_STATE] = DEAD
    row[AT_FLAGS] |= flags


cdef inline int lease_row(uint8_t* row, int64_t now, int64_t deadline, uint32_t max_attempts) noexcept nogil:
    """Lease a due row (ready and due, or leased with an expired deadline) until
    ``deadline``: one more attempt and a new epoch, so every earlier token is stale; the
    row keeps its key (Q9, Q13).  An expired lease that already had ``max_attempts``
    deliveries is dead-lettered instead (Q9)."""
    cdef bint expired = row[AT_STATE] == LEASED
    cdef uint32_t attempts = <uint32_t>load_le(row + AT_ATTEMPTS, 2)
    if expired and attempts >= max_attempts:
        dead_letter(row, now, 0)
        return T_EXPIRED_DEAD
    row[AT_STATE] = LEASED
    store_le(row + AT_ATTEMPTS, attempts + 1, 2)
    cdef uint32_t epoch = <uint32_t>load_le(row + AT_EPOCH, 4) + 1  # wraps at 2**32
    store_le(row + AT_EPOCH, epoch, 4)
    store_le(row + AT_DEADLINE, <uint64_t>deadline, 8)
    return T_RELEASED if expired else T_LEASED


cdef inline int nack_row(uint8_t* row, int64_t now, int64_t retry_at, bint dead, bint poisoned,
                         uint32_t max_attempts) noexcept nogil:
    """Give a leased row back (Q14): ready again at ``retry_at``, re-keyed, with its
    attempts, epoch and deadline kept; dead-lettered instead when ``dead`` is asked for
    (flagged explicit, and poisoned when a lease could not decode its body) or its
    attempts reached ``max_attempts``."""
    if dead or load_le(row + AT_ATTEMPTS, 2) >= max_attempts:
        dead_letter(row, now, (FLAG_DEAD_EXPLICIT | (FLAG_POISONED if poisoned else 0)) if dead else 0)
        return T_NACK_DEAD
    store_be64(row + AT_DUE, <uint64_t>retry_at)
    row[AT_STATE] = READY
    return T_RETRY
