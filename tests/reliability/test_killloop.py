"""Harness (a): kill -9 loop against a journal of acknowledged operations (docs/reliability.md, (a)).

Children (``workload.loop``) run producer, consumer and outbox-transaction mixes on a
fixed and a var queue of one database; the parent SIGKILLs each at a random moment
(sometimes during ``Db.open``, which is recovery), sometimes lets several kills pile
up, then reopens the database and checks it against the journals with
``checker.Model``: I1 no loss, I2 no resurrection, I3 no phantom or wrong payload,
I4 no header without body, I5 conservation, I6 a token from before the restart is
refused and no lease overlaps a live one, I7 attempts never go back, I8 outbox
atomicity, I9 ``armdb.check`` clean.  Every fifth check of a database also drains it.

Four databases ("lanes") run side by side, each with its own journal: plain or
encrypted (payload, effects map and transaction log) times default or durable
transactions, with one or two header shards.  Kill targets rotate so that every
phase (open, push, lease, ack, nack, tx) is hit at least ``MIN_PHASE_HITS`` times.

Sizes: CI 200 kills (``ARMDB_KILLS_CI``), nightly ``ARMDB_KILLS`` (default 2000,
``@pytest.mark.slow``).  ``ARMDB_KILLLOOP_SEED`` replays a run's choices (the kill
moments themselves depend on timing).
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from armdb.errors import ArmdbError

from . import adapter
from .adapter import Profile
from .checker import VIOLATIONS, Model, verify_database
from .journal import journal_files, read_journal, save_artifacts, summary_line
from .workload import WORKLOADS

ROOT = Path(__file__).resolve().parents[2]
PHASES = ("open", "push", "lease", "ack", "nack", "tx")
TARGET_WORKLOAD = {
    "push": "producer",
    "lease": "consumer-lease",
    "ack": "consumer-ack",
    "nack": "consumer-nack",
    "tx": "outbox",
}
PHASE_OF = {"P?": "push", "L?": "lease", "L!": "lease", "A?": "ack", "N?": "nack", "T?": "tx"}
MIN_PHASE_HITS = 20
LANES = (
    Profile(enc=False, durable=False, shards=1),
    Profile(enc=True, durable=False, shards=2),
    Profile(enc=False, durable=True, shards=2),
    Profile(enc=True, durable=True, shards=1),
)
DRAIN_EVERY = 5
CHILD_TIMEOUT = 60.0
# Lanes run this many at a time (the parent mostly waits for children; 2 fits 2 cores).
PARALLEL = int(os.environ.get("ARMDB_KILL_PARALLEL", "2"))


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("ARMDB_FAILPOINT", None)
    return env


def read_line(p: subprocess.Popen[bytes], timeout: float) -> str:
    """One stdout line of the child, '' on EOF; raises on timeout (a hung child)."""
    fd = p.stdout.fileno()  # type: ignore[union-attr]
    buf = b""
    end = time.monotonic() + timeout
    while not buf.endswith(b"\n"):
        left = end - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"child {p.pid} printed nothing for {timeout} s (hung open?)")
        r, _, _ = select.select([fd], [], [], left)
        if not r:
            continue
        chunk = os.read(fd, 1)
        if not chunk:
            return ""
        buf += chunk
    return buf.decode().strip()


def kill_phase(records: list[list[str]]) -> str:
    if not any(r[0] == "O!" for r in records):
        return "open"
    return PHASE_OF.get(records[-1][0], "between") if records else "open"


@dataclass
class Lane:
    index: int
    profile: Profile
    root: Path
    model: Model
    rng: random.Random
    children: int = 0
    checks: int = 0
    fed: set[str] = field(default_factory=set)

    @property
    def db(self) -> Path:
        return self.root / "db"

    @property
    def journal_dir(self) -> Path:
        return self.root / "journal"


class KillLoop:
    def __init__(self, base: Path, seed: int, kills: int) -> None:
        self.seed = seed
        self.kills_wanted = kills
        self.base = base
        self.lock = threading.Lock()
        self.abort = threading.Event()
        self.lanes = [
            Lane(i, p, base / f"lane{i}-{p.label()}", Model(max_attempts=p.max_attempts),
                 random.Random(seed * 16 + i))
            for i, p in enumerate(LANES)
        ]
        self.reserved = 0
        self.hits: Counter[str] = Counter()
        self.pending: Counter[str] = Counter()
        self.workloads: Counter[str] = Counter()
        self.kills = 0
        self.self_exits = 0
        self.open_est = 0.08
        self.drains = 0
        self.states = 0
        self.findings: list[str] = []

    # -- one child ------------------------------------------------------------------------------
    def spawn(self, lane: Lane, workload: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
        lane.children += 1
        jpath = lane.journal_dir / f"c{lane.children:05d}.log"
        epath = lane.root / "stderr" / f"c{lane.children:05d}.txt"
        epath.parent.mkdir(parents=True, exist_ok=True)
        spec = {
            "mode": "loop",
            "db": str(lane.db),
            "journal": str(jpath),
            "seed": lane.rng.randrange(1 << 30),
            "profile": lane.profile.to_json(),
            "base": lane.children * 1_000_000,
            "workload": workload,
            "max_seconds": 30,
        }
        code = f"from tests.reliability.workload import main; main({json.dumps(json.dumps(spec))})"
        with open(epath, "wb") as err:
            p = subprocess.Popen([sys.executable, "-u", "-c", code], stdout=subprocess.PIPE, stderr=err,
                                 env=child_env(), cwd=str(ROOT))
        return p, jpath, epath

    def one_kill(self, lane: Lane) -> None:
        rng = lane.rng
        with self.lock:
            target = min(PHASES, key=lambda ph: (self.hits[ph] + self.pending[ph], rng.random()))
            self.pending[target] += 1
        if target == "open":
            workload = rng.choice(sorted(WORKLOADS))
        else:
            workload = "mixed" if rng.random() < 0.2 else TARGET_WORKLOAD[target]
        try:
            self._kill(lane, target, workload)
        finally:
            with self.lock:
                self.pending[target] -= 1

    def _kill(self, lane: Lane, target: str, workload: str) -> None:
        rng = lane.rng
        with self.lock:
            self.workloads[workload] += 1
        p, jpath, epath = self.spawn(lane, workload)
        try:
            first = read_line(p, CHILD_TIMEOUT)
            if first == "OPENING":
                t_open = time.monotonic()
                if target == "open":
                    time.sleep(rng.uniform(0.0, self.open_est * 1.2))
                else:
                    if read_line(p, CHILD_TIMEOUT) == "READY":
                        took = time.monotonic() - t_open
                        self.open_est = 0.8 * self.open_est + 0.2 * took
                    time.sleep(rng.uniform(0.01, 0.25))
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        finally:
            try:
                p.kill()
            except ProcessLookupError:
                pass
            p.wait()
            p.stdout.close()  # type: ignore[union-attr]
        records = read_journal(jpath) if jpath.exists() else []
        with self.lock:
            self.kills += 1
            if p.returncode != -signal.SIGKILL:
                self.self_exits += 1
                self.hits["exited"] += 1
            else:
                self.hits[kill_phase(records)] += 1
        if p.returncode != -signal.SIGKILL and not any(r[0] == "X" for r in records):
            # (an X record is counted by the checker)
            lane.model.bad("child_errors", f"{jpath.name}: exit {p.returncode}: {epath.read_text()[-500:]}")

    # -- verification ---------------------------------------------------------------------------
    def feed(self, lane: Lane) -> None:
        for path in journal_files(lane.journal_dir):
            if path.name in lane.fed:
                continue
            recs = read_journal(path)
            lane.model.feed(recs, path.name)
            for r in recs:
                if r[0] == "O!":
                    lane.model.counts["orphans_collected"] += int(r[1])
            lane.fed.add(path.name)

    def verify(self, lane: Lane, drain: bool) -> None:
        self.feed(lane)
        where = f"lane{lane.index} check {lane.checks}"
        with self.lock:
            self.states += 1
            self.drains += int(drain)
        verify_database(lane.db, lane.profile, lane.model, drain=drain, where=where)
        lane.checks += 1

    # -- the loop -------------------------------------------------------------------------------
    def reserve(self, lane: Lane) -> int:
        """How many kills this lane's next cycle takes (0 when the run is complete)."""
        want = lane.rng.choice((1, 1, 1, 2, 2, 3))
        with self.lock:
            left = self.kills_wanted - self.reserved
            if (
                left <= 0
                and self.kills_wanted >= 200
                and self.reserved < 2 * self.kills_wanted
                and min(self.hits[ph] for ph in PHASES) < MIN_PHASE_HITS
            ):
                # A kill lands in whatever phase the child is in (a loaded machine skews
                # that): go on until every phase has its hits, at most twice the size.
                left = 1
            k = min(want, left)
            self.reserved += k
            return k

    def run_lanes(self, lanes: list[Lane]) -> None:
        cycle = 0
        while not self.abort.is_set():
            lane = lanes[cycle % len(lanes)]
            cycle += 1
            k = self.reserve(lane)
            if k <= 0:
                break
            for _ in range(k):
                self.one_kill(lane)
            self.verify(lane, drain=(lane.checks + 1) % DRAIN_EVERY == 0)
        for lane in lanes:  # the Jepsen final drain
            self.verify(lane, drain=True)

    def run(self) -> float:
        t0 = time.monotonic()
        groups = [self.lanes[i :: PARALLEL] for i in range(PARALLEL)]
        errors: list[BaseException] = []

        def body(ls: list[Lane]) -> None:
            try:
                self.run_lanes(ls)
            except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
                errors.append(e)

        threads = [threading.Thread(target=body, args=(g,), name=f"killloop-{i}", daemon=True)
                   for i, g in enumerate(groups)]
        for t in threads:
            t.start()
        try:
            for t in threads:
                t.join()
        except BaseException:  # e.g. the pytest-timeout alarm: stop the lanes, don't leave them running
            self.abort.set()
            raise
        if errors:
            raise errors[0]
        return time.monotonic() - t0

    def totals(self) -> Counter[str]:
        c: Counter[str] = Counter()
        for lane in self.lanes:
            c.update(lane.model.summary())
            c["stale_checks"] += lane.model.counts["stale_checks"]
        return c

    def report(self, seconds: float) -> str:
        t = self.totals()
        fields: dict[str, object] = {
            "kills": self.kills,
            "checks": self.states,
            "drains": self.drains,
            "seconds": f"{seconds:.0f}",
            "kills_per_min": f"{self.kills / seconds * 60:.0f}",
            "parallel": PARALLEL,
            "self_exits": self.self_exits,
        }
        for ph in PHASES:
            fields[f"phase_{ph}"] = self.hits[ph]
        fields["phase_between"] = self.hits["between"]
        fields["min_phase"] = min(self.hits[ph] for ph in PHASES)
        fields["encrypted_lanes"] = sum(1 for ln in self.lanes if ln.profile.enc)
        fields["lanes"] = len(self.lanes)
        for k in ("attempts", "acknowledged", "acked", "deliveries", "duplicated", "recovered", "dead_letters",
                  "effects", "orphans_collected", "repaired_on_open", "stale_checks"):
            fields[k] = t[k]
        for k in VIOLATIONS:
            fields[k] = t[k]
        fields["seed"] = self.seed
        return summary_line("killloop", fields)

    def violations(self) -> list[str]:
        out = []
        for lane in self.lanes:
            out += [f"lane{lane.index} {lane.profile.label()}: {v}" for v in lane.model.violations]
        return out


