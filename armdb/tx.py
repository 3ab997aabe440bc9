"""``db.tx()``: queue transitions and map writes in one atomic commit (SPEC T1-T7, Q14, Q21).

Commit protocol (docs/transactions.md):

1. Builder calls only record steps (payloads and keys are encoded at once, so
   a wrong type fails at the call).  Queue ids for explicit pushes are drawn
   before locking, which fixes the shard each push lands in.
2. ``commit`` takes every lock the commit needs, in one global order (by
   collection directory, then shard), so commits never deadlock each other or
   the direct operations, which hold one shard lock at a time:
   the Bitcask shard of each map key written; the header shard of each push,
   ack and nack; the Bitcask shard of each var body written or deleted; and, for
   a change stream, every shard of every destination queue and its payload
   collection (T7).
3. Under the locks: stream closures run (each change sees the state left by the
   steps before it), tokens are validated, the capacity rule is judged on the
   net effect per queue, slots and gsns are allocated, and every physical row
   is built as an absolute image.
4. One record with every row is appended to the transaction log; with
   ``durable`` it is fsynced (group commit) before anything is applied, so a
   power loss can never leave half a commit applied.
5. The rows are applied to the stores and the in-RAM indexes.  A failure here
   raises ``TxFailedAfterLog``; the next open replays the record.
6. The locks are released.  Stream commits hold them across the log sync too;
   so do durable commits in general, because the rows are applied only after
   the sync (write-ahead).

This module runs the protocol; it builds no queue row itself.  A queue takes part
through the few methods of ``Queue`` listed under "what a db.tx() commit calls" in
armdb/queue.py, which plan its pushes and settles into the commit's ``armdb.plan.Plan``
with row images from ``armdb.transitions``.
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from . import _fail
from ._clock import to_ms
from ._core.fixed import ack_rows, tomb_rows
from ._core.locks import draw_turns, serve_turns, take_for_plan, take_turns
from ._core.qshard import ABSENT
from .errors import (
    ConfigError,
    EncryptionKeyRequired,
    QueueFull,
    StaleToken,
    StorageError,
    StreamSourceRequiresTx,
    TxFailedAfterLog,
)
from .mapcodec import decode_value, encode_key, encode_value
from .maps import Map
from .plan import Plan
from .queue import Lease, LeaseToken, Queue, as_token, nack_args
from .streams import Change

if TYPE_CHECKING:
    from .db import Db

log = logging.getLogger("armdb")

__all__ = ["Tx", "TxSyncFailed"]


@dataclass(slots=True)
class _Push:
    queue: Queue[Any]
    body: bytes
    delay_ms: int
    seq: int = 0


@dataclass(slots=True)
class _Settle:
    queue: Queue[Any]
    token: LeaseToken
    ack: bool
    delay_ms: int | None = None
    dead: bool = False
    poisoned: bool = False  # dead-lettered by a lease that could not decode its body (not a nack)


@dataclass(slots=True)
class _DeadRows:
    """A redrive (or a purge) of a queue's dead rows (Q34): one commit for all of them."""

    queue: Queue[Any]
    ids: frozenset[int] | None
    redrive: bool
    delay_ms: int
    moved: int = 0


@dataclass(slots=True)
class _Batch:
    """A queue's ``push_many`` (Q31): one logged commit for the whole batch, planned by the
    queue (``Queue._tx_push_many``), which leaves its first id here.  (An ``ack_many``
    commits by :func:`commit_ack_many`, without a step.)"""

    queue: Queue[Any]
    args: tuple[Any, ...]
    result: Any = None


@dataclass(slots=True)
class _MapWrite:
    map: Map
    key: Any
    raw_key: bytes
    value: Any  # None for a delete
    raw_value: bytes | None


class TxSyncFailed(TxFailedAfterLog, StorageError):
    """A durable commit's log sync failed (S12): both ``TxFailedAfterLog`` (its record
    was appended, so the next open replays it if the record reached the disk) and
    ``StorageError`` (the disk refused the sync).  Nothing of the commit was applied,
    and the log refuses later commits until the database is reopened."""


