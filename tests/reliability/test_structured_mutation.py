"""Harness (d2): structure-aware mutation (issue 14, "The harness that would have found these").

Harness (d) flips bytes, so nearly every case it makes is caught by a CRC.  This one
decodes every record and file kind armdb writes (``structured.FIELDS``: the log file
header and its records down to each field of each logged row, the ``fixed.data``
header page, its slots and high-water mark, ``fixed.redo``, Bitcask data file headers
and records, hint file headers, entries and trailers, ``collection.meta``,
``queue.meta``, ``db.meta``, ``compaction.pending``, ``seqmap``, the synced mark area, and
``LOCK`` as a link, a folder or a fifo), sets one field to a
boundary or hostile value and re-seals the file: every CRC is recomputed and sealed
fields are sealed again with the test's keys, so only armdb's judgement of the
content stands between the file and the process.

Each crafted file is written into a fresh copy of its golden database (the goldens of
``test_mutation.py``, an encrypted payload store that rotated, a fixed queue with two
header shards), and a child process (``sys.executable``, under
``RLIMIT_AS`` = 2 GiB and ``RLIMIT_FSIZE`` = 64 MiB, ``SIGXFSZ`` ignored so that a
runaway file is an ``EFBIG`` error) runs ``armdb.check`` on it, opens the database,
reads everything (every queue: stats, snapshot, lease until empty; every map:
``items()``), writes once (a push to every queue, a put to every map) and closes it.  Children take a batch of cases each and print one JSON
line per case; a per-case watchdog (``faulthandler.dump_traceback_later``) ends a
hung case.  Beside the database lies a canary folder holding a copy of a database,
and the folders above it are watched: a crafted name such as ``../../canary/x`` or
an absolute path must not write there.

Violations (each counter must be 0):

* ``signals``: a child killed by a signal (SIGSEGV, SIGBUS, SIGABRT ...);
* ``hangs``: a case still running after ``ARMDB_D2_CASE_TIMEOUT`` seconds;
* ``memory``: ``MemoryError`` or ``ENOMEM`` (the address-space bound was hit), or a
  case whose peak resident memory passed ``ARMDB_D2_RSS_MB`` (512);
* ``file_size``: ``EFBIG`` or ``SIGXFSZ``, or a database past 64 MiB;
* ``outside_writes``: the canary changed, or a file appeared beside the database;
* ``untyped_exceptions``: anything but an ``armdb.errors.ArmdbError`` escaping
  ``check``, the open, a read or the close;
* ``check_ok_on_refused``: ``check`` said OK and the open or a read then refused
  with a corruption-family error (not counted where the crafted value lies inside a
  sealed field or fails a tag: check reads no key);
* ``silent_loss``: a hint or compaction marker (which must never change what is
  served: the goldens hold no real compaction input) changed what an open served, and
  ``check`` had said OK (when check named the file first, the case is counted as
  ``reported_loss``, not a violation: open cannot tell a lying hint with the right
  identity, or a marker naming older immutable files, from a real one);
* ``unwritable``: the open served the database, then one push to every queue or one
  put to every map raised (the open accepted a state it cannot go on from);
* ``harness_errors``: the harness itself failed (a child died for no reason above).

Size: ``ARMDB_D2_CASES`` crafted files (CI default 21,000, at least 20,000 checked),
``ARMDB_D2_CASES_NIGHTLY`` for the ``slow`` test (default: the whole case space).
``ARMDB_D2_WORKERS`` children run at once (default: 2).  ``ARMDB_D2_ONLY`` (kinds or
``kind.field``, comma-separated) restricts a run to them, to reproduce one class.  ``ARMDB_D2_FINDINGS`` names a
markdown file the distinct violation classes are written to.  One summary line
``RELIABILITY d2-mutation ...`` goes to ``$ARMDB_RELIABILITY_REPORT``.
"""

from __future__ import annotations

import contextlib
import errno
import faulthandler
import json
import logging
import os
import random
import re
import resource
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from armdb import bitcask, txlog
from armdb.errors import ArmdbError, ConfigError, EncryptionKeyRequired, SchemaMismatch, WrongKey

from . import structured as S
from .bcd_workloads import FakeClock, World, fast_tmpdir, quiesce
from .journal import quiet_armdb_log, report_line
from .test_mutation import GOLDEN_SPECS as D_GOLDENS
from .test_mutation import _qops, build_golden

ROOT = Path(__file__).resolve().parents[2]
CI_CASES = int(os.environ.get("ARMDB_D2_CASES", "21000"))
NIGHTLY_CASES = int(os.environ.get("ARMDB_D2_CASES_NIGHTLY", str(10**9)))  # default: every case
WORKERS = int(os.environ.get("ARMDB_D2_WORKERS", str(max(1, min(2, os.cpu_count() or 1)))))
# The slowest sound case takes about 1.5 s on the loaded machine; the quadratic torn-tail
# search of old took about 25 s on the 2 MiB "tail" case.
CASE_TIMEOUT = float(os.environ.get("ARMDB_D2_CASE_TIMEOUT", "10"))
MEMORY_LIMIT = 2 << 30
RSS_LIMIT_MB = int(os.environ.get("ARMDB_D2_RSS_MB", "512"))  # peak resident memory of one case
FSIZE_LIMIT = 64 << 20
MIN_CI_CRAFTED = 20_000
# To reproduce one class: ARMDB_D2_ONLY=hint_entry.tombstone,pending (kinds or kind.field).
ONLY = {x for x in os.environ.get("ARMDB_D2_ONLY", "").split(",") if x}

