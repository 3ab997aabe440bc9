"""Harness (c): an I/O error at call k, for every k (docs/reliability.md, (c); SPEC S12 and section 6).

For each short workload x {once, persistent} x {EIO, ENOSPC}: a dry run on
:class:`~tests.reliability.faultfs.FaultFS` counts the K storage calls the workload
makes (open, pwrite, fsync/fdatasync/msync/directory fsync, ftruncate, fallocate
(block allocation when a mapped file is created or grows), rename, unlink, mkdir,
mmap) and records the state after every operation.  Then, for every
k in 1..K, the workload runs again from the same base with ``OSError(errno)``
injected at call k (and, in persistent mode, at every later call; every second k
also writes half of a failing ``pwrite`` first, or extends the file by half of a
failing ``fallocate``).  The first operation that raises
ends the workload.  Checked:

* the error is an ``armdb.errors`` class, never a bare ``OSError``, ``IndexError``,
  ``struct.error`` ... (E: "each message says what happened");
* nothing half-written is visible in the process: the state read right after the
  failure is the state before or after the failed operation;
* S12: after a failed sync, a write to the collection whose file failed to sync
  raises ``StorageError`` (never retried), and reads keep working;
* after a failed append or a failed block allocation (a full disk), the collection
  stays writable: once the disk has room again a write to it succeeds;
* no file descriptor leaks (``/proc/self/fd`` before and after open + workload + close,
  the SQLite leak check);
* reopening with the real file system shows the state before or after the failed
  operation (no committed data lost, no half-written row), and ``armdb.check`` is clean.

A read-fault pass (EIO on ``pread``) checks that read errors surface as
``armdb.errors`` too.  One summary line ``RELIABILITY faults ...`` is printed and
appended to ``$ARMDB_RELIABILITY_REPORT``; K per workload is in it.
"""

from __future__ import annotations

import contextlib
import errno
import faulthandler
import gc
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import armdb
from armdb import _fs
from armdb.errors import ArmdbError, DbClosed, StorageError, TxFailedAfterLog

from .bcd_workloads import Session, World, describe_state, fast_tmpdir, judge
from .faultfs import FaultFS, fd_count
from .journal import quiet_armdb_log, report_line

ROOT = Path(__file__).resolve().parents[2]
CASE_TIMEOUT = 60.0  # seconds per injected run before the watchdog dumps stacks and exits


# ---------------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------------

FIXED = World(queues=(("fq", False),), durable=True)
VAR = World(queues=(("vq", True),), durable=True)
VAR_ENC = World(queues=(("vq", True),), durable=True, encrypted=True)
OUTBOX = World(queues=(("vq", True),), maps=("m",), durable=True)
MAP = World(queues=(), maps=("m",), durable=True, value_size=6000)
GROW = World(queues=(("fq", False),), durable=True, grow_step=2)
VAR_DEFAULT = World(queues=(("vq", True),), durable=False)


@dataclass(frozen=True)
class Workload:
    world: World
    ops: tuple[str, ...]
    base_ops: tuple[str, ...] = ()  # run (cleanly) to build the base directory
    base_crash: str | None = None  # failpoint for a child that leaves an unapplied log record


WORKLOADS: dict[str, Workload] = {
    "create": Workload(OUTBOX, ()),
    "fixed_cycle": Workload(
        FIXED,
        ("push:fq", "push:fq", "lease:fq", "ack:fq", "lease:fq", "nack:fq", "lease:fq", "dead:fq"),
        base_ops=("push:fq",),
    ),
    "var_cycle": Workload(
        VAR,
        ("push:vq", "push:vq", "lease:vq", "ack:vq", "lease:vq", "nack:vq", "lease:vq", "dead:vq"),
        base_ops=("push:vq",),
    ),
    "var_encrypted": Workload(
        VAR_ENC, ("push:vq", "lease:vq", "ack:vq", "lease:vq", "nack:vq"), base_ops=("push:vq",)
    ),
    "tx_outbox": Workload(
        OUTBOX, ("outbox:vq:m", "outbox:vq:m", "lease:vq", "tx:vq", "put:m"), base_ops=("push:vq",)
    ),
    "map_rotation": Workload(MAP, ("put:m",) * 14 + ("del:m", "put:m")),
    "grow": Workload(GROW, ("push:fq",) * 5 + ("lease:fq", "ack:fq")),
    "recovery": Workload(
        VAR, ("lease:vq", "ack:vq"), base_ops=("push:vq", "push:vq"), base_crash="txlog.after_append"
    ),
    "var_default": Workload(VAR_DEFAULT, ("push:vq", "lease:vq", "ack:vq", "push:vq"), base_ops=("push:vq",)),
}