class Tx:
    """A transaction builder (T1).  Every method records a step and returns the builder."""

    __slots__ = ("_db", "_durable", "_finished", "_sealed", "_steps")

    def __init__(self, db: Db) -> None:
        self._db = db
        self._steps: list[Any] = []
        self._durable = db.tx_config.durable
        self._finished = False
        # A step touches an encrypted collection (a map whose store seals, a queue whose
        # bodies are sealed; both fixed at open): the commit needs a sealed log (T4).
        self._sealed = False

    # -- builder ------------------------------------------------------------------------
    def _queue_arg(self, queue: object) -> Queue[Any]:
        if not isinstance(queue, Queue) or not queue._belongs_to(self._db):
            raise ConfigError("tx steps take a Queue handle opened on this Db (db.open_queue)")
        return queue

    def _map_arg(self, m: object) -> Map:
        if not isinstance(m, Map) or self._db._maps.get(m.name) is not m:
            raise ConfigError("tx steps take a Map handle opened on this Db (db.open_map)")
        return m

    def _open_step(self) -> None:
        if self._finished:
            raise ConfigError("this transaction was already committed or aborted; start a new db.tx()")

    def push(self, queue: Queue[Any], payload: Any, *, delay: timedelta | float | None = None) -> Tx:
        """Record a push; its id is in the list ``commit()`` returns.

        The payload is encoded and checked here, as ``Queue.push`` does: a value that
        does not match the queue's type or would not read back raises
        ``PayloadTypeError`` at this call, and the transaction holds nothing of it.
        """
        if self._finished:
            self._open_step()  # raises
        # _queue_arg's test inline (one frame less a step); it raises.
        q = queue if isinstance(queue, Queue) and queue._belongs_to(self._db) else self._queue_arg(queue)
        if delay is None:
            delay_ms = 0
        else:
            delay_ms = to_ms(delay, "delay")
            if delay_ms < 0 or delay_ms >= 1 << 62:
                raise ConfigError(f"delay must not be negative, nor reach past 2**62 ms, got {delay!r}")
        self._steps.append(_Push(q, q._encode(payload), delay_ms))
        if q._body_sealed:
            self._sealed = True
        return self

    def ack(self, queue: Queue[Any], token: Lease[Any] | LeaseToken) -> Tx:
        """Record an ack of a leased row (a ``Lease`` or its token; ``NotALease`` at this
        call for anything else, Q30)."""
        if self._finished:
            self._open_step()  # raises
        q = self._queue_arg(queue)
        self._steps.append(_Settle(q, as_token(token), True))
        if q._body_sealed:
            self._sealed = True
        return self

    def nack(self, queue: Queue[Any], token: Lease[Any] | LeaseToken, *, delay: timedelta | float | None = None,
             dead: bool = False) -> Tx:
        if self._finished:
            self._open_step()  # raises
        token = as_token(token)
        delay_ms = nack_args(delay, dead)
        q = self._queue_arg(queue)
        self._steps.append(_Settle(q, token, False, delay_ms, dead))
        if q._body_sealed:
            self._sealed = True
        return self

    def put(self, map: Map, key: Any, value: Any) -> Tx:
        """Record a map write; key and value are checked here as ``Map.put`` does
        (``PayloadTypeError`` at this call for a value that would not read back)."""
        if self._finished:
            self._open_step()  # raises
        # _map_arg's test inline (one frame less a step); it raises.
        m = map if isinstance(map, Map) and self._db._maps.get(map.name) is map else self._map_arg(map)
        self._steps.append(_MapWrite(m, key, encode_key(key), value, encode_value(value)))
        if m._store._encrypted:
            self._sealed = True
        return self

    def delete(self, map: Map, key: Any) -> Tx:
        if self._finished:
            self._open_step()  # raises
        m = self._map_arg(map)
        self._steps.append(_MapWrite(m, key, encode_key(key), None, None))
        if m._store._encrypted:
            self._sealed = True
        return self

    def durable(self) -> Tx:
        """fsync the log before ``commit()`` returns (power-loss atomicity, T3)."""
        if self._finished:
            self._open_step()  # raises
        self._durable = True
        return self

    def __enter__(self) -> Self:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if et is None:
            if not self._finished:
                self.commit()
        else:
            self.abort()

    def abort(self) -> None:
        """Drop every recorded step; nothing is written."""
        self._steps.clear()
        self._finished = True

    # -- commit ----------------------------------------------------------------------------
    def commit(self) -> list[int]:
        """Apply every step atomically; returns the ids of the explicit pushes in builder order.

        Raises
        ------
        QueueFull, StaleToken
            The queues' state refuses the commit; nothing is written.
        EncryptionKeyRequired
            The commit touches an encrypted collection and the Db has no log key.
        TxFailedAfterLog
            The commit is logged but applying it failed; the next open applies it.
            When the log sync itself failed, the error is also a ``StorageError``.
        """
        if self._finished:
            self._open_step()  # raises
        db = self._db
        if db._closed:
            db.check_open()  # raises DbClosed
        self._finished = True
        steps = self._steps
        if not steps:
            return []
        registry = db.schema
        stream_dest = self._stream_destinations(steps) if registry is not None else []
        if db.txlog.sealer is None:  # before anything is written, ids included
            if self._sealed:
                raise _log_key_required()
            for q in stream_dest:
                if q._body_sealed:
                    raise EncryptionKeyRequired(
                        f"change stream into encrypted queue {q.name!r} needs TxConfig(log_encryption_key=...)"
                    )
        plan = Plan(db.seqmap)
        # One pass before locking: the ids of the pushes (an id fixes its row's shard, so
        # its lock), every lock in the global order (docs/transactions.md), and the
        # queues to wake afterwards: a push, and a nack that makes its row ready again,
        # can end a wait (Q19).  A stale token adds no lock; the plan refuses it.
        # ``blind``: every step writes without reading stored state (a map put, a push into
        # a queue with no cap), so the commit may plan on top of commits that are logged
        # but not yet applied on its shards; any other commit waits until they applied.
        locks: dict[str, threading.Lock] = {}
        ids: list[int] = []
        wake: list[Queue[Any]] = []
        blind = not stream_dest
        for s in steps:
            t = type(s)
            if t is _MapWrite:
                k, lock = s.map._store.shard_lock(s.raw_key)
                locks[k] = lock
                if s.raw_value is None:
                    blind = False  # a delete asks whether the key exists
                continue
            q = s.queue
            if t is _Push:
                s.seq = seq = plan.draw(q._seq_name)  # reserved only if the commit goes ahead (T5)
                ids.append(seq)
                q._tx_locks(locks, seq, None)
                if q._max_depth is not None:
                    blind = False  # the cap counts live rows
            else:
                blind = False  # a settle checks its lease, a batch its rows
                q._tx_locks(locks, 0, s.token)
                if s.ack:
                    continue
            if q not in wake:
                wake.append(q)
        for q in stream_dest:
            q._tx_all_locks(locks)
        self._commit_locked(plan, steps, _ordered(locks), registry, wake, blind, bool(stream_dest))
        return ids

    def _commit_locked(self, plan: Plan, steps: list[Any], locks: list[Any], registry: Any,
                       wake: list[Queue[Any]], blind: bool, hold: bool = False) -> None:
        """The commit protocol (docs/transactions.md), in this one frame: take ``locks`` (in
        their order, ``armdb._core.locks.take_for_plan``); under them run the streams (their
        destinations join ``wake``), plan every row into ``plan`` and log them.  A commit
        that syncs, or that queues behind commits logged before it on one of its shards,
        then draws a turn on every shard and releases the locks: it syncs while later
        commits plan and log, waits for its turns (the log's order on each shard), takes
        the locks again and applies.  Any other applies at once under the locks.  Then,
        unlocked, run the log's checkpoint if it is due (it syncs the stores, so it takes
        their locks) and the compactions a rotation under the locks deferred, and wake
        ``wake``.  ``hold``: a commit that feeds a change stream keeps every lock of its
        destinations through its sync (T7); it planned on drained shards, so nothing
        queues ahead of it."""
        db = self._db
        txlog = db.txlog
        now = int(db.clock())
        durable = self._durable
        held = 0
        tickets: list[int] | None = None
        try:
            behind = take_for_plan(locks, blind, txlog)
            held = len(locks)
            try:
                if registry is not None:
                    self._expand_streams(steps, registry, plan, wake)
                self._plan(steps, plan, now)
                # A store fenced by a failed sync refuses the commit before it is logged
                # (its rows could not be applied; replay would apply them at the reopen).
                for store in plan.bitcask:
                    if store._closed or store._poisoned is not None:
                        store.check_writable()  # raises
                for shard in plan.fixed:
                    if shard.poisoned is not None or shard.sf.closed:
                        shard.check_writable()  # raises
                # Only a commit that goes ahead persists the id blocks it drew.
                if plan.drawn:
                    for name, n in plan.drawn.items():
                        db.seqmap.reserve_through(name, n)
                end = txlog.append(plan.rows, plan.packed, behind)
            except BaseException:
                plan.give_back()
                raise
            if (durable and not hold) or behind:
                # Turns are drawn under the locks, right after the append: on each shard
                # they follow the log's order.
                tickets = draw_turns(locks)
                held = 0
            synced = not durable
            try:
                if not synced:
                    # Write-ahead: the record is on disk before any row is applied.  Threads
                    # committing at once share one fdatasync (TxLog.sync_to, group commit).
                    txlog.sync_to(end)
                    synced = True
                if tickets is not None:
                    take_turns(locks, tickets)
                    held = len(locks)
                for fn in plan.apply:
                    fn()
                _fail.point("txlog.after_apply")
                for fixed_shard in plan.fixed:
                    fixed_shard.raise_sync_error()  # applied in full; its sync failed
            except BaseException as e:
                err = self._failed_after_log(steps, plan, e, sync_failed=not synced)
                txlog.done()  # only once the stores are fenced: a checkpoint may follow
                raise err from e
            checkpoint_due = txlog.done()
        finally:
            if tickets is not None:
                # Every turn drawn is handed on once, in its turn, whatever happened: the
                # commits behind this one apply (or, fenced, fail) and direct calls wait.
                serve_turns(locks, tickets)
            while held:
                held -= 1
                locks[held].release()
        if checkpoint_due:
            txlog.checkpoint_after_commit()
        for store in plan.bitcask:
            if store._compact_deferred:  # maybe_compact's own test, without its call
                store.maybe_compact()
        if plan.payload_writes:
            for q, n in plan.payload_writes.items():
                q._tx_count_payload_writes(n)
        for q in wake:
            q._notify()

    def _failed_after_log(self, steps: list[Any], plan: Plan, e: BaseException, *,
                          sync_failed: bool = False) -> TxFailedAfterLog:
        """Fence the stores of a commit that was logged but not (fully) applied."""
        queues = {s.queue for s in steps if type(s) in (_Push, _Settle, _DeadRows, _Batch)}
        return _fence_after_log(queues, plan.fixed, plan.bitcask, e, sync_failed)

    # -- commit helpers ------------------------------------------------------------------------
    def _stream_destinations(self, steps: list[Any]) -> list[Queue[Any]]:
        db = self._db
        registry = db.schema
        assert registry is not None
        stream_dest: list[Queue[Any]] = []
        for s in steps:
            if type(s) is _MapWrite:
                for st in registry.streams_for(s.map.name):
                    q = db._queues.get(st.queue.name)
                    if q is None:
                        raise ConfigError(
                            f"change stream {s.map.name!r} -> {st.queue.name!r}: open the queue before "
                            f"committing writes to its source"
                        )
                    if q not in stream_dest:
                        stream_dest.append(q)
        return stream_dest

    def _expand_streams(self, steps: list[Any], registry: Any, plan: Plan, wake: list[Queue[Any]]) -> None:
        """Run the stream closures (under the locks) and append their pushes (T6); the
        queues they push to join ``wake``."""
        view: dict[tuple[str, bytes], Any] = {}
        extra: list[_Push] = []
        for s in steps:
            if type(s) is not _MapWrite:
                continue
            streams = registry.streams_for(s.map.name)
            k = (s.map.name, s.raw_key)
            if k in view:
                old = view[k]
            else:
                raw = s.map.store.get_locked(s.raw_key)
                old = None if raw is None else decode_value(raw)
            view[k] = s.value
            if old is None and s.value is None:
                continue  # deleting a missing key changes nothing, so it emits nothing (T1)
            for st in streams:
                out = st.emit(Change(s.key, old, s.value))
                if out is None:
                    continue
                q = self._db._queues[st.queue.name]
                for payload in out if isinstance(out, list) else [out]:
                    body = q._encode(payload)  # PayloadTypeError aborts the commit
                    extra.append(_Push(q, body, 0, plan.draw(q._seq_name)))
                    if q not in wake:
                        wake.append(q)
        steps.extend(extra)

    def _plan(self, steps: list[Any], plan: Plan, now: int) -> None:
        if len(steps) == 1:
            s = steps[0]
            t = type(s)
            if t is _Batch:
                s.result = s.queue._tx_push_many(plan, *s.args, now=now)
                return
            if t is _DeadRows:
                s.moved = s.queue._tx_dead_rows(plan, s.ids, s.redrive, s.delay_ms, now)
                return
            if t is _Settle:
                # A lone settle (a var queue's nack): no push to cap, no second token.
                s.queue._tx_settle(plan, s.token, s.ack, s.delay_ms, s.dead, s.poisoned, now)
                return
        # Q21: judge each queue's cap once, on the net effect.
        net: dict[Queue[Any], list[int]] | None = None
        settles = False
        for s in steps:
            t = type(s)
            if t is _Push:
                if s.queue._max_depth is not None:
                    net = net if net is not None else {}
                    net.setdefault(s.queue, [0, 0])[0] += 1
            elif t is _Settle:
                settles = True
                if s.ack and s.queue._max_depth is not None:
                    net = net if net is not None else {}
                    net.setdefault(s.queue, [0, 0])[1] += 1
        if net is not None:
            for q, (pushes, acks) in net.items():
                cap = q._max_depth
                if cap is not None and pushes > acks:
                    live = q.len()
                    if live - acks + pushes > cap:
                        raise QueueFull(
                            f"queue {q.name!r}: this transaction would leave {live - acks + pushes} live "
                            f"rows, above max_depth={cap}; nothing was written"
                        )
        if settles:
            seen_tokens: set[LeaseToken] = set()
            for s in steps:
                if type(s) is _Settle:
                    if isinstance(s.token, LeaseToken) and s.token in seen_tokens:
                        raise StaleToken(
                            f"row {s.token.seq} is settled twice in one transaction; nothing was written"
                        )
                    s.queue._tx_settle(plan, s.token, s.ack, s.delay_ms, s.dead, s.poisoned, now)
                    seen_tokens.add(s.token)
        for s in steps:
            t = type(s)
            if t is _Push:
                s.queue._tx_push(plan, s.seq, s.body, now, s.delay_ms)
            elif t is _MapWrite:
                m = s.map
                raw_key = s.raw_key
                raw_value = s.raw_value
                if raw_value is None and not _key_exists(steps, s):
                    continue  # deleting a missing key is a no-op (T1)
                gsn = plan.gsn()
                plan.rows.append(["B", m.name, raw_key, raw_value, gsn])
                store = m._store
                if store not in plan.bitcask:  # plan.add_bitcask, one frame less
                    plan.bitcask.append(store)
                plan.apply.append(functools.partial(m._tx_write, raw_key, raw_value, gsn))


