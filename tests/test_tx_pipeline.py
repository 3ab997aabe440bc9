"""The durable commit pipeline under threads and injected log-sync faults (SPEC T1, T2,
T3, T6, T7, Q13, Q14, Q21, Q28, Q31, Q32, S12; docs/transactions.md, the commit protocol).

These tests hold for any commit protocol that keeps the contract: locks held through the
log sync, or released after the append with each shard's commits applied in log order
afterwards.  They fail on a protocol that applies two commits of one shard out of log
order, lets a direct operation overtake a logged commit it depends on, loses a commit
that returned, shows half a commit, or hangs.

The model that makes the threads' results checkable:

- every map key is written by one thread only, and each write of it gets the next
  *version* of that key (1, 2, ...), registered before the call starts; a write stores
  ``[key, version]``.  A read of a key is then correct exactly when it shows the state
  after some version between the last one whose call had returned before the read began
  and the last one registered after the read ended (a linearizability check for one
  writer: nothing older than a write that returned, nothing from the future);
- every job carries ``(map, key, version, nonce)``: the map write it belongs with (the
  same commit's, or a direct put that returned before the push began) and a nonce that
  makes it unique.  A consumer that leases it must see that map write or a later one
  (the outbox rule: a job is visible only with its commit's rows, T2);
- every call that returned is recorded; at the end each job that a returned push or
  commit produced is acked exactly once, or still in its queue (live or dead), and
  nothing else is there.
"""

from __future__ import annotations

import errno
import itertools
import os
import random
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import armdb
from armdb import Config, FixedConfig, QueueConfig, TxConfig, _fs
from armdb.errors import QueueFull, StorageError, TxFailedAfterLog
from armdb.maps import Map
from armdb.streams import SchemaRegistry

from .conftest import FakeClock

pytestmark = pytest.mark.stress

JOB = np.dtype([("m", "<u8"), ("k", "<u8"), ("v", "<u8"), ("n", "<u8")])
PARK = np.dtype([("t", "<u8"), ("n", "<u8")])
FQ = armdb.queue("txp_fixed", payload=JOB)
VQ = armdb.queue("txp_var", payload=object, var=True)
SQ = armdb.queue("txp_stream", payload=object, var=True)  # the change stream's destination
PQ = armdb.queue("txp_parked", payload=PARK)  # delayed pushes nobody leases: counted by len()
MAPS = ("txp_a", "txp_b", "txp_feed")  # txp_feed is the stream source (T6)
FEED = 2
VQ_DEPTH = 24  # max_depth of txp_var: some pushes meet QueueFull (Q21), which writes nothing
JOIN_TIMEOUT = 90.0  # a thread still running after this is a hang (a deadlock of the protocol); a run takes ~2 s
FAR = 3600.0  # a delay the fixed clock never reaches


def _emit(change: Any) -> Any:
    # A put of txp_feed emits one job naming its key and version (in a list: a bare list
    # would be a list of payloads, T6); a delete emits nothing.
    if change.new is None:
        return None
    return [[FEED, change.key, change.new[1], 0]]


def _registry() -> SchemaRegistry:
    return SchemaRegistry().change_stream(MAPS[FEED], SQ, _emit).register_queue(FQ).register_queue(VQ)


def _open_all(d: armdb.Db) -> tuple[list[Map], dict[str, armdb.Queue[Any]]]:
    """Few shards everywhere, so that threads collide on them: one or two per collection."""
    shards = {"txp_a": 1, "txp_b": 2, "txp_feed": 1}
    maps = [d.open_map(n, Config.balanced().shard_count(shards[n]).enable_fsync(False).build()) for n in MAPS]

    def qcfg(header_shards: int, depth: int | None = None) -> QueueConfig:
        header = FixedConfig.balanced().shard_count(header_shards).grow_step(64).enable_fsync(False).build()
        body = Config.balanced().shard_count(1).enable_fsync(False).build()
        return (QueueConfig.balanced().header_config(header).payload_config(body).max_attempts(1000)
                .max_depth(depth).build())

    queues: dict[str, armdb.Queue[Any]] = {
        FQ.name: d.open_queue(FQ, qcfg(2)),
        VQ.name: d.open_queue(VQ, qcfg(2, VQ_DEPTH)),
        SQ.name: d.open_queue(SQ, qcfg(1)),
        PQ.name: d.open_queue(PQ, qcfg(1)),
    }
    return maps, queues


def _ident(payload: Any) -> tuple[int, int, int, int]:
    """A job's identity, from either flavour's payload."""
    if isinstance(payload, list):
        return (int(payload[0]), int(payload[1]), int(payload[2]), int(payload[3]))
    assert isinstance(payload, np.void), f"a job payload of an unexpected type: {payload!r}"
    return (int(payload["m"]), int(payload["k"]), int(payload["v"]), int(payload["n"]))


