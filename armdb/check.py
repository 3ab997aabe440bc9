"""``armdb.check``: a read-only consistency check of a closed database (SPEC D6, RELIABILITY I9).

Like ``PRAGMA integrity_check`` or diskcache's ``Cache.check``, it reads every file
the library wrote and reports what does not add up, one readable line per problem.
It never repairs: recovery is the job of the next ``Db.open`` (torn slots are freed,
torn Bitcask tails truncated, orphan bodies collected), and tests call ``check``
after every reopen to prove that recovery left a clean store.

What it checks:

* the database: ``db.meta`` (magic, version, CRC) and ``seqmap`` (magic, version,
  CRC); leftover ``*.tmp`` files anywhere under the directory (an interrupted
  tmp + rename that recovery should have cleaned up);
* every queue (a collection with ``queue.meta``): the meta file, one
  ``shard-NNN/fixed.data`` per stored shard with a matching header page and slot
  geometry, every slot's CRC (``armdb.fixed.check_shard_file``), and each occupied
  slot's row against the rules open applies (``armdb.queue.row_problems``: a valid
  state, the dead key class (bit 63 of the due word) set exactly on DEAD rows, a
  plausible lease deadline, a row id other than 0 in the shard its id selects,
  attempts a retry can count, a payload id equal to the row id for a var queue and 0
  for a fixed one), a row id that is not duplicated in any shard and lies below the
  id block reserved in ``seqmap`` (T5), and for a var queue an existing
  ``<name>.payload`` store;
* every other collection is a Bitcask store, checked by ``armdb.bitcask.check_dir``;
* the transaction log ``txlog/``, checked by ``_check_log_dir``.

Encrypted parts (SPEC C4): with ``encryption_key`` (one key or several; each encrypted
collection takes the one whose check value its meta file holds, ``armdb.dbkeys``) every
record of an encrypted collection is opened under its key (the authentication tags of its
sealed key and value) and a map's plaintexts are decoded; with ``log_encryption_key`` (by
default whichever collection key is the log's) every sealed log record is opened and its
rows are checked like those of an unsealed one.  Without a key, only what the CRCs cover
is checked there: the report lists what was not verified in ``unverified``.

Locking: on a directory it may write, ``check`` takes the directory lock exactly like
``Db.open`` (so it raises ``DbLocked`` while the database is open anywhere) and
releases it before returning; taking the lock rewrites the pid in ``LOCK``, as every
open does.  On a directory it cannot write (a read-only mount, a backup, SPEC D10) it
only locks an existing ``LOCK`` read-only, which still sees a live owner, and writes
nothing at all.  Nothing else is ever written, created, truncated or renamed.  All file access goes through
``armdb._fs`` like the rest of the library.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _fs, bitcask, logformat, replay
from ._crypto import Sealer
from .dbkeys import Keys, normalize_keys, resolve_keys
from .errors import ConfigError, CorruptionError, FormatError, WrongKey
from .fixed import FILE_NAME as FIXED_FILE
from .fixed import check_shard_file, slot_size_for
from .inspect import read_shard
from .layout import (
    COLLECTIONS,
    META_FILE,
    NAME_RE,
    PAYLOAD_SUFFIX,
    QUEUE_META,
    TXLOG_DIR,
    DirLock,
    check_meta,
)
from .mapcodec import decode_key, decode_value
from .qrows import HEADER_SIZE, KEY_SIZE, decode_meta, row_problems
from .seqmap import FILE_NAME as SEQMAP_FILE
from .seqmap import decode as decode_seqmap

__all__ = ["CheckReport", "check"]


#: At most this many examples are named in one finding (slots, ids).
_EXAMPLES = 5


@dataclass(frozen=True)
class CheckReport:
    """The result of :func:`check`.

    Attributes
    ----------
    ok : bool
        ``True`` when nothing was found.
    findings : list of str
        One readable line per problem, each naming the file it concerns.
    unverified : list of str
        What could not be verified for want of a key: encrypted collections and sealed
        log records whose authentication tags were not checked (their CRCs were).  Not
        findings: ``ok`` does not depend on them.
    """

    ok: bool
    findings: list[str] = field(default_factory=list)
    unverified: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        if self.ok:
            lines = ["armdb.check: OK (no findings)"]
        else:
            lines = [f"armdb.check: {len(self.findings)} finding(s)"]
            lines += [f"  - {f}" for f in self.findings]
        if self.unverified:
            lines.append(f"not verified without a key ({len(self.unverified)}):")
            lines += [f"  - {u}" for u in self.unverified]
        return "\n".join(lines)


def check(
    path: str | os.PathLike[str],
    *,
    encryption_key: bytes | Sequence[bytes] | None = None,
    log_encryption_key: bytes | None = None,
) -> CheckReport:
    """Check a database that is not open, without changing it (D6).

    Parameters
    ----------
    path : str or os.PathLike
        The database directory.
    encryption_key : bytes or sequence of bytes, optional
        The key of its encrypted collections (``Config.encryption_key``), or several
        keys; each encrypted collection takes the one it was created with.  With it,
        every sealed key and value is opened (its authentication tag verified) and a
        map's are decoded.  Without it, encrypted records are checked by CRC only.
    log_encryption_key : bytes, optional
        The transaction log key (``TxConfig.log_encryption_key``); by default the key
        among ``encryption_key`` that is the log's, if any.  With it, every sealed log
        record is opened and its rows checked.

    Returns
    -------
    CheckReport
        ``report.ok`` and ``report.findings`` (readable lines; empty when ok).  A
        path that is not an armdb database gives a report that is not ok.

    Raises
    ------
    DbLocked
        The database is open, in this process or another one.
    ConfigError
        Its ``LOCK`` is not a regular file of its own (a symbolic link, a folder...), or
        a key is not 32 bytes.
    WrongKey
        ``log_encryption_key`` is not the database's log key, or a key of
        ``encryption_key`` opens none of its encrypted collections (and is not the log
        key either).  Checked before any record is read.
    """
    keys = normalize_keys(encryption_key, "encryption_key")
    if log_encryption_key is not None and not isinstance(log_encryption_key, (bytes, bytearray)):
        raise ConfigError(f"log_encryption_key must be one 32-byte key (bytes), got {type(log_encryption_key).__name__}")
    log_key = normalize_keys(log_encryption_key, "log_encryption_key")
    return _check(path, keys, log_key[0] if log_key else None)


def _check(
    path: str | os.PathLike[str],
    keys: Sequence[bytes],
    log_key: bytes | None,
    labels: Sequence[str] | None = None,
    log_label: str = "log_encryption_key",
) -> CheckReport:
    """:func:`check` with validated keys; ``labels`` name them in ``WrongKey`` messages
    (the command line names its key files)."""
    directory = os.path.abspath(os.fspath(path))
    fs = _fs.FS
    if not fs.isdir(directory):
        return CheckReport(False, [f"{directory}: no such database directory"])
    if not fs.exists(os.path.join(directory, META_FILE)):
        # Not ours (or never opened): do not even create a LOCK file in it.
        return CheckReport(False, [f"{directory}: not an armdb database ({META_FILE} is missing)"])
    lock = DirLock.for_inspection(directory)
    try:
        resolved = resolve_keys(directory, keys, log_key, labels=labels, log_label=log_label)
        checker = _Checker(directory, resolved)
        findings = checker.run()
    finally:
        lock.release()
    return CheckReport(not findings, findings, checker.unverified)


class _Checker:
    def __init__(self, directory: str, keys: Keys | None = None) -> None:
        self.directory = directory
        self.keys = keys if keys is not None else Keys()
        self.fs = _fs.FS
        self.findings: list[str] = []
        self.unverified: list[str] = []
        self.reserved: dict[str, int] | None = None

    def add(self, line: str) -> None:
        self.findings.append(line)

    def rel(self, path: str) -> str:
        """A path as shown in findings: relative to the database when inside it."""
        inside = path.startswith(self.directory + os.sep)
        return os.path.relpath(path, self.directory) if inside else path

    def read(self, path: str) -> bytes | None:
        try:
            return self.fs.read_file(path)
        except OSError as e:
            self.add(f"{self.rel(path)}: cannot read ({e})")
            return None

    # -- the database ------------------------------------------------------------------
    def run(self) -> list[str]:
        meta = os.path.join(self.directory, META_FILE)
        raw = self.read(meta)
        if raw is not None:
            try:
                check_meta(raw, meta)
            except FormatError as e:
                self.add(str(e))
        seqmap = os.path.join(self.directory, SEQMAP_FILE)
        if self.fs.exists(seqmap):
            raw = self.read(seqmap)
            if raw is not None:
                try:
                    self.reserved = decode_seqmap(raw, seqmap)
                except FormatError as e:
                    self.add(str(e))
        else:
            self.reserved = {}  # created on the first id handed out
        self.find_tmp(self.directory)
        self.check_txlog(os.path.join(self.directory, TXLOG_DIR))
        cdir = os.path.join(self.directory, COLLECTIONS)
        if self.fs.isdir(cdir):
            names = self.fs.listdir(cdir)
            queues: dict[str, dict[str, Any] | None] = {}
            for name in names:
                d = os.path.join(cdir, name)
                if not self.fs.isdir(d):
                    if not name.endswith(".tmp"):  # tmp files are reported by find_tmp
                        self.add(f"{self.rel(d)}: unexpected file among the collections")
                    continue
                if not NAME_RE.fullmatch(name):
                    self.add(f"{self.rel(d)}: {name!r} is not a valid collection name")
                if self.fs.exists(os.path.join(d, QUEUE_META)):
                    queues[name] = self.check_queue(d, name)
            for name in names:
                d = os.path.join(cdir, name)
                if name in queues or not self.fs.isdir(d):
                    continue
                if self.fs.exists(os.path.join(d, QUEUE_META + ".tmp")):
                    self.add(
                        f"{self.rel(d)}: creation of queue {name!r} was interrupted "
                        f"({QUEUE_META}.tmp without {QUEUE_META})"
                    )
                    continue
                if name.endswith(PAYLOAD_SUFFIX):
                    owner = name[: -len(PAYLOAD_SUFFIX)]
                    owner_meta = queues.get(owner)
                    if owner not in queues:
                        self.add(f"{self.rel(d)}: payload store of queue {owner!r}, which does not exist")
                    elif owner_meta is not None and not owner_meta.get("var"):
                        self.add(f"{self.rel(d)}: payload store of {owner!r}, which is a fixed queue")
                self.check_bitcask(d)
        return self.findings

    def find_tmp(self, directory: str) -> None:
        """Report every ``*.tmp`` file: a tmp + rename that was never finished or cleaned.

        Bitcask collections are left to ``bitcask.check_dir``, which reports its own.
        """
        cdir = os.path.join(self.directory, COLLECTIONS)
        for entry in self.fs.listdir(directory):
            p = os.path.join(directory, entry)
            if self.fs.isdir(p):
                if directory == cdir and not self.fs.exists(os.path.join(p, QUEUE_META)):
                    continue  # a Bitcask collection: bitcask.check_dir reports its own
                if directory == self.directory and entry == TXLOG_DIR:
                    continue  # _check_log_dir reports its own
                self.find_tmp(p)
            elif entry.endswith(".tmp"):
                self.add(f"{self.rel(p)}: leftover temporary file (an interrupted atomic write)")

    # -- transaction log ----------------------------------------------------------------------
    def check_txlog(self, d: str) -> None:
        if not self.fs.isdir(d):
            return
        try:
            found = _check_log_dir(d, self.keys, self.unverified)
        except WrongKey:
            raise
        except Exception as e:  # noqa: BLE001 - a checker reports, it never crashes on bad input
            self.add(f"{self.rel(d)}: transaction log check failed with {type(e).__name__}: {e}")
            return
        self.findings.extend(str(f) for f in found)
        # What the replay would leave in each queue shard: a logged slot write must not
        # put a row id in a second slot (the queue's open refuses such a shard).
        try:
            self.findings.extend(_log_conflicts(d, self.keys))
        except Exception as e:  # noqa: BLE001 - a checker reports, it never crashes on bad input
            self.add(f"{self.rel(d)}: judging the logged slot writes failed with {type(e).__name__}: {e}")

    # -- Bitcask collections ---------------------------------------------------------------
    def check_bitcask(self, d: str) -> None:
        # Every gsn is reserved in seqmap before it reaches a file (T5).
        limit = self.reserved.get("gsn") if self.reserved else None
        kwargs: dict[str, Any] = {} if limit is None else {"gsn_limit": limit}
        name = os.path.basename(d)
        if not name.endswith(PAYLOAD_SUFFIX):  # a map: its keys and values must decode
            kwargs["decode"] = lambda k, v: (decode_key(k), decode_value(v))
        key = self.keys.collections.get(name)
        if key is not None:
            kwargs["key"] = key
        elif name in self.keys.locked:
            self.unverified.append(
                f"{self.rel(d)}: encrypted, and no key given opens it: its records' authentication tags were not "
                f"checked{'' if name.endswith(PAYLOAD_SUFFIX) else ' nor its keys and values decoded'} "
                f"(give its key)"
            )
        try:
            found = bitcask.check_dir(d, **kwargs)
        except WrongKey:
            raise
        except Exception as e:  # noqa: BLE001 - a checker reports, it never crashes on bad input
            self.add(f"{self.rel(d)}: Bitcask check failed with {type(e).__name__}: {e}")
            return
        self.findings.extend(str(f) for f in found)

    # -- queues -------------------------------------------------------------------------------
    def check_queue(self, d: str, name: str) -> dict[str, Any] | None:
        meta_path = os.path.join(d, QUEUE_META)
        raw = self.read(meta_path)
        if raw is None:
            return None
        try:
            meta = decode_meta(raw, meta_path)
        except FormatError as e:
            self.add(str(e))
            return None
        except Exception as e:  # noqa: BLE001 - CRC matched but the body is not what we wrote
            self.add(f"{self.rel(meta_path)}: undecodable body ({type(e).__name__}: {e})")
            return None
        try:
            var = meta["var"]
            shard_count = meta["shard_count"]
            key_size = meta["key_size"]
            value_size = meta["value_size"]
        except (KeyError, TypeError):
            self.add(
                f"{self.rel(meta_path)}: missing fields (has {sorted(meta) if isinstance(meta, dict) else meta!r})"
            )
            return None
        if not isinstance(var, bool) or not isinstance(shard_count, int) or shard_count < 1:
            self.add(f"{self.rel(meta_path)}: bad var flag {var!r} or shard count {shard_count!r}")
            return None
        if (
            key_size != KEY_SIZE
            or not isinstance(value_size, int)
            or (value_size != HEADER_SIZE if var else value_size <= HEADER_SIZE)
        ):
            self.add(
                f"{self.rel(meta_path)}: slot geometry {key_size}+{value_size} is impossible for a "
                f"{'var' if var else 'fixed'} queue"
            )
            return None

        expected = [f"shard-{i:03d}" for i in range(shard_count)]
        for entry in self.fs.listdir(d):
            if entry.startswith("shard-") and entry not in expected:
                self.add(
                    f"{self.rel(os.path.join(d, entry))}: shard folder beyond the stored count {shard_count}"
                )

        seen: dict[int, tuple[int, int]] = {}  # row id -> (shard, slot) of its first sighting
        dups: list[str] = []
        max_seq = 0
        rows_total = 0
        for i, sdir in enumerate(expected):
            path = os.path.join(d, sdir, FIXED_FILE)
            rel = self.rel(path)
            if not self.fs.exists(path):
                self.add(f"{rel}: missing (the queue stores {shard_count} shard(s))")
                continue
            self.findings.extend(check_shard_file(path, key_size, value_size))
            data = self.read(path)
            if data is None:
                continue
            try:
                sr = read_shard(data, path)
            except FormatError:
                continue  # already reported by check_shard_file
            if (sr.slot_size, sr.key_size, sr.value_size) != (slot_size_for(key_size, value_size), key_size,
                                                              value_size):
                continue  # a geometry open refuses, reported by check_shard_file: the slots cannot be read
            if sr.shard != i:
                self.add(f"{rel}: header says shard {sr.shard}, but it is in folder {sdir}")
            if sr.tail.strip(b"\0"):
                self.add(f"{rel}: a partial slot at the end of the file holds data")
            occ = sr.occupied
            if occ.size == 0:
                continue
            rows_total += int(occ.size)
            rows = sr.rows
            seq = rows["seq"].astype(np.uint64)
            # The rules open applies (qrows.row_problems); every broken one is a finding,
            # whether open refuses the shard, repairs the rows or serves them as they are.
            for problem in row_problems(rows, i, shard_count, var, duplicates=False):
                self.rows_problem(rel, occ, problem.bad, problem.what)
            for slot, s in zip(occ.tolist(), seq.tolist()):
                if s in seen:
                    fs_, fsl = seen[s]
                    dups.append(f"id {s} in shard {fs_} slot {fsl} and shard {i} slot {slot}")
                else:
                    seen[s] = (i, slot)
            max_seq = max(max_seq, int(seq.max()))
        if dups:
            self.add(f"{self.rel(d)}: {len(dups)} row id(s) stored twice ({'; '.join(dups[:_EXAMPLES])})")
        if self.reserved is not None and max_seq:
            end = self.reserved.get("q:" + name, 1)
            if max_seq >= end:
                self.add(
                    f"{self.rel(d)}: row id {max_seq} is not below the ids reserved in seqmap ({end}); "
                    f"a later push could reuse an id"
                )
        if var and rows_total and not self.fs.isdir(os.path.join(os.path.dirname(d), name + PAYLOAD_SUFFIX)):
            self.add(
                f"{self.rel(d)}: var queue holds {rows_total} row(s) but its payload store {name}.payload is missing"
            )
        return meta

    def rows_problem(self, rel: str, occ: np.ndarray, bad: np.ndarray, what: str) -> None:
        bad = np.asarray(bad, dtype=bool)
        k = int(bad.sum())
        if k:
            self.add(f"{rel}: {k} row(s) {what} (slots {occ[bad][:_EXAMPLES].tolist()})")


def _open_sealed(sealer: Sealer, keys: Keys, version: int, txid: int, body: bytes) -> bytes | None:
    """A sealed record's plaintext body, or None when its tag fails under the log key."""
    try:
        return sealer.open(body, logformat.record_aad(version, keys.db_id, txid))
    except CorruptionError:
        return None


