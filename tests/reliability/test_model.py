"""Harness (e): a Hypothesis state machine over a queue, beside a pure-Python model.

docs/reliability.md, (e).  Rules: push (with a delay), lease (n, timeout override), ack,
nack (delay / dead), clock advance and clock jump back (a ``FakeClock`` passed as
``Db.open(clock=...)``), transactions (``db.tx()`` with pushes, an ack or nack and a
map put, sometimes refused by ``max_depth`` or a stale token), close/reopen and
crash/reopen.  Each example picks a flavour (fixed or var, var sometimes encrypted),
the queue settings and the header shard count in its ``initialize`` rule.

The crash rule abandons the open ``Db`` without ``close()``: the background threads
are stopped, the directory lock is released and every descriptor the Db holds is
closed, which is what the kernel does when a process dies.  Nothing is flushed or
checkpointed; since every write already reached the page cache (mmap stores and
``pwrite``), this models a process crash (kill -9), and the model expects every
completed operation to survive it.

Invariants after every step: ``len``, ``dead_len``, ``next_delay``,
``stats()`` (ready, leased, delayed and the since-open counters) and ``snapshot()``
(id, state, due, attempts, epoch, deadline of every row) match the model; the map's
items match.  Every ``lease`` result is checked row by row against the model (key
order, payload, attempt, deadline).  Tokens from before a reopen must raise
``StaleToken``.  ``armdb.check(path).ok`` after every reopen and at teardown.

Sizes: ``ARMDB_HYP_EXAMPLES`` examples of at most ``ARMDB_HYP_STEPS`` steps for each
flavour: defaults 200 x 50 for the CI test, 5000 x 100 for the nightly one (``-m slow``).

Per-step cost: the harness installs ``TrackingFS`` (syncs are no-ops: they cannot change
the outcome of a process crash), so a clean reopen costs a few milliseconds; reopen and
crash_reopen are each about 12% of the steps.
"""

from __future__ import annotations

import collections
import importlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import armdb
from armdb import Config, FixedConfig, QueueConfig, State, TxConfig, _fs
from armdb._core.qindex import KeyIndex
from armdb.errors import QueueFull, StaleToken

from ..conftest import FakeClock
from .journal import report_line

PAYLOAD_KEY = bytes(range(32))
LOG_KEY = bytes(range(100, 132))
FIXED_DTYPE = np.dtype([("n", "<u8"), ("tag", "S6")])
READY, LEASED, DEAD = int(State.READY), int(State.LEASED), int(State.DEAD)


@dataclass
class Job:
    n: int
    blob: bytes


FixedQ = armdb.queue("mq", payload=FIXED_DTYPE)
VarQ = armdb.queue("mq", payload=Job, var=True)

# Counters shared by every machine run in this process (for the summary line).
RUN = collections.Counter()


class TrackingFS(_fs.RealFS):
    """The real file system, remembering which descriptors armdb opened (and for what path).

    ``abandon`` closes exactly those, so descriptors that ``mmap`` duplicated for
    itself (they stay valid while a mapping lives) are never closed twice.

    ``fsync``, ``fdatasync``, ``msync`` and directory syncs are no-ops: this harness
    models a process crash, which the page cache survives, so a sync changes no
    outcome here; skipping them keeps a reopen at a few milliseconds.
    (Power loss is harness (b)'s job.)
    """

    def __init__(self) -> None:
        super().__init__()
        self.fds: dict[int, str] = {}

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        fd = super().open(path, flags, mode)
        self.fds[fd] = os.path.abspath(path)
        return fd

    def close(self, fd: int) -> None:
        self.fds.pop(fd, None)
        super().close(fd)

    def fsync(self, fd: int) -> None:
        pass

    def fdatasync(self, fd: int) -> None:
        pass

    def fsync_dir(self, path: str) -> None:
        pass

    def _msync(self, mf: _fs.MappedFile, offset: int, length: int) -> None:
        pass


