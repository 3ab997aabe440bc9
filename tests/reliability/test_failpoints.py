"""Harness (a2): a deterministic crash at every named durable boundary (docs/reliability.md, (a2); SPEC D8).

For every workload below, a dry run (a child that counts every ``armdb._fail.point``
call it passes) tells which registered failpoints the workload reaches and how
often.  Then, for every failpoint in ``armdb._fail.ALL`` and every skip in {0, 1, 2}
that the workload reaches, a child runs the same deterministic script with
``ARMDB_FAILPOINT=name:skip`` and must exit 86 (``os._exit``) at that point, or run
to the end (exit 0) when timing made it miss the point this time.  The parent
reopens the database, checks it against the child's journal (``checker.Model``:
I1-I8), drains it, and runs ``armdb.check`` (I9).  Some points also have a precise
expectation (a logged transaction is committed; a var push that died after its body
is absent and its body is collected as an orphan; a slot write that completed is
visible).

The ``recovery_replay`` workload starts from a crashed database whose transaction
log holds records to replay and whose payload store holds an orphan body, and only
opens and closes it: a crash there is a crash *during recovery*
(``recovery.mid_replay``, ``queue.orphan_sweep.mid``, ...), and the parent's reopen is
the clean recovery after it.

The test fails on any violation, and when a registered failpoint is reached by no
workload at all.  It reports, per workload, how many (point, skip) pairs were never
reached.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from armdb import _fail

from . import adapter
from .adapter import Profile
from .checker import VIOLATIONS, Model, verify_database
from .journal import journal_files, now_ms, read_journal, save_artifacts, summary_line

ROOT = Path(__file__).resolve().parents[2]
SKIPS = (0, 1, 2)
PARALLEL = int(os.environ.get("ARMDB_FAILPOINT_PARALLEL", "2"))
CHILD_TIMEOUT = 120


@dataclass(frozen=True)
class Workload:
    name: str
    script: str
    profile: Profile
    fake_clock: bool = False
    setup: tuple[tuple[str, str], ...] = ()  # (script, failpoint) runs that build the starting state


WORKLOADS = (
    Workload("push_fixed", "push_fixed", Profile(sync_interval=0.0)),
    Workload("push_var", "push_var", Profile(sync_interval=0.0)),
    Workload("lease_ack_nack", "lease_ack_nack", Profile(shards=2)),
    # Durable headers: a lease, nack or ack of a live row syncs its redo record first.
    Workload("lease_ack_nack_durable", "lease_ack_nack", Profile(sync_interval=0.0)),
    Workload("tx_outbox_durable", "tx_outbox", Profile(durable=True, shards=2)),
    Workload("map_compaction", "map_compaction", Profile(max_file_size=64 * 1024, compaction_threshold=0.1)),
    Workload("retention", "retention", Profile(dead_retention=1.0), fake_clock=True),
    Workload("seqmap_block", "seqmap_block", Profile(grow_step=512)),
    Workload("recovery_replay", "open_close", Profile(), setup=(("recovery_setup", "queue.var_push.after_body:8"),)),
    Workload("mixed_encrypted", "mixed", Profile(enc=True, shards=2)),
)
LOGGED_COMMIT_POINTS = {"txlog.after_append", "txlog.after_sync", "txlog.after_apply"}


def child_env(failpoint: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("ARMDB_FAILPOINT", None)
    if failpoint:
        env["ARMDB_FAILPOINT"] = failpoint
    return env


def run_child(wl: Workload, script: str, root: Path, jname: str, failpoint: str | None, seed: int,
              count_points: Path | None = None) -> subprocess.CompletedProcess[str]:
    spec = {
        "mode": "script",
        "script": script,
        "db": str(root / "db"),
        "journal": str(root / "journal" / jname),
        "seed": seed,
        "profile": wl.profile.to_json(),
        "base": 1_000_000 * (1 + len(journal_files(root / "journal"))),
        "fake_clock_ms": now_ms() if wl.fake_clock else 0,
        "count_points": str(count_points) if count_points else "",
    }
    code = f"from tests.reliability.workload import main; main({json.dumps(json.dumps(spec))})"
    return subprocess.run([sys.executable, "-u", "-c", code], env=child_env(failpoint), cwd=str(ROOT),
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT, check=False)


@dataclass
class CaseResult:
    workload: str
    point: str
    skip: int
    reached: bool
    model: Model
    root: Path
    notes: list[str] = field(default_factory=list)


def in_flight(records: list[list[str]]) -> list[str] | None:
    """The intent the crash interrupted, if the last record is one."""
    if records and records[-1][0].endswith("?"):
        return records[-1]
    return None


def expectations(res: CaseResult, wl: Workload, case_records: list[list[str]], orphans_at_verify: int) -> None:
    """Point-specific assertions (the crash point is known, so the outcome is too)."""
    m = res.model
    last = in_flight(case_records)
    if not res.reached or last is None:
        return
    op = last[0]
    if res.point in LOGGED_COMMIT_POINTS and op == "T?":
        n = int(last[3])
        if m.tx_of[n][-1].state != "committed":
            m.bad("tx_atomicity", f"{res.point}: the interrupted outbox tx on job {n} was logged but not committed")
    if res.point in LOGGED_COMMIT_POINTS and op in ("A?", "N?") and last[1] == "v":
        n = int(last[3])
        if op == "A?" and m.jobs[n].ack != "done":
            m.bad("lost", f"{res.point}: the interrupted var ack of job {n} was logged but is not applied")
    if res.point == "queue.var_push.after_body" and op == "P?" and last[1] == "v":
        n = int(last[2])
        if m.jobs[n].push != "never":
            m.bad("headers_without_body", f"{res.point}: job {n} is visible although its header was never written")
        if orphans_at_verify < 1:
            m.bad("conservation", f"{res.point}: the body of job {n} was not collected as an orphan on reopen")
    if res.point == "fixed.after_slot_write" and op == "P?":
        n = int(last[2])
        if m.jobs[n].push != "done":
            m.bad("lost", f"{res.point}: job {n}'s header slot was written but the job is gone after reopen")


def check_kv(res: CaseResult, records: list[list[str]], wl: Workload, db: object) -> None:
    """The map workload: every key holds the last value put, or the interrupted put's value."""
    last_done: dict[int, int] = {}
    maybe: dict[int, int] = {}
    for r in records:
        if r[0] == "M?":
            maybe[int(r[1])] = int(r[2])
        elif r[0] == "M!":
            last_done[int(r[1])] = int(r[2])
            maybe.pop(int(r[1]), None)
    items = adapter.kv_items(db, wl.profile)
    for k in set(last_done) | set(maybe) | set(items):
        allowed = {adapter.kv_value(i) for i in (last_done.get(k), maybe.get(k)) if i is not None}
        got = items.get(k)
        if got is None:
            if k in last_done:
                res.model.bad("lost", f"map key {k}: put {last_done[k]} returned but the key is gone")
        elif got not in allowed:
            res.model.bad("wrong_payload", f"map key {k}: holds a value that is neither put {last_done.get(k)} "
                          f"nor the interrupted put {maybe.get(k)}")
    res.model.counts["map_keys_checked"] += len(items)


