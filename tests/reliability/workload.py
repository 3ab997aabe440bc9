"""Code the worker children run (kill -9 loop and failpoint harnesses).

A child is started as ``python -u -c "from tests.reliability.workload import main; main(SPEC)"``
where ``SPEC`` is a JSON object.  It journals every call (``journal.py``) and prints
``OPENING`` before it opens the database and ``READY`` once it is open, so the parent
can time its kill.  Every random choice goes through ``random.Random(spec["seed"])``.

Two entry points:

* ``loop``: the kill -9 workload.  Runs a weighted random mix of push / lease / ack /
  nack / outbox tx on a fixed and a var queue until it is killed.
* ``script``: the failpoint workload.  Runs a named, deterministic script to the end
  (``ARMDB_FAILPOINT`` makes it exit 86 at the chosen point) and prints ``DONE``.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import traceback
from typing import Any

from . import adapter
from .adapter import Profile
from .journal import Journal, now_ms

KINDS = ("f", "v")


class Worker:
    """Journaled verbs over one open database (the journal format is in ``journal.py``)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.profile = Profile.from_json(spec["profile"])
        self.j = Journal(spec["journal"])
        self.rng = random.Random(spec["seed"])
        self.next_n = int(spec["base"])
        self.held: list[tuple[str, adapter.Leased]] = []
        self.db: Any = None
        self.qs: dict[str, Any] = {}
        self.eff: Any = None
        self.clock: Any = None

    # -- lifecycle -------------------------------------------------------------------------
    def open(self) -> None:
        print("OPENING", flush=True)
        self.j.write("O?")
        self.db, self.qs, self.eff = adapter.open_all(self.spec["db"], self.profile, self.clock)
        orphans = adapter.orphans_collected(self.qs["v"])
        self.j.write("O!", orphans)
        print("READY", flush=True)

    def new_n(self) -> int:
        n = self.next_n
        self.next_n += 1
        return n

    def length(self) -> int:
        return self.rng.choice((40, 100, 300, 1000, 3000))

    # -- verbs ------------------------------------------------------------------------------
    def push(self, kind: str, tx: bool = False) -> None:
        n = self.new_n()
        ln = self.length()
        self.j.write("P?", kind, n, ln)
        if tx:
            rid = adapter.tx_push(self.db, self.qs[kind], kind, n, ln, self.profile.durable)
        else:
            rid = adapter.push(self.qs[kind], kind, n, ln)
        self.j.write("P!", kind, n, rid)

    def lease(self, kind: str, k: int, timeout: float | None) -> list[adapter.Leased]:
        self.j.write("L?", kind, k, now_ms())
        got = adapter.lease(self.qs[kind], kind, k, timeout)
        for lz in got:
            self.j.write("L!", kind, lz.id, lz.n, lz.attempt, lz.epoch, lz.shard, lz.due, lz.deadline_ms,
                         1 if lz.ok else 0, lz.handle)
            self.held.append((kind, lz))
        self.j.write("L.", kind, len(got), now_ms())
        return got

    def take(self) -> tuple[str, adapter.Leased]:
        return self.held.pop(self.rng.randrange(len(self.held)))

    def ack(self, kind: str, lz: adapter.Leased) -> bool:
        self.j.write("A?", kind, lz.id, lz.n, lz.epoch)
        ok = adapter.ack(self.qs[kind], lz.token)
        self.j.write("A!" if ok else "A~", kind, lz.id, lz.n)
        return ok

    def nack(self, kind: str, lz: adapter.Leased, dead: bool, delay: float | None = None) -> bool:
        what = "dead" if dead else "retry"
        self.j.write("N?", kind, lz.id, lz.n, what, lz.epoch)
        ok = adapter.nack(self.qs[kind], lz.token, dead, delay)
        self.j.write("N!" if ok else "N~", kind, lz.id, lz.n, what)
        return ok

    def outbox(self, kind: str, lz: adapter.Leased, follow: bool) -> bool:
        fq = self.rng.choice(KINDS)
        m = self.new_n() if follow else 0
        mlen = self.length()
        self.j.write("T?", kind, lz.id, lz.n, fq, m, lz.epoch)
        ok, mid = adapter.outbox(self.db, self.eff, self.qs[kind], lz.token, lz.n, self.qs[fq], fq, m, mlen,
                                 self.profile.durable)
        if ok:
            self.j.write("T!", kind, lz.id, lz.n, fq, m, mid)
        else:
            self.j.write("T~", kind, lz.id, lz.n, fq, m)
        return ok