def _check_log_dir(path: str, keys: Keys | None = None, unverified: list[str] | None = None) -> list[str]:
    """Read-only check of ``<db>/txlog`` for ``armdb.check``.

    Besides the framing (header, magic, length, CRC) every record's txid and every row
    is checked as open checks it before replay.  A sealed body is opened with the log key
    (``keys.log_key``) first; without the key its rows are not checked, and a line in
    ``unverified`` says so.

    Raises ``WrongKey`` when the log key could not be matched to ``db.meta`` (a database
    that never recorded one) and opens none of the sealed records."""
    fs = _fs.FS
    keys = keys if keys is not None else Keys()
    sealer = Sealer(keys.log_key) if keys.log_key is not None else None
    sealed = opened = 0
    failed: list[str] = []
    findings: list[str] = []
    if not fs.exists(path):
        return findings
    collections = os.path.join(os.path.dirname(path), COLLECTIONS)
    geometries: dict[str, replay.FixedGeometry] = {}
    seq_path = os.path.join(os.path.dirname(path), SEQMAP_FILE)
    try:
        reserved = decode_seqmap(fs.read_file(seq_path), seq_path).get("gsn") if fs.exists(seq_path) else None
    except FormatError:
        reserved = None  # armdb.check reports the seqmap itself
    limit = replay.gsn_limit(reserved)

    def geometry(name: str) -> replay.FixedGeometry:
        if name not in geometries:
            geometries[name] = replay.fixed_geometry(os.path.join(collections, name))
        return geometries[name]

    names = fs.listdir(path)
    logs = sorted(n for n in names if logformat._NAME_RE.match(n))
    for n in names:
        if n.endswith(".tmp"):
            findings.append(f"{os.path.join(path, n)}: leftover temporary file")
    for name in logs:
        p = os.path.join(path, name)
        raw = fs.read_file(p)
        try:
            _number, version = logformat._file_header_fields(raw, p)
        except FormatError as e:
            findings.append(str(e))
            continue
        mark = logformat.synced_mark(raw, version, path)
        recs, end, bad = logformat._records_at(raw, logformat.records_start(version))
        gone = logformat.records_below_mark(p, raw, end, bad, mark)
        if gone is not None:
            findings.append(f"{gone}, and open refuses the log")
        if bad is not None:
            findings.append(logformat._tail_finding(raw, p, bad, version, mark))
        for offset, txid, flags, body in recs:
            rec = logformat._Logged(txid, flags, body, p, offset)
            plain: bytes | None = body
            if flags & logformat.FLAG_SEALED:
                sealed += 1
                plain = None if sealer is None else _open_sealed(sealer, keys, version, txid, body)
                if plain is not None:
                    opened += 1
                elif sealer is not None:
                    failed.append(
                        f"{rec.where}: the sealed body fails its authentication tag under the log key (altered bytes, "
                        f"or a record of another database): open refuses the database; salvage with the log key "
                        f"cuts the log there, or restore the database from a backup"
                    )
            try:
                logformat._check_txid(rec)
                if plain is not None:
                    for row in logformat._rows(plain, rec.where):
                        replay.check_row(row, rec.where, collections, geometry, limit)
            except (CorruptionError, FormatError) as e:
                findings.append(str(e))
    if sealer is not None and sealed and not opened and not keys.log_checked:
        raise WrongKey(
            "the transaction log key given opens none of the log's sealed records (and db.meta keeps no check "
            "value to tell a wrong key from damage); give the key the log was written with"
        )
    findings.extend(failed)
    if sealed and sealer is None and unverified is not None:
        unverified.append(
            f"{os.path.basename(path)}: {sealed} sealed record(s): their authentication tags were not checked nor "
            f"their rows judged (give the log key)"
        )
    return findings


