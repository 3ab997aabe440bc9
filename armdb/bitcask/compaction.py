"""Compaction of a Bitcask shard's immutable data files (SPEC S8).

A round rewrites the live records of some input files into one new data file, then
removes the inputs, in separate steps whose order on disk is what makes a crash at any
point harmless (see :func:`_compact_round`): :func:`_copy` writes the new file and its
hint as temporaries, :func:`_publish` renames them into place, :func:`_commit_round`
points the index at the new copies, and :func:`_retire` removes the inputs behind a
compaction marker (``compaction.pending``), all or none across a crash.  Open finishes
a round that a crash interrupted after its marker (``armdb.bitcask.recovery``).

Lock policy (``armdb.bitcask.shard`` states it whole): a round runs under the shard's
``compact_lock``, which it is given already held; it copies from the immutable inputs
without the shard's ``lock`` and takes ``lock`` in short sections only: to draw the
output's file id, to classify a batch of records, to commit the new locations, to sync
the active file, and to drop and close the inputs.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .. import _fail, _fs
from ..errors import ArmdbError, CorruptionError, FormatError
from .files import Scanned, _DataFile, _HintBuilder, _iter_hint, _Scan, _storage_error, _Window
from .format import (
    DATA_START,
    FLAG_COMPACTED,
    FLAG_ENCRYPTED,
    PENDING_NAME,
    REC_HEAD,
    REC_HEAD_SIZE,
    TOMBSTONE,
    _encode_pending,
    _hint_name,
    _record_crc,
)
from .shard import _Host, _Shard

log = logging.getLogger("armdb")

_COMPACT_BATCH = 4096
_COPY_FLUSH = 4 << 20


def _take(it: Iterator[Any], n: int) -> list[Any]:
    """Up to ``n`` items from an iterator."""
    out = []
    for item in it:
        out.append(item)
        if len(out) >= n:
            break
    return out


def _compact_all(host: _Host, shards: list[_Shard]) -> int:
    """Compact every shard, each under its ``compact_lock`` (``BitcaskStore.compact``)."""
    done = 0
    for sh in shards:
        with sh.compact_lock:
            try:
                done += _compact_shard(host, sh)
            except OSError as e:
                if isinstance(e, ArmdbError):
                    raise
                raise _storage_error(e, f"compaction of {sh.sdir} failed; no data was lost") from e
    return done


def _auto_compact(host: _Host, sh: _Shard) -> None:
    """Compact after a rotation, unless a compaction of this shard is already running."""
    sh.compact_due = False
    if not sh.compact_lock.acquire(blocking=False):
        return
    try:
        _compact_shard(host, sh)
    except (ArmdbError, OSError) as e:
        log.warning("automatic compaction of %s failed: %s", sh.sdir, e)
    finally:
        sh.compact_lock.release()


def _candidates(host: _Host, sh: _Shard) -> list[int]:
    thr = host.config.compaction_threshold
    return sorted(
        fid
        for fid, f in sh.files.items()
        if f is not sh.active and (f.total == 0 or f.dead / f.total > thr)
    )


def _compact_shard(host: _Host, sh: _Shard) -> int:
    """Compact one shard in rounds of at most ``max_file_size`` live bytes (holds compact_lock)."""
    with sh.lock:
        if host._closed or host._poisoned is not None:
            return 0
        cands = _candidates(host, sh)
    done = 0
    limit = host.config.max_file_size
    while cands:
        inputs: list[_DataFile] = []
        live_sum = 0
        with sh.lock:
            cands = [fid for fid in cands if fid in sh.files]
            for fid in cands:
                f = sh.files[fid]
                live = f.total - f.dead
                if inputs and live_sum + live > limit:
                    break
                inputs.append(f)
                live_sum += live
        if not inputs:
            break
        cands = cands[len(inputs) :]
        done += _compact_round(host, sh, inputs)
    return done


def _plain_key(host: _Host, f: _DataFile, rec: Scanned) -> bytes:
    if host._sealer is None:
        return rec[5]
    return host._sealer.open(rec[5], host._aad(b"K", rec[1]), what=f"{f.path}: key at offset {rec[0]}")


def _file_records(host: _Host, sdir: str, f: _DataFile) -> Iterator[Scanned]:
    """Records of an immutable file: from its hint when usable, else by a strict scan."""
    fs = _fs.FS
    hint_path = os.path.join(sdir, _hint_name(f.fid))
    entries = None
    if fs.exists(hint_path):
        try:
            entries = _iter_hint(fs.read_file(hint_path), hint_path, f, host._encrypted)
        except (FormatError, CorruptionError):
            entries = None
    if entries is not None:
        yield from entries
        return
    scan = _Scan(f.fd, f.size, host._encrypted, f.start)
    yield from scan
    if scan.bad is not None:
        raise CorruptionError(
            f"{f.path}: corrupt or truncated record at offset {scan.bad} in an immutable data file; "
            f"restore the file from a backup"
        )


@dataclass(eq=False)
class _Round:
    """One compaction round of a shard: its inputs, the output as the copy builds it, and
    what the copy decided, for the steps after it."""

    sh: _Shard
    inputs: list[_DataFile]
    in_fids: set[int]
    out: _DataFile | None = None  # the new data file (``<name>.tmp`` until published)
    hint: _HintBuilder | None = None  # its hint builder
    has_hint: bool = False  # the hint was written whole (as ``<name>.hint.tmp``)
    # (key, is_tombstone, old fid, old offset, new offset, size)
    copied: list[tuple[bytes, bool, int, int, int, int]] = field(default_factory=list)
    dropped: list[tuple[bytes, int, int]] = field(default_factory=list)
    dead_keys: set[bytes] = field(default_factory=set)

    def discard(self) -> None:
        """After a failed copy or publish: close the output and remove its temporaries."""
        fs = _fs.FS
        out = self.out
        if out is not None:
            try:
                fs.close(out.fd)
                if fs.exists(out.path + ".tmp"):
                    fs.unlink(out.path + ".tmp")
            except OSError:
                pass
        if self.hint is not None:
            self.hint.abort()


def _compact_round(host: _Host, sh: _Shard, inputs: list[_DataFile]) -> int:
    """Rewrite the live records of ``inputs`` into one new file, then remove them (S8).

    Order on disk: new file written as ``.tmp`` and synced; its hint written as
    ``.tmp`` (:func:`_copy`); both renamed into place and the folder synced
    (:func:`_publish`); the index switched to the new copies (:func:`_commit_round`);
    ``compaction.pending`` (naming every input) written atomically; inputs unlinked;
    folder synced; marker removed (:func:`_retire`).  A crash before the renames leaves
    only temporaries (deleted on open); a crash after them leaves duplicate copies with
    equal gsns (harmless); a crash after the marker is finished by the next open, so
    inputs never vanish one by one (a dropped tombstone could otherwise let an older
    put return).
    """
    r = _Round(sh, inputs, {f.fid for f in inputs})
    try:
        _copy(host, r)
        _publish(host, r)
    except BaseException:
        r.discard()
        raise
    _commit_round(host, sh, inputs, r.in_fids, r.out, r.copied, r.dropped, r.dead_keys)
    return _retire(host, r)


def _copy(host: _Host, r: _Round) -> None:
    """Step 1: copy the current records of the inputs into a new data file, written as
    ``<name>.tmp`` and synced (with ``enable_fsync``), and its hint, written as
    ``<name>.hint.tmp``.  No output is created when no record is current.  Every record
    copied is checked against its CRC first."""
    fs = _fs.FS
    sync = host.config.enable_fsync
    sh = r.sh
    in_fids = r.in_fids
    copied = r.copied
    dropped = r.dropped
    dead_keys = r.dead_keys
    out: _DataFile | None = None
    hint: _HintBuilder | None = None
    pending = bytearray()
    pending_at = new_off = DATA_START  # a new file: of the current format
    for f in r.inputs:
        records = _file_records(host, sh.sdir, f)
        win = _Window(f.fd, f.size)
        while True:
            batch = [(_plain_key(host, f, rec), rec) for rec in _take(records, _COMPACT_BATCH)]
            if not batch:
                break
            keep = _classify(sh, f, in_fids, batch, dropped, dead_keys)
            for key, rec in keep:
                off, gsn_word, klen, vlen, rsize, kf = rec
                data = win.view(off, rsize)
                n = REC_HEAD_SIZE + klen + vlen
                if data is None or REC_HEAD.unpack_from(data)[:2] != (gsn_word, _record_crc(data, n)):
                    raise CorruptionError(
                        f"{f.path}: record at offset {off} fails its CRC check during compaction; "
                        f"restore the file from a backup"
                    )
                if out is None:
                    with sh.lock:
                        fid = sh.next_fid
                        sh.next_fid = fid + 1
                        base = sh.highest
                    flags = FLAG_COMPACTED | (FLAG_ENCRYPTED if host._encrypted else 0)
                    out = r.out = host._new_data_file(sh.sdir, fid, flags, base, tmp=True)
                    hint = r.hint = _HintBuilder(sh.sdir, out)
                assert hint is not None
                pending += data
                hint.add(gsn_word, new_off, vlen, kf)
                copied.append((key, bool(gsn_word & TOMBSTONE), f.fid, off, new_off, rsize))
                new_off += rsize
                if len(pending) >= _COPY_FLUSH:
                    fs.pwrite(out.fd, bytes(pending), pending_at)
                    pending_at += len(pending)
                    pending.clear()
    if out is not None:
        assert hint is not None
        if pending:
            fs.pwrite(out.fd, bytes(pending), pending_at)
        out.size = new_off
        out.total = new_off - out.start
        if sync:
            host._fsync(fs.fdatasync, out.fd, out.path + ".tmp")
        _fail.point("compaction.after_new_file")
        try:
            r.has_hint = hint.finish(out.size, rename=False)
        except OSError as e:
            log.warning(
                "could not write hint file %s: %s (the data file will be scanned)", hint.final, e
            )
            hint.abort()
            r.has_hint = False
        _fail.point("compaction.after_hint")


def _publish(host: _Host, r: _Round) -> None:
    """Step 2: rename the new data file, then its hint, into place, and sync the folder
    (with ``enable_fsync``).  From here the new copies survive a crash (with equal gsns
    to their originals, so which copy open keeps does not matter)."""
    out, hint = r.out, r.hint
    if out is None:
        return
    assert hint is not None
    fs = _fs.FS
    fs.rename(out.path + ".tmp", out.path)
    if r.has_hint:
        fs.rename(hint.tmp, hint.final)
    if host.config.enable_fsync:
        host._fsync(fs.fsync_dir, r.sh.sdir, r.sh.sdir)


def _retire(host: _Host, r: _Round) -> int:
    """Step 4: remove the inputs, all or none across a crash, and return their bytes.

    The active file is synced first (see below); then ``compaction.pending`` names every
    input (written atomically and synced), the inputs are dropped from the file table and
    closed, unlinked with their hints, the folder synced, and the marker removed."""
    fs = _fs.FS
    sync = host.config.enable_fsync
    sh, inputs, out = r.sh, r.inputs, r.out
    # Records judged dead may be superseded only by unsynced appends in the active
    # file: sync it before any input is deleted, or a power loss could take both
    # the new record and the only synced old one.
    with sh.lock:
        if sh.dirty and host._poisoned is None:
            host._fsync(fs.fdatasync, sh.active.fd, sh.active.path)
            host._synced_active(sh)
            sh.dirty = False
            sh.last_sync = time.monotonic()
    # Make the removal of all inputs atomic against a crash: record them first.
    marker = os.path.join(sh.sdir, PENDING_NAME)
    fs.write_file_atomic(marker, _encode_pending(sorted(r.in_fids)))  # always synced, like the meta
    _fail.point("compaction.before_unlink")
    with sh.lock:
        for f in inputs:
            sh.files.pop(f.fid, None)
            try:
                fs.close(f.fd)
            except OSError:
                pass
    for f in inputs:
        fs.unlink(f.path)
        hp = os.path.join(sh.sdir, _hint_name(f.fid))
        if fs.exists(hp):
            fs.unlink(hp)
    if sync:
        host._fsync(fs.fsync_dir, sh.sdir, sh.sdir)
    fs.unlink(marker)
    if sync:
        host._fsync(fs.fsync_dir, sh.sdir, sh.sdir)
    compacted = sum(f.size for f in inputs)
    log.info(
        "compacted %d file(s) of %s (%d bytes) into %s",
        len(inputs),
        sh.sdir,
        compacted,
        out.path if out is not None else "nothing",
    )
    return compacted


def _classify(
    sh: _Shard,
    f: _DataFile,
    in_fids: set[int],
    batch: list[tuple[bytes, Scanned]],
    dropped: list[tuple[bytes, int, int]],
    dead_keys: set[bytes],
) -> list[tuple[bytes, Scanned]]:
    """Pick the records of ``batch`` to copy: current puts and still-needed tombstones."""
    keep = []
    with sh.lock:
        for key, rec in batch:
            off, gsn_word = rec[0], rec[1]
            if gsn_word & TOMBSTONE:
                t = sh.tombs.get(key)
                if t is not None and t[0] == f.fid and t[1] == off:
                    # Needed while a file outside this round may hold an older put.
                    if any(h in sh.files and h not in in_fids for h in (t[4] or ())):
                        keep.append((key, rec))
                    else:
                        dropped.append((key, f.fid, off))
                    continue
            else:
                e = sh.index.get(key)
                if e is not None and e[0] == f.fid and e[1] == off:
                    keep.append((key, rec))
                    continue
            if key in sh.tombs:
                dead_keys.add(key)  # a tombstone elsewhere may stop being needed
    return keep


def _commit_round(
    host: _Host,
    sh: _Shard,
    inputs: list[_DataFile],
    in_fids: set[int],
    out: _DataFile | None,
    copied: list[tuple[bytes, bool, int, int, int, int]],
    dropped: list[tuple[bytes, int, int]],
    dead_keys: set[bytes],
) -> None:
    """Step 3: point the index at the new copies; records superseded meanwhile stay dead."""
    with sh.lock:
        if out is not None:
            sh.files[out.fid] = out
        for key, is_tomb, ofid, ooff, noff, rsize in copied:
            table = sh.tombs if is_tomb else sh.index
            e = table.get(key)
            if out is not None and e is not None and e[0] == ofid and e[1] == ooff:
                table[key] = (out.fid, noff, e[2], e[3], e[4])
            elif out is not None:
                out.dead += rsize
        for key, ofid, ooff in dropped:
            t = sh.tombs.get(key)
            if t is not None and t[0] == ofid and t[1] == ooff:
                del sh.tombs[key]
        for key in dead_keys:
            t = sh.tombs.get(key)
            if t is None or t[0] in in_fids:
                continue
            rest = frozenset(h for h in (t[4] or ()) if h in sh.files and h not in in_fids and h != t[0])
            if not rest:
                del sh.tombs[key]  # nothing older left to mask: garbage now
                tf = sh.files.get(t[0])
                if tf is not None:
                    tf.dead += t[2]
            elif rest != t[4]:
                sh.tombs[key] = (t[0], t[1], t[2], t[3], rest)
        host._compaction_bytes += sum(f.size for f in inputs)
        host._compactions += 1
