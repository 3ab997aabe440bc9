"""Jepsen-style queue checker: journal of intents/completions + the reopened database.

``Model`` ingests journal records (``journal.py`` lists them) in the order the
children wrote them, then is shown what a reopened database holds (``observe``) and
what a drain returns (``drained``).  It keeps Jepsen's ``total-queue`` counts
(attempts, acknowledged, lost, unexpected, duplicated, recovered) plus the checks a
lease queue needs (docs/reliability.md, Invariants):

=====================  =====================================================================
count                  violation of
=====================  =====================================================================
lost                   I1  a push that returned (or a committed tx push) is gone unacked
resurrected            I2  a job is present or delivered after its ack returned (or after an
                           explicit dead-letter returned)
unexpected             I3  a row/delivery/effect with no intent, or one resolved as never pushed
wrong_payload          I3  payload bytes (or an effect value) not what was pushed; id/job mismatch
headers_without_body   I4  a var header whose body is missing
conservation           I5  len + dead_len != rows; attempts > max; DEAD without a reason
stale_accepted         I6  a token from before the restart was honoured
lease_overlaps         I6  a job leased again before the previous unsettled lease's deadline
attempt_regressions    I7  a stored or delivered attempt count below one already reported
tx_atomicity           I8  outbox effect present iff job acked (and follow-up pushed) broken
check_failures         I9  ``armdb.check`` not ok after recovery
child_errors           --  an exception the workload did not expect (untyped error, open failed)
=====================  =====================================================================

A run is valid only when every count in :data:`VIOLATIONS` is 0.  ``duplicated``
(at-least-once redeliveries) and ``recovered`` (interrupted pushes that landed) are
counted, never violations.

Outcomes the kill left unknown (an intent without completion) are resolved by the
next observation: a job that is present was pushed and was not acked, one that is
absent was not pushed (or was acked).  After that, the resolved outcome is final,
so a job resolved as "never pushed" that shows up later is ``unexpected`` and one
resolved as acked that shows up later is ``resurrected``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

VIOLATIONS = (
    "lost",
    "resurrected",
    "unexpected",
    "wrong_payload",
    "headers_without_body",
    "conservation",
    "stale_accepted",
    "lease_overlaps",
    "attempt_regressions",
    "tx_atomicity",
    "check_failures",
    "child_errors",
)
STATE_DEAD = 2
STATE_LEASED = 1


@dataclass
class LeaseRec:
    id: int
    epoch: int
    shard: int
    due: int
    deadline_ms: int
    attempt: int
    handle: int = 0


@dataclass
class Job:
    n: int
    q: str
    push: str = "none"  # none | maybe | done | never
    ack: str = "no"  # no | maybe | done
    dead: str = "no"  # no | maybe | done   (explicit dead-letter nack)
    via_tx: int = 0  # for a follow-up job: the n of the outbox tx that pushes it
    id: int = 0
    max_att: int = 0
    deliveries: int = 0
    seen: bool = False
    lease: LeaseRec | None = None  # the newest lease not known to be settled
    acked_by_plain: bool = False  # an A? was ever issued on this job


@dataclass
class TxRec:
    n: int
    q: str
    fq: str
    m: int
    state: str = "unknown"  # unknown | committed | aborted


@dataclass
class Observation:
    """One stored row: queue kind, row id, state, attempts, epoch, job n (-1 if the bytes are wrong)."""

    q: str
    id: int
    state: int
    attempts: int
    epoch: int
    n: int
    ok: bool
    body_missing: bool


@dataclass
class Model:
    max_attempts: int
    counts: Counter[str] = field(default_factory=Counter)
    jobs: dict[int, Job] = field(default_factory=dict)
    by_id: dict[tuple[str, int], int] = field(default_factory=dict)
    txs: list[TxRec] = field(default_factory=list)
    tx_of: dict[int, list[TxRec]] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    dead_may_vanish: bool = False  # retention may sweep dead rows (and their bodies)
    _batch: list[tuple[str, list[str]]] = field(default_factory=list)
    _reported: set[tuple[str, int]] = field(default_factory=set)

    # -- bookkeeping --------------------------------------------------------------------------
    def bad(self, kind: str, what: str) -> None:
        self.counts[kind] += 1
        if len(self.violations) < 40:
            self.violations.append(f"{kind}: {what}")

    def bad_once(self, kind: str, n: int, what: str) -> None:
        """Report a standing condition (seen at every later reopen) once per job."""
        if (kind, n) not in self._reported:
            self._reported.add((kind, n))
            self.bad(kind, what)

    def ok(self) -> bool:
        return all(self.counts[k] == 0 for k in VIOLATIONS)

    def summary(self) -> dict[str, int]:
        dup = sum(1 for j in self.jobs.values() if j.deliveries > 1)
        out = {
            "attempts": self.counts["attempts"],
            "acknowledged": self.counts["acknowledged"],
            "acked": self.counts["acked"],
            "recovered": self.counts["recovered"],
            "duplicated": dup,
            "deliveries": self.counts["deliveries"],
            "dead_letters": self.counts["dead_letters"],
            "orphans_collected": self.counts["orphans_collected"],
            "repaired_on_open": self.counts["repaired_on_open"],
            "effects": self.counts["effects_checked"],
        }
        for k in VIOLATIONS:
            out[k] = self.counts[k]
        return out

    def job(self, n: int, q: str) -> Job:
        j = self.jobs.get(n)
        if j is None:
            j = self.jobs[n] = Job(n, q)
        return j

    def _learn_id(self, j: Job, q: str, rid: int, where: str) -> None:
        other = self.by_id.get((q, rid))
        if other is not None and other != j.n:
            self.bad("wrong_payload", f"{where}: row {q}:{rid} holds job {j.n}, but it was job {other}")
            return
        if j.id and j.id != rid:
            self.bad("wrong_payload", f"{where}: job {j.n} found in row {q}:{rid}, pushed as row {j.id}")
            return
        if j.q != q:
            self.bad("wrong_payload", f"{where}: job {j.n} of queue {j.q} found in queue {q}")
            return
        j.id = rid
        self.by_id[(q, rid)] = j.n

    # -- journal records ----------------------------------------------------------------------
    def feed(self, records: list[list[str]], source: str = "") -> None:
        """Apply one child's journal (a complete file; the last intent may be unfinished)."""
        for rec in records:
            self.apply(rec, source)
        self._flush_lease(source, None)

    def apply(self, rec: list[str], source: str = "") -> None:
        op = rec[0]
        if op == "L!":
            self._batch.append((source, rec))
            return
        if op == "L.":
            self._flush_lease(source, int(rec[3]))
            return
        if self._batch:
            self._flush_lease(source, None)
        if op == "P?":
            q, n = rec[1], int(rec[2])
            j = self.job(n, q)
            j.push = "maybe"
            self.counts["attempts"] += 1
        elif op == "P!":
            q, n, rid = rec[1], int(rec[2]), int(rec[3])
            j = self.job(n, q)
            j.push = "done"
            self.counts["acknowledged"] += 1
            self._learn_id(j, q, rid, f"{source} push")
        elif op in ("A?", "A!", "A~"):
            q, rid, n = rec[1], int(rec[2]), int(rec[3])
            j = self.jobs.get(n)
            if j is None:
                self.bad("unexpected", f"{source}: ack of unknown job {n}")
                return
            self._settle_intent(j, rec, op)
            if op == "A?":
                if j.ack != "done":  # else the token is stale: refused, or a double ack (below)
                    j.ack = "maybe"
                j.acked_by_plain = True
            elif op == "A!":
                if j.ack == "done":
                    self.bad("resurrected", f"{source}: job {n} acked a second time")
                j.ack = "done"
                self.counts["acked"] += 1
            elif j.ack == "maybe":
                j.ack = "no"
        elif op in ("N?", "N!", "N~"):
            q, rid, n, kind = rec[1], int(rec[2]), int(rec[3]), rec[4]
            j = self.jobs.get(n)
            if j is None:
                self.bad("unexpected", f"{source}: nack of unknown job {n}")
                return
            self._settle_intent(j, rec, op)
            if op == "N?":
                if kind == "dead" and j.dead != "done":
                    j.dead = "maybe"
            elif op == "N!":
                if j.ack == "done" or j.dead == "done":
                    self.bad("resurrected", f"{source}: job {n} nacked after it was acked or dead-lettered")
                if kind == "dead":
                    j.dead = "done"
            elif kind == "dead" and j.dead == "maybe":
                j.dead = "no"
        elif op == "T?":
            q, rid, n, fq, m = rec[1], int(rec[2]), int(rec[3]), rec[4], int(rec[5])
            j = self.jobs.get(n)
            if j is None:
                self.bad("unexpected", f"{source}: outbox tx on unknown job {n}")
                return
            self._settle_intent(j, rec, op)
            if j.ack != "done":
                j.ack = "maybe"
            t = TxRec(n, q, fq, m)
            self.txs.append(t)
            self.tx_of.setdefault(n, []).append(t)
            if m > 0:
                mj = self.job(m, fq)
                mj.push = "maybe"
                mj.via_tx = n
                self.counts["attempts"] += 1
        elif op in ("T!", "T~"):
            q, rid, n, fq, m = rec[1], int(rec[2]), int(rec[3]), rec[4], int(rec[5])
            j = self.jobs[n]
            t = self.tx_of[n][-1]
            if op == "T!":
                if j.ack == "done":
                    self.bad("resurrected", f"{source}: job {n} acked a second time (outbox tx)")
                t.state = "committed"
                j.ack = "done"
                self.counts["acked"] += 1
                if m > 0:
                    mj = self.jobs[m]
                    mj.push = "done"
                    self.counts["acknowledged"] += 1
                    self._learn_id(mj, fq, int(rec[6]), f"{source} tx push")
            else:
                t.state = "aborted"
                if j.ack == "maybe":
                    j.ack = "no"
                if m > 0:
                    self.jobs[m].push = "never"
        elif op == "X":
            self.bad("child_errors", f"{source}: {' '.join(rec[1:])[:300]}")
        # O?, O!, L?, V... carry no state (O! orphans are counted by the caller)

    @staticmethod
    def _settle_intent(j: Job, rec: list[str], op: str) -> None:
        """An ack/nack/tx on the lease at the record's epoch (last field) was invoked.

        From the intent on, that lease may be settled, so a redelivery before its
        deadline is no longer an overlap, and it is no longer a candidate for the
        stale-token check."""
        if op.endswith("?") and j.lease is not None and int(rec[-1]) == j.lease.epoch:
            j.lease = None

    def _flush_lease(self, source: str, comp_ms: int | None) -> None:
        batch, self._batch = self._batch, []
        for src, rec in batch:
            q, rid, n, att, epoch, shard, due, dl, ok = (
                rec[1], int(rec[2]), int(rec[3]), int(rec[4]), int(rec[5]), int(rec[6]), int(rec[7]),
                int(rec[8]), rec[9] == "1",
            )
            handle = int(rec[10]) if len(rec) > 10 else 0
            self.delivered(q, rid, n, att, ok, src, comp_ms, LeaseRec(rid, epoch, shard, due, dl, att, handle))

    def delivered(self, q: str, rid: int, n: int, att: int, ok: bool, where: str, comp_ms: int | None,
                  lease: LeaseRec | None) -> Job | None:
        """A lease (by a child or by the verifier's drain) returned job ``n`` in row ``rid``."""
        self.counts["deliveries"] += 1
        if not ok or n < 0:
            self.bad("wrong_payload", f"{where}: row {q}:{rid} delivered with a payload that is not a job body")
            return None
        j = self.jobs.get(n)
        if j is None or j.push == "none":
            self.bad("unexpected", f"{where}: job {n} delivered but never pushed (row {q}:{rid})")
            return None
        if j.push == "never":
            self.bad("unexpected", f"{where}: job {n} delivered, but an earlier reopen showed it was never pushed")
        elif j.push == "maybe":
            j.push = "done"
            self.counts["recovered"] += 1
        self._learn_id(j, q, rid, where)
        if j.ack == "done":
            self.bad("resurrected", f"{where}: job {n} (row {q}:{rid}) delivered after its ack returned")
        elif j.ack == "maybe":
            j.ack = "no"  # the interrupted ack (or outbox tx) did not happen
            self._abort_unknown_tx(n, where)
        if j.dead == "done":
            self.bad("resurrected", f"{where}: job {n} delivered after it was dead-lettered")
        elif j.dead == "maybe":
            j.dead = "no"
        if att <= j.max_att:
            self.bad("attempt_regressions",
                     f"{where}: job {n} delivered at attempt {att}, but attempt {j.max_att} was already reported")
        prev = j.lease
        if prev is not None and comp_ms is not None and comp_ms < prev.deadline_ms:
            self.bad("lease_overlaps",
                     f"{where}: job {n} leased again at {comp_ms} ms, before the unsettled lease (epoch "
                     f"{prev.epoch}) ended at {prev.deadline_ms} ms")
        j.max_att = max(j.max_att, att)
        j.deliveries += 1
        j.seen = True
        j.lease = lease
        return j

    def _abort_unknown_tx(self, n: int, where: str) -> None:
        for t in self.tx_of.get(n, []):
            if t.state == "unknown":
                t.state = "aborted"
                if t.m > 0:
                    mj = self.jobs[t.m]
                    if mj.seen:
                        self.bad("tx_atomicity", f"{where}: follow-up job {t.m} of an outbox tx on job {n} was "
                                 f"delivered, but job {n} was delivered again (the tx did not commit)")
                    mj.push = "never"

    # -- observations --------------------------------------------------------------------------
    def observe(self, rows: list[Observation], effects: dict[int, Any] | None, counts: dict[str, tuple[int, int]],
                effect_ok: Any = None, where: str = "reopen") -> None:
        """What a reopened database holds: every row of every queue, the effects map, and
        ``(len, dead_len)`` per queue.  Resolves every unknown outcome."""
        present: dict[int, Observation] = {}
        per_q: Counter[tuple[str, str]] = Counter()
        for r in rows:
            per_q[(r.q, "dead" if r.state == STATE_DEAD else "live")] += 1
            if r.body_missing:
                self.bad("headers_without_body", f"{where}: var row {r.q}:{r.id} has no payload body")
                continue
            if not r.ok or r.n < 0:
                self.bad("wrong_payload", f"{where}: row {r.q}:{r.id} holds bytes that are not a job body")
                continue
            j = self.jobs.get(r.n)
            if j is None or j.push == "none":
                self.bad("unexpected", f"{where}: row {r.q}:{r.id} holds job {r.n}, which was never pushed")
                continue
            if r.n in present:
                self.bad("wrong_payload", f"{where}: job {r.n} stored twice (rows {present[r.n].id} and {r.id})")
                continue
            present[r.n] = r
            self._learn_id(j, r.q, r.id, where)
        for q, (ln, dl) in counts.items():
            if ln != per_q[(q, "live")] or dl != per_q[(q, "dead")]:
                self.bad("conservation", f"{where}: queue {q} len={ln} dead_len={dl} but it stores "
                         f"{per_q[(q, 'live')]} live and {per_q[(q, 'dead')]} dead rows")
        eff = effects or {}
        # Outbox transactions with unknown outcome first (they decide the follow-up jobs).
        for t in self.txs:
            if t.state != "unknown":
                continue
            committed = t.n in eff
            if committed and any(o.state == "committed" for o in self.tx_of[t.n] if o is not t):
                committed = False
            t.state = "committed" if committed else "aborted"
            if committed:
                self.counts["acked"] += 1
        for n, j in self.jobs.items():
            r = present.get(n)
            if j.push == "maybe":
                if r is not None:
                    j.push = "done"
                    self.counts["recovered"] += 1
                else:
                    j.push = "never"
            if j.push == "never":
                if r is not None:
                    self.bad("unexpected", f"{where}: job {n} present, but it was resolved as never pushed")
                continue
            if j.push != "done":
                continue
            if j.ack == "maybe":
                j.ack = "no" if r is not None else "done"
                if j.ack == "done" and j.acked_by_plain:
                    self.counts["acked"] += 1
            elif j.ack == "done" and r is not None:
                self.bad_once("resurrected", n, f"{where}: job {n} (row {r.q}:{r.id}) present after its ack returned")
            if j.dead == "maybe":
                if r is not None:
                    j.dead = "done" if r.state == STATE_DEAD else "no"
                else:
                    j.dead = "done" if self.dead_may_vanish else "no"
            if r is None:
                j.lease = None
                swept = self.dead_may_vanish and (j.dead == "done" or j.max_att >= self.max_attempts)
                if j.ack != "done" and not swept:
                    self.bad_once("lost", n,
                                  f"{where}: job {n} (row {j.q}:{j.id}) was pushed and never acked, but is gone")
                continue
            if j.dead == "done" and r.state != STATE_DEAD:
                self.bad_once("resurrected", n, f"{where}: job {n} was dead-lettered but is live again")
            if r.attempts < j.max_att:
                self.bad_once("attempt_regressions", n,
                              f"{where}: job {n} stores attempts={r.attempts}, below the attempt {j.max_att} a "
                              f"lease reported")
            if r.attempts > self.max_attempts:
                self.bad_once("conservation", n, f"{where}: job {n} has attempts={r.attempts} > max_attempts")
            if r.state == STATE_DEAD and r.attempts < self.max_attempts and j.dead == "no":
                self.bad_once("conservation", n,
                              f"{where}: job {n} is DEAD at attempts={r.attempts} without a dead nack")
            if j.lease is not None and (r.state != STATE_LEASED or r.epoch != j.lease.epoch):
                j.lease = None  # settled or expired and re-leased by someone the journal saw
            j.seen = True
        # I8: effect present iff the job was acked by a committed outbox tx; follow-up iff committed.
        for n, value in eff.items():
            self.counts["effects_checked"] += 1
            if effect_ok is not None and not effect_ok(n, value):
                self.bad_once("wrong_payload", n, f"{where}: effect {n} holds {value!r:.60}")
            ts = self.tx_of.get(n, [])
            if not any(t.state == "committed" for t in ts):
                self.bad_once("tx_atomicity" if ts else "unexpected", n,
                              f"{where}: effect {n} present without a committed outbox tx")
            if n in present:
                self.bad_once("tx_atomicity", n, f"{where}: effect {n} present but job {n} was not acked")
        for t in self.txs:
            if t.state == "committed":
                if t.n not in eff:
                    self.bad_once("tx_atomicity", t.n,
                                  f"{where}: outbox tx on job {t.n} committed but its effect is missing")
                if t.m > 0 and self.jobs[t.m].push == "never":
                    self.bad_once("tx_atomicity", t.m,
                                  f"{where}: outbox tx on job {t.n} committed without its follow-up job {t.m}")
            elif t.m > 0 and t.m in present:
                self.bad_once("tx_atomicity", t.m, f"{where}: follow-up job {t.m} present, but its outbox tx on "
                              f"job {t.n} did not commit")
        # A job gone with neither a plain ack nor a committed tx: the tx acked without its effect.
        for n, ts in self.tx_of.items():
            j = self.jobs[n]
            if n in present or j.acked_by_plain:
                continue
            if j.push == "done" and not any(t.state == "committed" for t in ts):
                self.bad_once("tx_atomicity", n, f"{where}: job {n} gone after an outbox tx that left no effect")
        self.counts["dead_letters"] = sum(1 for r in present.values() if r.state == STATE_DEAD)

    def drained(self, q: str, rid: int, n: int, att: int, ok: bool, where: str = "drain") -> None:
        """The verifier leased and acked row ``rid`` while draining."""
        j = self.delivered(q, rid, n, att, ok, where, None, None)
        if j is not None:
            j.ack = "done"
            j.acked_by_plain = True
            j.lease = None
            self.counts["acked"] += 1

    def verifier_acked(self, n: int) -> None:
        """The verifier's own ack succeeded (e.g. a stale token was wrongly honoured)."""
        j = self.jobs.get(n)
        if j is not None:
            j.ack = "done"
            j.acked_by_plain = True
            j.lease = None

    def unsettled_leases(self) -> list[tuple[Job, LeaseRec]]:
        return [(j, j.lease) for j in self.jobs.values() if j.lease is not None and j.ack != "done"]


