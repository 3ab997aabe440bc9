"""Open-time recovery of a Bitcask collection (SPEC S7, S8, D5, D6).

Open runs in three phases, per shard, and changes nothing on disk before the last:

1. :func:`_scan_shard_files` lists the shard's files and checks every header and the
   compaction marker (read-only);
2. :func:`_load_shard` builds the index from the hint files and scans of the data
   files, and :func:`_load_active` judges the active file's tail against its synced
   mark (read-only);
3. :func:`_apply_plan` finishes an interrupted compaction, removes temporaries, cuts a
   torn or unsynced tail, writes missing hint files and returns the shard; an active
   file of an older data format is sealed and appends move to a new file of the
   current format.

A collection that has no meta file yet is created by :func:`_create`.

Lock policy: none.  Recovery runs inside ``BitcaskStore.open`` before the store is
returned, so no other thread can reach the shards it builds.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .. import _fs, _syncmark
from .._crypto import Sealer
from ..config import Config
from ..errors import SALVAGE_HINT, CorruptionError, FormatError
from ..seqmap import MAX_RESERVED
from .files import (
    Scanned,
    _DataFile,
    _HintBuilder,
    _iter_hint,
    _judge_bad,
    _new_nonce,
    _next_valid,
    _read_file_header,
    _records_start_of,
    _Scan,
    _synced_mark,
)
from .format import (
    _DATA_RE,
    _HINT_RE,
    AREA_MARK_DATA_VERSION,
    DATA_MAGIC,
    DATA_START,
    DATA_VERSION,
    FLAG_ENCRYPTED,
    HINT_ENTRY,
    HINT_MAGIC,
    META_NAME,
    PENDING_NAME,
    REC_HEAD_SIZE,
    SEQ_MASK,
    TOMBSTONE,
    _appenders,
    _check_pending,
    _data_header,
    _data_name,
    _decode_pending,
    _encode_meta,
    _Header,
    _hint_name,
    _Meta,
    _new_file_head,
    _parse_header,
    _shard_dir,
)
from .shard import Entry, _Host, _Shard

log = logging.getLogger("armdb")


class _Ingest:
    """Builds a shard's index from records seen in any order (highest gsn wins).

    ``latest`` maps a key to ``(fid, offset, size, gsn_word, seen)`` where
    ``seen`` is None or ``{fid: (max seq, is_put)}`` for the other records of the
    key.  For the common key with one record and no tombstone the tuple is
    already the final index entry, so ``finish`` only revisits the keys listed in
    ``special`` (several records, or a tombstone).
    """

    def __init__(self, unseal: Callable[[bytes, int, int, str], bytes] | None, gsn_limit: int = MAX_RESERVED) -> None:
        self.gsn_limit = gsn_limit  # every gsn on disk is below it (see _gsn_beyond)
        self.latest: dict[bytes, tuple[int, int, int, int, Any]] = {}
        self.special: set[bytes] = set()
        self.dead: dict[int, int] = {}
        self.unseal = unseal
        self.highest = 0

    def add_all(self, f: _DataFile, records: Iterable[Scanned], hint: bytearray | None) -> int:
        """Ingest every record of file ``f``; also encode hint entries into ``hint``.  Returns the count."""
        latest = self.latest
        get = latest.get
        unseal = self.unseal
        fid = f.fid
        hi = self.highest
        pack = HINT_ENTRY.pack
        count = 0
        for off, gsn_word, klen, vlen, rsize, kf in records:
            key = kf if unseal is None else unseal(kf, gsn_word, off, f.path)
            seq = gsn_word & SEQ_MASK
            if seq > hi:
                if seq >= self.gsn_limit:
                    raise _gsn_beyond(f.path, off, seq, self.gsn_limit)
                hi = seq
            cur = get(key)
            if cur is None:
                latest[key] = (fid, off, rsize, gsn_word, None)
                if gsn_word & TOMBSTONE:
                    self.special.add(key)
            else:
                self._update(key, cur, fid, off, rsize, gsn_word)
            if hint is not None:
                hint += pack(gsn_word, off, vlen, klen)
                hint += kf
            count += 1
        self.highest = hi
        return count

    def _update(
        self, key: bytes, cur: tuple[int, int, int, int, Any], fid: int, off: int, size: int, gw: int
    ) -> None:
        self.special.add(key)
        seq = gw & SEQ_MASK
        cseq = cur[3] & SEQ_MASK
        seen = dict(cur[4]) if cur[4] else {}
        if seq > cseq or (seq == cseq and fid > cur[0]):
            _note(seen, cur[0], cseq, not cur[3] & TOMBSTONE)
            self.dead[cur[0]] = self.dead.get(cur[0], 0) + cur[2]
            self.latest[key] = (fid, off, size, gw, seen)
        else:
            _note(seen, fid, seq, not gw & TOMBSTONE)
            self.dead[fid] = self.dead.get(fid, 0) + size
            self.latest[key] = (cur[0], cur[1], cur[2], cur[3], seen)

    def finish(self) -> tuple[dict[bytes, Entry], dict[bytes, Entry], dict[int, int]]:
        """Return (index, needed tombstones, dead bytes per file)."""
        latest = self.latest
        tombs: dict[bytes, Entry] = {}
        dead = self.dead
        for key in self.special:
            fid, off, size, gsn_word, seen = latest[key]
            # A file holds an older put of the key when its newest record of the key is a put.
            holders = frozenset(h for h, (_, is_put) in seen.items() if is_put and h != fid) if seen else None
            t = (fid, off, size, gsn_word, holders or None)
            if gsn_word & TOMBSTONE:
                del latest[key]
                if t[4] is None:
                    dead[fid] = dead.get(fid, 0) + size  # garbage tombstone
                else:
                    tombs[key] = t
            else:
                latest[key] = t
        index: dict[bytes, Entry] = latest  # every entry now has its final shape
        self.latest = {}
        self.special = set()
        return index, tombs, dead


def _gsn_beyond(path: str, off: int, seq: int, limit: int) -> CorruptionError:
    """A gsn at or above ``limit``: the end of the gsn block the database has reserved on disk
    (every gsn is reserved there before it is handed out), or :data:`MAX_RESERVED` without
    one.  No write produces it; accepting it would push the database's counter to the top
    of the gsn space and stop every later write."""
    return CorruptionError(
        f"{path}: record at offset {off} has gsn {seq}, not below {limit}, the end of the gsns the "
        f"database has reserved: no write made it, the file is damaged or forged. Restore the "
        f"collection from a backup (armdb.check lists every such record)"
    )


def _note(seen: dict[int, tuple[int, bool]], fid: int, seq: int, is_put: bool) -> None:
    prev = seen.get(fid)
    if prev is None or seq >= prev[0]:
        seen[fid] = (seq, is_put)


@dataclass
class _ShardPlan:
    """What open found in one shard, before it changes anything on disk."""

    idx: int
    sdir: str
    files: dict[int, _DataFile] = field(default_factory=dict)
    pending: list[int] = field(default_factory=list)
    has_marker: bool = False
    to_delete: list[str] = field(default_factory=list)
    active: int | None = None
    reset_active: bool = False  # active file's header was torn at creation: rewrite it
    truncate_to: int | None = None
    torn: int = 0
    mark: int = 0  # the active file's synced mark
    mark_generation: int = 0  # the generation of the cell it was read from
    unsynced: int = 0  # intact records in the cut tail (reordered, unsynced write-back)
    hints_to_write: dict[int, tuple[bytearray, int]] = field(default_factory=dict)
    active_hint: tuple[bytearray, int] = (bytearray(), 0)
    index: dict[bytes, Entry] = field(default_factory=dict)
    tombs: dict[bytes, Entry] = field(default_factory=dict)
    highest: int = 0
    max_fid: int = 0

    def close_all(self) -> None:
        for f in self.files.values():
            try:
                _fs.FS.close(f.fd)
            except OSError:
                pass
        self.files.clear()


def _create(directory: str, config: Config) -> _Meta:
    """Create a new collection: shard folders and first data files, then the meta file."""
    fs = _fs.FS
    count = config.shard_count or 1
    key = config.encryption_key
    salt = os.urandom(16)
    check = Sealer(key).key_check() if key is not None else b""
    meta = _Meta(count, key is not None, salt, check)
    flags = FLAG_ENCRYPTED if key is not None else 0
    fs.makedirs(directory)
    for i in range(count):
        sdir = _shard_dir(directory, i)
        if fs.isdir(sdir):
            # Leftovers of an interrupted creation (the meta file is written last).
            for name in fs.listdir(sdir):
                path = os.path.join(sdir, name)
                if _DATA_RE.match(name) and fs.file_size(path) > _records_start_of(path):
                    raise CorruptionError(
                        f"{os.path.join(directory, META_NAME)} is missing but {path} holds records; "
                        f"restore the meta file from a backup"
                    )
            for name in fs.listdir(sdir):
                fs.unlink(os.path.join(sdir, name))
        fs.makedirs(sdir)
        path = os.path.join(sdir, _data_name(1))
        fs.close(fs.create_file(path, _new_file_head(1, flags, 0, _new_nonce())))
    # Synced even without enable_fsync: creation is rare, and a meta file whose
    # rename reached the disk before its bytes would make the collection unopenable.
    fs.fsync_dir(directory)
    fs.write_file_atomic(os.path.join(directory, META_NAME), _encode_meta(meta))
    return meta


def _scan_shard_files(directory: str, i: int, encrypted: bool) -> _ShardPlan:
    """Phase 1 (read-only): list a shard's files and check every header (D5)."""
    fs = _fs.FS
    sdir = _shard_dir(directory, i)
    plan = _ShardPlan(i, sdir)
    if not fs.isdir(sdir):
        raise CorruptionError(f"shard folder {sdir} is missing; restore the collection from a backup")
    names = fs.listdir(sdir)
    if PENDING_NAME in names:
        path = os.path.join(sdir, PENDING_NAME)
        plan.pending = _decode_pending(fs.read_file(path), path)
        plan.has_marker = True
    pending = set(plan.pending)
    data_fids: list[int] = []
    hint_fids: list[int] = []
    for name in names:
        if m := _DATA_RE.match(name):
            data_fids.append(int(m.group(1)))
        elif m := _HINT_RE.match(name):
            hint_fids.append(int(m.group(1)))
        elif name.endswith(".tmp"):
            plan.to_delete.append(os.path.join(sdir, name))
        elif name != PENDING_NAME:
            log.debug("ignoring unknown file %s", os.path.join(sdir, name))
    plan.max_fid = max(data_fids + hint_fids + plan.pending, default=0)
    want = FLAG_ENCRYPTED if encrypted else 0
    headers: dict[int, _Header | None] = {}
    for fid in data_fids:
        path = os.path.join(sdir, _data_name(fid))
        raw = _read_file_header(path)
        head = _parse_header(raw, path, DATA_MAGIC, "Bitcask data")
        if head is not None:
            if head.flags & FLAG_ENCRYPTED != want:
                raise FormatError(
                    f"{path}: data file is {'' if head.flags & FLAG_ENCRYPTED else 'not '}encrypted but "
                    f"the collection is {'' if want else 'not '}; it belongs to another collection"
                )
            if head.fid != fid:
                raise CorruptionError(
                    f"{path}: header names file id {head.fid} (offset 12); restore from a backup"
                )
        headers[fid] = head
    if plan.has_marker:
        _check_pending(plan.pending, headers, os.path.join(sdir, PENDING_NAME))
    for fid in hint_fids:
        path = os.path.join(sdir, _hint_name(fid))
        raw = _read_file_header(path)
        try:
            _parse_header(raw, path, HINT_MAGIC, "Bitcask hint")
        except CorruptionError:
            pass
        except FormatError:
            if raw[:8] == HINT_MAGIC:
                raise  # written by a newer armdb (D5)  # a damaged hint is only a cache: the data file is scanned instead
        if fid in pending or fid not in headers:
            plan.to_delete.append(path)
    live = [fid for fid in sorted(headers) if fid not in pending]
    torn = [fid for fid in live if headers[fid] is None]
    if torn and torn != [live[-1]]:
        path = os.path.join(sdir, _data_name(torn[0]))
        raise CorruptionError(
            f"{path}: data file header is missing or zero (offset 0); restore from a backup"
        )
    appenders = _appenders(headers, pending)
    plan.active = appenders[-1] if appenders else None
    _check_active_present(plan, live, appenders, hint_fids)
    try:
        for fid in live:
            path = os.path.join(sdir, _data_name(fid))
            head = headers[fid]
            is_active = fid == plan.active
            fd = fs.open(path, os.O_RDWR if is_active else os.O_RDONLY)
            try:
                size = fs.size(fd)
            except BaseException:
                fs.close(fd)
                raise
            if head is None:
                head = _Header(fid, want, 0, 0)
                plan.reset_active = True
            plan.files[fid] = _DataFile(
                fid, path, fd, size, head.flags, head.nonce, head.base_gsn, version=head.version
            )
    except BaseException:
        plan.close_all()
        raise
    return plan