# -- the kill -9 loop ---------------------------------------------------------------------------------------

WORKLOADS: dict[str, dict[str, float]] = {
    "producer": {"push": 8, "txpush": 1, "lease": 1, "ack": 1},
    "consumer-lease": {"lease": 6, "push": 2, "ack": 1, "nack": 1},
    "consumer-ack": {"ack": 6, "lease": 3, "push": 2},
    "consumer-nack": {"nack": 6, "lease": 3, "push": 2},
    "outbox": {"tx": 6, "lease": 3, "push": 2},
    "mixed": {"push": 3, "txpush": 1, "lease": 3, "ack": 2, "nack": 1, "tx": 2},
}
LEASE_TIMEOUTS = (0.03, 0.15, 0.6)
MAX_HELD = 48


def loop(w: Worker) -> None:
    weights = WORKLOADS[w.spec["workload"]]
    ops = list(weights)
    wts = [weights[o] for o in ops]
    rng = w.rng
    stop = time.monotonic() + float(w.spec.get("max_seconds", 30))
    while time.monotonic() < stop:
        op = rng.choices(ops, wts)[0]
        kind = rng.choice(KINDS)
        if op in ("ack", "nack", "tx") and not w.held:
            op = "lease"
        if op == "lease" and len(w.held) >= MAX_HELD:
            op = "ack"
        if op == "push":
            w.push(kind)
        elif op == "txpush":
            w.push(kind, tx=True)
        elif op == "lease":
            if not w.lease(kind, rng.randint(1, 8), rng.choice(LEASE_TIMEOUTS)):
                for _ in range(rng.randint(1, 6)):
                    w.push(kind)
        elif op == "ack":
            k, lz = w.take()
            w.ack(k, lz)
        elif op == "nack":
            k, lz = w.take()
            dead = rng.random() < 0.2
            w.nack(k, lz, dead, rng.choice((None, 0.0, 0.01)))
        elif op == "tx":
            k, lz = w.take()
            w.outbox(k, lz, follow=rng.random() < 0.5)


# -- failpoint scripts ----------------------------------------------------------------------------------------


def _script_push(w: Worker, kind: str, count: int) -> None:
    for _ in range(count):
        w.push(kind)


def _drain_some(w: Worker, kind: str, rounds: int) -> None:
    """lease -> ack / nack retry / nack dead / outbox, deterministic by the seed."""
    for _ in range(rounds):
        for lz in w.lease(kind, 4, 60.0):
            w.held.remove((kind, lz))
            r = w.rng.random()
            if r < 0.4:
                w.ack(kind, lz)
            elif r < 0.6:
                w.nack(kind, lz, dead=False, delay=0.0)
            elif r < 0.75:
                w.nack(kind, lz, dead=True)
            else:
                w.outbox(kind, lz, follow=w.rng.random() < 0.5)