# -- thread harness: lease-window checks ----------------------------------------------------------------


@dataclass(frozen=True)
class Delivery:
    """One lease of one job in the thread harness (times in ns of ``time.time_ns``)."""

    job: int
    epoch: int
    attempt: int
    inv_ns: int
    comp_ns: int
    deadline_ms: int
    thread: str


@dataclass(frozen=True)
class Settle:
    """One ack/nack attempt: ``ok`` False when it raised StaleToken."""

    job: int
    epoch: int
    kind: str  # ack | nack
    inv_ns: int
    comp_ns: int
    ok: bool
    thread: str


def check_lease_history(pushed: set[int], deliveries: list[Delivery], settles: list[Settle],
                        drained: dict[int, int]) -> tuple[Counter[str], list[str]]:
    """The Jepsen lease-queue checks over a concurrent history.

    * ``lease_overlaps``: job delivered at epoch e2 while the lease at epoch e1 < e2 was
      unexpired and not settled before the second lease was invoked.  The second lease
      claimed the row at some moment <= its completion, and the library refuses a row
      whose deadline (ms) has not passed, so ``floor(comp_ns / 1e6) < deadline_ms`` with
      no successful settle of e1 completed before the second lease's invocation proves
      two live leases.
    * ``lost``: pushed but never successfully acked.  ``unexpected``: delivered, never pushed.
    * ``double_acked``: more than one successful ack of a job.
    * ``resurrected``: delivered after a successful ack completed.
    * ``unexplained_duplicates``: a redelivery not preceded by the expiry of the previous
      lease or a nack of it.
    * ``stale_accepted``: a settle succeeded with an epoch older than a later delivery that
      completed before the settle was invoked.
    """
    c: Counter[str] = Counter()
    bad: list[str] = []

    def flag(kind: str, what: str) -> None:
        c[kind] += 1
        if len(bad) < 40:
            bad.append(f"{kind}: {what}")

    by_job: dict[int, list[Delivery]] = {}
    for d in deliveries:
        by_job.setdefault(d.job, []).append(d)
    acks: dict[int, list[Settle]] = {}
    settles_by: dict[tuple[int, int], list[Settle]] = {}
    for s in settles:
        settles_by.setdefault((s.job, s.epoch), []).append(s)
        if s.kind == "ack" and s.ok:
            acks.setdefault(s.job, []).append(s)
    for job in by_job:
        if job not in pushed:
            flag("unexpected", f"job {job} delivered but never pushed")
    for job in pushed:
        n_acks = len(acks.get(job, [])) + drained.get(job, 0)
        if n_acks == 0:
            flag("lost", f"job {job} pushed, never acked")
        elif n_acks > 1:
            flag("double_acked", f"job {job} acked {n_acks} times")
    for job, ds in by_job.items():
        ds.sort(key=lambda d: d.epoch)
        c["deliveries"] += len(ds)
        if len(ds) > 1:
            c["duplicated"] += 1
        first_ack = min((a.comp_ns for a in acks.get(job, [])), default=None)
        for i, d in enumerate(ds):
            if first_ack is not None and d.inv_ns > first_ack:
                flag("resurrected", f"job {job} delivered (epoch {d.epoch}) after its ack completed")
            if i == 0:
                continue
            p = ds[i - 1]
            if d.epoch <= p.epoch:
                flag("attempt_regressions", f"job {job}: epoch {d.epoch} after {p.epoch}")
            if d.attempt <= p.attempt:
                flag("attempt_regressions", f"job {job}: attempt {d.attempt} after {p.attempt}")
            settled_before = [s for s in settles_by.get((job, p.epoch), []) if s.ok and s.comp_ns <= d.inv_ns]
            settled_any = [s for s in settles_by.get((job, p.epoch), []) if s.ok and s.inv_ns <= d.comp_ns]
            expired = d.comp_ns // 1_000_000 >= p.deadline_ms
            if not expired and not settled_any:
                flag("lease_overlaps", f"job {job}: epoch {d.epoch} leased at <= {d.comp_ns // 1_000_000} ms while "
                     f"epoch {p.epoch} was live until {p.deadline_ms} ms")
            nacked = any(s.kind == "nack" for s in settled_before + settled_any)
            if not expired and not nacked:
                flag("unexplained_duplicates", f"job {job}: redelivered (epoch {d.epoch}) without expiry or nack")
            if expired or nacked:
                c["explained_duplicates"] += 1
    # A settle that succeeded although a later lease of the job had already completed.
    for s in settles:
        if not s.ok:
            continue
        later = [d for d in by_job.get(s.job, []) if d.epoch > s.epoch and d.comp_ns < s.inv_ns]
        if later:
            flag("stale_accepted", f"job {s.job}: {s.kind} with epoch {s.epoch} succeeded after epoch "
                 f"{later[0].epoch} was leased")
    return c, bad