def _key_exists(steps: list[Any], delete: _MapWrite) -> bool:
    """Whether the key that the map delete step ``delete`` names exists when the step
    runs: as the last write of that key earlier in the same commit left it, else as
    stored (the caller holds the key's shard lock)."""
    before = False
    for s in reversed(steps):
        if s is delete:
            before = True
        elif before and type(s) is _MapWrite and s.map is delete.map and s.raw_key == delete.raw_key:
            return s.raw_value is not None
    return delete.map._store.contains_locked(delete.raw_key)


def _fence_after_log(queues: Any, fixed: list[Any], bitcask: list[Any], e: BaseException,
                     sync_failed: bool = False) -> TxFailedAfterLog:
    """Fence what a commit that was logged but not (fully) applied touched: its
    ``queues`` pause retention (Q25), its ``fixed`` header shards and ``bitcask`` stores
    refuse later writes until the reopen replays the record.  Returns the error to raise.
    The one copy of this handling: :meth:`Tx._failed_after_log` and the lean ack of
    :func:`commit_settle` both call it."""
    reason = f"a logged transaction failed to apply ({e}); reopen the database"
    for q in queues:
        q._tx_fence()  # Q25
    # Later writes to these stores would take versions and gsns that make
    # replay skip the logged rows: refuse them until the reopen replays.
    for fixed_shard in fixed:
        if fixed_shard.poisoned is None:
            fixed_shard.poisoned = e
    for store in bitcask:
        store.poison(reason)
    if sync_failed and isinstance(e, StorageError):
        return TxSyncFailed(
            f"the transaction was logged but the log sync failed ({e}); nothing of it was applied. "
            f"Reopen the database: the commit is there if its record reached the disk"
        )
    return TxFailedAfterLog(
        f"the transaction was logged but applying it failed ({e}); reopen the database "
        f"to finish it"
    )


