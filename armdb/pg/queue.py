"""A queue handle on PostgreSQL (SPEC G2-G5): the operations and errors of ``armdb.Queue``.

Every rule that changes a row (the lease, a nack's backoff and dead-lettering, an
extension, a redrive) is ``armdb.transitions``: the handle reads the row under a row
lock, builds its image with ``armdb.qrows.pack_row``, asks the rule for the new image
and writes back what changed.  Leasing picks due rows with ``FOR UPDATE SKIP LOCKED``,
so two callers never hold the same row; the row's ``epoch`` (bumped by every lease)
is in the token, so a settle with a token whose row was leased again changes nothing
and raises ``StaleToken``.  Times come from the server's clock (``now()``).

The SQL is in armdb/pg/schema.py; the layout in docs/postgres.md.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
import typing
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np

from .. import transitions
from .._clock import ms_to_datetime, system_clock, to_ms, to_seconds
from .._crypto import Sealer
from ..config import QueueConfig
from ..errors import ConfigError, DbClosed, NotALease, PayloadTypeError, ProcessBound, QueueFull, StaleToken
from ..qrows import DEAD_BIT, SNAPSHOT_DTYPE, State, header_of, key_of, pack_row
from ..qspec import FixedCodec, QueueSpec, VarCodec
from ..queue import (
    MAX_LEASE,
    Job,
    Lease,
    LeaseBatch,
    LeaseToken,
    QueueStats,
    as_token,
    lease_deadline,
    nack_args,
)
from . import schema
from .schema import one

if TYPE_CHECKING:
    import psycopg

    from .db import PgDb

log = logging.getLogger("armdb")

T = TypeVar("T")

_PROCESS_TAG = int.from_bytes(os.urandom(4), "big")
_handle_ids = itertools.count(1)

# The initial header of a pushed row, from the push rule itself (state, flags, attempts,
# epoch, deadline): a push is one INSERT, so these are its parameters.
_PUSH_STATE, _PUSH_FLAGS, _PUSH_ATTEMPTS, _PUSH_EPOCH, _PUSH_DEADLINE = header_of(transitions.push(1, 0, 0, 0))[:5]
RETENTION_PERIOD = 1.0  # seconds between two retention passes of one handle
MAX_PUSH_MANY = 100_000
# The largest payload one row holds: PostgreSQL's bytea field tops out at 1 GiB; room is
# left for the seal and the protocol.
MAX_BODY = (1 << 30) - (1 << 20)


def int_array(xs: Iterable[int]) -> str:
    """A PostgreSQL array literal of integers (``{1,2,3}``), for a ``%s::bigint[]``
    parameter: one string costs the client far less than psycopg's per-element dump."""
    return "{" + ",".join(map(str, xs)) + "}"


def _image(row: tuple[Any, ...]) -> bytes:
    """The row image (armdb.qrows) of a live row ``(id, due_ms, state, flags, attempts,
    epoch, deadline_ms, pushed_ms, ...)``: what the rules of armdb.transitions take."""
    rid, due, state, flags, attempts, epoch, deadline, pushed = row[:8]
    return pack_row(due, rid, state, flags, attempts, epoch, deadline, rid, pushed)