def run_kill_loop(tmp_path: Path, kills: int) -> None:
    seed = int(os.environ.get("ARMDB_KILLLOOP_SEED") or int.from_bytes(os.urandom(4), "little"))
    kl = KillLoop(tmp_path, seed, kills)
    seconds = kl.run()
    kl.report(seconds)
    t = kl.totals()
    bad = {k: t[k] for k in VIOLATIONS if t[k]}
    short = {ph: kl.hits[ph] for ph in PHASES if kl.hits[ph] < MIN_PHASE_HITS and kills >= 200}
    if bad or short:
        save_artifacts(
            "killloop",
            seed,
            [ln.root for ln in kl.lanes],
            f"ARMDB_KILLLOOP_SEED={seed} ARMDB_KILLS_CI={kills} .venv/bin/python -m pytest -p no:cacheprovider -s "
            f"tests/reliability/test_killloop.py -k ci",
            "\n".join(kl.violations()),
        )
    assert not bad, f"kill loop violations {bad}:\n" + "\n".join(kl.violations()[:25])
    assert not short, f"kill phases hit fewer than {MIN_PHASE_HITS} times: {short}"


@pytest.mark.crash
@pytest.mark.timeout(900)
def test_killloop_ci(tmp_path: Path) -> None:
    """I1-I9 under kill -9 at CI size (200 kills, every phase >= 20)."""
    run_kill_loop(tmp_path, int(os.environ.get("ARMDB_KILLS_CI", "200")))