# The goldens of harness (d), and two more: an encrypted payload store that rotated (sealed
# keys in several data files and in hint files) and a fixed queue with two header shards.
EXTRA_GOLDENS: dict[str, tuple[World, list[str]]] = {
    "var_encrypted_rotated": (World(queues=(("vq", True),), durable=True, encrypted=True, payload_size=3000),
                              _qops("vq", 44) + ["lease:vq", "ack:vq"] * 6),
    "fixed_two_shards": (World(queues=(("fq", False),), durable=True, shards=2), _qops("fq", 12)),
}
GOLDEN_SPECS: dict[str, tuple[World, list[str]]] = {**D_GOLDENS, **EXTRA_GOLDENS}


def build_d2_golden(name: str, root: str) -> str:
    """The folder of golden database ``name``: (d)'s builder, or the workload run here."""
    if name in D_GOLDENS:
        return build_golden(name, root).path
    from .bcd_workloads import Session

    world, ops = EXTRA_GOLDENS[name]
    path = os.path.join(root, name, "db")
    os.makedirs(path)
    sess = Session(world, path).open()
    for op in ops:
        sess.run(op)
    sess.close()
    return path


VIOLATIONS = ("signals", "hangs", "memory", "file_size", "outside_writes", "untyped_exceptions",
              "check_ok_on_refused", "silent_loss", "unwritable", "harness_errors")
# Refusals that say the declaration or the keys do not match the files (a valid file
# can cause them: check, which knows neither, rightly says OK).
_MISMATCH = (SchemaMismatch, EncryptionKeyRequired, WrongKey, ConfigError)
_TAG_FAILURE = re.compile(r"authentication tag|fails its tag")


# ---------------------------------------------------------------------------------------------
# The child: craft, check, open, read everything, close; one JSON line per case
# ---------------------------------------------------------------------------------------------


def _chain(e: BaseException) -> list[BaseException]:
    out, seen = [], set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen and len(out) < 12:
        out.append(x)
        seen.add(id(x))
        x = x.__cause__ or x.__context__
    return out


def _resource_class(e: BaseException) -> str | None:
    for x in _chain(e):
        if isinstance(x, MemoryError) or getattr(x, "errno", None) == errno.ENOMEM:
            return "memory"
        if getattr(x, "errno", None) == errno.EFBIG or "File too large" in str(x):
            return "file_size"
    return None


def _ename(e: BaseException) -> str:
    """The exception's class, with its module unless it is a builtin or armdb's (msgpack has
    a ``FormatError`` of its own)."""
    mod = type(e).__module__
    return type(e).__name__ if mod in ("builtins", "armdb.errors") else f"{mod}.{type(e).__name__}"


def _tb_head(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if "/armdb/" in f.filename] or frames
    tail = ours[-3:]
    return " <- ".join(f"{os.path.relpath(f.filename, ROOT) if f.filename.startswith(str(ROOT)) else f.filename}:"
                       f"{f.lineno} {f.name}" for f in reversed(tail))


def _payload(p: Any) -> Any:
    if isinstance(p, (bytes, bytearray, memoryview)):
        return bytes(p)
    if hasattr(p, "tobytes"):
        return p.tobytes()
    return repr(p)


def read_all(world: World, path: str) -> tuple[str, Any, BaseException | None]:
    """``(stage, state, error)``: open the database, read everything, close it."""
    import armdb

    d = None
    stage = "open"
    try:
        d = armdb.Db.open(path, clock=FakeClock(), tx_config=world.tx_config())
        quiesce(d)
        specs = world.specs()
        qs = {n: d.open_queue(specs[n], world.queue_config()) for n, _v in world.queues}
        ms = {m: d.open_map(m, world.bitcask_config()) for m in world.maps}
        stage = "read"
        state: list[Any] = []
        for n, q in qs.items():
            st = q.stats()
            snap = q.snapshot().tolist()
            counts = (q.len(), q.dead_len(), st.ready, st.leased, st.delayed)
            leased = []
            for _ in range(64):
                got = q.lease(1000)
                if not got:
                    break
                leased += [(x.id, x.attempt, _payload(x.payload)) for x in got]
            state.append((n, counts, snap, leased))
        for m, mm in ms.items():
            state.append((m, sorted(mm.items(), key=repr)))
        # The database it served must go on working: one push to every queue, one put to
        # every map (a stored gsn or id at the end of its range would block every write).
        stage = "write"
        for n, q in qs.items():
            q.push(b"probe" if dict(world.queues)[n] else (7, 7))
        for mm in ms.values():
            mm.put(b"probe", b"v")
        stage = "close"
        d.close()
        d = None
        return "served", state, None
    except Exception as e:  # noqa: BLE001 - classified by the caller
        return stage, None, e
    finally:
        if d is not None:
            with contextlib.suppress(BaseException):
                d.shutdown()


def _digest(root: str) -> dict[str, tuple[int, ...]]:
    """Size, inode, modification time and mode of everything under ``root`` (a store
    through a shared mapping updates the modification time too)."""
    out = {}
    for dirpath, _dirs, names in os.walk(root):
        for fn in [*names, ""]:
            p = os.path.join(dirpath, fn)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_size, st.st_ino, st.st_mtime_ns, st.st_mode)
    return out


