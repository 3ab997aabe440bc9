"""The transaction log: one CRC-protected record per commit, appended before it is applied (SPEC T2-T5).

Files: ``<db>/txlog/NNNNNNNN.log``.  A file starts with a 32-byte header
(``b"ARMTXLG1"``, format version, file number, CRC) and the 32-byte mark area that
holds its synced mark (armdb._syncmark); records follow from offset 64
(:data:`RECORDS_START`; from offset 32 in files of format 3 and older), each
8-byte aligned::

    u32 magic 0x314E5854 ("TXN1") | u32 flags (bit 0: body sealed) | u64 txid
    | u32 body_len | u32 crc32 (over the 20 bytes before it and the body) | body | pad

then zeros to the file's end: at a file's first durable commit its blocks are allocated
ahead, up to ``checkpoint_bytes`` and 1 MiB more (at most 65 MiB), because a sync of an
append that grows the file must also journal its new size and new blocks (measured on
ext4: 155-175 against 215-275 us a sync).  A clean close cuts the zeros off.

This module is the log's runtime (:class:`TxLog`: append, group sync, replay at open,
checkpoint); the codecs of the format, and the offline check, are ``armdb.logformat``.

The body is msgpack: a list of absolute rows (``docs/transactions.md``)::

    ["F", collection, shard, slot, version, status, slot_body]   # a FixedStore slot write
    ["B", collection, key, value_or_None, gsn]                     # a Bitcask record

With ``TxConfig(log_encryption_key=...)`` the body is sealed with AES-256-GCM,
the txid as associated data.

Recovery (``replay``): records are read in order.  A record that fails its
magic, length or CRC with no valid record after it is a torn tail: an
uncommitted transaction; it is cut off.  One with a valid record after it is
corruption and raises ``CorruptionError``.  Each FixedStore row is applied only
where its version is newer than the slot's (S3); each Bitcask row only where
its gsn is above the shard's highest (``BitcaskStore.apply``).  Rows for an
encrypted collection wait until that collection is opened with its key.

Checkpoint: once no commit is between its append and the end of its apply,
appends move to a fresh log file, the stores are synced, and the old file is
removed.  While a checkpoint waits for that moment, new appends wait for it (else
steady commits from several threads could keep one in flight at every instant and
starve the checkpoint, and the log would grow without bound).  A checkpoint runs
when the file passes ``TxConfig.checkpoint_bytes`` (by the commit that crossed it,
after it released its locks) and at close.

Lock policy: ``TxLog._lock`` guards the file, the end offset and the in-flight
count; it is held for the append only, never across a sync or an apply.
``_group`` (``armdb._core.groupsync.GroupSync``, its own C mutex) holds the
group-commit state (a sync is running; the offset the last sync covered): one
committer at a time leads a sync of everything appended so far while the
others wait, with the GIL released, so several committing threads share one
``fdatasync`` (group commit, ``TxLog.sync_to``).  ``_ckpt_lock`` serialises
checkpoints; it is taken before ``_lock``, never by a thread that holds a store lock.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from . import _fail, _fs, _syncmark
from ._core.fixed import log_frame_parts, log_record
from ._core.groupsync import GroupSync
from ._core.locks import Lock
from ._core.plainpack import pack_plain
from ._crypto import Sealer
from ._objdict import install_own_dict
from ._pack import packb
from .errors import (
    SALVAGE_HINT,
    ArmdbError,
    ConfigError,
    CorruptionError,
    DbClosed,
    EncryptionKeyRequired,
    FormatError,
    StorageError,
    WrongKey,
)
from .layout import META_FILE, DbMeta, check_meta, encode_meta

# The log's file format lives in armdb.logformat.  The names imported as themselves
# (``X as X``) are re-exported: they stay importable from armdb.txlog for the tests and
# benchmarks that read and craft log files by them.
from .logformat import _FILE_HEAD as _FILE_HEAD
from .logformat import (
    _NAME_RE,
    DIR,
    FILE_HEADER_SIZE,
    FLAG_SEALED,
    FLAG_SYNCED_BEFORE,
    FORMAT_VERSION,
    RECORDS_START,
    _check_txid,
    _file_header,
    _file_header_fields,
    _judge_bad,
    _Logged,
    _records_at,
    _rows,
    _torn_header,
    _valid_record_after,
    record_aad,
    records_below_mark,
    records_start,
    synced_mark,
)
from .logformat import AREA_MARK_VERSION as AREA_MARK_VERSION
from .logformat import FILE_MAGIC as FILE_MAGIC
from .logformat import MAX_BODY as MAX_BODY
from .logformat import REC_HEAD_SIZE as REC_HEAD_SIZE
from .logformat import REC_MAGIC as REC_MAGIC
from .logformat import _check_file_header as _check_file_header
from .logformat import _parse_one as _parse_one
from .logformat import encode_record as encode_record
from .logformat import parse_records as parse_records
from .logformat import valid_offsets_after as valid_offsets_after
from .replay import Replayer

if TYPE_CHECKING:
    from .db import Db

log = logging.getLogger("armdb")

# A log file's blocks are allocated up to checkpoint_bytes (at most _PREALLOC_CAP)
# and _PREALLOC_SLACK more, for the commits appended between the one that crosses
# checkpoint_bytes and the checkpoint's rotation; a log that grows past it grows as any
# file does.  The cap bounds what open reads of zeros, and the disk a log holds.
_PREALLOC_CAP = 64 << 20
_PREALLOC_SLACK = 1 << 20


def _list_header(n: int) -> bytes:
    """The msgpack header of a list of ``n`` items (as ``packb`` writes it)."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 65536:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