class Harness:
    def __init__(self, base: Path, seed: int) -> None:
        self.base = base
        self.seed = seed
        self.templates: dict[str, Path] = {}
        self.reach: dict[str, Counter[str]] = {}
        self.setup_errors: list[str] = []

    def build_template(self, wl: Workload) -> Path:
        root = self.base / "templates" / wl.name
        (root / "journal").mkdir(parents=True, exist_ok=True)
        for i, (script, fp) in enumerate(wl.setup):
            r = run_child(wl, script, root, f"a{i:02d}-setup.log", fp, self.seed + i)
            if r.returncode != _fail.EXIT_CODE:
                self.setup_errors.append(f"{wl.name} setup {script} at {fp}: exit {r.returncode}: {r.stderr[-400:]}")
        return root

    def dry_run(self, wl: Workload) -> Counter[str]:
        root = self.base / "dry" / wl.name
        shutil.copytree(self.templates[wl.name], root)
        out = root / "points.json"
        r = run_child(wl, wl.script, root, "b-case.log", None, self.seed, count_points=out)
        if r.returncode != 0:
            self.setup_errors.append(f"{wl.name} dry run: exit {r.returncode}: {r.stderr[-600:]}")
            return Counter()
        return Counter(json.loads(out.read_text()))

    def run_case(self, wl: Workload, point: str, skip: int) -> CaseResult:
        root = self.base / "cases" / f"{wl.name}--{point}--{skip}"
        shutil.copytree(self.templates[wl.name], root)
        r = run_child(wl, wl.script, root, "b-case.log", f"{point}:{skip}", self.seed)
        model = Model(max_attempts=wl.profile.max_attempts, dead_may_vanish=wl.profile.dead_retention is not None)
        res = CaseResult(wl.name, point, skip, r.returncode == _fail.EXIT_CODE, model, root)
        if r.returncode not in (0, _fail.EXIT_CODE):
            model.bad("child_errors", f"{wl.name} {point}:{skip}: exit {r.returncode}: {r.stderr[-600:]}")
        case_records: list[list[str]] = []
        for path in journal_files(root / "journal"):
            recs = read_journal(path)
            model.feed(recs, path.name)
            if path.name == "b-case.log":
                case_records = recs
        before = model.counts["orphans_collected"]
        also = (lambda db: check_kv(res, case_records, wl, db)) if wl.script == "map_compaction" else None
        verify_database(root / "db", wl.profile, model, drain=True, where=f"{wl.name} {point}:{skip}",
                        stale_check=0, also=also)
        expectations(res, wl, case_records, model.counts["orphans_collected"] - before)
        return res