@pytest.mark.crash
@pytest.mark.slow
@pytest.mark.timeout(0)
def test_killloop_nightly(tmp_path: Path) -> None:
    """The same at nightly size (``ARMDB_KILLS``, default 2000)."""
    run_kill_loop(tmp_path, int(os.environ.get("ARMDB_KILLS", "2000")))


I6_HOLDER = """
import os, pickle, sys
from tests.reliability import adapter
from tests.reliability.adapter import Profile
p = Profile.from_json(sys.argv[1])
db, qs, eff = adapter.open_all(sys.argv[2], p)
for kind in ("f", "v"):
    adapter.push(qs[kind], kind, 1 if kind == "f" else 2, 100)
    (lz,) = adapter.lease(qs[kind], kind, 1, 600.0)
    print(kind, pickle.dumps(lz.token).hex(), flush=True)
os.kill(os.getpid(), 9)
"""

I6_USER = """
import pickle, sys
from tests.reliability import adapter
from tests.reliability.adapter import Profile
p = Profile.from_json(sys.argv[1])
db, qs, eff = adapter.open_all(sys.argv[2], p)
for line in sys.argv[3].splitlines():
    kind, tok = line.split()
    accepted = adapter.ack(qs[kind], pickle.loads(bytes.fromhex(tok)))
    print(kind, "accepted" if accepted else "refused", qs[kind].len(), flush=True)
adapter.close(db)
"""