READ_FAULT_WORKLOADS = ("recovery", "var_cycle", "map_rotation")


def build_base(name: str, wl: Workload, root: str) -> str:
    """A closed database directory the workload starts from (``root/db``)."""
    base = os.path.join(root, f"base-{name}")
    db = os.path.join(base, "db")
    os.makedirs(db)
    if wl.base_ops or wl.base_crash:
        s = Session(wl.world, db).open()
        for op in wl.base_ops:
            s.run(op)
        s.close()
    if wl.base_crash:
        # A child leases and acks (a var ack is one log commit) and exits right after the
        # log append: the base then holds a logged, unapplied transaction to replay.
        code = (
            f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
            "from tests.reliability.bcd_workloads import Session, World\n"
            f"w = World(**{_world_kwargs(wl.world)!r})\n"
            f"s = Session(w, {db!r}).open(); s.run('lease:vq'); s.run('ack:vq')\n"
        )
        env = dict(os.environ, ARMDB_FAILPOINT=f"{wl.base_crash}", PYTHONPATH=str(ROOT))
        r = subprocess.run(
            [sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 86, (
            f"the base child did not stop at {wl.base_crash}: {r.returncode} {r.stderr}"
        )
    return base


def _world_kwargs(w: World) -> dict[str, Any]:
    return {k: getattr(w, k) for k in w.__dataclass_fields__}


# ---------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------


@dataclass
class RunResult:
    states: list[Any]  # state after each op returned (index 0: after open)
    failed_op: int | None = None  # index into ["open", *ops, "close"]
    error: BaseException | None = None
    violations: list[tuple[str, str]] = field(default_factory=list)
    fired: list[tuple[int, str, str]] = field(default_factory=list)
    count: int = 0


def _sync_target(fs: FaultFS) -> str | None:
    """The path whose sync failed first, if the first fault was a sync."""
    if not fs.fired or fs.fired[0][1] != "sync":
        return None
    return fs.fired[0][2]


def run_workload(wl: Workload, db_path: str, fs: FaultFS | None, *, probe: bool = True) -> RunResult:
    """Run open + ops + close under ``fs`` (None: the real FS); stop at the first error."""
    seq = ["open", *wl.ops, "close"]
    res = RunResult(states=[])
    sess = Session(wl.world, db_path)
    ctx = _fs.use(fs) if fs is not None else _null()
    with ctx:
        for i, op in enumerate(seq):
            try:
                if op == "open":
                    sess.open()
                elif op == "close":
                    sess.close()
                else:
                    sess.run(op)
                if op != "close":
                    # Observing is reading: under read faults it may fail too (typed).
                    res.states.append(sess.capture())
            except ArmdbError as e:
                res.failed_op, res.error = i, _detach(e)
                break
            except Exception as e:  # noqa: BLE001 - exactly what the harness looks for
                where = _origin(e)
                res.failed_op, res.error = i, _detach(e)
                res.violations.append(("untyped_exception", f"{op}: {type(e).__name__} from {where}: {e}"))
                break
        if res.failed_op is not None and sess.db is not None:
            _after_failure(wl, sess, fs, res)
        if sess.db is not None:
            try:
                sess.close()
            except ArmdbError:
                pass
            except Exception as e:  # noqa: BLE001
                res.violations.append(
                    ("untyped_exception", f"close after failure: {type(e).__name__} from {_origin(e)}: {e}")
                )
                db = sess.db
                if db is not None:  # best effort, so one broken run cannot leak into the next
                    with contextlib.suppress(Exception):
                        db.close()
    if fs is not None:
        res.fired = list(fs.fired)
        res.count = fs.count
    return res


def _origin(e: BaseException) -> str:
    """The innermost armdb frame that let ``e`` escape (``module.function``)."""
    import traceback

    frames = [
        f
        for f in traceback.extract_tb(e.__traceback__)
        if f"{os.sep}armdb{os.sep}" in f.filename and f"{os.sep}_fs.py" not in f.filename
    ]
    if not frames:
        return "?"
    f = frames[-1]
    return f"{os.path.basename(f.filename)[:-3]}.{f.name}"


def _detach(e: BaseException) -> BaseException:
    """Drop the tracebacks of an exception chain: frames keep mapped files (and their
    descriptors) alive, which would look like a descriptor leak."""
    x: BaseException | None = e
    while x is not None:
        x.__traceback__ = None
        x = x.__cause__ or x.__context__
    return e


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


def _after_failure(wl: Workload, sess: Session, fs: FaultFS | None, res: RunResult) -> None:
    """In-process checks right after a failed operation: reads work and show no half-done
    operation; after a failed sync the collection refuses writes (S12)."""
    i = res.failed_op
    assert i is not None
    try:
        got = sess.capture()
    except ArmdbError as e:
        if not (fs is not None and fs.persistent and "read" in fs.kinds):
            res.violations.append(("reads_fail_after_error", f"{type(e).__name__}: {e}"))
        got = None
    except Exception as e:  # noqa: BLE001
        res.violations.append(("untyped_exception", f"read after failure: {type(e).__name__}: {e}"))
        got = None
    res.inproc = got  # type: ignore[attr-defined]
    if fs is None:
        return
    if not fs.persistent and fs.first_kind in ("write", "alloc") and isinstance(res.error, StorageError):
        _retry_probe(wl, sess, fs, res)
        return
    target = _sync_target(fs)
    if target is None or not isinstance(res.error, StorageError):
        return
    probe = _probe_for(wl, target)
    if probe is None:
        return
    fs.active = False  # the disk is fine again: only poisoning may refuse the write now
    try:
        sess.run(probe)
    except StorageError:
        pass
    except ArmdbError as e:
        if not isinstance(e, DbClosed):
            res.violations.append(
                ("s12_wrong_error", f"{probe} after a failed sync of {target}: {type(e).__name__}: {e}")
            )
    except Exception as e:  # noqa: BLE001
        res.violations.append(("untyped_exception", f"S12 probe {probe}: {type(e).__name__}: {e}"))
    else:
        res.violations.append(
            ("s12_write_after_failed_sync", f"{probe} succeeded after a failed sync of {target}")
        )
    finally:
        fs.active = True


PROBE_KEY = b"probe-after-enospc"


def _retry_probe(wl: Workload, sess: Session, fs: FaultFS, res: RunResult) -> None:
    """A failed append is undone and the store stays writable (docs/format.md,
    Writing, rotation and sync), and so does a failed allocation of a growing header file
    (docs/format.md, Size and growth): once the disk has room again, a write to the
    same collection succeeds.  The probe's row or key is ignored when the state is judged."""
    path = fs.fired[0][2]
    target = fs.paths.get(int(path)) if path.isdigit() else None
    if target is None or "collections" not in target.split(os.sep):
        return
    parts = target.split(os.sep)
    coll = parts[parts.index("collections") + 1]
    qname = coll.removesuffix(".payload")
    fs.active = False
    try:
        if qname in dict(wl.world.queues):
            res.probe_id = sess.run(f"push:{qname}")  # type: ignore[attr-defined]
        elif qname in wl.world.maps:
            sess.maps[qname].put(PROBE_KEY, b"probe")
    except ArmdbError as e:
        res.violations.append(
            (
                "unwritable_after_failed_append",
                f"a write to {coll} after a failed append ({res.error!r}) raised {type(e).__name__}: {e}",
            )
        )
    except Exception as e:  # noqa: BLE001
        res.violations.append(
            ("untyped_exception", f"retry probe on {coll}: {type(e).__name__} from {_origin(e)}: {e}")
        )
    finally:
        fs.active = True


def _without_probe(state: Any, res: RunResult) -> Any:
    pid = getattr(res, "probe_id", None)
    out = []
    for name, rows in state:
        rows = tuple(
            r for r in rows if not (len(r) == 8 and r[0] == pid) and not (len(r) == 2 and r[0] == PROBE_KEY)
        )
        out.append((name, rows))
    return tuple(out)


def _probe_for(wl: Workload, target: str) -> str | None:
    """A write that must be refused after a failed sync of ``target`` (S12)."""
    parts = target.split(os.sep)
    if "collections" not in parts:
        return None  # txlog, seqmap, db.meta: no collection-level promise to probe
    coll = parts[parts.index("collections") + 1] if len(parts) > parts.index("collections") + 1 else ""
    if coll.endswith(".tmp") or coll == "":
        return None
    qname = coll.removesuffix(".payload")
    for name, _var in wl.world.queues:
        if name == qname:
            return f"push:{name}"  # writes the body (var) and the header: refused if either store is poisoned
    if qname in wl.world.maps:
        return f"put:{qname}"
    return None


# ---------------------------------------------------------------------------------------------
# The every-k loop
# ---------------------------------------------------------------------------------------------


@dataclass
class FaultTally:
    runs: int = 0
    fired: int = 0
    violations: Counter = field(default_factory=Counter)
    untyped: int = 0
    fd_leaks: int = 0
    k_per_workload: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)
    signatures: Counter = field(default_factory=Counter)
    sig_example: dict = field(default_factory=dict)
    error_classes: Counter = field(default_factory=Counter)

    def add(self, cls: str, msg: str) -> None:
        self.violations[cls] += 1
        if cls == "untyped_exception":
            self.untyped += 1
        if cls == "fd_leak":
            self.fd_leaks += 1
        sig = cls + ": " + _blank(msg)
        self.signatures[sig] += 1
        self.sig_example.setdefault(sig, msg)

    def merge(self, o: FaultTally) -> None:
        self.runs += o.runs
        self.fired += o.fired
        self.violations.update(o.violations)
        self.untyped += o.untyped
        self.fd_leaks += o.fd_leaks
        self.k_per_workload.update(o.k_per_workload)
        self.signatures.update(o.signatures)
        for k, v in o.sig_example.items():
            self.sig_example.setdefault(k, v)
        self.error_classes.update(o.error_classes)


def _blank(msg: str) -> str:
    import re

    text = re.sub(r"\(injected at call [^)]*\)\)?", "", msg.split(" | ")[0])
    text = re.sub(r"/\S+/(db/)?", "", text)
    text = re.sub(r"\[[a-z_]+ (once|persistent) [A-Z]+ k=\d+/\d+ ", "[", text)
    text = re.sub(r"\d+", "#", text)
    return text[:170]


def every_k(
    name: str,
    scratch: str,
    *,
    err: int,
    persistent: bool,
    kinds: frozenset[str] | None = None,
    partial: bool = True,
    limit: int | None = None,
) -> FaultTally:
    wl = WORKLOADS[name]
    t = FaultTally()
    base = build_base(name, wl, scratch)
    # Dry run: count the calls and record the state after every operation.
    d0 = os.path.join(scratch, "dry")
    shutil.copytree(base, d0)
    counter = FaultFS(0, kinds=kinds)
    dry = run_workload(wl, os.path.join(d0, "db"), counter)
    assert dry.failed_op is None, f"dry run of {name} failed: {dry.error!r}"
    K = counter.count
    t.k_per_workload[name if kinds is None else f"{name}/{'+'.join(sorted(kinds))}"] = K
    states = [dry.states[0], *dry.states]  # [before open, after open, after op1, ...]
    states.append(states[-1])  # after close
    shutil.rmtree(d0)
    mode = f"{'persistent' if persistent else 'once'} {errno.errorcode[err]}"
    gc.collect()
    gc.freeze()  # later collections scan only new objects: ~1 ms instead of ~40 ms
    baseline = fd_count()
    try:
        _loop(t, wl, name, base, states, K, mode, err, persistent, kinds, partial, limit, scratch, baseline)
    finally:
        gc.unfreeze()
    return t


def _loop(
    t: FaultTally,
    wl: Workload,
    name: str,
    base: str,
    states: list[Any],
    K: int,
    mode: str,
    err: int,
    persistent: bool,
    kinds: frozenset[str] | None,
    partial: bool,
    limit: int | None,
    scratch: str,
    baseline: int,
) -> None:
    k = 0
    while True:
        k += 1
        if limit is not None and k > limit:
            break
        d = os.path.join(scratch, f"k{k}")
        shutil.copytree(base, d)
        fs = FaultFS(k, err=err, persistent=persistent, kinds=kinds, partial=partial and k % 2 == 0)
        fd0 = fd_count()
        if fd0 != baseline:  # garbage of an earlier run still holds a mapped file
            gc.collect()
            fd0 = baseline = fd_count()
        faulthandler.dump_traceback_later(CASE_TIMEOUT, exit=True)
        try:
            res = run_workload(wl, os.path.join(d, "db"), fs)
        finally:
            faulthandler.cancel_dump_traceback_later()
        fd1 = fd_count()
        if fd1 != fd0:  # frames and cycles keep maps (and their descriptors) alive until collected
            gc.collect()
            fd1 = fd_count()
        baseline = fd1
        t.runs += 1
        where = f"[{name} {mode} k={k}/{K} fault {res.fired[:1]}]"
        if not res.fired:
            shutil.rmtree(d)
            if k > K:
                break  # the workload completed without reaching call k: every k was covered
            continue
        t.fired += 1
        if res.error is not None:
            t.error_classes[type(res.error).__name__] += 1
        for cls, msg in res.violations:
            t.add(cls, f"{where} {msg}")
        if fd1 > fd0:
            t.add("fd_leak", f"{where} {fd1 - fd0} descriptor(s) left open (error {res.error!r})")
        fi = res.failed_op
        # States the failed run may show: before or after the failed op (index fi in seq).
        if fi is None:
            lo, hi = len(states) - 1, len(states) - 1
        else:
            lo, hi = fi, fi + 1
        after_log = isinstance(res.error, TxFailedAfterLog)
        if after_log:
            lo = hi  # T2: the commit is logged; the next open must finish it
        inproc = getattr(res, "inproc", None)
        if inproc is not None:
            inproc = _without_probe(inproc, res)
            # After TxFailedAfterLog the process may show a partly applied commit (T2: the
            # next open finishes it), but every row it shows must be whole (E).
            cls, detail = judge(inproc, states, fi if after_log else lo, hi, exact=not after_log)
            if cls != "ok":
                t.add(
                    "visible_" + cls,
                    f"{where} in process after {res.error!r}: {detail}; got {describe_state(inproc)}",
                )
        # Reopen on the real file system.
        sess = Session(wl.world, os.path.join(d, "db"))
        try:
            sess.open()
            got = sess.capture()
            sess.close()
        except ArmdbError as e:
            t.add("reopen_raised", f"{where} {type(e).__name__}: {e}")
            got = None
        except Exception as e:  # noqa: BLE001
            t.add("untyped_exception", f"{where} reopen: {type(e).__name__}: {e}")
            got = None
        finally:
            if sess.db is not None:
                with contextlib.suppress(Exception):
                    sess.db.close()
        if got is not None:
            got = _without_probe(got, res)
            cls, detail = judge(got, states, lo, hi, exact=True)
            if cls != "ok":
                t.add("reopen_" + cls, f"{where} after {res.error!r}: {detail}; got {describe_state(got)}")
            rep = armdb.check(os.path.join(d, "db"))
            if not rep.ok:
                t.add("check_findings", f"{where} {'; '.join(rep.findings[:2])}")
        shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------

_TOTAL = FaultTally()


@pytest.fixture(scope="module", autouse=True)
def _summary(request: pytest.FixtureRequest):
    t0 = time.monotonic()
    with quiet_armdb_log():
        yield
    v = _TOTAL
    ks = ",".join(f"{k}:{n}" for k, n in sorted(v.k_per_workload.items()))
    line = (
        f"RELIABILITY faults states=0 faults={v.fired} mutations=0 violations={sum(v.violations.values())} "
        f"untyped_exceptions={v.untyped} fd_leaks={v.fd_leaks} runs={v.runs} K={{{ks}}} "
        f"by_class={dict(v.violations) or '{}'} errors={dict(v.error_classes)} seconds={time.monotonic() - t0:.0f}"
    )
    report_line(line, request)


@pytest.fixture
def scratch() -> Any:
    d = fast_tmpdir("armdb-faults-")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _finish(t: FaultTally, what: str) -> None:
    _TOTAL.merge(t)
    n = sum(t.violations.values())
    if n:
        lines = "\n".join(
            f"  {c} x {sig}\n      e.g. {t.sig_example[sig][:600]}" for sig, c in t.signatures.most_common(12)
        )
        pytest.fail(
            f"{what}: {n} violation(s) in {t.fired} injected faults ({dict(t.violations)}), grouped:\n{lines}",
            pytrace=False,
        )


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC], ids=["EIO", "ENOSPC"])
@pytest.mark.parametrize("persistent", [False, True], ids=["once", "persistent"])
@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_fault_every_k(name: str, persistent: bool, err: int, scratch: str) -> None:
    """Every k of one workload: typed errors, S12 poisoning, no fd leak, clean reopen."""
    t = every_k(name, scratch, err=err, persistent=persistent)
    _finish(
        t, f"I/O faults, workload {name}, {'persistent' if persistent else 'once'} {errno.errorcode[err]}"
    )