class PgQueue(Generic[T]):
    """A queue handle on PostgreSQL.  Get one with ``PgDb.open_queue(spec, config)``.

    Safe to share between threads; any number of processes (on any machines) may open
    the same queue.  Its methods are those of ``armdb.Queue``.
    """

    def __init__(self, db: PgDb, spec: QueueSpec, config: QueueConfig, coll_id: int, live: str, dead: str,
                 seq: str, sealer: Sealer | None, codec: FixedCodec | VarCodec) -> None:
        self._db = db
        self.spec = spec
        self.name = spec.name
        self.config = config
        self._coll_id = coll_id
        self._sql = schema.QueueSQL(db.namespace, live, dead, seq)
        self._tables = (live, dead, seq)
        self._channel = schema.channel_name(db.namespace, coll_id)
        self._listen_key = schema.listen_key(db.namespace, coll_id)
        self._gate_key = schema.gate_key(db.namespace, coll_id)
        self._notify_args = {"chan": self._channel, "lk": self._listen_key, "g1": self._gate_key[0],
                             "g2": self._gate_key[1]}
        self._handle = (_PROCESS_TAG << 32) | next(_handle_ids)
        self._sealer = sealer
        self._codec = codec
        self._encode_plain = codec.encode
        self._lease_ms = int(round(config.lease_timeout * 1000))
        self._lease_timeouts: dict[tuple[int, int], int] = {}
        self._retention_ms = transitions.retention_ms(config)
        self._next_retention = 0.0
        self._lock = threading.Lock()  # counters
        self._counts = dict.fromkeys(("pushes", "acks", "nacks", "dead_lettered", "poisoned", "expired_leases",
                                      "payload_writes"), 0)
        self._cond = threading.Condition(threading.Lock())
        self._gen = 0
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._closed = False

    # -- helpers ------------------------------------------------------------------------------
    def _aad(self, rid: int) -> bytes:
        """What a sealed payload is bound to: this queue and its row (G5)."""
        return b"armdb.pg.q\x00" + self.name.encode() + b"\x00" + rid.to_bytes(8, "big")

    def _encode(self, payload: Any) -> bytes:
        body = self._encode_plain(payload)
        if len(body) > MAX_BODY:
            raise ConfigError(
                f"payload of queue {self.name!r} encodes to {len(body):,} bytes, above the limit of {MAX_BODY:,}; "
                f"store large data elsewhere and push a reference to it; nothing was written")
        return body

    def _stored(self, rid: int, body: bytes) -> bytes:
        """A payload as the table holds it: sealed when the queue is encrypted."""
        return body if self._sealer is None else self._sealer.seal(body, self._aad(rid))

    def _open_body(self, rid: int, raw: bytes) -> bytes:
        if self._sealer is None:
            return bytes(raw)
        return self._sealer.open(raw, self._aad(rid), what=f"queue {self.name!r} row {rid}")

    def _decode(self, body: bytes) -> Any:
        if self.spec.var:
            return typing.cast(VarCodec, self._codec).decode(body)
        return np.frombuffer(bytearray(body), dtype=self.spec.dtype)[0]

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def _check(self) -> None:
        """DbClosed when closed; run retention when due (Q22, Q24)."""
        if self._closed or self._db.closed:
            raise DbClosed(f"queue {self.name!r} (its PgDb is closed)")
        if self._retention_ms is not None and time.monotonic() >= self._next_retention:
            self._next_retention = time.monotonic() + RETENTION_PERIOD
            try:
                self.sweep_expired()
            except DbClosed:
                raise
            except Exception as e:  # noqa: BLE001 - a retention failure never fails an operation (Q24)
                log.warning("queue %s: retention failed: %s", self.name, e)

    def sweep_expired(self) -> int:
        """Delete the dead rows older than ``dead_retention`` (Q22); returns how many."""
        if self._retention_ms is None:
            return 0
        with self._db._conn() as c:
            return c.execute(self._sql.retention, (self._retention_ms,)).rowcount

    def _token(self, lease: object) -> LeaseToken:
        token = as_token(lease)
        if token.handle != self._handle:
            raise StaleToken(
                f"this token was issued by another queue handle (another queue, or before a reopen); "
                f"lease the row again from queue {self.name!r}"
            )
        return token

    @staticmethod
    def _stale(token: LeaseToken) -> StaleToken:
        return StaleToken(f"row {token.seq} was acked, nacked, dead-lettered or leased again since this token "
                          f"was issued; nothing changed")

    # -- push (Q9, Q20, Q31) -------------------------------------------------------------------
    def _delay_ms(self, delay: timedelta | float | None) -> int:
        delay_ms = 0 if delay is None else to_ms(delay, "delay")
        if delay_ms < 0 or delay_ms >= 1 << 62:
            raise ConfigError(f"delay must not be negative, nor reach past 2**62 ms, got {delay!r}")
        return delay_ms

    def _full(self, live: int, adding: int) -> QueueFull:
        return QueueFull(
            f"queue {self.name!r} holds {live} live rows and max_depth is {self.config.max_depth}; adding "
            f"{adding} would pass it: ack or dead-letter work, or open it with a larger max_depth"
        )

    def push(self, payload: T, *, delay: timedelta | float | None = None) -> int:
        """Insert a ready row due at ``now + delay`` (server clock); return its id.

        Raises ``PayloadTypeError`` (nothing written), ``QueueFull``, ``DbClosed``,
        ``StorageError`` (the server is unreachable: the push may or may not have
        committed).
        """
        self._check()
        delay_ms = self._delay_ms(delay)
        body = self._encode(payload)
        cap = self.config.max_depth
        with self._db._conn() as c:
            if cap is not None:
                live = one(c.execute(self._sql.count_live))[0]
                if live >= cap:
                    raise self._full(live, 1)
            rid = None
            if self._sealer is not None:
                rid = one(c.execute(self._sql.next_ids, (self._sql.seq, 1)))[0]
                body = self._stored(rid, body)
            row = one(c.execute(self._sql.push, self._push_params(rid, delay_ms, body)))
        self._count("pushes")
        if self.spec.var:
            self._count("payload_writes")
        return int(row[0])

    def _push_params(self, rid: int | None, delay_ms: int, body: bytes) -> dict[str, Any]:
        return {"id": rid, "seq": self._sql.seq, "delay": delay_ms, "state": _PUSH_STATE, "flags": _PUSH_FLAGS,
                "attempts": _PUSH_ATTEMPTS, "epoch": _PUSH_EPOCH, "deadline": _PUSH_DEADLINE, "payload": body,
                **self._notify_args}

    def push_many(self, payloads: Iterable[T] | np.ndarray, *, delay: timedelta | float | None = None) -> Any:
        """Push a sequence in one commit, all or nothing (Q31); ids increase in input order.
        A fixed queue also takes a 1-D NumPy array of its dtype and then returns a
        ``uint64`` array of ids.  ``PayloadTypeError`` (naming the payload) or ``QueueFull``
        (judged on the whole batch): nothing is written."""
        self._check()
        delay_ms = self._delay_ms(delay)
        as_array = isinstance(payloads, np.ndarray) and not self.spec.var
        if as_array:
            arr = typing.cast(np.ndarray, payloads)
            if arr.ndim != 1 or arr.dtype != self.spec.dtype:
                raise PayloadTypeError(
                    f"queue {self.name!r} stores {self.spec.dtype}; push_many got an array of {arr.dtype} with shape "
                    f"{arr.shape}: give a 1-D array of the queue's dtype")
            bodies = [r.tobytes() for r in np.ascontiguousarray(arr)]
        else:
            if isinstance(payloads, (str, bytes, bytearray, memoryview, dict)) or not isinstance(payloads, Iterable):
                raise PayloadTypeError(f"push_many takes a sequence of payloads (e.g. a list), not "
                                       f"{type(payloads).__name__}; push one payload with push()")
            bodies = []
            for i, p in enumerate(payloads):
                try:
                    bodies.append(self._encode(p))
                except PayloadTypeError as e:
                    raise type(e)(f"payload {i} of the batch: {e}; nothing was pushed") from None
        if len(bodies) > MAX_PUSH_MANY:
            raise ConfigError(f"push_many takes at most {MAX_PUSH_MANY:,} payloads per call, got {len(bodies):,}")
        ids: list[int] = []
        if bodies:
            with self._db._conn() as c:  # one INSERT: all or nothing by itself
                ids = self._insert_many(c, bodies, delay_ms)
            self._count("pushes", len(ids))
            if self.spec.var:
                self._count("payload_writes", len(ids))
        return np.array(ids, dtype=np.uint64) if as_array else ids

    def _insert_many(self, c: psycopg.Connection[Any], bodies: list[bytes], delay_ms: int,
                     judge_cap: bool = True) -> list[int]:
        """Insert rows in the caller's transaction; ids in input order."""
        cap = self.config.max_depth
        if judge_cap and cap is not None:
            live = one(c.execute(self._sql.count_live))[0]
            if live + len(bodies) > cap:
                raise self._full(live, len(bodies))
        ids: str | None = None  # no ids given: the sequence draws them (unnest pads with NULLs)
        if self._sealer is not None:
            drawn = sorted(r[0] for r in c.execute(self._sql.next_ids, (self._sql.seq, len(bodies))).fetchall())
            bodies = [self._stored(rid, b) for rid, b in zip(drawn, bodies, strict=True)]
            ids = int_array(drawn)
        params = self._push_params(None, delay_ms, b"")
        del params["payload"], params["id"]
        params["payloads"] = bodies
        params["ids"] = ids
        return sorted(int(r[0]) for r in c.execute(self._sql.push_many, params).fetchall())

    # -- lease (Q9, Q11, Q32) ------------------------------------------------------------------
    def lease(self, n: int = 1, *, lease_timeout: timedelta | float | None = None) -> list[Lease[T]]:
        """Lease up to ``n`` due rows; never blocks, may return ``[]``.  Rows of one result
        come in key order (due time, then id)."""
        taken, payloads = self._take(n, lease_timeout)
        handle = self._handle
        return [Lease(rid, payload, attempt, ms_to_datetime(deadline), LeaseToken(handle, 0, due, rid, epoch))
                for (rid, due, attempt, epoch, deadline), payload in zip(taken, payloads, strict=True)]

    def lease_batch(self, n: int = 1, *, lease_timeout: timedelta | float | None = None,
                    ack: LeaseBatch[T] | Iterable[Lease[T] | LeaseToken] | None = None) -> LeaseBatch[T]:
        """Lease like :meth:`lease` and return the leases as a ``LeaseBatch`` of arrays
        (Q32): ``ids``, ``attempts``, ``deadlines`` and ``payloads`` (a structured array of
        the dtype for a fixed queue, a list for a var queue), in key order.

        ``ack``: leases to ack first, as :meth:`ack_many` takes them (typically the batch
        the worker just finished).  The acks and the lease are one SQL transaction, one
        commit: a worker loop pays one WAL flush per batch instead of two.  All or nothing:
        if any of them no longer holds its lease, ``StaleToken`` and nothing is acked nor
        leased; an empty ``ack`` (an empty batch or list) leases only."""
        acks = None if ack is None or isinstance(ack, LeaseBatch) and not len(ack) else self._ack_arrays(ack)
        taken, decoded = self._take(n, lease_timeout, acks)
        k = len(taken)
        payloads: Any = decoded
        if not self.spec.var:
            payloads = np.array(decoded, dtype=self.spec.dtype) if k else np.empty(0, self.spec.dtype)
        # One transaction, one server clock reading: every lease of the batch has one deadline.
        deadline = (taken[0][4], ms_to_datetime(taken[0][4])) if k else (0, ms_to_datetime(0))
        ids, dues, attempts, epochs, _ = zip(*taken, strict=True) if k else ((), (), (), (), ())
        return LeaseBatch(self.name, self._handle, np.zeros(k, np.uint32), np.array(dues, np.uint64),
                          np.array(ids, np.uint64), np.array(attempts, np.uint16), np.array(epochs, np.uint32),
                          deadline, payloads)

    def _take(self, n: int, lease_timeout: timedelta | float | None,
              acks: tuple[list[int], list[int]] | None = None
              ) -> tuple[list[tuple[int, int, int, int, int]], list[Any]]:
        """Lease up to ``n`` rows: ``(id, due, attempt, epoch, deadline)`` of each, in key
        order, and their decoded payloads.  A row whose body cannot be read is
        dead-lettered (poisoned) and left out.  ``acks`` (row ids and epochs) are acked
        first in the same transaction, all or nothing (``StaleToken``: nothing happened)."""
        if type(n) is not int and (not isinstance(n, int) or isinstance(n, bool)) or n < 1:
            raise ConfigError(f"lease(n) needs an int n >= 1, got {n!r}")
        if n > MAX_LEASE:
            raise ConfigError(f"lease(n) takes at most {MAX_LEASE:,} rows per call, got {n:,}; lease in batches")
        if lease_timeout is None:
            lease_ms = self._lease_ms
        else:
            timeout = to_seconds(lease_timeout, "lease_timeout")
            if timeout < 0.001:
                raise ConfigError(f"lease_timeout must be positive, at least 1 ms, got {lease_timeout!r}")
            lease_ms = int(round(timeout * 1000))
            lease_deadline(system_clock(), lease_ms, lease_timeout, "lease_timeout")  # (the server's clock decides)
        self._check()
        taken: list[tuple[int, int, int, int, int, bytes]] = []  # id, due, attempt, epoch, deadline, raw
        if acks is not None and not acks[0]:
            acks = None
        # Pipelined: BEGIN goes out with the pick (and the acks, if any), and the UPDATE
        # with the COMMIT (two round trips); rows come back in binary (no hex decoding of
        # the payloads).
        with self._db._conn() as c, c.pipeline(), c.transaction():
            acked = None if acks is None else c.execute(self._sql.ack_in_tx, (int_array(acks[0]),
                                                                              int_array(acks[1])))
            rows = c.execute(self._sql.lease_pick, (n,), binary=True).fetchall()
            if acks is not None and typing.cast("psycopg.Cursor[Any]", acked).rowcount != len(acks[0]):
                # Raised inside the transaction: it rolls back, the rows picked are let go.
                raise StaleToken("some of the leases given as ack= no longer hold their lease (their rows were "
                                 "acked, nacked, dead-lettered or leased again); nothing was acked nor leased")
            ids: list[int] = []
            states: list[int] = []
            attempts_col: list[int] = []
            epochs: list[int] = []
            deadlines: list[int] = []
            dead: list[tuple[Any, ...]] = []
            expired = 0
            max_attempts = self.config.max_attempts
            rule = transitions.lease
            for row in rows:
                now = row[9]
                out, outcome = rule(_image(row), now, now + lease_ms, max_attempts)
                state, flags, attempts, epoch, deadline = header_of(out)[:5]
                if outcome == transitions.EXPIRED_DEAD:
                    dead.append((row[0], transitions.dead_since(key_of(out)[0]), flags, attempts, epoch, deadline,
                                 row[7], row[8]))
                    continue
                if outcome == transitions.RELEASED:
                    expired += 1
                ids.append(row[0])
                states.append(state)
                attempts_col.append(attempts)
                epochs.append(epoch)
                deadlines.append(deadline)
                taken.append((row[0], row[1], attempts, epoch, deadline, row[8]))
            if ids:
                c.execute(self._sql.update_leased, (int_array(ids), int_array(states), int_array(attempts_col),
                                                    int_array(epochs), int_array(deadlines)))
            if dead:
                self._move_dead(c, dead)
        if acks is not None:
            self._acked(*acks)
        if expired or dead:
            with self._lock:
                self._counts["expired_leases"] += expired + len(dead)
                self._counts["dead_lettered"] += len(dead)
        taken.sort(key=lambda t: (t[1], t[0]))
        out_rows: list[tuple[int, int, int, int, int]] = []
        payloads: list[Any] = []
        poisoned: list[tuple[LeaseToken, Exception]] = []
        decode, open_body = self._decode, self._open_body
        for rid, due, attempt, epoch, deadline, raw in taken:
            try:
                payload = decode(open_body(rid, raw))
            except Exception as e:  # noqa: BLE001 - a body that cannot be read is this row's problem alone
                poisoned.append((LeaseToken(self._handle, 0, due, rid, epoch), e))
                continue
            out_rows.append((rid, due, attempt, epoch, deadline))
            payloads.append(payload)
        for token, err in poisoned:
            try:
                self._settle(token, False, None, True, poisoned=True)
            except StaleToken:
                continue
            self._count("poisoned")
            log.warning("queue %s: row %d cannot be decoded at lease (%s: %s); dead-lettered it, and delivered "
                        "the rest of the batch", self.name, token.seq, type(err).__name__, err)
        if lease_ms != self._lease_ms and out_rows:
            with self._lock:
                for r in out_rows:
                    self._lease_timeouts[(r[0], r[3])] = lease_ms
                while len(self._lease_timeouts) > 100_000:
                    self._lease_timeouts.pop(next(iter(self._lease_timeouts)), None)
        return out_rows, payloads

    def _move_dead(self, c: psycopg.Connection[Any], rows: list[tuple[Any, ...]]) -> None:
        """Move rows ``(id, dead_ms, flags, attempts, epoch, deadline, pushed, payload)``
        from the live table to the dead one, in the caller's transaction."""
        cols = list(zip(*rows, strict=True))
        c.execute(self._sql.delete_live, (list(cols[0]),))
        c.execute(self._sql.insert_dead, [list(col) for col in cols])

    # -- settle (Q13, Q14, Q29, Q30) -----------------------------------------------------------
    def ack(self, token: Lease[T] | LeaseToken) -> None:
        """Remove a leased row.  ``StaleToken`` if the token no longer holds its lease."""
        token = self._token(token)
        self._forget(token)
        self._check()
        with self._db._conn() as c:
            if c.execute(self._sql.ack, (token.seq, token.epoch)).rowcount != 1:
                raise self._stale(token)
        self._count("acks")

    def ack_many(self, leases: LeaseBatch[T] | Iterable[Lease[T] | LeaseToken]) -> int:
        """Ack a ``LeaseBatch`` (or a sequence of leases or tokens) in one commit, all or
        nothing (Q32): if any token is stale, ``StaleToken`` and nothing is acked.  Returns
        how many rows were acked."""
        seqs, epochs = self._ack_arrays(leases)
        self._check()
        if not seqs:
            return 0
        with self._db._conn() as c:
            n = c.execute(self._sql.ack_many, (int_array(seqs), int_array(epochs), len(seqs))).rowcount
        if n != len(seqs):
            raise StaleToken("some of these tokens no longer hold their lease (their rows were acked, nacked, "
                             "dead-lettered or leased again); nothing was acked")
        self._acked(seqs, epochs)
        return n

    def _ack_arrays(self, leases: LeaseBatch[T] | Iterable[Lease[T] | LeaseToken]) -> tuple[list[int], list[int]]:
        """The row ids and epochs of what ``ack_many`` (or ``lease_batch(ack=)``) was given;
        ``StaleToken`` for a batch or token of another handle or a row given twice,
        ``NotALease`` for something that is not a lease."""
        if isinstance(leases, LeaseBatch):
            if leases._handle != self._handle:
                raise StaleToken(f"this batch was leased through another handle (or before a reopen); lease again "
                                 f"from queue {self.name!r}; nothing was acked")
            seqs, epochs = leases.ids.tolist(), leases._epochs.tolist()
        else:
            if isinstance(leases, (Lease, LeaseToken)) or not isinstance(leases, Iterable):
                raise NotALease(f"ack_many takes a LeaseBatch or a list of Lease objects (or tokens), got "
                                f"{type(leases).__name__}; ack one lease with ack()")
            tokens = [self._token(x) for x in leases]
            seqs, epochs = [t.seq for t in tokens], [t.epoch for t in tokens]
        if len(set(seqs)) != len(seqs):
            raise StaleToken("a row appears twice in this batch; nothing was acked")
        return seqs, epochs

    def _acked(self, seqs: list[int], epochs: list[int]) -> None:
        """Count acks that committed and forget their per-lease timeouts."""
        if self._lease_timeouts:
            with self._lock:
                for key in zip(seqs, epochs, strict=True):
                    self._lease_timeouts.pop(key, None)
        self._count("acks", len(seqs))

    def _forget(self, token: LeaseToken) -> None:
        if self._lease_timeouts:
            with self._lock:
                self._lease_timeouts.pop((token.seq, token.epoch), None)

    def nack(self, token: Lease[T] | LeaseToken, *, delay: timedelta | float | None = None,
             dead: bool = False) -> None:
        """Give a leased row back: ready again at ``now + backoff`` (or ``now + delay``), or
        dead-lettered when its attempts reached ``max_attempts`` or ``dead=True``."""
        token = self._token(token)
        self._forget(token)
        self._check()
        self._settle(token, False, nack_args(delay, dead), dead)

    def _settle(self, token: LeaseToken, ack: bool, delay_ms: int | None, dead: bool, *,
                poisoned: bool = False) -> None:
        with self._db._conn() as c, c.pipeline(), c.transaction():
            went_dead = self._tx_settle(c, token, ack, delay_ms, dead, poisoned) == "dead"
        self._settled(ack, poisoned, went_dead)

    def _settled(self, ack: bool, poisoned: bool, went_dead: bool) -> None:
        """Count a settle once its transaction committed."""
        with self._lock:
            if ack:
                self._counts["acks"] += 1
            elif not poisoned:
                self._counts["nacks"] += 1
            if went_dead:
                self._counts["dead_lettered"] += 1

    def _tx_settle(self, c: psycopg.Connection[Any], token: LeaseToken, ack: bool, delay_ms: int | None,
                   dead: bool, poisoned: bool = False) -> str:
        """Settle ``token`` in the caller's transaction; returns ``"ack"``, ``"retry"`` (the
        row is ready again) or ``"dead"``.  ``StaleToken`` unless the token still holds
        its lease."""
        if ack:
            if c.execute(self._sql.ack, (token.seq, token.epoch)).rowcount != 1:
                raise self._stale(token)
            return "ack"
        row = c.execute(self._sql.settle_pick, (token.seq, token.epoch)).fetchone()
        if row is None:
            raise self._stale(token)
        now = row[9]
        moved = transitions.nack(_image(row), now, self.config, delay_ms, dead, poisoned)
        state, flags, attempts, epoch, deadline = header_of(moved.image)[:5]
        if moved.dead:
            self._move_dead(c, [(row[0], transitions.dead_since(moved.due), flags, attempts, epoch, deadline,
                                 row[7], row[8])])
            return "dead"
        c.execute(self._sql.update_row, (moved.due, moved.due, state, flags, attempts, epoch, deadline, row[0]))
        c.execute(self._sql.notify, self._notify_args)
        return "retry"

    def extend(self, lease: Lease[T] | LeaseToken, *, by: timedelta | float | None = None) -> datetime:
        """Move a lease's deadline to ``now + by`` (server clock) and return it (Q29)."""
        token = self._token(lease)
        self._check()
        if by is None:
            by_ms = self._lease_timeouts.get((token.seq, token.epoch), self._lease_ms)
        else:
            by_ms = to_ms(by, "by")
            if by_ms <= 0:
                raise ConfigError(f"by must be positive, at least 1 ms, got {by!r}")
        with self._db._conn() as c, c.transaction():
            row = c.execute(self._sql.settle_pick, (token.seq, token.epoch)).fetchone()
            if row is None:
                raise self._stale(token)
            deadline = lease_deadline(row[9], by_ms, by, "by")
            image = transitions.extend(_image(row), deadline)
            state, flags, attempts, epoch, new_deadline = header_of(image)[:5]
            due = key_of(image)[0]
            c.execute(self._sql.update_row, (due, new_deadline, state, flags, attempts, epoch, new_deadline, row[0]))
        return ms_to_datetime(new_deadline)

    def release_many(self, leases: LeaseBatch[T] | Iterable[Lease[T] | LeaseToken]) -> int:
        """Give back leases whose work has not started, as ``armdb.Queue.release_many``
        (P6): each row ready again at once under its key, the attempt its lease counted
        taken back (``armdb.transitions.release``), in one transaction; a lease no longer
        held is left alone.  Returns how many were released."""
        if isinstance(leases, (Lease, LeaseToken)) or not isinstance(leases, Iterable):
            raise NotALease(f"release_many takes a LeaseBatch or a list of Lease objects (or tokens), got "
                            f"{type(leases).__name__}")
        tokens = [self._token(x) for x in leases]
        self._check()
        if not tokens:
            return 0
        n = 0
        with self._db._conn() as c, c.transaction():
            for token in tokens:
                row = c.execute(self._sql.settle_pick, (token.seq, token.epoch)).fetchone()
                if row is None:
                    continue
                image = transitions.release(_image(row))
                state, flags, attempts, epoch, deadline = header_of(image)[:5]
                due = key_of(image)[0]
                c.execute(self._sql.update_row, (due, due, state, flags, attempts, epoch, deadline, row[0]))
                n += 1
            if n:
                c.execute(self._sql.notify, self._notify_args)
        for token in tokens:
            self._forget(token)
        return n

    # -- counts and waiting (Q18, Q19, G4) -----------------------------------------------------
    def len(self) -> int:
        """Live rows: ready, delayed and leased."""
        self._check_open()
        return int(self._db._read(lambda c: one(c.execute(self._sql.count_live))[0]))

    def __len__(self) -> int:
        return self.len()

    def dead_len(self) -> int:
        self._check_open()
        return int(self._db._read(lambda c: one(c.execute(self._sql.count_dead))[0]))

    def _check_open(self) -> None:
        if self._closed or self._db.closed:
            raise DbClosed(f"queue {self.name!r} (its PgDb is closed)")

    def _next(self) -> tuple[int | None, int]:
        t, now = self._db._read(lambda c: one(c.execute(self._sql.next_visible)))
        return (None if t is None else int(t)), int(now)

    def next_delay(self) -> timedelta | None:
        """``None`` with no live row, ``timedelta(0)`` when one is due now, else the time
        until the earliest due time or lease deadline (Q18)."""
        self._check()
        t, now = self._next()
        if t is None:
            return None
        return timedelta(milliseconds=max(0, t - now))

    def _wait_seconds(self) -> float:
        self._check()
        t, now = self._next()
        recheck = self.config.wakeup_recheck
        if t is None:
            return recheck
        if t <= now:
            return 0.0
        return min(recheck, (t - now) / 1000)

    def _wake(self, exc: BaseException | None = None) -> None:
        """A push or nack somewhere (a notification), or the close: wake the waiters."""
        with self._cond:
            self._gen += 1
            waiters, self._async_waiters = self._async_waiters, []
            self._cond.notify_all()
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_resolve, fut, exc)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

    def wait_due_timeout(self, timeout: timedelta | float) -> bool:
        """Block until a row is due or ``timeout`` passes; ``True`` is advisory (Q19).  A
        push or nack from any process wakes it at once (LISTEN/NOTIFY); it rechecks at
        least every ``wakeup_recheck``."""
        limit = time.monotonic() + to_seconds(timeout, "timeout")
        self._db._listen(self)
        while True:
            gen = self._gen
            wait = self._wait_seconds()
            if wait == 0:
                return True
            remaining = limit - time.monotonic()
            if remaining <= 0:
                return False
            with self._cond:
                if self._closed:
                    raise DbClosed(f"queue {self.name!r} (its PgDb was closed while waiting)")
                if self._gen == gen:
                    self._cond.wait(min(remaining, wait))

    async def due(self) -> None:
        """Resolve when a row is due (advisory, like :meth:`wait_due_timeout`)."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._db._listen, self)
        while True:
            gen = self._gen
            wait = await loop.run_in_executor(None, self._wait_seconds)
            if wait == 0:
                return
            fut: asyncio.Future[None] = loop.create_future()
            with self._cond:
                if self._closed:
                    raise DbClosed(f"queue {self.name!r} (its PgDb was closed while waiting)")
                if self._gen != gen:
                    continue
                self._async_waiters.append((loop, fut))
            try:
                await asyncio.wait({fut}, timeout=wait)
            finally:
                with self._cond:
                    if (loop, fut) in self._async_waiters:
                        self._async_waiters.remove((loop, fut))
            if fut.done() and fut.exception() is not None:
                raise typing.cast(BaseException, fut.exception())

    # -- inspection and dead letters (Q26, Q27, Q33, Q34) --------------------------------------
    def peek(self, n: int = 10, *, dead: bool = False) -> list[Job[T]]:
        """Read up to ``n`` rows without changing anything: live rows in key order, or dead
        rows oldest dead-lettered first."""
        if type(n) is not int or n < 1 or n > MAX_LEASE:
            raise ConfigError(f"peek(n) needs an int n in 1..{MAX_LEASE:,}, got {n!r}")
        if not isinstance(dead, bool):
            raise ConfigError("dead must be True or False")
        self._check()
        rows = self._db._read(lambda c: c.execute(self._sql.peek_dead if dead else self._sql.peek_live, (n,)).fetchall())
        jobs: list[Job[T]] = []
        for rid, state, attempts, at, raw in rows:
            body = self._open_body(rid, raw)
            try:
                payload = self._decode(body)
            except Exception:  # noqa: BLE001 - a poisoned body: show what is stored
                payload = body
            jobs.append(Job(rid, State(state), attempts, ms_to_datetime(at), payload))
        return jobs

    def redrive(self, ids: Any = None, *, delay: timedelta | float | None = None) -> int:
        """Move dead rows back to ready, due at ``now + delay``, attempts reset (Q34), in one
        commit.  ``QueueFull`` if they would pass ``max_depth`` (nothing moves)."""
        delay_ms = 0 if delay is None else to_ms(delay, "delay")
        if delay_ms < 0:
            raise ConfigError(f"delay must not be negative, got {delay!r}")
        wanted = _id_list(ids)
        self._check()
        with self._db._conn() as c, c.transaction():
            rows = c.execute(self._sql.dead_pick, (wanted, wanted)).fetchall()
            if not rows:
                return 0
            cap = self.config.max_depth
            if cap is not None:
                live = one(c.execute(self._sql.count_live))[0]
                if live + len(rows) > cap:
                    raise self._full(live, len(rows))
            now = one(c.execute(self._sql.now))[0]
            cols: tuple[list[Any], ...] = ([], [], [], [], [], [], [], [], [])
            for rid, dead_ms, flags, attempts, epoch, deadline, pushed, payload in rows:
                image = pack_row(DEAD_BIT | dead_ms, rid, State.DEAD, flags, attempts, epoch, deadline, rid, pushed)
                moved = transitions.redrive(image, now + delay_ms)
                st, fl, at, ep, dl = header_of(moved.image)[:5]
                for col, v in zip(cols, (rid, moved.due, st, fl, at, ep, dl, pushed, payload), strict=True):
                    col.append(v)
            c.execute(self._sql.delete_dead, (cols[0],))
            c.execute(self._sql.insert_live_rows, cols)
            c.execute(self._sql.notify, self._notify_args)
        return len(rows)

    def purge_dead(self, ids: Any = None) -> int:
        """Delete dead rows (all, or those of ``ids``) in one commit; returns how many."""
        wanted = _id_list(ids)
        self._check()
        with self._db._conn() as c:
            return int(c.execute(self._sql.purge, (wanted, wanted)).rowcount)

    def stats(self) -> QueueStats:
        """Counts and counters since this open (Q26).  The fields that describe files
        (shards, slots, header file sizes, compaction) are 0: PostgreSQL keeps the rows."""
        self._check_open()
        ready, leased, delayed, dead = self._db._read(lambda c: one(c.execute(self._sql.stats)))
        with self._lock:
            k = dict(self._counts)
        return QueueStats(
            name=self.name, len=ready + leased + delayed, dead_len=dead, ready=ready, leased=leased, delayed=delayed,
            shards=0, slots_allocated=0, version_vector_bytes=0, header_file_logical_bytes=0,
            header_file_physical_bytes=0, payload_writes=k["payload_writes"], compaction_bytes=0,
            payload_compaction_bytes=0, pushes=k["pushes"], acks=k["acks"], nacks=k["nacks"],
            dead_lettered=k["dead_lettered"], poisoned=k["poisoned"], expired_leases=k["expired_leases"],
            repaired_on_open=0, retention_retry_pending=0, orphans_collected=0,
        )

    def snapshot(self) -> np.ndarray:
        """Every live and dead row as a NumPy structured array (Q27), live rows in key
        order, then dead rows."""
        self._check_open()
        def read(c: psycopg.Connection[Any]) -> list[Any]:
            with c.transaction():
                return c.execute(self._sql.snapshot_live).fetchall() + c.execute(self._sql.snapshot_dead).fetchall()

        rows = self._db._read(read)
        out = np.zeros(len(rows), dtype=SNAPSHOT_DTYPE)
        if rows:
            arr = np.array(rows, dtype=np.int64)
            out["id"] = arr[:, 0]
            out["state"] = arr[:, 1]
            out["due"] = arr[:, 2].astype("datetime64[ms]")
            out["attempts"] = arr[:, 3]
            out["epoch"] = arr[:, 4]
            dl = arr[:, 5].astype("datetime64[ms]")
            dl[arr[:, 5] == 0] = np.datetime64("NaT")
            out["deadline"] = dl
        return out

    def snapshot_frame(self) -> Any:
        """:meth:`snapshot` as a ``pandas.DataFrame`` with ``state`` a categorical of the
        :class:`State` names (the ``notebook`` extra)."""
        import pandas as pd  # optional, heavy: only this method needs it (the notebook extra)

        df = pd.DataFrame(self.snapshot(), copy=False)
        df["state"] = pd.Categorical.from_codes(df["state"], categories=[s.name for s in State])
        return df

    def _on_close(self) -> None:
        self._closed = True
        self._wake(DbClosed(f"queue {self.name!r} (its PgDb was closed while waiting)"))

    def __reduce__(self) -> Any:
        raise ProcessBound("a PgQueue handle cannot be pickled; open the queue in the other process with "
                           "armdb.pg.connect(dsn).open_queue(spec, config)")

    def __repr__(self) -> str:
        return f"<armdb.pg.PgQueue {self.name!r} ({'var' if self.spec.var else 'fixed'})>"


def _resolve(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


def _id_list(ids: Any) -> list[int] | None:
    if ids is None:
        return None
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise ConfigError(f"ids must be an iterable of row ids (ints) or None, not {type(ids).__name__}")
    out = []
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 < int(i) < 1 << 63:
            raise ConfigError(f"ids must be row ids (positive ints), got {i!r}")
        out.append(int(i))
    return out