def _payload(q: armdb.Queue[Any], ident: tuple[int, int, int, int]) -> Any:
    return list(ident) if q.spec.var else ident


def _all_rows(q: armdb.Queue[Any]) -> tuple[list[tuple[int, Any]], list[tuple[int, Any]]]:
    """(id, identity) of every live row and of every dead row."""
    live = [(j.id, _ident(j.payload)) for j in q.peek(1_000_000)] if q.len() else []
    dead = [(j.id, _ident(j.payload)) for j in q.peek(1_000_000, dead=True)] if q.dead_len() else []
    return live, dead


class Model:
    """What the threads did, as far as their calls returned (see the module docstring)."""

    def __init__(self) -> None:
        self.ops: dict[tuple[int, int], list[str]] = {}  # (map, key) -> kinds by version - 1
        self.published: dict[tuple[int, int], int] = {}  # (map, key) -> last returned version
        self.failed: set[tuple[int, int, int]] = set()  # versions whose call raised
        self.seen_puts: set[tuple[int, int, int]] = set()  # versions some read showed
        self.pushed: dict[str, set[tuple[int, int, int, int]]] = {n: set() for n in (FQ.name, VQ.name, SQ.name)}
        self.by_id: dict[tuple[str, int], tuple[int, int, int, int]] = {}  # ids a push returned
        self.leased: list[tuple[str, int, tuple[int, int, int, int]]] = []
        self.acked: Counter[tuple[str, tuple[int, int, int, int]]] = Counter()
        self.dead_nacked: set[tuple[str, tuple[int, int, int, int]]] = set()
        self.holders: dict[tuple[str, int], str] = {}
        self.hold_lock = threading.Lock()
        self.parked = Counter[str]()  # thread -> parked pushes that returned
        self.violations: list[str] = []
        self.nonce = itertools.count(1)
        self.queue_full = 0

    # -- map writes --------------------------------------------------------------------------
    def begin(self, m: int, k: int, kind: str) -> int:
        ops = self.ops.setdefault((m, k), [])
        ops.append(kind)
        return len(ops)

    def returned(self, m: int, k: int, v: int) -> None:
        self.published[(m, k)] = v

    def fail(self, m: int, k: int, v: int) -> None:
        self.failed.add((m, k, v))

    def check_read(self, maps: list[Map], m: int, k: int, lower: int, where: str) -> None:
        """Read ``k`` of map ``m``: it must show the state after a version in
        ``[lower, registered-after-the-read]`` (T2: a returned commit is visible, T1: a
        commit is visible whole and never before it was made)."""
        got = maps[m].get(k)
        ops = self.ops.get((m, k), [])
        upper = len(ops)
        if got is None:
            ok = lower == 0 or any(ops[x - 1] == "del" for x in range(lower, upper + 1))
        else:
            ok = (isinstance(got, list) and len(got) == 2 and got[0] == k and lower <= got[1] <= upper
                  and ops[got[1] - 1] == "put")
            if ok:
                self.seen_puts.add((m, k, got[1]))
        if not ok:
            self.violations.append(
                f"{where}: {MAPS[m]}[{k}] reads {got!r}, but the writes of versions {lower}..{upper} "
                f"({ops[max(lower - 1, 0):upper]}) allow none of that"
            )

    def expected_map(self, m: int) -> dict[int, Any]:
        want: dict[int, Any] = {}
        for (mm, k), ops in self.ops.items():
            if mm != m:
                continue
            for v in range(len(ops), 0, -1):
                if (m, k, v) in self.failed:
                    continue
                if ops[v - 1] == "put":
                    want[k] = [k, v]
                break
        return want

    # -- jobs --------------------------------------------------------------------------------------
    def job(self, m: int, k: int, v: int) -> tuple[int, int, int, int]:
        return (m, k, v, next(self.nonce))

    def pushed_ok(self, qname: str, ident: tuple[int, int, int, int], jid: int | None) -> None:
        self.pushed[qname].add(ident)
        if jid is not None:
            self.by_id[(qname, jid)] = ident

    def hold(self, qname: str, jid: int, ident: tuple[int, int, int, int], who: str) -> None:
        """A lease: no two callers hold one job at once (Q28)."""
        with self.hold_lock:
            other = self.holders.get((qname, jid))
            if other is not None:
                self.violations.append(f"{who}: {qname} job {jid} leased while {other} holds it")
            self.holders[(qname, jid)] = who
        self.leased.append((qname, jid, ident))

    def release(self, qname: str, jid: int) -> None:
        with self.hold_lock:
            self.holders.pop((qname, jid), None)

    def ack(self, qname: str, ident: tuple[int, int, int, int]) -> None:
        with self.hold_lock:  # a read-modify-write: two racing acks of one job must both count
            self.acked[(qname, ident)] += 1

    def park(self, who: str) -> None:
        with self.hold_lock:
            self.parked[who] += 1

    def parked_total(self) -> int:
        with self.hold_lock:
            return sum(self.parked.values())