def _check_active_present(plan: _ShardPlan, live: list[int], appenders: list[int], hint_fids: list[int]) -> None:
    """Refuse a shard whose active data file was lost (D6, S7).

    The active file is created (durably, whole) before anything is written to it
    and is never compacted, so a shard with data files always has an appendable
    one; and a hint file is written for a data file only once it is sealed, after
    its successor was created.  So only compaction outputs, or a newest appendable
    file that has a hint, mean the newest data file is gone: serving the rest would
    pass older values off as current.
    """
    if live and not appenders:
        raise CorruptionError(
            f"{plan.sdir}: holds only compaction outputs; its active data file is missing, and older "
            f"values would be served as current. Restore the shard folder from a backup"
        )
    if appenders and appenders[-1] in hint_fids:
        path = os.path.join(plan.sdir, _data_name(appenders[-1]))
        raise CorruptionError(
            f"{path} was sealed (it has a hint file) but no newer data file exists; the active data "
            f"file is missing. Restore the shard folder from a backup"
        )


def _load_shard(
    plan: _ShardPlan,
    encrypted: bool,
    unseal: Callable[[bytes, int, int, str], bytes] | None,
    gsn_limit: int,
) -> None:
    """Phase 2 (read-only): read hints or scan data files and build the index (S7)."""
    ing = _Ingest(unseal, gsn_limit)
    highest = 0
    for fid in sorted(plan.files):
        f = plan.files[fid]
        if f.base_gsn >= gsn_limit:
            raise CorruptionError(
                f"{f.path}: file header holds base gsn {f.base_gsn} (offset 16), not below {gsn_limit}, "
                f"the end of the gsns the database has reserved; the header is damaged or forged: "
                f"restore the collection from a backup"
            )
        highest = max(highest, f.base_gsn)
        if fid == plan.active:
            _load_active(plan, f, ing, encrypted)
            continue
        entries: Iterable[Scanned] | None = None
        hint_path = os.path.join(plan.sdir, _hint_name(fid))
        if _fs.FS.exists(hint_path) and hint_path not in plan.to_delete:
            raw = _fs.FS.read_file(hint_path)
            entries = _iter_hint(raw, hint_path, f, encrypted)
            if entries is None:
                if _iter_hint(raw, hint_path, f, encrypted, legacy=True) is not None:
                    log.info("hint file %s was written by an older armdb; rebuilding it from %s", hint_path, f.path)
                else:
                    log.warning(
                        "hint file %s is damaged or does not belong to %s; scanning the data file instead",
                        hint_path,
                        f.path,
                    )
        if entries is None:
            scan = _Scan(f.fd, f.size, encrypted, f.start)
            buf = bytearray()
            count = ing.add_all(f, scan, buf)
            if scan.bad is not None:
                raise CorruptionError(
                    f"{f.path}: corrupt or truncated record at offset {scan.bad} in an immutable data "
                    f"file; restore the file from a backup"
                )
            plan.hints_to_write[fid] = (buf, count)
        else:
            ing.add_all(f, entries, None)
        # Records tile a data file, so its record bytes are its size less the header.
        f.total = f.size - f.start
    plan.index, plan.tombs, dead = ing.finish()
    for fid, f in plan.files.items():
        f.dead = dead.get(fid, 0)
    plan.highest = max(highest, ing.highest)