@pytest.mark.parametrize("name", READ_FAULT_WORKLOADS)
def test_read_fault_every_k(name: str, scratch: str) -> None:
    """EIO on the k-th ``pread``: a read error surfaces as an armdb error, never as wrong data."""
    t = every_k(name, scratch, err=errno.EIO, persistent=False, kinds=frozenset({"read"}), partial=False)
    _finish(t, f"read faults, workload {name}")


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind", ["write", "sync", "trunc", "alloc", "rename", "unlink", "mkdir", "mmap", "open", "read"]
)
def test_fault_every_k_per_kind_nightly(kind: str, scratch: str) -> None:
    """Nightly: every k counted over one kind only, persistent, for every workload."""
    total = FaultTally()
    for name in sorted(WORKLOADS):
        sub = os.path.join(scratch, name)
        os.makedirs(sub)
        for persistent in (False, True):
            total.merge(every_k(name, sub, err=errno.EIO, persistent=persistent, kinds=frozenset({kind})))
            shutil.rmtree(sub)
            os.makedirs(sub)
    _finish(total, f"I/O faults on {kind} only, persistent")


# ---------------------------------------------------------------------------------------------
# Regressions: one deterministic fault per bug the every-k loop found (kept forever)
# ---------------------------------------------------------------------------------------------