@pytest.mark.crash
@pytest.mark.parametrize("enc", [False, True], ids=["plain", "encrypted"])
def test_i6_q13_token_from_killed_process_refused_after_restart(tmp_path: Path, enc: bool) -> None:
    """Q13/I6: a token leased by a process that was killed is refused by the next process.

    The holder leases one row of each queue (lease timeout 600 s, so the row stays
    LEASED at the same epoch) and prints the pickled tokens; it is SIGKILLed.  A new
    process opens the same queues in the same order and acks with those tokens:
    each ack must raise StaleToken and leave the row leased.
    """
    prof = Profile(enc=enc).to_json()
    db = str(tmp_path / "db")
    env = child_env()
    holder = subprocess.run([sys.executable, "-c", I6_HOLDER, prof, db], capture_output=True, text=True,
                            env=env, cwd=str(ROOT), timeout=60, check=False)
    assert holder.returncode == -signal.SIGKILL, holder.stderr
    user = subprocess.run([sys.executable, "-c", I6_USER, prof, db, holder.stdout], capture_output=True,
                          text=True, env=env, cwd=str(ROOT), timeout=60, check=False)
    assert user.returncode == 0, user.stderr
    assert user.stdout.split("\n")[:2] == ["f refused 1", "v refused 1"], (
        "a LeaseToken from a killed process was honoured by a new process "
        f"(handle ids restart at 1 in every process):\n{user.stdout}"
    )


