"""Short, deterministic workloads shared by the power-loss (b), fault (c) and mutation (d) harnesses.

A :class:`World` names the collections of a database and how they are configured
(durable or not, encrypted or not).  A :class:`Session` opens it, runs named
operations and captures the observable state in a canonical, comparable form:

* per queue: every live and dead row as ``(id, state, flags, attempts, epoch, due
  word, deadline, payload bytes)``; a var row whose body cannot be found shows
  the payload ``NOBODY`` (a header without its payload, I4);
* per map: ``sorted(items())``.

Operations (``op`` strings, ``<q>``/``<m>`` are collection names):
``push:<q>``, ``lease:<q>`` (one row), ``ack:<q>`` / ``nack:<q>`` / ``dead:<q>`` (the
oldest token held), ``tx:<q>`` (push + ack of a held token in one commit),
``outbox:<q>:<m>`` (map put + queue push in one commit), ``put:<m>``,
``del:<m>``, ``reopen``.  ``durable`` worlds make every operation power-loss durable
before it returns: headers and bodies sync on every write (``sync_interval=0``),
transactions run with ``.durable()``.  Other worlds never sync on a timer
(``sync_interval`` of an hour), only at close, rotation and checkpoint, so the
recorded traces are deterministic.

The payload of push number ``n`` is derived from ``n`` (and a digest of it), so a
wrong or shifted payload is always detectable.  :func:`judge` compares a recovered
state with the states recorded after each operation.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

import armdb
from armdb import Config, Db, FixedConfig, QueueConfig, TxConfig
from armdb.errors import ArmdbError

START_MS = 1_700_000_000_000
FIXED_DTYPE = np.dtype([("n", "<u8"), ("h", "<u8")])
KEY = bytes(range(32))
LOG_KEY = bytes(range(100, 132))
NOBODY = b"<NOBODY>"
_HDR = struct.Struct("<BBHIqQq")


class FakeClock:
    def __init__(self, ms: int = START_MS) -> None:
        self.ms = ms

    def __call__(self) -> int:
        return self.ms


def payload_bytes(n: int, size: int = 40) -> bytes:
    """Body of push ``n``: its number, a digest, filler to ``size`` bytes."""
    head = b"J%08d:" % n + hashlib.sha256(b"%d" % n).digest()[:16]
    if size <= len(head):
        return head
    fill = (hashlib.sha256(head).digest() * (size // 32 + 1))[: size - len(head)]
    return head + fill


def fixed_payload(n: int) -> tuple[int, int]:
    h = int.from_bytes(hashlib.sha256(b"%d" % n).digest()[:8], "little")
    return (n, h)


@dataclass(frozen=True)
class World:
    """Collections and settings of one database."""

    queues: tuple[tuple[str, bool], ...] = (("vq", True),)  # (name, var)
    maps: tuple[str, ...] = ()
    durable: bool = True
    encrypted: bool = False
    payload_size: int = 40
    value_size: int = 48
    shards: int = 1
    grow_step: int = 64
    max_file_size: int = 64 * 1024
    max_attempts: int = 100
    checkpoint_bytes: int = 8192  # small: workloads checkpoint mid-run, not only at close

    def specs(self) -> dict[str, Any]:
        return {
            name: armdb.queue(name, payload=bytes, var=True)
            if var
            else armdb.queue(name, payload=FIXED_DTYPE)
            for name, var in self.queues
        }

    def fixed_config(self) -> FixedConfig:
        b = FixedConfig.balanced().grow_step(self.grow_step).shard_count(self.shards)
        return b.sync_interval(0 if self.durable else 3600).build()

    def bitcask_config(self) -> Config:
        b = Config.balanced().max_file_size(self.max_file_size).sync_interval(0 if self.durable else 3600)
        if self.encrypted:
            b = b.encryption_key(KEY)
        return b.build()

    def queue_config(self) -> QueueConfig:
        return (
            QueueConfig.balanced()
            .max_attempts(self.max_attempts)
            .backoff_secs([0])
            .lease_timeout(3600)
            .header_config(self.fixed_config())
            .payload_config(self.bitcask_config())
            .build()
        )

    def tx_config(self) -> TxConfig:
        return TxConfig(durable=self.durable, log_encryption_key=LOG_KEY if self.encrypted else None,
                        checkpoint_bytes=self.checkpoint_bytes)


class Session:
    """An open database of a :class:`World` plus the workload's own state (tokens, counters)."""

    def __init__(
        self, world: World, path: str, *, clock: FakeClock | None = None, quiet: bool = True
    ) -> None:
        self.world = world
        self.path = path
        self.clock = clock or FakeClock()
        self.quiet = quiet
        self.specs = world.specs()
        self.db: Db | None = None
        self.queues: dict[str, Any] = {}
        self.maps: dict[str, Any] = {}
        self.tokens: dict[str, list[Any]] = {name: [] for name, _ in world.queues}
        self.pushes = 0
        self.puts = 0
        # Every payload ever pushed (by push number) and every value ever put (by key),
        # so a harness can tell "older but once written" from "never written".
        self.pushed: dict[int, Any] = {}
        self.put_history: dict[bytes, list[bytes]] = {}

    # -- lifecycle ---------------------------------------------------------------------------------
    def open(self) -> Session:
        w = self.world
        self.db = Db.open(self.path, clock=self.clock, tx_config=w.tx_config())
        try:
            if self.quiet:
                quiesce(self.db)
            for name, _var in w.queues:
                self.queues[name] = self.db.open_queue(self.specs[name], w.queue_config())
            for m in w.maps:
                self.maps[m] = self.db.open_map(m, w.bitcask_config())
        except BaseException:
            with contextlib.suppress(Exception):  # the open's own error is the one to raise
                self.db.shutdown()
            self.db = None
            raise
        for name in self.tokens:
            self.tokens[name] = []
        return self

    def close(self) -> None:
        db, self.db = self.db, None
        self.queues = {}
        self.maps = {}
        if db is not None:
            db.shutdown()

    # -- operations --------------------------------------------------------------------------------
    def next_payload(self, q: str) -> Any:
        self.pushes += 1
        n = self.pushes
        var = dict(self.world.queues)[q]
        p = payload_bytes(n, self.world.payload_size) if var else fixed_payload(n)
        self.pushed[n] = p
        return p

    def next_value(self) -> tuple[bytes, bytes]:
        self.puts += 1
        n = self.puts
        key = b"k%03d" % (n % 7)
        val = payload_bytes(10_000 + n, self.world.value_size)
        self.put_history.setdefault(key, []).append(val)
        return key, val

    def run(self, op: str) -> Any:
        """Run one named operation; returns its result (ids, lease ids, ...)."""
        parts = op.split(":")
        kind = parts[0]
        assert self.db is not None or kind == "reopen"
        if kind == "push":
            q = parts[1]
            return self.queues[q].push(self.next_payload(q))
        if kind == "lease":
            q = parts[1]
            got = self.queues[q].lease(1)
            for lease in got:
                self.tokens[q].append(lease.token)
            return [(x.id, x.attempt) for x in got]
        if kind in ("ack", "nack", "dead"):
            q = parts[1]
            if not self.tokens[q]:
                return None
            tok = self.tokens[q][0]
            if kind == "ack":
                self.queues[q].ack(tok)
            elif kind == "nack":
                self.queues[q].nack(tok, delay=0)
            else:
                self.queues[q].nack(tok, dead=True)
            self.tokens[q].pop(0)
            return tok.seq
        if kind == "tx":
            q = parts[1]
            tx = self.db.tx().push(self.queues[q], self.next_payload(q))
            tok = self.tokens[q][0] if self.tokens[q] else None
            if tok is not None:
                tx = tx.ack(self.queues[q], tok)
            if self.world.durable:
                tx = tx.durable()
            ids = tx.commit()
            if tok is not None:
                self.tokens[q].pop(0)
            return ids
        if kind == "outbox":
            q, m = parts[1], parts[2]
            key, val = self.next_value()
            tx = self.db.tx().put(self.maps[m], key, val).push(self.queues[q], self.next_payload(q))
            if self.world.durable:
                tx = tx.durable()
            return tx.commit()
        if kind == "put":
            m = parts[1]
            key, val = self.next_value()
            self.maps[m].put(key, val)
            return key
        if kind == "del":
            m = parts[1]
            key = b"k%03d" % ((self.puts + 3) % 7)
            return self.maps[m].delete(key)
        if kind == "reopen":
            self.close()
            self.open()
            return None
        raise ValueError(f"unknown op {op!r}")

    # -- observation ---------------------------------------------------------------------------------
    def capture(self) -> tuple[Any, ...]:
        """The canonical observable state (see module docstring)."""
        out: list[Any] = []
        for name, var in self.world.queues:
            q = self.queues[name]
            rows = []
            itemsize = 0 if var else FIXED_DTYPE.itemsize
            for sh in q._shards:
                with sh.lock:
                    for idx in (sh.live, sh.dead):
                        _due, seq, slot, _dl = idx.to_arrays()
                        for s, sl in zip(seq.tolist(), slot.tolist()):
                            raw = sh.fixed.slots[sl, 8:].tobytes()
                            due_word = int.from_bytes(raw[:8], "big")
                            state, flags, attempts, epoch, deadline, _pid, _pushed = _HDR.unpack_from(raw, 16)
                            if var:
                                body = q._payload.get(int(s).to_bytes(8, "big"))
                                pl = NOBODY if body is None else bytes(body)
                            else:
                                pl = raw[48 : 48 + itemsize]
                            rows.append((int(s), state, flags, attempts, epoch, due_word, deadline, pl))
            rows.sort()
            out.append((name, tuple(rows)))
        for m in self.world.maps:
            items = sorted(self.maps[m].items(), key=lambda kv: repr(kv[0]))
            out.append((m, tuple(items)))
        return tuple(out)

    def body_count(self) -> int:
        """Bodies in every var queue's payload store (orphans included)."""
        return sum(len(q._payload) for q in self.queues.values() if q._payload is not None)