@pytest.mark.crash
@pytest.mark.timeout(900)
def test_failpoints_every_point_every_workload(tmp_path: Path) -> None:
    """D8, I1-I9: crash at every registered failpoint x skip {0,1,2} x workload that reaches it."""
    seed = int(os.environ.get("ARMDB_FAILPOINT_SEED", "4242"))
    t0 = time.monotonic()
    h = Harness(tmp_path, seed)
    for wl in WORKLOADS:
        h.templates[wl.name] = h.build_template(wl)
    with ThreadPoolExecutor(PARALLEL) as ex:
        for wl, counts in zip(WORKLOADS, ex.map(h.dry_run, WORKLOADS)):
            h.reach[wl.name] = counts
    assert not h.setup_errors, "\n".join(h.setup_errors)
    unknown = {p for c in h.reach.values() for p in c if p not in _fail.ALL}
    assert not unknown, f"the library calls unregistered failpoints {sorted(unknown)}"

    cases = [(wl, p, s) for wl in WORKLOADS for p in sorted(_fail.ALL) for s in SKIPS if h.reach[wl.name][p] > s]
    with ThreadPoolExecutor(PARALLEL) as ex:
        results = list(ex.map(lambda c: h.run_case(*c), cases))
    seconds = time.monotonic() - t0

    total: Counter[str] = Counter()
    for res in results:
        total.update({k: v for k, v in res.model.counts.items() if k in VIOLATIONS or k in (
            "orphans_collected", "repaired_on_open", "effects_checked", "deliveries", "map_keys_checked")})
    hit_points = {r.point for r in results if r.reached}
    never = sorted(_fail.ALL - hit_points)
    unreached = {
        wl.name: sum(1 for p in _fail.ALL for s in SKIPS
                     if not any(r.reached for r in results if (r.workload, r.point, r.skip) == (wl.name, p, s)))
        for wl in WORKLOADS
    }
    by_point = Counter(r.point for r in results if r.reached)
    recovery_crashes = sum(1 for r in results if r.reached and r.workload == "recovery_replay")
    fields: dict[str, object] = {
        "points": len(_fail.ALL),
        "points_hit": len(hit_points),
        "coverage": f"{100 * len(hit_points) // len(_fail.ALL)}%",
        "workloads": len(WORKLOADS),
        "cases": len(results),
        "crashes": sum(1 for r in results if r.reached),
        "ran_to_end": sum(1 for r in results if not r.reached),
        "recovery_crashes": recovery_crashes,
        "pairs_total": len(_fail.ALL) * len(SKIPS) * len(WORKLOADS),
        "pairs_unreached": sum(unreached.values()),
        "unreached_per_workload": ",".join(f"{k}:{v}" for k, v in unreached.items()),
        "min_crashes_per_point": min(by_point.get(p, 0) for p in _fail.ALL),
        "seconds": f"{seconds:.0f}",
    }
    for k in ("deliveries", "effects_checked", "map_keys_checked", "orphans_collected", "repaired_on_open"):
        fields[k] = total[k]
    for k in VIOLATIONS:
        fields[k] = total[k]
    fields["never_hit"] = ",".join(never) or "-"
    summary_line("failpoints", fields)

    failed = [r for r in results if not r.model.ok()]
    if failed or never:
        save_artifacts(
            "failpoints", seed, [r.root for r in failed[:20]],
            f"ARMDB_FAILPOINT_SEED={seed} .venv/bin/python -m pytest -p no:cacheprovider -s "
            f"tests/reliability/test_failpoints.py",
            "\n".join(f"{r.workload} {r.point}:{r.skip}: {v}" for r in failed for v in r.model.violations[:5]),
        )
    msgs = [f"{r.workload} {r.point}:{r.skip}: {v}" for r in failed for v in r.model.violations[:3]]
    assert not failed, f"{len(failed)} failpoint case(s) broke invariants:\n" + "\n".join(msgs[:30])
    assert not never, f"registered failpoints reached by no workload: {never}"