def _log_conflicts(txlog_dir: str, keys: Keys | None = None) -> list[str]:
    """Check's view of :func:`armdb.replay.replay_conflicts`: the logged slot writes of every
    record, in the order open replays them, judged against each queue shard.

    Rows that ``armdb.replay.check_row`` refuses are left out (``_check_log_dir`` reports
    them); with a sealed record that the log key (``keys.log_key``) does not open, or
    without the key, nothing is judged (what it writes cannot be read)."""
    fs = _fs.FS
    keys = keys if keys is not None else Keys()
    sealer = Sealer(keys.log_key) if keys.log_key is not None else None
    db_dir = os.path.dirname(txlog_dir)
    collections = os.path.join(db_dir, COLLECTIONS)
    seq_path = os.path.join(db_dir, SEQMAP_FILE)
    try:
        reserved = decode_seqmap(fs.read_file(seq_path), seq_path).get("gsn") if fs.exists(seq_path) else None
    except Exception:  # noqa: BLE001 - armdb.check reports the seqmap itself
        reserved = None
    limit = replay.gsn_limit(reserved)
    geometries: dict[str, replay.FixedGeometry] = {}

    def geometry(name: str) -> replay.FixedGeometry:
        if name not in geometries:
            geometries[name] = replay.fixed_geometry(os.path.join(collections, name))
        return geometries[name]

    writes: dict[tuple[str, int], list[replay.LoggedSlot]] = {}
    for name in sorted(n for n in fs.listdir(txlog_dir) if logformat._NAME_RE.match(n)):
        path = os.path.join(txlog_dir, name)
        raw = fs.read_file(path)
        try:
            _number, version = logformat._file_header_fields(raw, path)
        except Exception:  # noqa: BLE001 - reported by logformat.check_dir
            continue
        recs, _, _ = logformat._records_at(raw, logformat.records_start(version))
        for offset, txid, flags, body in recs:
            if flags & logformat.FLAG_SEALED:
                plain = None if sealer is None else _open_sealed(sealer, keys, version, txid, body)
                if plain is None:
                    return []
                body = plain
            where = f"{path}: transaction log record at offset {offset}"
            try:
                rows = logformat._rows(body, where)
            except Exception:  # noqa: BLE001 - reported by logformat.check_dir
                continue
            for row in rows:
                try:
                    replay.check_row(row, where, collections, geometry, limit)
                except Exception:  # noqa: BLE001 - reported by logformat.check_dir
                    continue
                if row[0] == "F":
                    _, qname, shard, slot, slot_version, status, rbody = row
                    logged = replay.LoggedSlot(slot, slot_version, status, rbody, where)
                    writes.setdefault((qname, shard), []).append(logged)
    findings: list[str] = []
    for (qname, shard), ws in writes.items():
        g = geometry(qname)
        data = os.path.join(collections, qname, f"shard-{shard:03d}", FIXED_FILE)
        try:
            found = replay.replay_conflicts(data, g.body_size + 8, ws)
        except (OSError, ValueError) as e:
            findings.append(f"{data}: cannot judge the logged slot writes ({type(e).__name__}: {e})")
            continue
        findings.extend(str(replay.bad_record(where, f"queue {qname!r} shard {shard}: the record {what}"))
                        for where, what in found)
    return findings