def fast_tmpdir(prefix: str) -> str:
    """A fresh directory on a RAM file system when there is one (``$ARMDB_SCRATCH``, else
    ``/dev/shm``), else in the system temp dir.  These harnesses reopen thousands of
    small databases; on a disk every reopen pays several real ``fsync`` calls."""
    import tempfile

    for base in (os.environ.get("ARMDB_SCRATCH"), "/dev/shm"):
        if base and os.path.isdir(base) and os.access(base, os.W_OK):
            return tempfile.mkdtemp(prefix=prefix, dir=base)
    return tempfile.mkdtemp(prefix=prefix)


def quiesce(db: Db) -> None:
    """Stop the background workers of an open Db (flusher, sweeper), so that the calls a
    workload makes are deterministic.  Syncing less only makes power loss harsher."""
    for w in list(getattr(db, "_workers", [])):
        w.stop()
    for w in list(getattr(db, "_workers", [])):
        if w.is_alive():
            w.join(timeout=5)


def describe_state(state: tuple[Any, ...]) -> str:
    parts = []
    for name, rows in state:
        if rows and len(rows[0]) == 8:
            parts.append(
                f"{name}: "
                + ", ".join(
                    f"{r[0]}:{'RLD'[r[1]] if r[1] < 3 else r[1]}a{r[3]}"
                    + ("!NOBODY" if r[7] == NOBODY else "")
                    for r in rows
                )
            )
        else:
            parts.append(f"{name}: {len(rows)} items")
    return "; ".join(parts)