# -- reopen + observe + drain + armdb.check (shared by the kill loop and the failpoint harness) -------------


def verify_database(path: Any, profile: Any, model: Model, *, drain: bool, where: str,
                    stale_check: int = 3, also: Any = None) -> None:
    """Reopen ``path``, show the model what it holds, check stale tokens, optionally drain,
    call ``also(db)`` (to open and check further collections: a collection recovers
    when it is opened), close, and run ``armdb.check`` (I1-I9).  Violations land in
    ``model``."""
    from armdb.errors import ArmdbError

    from . import adapter

    clock = adapter.far_future_clock() if drain else None
    try:
        db, qs, eff = adapter.open_all(path, profile, clock)
    except ArmdbError as e:
        model.bad("child_errors", f"{where}: reopen failed: {type(e).__name__}: {e}")
        return
    try:
        model.counts["orphans_collected"] += adapter.orphans_collected(qs["v"])
        model.counts["repaired_on_open"] += sum(adapter.repaired_on_open(q) for q in qs.values())
        rows = [Observation(k, r.id, r.state, r.attempts, r.epoch, r.n, r.ok, r.body_missing)
                for k, q in qs.items() for r in adapter.peek(q, k)]
        counts = {k: adapter.counts(q) for k, q in qs.items()}
        model.observe(rows, adapter.effects_items(eff), counts, adapter.effect_ok, where)
        if stale_check:
            _stale_token_check(model, qs, rows, where, stale_check)
        if drain:
            _drain(model, qs, where)
        if also is not None:
            also(db)
        final = {k: sum(adapter.counts(q)) for k, q in qs.items()}
    finally:
        adapter.close(db)
    # I5 against the disk: rows the indexes served == occupied header slots in the files.
    on_disk = adapter.disk_rows(path)
    for k, n in final.items():
        if on_disk.get(k) != n:
            model.bad("conservation", f"{where}: queue {k} served {n} rows but {on_disk.get(k)} header slots are "
                      f"occupied on disk after close")
    ok, findings = adapter.check(path)
    if not ok:
        model.bad("check_failures", f"{where}: {findings[:3]}")


