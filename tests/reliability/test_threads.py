"""Harness (f): thread stress with lease-window checking (docs/reliability.md, (f); SPEC Q12, Q13, Q28).

8 producer and 8 consumer threads share one fixed and one var queue handle (20,000
jobs each, 40,000 in all) on the real clock, plus a chaos thread reading ``len``,
``dead_len``, ``stats``, ``next_delay`` and ``snapshot`` in a loop.  Every lease
records (job, token epoch, attempt, invocation and completion time, deadline);
every ack/nack records its invocation, completion and whether it was refused as
stale.  Consumers mostly ack at once; sometimes they nack, take a short lease and
sleep past its deadline before acking or nacking (an expired token is still
honoured unless the row was leased again, Q13), abandon a lease, or ack an old token
of a job that was already acked (which must be refused).

``checker.check_lease_history`` then proves: no two unexpired, unsettled leases of
one job ever overlapped (the conservative Jepsen window), nothing was lost or
delivered unpushed, each job was acked exactly once (a refused ack does not count),
no delivery after an ack, every redelivery is explained by an expiry or a nack, and
no stale token was honoured.  After a drain both queues are empty and
``armdb.check`` is clean.

Sizes: CI three seeds (``test_threads_ci``); nightly ``ARMDB_THREAD_SEEDS`` seeds
(default 20, ``@pytest.mark.slow``).  ``ARMDB_THREAD_SEED`` replays a seed's choices
(thread interleavings themselves are not reproducible).
"""

from __future__ import annotations

import faulthandler
import os
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from armdb import StaleToken
from armdb import errors as armdb_errors

from . import adapter
from .adapter import Profile
from .checker import Delivery, Settle, check_lease_history
from .journal import make_payload, now_ms, parse_payload, save_artifacts, summary_line

PRODUCERS = 8
CONSUMERS = 8
JOBS = int(os.environ.get("ARMDB_THREAD_JOBS", "40000"))
LEASE_TIMEOUT = 0.25  # the queue default: long enough that a prompt ack beats it
SHORT_LEASE = 0.02  # the leases a consumer deliberately outlives
DEADLINE_S = 240.0
VIOLATION_KEYS = ("lease_overlaps", "lost", "unexpected", "double_acked", "resurrected",
                  "unexplained_duplicates", "stale_accepted", "attempt_regressions", "exceptions",
                  "wrong_payload", "check_failures", "leftover_rows")


