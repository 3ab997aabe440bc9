"""Every queue rule: how a row changes at push, lease, nack, dead-letter and expiry
(SPEC Q9, Q13, Q14, Q22).

A rule maps a row image (``armdb.qrows``: key, header, inline payload), the clock and
the queue's configuration to a new row image; what else it needs written (which index
the row moves to, which counters change) follows from the outcome.  The rules
themselves are ``cdef inline`` functions in ``armdb/_core/qrow.pxd``, so that the compiled
push and claim of ``armdb._core.qshard`` run them on the hot path without leaving C;
this module is their Python face, and computes what comes from the configuration: the
backoff of a retry, the retention of dead rows.  The direct nack of a fixed queue
(``Queue.nack``) and the transaction planner (``Queue._tx_push``, ``Queue._tx_settle``,
behind every var ack and nack and every ``db.tx()``) call it; nothing else computes a
backoff, an attempt count or a dead-letter decision.

``extend`` (Q29), ``release`` (P6) and ``redrive`` (Q34) are header rewrites computed here in
Python.
"""

from __future__ import annotations

from typing import NamedTuple

from ._core import qrow as _rules
from .config import QueueConfig
from .errors import ConfigError
from .qrows import DEAD_BIT, MAX_DUE_MS, ROW_SIZE, State, header_of, key_of, pack_row

# What a rule did (armdb/_core/qrow.pxd).
LEASED = _rules.OUTCOMES["LEASED"]  # a ready row was leased
RELEASED = _rules.OUTCOMES["RELEASED"]  # an expired lease was leased again
EXPIRED_DEAD = _rules.OUTCOMES["EXPIRED_DEAD"]  # an expired lease out of attempts was dead-lettered
RETRY = _rules.OUTCOMES["RETRY"]  # a nacked row is ready again at its retry time
NACK_DEAD = _rules.OUTCOMES["NACK_DEAD"]  # a nacked row was dead-lettered

_NOT_DEAD = ~DEAD_BIT & 0xFFFFFFFFFFFFFFFF


class Moved(NamedTuple):
    """A settled row: its new image, its new key's due word, and whether it is dead now."""

    image: bytes
    due: int
    dead: bool


def push(seq: int, due: int, now: int, payload_id: int, inline: bytes = b"") -> bytes:
    """The image of a new ready row keyed ``(due, seq)``, pushed at ``now`` (Q9)."""
    return _rules.push(due, seq, now, payload_id, inline)


def lease(image: bytes, now: int, deadline: int, max_attempts: int) -> tuple[bytes, int]:
    """The image of a due row leased until ``deadline``, and LEASED, RELEASED or
    EXPIRED_DEAD (Q9, Q13).  The compiled claim applies this very rule in place."""
    return _rules.lease(image, now, deadline, max_attempts)


def backoff_ms(config: QueueConfig, attempts: int) -> int:
    """How long a row nacked after ``attempts`` deliveries waits before it is ready again."""
    return round(config.backoff_for(attempts) * 1000)


def nack(image: bytes, now: int, config: QueueConfig, delay_ms: int | None, dead: bool,
         poisoned: bool = False) -> Moved:
    """A leased row given back (Q14): ready again at ``now`` plus ``delay_ms`` or its
    backoff, or dead-lettered when ``dead`` (``poisoned``: by a lease that could not decode
    its body) or when its attempts reached ``max_attempts``."""
    wait = delay_ms if delay_ms is not None else backoff_ms(config, header_of(image)[2])
    retry_at = now + wait
    out, outcome = _rules.nack(image, now, min(retry_at, MAX_DUE_MS - 1), dead, poisoned, config.max_attempts)
    if outcome == RETRY and retry_at >= MAX_DUE_MS:
        # A due time at or past 2**63 is the dead key class: a ready row keyed there is
        # one the next open refuses (such a row was once written).
        raise ConfigError(f"delay must not be negative and is at most {MAX_DUE_MS - now} ms, got {wait} ms")
    return Moved(out, key_of(out)[0], outcome == NACK_DEAD)


def extend(image: bytes, deadline: int) -> bytes:
    """A leased row's image with its lease running until ``deadline`` (Q29): the state,
    attempts and epoch stay, so the lease's token stays valid."""
    state, flags, attempts, epoch, _deadline, payload_id, pushed = header_of(image)
    due, seq = key_of(image)
    return pack_row(due, seq, state, flags, attempts, epoch, deadline, payload_id, pushed, image[ROW_SIZE:])


def release(image: bytes) -> bytes:
    """A leased row given back before its work started (P6): ready again under the same
    key (due at once, in its place in key order), the lease's attempt not counted (one
    less than the lease made it), no deadline.  Its epoch stays: the token is stale because
    the row is no longer LEASED, and the next lease's new epoch keeps it so."""
    _state, flags, attempts, epoch, _deadline, payload_id, pushed = header_of(image)
    due, seq = key_of(image)
    return pack_row(due, seq, State.READY, flags, max(attempts - 1, 0), epoch, 0, payload_id, pushed,
                    image[ROW_SIZE:])


def redrive(image: bytes, due: int) -> Moved:
    """A dead row moved back (Q34): ready at ``due`` (keyed ``(due, id)``), its attempts
    reset to 0 and its dead-letter flags cleared; its id, epoch (so any old token stays
    stale), payload id, push time and inline payload are kept."""
    if due >= MAX_DUE_MS:
        raise ConfigError(f"the redrive time {due} ms reaches the dead key class; use a shorter delay")
    seq = key_of(image)[1]
    _state, _flags, _attempts, epoch, _deadline, payload_id, pushed = header_of(image)
    out = pack_row(due, seq, State.READY, 0, 0, epoch, 0, payload_id, pushed, image[ROW_SIZE:])
    return Moved(out, due, False)


def dead_since(due: int) -> int:
    """When a dead row (its key's due word) was dead-lettered, in ms."""
    return due & _NOT_DEAD


def retention_ms(config: QueueConfig) -> int | None:
    """How long a dead row is kept before retention sweeps it (Q22); None: for ever."""
    ret = config.dead_retention
    return None if ret is None else int(ret * 1000)