def abandon(db: armdb.Db, fs: TrackingFS) -> None:
    """Simulate a process crash of ``db``: no close, no flush, no checkpoint.

    The background threads are stopped first (a dead process runs none), then the
    directory lock is released and every descriptor armdb opened under the database
    directory is closed, as the kernel does for a killed process.  Mappings stay
    until the objects are collected; unmapping writes nothing that was not already
    in the page cache.
    """
    db._closed = True
    for w in db._workers:
        w.stop()
    for w in db._workers:
        w.join(5)
    assert db._dirlock is not None
    db._dirlock.release()
    db._dirlock = None
    prefix = db.path + os.sep
    for fd, path in list(fs.fds.items()):
        if path.startswith(prefix):
            fs.close(fd)


# Block size of the queue's in-RAM key index (armdb._core.qindex.KeyIndex).  The library
# always uses 256; each example picks 4 or 256, so that the small examples here walk the
# split, merge and ``bmin`` skip paths of the index as well as the single-block path.
BLOCK = [256]
QUEUE_MODULE = importlib.import_module("armdb.queue")  # ``armdb.queue`` is the declaring function


def _key_index(block_size: int = 256) -> KeyIndex:
    return KeyIndex(BLOCK[0])


def _key_index_from_arrays(due: Any, seq: Any, slot: Any, deadline: Any, block_size: int = 256) -> KeyIndex:
    return KeyIndex.from_arrays(due, seq, slot, deadline, block_size=BLOCK[0])


_key_index.from_arrays = _key_index_from_arrays  # type: ignore[attr-defined]


# -- the model ---------------------------------------------------------------------------------


@dataclass
class Row:
    id: int
    payload: Any
    due: int  # the live key's due ms, or the dead-letter time for a dead row
    state: int = READY
    attempts: int = 0
    epoch: int = 0
    deadline: int = 0  # last lease deadline (0: never leased)
    maybe_swept: bool = False  # dead and past its retention at some moment: may vanish


@dataclass
class Tok:
    token: Any
    id: int
    epoch: int
    gen: int  # the open (generation) that issued it


class Model:
    def __init__(self, max_attempts: int, backoff_ms: list[int], retention_ms: int | None) -> None:
        self.rows: dict[int, Row] = {}
        self.max_attempts = max_attempts
        self.backoff_ms = backoff_ms
        self.retention_ms = retention_ms
        self.counters = collections.Counter()
        self.map: dict[Any, Any] = {}

    def live(self) -> list[Row]:
        return sorted((r for r in self.rows.values() if r.state != DEAD), key=lambda r: (r.due, r.id))

    def dead(self) -> list[Row]:
        return [r for r in self.rows.values() if r.state == DEAD]

    def backoff(self, attempts: int) -> int:
        b = self.backoff_ms
        return b[min(max(attempts, 1) - 1, len(b) - 1)]

    def mark_sweepable(self, now: int) -> None:
        if self.retention_ms is None:
            return
        for r in self.dead():
            if r.due + self.retention_ms <= now:
                r.maybe_swept = True

    def sweep(self, now: int) -> None:
        """A queue operation that runs retention (push, lease, ack, nack, next_delay)."""
        if self.retention_ms is None:
            return
        for r in self.dead():
            if r.due + self.retention_ms <= now:
                del self.rows[r.id]

    def token_valid(self, t: Tok, gen: int) -> bool:
        r = self.rows.get(t.id)
        return t.gen == gen and r is not None and r.state == LEASED and r.epoch == t.epoch

    def lease(self, now: int, n: int, deadline: int) -> list[Row]:
        out: list[Row] = []
        for r in self.live():
            if len(out) >= n or r.due > now:
                break
            if r.state == LEASED:
                if r.deadline > now:
                    continue
                self.counters["expired_leases"] += 1
                if r.attempts >= self.max_attempts:
                    r.state, r.due = DEAD, now
                    self.counters["dead_lettered"] += 1
                    continue
            r.state = LEASED
            r.attempts += 1
            r.epoch = (r.epoch + 1) & 0xFFFFFFFF
            r.deadline = deadline
            out.append(r)
        return out

    def ack(self, rid: int) -> None:
        del self.rows[rid]
        self.counters["acks"] += 1

    def nack(self, rid: int, now: int, delay_ms: int | None, dead: bool) -> None:
        r = self.rows[rid]
        self.counters["nacks"] += 1
        if dead or r.attempts >= self.max_attempts:
            r.state, r.due = DEAD, now
            self.counters["dead_lettered"] += 1
        else:
            r.state = READY
            r.due = now + (delay_ms if delay_ms is not None else self.backoff(r.attempts))

    def next_delay(self, now: int) -> timedelta | None:
        live = self.live()
        if not live:
            return None
        t = min(r.deadline if r.state == LEASED else r.due for r in live)
        return timedelta(milliseconds=max(0, t - now))