class Run:
    """One seed of the thread stress."""

    def __init__(self, path: Path, seed: int, jobs: int) -> None:
        self.path = path
        self.seed = seed
        self.jobs = jobs
        self.profile = Profile(lease_timeout=LEASE_TIMEOUT, max_attempts=10_000, backoff=(0.0,),
                               grow_step=4096, shards=2)
        self.pushed: set[int] = set()
        self.deliveries: list[Delivery] = []
        self.settles: list[Settle] = []
        self.drained: Counter[int] = Counter()
        self.acked = 0
        self.lock = threading.Lock()
        self.errors: list[str] = []
        self.wrong_payload = 0
        self.stop = threading.Event()
        self.producers_done = threading.Event()
        self.chaos_reads = 0
        self.behaviour: Counter[str] = Counter()

    # -- threads ---------------------------------------------------------------------------------
    def producer(self, i: int, qs: dict) -> None:
        rng = random.Random(self.seed * 1000 + i)
        per = self.jobs // PRODUCERS
        local: list[int] = []
        for k in range(per):
            n = i * 1_000_000 + k + 1
            kind = "f" if k % 2 == 0 else "v"
            adapter.push(qs[kind], kind, n, rng.choice((40, 100, 300)))
            local.append(n)
        with self.lock:
            self.pushed.update(local)

    def consumer(self, i: int, qs: dict) -> None:
        rng = random.Random(self.seed * 1000 + 500 + i)
        name = f"c{i}"
        deliveries: list[Delivery] = []
        settles: list[Settle] = []
        old: list[tuple[int, int, object, str]] = []  # (job, epoch, token, kind) of acked leases
        behaviour: Counter[str] = Counter()
        idle = 0
        try:
            while not self.stop.is_set():
                kind = rng.choice(("f", "v"))
                q = qs[kind]
                short = rng.random() < 0.08
                t_inv = time.time_ns()
                got = q.lease(rng.randint(1, 4), lease_timeout=SHORT_LEASE if short else None)
                t_comp = time.time_ns()
                if not got:
                    idle += 1
                    if self.producers_done.is_set() and idle > 200 and (self.acked >= self.jobs or idle > 3000):
                        break  # all acked, or nothing due for seconds (the drain and checker take over)
                    time.sleep(0.001)
                    continue
                idle = 0
                leased = []
                for lz in got:
                    n = parse_payload(adapter.payload_bytes(kind, lz.payload))
                    if n is None:
                        with self.lock:
                            self.wrong_payload += 1
                        continue
                    dl = round(lz.deadline.timestamp() * 1000)
                    deliveries.append(Delivery(n, int(lz.token.epoch), int(lz.attempt), t_inv, t_comp, dl, name))
                    leased.append((n, lz))
                if short:
                    time.sleep(SHORT_LEASE + 0.01)  # outlive the lease on purpose
                for n, lz in leased:
                    r = rng.random()
                    if short:
                        what = "late_ack" if r < 0.7 else "late_nack"
                    elif r < 0.05:
                        what = "nack"
                    elif r < 0.06:
                        what = "abandon"
                    else:
                        what = "ack"
                    behaviour[what] += 1
                    if what == "abandon":
                        continue
                    is_ack = what in ("ack", "late_ack")
                    s_inv = time.time_ns()
                    try:
                        if is_ack:
                            q.ack(lz.token)
                        else:
                            q.nack(lz.token, delay=0.0)
                        ok = True
                    except StaleToken:
                        ok = False
                    s_comp = time.time_ns()
                    settles.append(Settle(n, int(lz.token.epoch), "ack" if is_ack else "nack", s_inv, s_comp, ok, name))
                    if short:
                        behaviour["late_honoured" if ok else "late_refused"] += 1
                    if ok and is_ack:
                        with self.lock:
                            self.acked += 1
                        if len(old) < 64:
                            old.append((n, int(lz.token.epoch), lz.token, kind))
                    if ok and is_ack and old and rng.random() < 0.02:
                        # Ack an old token of a job already acked: it must be refused (Q13).
                        on, oe, otok, okind = old[rng.randrange(len(old))]
                        behaviour["stale_ack"] += 1
                        s_inv = time.time_ns()
                        try:
                            qs[okind].ack(otok)
                            sok = True
                        except StaleToken:
                            sok = False
                        settles.append(Settle(on, oe, "ack", s_inv, time.time_ns(), sok, name))
                        if sok:
                            with self.lock:
                                self.acked += 1
        except BaseException as e:  # noqa: BLE001 - reported by the test
            with self.lock:
                self.errors.append(f"{name}: {type(e).__name__}: {e}")
        finally:
            with self.lock:
                self.deliveries.extend(deliveries)
                self.settles.extend(settles)
                self.behaviour.update(behaviour)

    def chaos(self, db: object, qs: dict) -> None:
        try:
            while not self.stop.is_set():
                for q in qs.values():
                    q.len()
                    q.dead_len()
                    q.next_delay()
                    q.stats()
                    if self.chaos_reads % 20 == 0:
                        q.snapshot()
                    self.chaos_reads += 1
                time.sleep(0.005)
        except BaseException as e:  # noqa: BLE001
            with self.lock:
                self.errors.append(f"chaos: {type(e).__name__}: {e}")

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> tuple[Counter[str], list[str], float]:
        t0 = time.monotonic()
        db, qs, _eff = adapter.open_all(self.path, self.profile)
        old_hook = threading.excepthook

        def hook(args: threading.ExceptHookArgs) -> None:
            with self.lock:
                self.errors.append(f"{args.thread.name if args.thread else '?'}: {args.exc_type.__name__}: "
                                   f"{args.exc_value}")

        threading.excepthook = hook
        old_switch = sys.getswitchinterval()
        sys.setswitchinterval(1e-5)  # frequent GIL hand-offs: more interleavings
        faulthandler.dump_traceback_later(DEADLINE_S + 60, exit=False)
        try:
            prods = [threading.Thread(target=self.producer, args=(i, qs), name=f"p{i}") for i in range(PRODUCERS)]
            cons = [threading.Thread(target=self.consumer, args=(i, qs), name=f"c{i}") for i in range(CONSUMERS)]
            chaos = threading.Thread(target=self.chaos, args=(db, qs), name="chaos")
            for t in prods + cons + [chaos]:
                t.start()
            for t in prods:
                t.join()
            self.producers_done.set()
            end = time.monotonic() + DEADLINE_S
            for t in cons:
                t.join(max(0.0, end - time.monotonic()))
            hung = [t.name for t in cons if t.is_alive()]
            self.stop.set()
            for t in cons + [chaos]:
                t.join(30)
            if hung:
                self.errors.append(f"consumers still running after {DEADLINE_S} s: {hung}")
        finally:
            sys.setswitchinterval(old_switch)
            threading.excepthook = old_hook
            faulthandler.cancel_dump_traceback_later()
        # Drain what the consumers abandoned (wait for those leases to expire first).
        time.sleep(LEASE_TIMEOUT + 0.05)
        leftover = 0
        for kind, q in qs.items():
            empty = 0
            while empty < 3:
                got = q.lease(64)
                if not got:
                    empty += 1
                    time.sleep(0.01)
                    continue
                empty = 0
                for lz in got:
                    n = parse_payload(adapter.payload_bytes(kind, lz.payload))
                    if n is None:
                        self.wrong_payload += 1
                        continue
                    dl = round(lz.deadline.timestamp() * 1000)
                    t = time.time_ns()
                    self.deliveries.append(Delivery(n, int(lz.token.epoch), int(lz.attempt), t, t, dl, "drain"))
                    q.ack(lz.token)
                    self.settles.append(Settle(n, int(lz.token.epoch), "ack", t, time.time_ns(), True, "drain"))
            leftover += q.len() + q.dead_len()
        adapter.close(db)
        ok, findings = adapter.check(self.path)
        c, bad = check_lease_history(self.pushed, self.deliveries, self.settles, {})
        c["exceptions"] = len(self.errors)
        c["wrong_payload"] += self.wrong_payload
        c["check_failures"] = 0 if ok else 1
        c["leftover_rows"] = leftover
        bad = self.errors[:10] + bad + ([] if ok else [f"check: {findings[:3]}"])
        if leftover:
            bad.append(f"{leftover} rows left after the drain")
        return c, bad, time.monotonic() - t0