def _first_kind_fault_in_open(kind: str, path: str) -> BaseException | None:
    """Open a fresh database with one var queue, failing the first ``kind`` call."""
    fs = FaultFS(1, kinds=frozenset({kind}))
    with _fs.use(fs):
        try:
            Session(VAR, path).open().close()
        except BaseException as e:  # noqa: BLE001 - returned for the assertion
            return _detach(e)
    return None


@pytest.mark.parametrize("kind", ["open", "write", "sync", "trunc", "alloc", "mkdir", "mmap", "unlink"])
def test_e_io_error_while_opening_is_a_storage_error(kind: str, scratch: str) -> None:
    """E/S12: an I/O error while opening a database or a queue surfaces as
    ``armdb.errors.StorageError`` (an ``OSError`` subclass), never as a bare ``OSError``."""
    base = os.path.join(scratch, "db")
    if kind == "unlink":
        armdb.Db.open(base).close()  # the second open unlinks the previous log file
    err = _first_kind_fault_in_open(kind, base)
    assert err is not None, f"no {kind} call was made"
    assert isinstance(err, ArmdbError), f"{type(err).__name__} from the first failing {kind}: {err}"


def test_s12_failed_msync_while_growing_is_typed_and_poisons(scratch: str) -> None:
    """S12/E: growing a FixedStore msyncs the old map first.  A failure there must raise
    StorageError and poison the shard like any other failed sync."""
    d = os.path.join(scratch, "db")
    s = Session(GROW, d).open()
    s.run("push:fq")
    s.run("push:fq")  # the grow step (2 slots) is full now
    fs = FaultFS(1, kinds=frozenset({"sync"}))
    with _fs.use(fs), pytest.raises(StorageError):
        s.run("push:fq")  # grow: flush the old map -> injected EIO
    assert fs.fired, "the push did not grow the store"
    with pytest.raises(StorageError):
        s.run("push:fq")  # S12: refused until reopen
    s.close()


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO], ids=["ENOSPC", "EIO"])
def test_s2_failed_allocation_while_growing_is_typed_and_keeps_the_store_usable(err: int, scratch: str) -> None:
    """Growing a header file allocates its new blocks (fallocate) before mapping them,
    so that a full disk is an error and not a SIGBUS.  A failed allocation raises
    StorageError (saying the disk is full for ENOSPC), poisons nothing: the rows
    already stored keep leasing and acking, and the next push grows the file once
    the disk has room."""
    d = os.path.join(scratch, "db")
    s = Session(GROW, d).open()
    try:
        s.run("push:fq")
        s.run("push:fq")  # the grow step (2 slots) is full now
        fs = FaultFS(1, err=err, kinds=frozenset({"alloc"}), partial=True)
        with _fs.use(fs), pytest.raises(StorageError) as info:
            s.run("push:fq")
        assert fs.fired, "the push did not grow the store"
        if err == errno.ENOSPC:
            assert "the disk is full" in str(info.value), info.value
        shard = s.queues["fq"]._headers.shards[0]
        assert os.path.getsize(shard.path) == 4096 + 2 * shard.slot_size, "the failed growth was not undone"
        assert s.run("lease:fq") and s.run("ack:fq") is not None
        s.run("push:fq")  # the disk has room again: this push grows the file
        s.run("push:fq")
        assert len(s.capture()[0][1]) == 3
    finally:
        s.close()
    assert armdb.check(d).ok


