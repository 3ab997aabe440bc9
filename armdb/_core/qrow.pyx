# cython: language_level=3
"""Python's way to the queue row rules of ``qrow.pxd``: thin wrappers that copy a row
image, apply one rule and return the new image with what happened.

Why compiled: not for speed (these serve the direct nack and the transaction planner,
one row at a time) but so that Python and the compiled claim run the same definition of
every transition.  ``armdb.transitions`` is their only caller; the constants exported here
let tests/test_transitions.py tie the row offsets to ``armdb.qrows.ROW_DTYPE``.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy

# The row layout and the rule outcomes of qrow.pxd (this module's own declarations), for
# armdb.transitions and for the test that compares the offsets with the NumPy dtype.
OFFSETS = {
    "due": AT_DUE, "seq": AT_SEQ, "state": AT_STATE, "flags": AT_FLAGS, "attempts": AT_ATTEMPTS,
    "epoch": AT_EPOCH, "deadline": AT_DEADLINE, "payload_id": AT_PAYLOAD_ID, "pushed": AT_PUSHED,
}
SIZES = {"key": KEY_SIZE, "header": HEADER_SIZE, "row": ROW_HEAD, "max_payload": MAX_PAYLOAD}
STATES = {"READY": READY, "LEASED": LEASED, "DEAD": DEAD}
FLAGS = {"DEAD_EXPLICIT": FLAG_DEAD_EXPLICIT, "POISONED": FLAG_POISONED}
OUTCOMES = {"LEASED": T_LEASED, "RELEASED": T_RELEASED, "EXPIRED_DEAD": T_EXPIRED_DEAD, "RETRY": T_RETRY,
            "NACK_DEAD": T_NACK_DEAD}


cdef bytes _copy(bytes image):
    if len(image) < ROW_HEAD:
        raise ValueError(f"a queue row is at least {ROW_HEAD} bytes, got {len(image)}")
    return PyBytes_FromStringAndSize(PyBytes_AS_STRING(image), len(image))


def push(uint64_t due, uint64_t seq, int64_t now, uint64_t payload_id, bytes payload not None):
    """A new ready row (``push_row``) followed by ``payload``."""
    cdef Py_ssize_t n = len(payload)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, ROW_HEAD + n)
    cdef uint8_t* p = <uint8_t*>PyBytes_AS_STRING(out)
    push_row(p, due, seq, now, payload_id)
    if n:
        memcpy(p + ROW_HEAD, PyBytes_AS_STRING(payload), n)
    return out


def lease(bytes image not None, int64_t now, int64_t deadline, uint32_t max_attempts):
    """``(new image, outcome)`` of ``lease_row``: T_LEASED, T_RELEASED or T_EXPIRED_DEAD."""
    cdef bytes out = _copy(image)
    cdef int r = lease_row(<uint8_t*>PyBytes_AS_STRING(out), now, deadline, max_attempts)
    return out, r


def nack(bytes image not None, int64_t now, int64_t retry_at, bint dead, bint poisoned, uint32_t max_attempts):
    """``(new image, outcome)`` of ``nack_row``: T_RETRY or T_NACK_DEAD."""
    cdef bytes out = _copy(image)
    cdef int r = nack_row(<uint8_t*>PyBytes_AS_STRING(out), now, retry_at, dead, poisoned, max_attempts)
    return out, r