class Threads:
    """Runs the workers; each records its exception and traceback."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.pool: list[threading.Thread] = []

    def start(self, name: str, fn: Callable[[], None]) -> None:
        def run() -> None:
            try:
                fn()
            except BaseException:  # noqa: BLE001 - reported by join_all
                self.errors.append(f"{name}:\n{traceback.format_exc()}")

        th = threading.Thread(target=run, name=name, daemon=True)  # daemon: a hang fails, never blocks pytest
        self.pool.append(th)
        th.start()

    def join(self, names: set[str] | None, deadline: float) -> None:
        """Join ``names`` (every thread for None) by ``deadline`` (``time.monotonic()``);
        one still running then is a hang: fail with the stacks of the hung threads."""
        for th in self.pool:
            if names is None or th.name in names:
                th.join(max(0.0, deadline - time.monotonic()))
        hung = [th for th in self.pool if (names is None or th.name in names) and th.is_alive()]
        if hung:
            frames = sys._current_frames()
            stacks = "\n".join(
                f"--- {th.name}\n" + "".join(traceback.format_stack(frames[th.ident]))
                for th in hung if th.ident in frames
            )
            raise AssertionError(f"threads still running at the deadline (a deadlock or a lost wake-up): "
                                 f"{[th.name for th in hung]}\n{stacks}")


def _check_final_queues(model: Model, queues: dict[str, armdb.Queue[Any]], when: str) -> dict[str, Any]:
    """Every job a returned push or commit produced is acked exactly once or still in its
    queue, dead exactly when a nack dead-lettered it, and nothing else is in the queues
    (T2 no lost commit, Q14 no lost ack, Q21 a refused push writes nothing, Q28)."""
    rows: dict[str, Any] = {}
    for qname in (FQ.name, VQ.name, SQ.name):
        live, dead = _all_rows(queues[qname])
        rows[qname] = (live, dead)
        ids = [i for i, _ in live + dead]
        assert len(ids) == len(set(ids)), f"{when}: {qname} holds an id twice"
        here = Counter(ident for _, ident in live + dead)
        twice = [i for i, c in here.items() if c > 1]
        assert not twice, f"{when}: {qname} holds a job twice: {twice[:5]}"
        acked = {ident for (qn, ident), c in model.acked.items() if qn == qname}
        over = [(ident, c) for (qn, ident), c in model.acked.items() if qn == qname and c != 1]
        assert not over, f"{when}: {qname} jobs acked more than once: {over[:5]}"
        both = acked & set(here)
        assert not both, f"{when}: {qname} jobs acked and still there: {sorted(both)[:5]}"
        pushed = model.pushed[qname]
        lost = pushed - acked - set(here)
        assert not lost, f"{when}: {qname} lost {len(lost)} jobs whose push returned: {sorted(lost)[:5]}"
        extra = (acked | set(here)) - pushed
        assert not extra, f"{when}: {qname} holds or acked jobs no returned push made: {sorted(extra)[:5]}"
        dead_idents = {ident for _, ident in dead}
        want_dead = {ident for qn, ident in model.dead_nacked if qn == qname}
        assert dead_idents == want_dead, (
            f"{when}: {qname} dead rows {sorted(dead_idents ^ want_dead)[:5]} differ from the nacks(dead=True)"
        )
        for jid, ident in live + dead:
            known = model.by_id.get((qname, jid))
            assert known is None or known == ident, f"{when}: {qname} job {jid} is {ident}, its push gave {known}"
    return rows


# SPEC T1, T2, T3, T6, T7, Q13, Q14, Q21, Q28, Q31, Q32: eight threads on one or two shards per
# collection run durable and plain commits (puts, deletes, pushes, acks, nacks, a change
# stream), direct pushes, leases, acks, nacks, puts, deletes and batches, and reads; every
# read is consistent with the writes that returned, every lease sees its job's map write,
# nothing is lost, duplicated or half-applied, before and after a reopen; nothing hangs.
# With durable=True every commit is durable, a var queue's own acks and nacks and the
# batches (push_many, ack_many) included, each by its own commit path.
@pytest.mark.parametrize("durable", [False, True], ids=["plain", "all-durable"])
def test_t2_threads_on_shared_shards_keep_order_visibility_and_every_row(db_path: Path, durable: bool) -> None:
    clock = FakeClock()  # fixed: leases never expire, a nack with delay=0 is due at once
    # Small checkpoints: the log rotates, and syncs the stores, while commits are in flight.
    tx_config = TxConfig(durable=durable, checkpoint_bytes=16384)
    d = armdb.Db.open(db_path, tx_config=tx_config, schema=_registry(), clock=clock)
    maps, queues = _open_all(d)
    fq, vq, sq, pq = queues[FQ.name], queues[VQ.name], queues[SQ.name], queues[PQ.name]
    model = Model()
    producers_done = threading.Event()
    stop_reader = threading.Event()
    per_writer = int(os.environ.get("ARMDB_TXPIPE_OPS", "400"))
    seed = 1000 if durable else 0  # each thread's choices are seeded; the interleaving is the host's

    def check_parked(where: str) -> None:
        # Every parked push that returned (counted after it returned) is in len() (T2).
        need = model.parked_total()
        got = pq.len()
        if got < need:
            model.violations.append(f"{where}: {PQ.name} has {got} rows, {need} parked pushes returned")

    def tx_writer(t: int, name: str) -> None:
        """Blind commits (put + push), some with a delete of another key and a parked
        push, half durable; and delete-only commits.  Reads its own writes after each."""
        rng = random.Random(seed + 100 + t)
        own = [t * 1000 + i for i in range(10)]
        for _ in range(per_writer):
            m = rng.randrange(2)
            k = rng.choice(own)
            began: list[tuple[int, int, int]] = []
            tx = d.tx()
            if rng.random() < 0.1:  # delete-only (a commit that reads state: T1 no-op rule)
                for k2 in rng.sample(own, 2):
                    began.append((m, k2, model.begin(m, k2, "del")))
                    tx.delete(maps[m], k2)
                q = None
                ident = None
            else:
                v = model.begin(m, k, "put")
                began.append((m, k, v))
                q = vq if rng.random() < 0.5 else fq
                ident = model.job(m, k, v)
                # Either builder order (T1: the order does not change the result): a
                # consumer that leases the job must see the put whichever came first.
                if rng.random() < 0.5:
                    tx.put(maps[m], k, [k, v]).push(q, _payload(q, ident))
                else:
                    tx.push(q, _payload(q, ident)).put(maps[m], k, [k, v])
                if rng.random() < 0.3:
                    k2 = rng.choice([x for x in own if x != k])
                    began.append((m, k2, model.begin(m, k2, "del")))
                    tx.delete(maps[m], k2)
            park = rng.random() < 0.2
            if park:
                tx.push(pq, (t, next(model.nonce)), delay=FAR)
            if rng.random() < 0.5:
                tx.durable()
            try:
                ids = tx.commit()
            except QueueFull:  # Q21: the var queue is at max_depth; nothing was written
                assert q is vq, "QueueFull from a commit that pushes no capped queue"
                model.queue_full += 1
                for b in began:
                    model.fail(*b)
                continue
            for b in began:
                model.returned(*b)
            if ident is not None:
                assert q is not None
                model.pushed_ok(q.name, ident, ids[0])  # the first explicit push in builder order
            if park:
                model.park(name)
            # Read-your-writes: the commit returned, so each of its writes is there (T2).
            for mm, kk, vv in began:
                model.check_read(maps, mm, kk, vv, f"{name} after its commit")
            check_parked(f"{name} after its commit")

    def stream_writer(name: str) -> None:
        """Commits into the stream source (each put emits a job into txp_stream under every
        lock of that queue, T6/T7), some with a push into txp_fixed, some with a delete."""
        rng = random.Random(seed + 7)
        own = list(range(5000, 5008))
        for _ in range(per_writer):
            k = rng.choice(own)
            tx = d.tx()
            began: list[tuple[int, int, int]] = []
            if rng.random() < 0.15:
                began.append((FEED, k, model.begin(FEED, k, "del")))
                tx.delete(maps[FEED], k)
                emitted = None
            else:
                v = model.begin(FEED, k, "put")
                began.append((FEED, k, v))
                emitted = (FEED, k, v, 0)
            ident = None
            if emitted is not None and rng.random() < 0.3:
                ident = model.job(FEED, k, began[0][2])
                tx.push(fq, ident)  # ahead of the put in the builder: its job needs the put all the same
            if emitted is not None:
                tx.put(maps[FEED], k, [k, began[0][2]])
            if rng.random() < 0.5:
                tx.durable()
            ids = tx.commit()
            for b in began:
                model.returned(*b)
            if emitted is not None:
                model.pushed_ok(SQ.name, emitted, None)  # commit() returns only explicit pushes' ids
            if ident is not None:
                model.pushed_ok(FQ.name, ident, ids[0])
            for mm, kk, vv in began:
                model.check_read(maps, mm, kk, vv, f"{name} after its commit")

    def direct_writer(name: str) -> None:
        """Direct puts then pushes of a job naming the put (the put returned first, so a
        consumer must see it), direct deletes, push_many, parked pushes."""
        rng = random.Random(seed + 11)
        own = [9000 + i for i in range(10)]
        last_put: dict[tuple[int, int], int] = {}
        for _ in range(per_writer):
            r = rng.random()
            m = rng.randrange(2)
            k = rng.choice(own)
            if r < 0.45:
                v = model.begin(m, k, "put")
                maps[m].put(k, [k, v])
                model.returned(m, k, v)
                last_put[(m, k)] = v
                model.check_read(maps, m, k, v, f"{name} after its put")
                q = rng.choice([fq, vq, sq])
                ident = model.job(m, k, v)
                try:
                    jid = q.push(_payload(q, ident))
                except QueueFull:
                    assert q is vq
                    model.queue_full += 1
                    continue
                model.pushed_ok(q.name, ident, jid)
            elif r < 0.6:
                v = model.begin(m, k, "del")
                maps[m].delete(k)
                model.returned(m, k, v)
                last_put.pop((m, k), None)
                model.check_read(maps, m, k, v, f"{name} after its delete")
            elif r < 0.85 and last_put:
                q = rng.choice([fq, vq])
                picks = [rng.choice(sorted(last_put)) for _ in range(rng.randint(2, 6))]
                idents = [model.job(pm, pk, last_put[(pm, pk)]) for pm, pk in picks]
                try:
                    jids = q.push_many([_payload(q, i) for i in idents])
                except QueueFull:
                    assert q is vq
                    model.queue_full += 1
                    continue
                for jid, ident in zip(list(jids), idents, strict=True):
                    model.pushed_ok(q.name, ident, int(jid))
            else:
                pq.push((99, next(model.nonce)), delay=FAR)
                model.park(name)
                check_parked(f"{name} after its parked push")

    def consume_one(name: str, q: armdb.Queue[Any], lz: Any) -> tuple[int, int, int, int]:
        try:
            ident = _ident(lz.payload)
        except AssertionError as e:
            raise AssertionError(f"{q.name} job {lz.id}: {e}") from None
        model.hold(q.name, lz.id, ident, name)
        m, k, v, _ = ident
        # The outbox rule: the job is visible only with its commit's map write (T2), and
        # a direct push's job only after the put that returned before it.
        model.check_read(maps, m, k, v, f"{name} leasing {q.name} job {lz.id}")
        return ident

    def direct_consumer(name: str) -> None:
        """lease(n), then a direct ack, nack (delay 0) or dead-letter of each lease."""
        rng = random.Random(seed + 21)
        idle = 0
        while idle < 3:
            got = 0
            for q in (fq, vq, sq):
                for lz in q.lease(rng.randint(1, 4)):
                    got += 1
                    ident = consume_one(name, q, lz)
                    r = rng.random()
                    model.release(q.name, lz.id)
                    if r < 0.7:
                        q.ack(lz)
                        model.ack(q.name, ident)
                    elif r < 0.96:
                        q.nack(lz, delay=0)
                    else:
                        q.nack(lz, dead=True)
                        model.dead_nacked.add((q.name, ident))
            idle = idle + 1 if got == 0 and producers_done.is_set() else 0
            if got == 0:
                time.sleep(0.002)

    def batch_consumer(name: str) -> None:
        """lease_batch then ack_many, or the next lease_batch(ack=previous batch) (Q31, Q32)."""
        rng = random.Random(seed + 31)
        prev: dict[str, tuple[Any, list[tuple[int, int, int, int]]]] = {}
        idle = 0
        while idle < 3:
            got = 0
            for q in (fq, vq):
                ack = prev.pop(q.name, None)
                if ack is not None:
                    for jid in ack[0].ids.tolist():
                        model.release(q.name, int(jid))
                batch = q.lease_batch(rng.randint(1, 8), ack=ack[0] if ack is not None else None)
                if ack is not None:
                    for ident in ack[1]:
                        model.ack(q.name, ident)
                if len(batch) == 0:
                    continue
                got += len(batch)
                idents = [consume_one(name, q, lz) for lz in batch]
                if rng.random() < 0.5:
                    for jid in batch.ids.tolist():
                        model.release(q.name, int(jid))
                    assert q.ack_many(batch) == len(batch)
                    for ident in idents:
                        model.ack(q.name, ident)
                else:
                    prev[q.name] = (batch, idents)
            idle = idle + 1 if got == 0 and producers_done.is_set() else 0
            if got == 0:
                time.sleep(0.002)
        for qname, (batch, idents) in prev.items():
            for jid in batch.ids.tolist():
                model.release(qname, int(jid))
            assert queues[qname].ack_many(batch) == len(batch)
            for ident in idents:
                model.ack(qname, ident)

    def tx_consumer(name: str) -> None:
        """Acks and nacks inside commits, with a put or delete of its own key (commits
        that read state: tokens, the net depth of txp_var); half durable."""
        rng = random.Random(seed + 41)
        own = [7000 + i for i in range(6)]
        idle = 0
        while idle < 3:
            leases = [(q, lz) for q in (fq, vq) for lz in (q.lease(rng.randint(1, 2)) if rng.random() < 0.7 else [])]
            if not leases:
                idle = idle + 1 if producers_done.is_set() else 0
                time.sleep(0.002)
                continue
            idle = 0
            tx = d.tx()
            settled: list[tuple[str, int, tuple[int, int, int, int], bool]] = []
            for q, lz in leases:
                ident = consume_one(name, q, lz)
                ack = rng.random() < 0.75
                if ack:
                    tx.ack(q, lz)
                else:
                    tx.nack(q, lz.token, delay=0)
                settled.append((q.name, lz.id, ident, ack))
            m = rng.randrange(2)
            k = rng.choice(own)
            kind = "put" if rng.random() < 0.8 else "del"
            v = model.begin(m, k, kind)
            if kind == "put":
                tx.put(maps[m], k, [k, v])
            else:
                tx.delete(maps[m], k)
            if rng.random() < 0.5:
                tx.durable()
            for qname, jid, _, _ in settled:
                model.release(qname, jid)
            tx.commit()
            model.returned(m, k, v)
            for qname, _, ident, ack in settled:
                if ack:
                    model.ack(qname, ident)
            model.check_read(maps, m, k, v, f"{name} after its commit")

    def reader(name: str) -> None:
        rng = random.Random(seed + 51)
        while not stop_reader.is_set():
            keys = list(model.published.copy().items())
            for (m, k), v in rng.sample(keys, min(8, len(keys))):
                model.check_read(maps, m, k, v, name)
            for q in queues.values():
                st = q.stats()
                if st.len < 0 or st.dead_len < 0:
                    model.violations.append(f"{name}: {q.name} stats {st}")
                q.len()
            check_parked(name)
            time.sleep(0.001)

    threads = Threads()
    writers = {"tx-writer-0", "tx-writer-1", "stream-writer", "direct-writer"}
    threads.start("tx-writer-0", lambda: tx_writer(0, "tx-writer-0"))
    threads.start("tx-writer-1", lambda: tx_writer(1, "tx-writer-1"))
    threads.start("stream-writer", lambda: stream_writer("stream-writer"))
    threads.start("direct-writer", lambda: direct_writer("direct-writer"))
    threads.start("direct-consumer", lambda: direct_consumer("direct-consumer"))
    threads.start("batch-consumer", lambda: batch_consumer("batch-consumer"))
    threads.start("tx-consumer", lambda: tx_consumer("tx-consumer"))
    threads.start("reader", lambda: reader("reader"))
    deadline = time.monotonic() + JOIN_TIMEOUT
    try:
        threads.join(writers, deadline)
    finally:
        producers_done.set()
    threads.join({"direct-consumer", "batch-consumer", "tx-consumer"}, deadline)
    stop_reader.set()
    threads.join(None, deadline)
    assert not threads.errors, "a thread failed:\n" + "\n".join(threads.errors)
    assert not model.violations, f"{len(model.violations)} violations:\n" + "\n".join(model.violations[:20])
    # The run did what it is meant to (not a vacuous pass).
    assert sum(len(p) for p in model.pushed.values()) > 2 * per_writer, model.pushed
    assert sum(model.acked.values()) > per_writer, "the consumers acked almost nothing"
    assert model.failed.isdisjoint(model.seen_puts), (
        f"a write of a commit that raised was read: {sorted(model.failed & model.seen_puts)[:5]}"
    )

    def check_maps(when: str) -> None:
        for m in range(len(MAPS)):
            want = model.expected_map(m)
            got = dict(maps[m].items())
            assert got == want, (
                f"{when}: {MAPS[m]} differs from the last writes that returned: "
                f"{ {k: (got.get(k), want.get(k)) for k in set(got) | set(want) if got.get(k) != want.get(k)} }"
            )
        assert pq.len() == model.parked_total(), f"{when}: parked rows differ from the parked pushes"

    check_maps("in process")
    rows = _check_final_queues(model, queues, "in process")
    d.close()

    d = armdb.Db.open(db_path, tx_config=tx_config, schema=_registry(), clock=clock)
    try:
        maps, queues = _open_all(d)
        pq = queues[PQ.name]
        check_maps("after reopen")
        rows2 = _check_final_queues(model, queues, "after reopen")
        for qname in rows:
            assert sorted(rows2[qname][0]) == sorted(rows[qname][0]), f"{qname}: the live rows changed across reopen"
            assert sorted(rows2[qname][1]) == sorted(rows[qname][1]), f"{qname}: the dead rows changed across reopen"
    finally:
        d.close()
    rep = armdb.check(db_path)
    assert rep.ok, rep.findings


# -- injected log-sync faults ----------------------------------------------------------------------


class LogSyncFailsAt(_fs.RealFS):
    """The real file system, except that the ``k``-th ``fdatasync`` of a transaction log
    file fails with EIO (S12: it is never retried).  Store syncs (their own files, a
    background thread's timed syncs, the checkpoint's) pass: only the log fails."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.calls = 0
        self.failed = False
        self._lock = threading.Lock()

    def fdatasync(self, fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if os.sep + "txlog" + os.sep in path and path.endswith(".log"):
            with self._lock:
                self.calls += 1
                fail = self.calls == self.k
                if fail:
                    self.failed = True
            if fail:
                raise OSError(errno.EIO, "injected log sync failure")
        super().fdatasync(fd)


FAULT_JOB = np.dtype([("k", "<u8")])
FFQ = armdb.queue("txf_fixed", payload=FAULT_JOB)
FVQ = armdb.queue("txf_var", payload=int, var=True)


def _open_fault(d: armdb.Db) -> tuple[Map, armdb.Queue[Any], armdb.Queue[Any]]:
    m = d.open_map("txf_docs", Config.balanced().shard_count(1).enable_fsync(False).build())
    header = FixedConfig.balanced().shard_count(1).grow_step(64).enable_fsync(False).build()
    body = Config.balanced().shard_count(1).enable_fsync(False).build()
    cfg = QueueConfig.balanced().header_config(header).payload_config(body).max_attempts(1000).build()
    return m, d.open_queue(FFQ, cfg), d.open_queue(FVQ, cfg)


def _job_key(payload: Any) -> int:
    return int(payload) if isinstance(payload, int) else int(payload["k"])


# SPEC T2, T3, S12, Q14: the k-th log sync fails while five threads commit durably on the
# same shards and a sixth pushes, leases and acks directly.  No thread hangs; every call
# returns or raises TxFailedAfterLog/TxSyncFailed/StorageError; after a reopen every commit
# that returned is there, every commit refused before its log append is absent, every
# commit is all or nothing, every ack that returned holds, and the directory checks clean.
@pytest.mark.parametrize("k", [1, 4, 13])
def test_t3_failed_log_sync_under_threads_keeps_every_commit_whole(db_path: Path, k: int) -> None:
    clock = FakeClock()
    fs = LogSyncFailsAt(k)
    n_ops = 30
    # (thread, op) -> (outcome, ...): "ok", "after_log" (TxFailedAfterLog: the record was
    # appended, so it may or may not be replayed), "refused" (StorageError before the append).
    outcome: dict[tuple[int, int], tuple[Any, ...]] = {}
    direct_pushed: dict[int, str] = {}  # key -> queue, for direct pushes that returned
    acked: set[int] = set()  # job keys whose ack returned
    maybe_acked: set[int] = set()  # job keys whose ack raised after its log append

    def classify(e: BaseException) -> str:
        if isinstance(e, TxFailedAfterLog):  # TxSyncFailed included
            return "after_log"
        if isinstance(e, StorageError):
            return "refused"
        raise e

    with _fs.use(fs):
        d = armdb.Db.open(db_path, clock=clock)
        m, fq, vq = _open_fault(d)
        start = threading.Barrier(6)

        def committer(t: int) -> None:
            start.wait()
            for i in range(n_ops):
                key = (t + 1) * 100_000 + i
                q = fq if (i + t) % 2 else vq
                tx = d.tx().put(m, key, key).push(q, (key,) if q is fq else key)
                prev = None
                if t == 2 and i > 0:  # with a delete of its previous key: all or nothing too
                    prev = key - 1
                    tx.delete(m, prev)
                try:
                    tx.durable().commit()
                    outcome[(t, i)] = ("ok", key, q.name, prev)
                except Exception as e:  # noqa: BLE001 - classified, anything else re-raised
                    outcome[(t, i)] = (classify(e), key, q.name, prev)

        def ack_committer(t: int) -> None:
            """Leases a job and acks it in a durable commit with a marker put (an outbox
            consumer): the marker exists exactly when the job is gone."""
            start.wait()
            for i in range(n_ops):
                try:
                    leases = fq.lease(1) + vq.lease(1)
                except StorageError:
                    leases = []
                if not leases:
                    time.sleep(0.001)
                    continue
                tx = d.tx()
                jobs = []
                for lz in leases:
                    q = fq if isinstance(lz.payload, np.void) else vq
                    tx.ack(q, lz)
                    jobs.append(_job_key(lz.payload))
                marker = -(t * 100_000 + i) - 1
                tx.put(m, marker, jobs)
                try:
                    tx.durable().commit()
                    outcome[(t, i)] = ("ack_ok", marker, jobs)
                except Exception as e:  # noqa: BLE001 - classified, anything else re-raised
                    outcome[(t, i)] = ("ack_" + classify(e), marker, jobs)

        def direct() -> None:
            start.wait()
            for i in range(n_ops * 2):
                key = 900_000 + i
                q = fq if i % 2 else vq
                try:
                    q.push((key,) if q is fq else key)
                    direct_pushed[key] = q.name
                except StorageError:
                    pass
                for qq in (fq, vq):
                    try:
                        leases = qq.lease(1)
                    except StorageError:
                        continue
                    for lz in leases:
                        jk = _job_key(lz.payload)
                        try:
                            qq.ack(lz)
                            acked.add(jk)
                        except (TxFailedAfterLog, StorageError):
                            # A var ack is a logged commit that may be replayed; a refused
                            # one leaves the row leased.  Either way it may be gone.
                            maybe_acked.add(jk)

        threads = Threads()
        for t in range(4):
            threads.start(f"committer-{t}", lambda t=t: committer(t))
        threads.start("ack-committer", lambda: ack_committer(4))
        threads.start("direct", direct)
        threads.join(None, time.monotonic() + JOIN_TIMEOUT)
        assert not threads.errors, "a thread failed:\n" + "\n".join(threads.errors)
        assert fs.failed, f"only {fs.calls} log syncs ran; the fault at sync {k} never fired"
        kinds = Counter(o[0] for o in outcome.values())
        assert kinds["after_log"] + kinds["ack_after_log"] >= 1, kinds  # the failed sync failed a commit
        try:
            d.close()
        except StorageError:
            pass  # closing over a failed log may report it; the reopen below is what counts

    with armdb.Db.open(db_path, clock=clock) as d:
        m, fq, vq = _open_fault(d)
        stored = dict(m.items())
        live: dict[int, tuple[str, int]] = {}
        for q in (fq, vq):
            assert q.dead_len() == 0
            for j in (q.peek(1_000_000) if q.len() else []):
                jk = _job_key(j.payload)
                assert jk not in live, f"job {jk} is in the queues twice: {live[jk]} and {(q.name, j.id)}"
                live[jk] = (q.name, j.id)
        markers = {mk: v for mk, v in stored.items() if mk < 0}
        acked_by_tx = {j for v in markers.values() for j in v}
        gone = acked | acked_by_tx  # jobs whose ack is known to hold

        for (t, i), o in sorted(outcome.items()):
            kind = o[0]
            if kind.startswith("ack_"):
                _, marker, jobs = o
                if kind == "ack_ok":
                    assert marker in stored, f"tx ack {marker} returned but its marker is lost"
                elif kind == "ack_refused":
                    assert marker not in stored, f"tx ack {marker} was refused before its log append but left its put"
                # All or nothing: the marker exists exactly when every job it acked is gone.
                if marker in stored:
                    assert not any(j in live for j in jobs), f"tx ack {marker} is half applied: jobs {jobs} still live"
                else:
                    assert all(j in live for j in jobs), f"tx ack {marker} is half applied: jobs {jobs} gone, no marker"
                continue
            _, key, qname, prev = o
            # A job that is live, or was leased (acked or not), was made visible by its
            # commit: the job tells whether the commit was applied.
            applied = key in live or key in gone or key in maybe_acked
            if kind == "ok":
                assert applied, f"commit {key} returned but its job is lost"
            elif kind == "refused":
                assert not applied, f"commit {key} was refused before its log append but its job exists"
            if key in live:
                assert live[key][0] == qname, f"job {key} is in {live[key][0]}, pushed to {qname}"
            # Its put is there exactly when it was applied, unless the thread's next
            # commit (later in the log) deleted it.
            nxt = outcome.get((t, i + 1))
            deleted_later = nxt is not None and nxt[3] == key and (
                nxt[1] in live or nxt[1] in gone or nxt[1] in maybe_acked)
            want = applied and not deleted_later
            assert (key in stored) == want, (
                f"commit {key} ({kind}) is half applied or lost: put there {key in stored}, job there {applied}, "
                f"deleted by the next commit {deleted_later}"
            )
            assert key not in stored or stored[key] == key
            if prev is not None and applied:
                assert prev not in stored, f"commit {key} is half applied: its delete of {prev} is lost"
        for key in direct_pushed:
            assert key in live or key in gone or key in maybe_acked, f"direct push {key} returned but is lost"
        for key in acked:
            assert key not in live, f"job {key}: its ack returned but it is back"
    rep = armdb.check(db_path)
    assert rep.ok, rep.findings
