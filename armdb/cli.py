"""The ``python -m armdb`` command line (SPEC C1-C3).

``demo``
    A small producer/worker pipeline on a fresh directory (C1).
``stats DIR``
    Read-only statistics of every queue in a database that is not open elsewhere (C2).
``bench``
    armdb's queue benchmarks beside SQLite-based peers, in one run (C3); the
    workloads live in :mod:`armdb._bench`.
``serve DIR``
    Open the database and serve it to other processes until SIGINT/SIGTERM (C5, P1).
``work DIR module:function [-p N] [--batch B] [--threads T] [--queue NAME]``
    Run :class:`armdb.Worker` over a queue the module declares (C5, P6).
``salvage DIR [--dry-run]``
    Cut the files that open refuses under S7 at their bad record
    (:func:`armdb.salvage`; docs/operations.md).
``check DIR``
    :func:`armdb.check`; exit 0 when clean, 1 with findings, 2 when it cannot inspect.

``stats``, ``check`` and ``salvage`` take ``--key-file PATH`` (repeatable: the keys of
encrypted collections) and ``--log-key-file PATH`` (the transaction log key; by default
whichever ``--key-file`` key is the log's), read by :func:`armdb.dbkeys.read_key_file`.
A key file that cannot be read or holds no key, and a key that opens nothing, end the
command with exit status 2 before anything is read or changed (C4).

This is the one module of the package that prints: it is the user interface.
Progress bars go to stderr, results to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from . import _bench, _fs
from ._term import ProgressBar, format_table
from ._version import __version__
from .check import _check
from .client import Client
from .config import QueueConfig, TxConfig
from .db import Db
from .dbkeys import key_file_warning, read_key_file, resolve_keys
from .errors import (
    ArmdbError,
    ConfigError,
    DbLocked,
    EncryptionKeyRequired,
    KeyFileError,
    ServerGone,
    WrongKey,
)
from .inspect import QueueFileStats, inspect_queue, queue_names
from .layout import META_FILE, DirLock
from .qspec import QueueSpec, queue
from .queue import Queue, QueueStats
from .salvage import _salvage
from .worker import Worker

__all__ = ["ProgressBar", "QueueFileStats", "format_stats", "format_table", "inspect_queue", "main", "run_demo"]


def format_stats(stats: QueueStats) -> str:
    """A :class:`QueueStats` as a two-column aligned table (the text form of ``_repr_html_``)."""
    rows = [(k, v) for k, v in stats.to_dict().items() if k != "name"]
    return f"queue {stats.name}\n" + format_table(("stat", "value"), rows)


# -- demo (C1) ---------------------------------------------------------------------------------


@dataclass
class DemoJob:
    """The demo's payload: a document to index."""

    doc_id: int
    text: str
    poison: bool


DemoJobs = queue("demo_jobs", payload=DemoJob, var=True)

DEMO_MAX_ATTEMPTS = 3
DEMO_BACKOFF = [0.05, 0.1]
DEMO_FAIL_RATE = 0.10
DEMO_POISON_EVERY = 400
DEMO_PRODUCERS = 2
DEMO_WORKERS = 4
DEMO_TIMEOUT = 120.0