def _tree_bytes(root: str) -> int:
    n = 0
    for dirpath, _dirs, names in os.walk(root):
        for fn in names:
            with contextlib.suppress(OSError):
                n += os.lstat(os.path.join(dirpath, fn)).st_size
    return n


class _Child:
    def __init__(self, spec: dict[str, Any]) -> None:
        import armdb

        self.armdb = armdb
        self.spec = spec
        self.work = spec["work"]
        # Nested so that ``..`` chains from db/collections/<name> land in watched folders.
        self.a = os.path.join(self.work, "a")
        self.b = os.path.join(self.a, "b")
        self.case = os.path.join(self.b, "case")
        self.db = os.path.join(self.case, "db")
        self.canary = os.path.join(self.case, "canary")
        shutil.rmtree(self.a, ignore_errors=True)
        os.makedirs(self.case)
        os.chdir(self.b)  # a relative path in a crafted name lands in a watched folder too
        self.canary_src = spec["canary"]
        shutil.copytree(self.canary_src, self.canary)
        self.canary_digest = _digest(self.canary)
        self.worlds = {n: GOLDEN_SPECS[n][0] for n in spec["goldens"]}
        self.infos: dict[str, S.GoldenInfo] = {}
        self.truth: dict[str, Any] = {}

    def info(self, name: str) -> S.GoldenInfo:
        if name not in self.infos:
            w = self.worlds[name]
            self.infos[name] = S.golden_info(name, self.spec["goldens"][name], dict(w.queues), list(w.maps))
        return self.infos[name]

    def golden_truth(self, name: str) -> Any:
        if name not in self.truth:
            shutil.copytree(self.spec["goldens"][name], self.db)
            stage, state, err = read_all(self.worlds[name], self.db)
            shutil.rmtree(self.db)
            assert err is None, f"golden {name} does not read back: {stage}: {err!r}"
            self.truth[name] = state
        return self.truth[name]

    def run(self, i: int, c: S.Case) -> dict[str, Any]:
        _reset_peak_rss()
        t0 = time.perf_counter()
        res: dict[str, Any] = {"i": i, "v": []}
        info = self.info(c.golden)
        truth = self.golden_truth(c.golden) if c.kind in S.CACHE_KINDS else None
        shutil.copytree(info.root, self.db, copy_function=shutil.copyfile)
        label, files = S.craft(info, c, self.case)
        res["label"] = label
        for rel, data in files.items():
            p = os.path.join(self.db, rel)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            if isinstance(data, tuple):  # a LOCK entry of another kind than a file
                _make_entry(p, *data)
                continue
            with open(p, "wb") as f:
                f.write(data)

        def violation(cls: str, what: str, e: BaseException | None = None) -> None:
            res["v"].append(cls)
            res.setdefault("detail", f"{what}: {_ename(e)}: {str(e)[:300]}" if e is not None else what)
            if e is not None:
                res.setdefault("tb", _tb_head(e))
                res.setdefault("exc", _ename(e))

        pre_ok = False
        try:
            rep = self.armdb.check(self.db)
            pre_ok = rep.ok
        except ArmdbError as e:
            res["check_raised"] = type(e).__name__
        except Exception as e:  # noqa: BLE001
            violation(_resource_class(e) or "untyped_exceptions", "check", e)
        res["pre_ok"] = pre_ok
        stage, state, err = read_all(self.worlds[c.golden], self.db)
        res["stage"] = stage
        if err is None:
            res["outcome"] = "served"
            if truth is not None and state != truth:
                if pre_ok:
                    violation("silent_loss", "open served a state other than the golden's "
                              f"({_diff(truth, state)}); nothing refused, check said OK")
                else:
                    # check named the file first.  A hint is a cache without a secret and a
                    # marker naming older immutable files looks like a crash's: open cannot
                    # tell them from real ones (docs/format.md), check can.
                    res["reported_loss"] = _diff(truth, state)
        else:
            res["outcome"] = f"refused:{_ename(err)}"
            cls = _resource_class(err)
            if cls is not None:
                violation(cls, stage, err)
            elif not isinstance(err, ArmdbError):
                violation("untyped_exceptions", stage, err)
            elif stage == "write":
                violation("unwritable", "the open served the database, then a push or put raised", err)
            elif pre_ok and not isinstance(err, _MISMATCH) and not _TAG_FAILURE.search(str(err)) \
                    and not S.sealed_content(info, c):
                # (check reads no key: a sealed field, its tag or its content, is the open's to judge)
                violation("check_ok_on_refused", f"check said OK; {stage} raised", err)
            if isinstance(err, ArmdbError):
                res["msg"] = str(err)[:160]
        self._after(res, violation)
        res["ms"] = round((time.perf_counter() - t0) * 1000, 1)
        rss = _peak_rss_mb()
        res["rss"] = rss
        if rss > RSS_LIMIT_MB:
            violation("memory", f"the case's peak resident memory was {rss} MiB (bound {RSS_LIMIT_MB} MiB)")
        return res

    def _after(self, res: dict[str, Any], violation: Any) -> None:
        size = _tree_bytes(self.db)
        if size > FSIZE_LIMIT:
            violation("file_size", f"the database grew to {size} bytes")
        extra = sorted(set(os.listdir(self.case)) - {"db", "canary"})
        for d, expect in ((self.b, {"case"}), (self.a, {"b"}), (self.work, {"a"})):
            extra += [os.path.join(d, x) for x in sorted(set(os.listdir(d)) - expect)]
        now = _digest(self.canary)
        changed = sorted(k for k in set(now) | set(self.canary_digest) if now.get(k) != self.canary_digest.get(k))
        if extra or changed:
            violation("outside_writes", f"written outside the database: {extra[:4]}"
                      + (f"; canary entries changed: {changed[:4]}" if changed else ""))
            for x in extra:
                p = x if os.path.isabs(x) else os.path.join(self.case, x)
                if os.path.isdir(p) and not os.path.islink(p):
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(p)
            if changed:
                shutil.rmtree(self.canary, ignore_errors=True)
                shutil.copytree(self.canary_src, self.canary)
                self.canary_digest = _digest(self.canary)
        shutil.rmtree(self.db, ignore_errors=True)