def test_checker_catches_injected_anomalies(tmp_path: Path) -> None:
    """The checker is not vacuous: each planted anomaly is counted under its invariant."""
    from .journal import Journal, make_payload

    prof = Profile()
    db_path = tmp_path / "db"
    j = Journal(tmp_path / "journal" / "c00001.log")
    db, qs, _eff = adapter.open_all(db_path, prof)
    try:
        f, v = qs["f"], qs["v"]
        ids = {}
        for n in range(1, 8):
            j.write("P?", "f", n, 64)
            ids[n] = adapter.push(f, "f", n, 64)
            j.write("P!", "f", n, ids[n])
        # lost (I1): job 1 acked behind the journal's back.
        (lz1,) = [x for x in adapter.lease(f, "f", 7, 600.0) if x.n == 1]
        adapter.ack(f, lz1.token)
        # resurrected (I2): the journal says job 2 was acked; it is still stored.
        j.write("A?", "f", ids[2], 2, 1)
        j.write("A!", "f", ids[2], 2)
        # unexpected (I3): a job nobody journaled.
        adapter.push(v, "v", 99, 100)
        # wrong payload (I3): a journaled push whose stored bytes are another job's body.
        j.write("P?", "v", 50, 100)
        rid = v.push(make_payload(51, 100)[:-1] + b"!")
        j.write("P!", "v", 50, rid)
        # attempt regression (I7): a lease of job 3 reported attempt 7; it stores 1.
        j.write("L?", "f", 1, 0)
        j.write("L!", "f", ids[3], 3, 7, 1, 0, 0, 1, 1)
        j.write("L.", "f", 1, 0)
        # tx atomicity (I8): the journal says job 4's outbox tx committed; no effect exists.
        j.write("T?", "f", ids[4], 4, "f", 0, 1)
        j.write("T!", "f", ids[4], 4, "f", 0, 0)
        # lease overlap (I6): job 5 leased twice, the second inside the first's live window.
        j.write("L?", "f", 1, 0)
        j.write("L!", "f", ids[5], 5, 1, 1, 0, 0, 10_000, 1)
        j.write("L.", "f", 1, 100)
        j.write("L?", "f", 1, 200)
        j.write("L!", "f", ids[5], 5, 2, 2, 0, 0, 20_000, 1)
        j.write("L.", "f", 1, 300)
    finally:
        adapter.close(db)
    m = Model(max_attempts=prof.max_attempts)
    m.feed(read_journal(j.path), "c00001.log")
    verify_database(db_path, prof, m, drain=True, where="planted", stale_check=0)
    got = {k: m.counts[k] for k in ("lost", "resurrected", "unexpected", "wrong_payload", "attempt_regressions",
                                     "tx_atomicity", "lease_overlaps")}
    assert all(got.values()), (got, m.violations)
    assert m.counts["check_failures"] == 0 and m.counts["child_errors"] == 0


@pytest.mark.parametrize("kind", ["f", "v"])
def test_i1_s4_kill_mid_lease_slot_update_keeps_the_job(tmp_path: Path, kind: str) -> None:
    """I1/S4: a SIGKILL inside a lease's in-place header update must not lose the job.

    ``armdb._core.fixed.SlotFile.put`` copies the new slot body in place, then stores the
    CRC and meta.  A kill between the two (the kill loop hit it: ``repaired_on_open=1``
    and one pushed, never-acked job gone) leaves the new body under the old CRC.  This
    test writes exactly that state: a pushed job whose slot holds the lease's new
    header bytes (state LEASED, attempts 1) under the old CRC, and reopens.  The job
    was pushed and never acked, so it must still be there (leased or ready); freeing
    the slot as "torn" loses it (and, for a var queue, its body is then collected as
    an orphan).
    """
    import numpy as np

    from armdb.fixed import HEADER_PAGE

    prof = Profile()
    db_path = tmp_path / "db"
    db, qs, _eff = adapter.open_all(db_path, prof)
    rid = adapter.push(qs[kind], kind, 7, 100)
    adapter.close(db)
    spec = adapter.FIXED_SPEC if kind == "f" else adapter.VAR_SPEC
    data = db_path / "collections" / spec.name / "shard-000" / "fixed.data"
    raw = bytearray(data.read_bytes())
    slot_size = int(np.frombuffer(raw, "<u4", 1, 12)[0])  # header: magic, version, slot_size, ...
    off = HEADER_PAGE  # the first push takes slot 0
    assert int.from_bytes(raw[off + 8 + 8 : off + 8 + 16], "big") == rid
    hdr = off + 8 + 16  # slot header (meta, crc) + row key (due, seq)
    raw[hdr] = 1  # state LEASED: the bytes the lease's memcpy wrote ...
    raw[hdr + 2] = 1  # ... attempts 1; the CRC and meta were not stored yet
    assert slot_size > 0
    data.write_bytes(bytes(raw))
    db, qs, _eff = adapter.open_all(db_path, prof)
    try:
        repaired = adapter.repaired_on_open(qs[kind])
        held = qs[kind].len()
    finally:
        adapter.close(db)
    assert held == 1, (
        f"a kill inside the lease's slot write lost pushed job {rid}: repaired_on_open={repaired}, len()={held}"
    )