def test_e_txlog_start_file_failure_leaks_no_descriptor(scratch: str) -> None:
    """E: opening a database starts a new log file, then unlinks the old one.  When the
    unlink (or the directory fsync after it) fails, the new file's descriptor must be
    closed with the failed open."""
    d = os.path.join(scratch, "db")
    armdb.Db.open(d).close()
    gc.collect()
    before = fd_count()
    for kind in ("unlink", "sync"):
        fs = FaultFS(1, kinds=frozenset({kind}))
        if kind == "sync":
            fs = FaultFS(3, kinds=frozenset({"sync"}))  # new log: fsync, dir fsync; after unlink: dir fsync
        with _fs.use(fs):
            try:
                armdb.Db.open(d).close()
            except OSError:
                pass
        assert fs.fired
    gc.collect()
    assert fd_count() == before, "a failed Db.open left descriptors open"


def test_t2_replay_failure_leaks_no_descriptor(scratch: str) -> None:
    """T2/E: when replaying a logged commit at open fails (here the msync of the replayed
    slot), every store the replay opened must still be closed."""
    base = build_base("recovery", WORKLOADS["recovery"], scratch)
    d = os.path.join(base, "db")
    gc.collect()
    before = fd_count()
    fs = FaultFS(1, kinds=frozenset({"sync"}))
    with _fs.use(fs), pytest.raises(ArmdbError):
        armdb.Db.open(d, clock=lambda: 1_700_000_000_000, tx_config=VAR.tx_config())
    gc.collect()
    assert fd_count() == before, "the failed replay left descriptors open"


def test_s12_failed_sync_of_an_ack_leaves_a_consistent_view(scratch: str) -> None:
    """S12/E: an ack whose msync fails raises StorageError; the write "stays visible until
    the reopen", so the process must show the row either acked or still leased, never as
    a READY row with a zeroed header and payload (today the slot is freed but the index
    still lists the row)."""
    d = os.path.join(scratch, "db")
    s = Session(FIXED, d).open()
    s.run("push:fq")
    s.run("lease:fq")
    fs = FaultFS(1, kinds=frozenset({"sync"}))
    with _fs.use(fs), pytest.raises(StorageError):
        s.run("ack:fq")
    q = s.queues["fq"]
    snap = q.snapshot()
    try:
        assert len(snap) == 0 or (int(snap["state"][0]) == 1 and int(snap["attempts"][0]) == 1), (
            f"after the failed ack the process shows {snap.tolist()} (len()={q.len()})"
        )
    finally:
        s.close()