class TxLog:
    """The Db's transaction log."""

    def __init__(self, db: Db) -> None:
        self.db = db
        self.dir = os.path.join(db.path, DIR)
        key = db.tx_config.log_encryption_key
        self.sealer: Sealer | None = Sealer(key) if key is not None else None
        self.db_id = b""  # from db.meta, read by _open
        self._key_checked = False  # the log key matched db.meta's key check value
        self._lock = Lock()  # (armdb._core.locks: a cheaper acquire than threading.Lock)
        self._idle = threading.Condition(self._lock)
        self._ckpt_lock = threading.Lock()  # one checkpoint at a time; taken before _lock
        self._checkpoint_bytes = db.tx_config.checkpoint_bytes
        self._prealloc = min(self._checkpoint_bytes, _PREALLOC_CAP) + _PREALLOC_SLACK
        self._checkpoint_warned = False  # a commit's checkpoint failed (warned once)
        self._group = GroupSync(-1, 0)  # group commit of the log's fdatasync calls
        self._fd = -1
        self._ahead = False  # the current file's blocks are allocated ahead (_allocate_ahead)
        self._path = ""
        self._number = 0
        self._end = 0
        self._inflight = 0
        self._idle_waiting = 0  # checkpoints waiting for _inflight to reach 0; appends wait meanwhile
        self._next_txid = 1
        self.poisoned: BaseException | None = None
        self.pending: dict[str, list[tuple[bytes, bytes | None, int]]] = {}
        # Older log files still replayed on open: kept while rows are owed to encrypted
        # collections not yet opened, or while a checkpoint syncs the stores.
        self._retained: list[str] = []
        self.commits = 0
        self.replayed = 0
        self.torn_bytes_dropped = 0  # bad tails cut at open
        self.unsynced_records_dropped = 0  # intact records in those tails (reordered write-back)
        # The synced mark of the current file (armdb._syncmark), under _mark_lock.
        self._marks: _syncmark.MarkWriter | None = None
        self._mark_lock = threading.Lock()
        install_own_dict(self)  # the compiled lone var ack reads and writes its attributes in place

    # -- open / replay ---------------------------------------------------------------
    @classmethod
    def open(cls, db: Db) -> TxLog:
        tl = cls(db)
        tl._open()
        return tl

    def _open(self) -> None:
        fs = _fs.FS
        fs.makedirs(self.dir)
        for name in fs.listdir(self.dir):
            if name.endswith(".log.tmp"):  # a log file whose creation a crash cut short
                fs.unlink(os.path.join(self.dir, name))
        fs.remove_stale_tmp(os.path.join(self.dir, _syncmark.MARK_NAME))  # its creation cut short
        files = sorted(
            (int(m.group(1)), name) for name in fs.listdir(self.dir) if (m := _NAME_RE.match(name))
        )
        meta = self._check_key()
        records: list[_Logged] = []
        for i, (number, name) in enumerate(files):
            path = os.path.join(self.dir, name)
            raw = fs.read_file(path)
            try:
                _number, version = _file_header_fields(raw, path)
            except FormatError:
                # A log file is created (O_TRUNC) just before its header is written: a
                # crash or power loss can leave it empty, zero or torn.  With no valid
                # record in it, it holds no commit, whatever its position (older ones are
                # kept while encrypted collections are owed rows).
                if _torn_header(raw) and _valid_record_after(raw, FILE_HEADER_SIZE - 8) is None:
                    log.warning("%s: log file with an unwritten header and no record; ignored", path)
                    continue
                raise
            recs, end, bad = _records_at(raw, records_start(version))
            mark = synced_mark(raw, version, self.dir)
            gone = records_below_mark(path, raw, end, bad, mark)
            if gone is not None:
                raise CorruptionError(f"{gone}. Restore the database from a backup. {SALVAGE_HINT}")
            if bad is not None:
                # A bad tail is torn in any file: in an older file it is the unsynced tail
                # of a log that a checkpoint superseded (its records were applied and synced).
                dropped = _judge_bad(raw, path, bad, version, mark)
                self.torn_bytes_dropped += len(raw) - bad
                self.unsynced_records_dropped += dropped
                if dropped:
                    log.warning(
                        "%s: cutting an unsynced log tail at offset %d: %d bytes with %d intact record(s) after a "
                        "damaged one, which no sync had covered (a power cut wrote its pages out of order); "
                        "those commits were not durable and are dropped",
                        path,
                        bad,
                        len(raw) - bad,
                        dropped,
                    )
                else:
                    log.warning("%s: dropping a torn log tail of %d bytes (an uncommitted transaction)", path, len(raw) - bad)
            records.extend(_Logged(txid, flags, body, path, offset, version) for offset, txid, flags, body in recs)
        for rec in records:
            _check_txid(rec)
        self._replay(records)
        self._record_identity(meta)
        # Start a fresh, empty log; the replayer synced the replayed rows into their
        # stores, so the old files can go.
        old = [os.path.join(self.dir, name) for _, name in files]
        if self.pending:
            # Rows for encrypted collections are still owed: keep the old files
            # until those collections are opened with their keys.
            self._retained, old = old, []
        self._start_file(files[-1][0] + 1 if files else 1)
        self._unlink(old)
        if not self._retained:  # no file of format 3 is left to read it
            _syncmark.drop_side(self.dir)
        if records:
            self._next_txid = max(r.txid for r in records) + 1

    def _check_key(self) -> Any:
        """Read db.meta; refuse a log key that does not match its key check value.

        Runs before any log file is read, so a wrong key changes nothing.  A database
        that has none yet (created before key check values, or never given a log key)
        records the first log key given, once the log has been replayed with it."""
        path = os.path.join(self.db.path, META_FILE)
        meta = check_meta(_fs.FS.read_file(path), path)
        self.db_id = meta.db_id or os.urandom(16)  # written by _record_identity
        if self.sealer is not None and meta.log_key_check:
            try:
                self.sealer.verify(meta.log_key_check)
            except WrongKey:
                raise WrongKey(
                    "the transaction log key given is not the log key this database was used with (db.meta "
                    "keeps its check value); give the original log key"
                ) from None
            self._key_checked = True
        return meta

    def _record_identity(self, meta: Any) -> None:
        """Write the database id (and the log key's check value, once a key is given)
        into db.meta, before the first log file that binds records to them exists."""
        check = meta.log_key_check
        if self.sealer is not None and not check:
            check = self.sealer.key_check()
        if meta.db_id and check == meta.log_key_check:
            return
        _fs.FS.write_file_atomic(os.path.join(self.db.path, META_FILE), encode_meta(DbMeta(self.db_id, check)))
        self._key_checked = self.sealer is not None

    def _decode(self, rec: _Logged) -> list[Any]:
        txid, flags, body = rec.txid, rec.flags, rec.body
        if flags & FLAG_SEALED:
            if self.sealer is None:
                raise EncryptionKeyRequired(
                    "the transaction log holds sealed records that must be replayed; open the Db with "
                    "TxConfig(log_encryption_key=...) set to the key it was written with"
                )
            try:
                body = self.sealer.open(body, record_aad(rec.version, self.db_id, txid), what=rec.where)
            except CorruptionError:
                if self._key_checked:
                    raise CorruptionError(
                        f"{rec.where}: the sealed body fails its tag under the right log key: it was sealed "
                        f"for another database or it is damaged. Restore the database from a backup"
                    ) from None
                raise WrongKey(
                    "the transaction log key does not open the logged records; give the key the log was "
                    "written with"
                ) from None
        return _rows(body, rec.where)

    def _replay(self, records: list[_Logged]) -> None:
        if not records:
            return
        decoded = [self._decode(rec) for rec in records]
        with Replayer(self.db) as rp:
            # Every row is checked before the first is applied: a hostile record anywhere
            # in the log refuses the open with nothing created or written.
            for rec, rows in zip(records, decoded, strict=True):
                for row in rows:
                    rp.check(row, rec.where)
            rp.check_images()  # and what the slot writes would leave, taken together
            for i, rows in enumerate(decoded):
                if i == len(decoded) // 2:
                    _fail.point("recovery.mid_replay")
                for row in rows:
                    rp.apply(row)
            self.pending = rp.deferred
        self.replayed = len(decoded)
        log.info("replayed %d logged transaction(s)", len(decoded))

    def _start_file(self, number: int) -> None:
        """Create log file ``number`` and move appends to it (caller holds ``_lock``, no
        commit in flight); if creating it fails, appends stay where they were."""
        fs = _fs.FS
        path = os.path.join(self.dir, f"{number:08d}.log")
        head = _file_header(number)
        fd = fs.create_file(path, head + bytes(_syncmark.AREA_SIZE))  # durably, header and empty mark area
        # Under _mark_lock: a sync that just finished may be writing its mark into the
        # old file (_note_synced), which must not find its descriptor closed or reused.
        with self._mark_lock:
            if self._fd >= 0:
                fs.close(self._fd)
            self._fd, self._path, self._number = fd, path, number
            self._ahead = False
            self._end = RECORDS_START
            self._group.reset(fd, RECORDS_START)
            if self._marks is None:
                self._marks = _syncmark.MarkWriter(fd, head, RECORDS_START)
            else:
                self._marks.rebind(fd, head, RECORDS_START)

    def _note_synced(self) -> None:
        """Record in the synced mark what the last completed sync covered (the file's
        next sync makes it durable).  The mark only sharpens open's verdict, so a failure
        to write it is logged, not raised, and later syncs no longer write one."""
        lock = self._mark_lock
        lock.acquire()  # not ``with``: see append_body
        try:
            marks = self._marks
            if marks is None or self._fd < 0:
                return
            try:
                marks.write(self._group.synced)
            except OSError as e:
                log.warning("%s: could not write the log's synced mark (%s); open will rely on record flags", self._path, e)
                self._marks = None
        finally:
            lock.release()

    def _unlink(self, old: list[str]) -> None:
        fs = _fs.FS
        for p in old:
            if fs.exists(p):
                fs.unlink(p)
        if old:
            fs.fsync_dir(self.dir)

    @property
    def syncs(self) -> int:
        """Log syncs made by commits since open (several commits can share one)."""
        return self._group.syncs

    def take_pending(self, collection: str) -> list[tuple[bytes, bytes | None, int]]:
        """Rows owed to an encrypted collection that is being opened now."""
        with self._lock:
            return self.pending.pop(collection, [])

    # -- commit --------------------------------------------------------------------------
    def needs_key(self) -> bool:
        return self.sealer is None

    def append(self, rows: list[Any], packed: list[tuple[int, bytes | bytearray]] | None = None,
               behind: bool = False) -> int:
        """Append one commit record; returns the log's end offset after it.  The
        caller must call :meth:`done` after applying (or failing to apply) it.

        ``packed``: more rows of the record, already packed as msgpack by a batch's
        compiled plan, as ``(how many rows, bytes)``; they follow ``rows``.
        ``behind``: the caller holds a shard on which logged commits wait to apply
        (armdb._core.locks, "The apply turnstile"), so it must not wait for a checkpoint
        to start a new file: the checkpoint waits for those commits, which wait for the
        shard.  (Positional, not keyword-only: a keyword-only default costs every call
        from compiled code a dictionary lookup.)
        """
        if not packed:
            # The compiled packer writes msgpack's own bytes for plain rows (lists of str,
            # bytes, int, None: every row a commit plans); msgpack packs anything else.
            got = pack_plain([rows])
            return self.append_body(got[0] if got is not None else packb(rows), None, behind)
        # The body is the list header, then ``rows``, then each block as it came: the
        # record is framed from those parts (log_frame_parts) and written from them.
        # (A plain loop: a comprehension and two generators cost an ack_many of 64 rows
        # about 90 instructions a row.)
        parts = []
        size = count = 0
        for c, b in packed:
            parts.append(b)
            size += len(b)
            count += c
        if rows:
            parts.insert(0, packb(rows)[len(_list_header(len(rows))):])
            size += len(parts[0])
            count += len(rows)
        head = _list_header(count)
        if len(head) + size > MAX_BODY:
            raise ConfigError(
                f"this commit's log record would be {len(head) + size:,} bytes, above the limit of {MAX_BODY:,}; "
                f"split the batch into smaller ones"
            )
        return self.append_body(head, parts, behind)

    def _append_failed(self, end: int, e: OSError) -> StorageError:
        """The error of an append whose write failed (the caller holds ``_lock``; also
        ``armdb._core.qshard.VarFast``'s compiled append): the file cut back to ``end``,
        where the record started, so that nothing of it is left to replay; a failed cut
        poisons the log.  Nothing was committed."""
        try:
            _fs.FS.ftruncate(self._fd, end)
        except OSError:
            self.poisoned = e
        return StorageError(f"{self._path}: log append failed ({e}); nothing was committed")

    def append_body(self, body: bytes, parts: list[bytes | bytearray] | None = None,
                    behind: bool = False) -> int:
        """:meth:`append` of a record body already packed whole (the msgpack list of its
        rows, at most ``MAX_BODY`` bytes): a lone var ack packs its two rows in one call
        (``armdb.tx.commit_settle``).  With ``parts``, the body is ``body`` then each of
        them end to end (:meth:`append`'s blocks of packed rows), not joined unless it is
        sealed.  The caller must call :meth:`done` after it.  ``behind`` as for
        :meth:`append`."""
        # The lock by acquire and release, not ``with`` (which binds __enter__ and
        # __exit__ at every pass).
        lock = self._lock
        lock.acquire()
        try:
            while self._idle_waiting and not behind:  # a checkpoint is about to start a new file
                self._idle.wait()
            if self._fd < 0:  # Db.close closed the log once every store was closed
                raise DbClosed(f"the database of {self._path!r}")
            group = self._group
            if self.poisoned is not None or group.err:
                failure = self.poisoned or os.strerror(group.err)
                raise StorageError(f"{self._path}: an earlier log sync failed ({failure}); reopen the database")
            txid = self._next_txid
            end = self._end
            # The flag says that everything before this record was synced: a bad record
            # before it is then damage, never a tail that a power cut reordered.
            flags = FLAG_SYNCED_BEFORE if end == group.synced else 0
            if self.sealer is not None:
                if parts is not None:
                    body = b"".join([body, *parts])
                    parts = None
                body = self.sealer.seal(body, record_aad(FORMAT_VERSION, self.db_id, txid))
                flags |= FLAG_SEALED
            # logformat.encode_record's bytes; a batch's (parts) by one vectored write of
            # its frame, its rows where the plan packed them and its padding: no copy of
            # the record (about 210 instructions a row of a var push_many(1000)).
            fs = _fs.FS
            try:
                if parts is None:
                    raw = log_record(REC_MAGIC, flags, txid, body)
                    fs.pwrite(self._fd, raw, end)
                    size = len(raw)
                else:
                    frame, pad = log_frame_parts(REC_MAGIC, flags, txid, body, parts)
                    pieces = [frame, *parts, pad]
                    fs.pwritev(self._fd, pieces, end)
                    size = sum(map(len, pieces))
            except OSError as e:
                raise self._append_failed(end, e) from e
            self._next_txid = txid + 1
            end += size
            self._end = end
            group.wrote(end)
            self._inflight += 1
            self.commits += 1
        finally:
            lock.release()
        _fail.point("txlog.after_append")
        return end

    def sync_to(self, end: int) -> None:
        """Make the log durable up to ``end``: group commit, leader and followers.

        A committer that finds no sync running becomes the leader: it syncs
        everything appended so far; committers that arrive meanwhile wait, and
        when the sync ends those it covered return while one of the others leads
        the next sync, which covers everything appended during the previous one.
        Appends (``_lock``) never wait for a sync.  The coordination and the
        ``fdatasync(2)`` run in C without the GIL (``armdb._core.groupsync``), so
        the next sync starts as soon as the previous one returns, even while
        other threads hold the GIL; a file system that overrides ``fdatasync``
        (tests) has it called instead (``RealFS.native_fdatasync``).

        A failed sync poisons the log and is never retried (S12): the leader and
        every committer whose record it did not cover raise ``StorageError``, so
        no commit whose record the failed sync should have covered is applied.
        """
        group = self._group
        if not self._ahead:
            self._allocate_ahead()
        # (The local sync in this frame, not a helper's: a durable commit's own Python.)
        if group.synced < end:  # else a sync that started after our append already finished
            fs = _fs.FS
            try:
                err = group.sync_to(end, None if fs.native_fdatasync() else fs.fdatasync)
            except OSError as e:
                self.poisoned = e  # never retried (S12)
                raise StorageError(f"{self._path}: log sync failed ({e}); reopen the database") from e
            if err:
                failure = OSError(err, os.strerror(err))
                if self.poisoned is None:
                    self.poisoned = failure
                raise StorageError(
                    f"{self._path}: log sync failed ({failure}); nothing of this commit was applied; reopen the "
                    f"database"
                ) from failure
            self._note_synced()
            _fail.point("txlog.after_sync")
        primary = self.db._primary
        if primary is not None and self.db.tx_config.replicas:
            # Replicated ahead too (R4): the followers hold the record before any row of
            # it is applied, so a promoted follower replays it.  Waits as long as it takes.
            primary.wait_replicated(self.db.tx_config.replicas)

    def _allocate_ahead(self) -> None:
        """Allocate the current file's blocks up to ``_prealloc`` (module docstring), at its
        first durable commit: a log that is never synced (no durable commit) gains
        nothing from it.  The sync that follows makes it durable.  It only speeds syncs
        up, so a failure (a full disk) is logged, not raised: the file then grows as it
        is written.  Under the append lock: where the file system cannot allocate, the
        blocks are allocated by writing zeros over the pages that read as zeros
        (``RealFS.fallocate``), which would overwrite an append made meanwhile."""
        with self._lock, self._mark_lock:  # and the descriptor stays this file's (_start_file, _close_fd)
            if self._ahead or self._fd < 0:
                return
            self._ahead = True
            try:
                _fs.FS.fallocate(self._fd, 0, self._prealloc)
            except OSError as e:
                log.warning("%s: could not allocate the log file ahead (%s); durable commits sync a growing "
                            "file", self._path, e)

    def done(self) -> bool:
        """A commit finished applying (or gave up).  Returns whether the log is due a
        :meth:`checkpoint`, which the caller runs once it holds no store lock: the
        checkpoint takes those locks to sync the stores."""
        lock = self._lock
        lock.acquire()  # not ``with``: see append_body
        try:
            self._inflight -= 1
            if self._idle_waiting and self._inflight == 0:
                self._idle.notify_all()
            return self._end > self._checkpoint_bytes and not self.pending
        finally:
            lock.release()

    def checkpoint(self, *, wait: bool = True) -> None:
        """Trim the applied log: start a fresh log file, sync every store, then remove the
        old files.

        Appends move to the new file at once (with no commit in flight, so every record in
        the old files is applied), and other commits go on while the stores sync: a
        store's sync takes its shard locks, which a committer may hold while it waits to
        append, so the log's lock is not held across it.  Until the old files are removed
        they are replayed on open along with the new one, which replay allows (a record
        whose rows a store already holds is skipped).  A failed store sync leaves them
        for the next checkpoint.  ``wait=False`` returns at once when another thread is
        checkpointing (a commit that crossed ``checkpoint_bytes``).
        """
        if not self._ckpt_lock.acquire(blocking=wait):
            return
        try:
            with self._lock:
                self._idle_waiting += 1
                try:
                    while self._inflight:
                        self._idle.wait()
                    if self.pending or self.poisoned is not None or self._fd < 0:  # (_fd: closed)
                        return
                    if self._end == RECORDS_START and not self._retained:
                        return
                    if self._end > RECORDS_START:
                        current = self._path
                        self._start_file(self._number + 1)
                        self._retained.append(current)
                    old = list(self._retained)
                finally:
                    self._idle_waiting -= 1
                    self._idle.notify_all()  # the appends that waited for this moment
            _fail.point("txlog.after_rotate")
            self.db.sync_all_stores()
            with self._lock:
                self._retained = [p for p in self._retained if p not in old]
            self._unlink(old)  # appends never touch the old files; checkpoints are serialised
        finally:
            self._ckpt_lock.release()
        _fail.point("txlog.after_trim")

    def checkpoint_after_commit(self) -> None:
        """The checkpoint a commit that crossed ``checkpoint_bytes`` runs once it holds no
        lock.  The commit is applied whatever happens here: a failed store sync fences
        that store, which refuses later writes with ``StorageError``, and the old log
        files stay until a checkpoint succeeds; the failure is logged once, not raised."""
        try:
            self.checkpoint(wait=False)
        except (ArmdbError, OSError) as e:  # a sync failure, or the Db closing meanwhile
            if not self._checkpoint_warned:
                log.warning("log checkpoint failed (%s); the old log files are kept until one succeeds", e)
            self._checkpoint_warned = True

    def close_file(self) -> None:
        """Close the descriptor without a checkpoint (a failed open; ``Db.close`` once
        its stores are closed).  A checkpoint racing it then does nothing, and an append
        raises ``DbClosed``: neither uses the closed descriptor nor starts a new file."""
        with self._ckpt_lock, self._lock:
            if self._fd >= 0 and self.poisoned is None:
                self._seal_mark()
            self._close_fd()

    def _close_fd(self) -> None:
        """Close the log file (caller holds ``_lock``); under ``_mark_lock``, so that no
        mark is being written into it meanwhile (:meth:`_start_file`)."""
        with self._mark_lock:
            if self._fd >= 0:
                _fs.FS.close(self._fd)
                self._fd = -1
            self._marks = None

    def _seal_mark(self) -> None:
        """At a clean close: sync the file, mark its end, sync again, so that any bad
        byte found later in this file is below the mark and refused as damage."""
        fs = _fs.FS
        with self._mark_lock:
            marks = self._marks
            if marks is None or self._fd < 0:
                return
            try:
                if fs.size(self._fd) > self._end:
                    fs.ftruncate(self._fd, self._end)  # the allocated zeros (the seal's syncs carry it)
                fs.fdatasync(self._fd)
                marks.seal(self._end)
            except OSError as e:
                log.warning("%s: could not seal the log's synced mark at close (%s)", self._path, e)

    def close(self) -> None:
        if self._fd < 0:
            return
        try:
            if self.poisoned is None:
                self.checkpoint()
                with self._lock:
                    self._seal_mark()
        finally:
            with self._lock:
                self._close_fd()

    def stats(self) -> dict[str, int]:
        return {
            "commits": self.commits,
            "syncs": self.syncs,
            "replayed": self.replayed,
            "bytes": self._end,
            "torn_bytes_dropped": self.torn_bytes_dropped,
            "unsynced_records_dropped": self.unsynced_records_dropped,
        }