def _items(coll_rows: tuple[Any, ...]) -> dict[Any, Any]:
    """Rows of one collection by id (queue) or key (map)."""
    if coll_rows and len(coll_rows[0]) == 8:
        return {r[0]: r for r in coll_rows}
    return dict(coll_rows)


def _payload_of(v: Any) -> Any:
    return v[7] if isinstance(v, tuple) and len(v) == 8 else v


def judge(
    got: tuple[Any, ...], states: list[tuple[Any, ...]], lo: int, hi: int, *, exact: bool
) -> tuple[str, str]:
    """Compare a recovered state with the recorded states; returns ``("ok", "")`` or a violation.

    ``states[j]`` is the state after ``j`` operations returned; ``lo..hi`` is the range a
    crash may show.  With ``exact`` (durable worlds) the state must equal one of them.
    Otherwise (I10) every item is judged on its own: each row or map entry must equal
    its value in some allowed state, and an item present in every allowed state must
    be present.  Classes, most severe first: ``header_without_body`` (I4),
    ``phantom`` (an id or key that no recorded state ever had, I3), ``wrong_data`` (a
    payload never stored under that id or key, I3), ``resurrected`` (an item deleted
    or acked before the last completed sync is back, I2), ``lost`` (an item every
    allowed state holds is missing, I1), ``rolled_back`` (an item shows a value older
    than every allowed one), ``state`` (a value no allowed state has).
    """
    allowed = states[lo : hi + 1]
    for name, rows in got:
        for r in rows:
            if len(r) == 8 and r[7] == NOBODY:
                return "header_without_body", f"{name}: row {r[0]} has no body"
    if exact and got in allowed:
        return "ok", ""
    if not exact and got in allowed:
        return "ok", ""
    worst: tuple[int, str, str] | None = None
    rank = {
        "phantom": 0,
        "wrong_data": 1,
        "resurrected": 2,
        "lost": 3,
        "rolled_back": 4,
        "state": 5,
        "not_prefix": 6,
    }
    for ci, (name, rows) in enumerate(got):
        g = _items(rows)
        al = [_items(a[ci][1]) for a in allowed]
        ever = [_items(st[ci][1]) for st in states]
        for k, v in g.items():
            if any(k in a and a[k] == v for a in al):
                continue
            if not any(k in e for e in ever):
                cls = "phantom"
            elif not any(k in e and _payload_of(e[k]) == _payload_of(v) for e in ever):
                cls = "wrong_data"
            elif not any(k in a for a in al):
                cls = "resurrected"
            elif any(k in e and e[k] == v for e in ever[:lo]):
                cls = "rolled_back"
            else:
                cls = "state"
            detail = f"{name}: {k!r} is {v if not isinstance(v, tuple) else v[1:7]}"
            if worst is None or rank[cls] < worst[0]:
                worst = (rank[cls], cls, detail)
        for k in set.intersection(*(set(a) for a in al)) if al else set():
            if k not in g and (worst is None or rank["lost"] < worst[0]):
                worst = (rank["lost"], "lost", f"{name}: {k!r} missing")
    if worst is None:
        if exact:
            return "not_prefix", "every item is plausible, but the combination is no allowed state"
        return "ok", ""
    return worst[1], worst[2]


ALLOWED_OPEN_ERRORS = (ArmdbError,)

__all__ = [
    "FIXED_DTYPE",
    "KEY",
    "LOG_KEY",
    "NOBODY",
    "FakeClock",
    "Session",
    "World",
    "describe_state",
    "fast_tmpdir",
    "fixed_payload",
    "judge",
    "payload_bytes",
    "quiesce",
]