def _stale_token_check(model: Model, qs: dict[str, Any], rows: list[Observation], where: str, limit: int) -> None:
    """I6: a token a killed process held is refused after the restart (Q13)."""
    from . import adapter

    leased = {(r.q, r.id): r for r in rows if r.state == STATE_LEASED}
    tried = 0
    for job, lz in model.unsettled_leases():
        r = leased.get((job.q, lz.id))
        if r is None or r.epoch != lz.epoch or tried >= limit:
            continue
        tried += 1
        model.counts["stale_checks"] += 1
        tok = adapter.token_from_journal(lz.handle, lz.shard, lz.due, lz.id, lz.epoch)
        if adapter.ack(qs[job.q], tok):
            model.bad("stale_accepted", f"{where}: job {job.n} (row {job.q}:{lz.id}, epoch {lz.epoch}) acked with "
                      f"the token its killed holder leased before the restart")
            model.verifier_acked(job.n)


def _drain(model: Model, qs: dict[str, Any], where: str) -> None:
    """Lease and ack until three empty leases in a row (the Jepsen drain)."""
    from armdb.errors import ArmdbError

    from . import adapter

    model.counts["drains"] += 1
    for kind, q in qs.items():
        empty = 0
        while empty < 3:
            try:
                got = adapter.lease(q, kind, 64, 3600.0)
            except ArmdbError as e:
                model.bad("headers_without_body", f"{where} drain: lease raised {type(e).__name__}: {e}")
                break
            if not got:
                empty += 1
                continue
            empty = 0
            for lz in got:
                model.drained(kind, lz.id, lz.n, lz.attempt, lz.ok, f"{where} drain")
                if not adapter.ack(q, lz.token):
                    model.bad("conservation", f"{where} drain: a fresh token for row {kind}:{lz.id} was refused")
        ln, _dl = adapter.counts(q)
        if ln:
            model.bad("conservation", f"{where} drain: queue {kind} still holds {ln} live rows")