# -- strategies --------------------------------------------------------------------------------

ms_delay = st.one_of(st.none(), st.integers(0, 20_000))
fixed_payloads = st.tuples(st.integers(0, 2**64 - 1), st.binary(max_size=6).map(lambda b: b.rstrip(b"\0")))
var_payloads = st.builds(Job, st.integers(-(2**63), 2**64 - 1), st.binary(max_size=300))
DEPTHS = st.sampled_from([None, None, None, None, None, 1, 4, 12])  # max_depth of one open (not persisted, Q4)
map_keys = st.one_of(st.sampled_from(["a", "b", "c"]), st.integers(-3, 3), st.sampled_from([b"a", b"1"]))


def as_duration(ms: int, kind: int) -> Any:
    """A duration in one of the accepted forms: timedelta, float seconds, int seconds."""
    if kind == 0:
        return timedelta(milliseconds=ms)
    if kind == 1 and ms % 1000 == 0:
        return ms // 1000
    return ms / 1000


class QueueMachine(RuleBasedStateMachine):
    """One queue beside a model; the flavour is fixed by the subclass."""

    VAR = False
    DURABLE = False  # headers synced on every write (sync_interval 0): the ordered redo path

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="armdb-model-")
        self.path = os.path.join(self.dir, "db")
        self.clock = FakeClock()
        self.db: armdb.Db | None = None
        self.gen = 0
        self.tokens: list[Tok] = []
        self.issued_ids: set[int] = set()
        RUN["examples"] += 1

    # -- setup ---------------------------------------------------------------------------------
    @initialize(
        max_attempts=st.integers(1, 4),
        backoff=st.lists(st.integers(0, 30_000), min_size=1, max_size=3),
        lease_ms=st.integers(1, 30_000),
        max_depth=DEPTHS,
        retention=st.one_of(st.none(), st.integers(1, 60_000)),
        shards=st.sampled_from([1, 1, 2]),
        encrypted=st.booleans(),
        grow_step=st.sampled_from([2, 8, 64]),
        block=st.sampled_from([4, 256]),
    )
    def setup(self, max_attempts, backoff, lease_ms, max_depth, retention, shards, encrypted, grow_step, block) -> None:
        BLOCK[0] = block
        self.encrypted = self.VAR and encrypted
        self.lease_ms = lease_ms
        self.model = Model(max_attempts, backoff, retention)
        pc = Config.balanced().enable_fsync(False)
        if self.encrypted:
            pc = pc.encryption_key(PAYLOAD_KEY)
        self.map_config = pc.build()
        self.base = (
            QueueConfig.balanced()
            .max_attempts(max_attempts)
            .backoff_secs([b / 1000 for b in backoff])
            .lease_timeout(timedelta(milliseconds=lease_ms))
            .dead_retention(None if retention is None else retention / 1000)
            .header_config(self._header_config(shards, grow_step))
            .payload_config(self.map_config)
        )
        self.tx_config = TxConfig(log_encryption_key=LOG_KEY) if self.encrypted else None
        self.open(max_depth)

    def _header_config(self, shards: int, grow_step: int) -> FixedConfig:
        h = FixedConfig.balanced().shard_count(shards).grow_step(grow_step)
        return (h.sync_interval(0) if self.DURABLE else h.enable_fsync(False)).build()

    def open(self, max_depth: int | None) -> None:
        self.max_depth = max_depth
        self.db = armdb.Db.open(self.path, clock=self.clock, tx_config=self.tx_config)
        self.q = self.db.open_queue(VarQ if self.VAR else FixedQ, self.base.max_depth(max_depth).build())
        self.m = self.db.open_map("side", self.map_config)
        self.gen += 1
        self.model.counters.clear()

    def teardown(self) -> None:
        try:
            if self.db is not None:
                self.db.shutdown()
                report_ = armdb.check(self.path)
                assert report_.ok, str(report_)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    @property
    def now(self) -> int:
        return self.clock.ms

    def step(self, name: str) -> None:
        RUN["steps"] += 1
        RUN["rule:" + name] += 1
        self.model.mark_sweepable(self.now)

    def payload_form(self, payload: Any) -> Any:
        return payload

    def got_form(self, got: Any) -> Any:
        if self.VAR:
            return got
        return (int(got["n"]), bytes(got["tag"]))

    def new_id(self, rid: int) -> None:
        assert rid not in self.issued_ids, f"id {rid} handed out twice (T5)"
        self.issued_ids.add(rid)

    # -- rules ----------------------------------------------------------------------------------
    @rule(data=st.data(), k=st.integers(1, 8), delay=ms_delay, kind=st.integers(0, 2))
    def push(self, data, k, delay, kind) -> None:
        """Q9/Q20: push k rows (same delay); QueueFull at max_depth, writing nothing."""
        self.step("push")
        for _ in range(k):
            payload = data.draw(var_payloads if self.VAR else fixed_payloads, label="payload")
            now = self.now
            self.model.sweep(now)
            live = len(self.model.live())
            arg = None if delay is None else as_duration(delay, kind)
            if self.max_depth is not None and live >= self.max_depth:
                with pytest.raises(QueueFull, match="max_depth"):
                    self.q.push(payload, delay=arg)
                RUN["push_refused"] += 1
                continue
            rid = self.q.push(payload, delay=arg)
            self.new_id(rid)
            self.model.rows[rid] = Row(rid, payload, now + (delay or 0))
            self.model.counters["pushes"] += 1
            if self.VAR:
                self.model.counters["payload_writes"] += 1
            RUN["pushed"] += 1

    @rule(n=st.integers(1, 4), timeout=st.one_of(st.none(), st.integers(1, 30_000)), kind=st.integers(0, 2))
    def lease(self, n, timeout, kind) -> None:
        self.step("lease")
        now = self.now
        self.model.sweep(now)
        deadline = now + (self.lease_ms if timeout is None else timeout)
        arg = None if timeout is None else as_duration(timeout, kind)
        got = self.q.lease(n, lease_timeout=arg)
        exp = self.model.lease(now, n, deadline)
        assert [g.id for g in got] == [r.id for r in exp], "lease order or choice differs from the model (Q9)"
        keys = [(g.token.due, g.token.seq) for g in got]
        assert keys == sorted(keys), "rows of one lease() must come in key order (Q11)"
        for g, r in zip(got, exp):
            assert self.got_form(g.payload) == self.payload_form(r.payload), (
                f"row {r.id}: wrong payload (I3): {self.got_form(g.payload)!r} != {r.payload!r}"
            )
            assert g.attempt == r.attempts
            assert int(g.deadline.timestamp() * 1000 + 0.5) == deadline
            self.tokens.append(Tok(g.token, g.id, r.epoch, self.gen))
        RUN["leased"] += len(got)

    def pick(self, idx: int) -> Tok | None:
        """A token, counted from the newest (idx 0: the most recent lease)."""
        return self.tokens[-1 - idx % len(self.tokens)] if self.tokens else None

    @precondition(lambda self: self.tokens)
    @rule(idx=st.integers(0, 1000))
    def ack(self, idx) -> None:
        self.step("ack")
        t = self.pick(idx)
        now = self.now
        self.model.sweep(now)
        if self.model.token_valid(t, self.gen):
            self.q.ack(t.token)
            self.model.ack(t.id)
        else:
            with pytest.raises(StaleToken):
                self.q.ack(t.token)
            RUN["stale_rejected"] += 1

    @precondition(lambda self: self.tokens)
    @rule(idx=st.integers(0, 1000), delay=ms_delay, dead=st.booleans(), kind=st.integers(0, 2))
    def nack(self, idx, delay, dead, kind) -> None:
        self.step("nack")
        t = self.pick(idx)
        now = self.now
        self.model.sweep(now)
        arg = None if delay is None else as_duration(delay, kind)
        if self.model.token_valid(t, self.gen):
            self.q.nack(t.token, delay=arg, dead=dead)
            self.model.nack(t.id, now, delay, dead)
        else:
            with pytest.raises(StaleToken):
                self.q.nack(t.token, delay=arg, dead=dead)
            RUN["stale_rejected"] += 1

    @precondition(lambda self: any(t.gen != self.gen for t in self.tokens))
    @rule(idx=st.integers(0, 1000), use_ack=st.booleans())
    def token_from_before_reopen(self, idx, use_ack) -> None:
        """Q13: a token from before a reopen is rejected even if its row is still leased."""
        self.step("old_token")
        old = [t for t in self.tokens if t.gen != self.gen]
        t = old[idx % len(old)]
        self.model.sweep(self.now)
        with pytest.raises(StaleToken, match="another queue handle"):
            if use_ack:
                self.q.ack(t.token)
            else:
                self.q.nack(t.token)
        RUN["stale_rejected"] += 1

    @rule(ms=st.integers(0, 120_000))
    def advance(self, ms) -> None:
        self.step("advance")
        self.clock.ms += ms

    @rule(ms=st.integers(1, 60_000))
    def jump_back(self, ms) -> None:
        self.step("jump_back")
        self.clock.ms -= ms

    @rule(
        data=st.data(),
        n_push=st.integers(0, 2),
        delay=st.integers(0, 5_000),
        settle=st.sampled_from([None, "ack", "nack", "dead"]),
        idx=st.integers(0, 1000),
        put=st.one_of(st.none(), st.tuples(map_keys, st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1)))),
        durable=st.integers(0, 9),
        order=st.booleans(),
        nack_delay=ms_delay,
    )
    def transaction(self, data, n_push, delay, settle, idx, put, durable, order, nack_delay) -> None:
        """T1/Q21: pushes + an ack or nack + a map put (or delete) in one commit."""
        self.step("tx")
        payloads = [data.draw(var_payloads if self.VAR else fixed_payloads, label="payload") for _ in range(n_push)]
        t = self.pick(idx) if settle is not None else None
        now = self.now
        tx = self.db.tx()
        steps = []
        for p in payloads:
            steps.append(lambda tx, p=p: tx.push(self.q, p, delay=delay / 1000))
        if t is not None:
            if settle == "ack":
                steps.append(lambda tx: tx.ack(self.q, t.token))
            else:
                nd = None if nack_delay is None else nack_delay / 1000
                steps.append(lambda tx: tx.nack(self.q, t.token, delay=nd, dead=settle == "dead"))
        if put is not None:
            key, value = put
            steps.append(lambda tx: tx.put(self.m, key, value) if value is not None else tx.delete(self.m, key))
        if order:
            steps.reverse()  # the order of builder calls does not change the result (T1)
            payloads.reverse()  # commit() returns the push ids in builder order
        if durable == 0:
            tx.durable()
        for s in steps:
            s(tx)
        # What the model expects.
        live = len(self.model.live())
        acks = 1 if t is not None and settle == "ack" else 0
        stale = t is not None and not self.model.token_valid(t, self.gen)
        cap = self.max_depth
        over_with_credit = cap is not None and n_push > acks and live - acks + n_push > cap
        over_without = cap is not None and n_push > 0 and live + n_push > cap
        if stale or over_with_credit:
            allowed: tuple[type[Exception], ...] = ()
            if stale:
                allowed += (StaleToken,)
            if over_with_credit or (stale and over_without):
                allowed += (QueueFull,)
            with pytest.raises(allowed):
                tx.commit()
            RUN["tx_refused"] += 1
            return
        ids = tx.commit()
        assert len(ids) == n_push
        if t is not None:
            if settle == "ack":
                self.model.ack(t.id)
            else:
                self.model.nack(t.id, now, nack_delay, settle == "dead")
        for rid, p in zip(ids, payloads):
            self.new_id(rid)
            self.model.rows[rid] = Row(rid, p, now + delay)
            self.model.counters["pushes"] += 1
            if self.VAR:
                self.model.counters["payload_writes"] += 1
        if put is not None:
            key, value = put
            if value is None:
                self.model.map.pop(key, None)
            else:
                self.model.map[key] = value
        RUN["tx_committed"] += 1

    @rule(max_depth=DEPTHS)
    def reopen(self, max_depth) -> None:
        """Clean close, check, open: every token becomes stale (Q13)."""
        self.step("reopen")
        self.db.close()
        report_ = armdb.check(self.path)
        assert report_.ok, str(report_)
        self.open(max_depth)
        RUN["reopens"] += 1

    @rule(max_depth=DEPTHS)
    def crash_reopen(self, max_depth) -> None:
        """Abandon the Db (a process crash), recover, verify, close, check, open."""
        self.step("crash_reopen")
        old = self.db
        self.db = None
        abandon(old, _fs.FS)
        del old
        self.open(max_depth)
        self.verify()  # the recovered state, before a clean close could hide anything
        self.db.close()
        report_ = armdb.check(self.path)
        assert report_.ok, str(report_)
        self.open(max_depth)
        RUN["crash_reopens"] += 1

    # -- invariants -------------------------------------------------------------------------------
    @invariant()
    def matches_model(self) -> None:
        if self.db is not None:
            self.verify()

    def verify(self) -> None:
        q, model, now = self.q, self.model, self.now
        model.mark_sweepable(now)
        snap = q.snapshot()
        got = {
            int(r["id"]): (
                int(r["state"]),
                int(r["due"].astype("int64")),
                int(r["attempts"]),
                int(r["epoch"]),
                0 if np.isnat(r["deadline"]) else int(r["deadline"].astype("int64")),
            )
            for r in snap
        }
        assert len(got) == len(snap), "snapshot lists a row twice"
        # Dead rows past their retention may have been swept by the background thread.
        for rid in [rid for rid, r in model.rows.items() if r.maybe_swept and rid not in got]:
            del model.rows[rid]
        exp = {r.id: (r.state, r.due, r.attempts, r.epoch, r.deadline) for r in model.rows.values()}
        assert got == exp, f"snapshot differs from the model:\n got {got}\n exp {exp}"
        live = model.live()
        n_dead = len(snap) - len(live)
        assert q.len() == len(live)
        assert q.dead_len() == n_dead
        model.sweep(now)  # next_delay runs retention first, like every queue operation
        assert q.next_delay() == model.next_delay(now), "next_delay differs from the model (Q18)"
        live = model.live()
        n_dead = len(model.rows) - len(live)
        s = q.stats()
        ready = sum(1 for r in live if r.state == READY and r.due <= now)
        leased = sum(1 for r in live if r.state == LEASED)
        assert (s.len, s.dead_len, s.ready, s.leased, s.delayed) == (
            len(live), n_dead, ready, leased, len(live) - ready - leased,
        ), f"stats {s}"
        c = model.counters
        assert (s.pushes, s.acks, s.nacks, s.dead_lettered, s.expired_leases) == (
            c["pushes"], c["acks"], c["nacks"], c["dead_lettered"], c["expired_leases"],
        ), f"stats counters {s} vs model {dict(c)}"
        assert s.payload_writes == c["payload_writes"]
        assert (s.compaction_bytes, s.repaired_on_open, s.orphans_collected, s.retention_retry_pending) == (0, 0, 0, 0)
        # wait_due_timeout(0) answers "is a row due now?" without blocking (Q19).
        assert q.wait_due_timeout(0) == (model.next_delay(now) == timedelta(0))
        # Q27: per shard, live rows in key order, then dead rows in key order.
        nshards = s.shards
        keys = [(int(r["id"]) % nshards, int(r["state"]) == DEAD, int(r["due"].astype("int64")), int(r["id"])) for r in snap]
        for shard in range(nshards):
            mine = [k[1:] for k in keys if k[0] == shard]
            assert mine == sorted(mine), f"snapshot rows of shard {shard} out of key order"
        items = dict(self.m.items())
        assert items == model.map, f"map {items} vs model {model.map}"