LOG_WRITER = """
import os, sys
from tests.reliability import adapter
from tests.reliability.adapter import Profile
p = Profile.from_json(sys.argv[1])
db, qs, eff = adapter.open_all(sys.argv[2], p)
if sys.argv[3] == "commit":
    for n in range(1, 4):
        adapter.push(qs["v"], "v", n, 3000)
    for lz in adapter.lease(qs["v"], "v", 3, 600.0):
        adapter.outbox(db, eff, qs["v"], lz.token, lz.n, qs["v"], "v", 100 + lz.n, 3000, False)
os._exit(0)  # a process that dies without close(): the log is not checkpointed
"""


def _run_log_writer(prof: Profile, db: Path, what: str) -> None:
    r = subprocess.run([sys.executable, "-c", LOG_WRITER, prof.to_json(), str(db), what], capture_output=True,
                       text=True, env=child_env(), cwd=str(ROOT), timeout=60, check=False)
    assert r.returncode == 0, r.stderr


@pytest.mark.crash
@pytest.mark.parametrize("damage", ["empty_new_log_file", "torn_tail"])
def test_d1_t2_crash_state_in_a_retained_log_file_keeps_the_db_openable(tmp_path: Path, damage: str) -> None:
    """T2/D1: a crash state the log's recovery accepts must stay acceptable after the next open.

    In an encrypted database, ``TxLog._open`` cannot apply the logged rows of encrypted
    collections (the replayer has no payload key), so it *retains* every old log file
    until a checkpoint.  A process that is killed before ``close`` never checkpoints,
    so the files pile up.  Two crash states that recovery tolerates in the *last* file
    are then refused once a newer file exists:

    * ``empty_new_log_file``: a kill between ``_start_file``'s ``open(O_CREAT|O_TRUNC)``
      and its header write leaves a 0-byte log (the kill loop hit this: the database
      then failed every open with ``FormatError: ... not an armdb transaction log``);
    * ``torn_tail``: a kill inside a log append leaves a torn last record, which is
      dropped while the file is last but raises ``CorruptionError`` once it is not.
    """
    prof = Profile(enc=True)
    db = tmp_path / "db"
    _run_log_writer(prof, db, "commit")
    logs = sorted((db / "txlog").glob("*.log"))
    last = logs[-1]
    if damage == "empty_new_log_file":
        (db / "txlog" / f"{int(last.stem) + 1:08d}.log").write_bytes(b"")  # created, header never written
    else:
        raw = last.read_bytes()
        assert len(raw) > 200
        last.write_bytes(raw[:-100])  # the last record torn
    _run_log_writer(prof, db, "open")  # recovery accepts the state, then the process dies again
    try:
        d, _qs, _eff = adapter.open_all(db, prof)
    except ArmdbError as e:
        pytest.fail(f"the database no longer opens after two crashes: {type(e).__name__}: {e}")
    adapter.close(d)
    ok, findings = adapter.check(db)
    assert ok, findings