def _load_active(plan: _ShardPlan, f: _DataFile, ing: _Ingest, encrypted: bool) -> None:
    if plan.reset_active:
        found = _next_valid(f.fd, f.size, 0, encrypted) if f.size > REC_HEAD_SIZE else None
        if found is not None:
            raise CorruptionError(
                f"{f.path}: data file header is missing or zero (offset 0) but a valid record "
                f"follows at offset {found}; restore the file from a backup"
            )
        plan.torn = f.size
        plan.truncate_to = 0
        f.total = 0
        return
    scan = _Scan(f.fd, f.size, encrypted, f.start)
    buf = bytearray()
    count = ing.add_all(f, scan, buf)
    plan.active_hint = (buf, count)
    f.total = scan.end - f.start
    plan.mark, plan.mark_generation = _synced_mark(f, plan.sdir)
    if plan.mark > f.size:
        raise CorruptionError(
            f"{f.path}: the data file ends at offset {f.size}, below offset {plan.mark}, which a "
            f"completed sync covered: synced records are missing. Restore the file from a backup. "
            f"{SALVAGE_HINT}"
        )
    if scan.bad is not None:
        plan.unsynced = _judge_bad(f, scan.bad, encrypted, plan.mark)
        plan.truncate_to = scan.end
        plan.torn = f.size - scan.end


