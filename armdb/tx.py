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
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any

from . import _fail
from ._clock import to_ms
from ._core import fixed as _k
from .errors import (
    ConfigError,
    EncryptionKeyRequired,
    QueueFull,
    StaleToken,
    StreamSourceRequiresTx,
    TxFailedAfterLog,
)
from .fixed import DELETED, OCCUPIED
from .maps import Map, decode_value, encode_key, encode_value
from .queue import DEAD_BIT, FLAG_DEAD_EXPLICIT, LeaseToken, Queue, State, _pack_row
from .streams import Change

if TYPE_CHECKING:
    from .db import Db

log = logging.getLogger("armdb")

__all__ = ["Tx"]


@dataclass
class _Push:
    queue: Queue[Any]
    body: bytes
    delay_ms: int
    explicit: bool
    seq: int = 0


@dataclass
class _Settle:
    queue: Queue[Any]
    token: LeaseToken
    ack: bool
    delay_ms: int | None = None
    dead: bool = False


@dataclass
class _MapWrite:
    map: Map
    key: Any
    raw_key: bytes
    value: Any  # None for a delete
    raw_value: bytes | None


@dataclass
class _Plan:
    rows: list[list[Any]] = field(default_factory=list)
    apply: list[Any] = field(default_factory=list)  # callables run after the log append
    allocated: list[tuple[Any, int]] = field(default_factory=list)  # (FixedShard, slot) to undo
    payload_writes: dict[Queue[Any], int] = field(default_factory=dict)
    bitcask: set[Any] = field(default_factory=set)  # Bitcask stores written
    fixed: set[Any] = field(default_factory=set)  # FixedStore shards written