def run_seeds(tmp_path: Path, seeds: list[int], jobs: int) -> None:
    total: Counter[str] = Counter()
    behaviour: Counter[str] = Counter()
    problems: list[str] = []
    seconds = 0.0
    chaos = 0
    for seed in seeds:
        r = Run(tmp_path / f"seed-{seed}", seed, jobs)
        c, bad, secs = r.run()
        total.update(c)
        behaviour.update(r.behaviour)
        chaos += r.chaos_reads
        seconds += secs
        if any(c[k] for k in VIOLATION_KEYS):
            problems += [f"seed {seed}: {b}" for b in bad[:15]]
            save_artifacts("threads", seed, [r.path],
                           f"ARMDB_THREAD_SEED={seed} .venv/bin/python -m pytest -p no:cacheprovider -s "
                           f"tests/reliability/test_threads.py -k ci", "\n".join(bad))
    fields: dict[str, object] = {
        "seeds": len(seeds),
        "threads": f"{PRODUCERS}P+{CONSUMERS}C+1chaos",
        "jobs": jobs * len(seeds),
        "leases": total["deliveries"],
        "redelivered_jobs": total["duplicated"],
        "explained_duplicates": total["explained_duplicates"],
        "nacks": behaviour["nack"] + behaviour["late_nack"],
        "late_settles": behaviour["late_ack"] + behaviour["late_nack"],
        "late_honoured": behaviour["late_honoured"],
        "late_refused": behaviour["late_refused"],
        "abandoned": behaviour["abandon"],
        "stale_acks_tried": behaviour["stale_ack"],
        "chaos_reads": chaos,
        "seconds": f"{seconds:.0f}",
        "leases_per_s": f"{total['deliveries'] / seconds:.0f}" if seconds else "0",
    }
    for k in VIOLATION_KEYS:
        fields[k] = total[k]
    fields["seed"] = seeds[0] if len(seeds) == 1 else f"{seeds[0]}..{seeds[-1]}"
    summary_line("threads", fields)
    assert not problems, "thread stress violations:\n" + "\n".join(problems[:30])