def _apply_plan(host: _Host, plan: _ShardPlan) -> _Shard:
    """Phase 3: finish an interrupted compaction, drop temporaries, cut a torn tail."""
    fs = _fs.FS
    sync = host.config.enable_fsync
    sdir = plan.sdir
    if plan.has_marker:
        for fid in plan.pending:
            for name in (_data_name(fid), _hint_name(fid)):
                path = os.path.join(sdir, name)
                if fs.exists(path):
                    fs.unlink(path)
        if sync:
            fs.fsync_dir(sdir)
        fs.unlink(os.path.join(sdir, PENDING_NAME))
        log.info(
            "finished an interrupted compaction in %s (%d old files removed)", sdir, len(plan.pending)
        )
    for path in plan.to_delete:
        if fs.exists(path):
            fs.unlink(path)
    if plan.has_marker and sync:
        fs.fsync_dir(sdir)
    flags = FLAG_ENCRYPTED if host._encrypted else 0
    created = plan.active is None  # a new active file is created durably
    if plan.active is None:
        fid = plan.max_fid + 1
        active = host._new_data_file(sdir, fid, flags, plan.highest, tmp=False)
        plan.files[fid] = active
        plan.active = fid
    active = plan.files[plan.active]
    if plan.truncate_to is not None:
        fs.ftruncate(active.fd, plan.truncate_to)
        if plan.reset_active:
            active.nonce = _new_nonce()
            active.base_gsn = plan.highest
            active.flags = flags
            active.version = DATA_VERSION
            fs.pwrite(active.fd, _new_file_head(active.fid, flags, plan.highest, active.nonce), 0)
            active.size = DATA_START
        else:
            active.size = plan.truncate_to
        if sync:
            fs.fsync(active.fd)
        host._torn_dropped += plan.torn
        host._unsynced_dropped += plan.unsynced
        if plan.unsynced:
            log.warning(
                "cut an unsynced tail of %d bytes at offset %d of %s: %d intact record(s) after a "
                "damaged one, which no sync had covered (a power cut wrote their pages out of "
                "order); those writes were not durable and are dropped",
                plan.torn,
                plan.truncate_to,
                active.path,
                plan.unsynced,
            )
        elif plan.torn:
            log.warning(
                "dropped a torn tail of %d bytes at offset %d of %s (a write cut short by a crash)",
                plan.torn,
                plan.truncate_to,
                active.path,
            )
    for fid, (buf, count) in plan.hints_to_write.items():
        hb = _HintBuilder(sdir, plan.files[fid])
        try:
            hb.add_raw(buf, count)
            hb.finish(plan.files[fid].size)
        except OSError as e:
            hb.abort()
            log.warning("could not write hint file %s: %s (it will be rebuilt)", hb.final, e)
    hint = _HintBuilder(sdir, active)
    buf, count = plan.active_hint
    hint.add_raw(buf, count)
    sh = _Shard(
        idx=plan.idx,
        sdir=sdir,
        files=plan.files,
        active=active,
        index=plan.index,
        tombs=plan.tombs,
        highest=plan.highest,
        next_fid=max(plan.max_fid, max(plan.files)) + 1,
        hint=hint,
    )
    sh.last_sync = time.monotonic()
    # What a completed sync covered: the mark (at most), or the whole file if open
    # just synced it (an empty mark and an unsynced size claim nothing).
    # A data file's header is synced when the file is created (a reset header only if
    # open synced it).
    synced_now = created or (sync and plan.truncate_to is not None)
    header = active.start if sync or not plan.reset_active else 0
    sh.synced = active.size if synced_now else min(max(plan.mark, header), active.size)
    if active.version >= AREA_MARK_DATA_VERSION:
        generation = 0 if plan.reset_active else plan.mark_generation
        sh.marks = _syncmark.MarkWriter(active.fd, _data_header(active), sh.synced, generation)
    else:
        # An active file of an older format has no mark area: it is synced and
        # sealed, and appends go to a new file of the current format.
        sh.dirty = True
        host._rotate(sh)
        # Only an active file is judged by its mark: the older file's side file is done with.
        _syncmark.drop_side(sdir)
    return sh