class Tx:
    """A transaction builder (T1).  Every method records a step and returns the builder."""

    def __init__(self, db: Db) -> None:
        self._db = db
        self._steps: list[Any] = []
        self._durable = db.tx_config.durable
        self._finished = False
        self._drawn: dict[str, int] = {}  # seqmap name -> largest id drawn, reserved at commit

    def _draw(self, name: str) -> int:
        n = self._db.seqmap.draw(name)
        if n > self._drawn.get(name, 0):
            self._drawn[name] = n
        return n

    def _gsn(self) -> int:
        return self._draw("gsn")

    # -- builder ------------------------------------------------------------------------
    def _queue_arg(self, queue: object) -> Queue[Any]:
        if not isinstance(queue, Queue) or queue._db is not self._db:
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
        """Record a push; its id is in the list ``commit()`` returns."""
        self._open_step()
        q = self._queue_arg(queue)
        delay_ms = 0 if delay is None else to_ms(delay, "delay")
        if delay_ms < 0 or delay_ms >= 1 << 62:
            raise ConfigError(f"delay must not be negative, nor reach past 2**62 ms, got {delay!r}")
        self._steps.append(_Push(q, q._codec.encode(payload), delay_ms, True))
        return self

    def ack(self, queue: Queue[Any], token: LeaseToken) -> Tx:
        self._open_step()
        self._steps.append(_Settle(self._queue_arg(queue), token, True))
        return self

    def nack(self, queue: Queue[Any], token: LeaseToken, *, delay: timedelta | float | None = None,
             dead: bool = False) -> Tx:
        self._open_step()
        if not isinstance(dead, bool):
            raise ConfigError("dead must be True or False")
        delay_ms = None if delay is None else to_ms(delay, "delay")
        if delay_ms is not None and delay_ms < 0:
            raise ConfigError(f"delay must not be negative, got {delay!r}")
        self._steps.append(_Settle(self._queue_arg(queue), token, False, delay_ms, dead))
        return self

    def put(self, map: Map, key: Any, value: Any) -> Tx:
        self._open_step()
        m = self._map_arg(map)
        self._steps.append(_MapWrite(m, key, encode_key(key), value, encode_value(value)))
        return self

    def delete(self, map: Map, key: Any) -> Tx:
        self._open_step()
        m = self._map_arg(map)
        self._steps.append(_MapWrite(m, key, encode_key(key), None, None))
        return self

    def durable(self) -> Tx:
        """fsync the log before ``commit()`` returns (power-loss atomicity, T3)."""
        self._open_step()
        self._durable = True
        return self

    def __enter__(self) -> Tx:
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
        """
        self._open_step()
        db = self._db
        db.check_open()
        self._finished = True
        steps = self._steps
        if not steps:
            return []
        registry = db.schema
        stream_dest: list[Queue[Any]] = []
        if registry is not None:
            for s in steps:
                if isinstance(s, _MapWrite):
                    for st in registry.streams_for(s.map.name):
                        q = db._queues.get(st.queue.name)
                        if q is None:
                            raise ConfigError(
                                f"change stream {s.map.name!r} -> {st.queue.name!r}: open the queue before "
                                f"committing writes to its source"
                            )
                        if q not in stream_dest:
                            stream_dest.append(q)
        self._check_keys(steps, stream_dest)  # before anything is written, ids included
        # Ids for explicit pushes fix their shards before locking.
        for s in steps:
            if isinstance(s, _Push):
                s.seq = self._draw(s.queue._seq_name)
        now = int(db.clock())
        with ExitStack() as locks:
            for _, lock in self._lock_order(steps, stream_dest):
                locks.enter_context(lock)
            plan = _Plan()
            try:
                self._expand_streams(steps, registry, now)
                self._plan(steps, plan, now)
            except BaseException:
                for shard, slot in reversed(plan.allocated):
                    shard.unalloc(slot)
                raise
            try:
                # Only a commit that goes ahead persists the id blocks it drew.
                for name, n in self._drawn.items():
                    db.seqmap.reserve_through(name, n)
                _txid, end = db.txlog.append(plan.rows)
            except BaseException:
                for shard, slot in reversed(plan.allocated):
                    shard.unalloc(slot)
                raise
            try:
                if self._durable:
                    # Write-ahead: the record is on disk before any row is applied.
                    db.txlog.sync_to(end)
                for fn in plan.apply:
                    fn()
                _fail.point("txlog.after_apply")
                for fixed_shard in plan.fixed:
                    fixed_shard.raise_sync_error()  # applied in full; its sync failed
            except BaseException as e:
                reason = f"a logged transaction failed to apply ({e}); reopen the database"
                for q in {s.queue for s in steps if isinstance(s, (_Push, _Settle))}:
                    q._retention_paused = True  # Q25
                # Later writes to these stores would take versions and gsns that make
                # replay skip the logged rows: refuse them until the reopen replays.
                for fixed_shard in plan.fixed:
                    if fixed_shard.poisoned is None:
                        fixed_shard.poisoned = e
                for bitcask in plan.bitcask:
                    bitcask.poison(reason)
                raise TxFailedAfterLog(
                    f"the transaction was logged but applying it failed ({e}); reopen the database "
                    f"to finish it"
                ) from e
            finally:
                db.txlog.done()
        for bitcask in plan.bitcask:
            bitcask.maybe_compact()  # a rotation under our locks deferred its compaction
        for q, n in plan.payload_writes.items():
            with q._counter_lock:
                q._payload_writes += n
        for q in {s.queue for s in steps if isinstance(s, _Push)}:
            q._notify()
        return [s.seq for s in steps if isinstance(s, _Push) and s.explicit]

    # -- commit helpers ------------------------------------------------------------------------
    def _check_keys(self, steps: list[Any], stream_dest: list[Queue[Any]]) -> None:
        if not self._db.txlog.needs_key():
            return
        for s in steps:
            enc = False
            if isinstance(s, _MapWrite):
                enc = s.map.store.encrypted
            elif isinstance(s, (_Push, _Settle)):
                enc = s.queue._payload is not None and s.queue._payload.encrypted
            if enc:
                raise EncryptionKeyRequired(
                    "this transaction touches an encrypted collection; open the Db with "
                    "TxConfig(log_encryption_key=...) so the log never holds its plaintext"
                )
        for q in stream_dest:
            if q._payload is not None and q._payload.encrypted:
                raise EncryptionKeyRequired(
                    f"change stream into encrypted queue {q.name!r} needs TxConfig(log_encryption_key=...)"
                )

    def _lock_order(self, steps: list[Any], stream_dest: list[Queue[Any]]) -> list[tuple[tuple[str, int], Any]]:
        locks: dict[tuple[str, int], Any] = {}

        def q_shard(q: Queue[Any], i: int) -> None:
            sh = q._shards[i]
            locks[(sh.fixed.directory, 0)] = sh.lock

        def body(q: Queue[Any], seq: int) -> None:
            if q._payload is not None:
                key = q._key_bytes(seq)
                locks[q._payload.lock_key(key)] = q._payload.lock_for(key)

        for s in steps:
            if isinstance(s, _Push):
                q_shard(s.queue, s.seq % len(s.queue._shards))
                body(s.queue, s.seq)
            elif isinstance(s, _Settle):
                if isinstance(s.token, LeaseToken) and 0 <= s.token.shard < len(s.queue._shards):
                    q_shard(s.queue, s.token.shard)
                    body(s.queue, s.token.seq)
            else:
                locks[s.map.store.lock_key(s.raw_key)] = s.map.store.lock_for(s.raw_key)
        for q in stream_dest:
            for i in range(len(q._shards)):
                q_shard(q, i)
            if q._payload is not None:
                for k, lock in q._payload.all_locks():
                    locks[k] = lock
        return sorted(locks.items(), key=lambda kv: kv[0])

    def _expand_streams(self, steps: list[Any], registry: Any, now: int) -> None:
        """Run the stream closures (under the locks) and append their pushes (T6)."""
        if registry is None:
            return
        view: dict[tuple[str, bytes], Any] = {}
        extra: list[_Push] = []
        for s in list(steps):
            if not isinstance(s, _MapWrite):
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
                    body = q._codec.encode(payload)  # PayloadTypeError aborts the commit
                    p = _Push(q, body, 0, False, self._draw(q._seq_name))
                    extra.append(p)
        steps.extend(extra)

    def _plan(self, steps: list[Any], plan: _Plan, now: int) -> None:
        # Q21: judge each queue's cap once, on the net effect.
        net: dict[Queue[Any], list[int]] = {}
        for s in steps:
            if isinstance(s, _Push):
                net.setdefault(s.queue, [0, 0])[0] += 1
            elif isinstance(s, _Settle) and s.ack:
                net.setdefault(s.queue, [0, 0])[1] += 1
        for q, (pushes, acks) in net.items():
            cap = q.config.max_depth
            if cap is not None and pushes > acks:
                live = q.len()
                if live - acks + pushes > cap:
                    raise QueueFull(
                        f"queue {q.name!r}: this transaction would leave {live - acks + pushes} live rows, "
                        f"above max_depth={cap}; nothing was written"
                    )
        seen_tokens: set[LeaseToken] = set()
        map_state: dict[tuple[str, bytes], bool] = {}
        for s in steps:
            if isinstance(s, _Settle):
                if s.token in seen_tokens if isinstance(s.token, LeaseToken) else False:
                    raise StaleToken(f"row {s.token.seq} is settled twice in one transaction; nothing was written")
                self._plan_settle(s, plan, now)
                seen_tokens.add(s.token)
        for s in steps:
            if isinstance(s, _Push):
                self._plan_push(s, plan, now)
            elif isinstance(s, _MapWrite):
                self._plan_map(s, plan, map_state)

    def _plan_push(self, s: _Push, plan: _Plan, now: int) -> None:
        q = s.queue
        sh = q._shards[s.seq % len(q._shards)]
        due = now + s.delay_ms
        slot = sh.fixed.alloc()
        plan.allocated.append((sh.fixed, slot))
        version = _k.ring_next(int(sh.fixed.versions[slot]))
        if q._payload is not None:
            row = _pack_row(due, s.seq, State.READY, 0, 0, 0, 0, s.seq, now)
            key = q._key_bytes(s.seq)
            gsn = self._gsn()
            plan.rows.append(["B", q.spec.payload_name, key, s.body, gsn])
            plan.bitcask.add(q._payload)
            plan.apply.append(lambda st=q._payload, k=key, b=s.body, g=gsn: st.write_locked(k, b, g))
            plan.apply.append(lambda: q._cache_put(s.seq, s.body))
            plan.payload_writes[q] = plan.payload_writes.get(q, 0) + 1
        else:
            row = _pack_row(due, s.seq, State.READY, 0, 0, 0, 0, 0, now, s.body)
        plan.rows.append(["F", q.name, sh.fixed.index, slot, version, OCCUPIED, row])
        plan.fixed.add(sh.fixed)

        def apply() -> None:
            sh.fixed.write(slot, row, version)
            sh.live.insert(due, s.seq, slot, 0)
            sh.pushes += 1

        plan.apply.append(apply)

    def _plan_settle(self, s: _Settle, plan: _Plan, now: int) -> None:
        q = s.queue
        token = s.token
        sh = q._token_shard(token)
        slot, hdr = q._validate_locked(sh, token)
        _state, flags, attempts, epoch, deadline, pid, pushed = hdr
        version = _k.ring_next(int(sh.fixed.versions[slot]))
        coll = q.name
        if s.ack:
            plan.rows.append(["F", coll, sh.fixed.index, slot, version, DELETED, b""])
            plan.fixed.add(sh.fixed)
            if q._payload is not None:
                key = q._key_bytes(token.seq)
                gsn = self._gsn()
                plan.rows.append(["B", q.spec.payload_name, key, None, gsn])
                plan.bitcask.add(q._payload)
                plan.apply.append(lambda st=q._payload, k=key, g=gsn: st.write_locked(k, None, g))

            def apply_ack() -> None:
                sh.fixed.free(slot, version)
                sh.live.remove(token.due, token.seq)
                q._cache_drop(token.seq)
                sh.acks += 1

            plan.apply.insert(len(plan.apply) - (1 if q._payload is not None else 0), apply_ack)
            return
        extra = b"" if q._payload is not None else q._payload_bytes(sh, slot)
        if s.dead or attempts >= q.config.max_attempts:
            if s.dead:
                flags |= FLAG_DEAD_EXPLICIT
            dkey = DEAD_BIT | now
            row = _pack_row(dkey, token.seq, State.DEAD, flags, attempts, epoch, deadline, pid, pushed, extra)

            def apply_dead() -> None:
                sh.fixed.write(slot, row, version)
                sh.live.remove(token.due, token.seq)
                sh.dead.insert(dkey, token.seq, slot, 0)
                sh.nacks += 1
                sh.dead_lettered += 1
                q._note_dead(now)

            plan.rows.append(["F", coll, sh.fixed.index, slot, version, OCCUPIED, row])
            plan.fixed.add(sh.fixed)
            plan.apply.append(apply_dead)
            return
        wait = s.delay_ms if s.delay_ms is not None else int(round(q.config.backoff_for(attempts) * 1000))
        due = now + wait
        row = _pack_row(due, token.seq, State.READY, flags, attempts, epoch, deadline, pid, pushed, extra)

        def apply_nack() -> None:
            sh.fixed.write(slot, row, version)
            sh.live.remove(token.due, token.seq)
            sh.live.insert(due, token.seq, slot, 0)
            sh.nacks += 1

        plan.rows.append(["F", coll, sh.fixed.index, slot, version, OCCUPIED, row])
        plan.fixed.add(sh.fixed)
        plan.apply.append(apply_nack)

    def _plan_map(self, s: _MapWrite, plan: _Plan, state: dict[tuple[str, bytes], bool]) -> None:
        store = s.map.store
        k = (s.map.name, s.raw_key)
        exists = state[k] if k in state else store.get_locked(s.raw_key) is not None
        if s.raw_value is None and not exists:
            state[k] = False
            return  # deleting a missing key is a no-op (T1)
        state[k] = s.raw_value is not None
        gsn = self._gsn()
        plan.rows.append(["B", s.map.name, s.raw_key, s.raw_value, gsn])
        plan.bitcask.add(store)
        m, raw_key, raw_value = s.map, s.raw_key, s.raw_value
        plan.apply.append(lambda: m._tx_write(raw_key, raw_value, gsn))


def direct_put_refused(name: str) -> StreamSourceRequiresTx:
    return StreamSourceRequiresTx(
        f"map {name!r} is a change-stream source; write it inside db.tx() so its emitted jobs commit with it"
    )