def _make_entry(path: str, kind: str, target: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    if kind == "symlink":
        os.symlink(target, path)
    elif kind == "hardlink":
        os.link(target, path)
    elif kind == "dir":
        os.mkdir(path)
    else:
        os.mkfifo(path)


def _reset_peak_rss() -> None:
    """Reset the kernel's peak resident set size of this process (``VmHWM``)."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_rss_mb() -> int:
    try:
        with open("/proc/self/status") as f:
            m = re.search(r"VmHWM:\s+(\d+)", f.read())
    except OSError:
        return 0
    return int(m.group(1)) // 1024 if m else 0


def _diff(truth: Any, state: Any) -> str:
    for t, s in zip(truth, state):
        if t != s:
            if len(t) == 2:  # a map
                tk, sk = dict(t[1]), dict(s[1])
                gone = [k for k in tk if k not in sk]
                return f"{t[0]}: {len(gone)} key(s) gone, {len(tk)} -> {len(sk)}"
            return f"{t[0]}: counts {t[1]} -> {s[1]}, leased {len(t[3])} -> {len(s[3])}"
    return "differs"


def worker_main(spec_path: str) -> None:
    """Entry point of a child: process ``spec["cases"]`` in order, one JSON line each."""
    with open(spec_path) as f:
        spec = json.load(f)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a runaway file is EFBIG, counted
    logging.getLogger("armdb").setLevel(logging.CRITICAL)
    err = open(spec["errlog"], "a")  # noqa: SIM115 - lives as long as the process
    # Fatal signals, and the SIGABRT the parent sends to a case past its time bound, dump
    # every thread's stack here.
    faulthandler.enable(file=err, all_threads=True)
    child = _Child(spec)
    out = sys.stdout
    out.write('{"ready": 1}\n')
    out.flush()
    controls = spec.get("controls", {})
    for i, raw in enumerate(spec["cases"]):
        c = S.Case(*raw)
        control = controls.get(str(i))  # the detectors' own test: a fault on purpose
        if control == "segv":
            faulthandler._sigsegv()
        elif control == "hang":
            time.sleep(3600)
        elif control == "outside":
            with open(os.path.join(child.case, "stray"), "w") as f:
                f.write("x")
        try:
            res = child.run(i, c)
        except Exception as e:  # noqa: BLE001 - a harness failure, reported as such
            res = {"i": i, "v": ["harness_errors"], "detail": f"harness: {type(e).__name__}: {e}", "tb": _tb_head(e),
                   "exc": type(e).__name__}
            shutil.rmtree(child.db, ignore_errors=True)
        out.write(json.dumps(res, default=repr) + "\n")
        out.flush()


def _limits() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, FSIZE_LIMIT))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


# ---------------------------------------------------------------------------------------------
# The parent: goldens, cases, children, the tally
# ---------------------------------------------------------------------------------------------


@dataclass
class D2Tally:
    crafted: int = 0
    counts: Counter = field(default_factory=Counter)
    coverage: Counter = field(default_factory=Counter)  # (kind, field) -> crafted files
    outcomes: Counter = field(default_factory=Counter)
    groups: dict[tuple[str, ...], dict[str, Any]] = field(default_factory=dict)
    child_starts: int = 0
    slowest: float = 0.0
    peak_rss_mb: int = 0
    reported_loss: int = 0
    seconds: float = 0.0

    def add(self, c: S.Case, res: dict[str, Any]) -> None:
        self.crafted += 1
        self.coverage[(c.kind, c.field)] += 1
        self.outcomes[res.get("outcome", "died")] += 1
        self.slowest = max(self.slowest, float(res.get("ms", 0)) / 1000)
        self.peak_rss_mb = max(self.peak_rss_mb, int(res.get("rss", 0)))
        self.reported_loss += "reported_loss" in res
        for cls in dict.fromkeys(res["v"]):
            self.counts[cls] += 1
            frame = re.sub(r":\d+ ", " ", (res.get("tb") or "").split(" <- ")[0])
            sig = (cls, c.kind, c.field, res.get("exc", ""), frame)
            g = self.groups.setdefault(sig, {"n": 0, "example": None, "labels": Counter()})
            g["n"] += 1
            g["labels"][res.get("label", "?")] += 1
            if g["example"] is None:
                g["example"] = {"case": c.key(), **{k: res.get(k) for k in ("label", "stage", "detail", "tb", "msg")}}

    def violations(self) -> int:
        return sum(self.counts[k] for k in VIOLATIONS)


def select_cases(cases: list[S.Case], total: int, seed: int) -> list[S.Case]:
    """At most ``total`` cases: round robin over (kind, field), each field's distinct values
    first (at one target each), then the same values at further targets."""
    if len(cases) <= total:
        return list(cases)
    rng = random.Random(seed)
    groups: dict[tuple[str, str], list[S.Case]] = {}
    for c in cases:
        groups.setdefault((c.kind, c.field), []).append(c)
    queues = []
    for key in sorted(groups):
        by_value: dict[tuple[str, int], list[S.Case]] = {}
        for c in groups[key]:
            by_value.setdefault((c.golden, c.vi), []).append(c)
        for lst in by_value.values():
            rng.shuffle(lst)
        values = list(by_value.values())
        rng.shuffle(values)
        order: list[S.Case] = []
        depth = 0
        while True:
            layer = [lst[depth] for lst in values if depth < len(lst)]
            if not layer:
                break
            order += layer
            depth += 1
        queues.append(order)
    out: list[S.Case] = []
    pos = 0
    while len(out) < total:
        took = False
        for q in queues:
            if pos < len(q):
                out.append(q[pos])
                took = True
                if len(out) >= total:
                    break
        if not took:
            break
        pos += 1
    return out


def _drive(cases: list[S.Case], wdir: str, goldens: dict[str, str], canary: str, tally: D2Tally, lock: threading.Lock,
           *, timeout: float = CASE_TIMEOUT, controls: dict[int, str] | None = None) -> None:
    start = 0
    run = 0
    startup_failures = 0
    os.makedirs(wdir, exist_ok=True)
    while start < len(cases):
        run += 1
        files = wdir + f"-files{run}"
        os.makedirs(files, exist_ok=True)
        spec = {"work": wdir, "goldens": goldens, "canary": canary, "timeout": timeout,
                "errlog": os.path.join(files, "stderr.txt"), "cases": [list(c.key()) for c in cases[start:]],
                "controls": {str(j - start): a for j, a in (controls or {}).items() if j >= start}}
        spec_path = os.path.join(files, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("ARMDB_FAILPOINT", None)
        code = "import sys\nfrom tests.reliability.test_structured_mutation import worker_main\nworker_main(sys.argv[1])\n"
        with open(spec["errlog"], "a") as errf:
            p = subprocess.Popen([sys.executable, "-c", code, spec_path], stdout=subprocess.PIPE, stderr=errf,
                                 env=env, cwd=str(ROOT), text=True, preexec_fn=_limits)  # noqa: PLW1509
        with lock:
            tally.child_starts += 1
        last = [time.monotonic(), 0.0]  # last answer; answers so far (the first case waits for imports)
        killed = [False]

        def watchdog(p: subprocess.Popen[str] = p, last: list[float] = last, killed: list[bool] = killed) -> None:
            # A case past the bound: SIGABRT makes the child's faulthandler dump every
            # thread's stack (the head of the finding), then it dies; SIGKILL if it does not.
            while p.poll() is None:
                if time.monotonic() - last[0] > timeout + (20 if last[1] == 0 else 0):
                    killed[0] = True
                    with contextlib.suppress(OSError):
                        p.send_signal(signal.SIGABRT)
                    for _ in range(100):
                        if p.poll() is not None:
                            return
                        time.sleep(0.1)
                    p.kill()
                    return
                time.sleep(0.2)

        threading.Thread(target=watchdog, daemon=True).start()
        got = 0
        ready = False
        assert p.stdout is not None
        for line in p.stdout:
            last[0] = time.monotonic()
            last[1] += 1
            try:
                res = json.loads(line)
            except ValueError:
                continue  # a line cut by the child's death: its case is the culprit below
            if "ready" in res:
                ready = True
                continue
            with lock:
                tally.add(cases[start + res["i"]], res)
            got = res["i"] + 1
        p.stdout.close()
        rc = p.wait()
        if start + got >= len(cases):
            break
        with open(spec["errlog"], errors="replace") as f:
            err = f.read()
        if not ready:
            # It died before its first case (an import failed: the extension may be being
            # rebuilt in this working tree); no case is to blame.  Retry for a minute.
            startup_failures += 1
            if startup_failures > 20:
                raise AssertionError(f"d2 child cannot start: {err[-2000:]}")
            time.sleep(3)
            continue
        # The child died in case start + got: say how.
        culprit = cases[start + got]
        head = _fault_head(err)
        if killed[0] or "Timeout (" in err:
            cls, detail = "hangs", f"no answer within {timeout:.0f} s"
        elif rc == -signal.SIGXFSZ:
            cls, detail = "file_size", "killed by SIGXFSZ"
        elif rc < 0:
            cls, detail = "signals", f"killed by {signal.Signals(-rc).name}"
        else:
            cls, detail = "harness_errors", f"child exited with {rc}: {err[-400:]}"
        with lock:
            tally.add(culprit, {"v": [cls], "outcome": cls, "detail": detail, "tb": head, "exc": detail.split()[-1],
                                "label": _label(culprit, goldens)})
        start += got + 1


def _label(c: S.Case, goldens: dict[str, str]) -> str:
    w = GOLDEN_SPECS[c.golden][0]
    info = S.golden_info(c.golden, goldens[c.golden], dict(w.queues), list(w.maps))
    return S.CRAFTERS[c.kind].values(info, c.target, c.field)[c.vi][0]


def _fault_head(err: str) -> str:
    """The innermost frames of a faulthandler dump (the thread that faulted or hung)."""
    lines = [ln.strip() for ln in err.splitlines() if ln.strip().startswith("File ")]
    ours = [ln for ln in lines if "/armdb/" in ln] or lines
    return " <- ".join(re.sub(r'File "([^"]+)", line (\d+) in (\S+)', lambda m: f"{os.path.relpath(m.group(1), ROOT)}:{m.group(2)} {m.group(3)}", ln)
                       for ln in ours[:3])


def run_d2(total: int, seed: int, scratch: str) -> tuple[D2Tally, list[S.Case]]:
    t0 = time.monotonic()
    groot = os.path.join(scratch, "golden")
    goldens: dict[str, str] = {}
    cases: list[S.Case] = []
    for name in sorted(GOLDEN_SPECS):
        goldens[name] = build_d2_golden(name, groot)
        w = GOLDEN_SPECS[name][0]
        cases += S.enumerate_cases(S.golden_info(name, goldens[name], dict(w.queues), list(w.maps)))
    if ONLY:
        cases = [c for c in cases if f"{c.kind}.{c.field}" in ONLY or c.kind in ONLY]
    chosen = select_cases(cases, total, seed)
    random.Random(seed).shuffle(chosen)  # each child gets every kind
    tally = D2Tally()
    lock = threading.Lock()
    n = max(1, min(WORKERS, len(chosen)))
    errors: list[BaseException] = []

    def drive(k: int) -> None:
        try:
            _drive(chosen[k::n], os.path.join(scratch, f"w{k}"), goldens, goldens["fixed_queue"], tally, lock)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=drive, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    tally.seconds = time.monotonic() - t0
    return tally, cases


def coverage_table(t: D2Tally) -> tuple[str, list[tuple[str, str]]]:
    missing = [(k, f) for k, fs in S.FIELDS.items() for f in fs if not t.coverage[(k, f)]]
    lines = [f"  {k:16s} " + " ".join(f"{f}={t.coverage[(k, f)]}" for f in fs) for k, fs in S.FIELDS.items()]
    return "\n".join(lines), missing


_CHECK_OWNER = {"log": "armdb/check.py (_check_log_dir)", "fixed": "armdb/fixed.py (check_shard_file) and armdb/check.py",
                "redo": "armdb/fixed.py (check_shard_file) and armdb/check.py", "bitcask": "armdb/bitcask.py (check_dir)",
                "hint": "armdb/bitcask.py (check_dir)", "pending": "armdb/bitcask.py (check_dir)",
                "collection": "armdb/bitcask.py (check_dir)"}


def owner(sig: tuple[str, ...]) -> str:
    """The module that must fix a violation class: where it was raised, or for a check that
    passed what open refused, the check of that kind of file."""
    cls, kind, frame = sig[0], sig[1], sig[4]
    if cls == "check_ok_on_refused":
        return _CHECK_OWNER.get(kind.split("_")[0], "armdb/check.py")
    if cls == "silent_loss":
        return "armdb/bitcask.py (open: hints, compaction marker)"
    return frame.split(" ")[0].split(":")[0] if frame else "(no armdb frame)"


def findings_markdown(t: D2Tally, title: str) -> str:
    out = [f"# d2 structure-aware mutation: findings ({title})", "",
           f"crafted={t.crafted} seconds={t.seconds:.0f} " + " ".join(f"{k}={t.counts[k]}" for k in VIOLATIONS), "",
           "Violation classes, grouped by the module that must fix them; each class is (violation, kind.field, "
           "exception, innermost armdb frame) with its count, the values that hit it and one example.", ""]
    by_owner: dict[str, list[tuple[tuple[str, ...], dict[str, Any]]]] = {}
    for sig, g in t.groups.items():
        by_owner.setdefault(owner(sig), []).append((sig, g))
    for name in sorted(by_owner):
        out.append(f"## {name}")
        out.append("")
        for sig, g in sorted(by_owner[name], key=lambda x: (x[0][0], -x[1]["n"])):
            ex = g["example"]
            labels = ", ".join(f"{lab} x{n}" for lab, n in g["labels"].most_common(8))
            out.append(f"- **{sig[0]}** `{sig[1]}.{sig[2]}` {sig[3]} at `{sig[4] or '-'}`: {g['n']} case(s); values: {labels}")
            out.append(f"  - example {ex['case']}: value `{ex.get('label')}`, stage {ex.get('stage')}: {ex.get('detail')}")
            if ex.get("tb"):
                out.append(f"  - traceback head: `{ex['tb']}`")
        out.append("")
    return "\n".join(out)


_RUNS: list[D2Tally] = []


@pytest.fixture(scope="module", autouse=True)
def _summary(request: pytest.FixtureRequest):
    with quiet_armdb_log():
        yield
    if not _RUNS:
        return
    t = D2Tally()
    for r in _RUNS:
        t.crafted += r.crafted
        t.counts.update(r.counts)
        t.coverage.update(r.coverage)
        t.outcomes.update(r.outcomes)
        t.child_starts += r.child_starts
        t.slowest = max(t.slowest, r.slowest)
        t.peak_rss_mb = max(t.peak_rss_mb, r.peak_rss_mb)
        t.reported_loss += r.reported_loss
        t.seconds += r.seconds
    table, missing = coverage_table(t)
    capman = request.config.pluginmanager.get_plugin("capturemanager")
    with capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext():
        print(f"\nd2-mutation coverage (kind: field=crafted files), {len(missing)} field(s) never crafted:\n{table}")
    nfields = sum(len(fs) for fs in S.FIELDS.values())
    refused = sum(v for k, v in t.outcomes.items() if k.startswith("refused:"))
    line = (
        f"RELIABILITY d2-mutation crafted={t.crafted} kinds={len(S.FIELDS)} fields={nfields - len(missing)} "
        + " ".join(f"{k}={t.counts[k]}" for k in VIOLATIONS)
        + f" violations={t.violations()} served={t.outcomes['served']} refused={refused} "
        f"reported_loss={t.reported_loss} "
        f"fields_total={nfields} child_starts={t.child_starts} workers={WORKERS} slowest_case={t.slowest:.2f}s peak_rss_mb={t.peak_rss_mb} "
        f"seconds={t.seconds:.0f}"
    )
    report_line(line, request)


@pytest.fixture
def scratch() -> Any:
    d = fast_tmpdir("armdb-d2-")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _finish(t: D2Tally, what: str, *, min_crafted: int) -> None:
    _RUNS.append(t)
    table, missing = coverage_table(t)
    print(f"\n{what}: coverage (kind: field=crafted files)\n{table}")
    path = os.environ.get("ARMDB_D2_FINDINGS")
    if path:
        with open(path, "w") as f:
            f.write(findings_markdown(t, what) + "\n")
    if not ONLY:
        assert not missing, f"fields never crafted: {missing}"
        assert t.crafted >= min_crafted, f"only {t.crafted} crafted files (want >= {min_crafted})"
    n = t.violations()
    if n:
        groups = sorted(t.groups.items(), key=lambda x: -x[1]["n"])
        lines = "\n".join(
            f"  {g['n']} x {sig[0]} {sig[1]}.{sig[2]} {sig[3]} at {sig[4] or '-'}\n      e.g. value {g['example'].get('label')}: "
            f"{(g['example'].get('detail') or '')[:300]}" for sig, g in groups[:30]
        )
        pytest.fail(f"{what}: {n} violation(s) in {t.crafted} crafted files "
                    f"({ {k: t.counts[k] for k in VIOLATIONS if t.counts[k]} }), {len(groups)} classes:\n{lines}",
                    pytrace=False)


@pytest.mark.timeout(900)  # about 2 minutes on 2 idle cores; 4 on the shared machine
def test_d2_structured_mutation(scratch: str) -> None:
    """Every field of every file and record kind, set to boundary and hostile values and
    re-sealed: no signal, hang, runaway memory or file, write outside the directory,
    untyped exception, or check that passes what open refuses."""
    t, _cases = run_d2(CI_CASES, seed=14, scratch=scratch)
    _finish(t, "d2 structured mutation", min_crafted=min(CI_CASES, MIN_CI_CRAFTED))


@pytest.mark.slow
@pytest.mark.timeout(0)
def test_d2_structured_mutation_nightly(scratch: str) -> None:
    t, _cases = run_d2(NIGHTLY_CASES, seed=1414, scratch=scratch)
    _finish(t, "d2 structured mutation, nightly size", min_crafted=min(NIGHTLY_CASES, 40_000))


# ---------------------------------------------------------------------------------------------
# The crafter itself: a crafted file passes its integrity checks (else the harness would
# only test CRCs, like harness (d))
# ---------------------------------------------------------------------------------------------


def test_d2_crafted_files_pass_their_integrity_checks(scratch: str) -> None:
    import msgpack

    from armdb import fixed as _fixed
    from armdb._core import fixed as _k

    infos = {}
    cases: list[S.Case] = []
    for name in ("fixed_queue", "var_encrypted", "var_queue_rotated", "var_encrypted_rotated"):
        path = build_d2_golden(name, os.path.join(scratch, "golden"))
        w = GOLDEN_SPECS[name][0]
        infos[name] = S.golden_info(name, path, dict(w.queues), list(w.maps))
        cases += S.enumerate_cases(infos[name])

    def crafted(kind: str, fld: str, golden: str, label: str | None = None) -> tuple[S.Case, dict[str, bytes]]:
        for c in cases:
            if c.kind == kind and c.field == fld and c.golden == golden:
                lab, files = S.craft(infos[golden], c, "/nowhere")
                if label is None or lab == label:
                    return c, files
        raise AssertionError(f"no case {kind}.{fld} {label} in {golden}")

    # A Bitcask record with a new gsn, in an encrypted store: CRC and both tags hold.
    c, files = crafted("bitcask_record", "gsn", "var_encrypted", "0x1")
    rel, idx = S._split(c.target)
    raw = files[rel]
    salt, enc = S.salt_of(infos["var_encrypted"].root, S.coll_of(rel))
    assert enc
    r = S.parse_bitcask(raw)[idx]
    assert r.gsn_word & bitcask.SEQ_MASK == 1
    stored = bitcask.REC_HEAD.unpack_from(raw, r.off)[1]
    assert stored == bitcask._record_crc(raw[r.off :], 20 + len(r.key_field) + len(r.value_field))
    S._SEALER.open(r.key_field, S._aad(salt, b"K", r.gsn_word))
    S._SEALER.open(r.value_field, S._aad(salt, b"V", r.gsn_word))
    # A sealed log record whose row names a slot past the file: it parses, and it opens.
    c, files = crafted("log_record", "F.slot", "var_encrypted", str(2**31 - 1))
    recs, _end, bad = txlog.parse_records(files[infos["var_encrypted"].log_rel], txlog.RECORDS_START)
    assert bad is None and len(recs) == 1
    txid, flags, body = recs[0]
    info = infos["var_encrypted"]
    rows = msgpack.unpackb(S._LOG_SEALER.open(body, S._log_aad(info.log_version, info.db_id, txid)), raw=False)
    assert rows[0][3] == 2**31 - 1
    # A slot with crafted attempts validates as occupied.
    c, files = crafted("fixed_slot", "attempts", "fixed_queue", "0xffff")
    rel = c.target.split("#")[0]
    data = files[rel]
    ss = _fixed.decode_header(data[:4096], rel)[0]
    import numpy as np

    n = (len(data) - 4096) // ss
    slots = np.frombuffer(data, dtype=np.uint8, offset=4096, count=n * ss).reshape(n, ss).copy()
    status = np.zeros(n, dtype=np.uint8)
    _k.validate(slots, np.zeros(n, dtype=np.uint32), status)
    assert status[int(c.target.split("#")[1])] == _fixed.OCCUPIED
    # Meta files with crafted content pass their CRC layer (checked here by the layout of
    # docs/format.md, not by the decoders, which judge the content).
    def framed_ok(raw: bytes) -> bool:
        n = struct.unpack_from("<I", raw, 12)[0]
        return struct.unpack_from("<I", raw, 16 + n)[0] == S._crc(raw[: 16 + n])

    _c, files = crafted("queue_meta", "shard_count", "fixed_queue", "0")
    raw = next(iter(files.values()))
    assert framed_ok(raw) and msgpack.unpackb(raw[16:-4])["shard_count"] == 0
    _c, files = crafted("seqmap", "value", "fixed_queue", str(2**63 - 1))
    assert framed_ok(files["seqmap"]) and 2**63 - 1 in msgpack.unpackb(files["seqmap"][16:-4]).values()
    _c, files = crafted("db_meta", "version", "fixed_queue", "0x0")
    assert struct.unpack_from("<II", files["db.meta"], 8) == (0, S._crc(files["db.meta"][:12]))
    for kind, fld, golden, label in (("pending", "fid", "var_queue_rotated", "all"),
                                     ("collection_meta", "shard_count", "var_queue_rotated", "0x80")):
        _c, files = crafted(kind, fld, golden, label)
        raw = next(iter(files.values()))
        assert struct.unpack_from("<I", raw, len(raw) - 4)[0] == S._crc(raw[:-4]), kind
    assert bitcask.META_HEAD.unpack_from(raw)[3] == 128
    # A hint entry with a crafted offset keeps valid trailer CRCs.
    c, files = crafted("hint_entry", "offset", "var_queue_rotated", "0x0")
    hraw = next(iter(files.values()))
    _m, _size, count, ecrc, tcrc = bitcask.HINT_TRAILER.unpack_from(hraw, len(hraw) - 32)
    assert ecrc == S._crc(hraw[32:-32]) and tcrc == S._crc(hraw[-32:-4])
    # An encrypted store's hint: an entry given another record's (sealed) key keeps valid CRCs.
    c, files = crafted("hint_entry", "key", "var_encrypted_rotated", "other0")
    hraw = next(iter(files.values()))
    assert S._crc(hraw[32:-32]) == bitcask.HINT_TRAILER.unpack_from(hraw, len(hraw) - 32)[3]
    # A synced mark's crafted cell keeps a valid CRC, bound to the same file as before.
    c, files = crafted("synced_mark", "mark", "var_queue_rotated", "0x7fff")
    rel, cell = S._split(c.target)
    raw = files[rel]
    at = 32 + 16 * cell  # the file's own mark area
    assert struct.unpack_from("<QII", raw, at)[0] == 0x7FFF
    assert struct.unpack_from("<I", raw, at + 12)[0] == S._crc(raw[at : at + 12] + S._digest8(raw[:32]))
    # The redo record: valid, naming the crafted slot, with the original slot torn.
    c, files = crafted("redo", "rec_slot", "fixed_queue", "0x1")
    redo = next(v for k, v in files.items() if k.endswith("fixed.redo"))
    ss = _fixed.decode_header(files[c.target.replace("fixed.redo", "fixed.data")][:4096], "d")[0]
    assert _k.redo_record(np.frombuffer(redo, dtype=np.uint8), ss)[0] == 1


def test_d2_detectors_fire(scratch: str) -> None:
    """The harness's own controls: a child that segfaults, a case that hangs and a write
    beside the database are each counted once, and the cases after them still run."""
    g = build_golden("fixed_queue", os.path.join(scratch, "golden"))
    w = GOLDEN_SPECS["fixed_queue"][0]
    info = S.golden_info("fixed_queue", g.path, dict(w.queues), list(w.maps))
    cases = [c for c in S.enumerate_cases(info) if c.kind == "db_meta"][:7]
    tally = D2Tally()
    _drive(cases, os.path.join(scratch, "w"), {"fixed_queue": g.path}, g.path, tally, threading.Lock(),
           timeout=2.0, controls={1: "segv", 3: "hang", 5: "outside"})
    assert tally.crafted == 7
    assert (tally.counts["signals"], tally.counts["hangs"], tally.counts["outside_writes"]) == (1, 1, 1), tally.counts
    sig = next(s for s in tally.groups if s[0] == "signals")
    assert "SIGSEGV" in sig[3], sig
    assert tally.outcomes["served"] + sum(v for k, v in tally.outcomes.items() if k.startswith("refused:")) == 5