def commit_settle(db: Db, q: Queue[Any], token: LeaseToken, ack: bool, delay_ms: int | None = None,
                  dead: bool = False, poisoned: bool = False) -> None:
    """``db.tx().ack(q, token).commit()`` (or ``.nack(...)``) for a var queue's own
    ``Queue.ack``/``nack`` (Q7, Q14), without the builder.

    An ack runs the commit protocol here, in this one frame, without a plan: both locks
    (the header shard's and the body's payload shard's, in the global order, which the
    queue keeps ready per header shard), the lease check (``QueueShard.settle_slot``),
    one log record with the header's delete and the body's tombstone, then both applied;
    a failure after the log append fences the stores through :func:`_fence_after_log`,
    the same handling as every other commit's.  (The last profile gave the general
    path's plan, closures, step and builder objects about 60k of a var ack's 107k
    instructions.)

    The common ack (this handle's unaltered token, a body store of one unencrypted
    shard) does not come here: ``VarFast.ack`` runs these same steps in compiled code
    (``armdb._core.qshard.VarFast._commit_ack``, tested against this function), with the
    same failure handling through :func:`_fence_after_log`.

    A nack builds the step and commits it by :meth:`Tx._commit_locked`, whose planner
    hands a lone settle straight to ``Queue._tx_settle``; it takes only its header
    shard's lock (it leaves the body alone).  Neither emits stream jobs, so there is no
    stream pass and no stream destination to lock.

    ``poisoned``: the dead-letter of a row whose body a lease could not decode
    (``Queue._dead_letter_poisoned``); the same transition as ``nack(dead=True)``,
    not counted as a nack.
    """
    if not ack:
        locks: dict[str, threading.Lock] = {}
        q._tx_locks(locks, 0, token, body=False)  # none for a token of no shard of q: the plan refuses it
        _commit_queue_step(db, q, _Settle(q, token, ack, delay_ms, dead, poisoned), _ordered(locks))
        return
    if db._closed:
        db.check_open()
    txlog = db.txlog
    payload = q._payload
    assert payload is not None
    if txlog.sealer is None and q._body_sealed:  # payload.encrypted, read at open
        raise _log_key_required()
    # The fields by one unpacking: a NamedTuple's field by name is a descriptor call each.
    # The caller checked that the token is of q's handle and names one of its shards
    # (VarFast.ack by lone_token's checks, Queue._ack by _token_shard).
    _, shard_no, due, seq, epoch = token
    sh = q._shards[shard_no]
    pair = q._ack_locks
    first, second = pair[shard_no] if pair is not None else _ordered(q._tx_ack_locks(sh, seq.to_bytes(8, "big")))
    fixed = sh.fixed
    # The locks by acquire and release, not ``with``: a with statement looks up and binds
    # __enter__ and __exit__ at every pass (about 1k instructions each).
    first.acquire()
    try:
        second.acquire()
        try:
            slot, version = sh.settle_slot(due, seq, epoch)
            if slot < 0:
                raise q._stale(token, version == ABSENT)
            # Refused before anything is logged: a store fenced by a failed sync, a closed one.
            if fixed.poisoned is not None or fixed.sf.closed:
                fixed.check_writable()
            if payload._poisoned is not None or payload._closed:
                payload.check_writable()
            # The body tombstone's gsn, from the store's own gsn source (the Db's
            # SeqMap.drawer("gsn"), compiled): reserved on disk before it is returned, as a
            # Bitcask put's is.  The checks that can refuse this ack ran above, so only a
            # failed log append can leave it unused, and an unused gsn is a gap, which
            # nothing reads.
            gsn = payload._gsn()
            fhead, bhead = q._ack_heads
            body, key = ack_rows(fhead, fixed.index, slot, version, bhead, seq, gsn)
            end = txlog.append_body(body)
            if db.tx_config.durable:
                try:
                    txlog.sync_to(end)  # write-ahead: on disk before anything is applied
                except BaseException as e:
                    err = _fence_after_log((q,), [fixed], [payload], e, True)
                    txlog.done()
                    raise err from e
            try:
                sh.ack_slot(due, seq, slot, version)
                # (No cache entry to drop: a lease takes its row's body out of the cache.)
                payload.tomb_locked(key, gsn)
                _fail.point("txlog.after_apply")
                fixed.raise_sync_error()  # applied in full; its sync failed
            except BaseException as e:
                err = _fence_after_log((q,), [fixed], [payload], e)
                txlog.done()  # only once the stores are fenced: a checkpoint may follow
                raise err from e
            checkpoint_due = txlog.done()
        finally:
            second.release()
    finally:
        first.release()
    if checkpoint_due:
        txlog.checkpoint_after_commit()
    if payload._compact_deferred:  # maybe_compact's own test, without its call
        payload.maybe_compact()