def script(w: Worker) -> None:
    name = w.spec["script"]
    if name == "push_fixed":
        _script_push(w, "f", 150)  # grow_step 64: grows the header file twice
    elif name == "push_var":
        _script_push(w, "v", 150)
    elif name == "lease_ack_nack":
        for kind in KINDS:
            _script_push(w, kind, 20)
        for kind in KINDS:
            for lz in w.lease(kind, 20, 60.0):
                w.held.remove((kind, lz))
                r = w.rng.random()
                if r < 0.5:
                    w.ack(kind, lz)
                elif r < 0.8:
                    w.nack(kind, lz, dead=False, delay=0.0)
                else:
                    w.nack(kind, lz, dead=True)
    elif name == "tx_outbox":
        for kind in KINDS:
            _script_push(w, kind, 12)
        for kind in KINDS:
            for lz in w.lease(kind, 12, 60.0):
                w.held.remove((kind, lz))
                w.outbox(kind, lz, follow=w.rng.random() < 0.5)
    elif name == "map_compaction":
        # Map puts over a few keys with small files: rotation, hint files and compaction.
        m = adapter.open_kv(w.db, w.profile)
        for i in range(400):
            key = i % 7
            w.j.write("M?", key, i)
            adapter.kv_put(m, key, i)
            w.j.write("M!", key, i)
        w.push("v")
    elif name == "retention":
        # Dead rows swept by retention (dead_retention in the profile, fake clock moved on).
        for kind in KINDS:
            _script_push(w, kind, 6)
        for kind in KINDS:
            for lz in w.lease(kind, 6, 60.0):
                w.held.remove((kind, lz))
                w.nack(kind, lz, dead=True)
        w.clock.advance(w.profile.dead_retention or 1.0)
        w.clock.advance(1.0)
        w.j.write("R?")
        w.db.sweep_expired_now()
        w.j.write("R!")
        w.push("f")
    elif name == "seqmap_block":
        _script_push(w, "f", 2200)  # crosses two ID_BLOCK=1024 boundaries
    elif name == "recovery_setup":
        # Logged commits left in the transaction log (no close, so no checkpoint), then
        # var pushes; the setup run is stopped at queue.var_push.after_body so the next
        # open finds log records to replay and an orphan body to collect.
        for kind in KINDS:
            _script_push(w, kind, 6)
        for kind in KINDS:
            for lz in w.lease(kind, 6, 60.0):
                w.held.remove((kind, lz))
                w.outbox(kind, lz, follow=True)
        _script_push(w, "v", 10)
    elif name == "open_close":
        pass  # recovery only: everything happens in open() and close()
    elif name == "mixed":
        for kind in KINDS:
            _script_push(w, kind, 10)
        for kind in KINDS:
            _drain_some(w, kind, 3)
    else:
        raise ValueError(f"unknown script {name!r}")
    w.j.write("D")
    adapter.close(w.db)
    w.j.write("C")
    print("DONE", flush=True)


class FakeClock:
    """Settable wall clock in ms (children of the retention script)."""

    def __init__(self, start_ms: int) -> None:
        self.ms = start_ms

    def __call__(self) -> int:
        return self.ms

    def advance(self, seconds: float) -> None:
        self.ms += round(seconds * 1000)


def _count_points(out: str) -> Any:
    """Dry run: count every failpoint reached (the library calls ``_fail.point`` by
    attribute, so replacing it here sees every call)."""
    from collections import Counter

    from armdb import _fail

    hits: Counter[str] = Counter()
    real = _fail.point

    def point(name: str) -> None:
        hits[name] += 1
        real(name)

    _fail.point = point

    def dump() -> None:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(dict(hits), f)

    return dump


def main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    dump = _count_points(spec["count_points"]) if spec.get("count_points") else None
    w = Worker(spec)
    if spec.get("fake_clock_ms"):
        w.clock = FakeClock(int(spec["fake_clock_ms"]))
    try:
        w.open()
        if spec["mode"] == "loop":
            loop(w)
        else:
            script(w)
        if dump is not None:
            dump()
    except BaseException as e:  # noqa: BLE001 - every unexpected error is journaled for the checker
        w.j.write("X", type(e).__name__, str(e)[:300])
        sys.stderr.write(traceback.format_exc())
        sys.stderr.flush()
        os._exit(3)
    os._exit(0)
