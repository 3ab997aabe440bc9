"""Harness (d): corrupt files at many offsets and require a typed refusal or the truth
(docs/reliability.md, (d)).

Golden stores are built by the test (``GOLDENS``): a fixed queue, a var queue whose
payload store rotated (several data files, hint files), an encrypted var queue, a
map with hint files and a compaction output, and a database whose transaction log
holds a logged, unapplied commit (a child stopped by ``ARMDB_FAILPOINT=
txlog.after_append``).  Each file of a golden is mutated (bit flip, a zeroed range,
a 0xFF range, truncation, zero extension, appended garbage, deletion, rollback to
the copy taken half way through the workload), and the result must be one of:

* a refusal with ``CorruptionError`` or ``FormatError`` (the corruption family;
  ``WrongKey``/``EncryptionKeyRequired`` for key material, ``ConfigError``/
  ``SchemaMismatch`` only when a whole meta file is deleted);
* an open that serves the truth: every value it returns is the value last written
  under that id or key (or, where a torn tail may be cut, an older value once
  written), nothing that was never written, no header without its body, and
  anything missing is *reported* (a torn slot repaired on open, a torn tail
  dropped, or an ``armdb.check`` finding before the open).

Anything else is a violation: ``untyped_exception``, ``wrong_data``, ``phantom``,
``silent_loss``, ``header_without_body``, ``hang``.  Most cases are checked by the
decoding layer directly and in memory (``armdb._core.fixed.validate`` and
``decode_header`` for ``fixed.data``; ``BitcaskStore.open`` on one collection
folder for data, hint and collection meta files; the transaction log parser; the
meta decoders); a sample (every deletion and rollback, and one case in
``FULL_EVERY``) reopens the whole database.  Every case runs under a watchdog.

Size: ``ARMDB_MUTATIONS`` mutated files (CI default 21,000, which checks >= 20,000; the ``slow`` test runs
500,000).  One summary line ``RELIABILITY mutation ...`` is printed and appended to
``$ARMDB_RELIABILITY_REPORT``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

import armdb
from armdb import bitcask, txlog
from armdb._core import fixed as _k
from armdb.db import check_meta
from armdb.errors import (
    ArmdbError,
    ConfigError,
    CorruptionError,
    EncryptionKeyRequired,
    FormatError,
    SchemaMismatch,
    WrongKey,
)
from armdb.fixed import HEADER_PAGE, decode_header, lost_below_hwm, read_hwm
from armdb.seqmap import decode as decode_seqmap

from .bcd_workloads import KEY, NOBODY, Session, World, fast_tmpdir
from .journal import quiet_armdb_log, report_line

_queue = sys.modules["armdb.queue"]

ROOT = Path(__file__).resolve().parents[2]
CI_MUTATIONS = int(os.environ.get("ARMDB_MUTATIONS", "21000"))  # yields >= 20,000 mutated files
NIGHTLY_MUTATIONS = int(os.environ.get("ARMDB_MUTATIONS_NIGHTLY", "500000"))  # the slow test
FULL_EVERY = 12  # one case in FULL_EVERY also reopens the whole database
CASE_TIMEOUT = 20.0
CORRUPTION_FAMILY = (CorruptionError, FormatError)

# ---------------------------------------------------------------------------------------------
# Golden stores
# ---------------------------------------------------------------------------------------------

FIXED = World(queues=(("fq", False),), durable=True)
VAR_ROT = World(queues=(("vq", True),), durable=True, payload_size=3000)
VAR_ENC = World(queues=(("vq", True),), durable=True, encrypted=True, payload_size=300)
MAP = World(queues=(), maps=("m",), durable=True, value_size=6000)
VAR = World(queues=(("vq", True),), durable=True)

_Q_OPS = ["lease", "ack", "lease", "nack", "lease", "dead", "lease"]


def _qops(q: str, pushes: int) -> list[str]:
    return [f"push:{q}"] * pushes + [f"{op}:{q}" for op in _Q_OPS]


GOLDEN_SPECS: dict[str, tuple[World, list[str]]] = {
    "fixed_queue": (FIXED, _qops("fq", 12)),
    "var_queue_rotated": (VAR_ROT, _qops("vq", 44) + ["lease:vq", "ack:vq"] * 6),
    "var_encrypted": (VAR_ENC, _qops("vq", 10)),
    "map_hints": (MAP, ["put:m"] * 30 + ["del:m"] + ["put:m"] * 4 + ["del:m"]),
    "txlog_unapplied": (VAR, _qops("vq", 4)),
}


@dataclass
class Golden:
    name: str
    world: World
    path: str  # the pristine database folder (as the workload left it)
    older: str  # the same database half way through the workload
    truth: tuple[Any, ...]  # state after a clean reopen
    alt_truths: list[tuple[Any, ...]]  # other acceptable whole states (txlog_unapplied: before the commit)
    payloads: set[bytes]  # every payload ever stored (encoded as stored)
    map_values: dict[bytes, set[bytes]]  # every value ever put under a raw map key
    files: list[str] = field(default_factory=list)  # relative paths of the mutable files


def _encode_payload(world: World, p: Any) -> bytes:
    if isinstance(p, tuple):
        return struct.pack("<QQ", *p)
    return msgpack.packb(p, use_bin_type=True)


def build_golden(name: str, root: str) -> Golden:
    world, ops = GOLDEN_SPECS[name]
    path = os.path.join(root, name, "db")
    older = os.path.join(root, name, "older")
    os.makedirs(path)
    s = Session(world, path).open()
    half = len(ops) // 2
    for op in ops[:half]:
        s.run(op)
    s.close()
    shutil.copytree(path, older)
    s.open()
    for op in ops[half:]:
        s.run(op)
    s.close()
    alt: list[Any] = []
    if name == "txlog_unapplied":
        # A child leases and acks one row (a var ack is one log commit) and exits right
        # after the log append: the database holds a logged, unapplied commit.
        code = (
            f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
            "from tests.reliability.bcd_workloads import Session, World\n"
            f"s = Session(World(queues=(('vq', True),), durable=True), {path!r}).open()\n"
            "s.pushes = 10**6\n"
            "s.run('push:vq'); s.run('lease:vq'); s.run('ack:vq')\n"
        )
        env = dict(os.environ, ARMDB_FAILPOINT="txlog.after_append", PYTHONPATH=str(ROOT))
        r = subprocess.run(
            [sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 86, f"child did not stop at txlog.after_append: {r.returncode} {r.stderr}"
        s.pushed[10**6 + 1] = _child_payload(world)
        # Before the commit: the same folder with the log cut to its header.
        before = os.path.join(root, name, "before")
        shutil.copytree(path, before)
        for f in os.listdir(os.path.join(before, "txlog")):
            p = os.path.join(before, "txlog", f)
            with open(p, "r+b") as fh:
                fh.truncate(txlog.RECORDS_START)
        alt.append(_state_of(world, before))
    truth = _state_of(world, path, copy=True)
    payloads = {_encode_payload(world, p) for p in s.pushed.values()}
    mvals: dict[bytes, set[bytes]] = {}
    for k, vals in s.put_history.items():
        raw_k = b"b" + k  # armdb.maps key encoding: type tag then bytes
        mvals[raw_k] = {msgpack.packb(v, use_bin_type=True) for v in vals}
    files = []
    for dirpath, _dirs, names in os.walk(path):
        for fn in names:
            rel = os.path.relpath(os.path.join(dirpath, fn), path)
            if fn != "LOCK":
                files.append(rel)
    return Golden(name, world, path, older, truth, alt, payloads, mvals, sorted(files))


def _child_payload(world: World) -> Any:
    from .bcd_workloads import payload_bytes

    return payload_bytes(10**6 + 1, world.payload_size)


def _state_of(world: World, path: str, *, copy: bool = False) -> tuple[Any, ...]:
    d = path
    if copy:
        d = path + ".truth"
        shutil.copytree(path, d)
    s = Session(world, d).open()
    st = s.capture()
    s.close()
    if copy:
        shutil.rmtree(d)
    return st


# ---------------------------------------------------------------------------------------------
# Mutations
# ---------------------------------------------------------------------------------------------


@dataclass
class Mutation:
    rel: str
    desc: str
    data: bytes | None  # None: the file is deleted


def mutations_for(g: Golden, rel: str, data: bytes, rng: random.Random, n: int) -> list[Mutation]:
    """About ``n`` mutations of one file, plus the whole-file ones (zero extension, garbage,
    deletion, rollback).  Offsets: every byte of the file when the budget allows, else
    the header bytes, record boundaries +-1 and random offsets; at each offset a bit flip,
    a zeroed byte or run, a 0xFF byte or run, or a truncation."""
    out: list[Mutation] = []
    size = len(data)
    if size * 4 <= n:
        offsets = list(range(size)) * 4
        rng.shuffle(offsets)
    else:
        # Header bytes and record boundaries first (where decoders branch), then random
        # offsets; twice as many as needed, since zeroing a zero byte changes nothing.
        offsets = list(range(min(64, size))) + _boundaries(rel, data)
        rng.shuffle(offsets)
        offsets += [rng.randrange(size) for _ in range(max(0, 2 * n - len(offsets)))] if size else []
    kinds = ("flip", "zero", "ff", "trunc", "flip", "zero*", "ff*", "flip")
    for i, off in enumerate(offsets):
        if len(out) >= n:
            break
        kind = kinds[i % len(kinds)]
        if kind == "flip":
            b = bytearray(data)
            bit = rng.randrange(8)
            b[off] ^= 1 << bit
            out.append(Mutation(rel, f"flip@{off}.{bit}", bytes(b)))
        elif kind == "trunc":
            out.append(Mutation(rel, f"trunc@{off}", data[:off]))
        else:
            ln = rng.choice((2, 4, 8, 56, 512, 4096)) if kind.endswith("*") else 1
            fill = 0 if kind.startswith("zero") else 0xFF
            b = bytearray(data)
            end = min(size, off + ln)
            b[off:end] = bytes([fill]) * (end - off)
            if bytes(b) != data:
                out.append(Mutation(rel, f"{kind.rstrip('*')}@{off}+{end - off}", bytes(b)))
    out.append(Mutation(rel, "zext+4096", data + bytes(4096)))
    out.append(Mutation(rel, "zext+13", data + bytes(13)))
    out.append(Mutation(rel, "garbage+40", data + bytes(rng.getrandbits(8) for _ in range(40))))
    out.append(Mutation(rel, "delete", None))
    op = os.path.join(g.older, rel)
    if os.path.exists(op):
        with open(op, "rb") as f:
            od = f.read()
        if od != data:
            out.append(Mutation(rel, "rollback", od))
    return out


def _boundaries(rel: str, data: bytes) -> list[int]:
    """Record starts +-1 of a Bitcask data file or a log file (where torn writes end)."""
    offs: list[int] = []
    try:
        if rel.endswith(".data") and "shard-" in rel and not rel.endswith("fixed.data"):
            pos = bitcask.DATA_START
            while pos + bitcask.REC_HEAD_SIZE <= len(data):
                _g, _c, vlen, _m, klen = bitcask.REC_HEAD.unpack_from(data, pos)
                offs += [pos - 1, pos, pos + 1, pos + 12, pos + 18]
                pos += bitcask._pad8(bitcask.REC_HEAD_SIZE + klen + vlen)
        elif rel.endswith(".log"):
            recs, _end, _bad = txlog.parse_records(data, txlog.RECORDS_START)
            pos = txlog.RECORDS_START
            for _txid, _fl, body in recs:
                offs += [pos - 1, pos, pos + 1, pos + 20]
                pos += txlog.REC_HEAD_SIZE + len(body)
                pos += -pos % 8
    except Exception:  # noqa: BLE001, S110 - only a hint for where to mutate
        pass
    return [o for o in offs if 0 <= o < len(data)]


# ---------------------------------------------------------------------------------------------
# Checking
# ---------------------------------------------------------------------------------------------


@dataclass
class MTally:
    mutations: int = 0
    full_reopens: int = 0
    refused: int = 0
    served: int = 0
    violations: Counter = field(default_factory=Counter)
    untyped: int = 0
    signatures: Counter = field(default_factory=Counter)
    sig_example: dict = field(default_factory=dict)
    slowest: float = 0.0

    def add(self, cls: str, msg: str) -> None:
        self.violations[cls] += 1
        if cls == "untyped_exception":
            self.untyped += 1
        sig = cls + ": " + re.sub(r"\d+", "#", re.sub(r"/\S+/", "", msg.split(" :: ")[-1]))[:170]
        self.signatures[sig] += 1
        self.sig_example.setdefault(sig, msg)

    def merge(self, o: MTally) -> None:
        self.mutations += o.mutations
        self.full_reopens += o.full_reopens
        self.refused += o.refused
        self.served += o.served
        self.violations.update(o.violations)
        self.untyped += o.untyped
        self.signatures.update(o.signatures)
        for k, v in o.sig_example.items():
            self.sig_example.setdefault(k, v)
        self.slowest = max(self.slowest, o.slowest)


class Checker:
    def __init__(self, g: Golden, scratch: str, tally: MTally) -> None:
        self.g = g
        self.scratch = scratch
        self.t = tally
        self.n = 0
        self._fixed_truth: dict[str, tuple[np.ndarray, int, int, int]] = {}
        self._bitcask_truth: dict[str, dict[bytes, bytes]] = {}
        self._log_truth: dict[str, list[Any]] = {}

    # -- dispatch ----------------------------------------------------------------------------------
    def check(self, m: Mutation, *, full: bool) -> None:
        self.t.mutations += 1
        self.n += 1
        where = f"[{self.g.name} {m.rel} {m.desc}]"
        t0 = time.perf_counter()
        faulthandler.dump_traceback_later(CASE_TIMEOUT, exit=True)
        try:
            self._check(m, full, where)
        finally:
            faulthandler.cancel_dump_traceback_later()
            self.t.slowest = max(self.t.slowest, time.perf_counter() - t0)

    def _check(self, m: Mutation, full: bool, where: str) -> None:
        rel = m.rel
        base = os.path.basename(rel)
        if m.data is None or m.desc == "rollback" or full:
            self.full(m, where)
            return
        if base == "fixed.data":
            self.fixed(m, where)
        elif rel.startswith("collections" + os.sep) and "shard-" not in base and base in ("queue.meta",):
            self.decoder(m, where, lambda raw: _queue._decode_meta(raw, rel), _queue._decode_meta)
        elif rel.startswith("collections" + os.sep):
            self.bitcask_collection(m, where)
        elif rel.startswith("txlog" + os.sep):
            self.log(m, where)
        elif base == "db.meta":
            self.decoder(m, where, lambda raw: check_meta(raw, rel), check_meta)
        elif base == "seqmap":
            self.decoder(m, where, lambda raw: decode_seqmap(raw, rel), decode_seqmap)
        else:
            self.full(m, where)

    # -- meta decoders -------------------------------------------------------------------------------
    def decoder(self, m: Mutation, where: str, fn: Any, _f: Any) -> None:
        with open(os.path.join(self.g.path, m.rel), "rb") as f:
            orig = f.read()
        want = fn(orig)
        try:
            got = fn(m.data)
        except CORRUPTION_FAMILY:
            self.t.refused += 1
            return
        except Exception as e:  # noqa: BLE001
            self.t.add("untyped_exception", f"{where} :: decode: {type(e).__name__}: {e}")
            return
        self.t.served += 1
        if got != want:
            self.t.add("wrong_data", f"{where} :: decoded {got!r}, wrote {want!r}")

    # -- fixed.data, in memory -------------------------------------------------------------------------
    def fixed(self, m: Mutation, where: str) -> None:
        assert m.data is not None
        truth = self._fixed_truth.get(m.rel)
        if truth is None:
            with open(os.path.join(self.g.path, m.rel), "rb") as f:
                orig = f.read()
            slot_size, _ks, _vs, _ = decode_header(orig[:HEADER_PAGE], m.rel)
            n = (len(orig) - HEADER_PAGE) // slot_size
            slots = np.frombuffer(orig, np.uint8, n * slot_size, HEADER_PAGE).reshape(n, slot_size).copy()
            status = np.zeros(n, np.uint8)
            _k.validate(slots, np.zeros(n, np.uint32), status)
            truth = (slots, status, slot_size, n)
            self._fixed_truth[m.rel] = truth
        slots0, status0, slot_size, n0 = truth
        data = m.data
        try:
            decode_header(data[:HEADER_PAGE], m.rel)
        except FormatError:
            self.t.refused += 1
            return
        except Exception as e:  # noqa: BLE001
            self.t.add("untyped_exception", f"{where} :: decode_header: {type(e).__name__}: {e}")
            return
        self.t.served += 1
        # What open does: round the slot count up to whole grow steps, zero-extended.
        n = max(0, (len(data) - HEADER_PAGE) // slot_size)
        body = bytearray(data[HEADER_PAGE : HEADER_PAGE + n * slot_size])
        if n < n0:
            body.extend(bytes((n0 - n) * slot_size))
        cnt = max(n, n0)
        slots = np.frombuffer(bytes(body), np.uint8).reshape(cnt, slot_size).copy()
        status = np.zeros(cnt, np.uint8)
        _k.validate(slots, np.zeros(cnt, np.uint32), status)
        with open(os.path.join(self.g.path, os.path.dirname(m.rel), "fixed.redo"), "rb") as f:
            redo = f.read(64)  # the other copy of the high-water mark (this file is intact)
        if len(data) < HEADER_PAGE or lost_below_hwm(status, read_hwm(data[:HEADER_PAGE], redo)[1])[0]:
            self.t.refused += 1  # open raises CorruptionError (test_s4_truncated_fixed_data_is_reported)
            return
        for i in range(cnt):
            was = status0[i] if i < n0 else _k.FREE
            now = status[i]
            if now == _k.OCCUPIED:
                if was != _k.OCCUPIED:
                    self.t.add("phantom", f"{where} :: slot {i} was {was}, decodes as a row")
                    return
                if not np.array_equal(slots[i], slots0[i]):
                    self.t.add("wrong_data", f"{where} :: slot {i} validates with other content")
                    return
            elif was == _k.OCCUPIED and now == _k.FREE:
                self.t.add(
                    "silent_loss",
                    f"{where} :: slot {i} held a row and now reads as never written "
                    f"(no finding, no repair count)",
                )
                return
            elif was == _k.OCCUPIED and now == _k.DELETED:
                self.t.add("silent_loss", f"{where} :: slot {i} held a row and now validates as deleted")
                return

    # -- a Bitcask collection folder -------------------------------------------------------------------
    def bitcask_collection(self, m: Mutation, where: str) -> None:
        parts = m.rel.split(os.sep)
        coll = parts[1]
        src = os.path.join(self.g.path, "collections", coll)
        truth = self._bitcask_truth.get(coll)
        cfg = self._bitcask_config(coll)
        if truth is None:
            d = os.path.join(self.scratch, f"bt-{coll}")
            shutil.copytree(src, d)
            st = bitcask.BitcaskStore.open(d, cfg, lambda: 1 << 58)
            truth = dict(st.items())
            st.close()
            shutil.rmtree(d)
            self._bitcask_truth[coll] = truth
        d = os.path.join(self.scratch, f"b{self.n}")
        shutil.copytree(src, d)
        target = os.path.join(d, *parts[2:])
        assert m.data is not None
        with open(target, "wb") as f:
            f.write(m.data)
        pre = bitcask.check_dir(d)
        try:
            st = bitcask.BitcaskStore.open(d, cfg, lambda: 1 << 58)
        except CORRUPTION_FAMILY:
            self.t.refused += 1
            shutil.rmtree(d, ignore_errors=True)
            return
        except ArmdbError as e:
            if isinstance(e, (WrongKey, EncryptionKeyRequired)) and parts[-1] == "collection.meta":
                self.t.refused += 1
            else:
                self.t.add("unexpected_error", f"{where} :: open: {type(e).__name__}: {e}")
            shutil.rmtree(d, ignore_errors=True)
            return
        except Exception as e:  # noqa: BLE001
            self.t.add("untyped_exception", f"{where} :: open: {type(e).__name__}: {e}")
            shutil.rmtree(d, ignore_errors=True)
            return
        self.t.served += 1
        try:
            self._judge_items(st, truth, coll, pre, where, m)
        finally:
            with contextlib.suppress(Exception):
                st.close()
            shutil.rmtree(d, ignore_errors=True)

    def _bitcask_config(self, coll: str) -> armdb.Config:
        w = self.g.world
        b = armdb.Config.balanced()
        if w.encrypted and coll.endswith(".payload"):
            b = b.encryption_key(KEY)
        return b.build()

    def _prefix_ok(self, m: Mutation) -> bool:
        """Cutting a Bitcask file at a record boundary, or losing its newest data file,
        leaves a committed prefix that no format can tell from a shorter history: older
        values and missing keys are then acceptable without a report."""
        base = os.path.basename(m.rel)
        if not (base.endswith(".data") and base != "fixed.data"):
            return False
        if m.desc.startswith("trunc"):
            return True
        if m.data is None:
            d = os.path.join(self.g.path, os.path.dirname(m.rel))
            return base == max(f for f in os.listdir(d) if f.endswith(".data"))
        return False

    def _judge_items(
        self, st: Any, truth: dict[bytes, bytes], coll: str, pre: list[str], where: str, m: Mutation
    ) -> None:
        reported = bool(pre) or st.stats()["torn_bytes_dropped"] > 0 or self._prefix_ok(m)
        keys = list(st.keys())
        for k in keys:
            try:
                v = st.get(k)
            except CorruptionError:
                continue  # detected on read: never served
            except Exception as e:  # noqa: BLE001
                self.t.add("untyped_exception", f"{where} :: get: {type(e).__name__}: {e}")
                return
            if v is None:
                continue
            if truth.get(k) == v:
                continue
            if not self._ever_written(coll, k, v):
                cls = "phantom" if k not in truth and not self._key_known(coll, k) else "wrong_data"
                self.t.add(cls, f"{where} :: key {k!r} holds a value never written")
                return
            if not reported:
                self.t.add("silent_stale", f"{where} :: key {k!r} holds an older value, nothing reported")
                return
        missing = [k for k in truth if k not in set(keys)]
        if missing and not reported:
            self.t.add(
                "silent_loss",
                f"{where} :: {len(missing)} key(s) gone without a finding (e.g. {missing[0]!r})",
            )

    def _ever_written(self, coll: str, k: bytes, v: bytes) -> bool:
        if coll.endswith(".payload"):
            return v in self.g.payloads
        return v in self.g.map_values.get(k, set())

    def _key_known(self, coll: str, k: bytes) -> bool:
        if coll.endswith(".payload"):
            return True  # ids: judged by payload only
        return k in self.g.map_values

    # -- the transaction log -------------------------------------------------------------------------------
    def log(self, m: Mutation, where: str) -> None:
        assert m.data is not None
        truth = self._log_truth.get(m.rel)
        if truth is None:
            with open(os.path.join(self.g.path, m.rel), "rb") as f:
                orig = f.read()
            truth = txlog.parse_records(orig, txlog.RECORDS_START)[0]
            self._log_truth[m.rel] = truth
        raw = m.data
        last = self._is_last_log(m.rel)
        try:
            if len(raw) < txlog.RECORDS_START and last:
                recs: list[Any] = []
            else:
                txlog._check_file_header(raw, m.rel)
                recs, _end, bad = txlog.parse_records(raw, txlog.RECORDS_START)
                if bad is not None and (txlog._valid_record_after(raw, bad) is not None or not last):
                    raise CorruptionError("damaged log record with valid records after it")
            for _txid, flags, body in recs:
                if not flags & txlog.FLAG_SEALED:
                    rows = msgpack.unpackb(body, raw=False)
                    if not isinstance(rows, list):
                        raise CorruptionError("body is not a list")
        except CORRUPTION_FAMILY:
            self.t.refused += 1
            return
        except Exception as e:  # noqa: BLE001
            self.t.add("untyped_exception", f"{where} :: parse: {type(e).__name__}: {e}")
            return
        self.t.served += 1
        if recs != truth[: len(recs)]:
            self.t.add("wrong_data", f"{where} :: parsed records differ from the written ones")

    def _is_last_log(self, rel: str) -> bool:
        d = os.path.join(self.g.path, os.path.dirname(rel))
        logs = sorted(f for f in os.listdir(d) if f.endswith(".log"))
        return os.path.basename(rel) == logs[-1]

    # -- the whole database -------------------------------------------------------------------------------------
    def full(self, m: Mutation, where: str) -> None:
        self.t.full_reopens += 1
        d = os.path.join(self.scratch, f"f{self.n}")
        shutil.copytree(self.g.path, d)
        target = os.path.join(d, m.rel)
        if m.data is None:
            os.unlink(target)
        else:
            with open(target, "wb") as f:
                f.write(m.data)
        pre = armdb.check(d)
        sess = Session(self.g.world, d)
        try:
            sess.open()
            got = sess.capture()
            reported = not pre.ok or self._repaired(sess) or self._prefix_ok(m)
            sess.close()
        except CORRUPTION_FAMILY + (SchemaMismatch, WrongKey, EncryptionKeyRequired):
            self.t.refused += 1
            shutil.rmtree(d, ignore_errors=True)
            return
        except ConfigError as e:
            if m.data is None and m.rel.endswith(".meta"):
                self.t.refused += 1  # a deleted meta file: the collection looks foreign
            else:
                self.t.add("unexpected_error", f"{where} :: reopen: ConfigError: {e}")
            shutil.rmtree(d, ignore_errors=True)
            return
        except ArmdbError as e:
            self.t.add("unexpected_error", f"{where} :: reopen: {type(e).__name__}: {e}")
            shutil.rmtree(d, ignore_errors=True)
            return
        except Exception as e:  # noqa: BLE001
            self.t.add("untyped_exception", f"{where} :: reopen: {type(e).__name__}: {e}")
            shutil.rmtree(d, ignore_errors=True)
            return
        finally:
            if sess.db is not None:
                with contextlib.suppress(Exception):
                    sess.db.close()
        self.t.served += 1
        self._judge_state(got, reported, m, where)
        shutil.rmtree(d, ignore_errors=True)

    def _repaired(self, sess: Session) -> bool:
        for q in sess.queues.values():
            st = q.stats()
            if st.repaired_on_open or (q._payload is not None and q._payload.stats()["torn_bytes_dropped"]):
                return True
        return any(m.store.stats()["torn_bytes_dropped"] for m in sess.maps.values())

    def _judge_state(self, got: tuple[Any, ...], reported: bool, m: Mutation, where: str) -> None:
        g = self.g
        truths = [g.truth, *g.alt_truths]
        if got in truths:
            return
        for ci, (name, rows) in enumerate(got):
            tr = [dict((r[0], r) if len(r) == 8 else r for r in t[ci][1]) for t in truths]
            for r in rows:
                if len(r) == 8:
                    if r[7] == NOBODY:
                        self.t.add("header_without_body", f"{where} :: {name}: row {r[0]} has no body")
                        return
                    if any(r[0] in t and t[r[0]] == r for t in tr):
                        continue
                    if r[7] not in g.payloads:
                        self.t.add("wrong_data", f"{where} :: {name}: row {r[0]} payload never pushed")
                        return
                    if m.desc != "rollback" and not reported:
                        self.t.add(
                            "silent_stale",
                            f"{where} :: {name}: row {r[0]} differs from the truth "
                            f"{r[1:7]}, nothing reported",
                        )
                        return
                else:
                    k, v = r
                    if any(k in t and t[k] == v for t in tr):
                        continue
                    if msgpack.packb(v, use_bin_type=True) not in g.map_values.get(b"b" + k, set()):
                        self.t.add("wrong_data", f"{where} :: {name}: key {k!r} holds a value never put")
                        return
                    if m.desc != "rollback" and not reported:
                        self.t.add("silent_stale", f"{where} :: {name}: key {k!r} is stale, nothing reported")
                        return
            got_ids = {r[0] for r in rows}
            lost = [k for k in set.intersection(*(set(t) for t in tr)) if k not in got_ids]
            if lost and not reported and m.desc != "rollback":
                self.t.add(
                    "silent_loss",
                    f"{where} :: {name}: {len(lost)} item(s) gone, nothing reported (e.g. {lost[0]!r})",
                )
                return


# ---------------------------------------------------------------------------------------------
# Driving
# ---------------------------------------------------------------------------------------------


def run_mutations(names: list[str], total: int, seed: int, scratch: str) -> MTally:
    tally = MTally()
    rng = random.Random(seed)
    goldens = [build_golden(n, os.path.join(scratch, "golden")) for n in names]
    per_golden = total // len(goldens)
    for g in goldens:
        ck = Checker(g, scratch, tally)
        datas = {}
        for rel in g.files:
            with open(os.path.join(g.path, rel), "rb") as f:
                datas[rel] = f.read()
        # Small files get every offset x 4 kinds; the rest of the budget goes to big files.
        caps = {rel: 4 * len(d) for rel, d in datas.items()}
        share: dict[str, int] = {}
        left, open_files = per_golden, sorted(datas, key=lambda r: caps[r])
        while open_files:
            each = max(8, left // len(open_files))
            rel = open_files.pop(0)
            share[rel] = min(caps[rel], each) if open_files else max(8, left)
            left -= share[rel]
        cases: list[Mutation] = []
        for rel, data in datas.items():
            cases += mutations_for(g, rel, data, rng, share[rel])
        # Whole-file mutations first (every one is checked), then the rest in random order.
        whole = [m for m in cases if m.desc in ("delete", "rollback", "zext+4096", "zext+13", "garbage+40")]
        rest = [m for m in cases if m not in whole]
        rng.shuffle(rest)
        for i, m in enumerate(whole + rest[: max(0, per_golden - len(whole))]):
            ck.check(m, full=(i % FULL_EVERY == 0))
    return tally


_TOTAL = MTally()


@pytest.fixture(scope="module", autouse=True)
def _summary(request: pytest.FixtureRequest):
    t0 = time.monotonic()
    with quiet_armdb_log():
        yield
    v = _TOTAL
    line = (
        f"RELIABILITY mutation states=0 faults=0 mutations={v.mutations} violations={sum(v.violations.values())} "
        f"untyped_exceptions={v.untyped} fd_leaks=0 full_reopens={v.full_reopens} refused={v.refused} "
        f"served={v.served} slowest_case={v.slowest:.2f}s by_class={dict(v.violations) or '{}'} "
        f"seconds={time.monotonic() - t0:.0f}"
    )
    report_line(line, request)


@pytest.fixture
def scratch() -> Any:
    d = fast_tmpdir("armdb-mut-")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _finish(t: MTally, what: str) -> None:
    _TOTAL.merge(t)
    n = sum(t.violations.values())
    if n:
        lines = "\n".join(
            f"  {c} x {sig}\n      e.g. {t.sig_example[sig][:500]}" for sig, c in t.signatures.most_common(14)
        )
        pytest.fail(
            f"{what}: {n} violation(s) in {t.mutations} mutated files ({dict(t.violations)}), grouped:\n{lines}",
            pytrace=False,
        )


@pytest.mark.parametrize("name", sorted(GOLDEN_SPECS))
def test_mutation(name: str, scratch: str) -> None:
    """Every file of one golden store, mutated: typed refusal or the truth, never wrong data."""
    t = run_mutations([name], CI_MUTATIONS // len(GOLDEN_SPECS), seed=len(name), scratch=scratch)
    _finish(t, f"mutations of golden store {name}")


@pytest.mark.slow
@pytest.mark.timeout(0)
def test_mutation_nightly(scratch: str) -> None:
    t = run_mutations(sorted(GOLDEN_SPECS), NIGHTLY_MUTATIONS, seed=12345, scratch=scratch)
    _finish(t, "mutations, nightly size")


# ---------------------------------------------------------------------------------------------
# Regressions: one deterministic mutation per bug class the sweep found (kept forever)
# ---------------------------------------------------------------------------------------------


def _fixed_db(path: str, rows: int = 6) -> str:
    s = Session(FIXED, path).open()
    for _ in range(rows):
        s.run("push:fq")
    s.close()
    return os.path.join(path, "collections", "fq", "shard-000", "fixed.data")


def _slot_size(path: str) -> int:
    with open(path, "rb") as f:
        return decode_header(f.read(HEADER_PAGE), path)[0]


def _refused_and_reported(path: str, world: World) -> str:
    """check() names the damage, and open refuses it with CorruptionError (its message)."""
    rep = armdb.check(path)
    assert not rep.ok and any("high-water mark" in f for f in rep.findings), rep.findings
    with pytest.raises(CorruptionError, match="high-water mark") as ei:
        Session(world, path).open()
    return str(ei.value)


def test_s4_truncated_fixed_data_is_reported(scratch: str) -> None:
    """S4/D6: a fixed.data cut short (a lost extent, a bad copy) used to lose every row
    past the cut silently: open zero-extends the file back to whole grow steps and the
    missing slots read as never written.  The persisted high-water mark exposes it."""
    d = os.path.join(scratch, "db")
    path = _fixed_db(d)
    with open(path, "r+b") as f:
        f.truncate(HEADER_PAGE + _slot_size(path))  # keep slot 0 only
    assert "5 slot(s)" in _refused_and_reported(d, FIXED)


def test_s11_zeroed_slot_of_a_live_row_is_reported(scratch: str) -> None:
    """S11/S4: a zero-filled slot is "free" by design, so a page of zeros over live rows
    (LavinMQ's zero-filled segment) used to drop them silently.  Slots are handed out
    lowest first, so a zero slot below the high-water mark is damage: refused."""
    d = os.path.join(scratch, "db")
    path = _fixed_db(d)
    with open(path, "r+b") as f:
        size = _slot_size(path)
        f.seek(HEADER_PAGE + size)  # slot 1
        f.write(bytes(size))
    assert "first: slot 1" in _refused_and_reported(d, FIXED)


def test_s11_high_water_mark_survives_a_torn_copy(scratch: str) -> None:
    """The mark has two copies written alternately: one damaged copy (a power cut mid-
    update) leaves the other, and open neither refuses a healthy file nor loses the mark."""
    d = os.path.join(scratch, "db")
    path = _fixed_db(d)
    redo = os.path.join(os.path.dirname(path), "fixed.redo")
    with open(path, "rb") as a, open(redo, "rb") as b:
        gen, mark = read_hwm(a.read(HEADER_PAGE), b.read(64))
    assert mark == 6
    with open(path if gen % 2 else redo, "r+b") as f:  # the newer copy
        f.seek((512 if gen % 2 else 32) + 3)
        f.write(b"\xff")
    s = Session(FIXED, d).open()
    try:
        assert next(iter(s.queues.values())).len() == 6
    finally:
        s.close()
    assert armdb.check(d).ok


def test_q15_row_without_body_is_caught_at_open(scratch: str) -> None:
    """Q15/I4/D6: when a var queue's payload data file is lost (deleted, rolled back), the
    headers point at missing bodies.  Neither open nor check() notices; every lease that
    reaches such a row raises FormatError("row has no body") and the rows behind it
    starve.  Open must refuse (CorruptionError) or check() must report the rows."""
    d = os.path.join(scratch, "db")
    s = Session(VAR, d).open()
    for _ in range(3):
        s.run("push:vq")
    s.close()
    data = os.path.join(d, "collections", "vq.payload", "shard-000", "00000001.data")
    with open(data, "r+b") as f:
        f.truncate(bitcask.DATA_START)  # cut at a record boundary: a valid, empty file
    pre = armdb.check(d)
    try:
        s = Session(VAR, d).open()
    except CorruptionError:
        return
    try:
        lease_error = None
        try:
            s.queues["vq"].lease(1)
        except ArmdbError as e:
            lease_error = e
    finally:
        s.close()
    assert not pre.ok or lease_error is None, (
        f"open and check() accepted rows without bodies; lease then raised {lease_error!r}"
    )


def test_d6_deleted_active_data_file_is_reported(scratch: str) -> None:
    """D6/S7: the map_hints golden keeps its newest values in the active data file and
    older ones in a compaction output; deleting the active file must be refused or
    reported, not serve the older values as current."""
    g = build_golden("map_hints", scratch)
    sdir = os.path.join(g.path, "collections", "m", "shard-000")
    active = max(f for f in os.listdir(sdir) if f.endswith(".data") and not os.path.exists(
        os.path.join(sdir, f[: -len(".data")] + ".hint")))
    os.unlink(os.path.join(sdir, active))
    if not armdb.check(g.path).ok:
        return
    try:
        s = Session(MAP, g.path).open()
    except CorruptionError:
        return
    try:
        got = s.capture()
    finally:
        s.close()
    assert got == g.truth, "older values served as current after the active data file was deleted"