def commit_dead_rows(db: Db, q: Queue[Any], ids: frozenset[int] | None, redrive: bool, delay_ms: int) -> int:
    """``Queue.redrive`` and ``Queue.purge_dead`` (Q34): every chosen dead row of ``q``
    moves in one logged commit, under all of the queue's locks (and its body store's, for
    a purge), by the same :meth:`Tx._commit_locked`; returns how many moved."""
    locks: dict[str, threading.Lock] = {}
    q._tx_all_locks(locks)
    step = _DeadRows(q, ids, redrive, delay_ms)
    _commit_queue_step(db, q, step, _ordered(locks))
    return step.moved


def commit_batch(db: Db, q: Queue[Any], args: tuple[Any, ...]) -> Any:
    """``Queue.push_many`` (Q31): the whole batch in one logged commit, under all of the
    queue's locks, by the same :meth:`Tx._commit_locked`; returns what the queue's plan of
    it returned.  (``Queue.ack_many`` commits by :func:`commit_ack_many`.)"""
    locks: dict[str, threading.Lock] = {}
    q._tx_all_locks(locks)
    step = _Batch(q, args)
    _commit_queue_step(db, q, step, _ordered(locks))
    return step.result


def commit_ack_many(db: Db, q: Queue[Any], shard_nos: Any, dues: Any, seqs: Any, epochs: Any,
                    cached: bool = True) -> int:
    """``Queue.ack_many`` (Q14, Q32): the acks of a batch (ids distinct) in one logged
    commit, all or nothing, run here in one frame without a plan (as the lone ack of
    :func:`commit_settle`): every lock of the queue in the global order, the leases
    checked and the header rows built by the queue (``Queue._tx_plan_acks``, nothing
    changed if one is stale), then one log record with the bodies' tombstones (a var
    queue) ahead of the headers' deletes, synced first when durable (write-ahead), then
    the headers applied, then the tombstones (``BitcaskStore.delete_many_locked``) and
    the cache drops (none when ``cached`` is False: the batch's lease took its bodies out
    of the cache).  A failure after the log append fences the stores through
    :func:`_fence_after_log`, the same handling as every other commit's.  Returns how
    many were acked."""
    if db._closed:
        db.check_open()
    txlog = db.txlog
    if txlog.sealer is None and q._body_sealed:  # payload.encrypted, read at open
        raise _log_key_required()
    payload = q._payload
    n = len(seqs)
    lockmap: dict[str, threading.Lock] = {}
    q._tx_all_locks(lockmap)
    locks = _ordered(lockmap)
    checkpoint_due = False
    held = 0
    try:
        for lock in locks:
            lock.acquire()
            held += 1
        heads = bytearray()
        planned = q._tx_plan_acks(shard_nos, dues, seqs, epochs, heads)  # StaleToken: nothing changed
        # Refused before anything is logged: a store fenced by a failed sync, a closed one.
        fixed = [p[0].fixed for p in planned]
        for f in fixed:
            if f.poisoned is not None or f.sf.closed:
                f.check_writable()
        if payload is not None:
            if payload._poisoned is not None or payload._closed:
                payload.check_writable()
            # The tombstones' gsns, reserved on disk before the record that uses them is
            # logged; the bodies' rows first in the record, as every commit logs them.
            seqmap = db.seqmap
            g0 = seqmap.draw_block("gsn", n)
            seqmap.reserve_through("gsn", g0 + n - 1)
            ids = np.ascontiguousarray(seqs, dtype=np.uint64)
            body = bytearray()
            keys = tomb_rows(q._body_row_head, ids, g0, body)
            body += heads
            end = txlog.append([], [(2 * n, bytes(body))])
        else:
            end = txlog.append([], [(n, bytes(heads))])
        if db.tx_config.durable:
            try:
                txlog.sync_to(end)  # write-ahead: on disk before anything is applied
            except BaseException as e:
                err = _fence_after_log((q,), fixed, [payload] if payload is not None else [], e, True)
                txlog.done()
                raise err from e
        try:
            q._tx_apply_acks(planned)
            if payload is not None:
                payload.delete_many_locked(keys, g0)
                if cached:  # (False: the batch's lease took its bodies out of the cache)
                    q._cache_drop_many(ids)
            _fail.point("txlog.after_apply")
            for f in fixed:
                f.raise_sync_error()  # applied in full; its sync failed
        except BaseException as e:
            err = _fence_after_log((q,), fixed, [payload] if payload is not None else [], e)
            txlog.done()  # only once the stores are fenced: a checkpoint may follow
            raise err from e
        checkpoint_due = txlog.done()
    finally:
        while held:
            held -= 1
            locks[held].release()
    if checkpoint_due:
        txlog.checkpoint_after_commit()
    if payload is not None:
        payload.maybe_compact()
    return n