class FixedMachine(QueueMachine):
    VAR = False


class VarMachine(QueueMachine):
    VAR = True


class DurableFixedMachine(QueueMachine):
    """Durable headers: every lease, nack and ack of a live row syncs its redo record
    before the in-place copy (armdb.fixed.FixedShard._put)."""

    DURABLE = True


def run_machines(examples: int, steps: int, capsys: pytest.CaptureFixture[str], tag: str) -> None:
    """Run every machine; print the summary line (also when a machine fails)."""
    RUN.clear()
    t0 = time.perf_counter()
    failure: BaseException | None = None
    try:
        for machine in (FixedMachine, VarMachine, DurableFixedMachine):
            with _fs.use(TrackingFS()), pytest.MonkeyPatch.context() as mp:
                mp.setattr(QUEUE_MODULE, "KeyIndex", _key_index)
                run_state_machine_as_test(
                    machine,
                    settings=settings(
                        max_examples=examples,
                        stateful_step_count=steps,
                        deadline=None,
                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
                    ),
                )
    except BaseException as e:  # noqa: BLE001 - reported, then re-raised below
        failure = e
    elapsed = time.perf_counter() - t0
    total = max(RUN["steps"], 1)
    rules = {k[5:]: v for k, v in RUN.items() if k.startswith("rule:")}
    share = {k: v / total for k, v in rules.items()}
    hist = " ".join(f"{k}={100 * v:.1f}%" for k, v in sorted(share.items()))
    line = (
        f"RELIABILITY e-model{tag} machines=3 examples={RUN['examples']} steps={RUN['steps']} "
        f"reopens={RUN['reopens']} crash_reopens={RUN['crash_reopens']} pushed={RUN['pushed']} leased={RUN['leased']} "
        f"tx_committed={RUN['tx_committed']} tx_refused={RUN['tx_refused']} push_refused={RUN['push_refused']} "
        f"stale_rejected={RUN['stale_rejected']} violations={0 if failure is None else 1} "
        f"seconds={elapsed:.1f} rules[{hist}]"
    )
    with capsys.disabled():
        report_line(line)
    if failure is not None:
        raise failure
    if RUN["steps"] >= 2000:  # rule shares are meaningful only over enough steps
        assert share.get("reopen", 0) >= 0.05 and share.get("crash_reopen", 0) >= 0.05, hist
        # Every rule fires: at least 0.5% of the steps (old_token, which needs a settled
        # lease to replay, ran at 1.0-1.6% in CI-size runs; 1% was a coin toss).
        assert all(v >= 0.005 for v in share.values()), hist


@pytest.mark.timeout(3600)  # `make reliability` runs it with ARMDB_HYP_EXAMPLES=5000 too
def test_e_queue_model_ci(capsys: pytest.CaptureFixture[str]) -> None:
    run_machines(
        int(os.environ.get("ARMDB_HYP_EXAMPLES", "200")),
        int(os.environ.get("ARMDB_HYP_STEPS", "50")),
        capsys,
        "",
    )


@pytest.mark.slow
@pytest.mark.timeout(0)
def test_e_queue_model_nightly(capsys: pytest.CaptureFixture[str]) -> None:
    run_machines(
        int(os.environ.get("ARMDB_HYP_EXAMPLES", "5000")),
        int(os.environ.get("ARMDB_HYP_STEPS", "100")),
        capsys,
        "-nightly",
    )