@dataclass
class DemoTally:
    """What the workers saw; guarded by ``lock``."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    pushed: int = 0
    done: int = 0
    retried: int = 0
    dead: int = 0
    errors: list[BaseException] = field(default_factory=list)

    @property
    def settled(self) -> int:
        return self.done + self.dead


@dataclass(frozen=True)
class DemoResult:
    jobs: int
    tally: DemoTally
    elapsed: float
    stats: QueueStats
    path: str
    preexisting: int = 0  # live rows already in the queue (a reused --dir)


def is_poison(doc_id: int) -> bool:
    """Every 400th job (ids 199, 599, ...) is poison: it fails until dead-lettered."""
    return doc_id % DEMO_POISON_EVERY == DEMO_POISON_EVERY // 2 - 1


def _demo_fails(job: DemoJob, attempt: int) -> bool:
    """Poison jobs fail every attempt; about 10% of the others fail their first one."""
    if job.poison:
        return True
    return attempt == 1 and random.Random(job.doc_id).random() < DEMO_FAIL_RATE


def _demo_process(job: DemoJob) -> int:
    """Stand-in for real work: checksum the document."""
    return zlib.crc32(job.text.encode())


def _demo_producer(q: Queue[DemoJob], ids: range, tally: DemoTally) -> None:
    try:
        for i in ids:
            q.push(DemoJob(i, f"document {i}: " + "lorem ipsum " * 4, is_poison(i)))
            with tally.lock:
                tally.pushed += 1
    except BaseException as e:  # noqa: BLE001 - the main thread re-raises it
        with tally.lock:
            tally.errors.append(e)


def _demo_worker(q: Queue[DemoJob], total: int, tally: DemoTally, stop: threading.Event) -> None:
    try:
        while not stop.is_set():
            leases = q.lease(8)
            if not leases:
                q.wait_due_timeout(timedelta(milliseconds=50))
                continue
            for lease in leases:
                if _demo_fails(lease.payload, lease.attempt):
                    q.nack(lease.token)  # dead-letters once attempts reach max_attempts
                    with tally.lock:
                        if lease.attempt >= DEMO_MAX_ATTEMPTS:
                            tally.dead += 1
                        else:
                            tally.retried += 1
                else:
                    _demo_process(lease.payload)
                    q.ack(lease.token)
                    with tally.lock:
                        tally.done += 1
            with tally.lock:
                if tally.settled >= total:
                    stop.set()
    except BaseException as e:  # noqa: BLE001 - the main thread re-raises it
        with tally.lock:
            tally.errors.append(e)
        stop.set()


def run_demo(path: str, jobs: int, *, progress: bool = True) -> DemoResult:
    """Run the demo pipeline on ``path`` and return what happened.

    Two producer threads push ``jobs`` :class:`DemoJob` rows; four workers lease
    them eight at a time and ack them.  About 10% fail their first attempt and are
    nacked (retried after a short backoff); every 400th job is poison and fails
    until it is dead-lettered after three attempts.
    """
    config = (
        QueueConfig.balanced()
        .max_attempts(DEMO_MAX_ATTEMPTS)
        .backoff_secs(DEMO_BACKOFF)
        .lease_timeout(timedelta(seconds=30))
        .wakeup_recheck(timedelta(milliseconds=100))
        .build()
    )
    tally = DemoTally()
    stop = threading.Event()
    with Db.open(path) as db:
        q = db.open_queue(DemoJobs, config)
        preexisting = q.len()
        total = jobs + preexisting  # a reused --dir may hold rows from an interrupted run
        bar = ProgressBar(total, "demo") if progress else None
        start = time.perf_counter()
        producers = [
            threading.Thread(target=_demo_producer, args=(q, range(p, jobs, DEMO_PRODUCERS), tally), name=f"producer-{p}")
            for p in range(DEMO_PRODUCERS)
        ]
        workers = [
            threading.Thread(target=_demo_worker, args=(q, total, tally, stop), name=f"worker-{w}")
            for w in range(DEMO_WORKERS)
        ]
        for t in producers + workers:
            t.start()
        deadline = time.monotonic() + DEMO_TIMEOUT
        while not stop.wait(0.05):
            if bar is not None:
                bar.update(tally.settled, _demo_note(tally))
            if time.monotonic() > deadline:
                stop.set()
                with tally.lock:
                    tally.errors.append(TimeoutError(f"demo did not finish within {DEMO_TIMEOUT:.0f} s"))
        for t in producers + workers:
            t.join()
        elapsed = time.perf_counter() - start
        if bar is not None:
            bar.close(tally.settled, _demo_note(tally))
        stats = q.stats()
    if tally.errors:
        raise tally.errors[0]
    return DemoResult(jobs, tally, elapsed, stats, path, preexisting)


def _demo_note(t: DemoTally) -> str:
    return f"pushed {t.pushed}  done {t.done}  retried {t.retried}  dead {t.dead}"


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.jobs < 1:
        print("armdb demo: --jobs must be at least 1", file=sys.stderr)
        return 2
    tmp = None
    if args.dir is None:
        tmp = tempfile.mkdtemp(prefix="armdb-demo-")
        path = os.path.join(tmp, "db")
    else:
        path = args.dir
    try:
        try:
            result = run_demo(path, args.jobs)
        except DbLocked as e:
            print(f"armdb demo: {e}", file=sys.stderr)
            return 1
        t = result.tally
        print(format_stats(result.stats))
        print()
        rate = result.jobs / result.elapsed if result.elapsed > 0 else float("inf")
        print(
            f"demo: {result.jobs:,} jobs: done {t.done:,}, retried {t.retried:,}, "
            f"dead-lettered {t.dead:,}, elapsed {result.elapsed:.2f} s, {rate:,.0f} jobs/s"
        )
        where = "a temporary directory, now removed" if tmp else path
        print(f"demo: database in {where}")
        if result.preexisting:
            print(f"demo: the queue already held {result.preexisting:,} live rows from an earlier run; "
                  f"they were processed too and are included in the counts")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


# -- key files (C4) ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _KeyArgs:
    """The keys of ``--key-file`` and ``--log-key-file``, with the labels that name them."""

    keys: list[bytes]
    labels: list[str]
    log_key: bytes | None
    log_label: str


def _load_keys(args: argparse.Namespace) -> _KeyArgs:
    """Read the key files named on the command line; warn about files others can read.
    ``KeyFileError`` for a file that cannot be read or holds no key."""
    files = list(args.key_file or [])
    keys = [read_key_file(f) for f in files]
    log_key = read_key_file(args.log_key_file) if args.log_key_file else None
    for f in files + ([args.log_key_file] if args.log_key_file else []):
        warning = key_file_warning(f)
        if warning:
            print(f"armdb {args.command}: warning: {warning}", file=sys.stderr)
    return _KeyArgs(keys, [f"--key-file {f}" for f in files], log_key,
                    f"--log-key-file {args.log_key_file}" if args.log_key_file else "--log-key-file")


def _key_error(command: str, e: ArmdbError) -> int:
    """Report a key problem (exit status 2): which key, and what to pass."""
    if isinstance(e, EncryptionKeyRequired):
        msg = ("the transaction log holds sealed records that open must replay (a crash left them); pass the log "
               "key with --log-key-file PATH (or --key-file PATH when it is the same key)")
    elif isinstance(e, WrongKey):
        msg = f"{e} (with --key-file PATH for collections, --log-key-file PATH for the transaction log)"
    else:
        msg = str(e)
    print(f"armdb {command}: {type(e).__name__}: {msg}", file=sys.stderr)
    return 2


# -- stats (C2) --------------------------------------------------------------------------------


def _cmd_stats(args: argparse.Namespace) -> int:
    path = args.dir
    try:
        keys = _load_keys(args)
    except KeyFileError as e:
        return _key_error("stats", e)
    if not _fs.FS.exists(os.path.join(path, META_FILE)):
        print(f"armdb stats: {path} is not an armdb database (no {META_FILE})", file=sys.stderr)
        return 1
    try:  # keys that open nothing are refused before the open (and its recovery) writes anything
        resolved = resolve_keys(os.path.abspath(path), keys.keys, keys.log_key, labels=keys.labels,
                                log_label=keys.log_label)
    except WrongKey as e:
        return _key_error("stats", e)
    if not _fs.FS.writable(path):
        return _stats_read_only(os.path.abspath(path), args)
    tx = TxConfig(log_encryption_key=resolved.log_key) if resolved.log_key is not None else None
    try:
        db = Db.open(path, tx_config=tx)
    except DbLocked as e:
        print(f"armdb stats: {e}", file=sys.stderr)
        return 1
    except (EncryptionKeyRequired, WrongKey) as e:
        return _key_error("stats", e)
    try:
        _print_stats(db.path, db.clock(), "", args.json)
    finally:
        db.shutdown()
    return 0


def _stats_read_only(path: str, args: argparse.Namespace) -> int:
    """Stats of a database in a directory this process cannot write (a read-only mount, a
    backup): read from the files as they are, without opening (and so recovering) it."""
    try:
        lock = DirLock.for_inspection(path)
    except DbLocked as e:
        print(f"armdb stats: {e}", file=sys.stderr)
        return 1
    try:
        _print_stats(path, time.time_ns() // 1_000_000, " (read-only directory: the files as stored, not recovered)",
                     args.json)
    finally:
        lock.release()
    return 0


def _print_stats(path: str, now_ms: int, note: str, as_json: bool = False) -> None:
    names = queue_names(path)
    if as_json:
        # One object keyed by queue name; len and dead_len as QueueStats names them.
        out = {}
        for name in names:
            s = inspect_queue(path, name, now_ms)
            out[name] = {"len": s.live, "dead_len": s.dead, **dataclasses.asdict(s)}
        print(json.dumps(out, indent=2, sort_keys=True))
        return
    if not names:
        print(f"{path}: no queues{note}")
        return
    print(f"database {path}{note}")
    for name in names:
        s = inspect_queue(path, name, now_ms)
        print()
        print(f"queue {s.name} ({s.flavour}, {s.shards} shard{'s' if s.shards != 1 else ''})")
        rows = [
            ("live", s.live),
            ("ready", s.ready),
            ("leased", s.leased),
            ("  of which expired", s.expired),
            ("delayed", s.delayed),
            ("dead", s.dead),
            ("torn slots", s.torn),
            ("slots allocated", s.slots_allocated),
            ("header file logical bytes", s.header_file_logical_bytes),
            ("header file physical bytes", s.header_file_physical_bytes),
        ]
        if s.flavour == "var":
            rows.append(("payload file bytes", s.payload_bytes))
        print(format_table(("stat", "value"), rows))


# -- check -------------------------------------------------------------------------------------


def _cmd_check(args: argparse.Namespace) -> int:
    """Exit 0 when clean, 1 with findings, 2 when the database cannot be inspected."""
    path = args.dir
    try:
        keys = _load_keys(args)
    except KeyFileError as e:
        return _key_error("check", e)
    if not _fs.FS.exists(os.path.join(path, META_FILE)):
        print(f"armdb check: {path} is not an armdb database (no {META_FILE})", file=sys.stderr)
        return 2
    try:
        report = _check(path, keys.keys, keys.log_key, keys.labels, keys.log_label)
    except WrongKey as e:
        return _key_error("check", e)
    except ArmdbError as e:  # open elsewhere, or a lock file that is not ours
        print(f"armdb check: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(report)
    return 0 if report.ok else 1


# -- bench (C3) --------------------------------------------------------------------------------


def _cmd_bench(args: argparse.Namespace) -> int:
    return _bench.main(quick=args.quick, json_path=args.json, only=args.only, dsn=args.dsn)


# -- serve and work (C5) ----------------------------------------------------------------------


def _cmd_serve(args: argparse.Namespace) -> int:
    """Serve DIR in the foreground; SIGINT/SIGTERM stop accepting, finish the calls in
    flight and close the database."""
    stop = threading.Event()
    old = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        db = Db.open(args.dir)
        try:
            srv = db.serve(args.socket)
            print(f"armdb serve: serving {db.path} on {srv.path} (process {os.getpid()}); "
                  f"stop with Ctrl-C or SIGTERM", file=sys.stderr, flush=True)
            while not stop.wait(1.0):
                pass
            srv.close()
        finally:
            db.shutdown()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    print("armdb serve: stopped", file=sys.stderr)
    return 0


def _load_handler(target: str, queue_name: str | None) -> tuple[QueueSpec, Callable[..., Any]]:
    mod_name, sep, func_name = target.partition(":")
    if not sep or not mod_name or not func_name:
        raise ConfigError(f"give the handler as module:function, got {target!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    module = importlib.import_module(mod_name)
    handler = getattr(module, func_name, None)
    if not callable(handler):
        raise ConfigError(f"{mod_name} has no function {func_name!r}")
    specs = {v.name: v for v in vars(module).values() if isinstance(v, QueueSpec)}
    if queue_name is not None:
        if queue_name not in specs:
            raise ConfigError(f"{mod_name} declares no queue {queue_name!r} (it declares: {sorted(specs) or 'none'})")
        return specs[queue_name], handler
    if len(specs) != 1:
        raise ConfigError(f"{mod_name} declares {len(specs)} queues ({sorted(specs)}); pick one with --queue NAME")
    return next(iter(specs.values())), handler


def _cmd_work(args: argparse.Namespace) -> int:
    spec, handler = _load_handler(args.target, args.queue)
    db: Db | None = None
    try:
        source: Client | Db = Client(args.dir)
        where = f"connected to the owner of {args.dir}"
    except ServerGone:
        db = Db.open(args.dir)  # nobody serves it: own it, and serve it (to worker processes, and others)
        srv = db.serve()
        source = db
        where = f"owning {db.path}, serving it on {srv.path}"
    try:
        w = Worker(source, spec, handler, processes=args.processes, threads=args.threads, batch=args.batch)
        print(f"armdb work: {spec.name} with {args.target} ({where}; {args.processes or 1} process(es) x "
              f"{args.threads} thread(s)); stop with Ctrl-C or SIGTERM", file=sys.stderr, flush=True)
        stop_progress = threading.Event()

        def progress() -> None:
            t0 = time.monotonic()
            while not stop_progress.wait(1.0):
                done, failed = w.counts()
                rate = done / max(1e-9, time.monotonic() - t0)
                print(f"\r{done:,} done, {failed:,} failed, {rate:,.0f}/s", end="", file=sys.stderr, flush=True)

        pt = threading.Thread(target=progress, daemon=True)
        pt.start()
        try:
            w.run()
        finally:
            stop_progress.set()
            pt.join()
        done, failed = w.counts()
        print(f"\narmdb work: stopped; {done:,} done, {failed:,} failed", file=sys.stderr)
    finally:
        if isinstance(source, Client):
            source.close()
        if db is not None:
            db.shutdown()
    return 0


# -- entry point -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m armdb", description="armdb command line")
    parser.add_argument("--version", action="version", version=f"armdb {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run a small producer/worker pipeline")
    demo.add_argument("--dir", help="database directory (default: a fresh temporary directory)")
    demo.add_argument("--jobs", type=int, default=2000, help="number of jobs (default 2000)")
    demo.set_defaults(func=_cmd_demo)

    stats = sub.add_parser("stats", help="print the stats of every queue in a database")
    stats.add_argument("dir", help="database directory")
    stats.add_argument("--json", action="store_true",
                       help="print one JSON object keyed by queue name (each with len, dead_len and the counts)")
    _key_arguments(stats, "needed to open a database whose log holds sealed records left by a crash")
    stats.set_defaults(func=_cmd_stats)

    chk = sub.add_parser(
        "check", help="check every file of a database that is not open (read-only)",
        description="Check every file of a database that is not open, without changing it. Exit status: 0 when "
                    "clean, 1 with findings, 2 when the database cannot be inspected (missing, open elsewhere, "
                    "a key file that cannot be read, a wrong key).",
    )
    chk.add_argument("dir", help="database directory (a read-only copy is fine)")
    _key_arguments(chk, "with them every encrypted record's authentication tag is verified; without them "
                        "encrypted records are checked by CRC only, and the report lists what was not verified")
    chk.set_defaults(func=_cmd_check)

    bench = sub.add_parser("bench", help="benchmark armdb beside SQLite-based queues")
    bench.add_argument("--quick", action="store_true", help="small sizes: under a minute on 2 cores")
    bench.add_argument("--json", metavar="FILE", help="also write the raw figures to FILE")
    bench.add_argument("--only", metavar="SUBSTR", help="run only workloads whose name contains SUBSTR")
    bench.add_argument("--dsn", help="PostgreSQL server of the postgres rows (default: the bench starts one)")
    bench.set_defaults(func=_cmd_bench)

    srv = sub.add_parser("serve", help="open a database and serve it to other processes (armdb.connect)")
    srv.add_argument("dir", help="database directory")
    srv.add_argument("--socket", help="socket path (default: DIR/armdb.sock)")
    srv.set_defaults(func=_cmd_serve)

    work = sub.add_parser("work", help="run a worker: call module:function for every job of a queue")
    work.add_argument("dir", help="database directory (served by its owner, or opened and served here)")
    work.add_argument("target", metavar="module:function", help="the handler; its module declares the queue")
    work.add_argument("-p", "--processes", type=int, default=0, help="child processes (default 0: this one)")
    work.add_argument("--threads", type=int, default=1, help="handler threads per process (default 1)")
    work.add_argument("--batch", type=int, default=16, help="rows leased at once (default 16)")
    work.add_argument("--queue", help="the queue, when the module declares several")
    work.set_defaults(func=_cmd_work)

    salv = sub.add_parser(
        "salvage", help="cut the files that open refuses (a bad record with valid ones after it) at the bad record"
    )
    salv.add_argument("dir", help="database directory (not open anywhere)")
    salv.add_argument("--dry-run", action="store_true", help="only print what would be cut")
    _key_arguments(salv, "with them a file is also cut at an encrypted record that fails its authentication tag, "
                         "which open refuses once it has the key")
    salv.set_defaults(func=_cmd_salvage)
    return parser


def _key_arguments(p: argparse.ArgumentParser, why: str) -> None:
    """``--key-file`` and ``--log-key-file`` of ``stats``, ``check`` and ``salvage``."""
    formats = ("a key file holds 32 raw bytes (head -c 32 /dev/urandom), 64 hex digits (openssl rand -hex 32) "
               "or base64 (openssl rand -base64 32)")
    p.add_argument("--key-file", metavar="PATH", action="append",
                   help=f"a file holding the encryption key of encrypted collections (maps, var queue payloads); "
                        f"repeat it for several keys: each collection takes its own; {formats}; {why}")
    p.add_argument("--log-key-file", metavar="PATH",
                   help="a file holding the transaction log key (TxConfig log_encryption_key); "
                        "default: whichever --key-file key is the log's")


def _cmd_salvage(args: argparse.Namespace) -> int:
    try:
        keys = _load_keys(args)
        report = _salvage(args.dir, args.dry_run, keys.keys, keys.log_key, keys.labels, keys.log_label)
    except (KeyFileError, WrongKey) as e:
        return _key_error("salvage", e)
    print(report)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:
        # The reader went away (``| head``): end quietly, as a tool killed by SIGPIPE
        # would, and keep the interpreter from complaining when it flushes stdout.
        devnull = _fs.FS.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        _fs.FS.close(devnull)
        return 141
    except ArmdbError as e:
        print(f"armdb {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