def _commit_queue_step(db: Db, q: Queue[Any], step: Any, locks: list[threading.Lock]) -> None:
    """Commit one step a queue runs by itself (a settle, a dead-row move, a batch) without
    the builder, under ``locks`` (in the global order): it emits no stream jobs, so there
    is no stream pass and no stream destination to lock, and the same
    :meth:`Tx._commit_locked` logs and applies it."""
    db.check_open()
    if db.txlog.sealer is None and q._body_sealed:
        raise _log_key_required()
    tx = Tx(db)
    tx._finished = True
    # A nack and a redrive make rows ready, and a batch of pushes adds them (Q19).
    t = type(step)
    woken = t is _Batch or (t is _Settle and not step.ack) or (t is _DeadRows and step.redrive)
    tx._commit_locked(Plan(db.seqmap), [step], locks, None, [q] if woken else [], blind=False)


def _ordered(locks: dict[str, threading.Lock]) -> list[threading.Lock]:
    """The locks in the global order: by shard directory (docs/transactions.md)."""
    n = len(locks)
    if n == 1:
        return list(locks.values())
    if n == 2:  # the common commit (a var ack; a put and a push): one comparison
        (ka, la), (kb, lb) = locks.items()
        return [la, lb] if ka < kb else [lb, la]
    return [locks[k] for k in sorted(locks)]


def _log_key_required() -> EncryptionKeyRequired:
    return EncryptionKeyRequired(
        "this transaction touches an encrypted collection; open the Db with "
        "TxConfig(log_encryption_key=...) so the log never holds its plaintext"
    )


def direct_put_refused(name: str) -> StreamSourceRequiresTx:
    return StreamSourceRequiresTx(
        f"map {name!r} is a change-stream source; write it inside db.tx() so its emitted jobs commit with it"
    )