@pytest.mark.stress
@pytest.mark.timeout(600)
def test_threads_ci(tmp_path: Path) -> None:
    """Q12/Q13/Q28: 8P x 8C over 40,000 jobs, three seeds (its CI target in tests/reliability/figures.py):
    no overlap, no loss, one ack per job."""
    seed = int(os.environ.get("ARMDB_THREAD_SEED") or int.from_bytes(os.urandom(2), "little"))
    run_seeds(tmp_path, [seed, seed + 1, seed + 2], JOBS)


@pytest.mark.stress
@pytest.mark.slow
@pytest.mark.timeout(0)
def test_threads_nightly(tmp_path: Path) -> None:
    """The same over ``ARMDB_THREAD_SEEDS`` seeds (default 20)."""
    base = int(os.environ.get("ARMDB_THREAD_SEED", "1"))
    seeds = list(range(base, base + int(os.environ.get("ARMDB_THREAD_SEEDS", "20"))))
    run_seeds(tmp_path, seeds, JOBS)


def test_checker_flags_an_overlap() -> None:
    """The lease-window checker itself: a lease inside a live, unsettled lease is flagged."""
    t = now_ms() * 1_000_000
    d1 = Delivery(1, 1, 1, t, t + 1_000, now_ms() + 10_000, "a")
    d2 = Delivery(1, 2, 2, t + 2_000, t + 3_000, now_ms() + 20_000, "b")
    c, _ = check_lease_history({1}, [d1, d2], [Settle(1, 2, "ack", t + 4_000, t + 5_000, True, "b")], {})
    assert c["lease_overlaps"] == 1 and c["unexplained_duplicates"] == 1 and c["lost"] == 0
    nack = Settle(1, 1, "nack", t + 1_500, t + 1_600, True, "a")
    c, _ = check_lease_history({1}, [d1, d2], [nack, Settle(1, 2, "ack", t + 4_000, t + 5_000, True, "b")], {})
    assert c["lease_overlaps"] == 0 and c["unexplained_duplicates"] == 0
    assert make_payload(5, 64) and parse_payload(make_payload(5, 64)) == 5


def test_q28_q9_var_lease_never_reports_a_concurrently_acked_row_as_corrupt(tmp_path: Path) -> None:
    """Q28/Q9: a var lease whose row is re-leased and acked by another consumer mid-call.

    ``Queue.lease`` claims rows under the shard lock, releases it, and only then reads
    each var body.  If the lease it just took expires before that read (a short
    ``lease_timeout`` and a busy interpreter: the thread harness hit this with 20 ms
    leases, 16 threads and a 10 us switch interval), another consumer can lease the
    row again and ack it, deleting the body.  The first ``lease`` then raises
    ``FormatError("row N has no body; run armdb.check")`` -- a corruption report for a
    healthy database -- and the other rows it claimed are handed to nobody until they
    expire.  This test makes the interleaving deterministic with a fake clock: the
    body read of the first lease runs the other consumer's lease + ack first.
    """
    from armdb import Db

    ms = [1_700_000_000_000]
    db = Db.open(tmp_path / "db", clock=lambda: ms[0])
    try:
        q = db.open_queue(adapter.VAR_SPEC, adapter.queue_config(Profile(), var=True))
        seq = q.push(make_payload(1, 100))
        q._cache_drop(seq)  # the body was evicted from the payload cache: the lease reads the store
        store = q._payload
        real_get = store.get
        raced: list[object] = []

        def get_after_a_race(key: bytes) -> bytes | None:
            if not raced:
                raced.append(True)
                ms[0] += 1_000  # the first lease (20 ms) expires before its body is read ...
                (other,) = q.lease(1, lease_timeout=60)  # ... another consumer re-leases the row
                q.ack(other.token)  # ... and acks it, deleting the body
            return real_get(key)

        store.get = get_after_a_race  # type: ignore[method-assign]
        try:
            got = q.lease(1, lease_timeout=0.02)
        except armdb_errors.FormatError as e:
            pytest.fail(f"lease reported a healthy database as corrupt after a concurrent ack: {e}")
        finally:
            store.get = real_get  # type: ignore[method-assign]
        assert got == [] or all(parse_payload(lz.payload) == 1 for lz in got)
        assert q.len() == 0
    finally:
        db.shutdown()
    assert adapter.check(tmp_path / "db")[0]
