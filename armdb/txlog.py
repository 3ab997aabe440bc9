"""The transaction log: one CRC-protected record per commit, appended before it is applied (SPEC T2-T5).

Files: ``<db>/txlog/NNNNNNNN.log``.  A file starts with a 32-byte header
(``b"ARMTXLG1"``, format version, file number, CRC); records follow, each
8-byte aligned::

    u32 magic 0x314E5854 ("TXN1") | u32 flags (bit 0: body sealed) | u64 txid
    | u32 body_len | u32 crc32 (over the 20 bytes before it and the body) | body | pad

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
removed; this runs when the file passes ``TxConfig.checkpoint_bytes`` (by the
commit that crossed it, after it released its locks) and at close.

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
import re
import struct
import threading
import zlib
from typing import TYPE_CHECKING, Any, NamedTuple

import msgpack
import numpy as np

from . import _fail, _fs, _syncmark
from ._core import fixed as _k
from ._core.groupsync import GroupSync
from ._crcshift import crc_shift
from ._crypto import Sealer
from ._pack import packb
from .errors import (
    SALVAGE_HINT,
    ArmdbError,
    CorruptionError,
    DbClosed,
    EncryptionKeyRequired,
    FormatError,
    StorageError,
    WrongKey,
)

if TYPE_CHECKING:
    from .db import Db

log = logging.getLogger("armdb")

DIR = "txlog"
FILE_MAGIC = b"ARMTXLG1"
# Version 2 binds sealed bodies to the database (their AAD holds the database id from
# db.meta); version 1 files (AAD: the txid alone) are still read, and replayed as such.
# Version 3 adds the synced-before record flag and the synced mark (``txlog/synced.mark``,
# armdb._syncmark): open cuts a bad record that neither proves was synced.  Versions 1
# and 2 keep the older rule (any bad record with a valid one after it is refused).
FORMAT_VERSION = 3
READ_VERSIONS = (1, 2, 3)
MARKED_VERSION = 3
_AAD_PREFIX = b"armdb.txlog\x00"
_FILE_HEAD = struct.Struct("<8sIIQ")  # magic, version, flags, file number; then crc32, pad to 32
FILE_HEADER_SIZE = 32
REC_MAGIC = 0x314E5854
_REC_HEAD = struct.Struct("<IIQI")  # magic, flags, txid, body_len; then crc32
REC_HEAD_SIZE = _REC_HEAD.size + 4  # 24
FLAG_SEALED = 1
# Set on a record appended when a completed sync already covered everything before it.
FLAG_SYNCED_BEFORE = 2
MAX_BODY = 1 << 30
MAX_TXID = (1 << 62) - 1
_NAME_RE = re.compile(r"^(\d{8})\.log$")


def _file_header(number: int) -> bytes:
    head = _FILE_HEAD.pack(FILE_MAGIC, FORMAT_VERSION, 0, number)
    head += struct.pack("<I", zlib.crc32(head))
    return head + bytes(FILE_HEADER_SIZE - len(head))


def _check_file_header(raw: bytes, path: str) -> int:
    """The file number of a log file's header; ``FormatError`` unless it is a valid
    header of a version this armdb reads (:data:`READ_VERSIONS`)."""
    return _file_header_fields(raw, path)[0]


def _file_header_fields(raw: bytes, path: str) -> tuple[int, int]:
    """``(file number, format version)`` of a valid log file header."""
    if len(raw) < FILE_HEADER_SIZE or raw[:8] != FILE_MAGIC:
        raise FormatError(f"{path}: not an armdb transaction log; point armdb at its own directory")
    _magic, version, _flags, number = _FILE_HEAD.unpack_from(raw)
    if struct.unpack_from("<I", raw, _FILE_HEAD.size)[0] != zlib.crc32(raw[: _FILE_HEAD.size]):
        raise FormatError(f"{path}: transaction log header fails its CRC; restore it from a backup")
    if version not in READ_VERSIONS:
        raise FormatError(f"{path}: transaction log format {version} is not supported; upgrade armdb")
    return int(number), int(version)


def _torn_header(raw: bytes) -> bool:
    """The header never fully reached the disk: empty, zero, or a cut-off magic.  A
    foreign magic or a complete header of another version is not torn (FormatError)."""
    head = raw[:FILE_HEADER_SIZE]
    if not any(head):
        return True
    magic = head[:8]
    if magic != FILE_MAGIC:
        return FILE_MAGIC.startswith(magic.rstrip(b"\0"))
    # The magic is ours: torn if the CRC fails (a complete header of another version
    # passes its CRC and is refused as a newer format).
    return struct.unpack_from("<I", head, _FILE_HEAD.size)[0] != zlib.crc32(head[: _FILE_HEAD.size]) if len(head) >= _FILE_HEAD.size + 4 else True


def encode_record(txid: int, body: bytes, flags: int) -> bytes:
    """One record: its head (``_REC_HEAD``), the CRC-32 of head and body, the body, zero
    padding to 8 bytes.  Encoded in C (a test in tests/test_tx.py checks it against ``_REC_HEAD``)."""
    return _k.log_record(REC_MAGIC, flags, txid, body)


def parse_records(raw: bytes, start: int) -> tuple[list[tuple[int, int, bytes]], int, int | None]:
    """Parse records from ``start``.

    Returns ``(records, end_of_valid, bad_offset)`` where each record is
    ``(txid, flags, body)``; ``bad_offset`` is where the first bad record starts,
    or None when the file ends cleanly.
    """
    recs, end, bad = _records_at(raw, start)
    return [(txid, flags, body) for _offset, txid, flags, body in recs], end, bad


def _records_at(raw: bytes, start: int) -> tuple[list[tuple[int, int, int, bytes]], int, int | None]:
    """:func:`parse_records` with each record's offset: ``(offset, txid, flags, body)``."""
    out: list[tuple[int, int, int, bytes]] = []
    pos = start
    n = len(raw)
    while pos < n:
        rec = _parse_one(raw, pos)
        if rec is None:
            return out, pos, pos
        txid, flags, body, end = rec
        out.append((pos, txid, flags, body))
        pos = end
    return out, pos, None


class _Logged(NamedTuple):
    """One record read at open, with where it was read (for error messages) and the
    format version of its file (which says how its sealed body is bound)."""

    txid: int
    flags: int
    body: bytes
    path: str
    offset: int
    version: int = FORMAT_VERSION

    @property
    def where(self) -> str:
        return f"{self.path}: transaction log record at offset {self.offset}"


def _check_txid(rec: _Logged) -> None:
    """A txid above MAX_TXID was never handed out (they count up from 1 in each open), and
    would make the next commit's txid overflow its 64-bit field."""
    if rec.txid > MAX_TXID:
        raise CorruptionError(
            f"{rec.where}: txid {rec.txid} is beyond any armdb hands out; the record passes its CRC but "
            f"armdb never wrote it. Restore the database from a backup"
        )


def record_aad(version: int, db_id: bytes, txid: int) -> bytes:
    """The associated data a record's sealed body is bound to: in format 2 the database
    id and the txid (a record moved into another database fails its tag, as a Bitcask
    record moved into another collection does), in format 1 the txid alone."""
    if version == 1:
        return txid.to_bytes(8, "little")
    return _AAD_PREFIX + db_id + txid.to_bytes(8, "little")


def _rows(body: bytes, where: str) -> list[Any]:
    """Decode a record's (plaintext) body into its list of rows; ``CorruptionError`` if
    it is not one msgpack list."""
    try:
        rows = msgpack.unpackb(body, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:  # msgpack's errors are ValueErrors
        raise CorruptionError(
            f"{where}: the body does not decode ({type(e).__name__}: {e}); the record passes its CRC but "
            f"armdb never wrote it. Restore the database from a backup"
        ) from None
    if not isinstance(rows, list):
        raise CorruptionError(f"{where}: the body is not a list of rows; restore the database from a backup")
    return rows


def _parse_one(raw: bytes, pos: int) -> tuple[int, int, bytes, int] | None:
    if pos + REC_HEAD_SIZE > len(raw):
        return None
    magic, flags, txid, blen = _REC_HEAD.unpack_from(raw, pos)
    if magic != REC_MAGIC or blen > MAX_BODY:
        return None
    end = pos + REC_HEAD_SIZE + blen
    if end > len(raw):
        return None
    (crc,) = struct.unpack_from("<I", raw, pos + _REC_HEAD.size)
    body = raw[pos + REC_HEAD_SIZE : end]
    if zlib.crc32(body, zlib.crc32(raw[pos : pos + _REC_HEAD.size])) != crc:
        return None
    return txid, flags, body, end + (-(end - pos) % 8)


def _judge_bad(raw: bytes, path: str, bad: int, version: int, mark: int) -> int:
    """Whether the bad record at ``bad`` is damage (raises ``CorruptionError``) or a tail
    to cut; returns how many valid records the cut drops (0: a torn tail).

    In a file of :data:`MARKED_VERSION` or later, the record is damage if it lies below
    ``mark`` (a completed sync covered it) or a valid record after it carries
    :data:`FLAG_SYNCED_BEFORE` (it was appended once a sync covered the bad bytes).
    Any other bad record is an unsynced tail whose pages a power cut wrote out of order.
    In older files every bad record with a valid record after it is damage."""
    after = valid_offsets_after(raw, bad)
    if version < MARKED_VERSION:
        if after.size:
            raise CorruptionError(
                f"{path}: transaction log record at offset {bad} is damaged but later records are "
                f"intact; refusing to guess. Restore the database from a backup. {SALVAGE_HINT}"
            )
        return 0
    if bad < mark:
        raise CorruptionError(
            f"{path}: transaction log record at offset {bad} is damaged below offset {mark}, which a "
            f"completed sync covered; this is damage, not a torn write. Restore the database from a "
            f"backup. {SALVAGE_HINT}"
        )
    for off in after.tolist():
        if struct.unpack_from("<I", raw, off + 4)[0] & FLAG_SYNCED_BEFORE:
            raise CorruptionError(
                f"{path}: transaction log record at offset {bad} is damaged, and the intact record at "
                f"offset {off} was appended after a sync had covered it; this is damage, not a torn "
                f"write. Restore the database from a backup. {SALVAGE_HINT}"
            )
    return int(after.size)


def _valid_record_after(raw: bytes, pos: int) -> int | None:
    """The offset of the first valid record after ``pos`` (8-byte aligned), if any
    (:func:`valid_offsets_after`, which gives them all in the same pass)."""
    hits = valid_offsets_after(raw, pos)
    return int(hits[0]) if hits.size else None


def valid_offsets_after(raw: bytes, pos: int) -> np.ndarray:
    """The offsets of every valid record from ``pos + 8`` on (8-byte aligned), ascending.

    One forward pass, with bounded work per candidate, so that a crafted file cannot
    make open quadratic: every aligned offset from ``pos + 8`` whose magic, length and
    end are plausible is a candidate, and all candidates are CRC-checked together.  A
    candidate's CRC covers its 20 head bytes and then its body ``raw[a:e]``; with the
    running CRC ``C(x)`` of ``raw[:x]`` (one pass over the file, taken only at the
    candidates' body starts and ends) it is ``T_L(crc(head) ^ C(a)) ^ C(e)``, where
    ``T_L`` is the CRC register's linear map for ``L = e - a`` zero bytes, applied in
    ``log2(L)`` table steps (``armdb._crcshift.crc_shift``).  The verdict is the one checking each
    candidate with :func:`_parse_one` gives (tests/test_hostile_log.py compares them).
    """
    none = np.zeros(0, dtype=np.int64)
    n = len(raw)
    first = pos + 8
    first += -(first - FILE_HEADER_SIZE) % 8
    if first + REC_HEAD_SIZE > n:
        return none
    words = np.frombuffer(raw, dtype="<u4", count=n // 4)
    # Aligned offsets are multiples of 4 (FILE_HEADER_SIZE is), so each field is a word.
    m = (n - REC_HEAD_SIZE - first) // 8 + 1
    base = first // 4
    magic = words[base : base + 2 * m : 2]
    offsets = first + 8 * np.flatnonzero(magic == REC_MAGIC).astype(np.int64)
    if offsets.size == 0:
        return none
    blen = words[offsets // 4 + 4].astype(np.int64)
    ok = (blen <= MAX_BODY) & (offsets + REC_HEAD_SIZE + blen <= n)
    offsets, blen = offsets[ok], blen[ok]
    if offsets.size == 0:
        return none
    stored = words[offsets // 4 + 5]
    starts = offsets + REC_HEAD_SIZE
    ends = starts + blen
    # Running CRC at every body start and end, in one pass over the file.
    marks, where = np.unique(np.concatenate((starts, ends)), return_inverse=True)
    view = memoryview(raw)
    prefix = np.empty(marks.size, dtype=np.uint32)
    crc, prev = 0, 0
    for i, x in enumerate(marks.tolist()):
        crc = zlib.crc32(view[prev:x], crc)
        prefix[i] = crc
        prev = x
    c_start, c_end = prefix[where[: starts.size]], prefix[where[starts.size :]]
    heads = np.fromiter((zlib.crc32(view[p : p + _REC_HEAD.size]) for p in offsets.tolist()), np.uint32, offsets.size)
    crcs = crc_shift(heads ^ c_start, blen) ^ c_end
    return offsets[crcs == stored]


class TxLog:
    """The Db's transaction log."""

    def __init__(self, db: Db) -> None:
        self.db = db
        self.dir = os.path.join(db.path, DIR)
        key = db.tx_config.log_encryption_key
        self.sealer: Sealer | None = Sealer(key) if key is not None else None
        self.db_id = b""  # from db.meta, read by _open
        self._key_checked = False  # the log key matched db.meta's key check value
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._ckpt_lock = threading.Lock()  # one checkpoint at a time; taken before _lock
        self._checkpoint_bytes = db.tx_config.checkpoint_bytes
        self._checkpoint_warned = False  # a commit's checkpoint failed (warned once)
        self._group = GroupSync(-1, 0)  # group commit of the log's fdatasync calls
        self._fd = -1
        self._path = ""
        self._number = 0
        self._end = 0
        self._inflight = 0
        self._idle_waiting = 0  # checkpoints waiting for _inflight to reach 0
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
            recs, _end, bad = _records_at(raw, FILE_HEADER_SIZE)
            mark = 0
            if version >= MARKED_VERSION:
                mark = _syncmark.read_mark(self.dir, raw[:FILE_HEADER_SIZE])[0]
                if mark > len(raw):
                    raise CorruptionError(
                        f"{path}: the log file ends at offset {len(raw)}, below offset {mark}, which a completed "
                        f"sync covered: synced records are missing. Restore the database from a backup. "
                        f"{SALVAGE_HINT}"
                    )
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
        if records:
            self._next_txid = max(r.txid for r in records) + 1

    def _check_key(self) -> Any:
        """Read db.meta; refuse a log key that does not match its key check value.

        Runs before any log file is read, so a wrong key changes nothing.  A database
        that has none yet (created before key check values, or never given a log key)
        records the first log key given, once the log has been replayed with it."""
        from .layout import META_FILE, check_meta

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
        from .layout import META_FILE, DbMeta, encode_meta

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
        from .replay import Replayer

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
        fd = fs.create_file(path, head)
        if self._fd >= 0:
            fs.close(self._fd)
        self._fd, self._path, self._number = fd, path, number
        self._end = FILE_HEADER_SIZE
        self._group.reset(fd, FILE_HEADER_SIZE)
        with self._mark_lock:
            if self._marks is None:
                self._marks = _syncmark.MarkWriter(self.dir, head, FILE_HEADER_SIZE)
            else:
                self._marks.rebind(head, FILE_HEADER_SIZE)

    def _note_synced(self) -> None:
        """Record in the synced mark what the last completed sync covered.  The mark
        only sharpens open's verdict, so a failure to write it is logged, not raised."""
        with self._mark_lock:
            marks = self._marks
            if marks is None:
                return
            try:
                marks.write(self._group.synced)
            except OSError as e:
                log.warning("%s: could not write the log's synced mark (%s); open will rely on record flags", marks.path, e)
                marks.close()
                self._marks = None

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

    def append(self, rows: list[Any]) -> int:
        """Append one commit record; returns the log's end offset after it.  The
        caller must call :meth:`done` after applying (or failing to apply) it."""
        body = packb(rows)
        with self._lock:
            if self._fd < 0:  # Db.close closed the log once every store was closed
                raise DbClosed(f"the database of {self._path!r}")
            if self.poisoned is not None or self._group.err:
                failure = self.poisoned or os.strerror(self._group.err)
                raise StorageError(f"{self._path}: an earlier log sync failed ({failure}); reopen the database")
            txid = self._next_txid
            # The flag says that everything before this record was synced: a bad record
            # before it is then damage, never a tail that a power cut reordered.
            flags = FLAG_SYNCED_BEFORE if self._end == self._group.synced else 0
            if self.sealer is not None:
                body = self.sealer.seal(body, record_aad(FORMAT_VERSION, self.db_id, txid))
                flags |= FLAG_SEALED
            raw = encode_record(txid, body, flags)
            end = self._end
            fs = _fs.FS
            try:
                fs.pwrite(self._fd, raw, end)
            except OSError as e:
                try:
                    fs.ftruncate(self._fd, end)
                except OSError:
                    self.poisoned = e
                raise StorageError(f"{self._path}: log append failed ({e}); nothing was committed") from e
            self._next_txid = txid + 1
            end += len(raw)
            self._end = end
            self._group.wrote(end)
            self._inflight += 1
            self.commits += 1
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
        if group.synced >= end:
            return  # a sync that started after our append already finished
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

    def done(self) -> bool:
        """A commit finished applying (or gave up).  Returns whether the log is due a
        :meth:`checkpoint`, which the caller runs once it holds no store lock: the
        checkpoint takes those locks to sync the stores."""
        with self._lock:
            self._inflight -= 1
            if self._inflight == 0 and self._idle_waiting:
                self._idle.notify_all()
            return self._end > self._checkpoint_bytes and not self.pending

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
                finally:
                    self._idle_waiting -= 1
                if self.pending or self.poisoned is not None or self._fd < 0:  # (_fd: closed)
                    return
                if self._end == FILE_HEADER_SIZE and not self._retained:
                    return
                if self._end > FILE_HEADER_SIZE:
                    current = self._path
                    self._start_file(self._number + 1)
                    self._retained.append(current)
                old = list(self._retained)
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
            if self._fd >= 0:
                if self.poisoned is None:
                    self._seal_mark()
                _fs.FS.close(self._fd)
                self._fd = -1
            self._close_marks()

    def _close_marks(self) -> None:
        with self._mark_lock:
            if self._marks is not None:
                self._marks.close()
                self._marks = None

    def _seal_mark(self) -> None:
        """At a clean close: sync the file, mark its end, sync the mark, so that any bad
        byte found later in this file is below the mark and refused as damage."""
        fs = _fs.FS
        with self._mark_lock:
            marks = self._marks
            if marks is None or self._fd < 0:
                return
            try:
                fs.fdatasync(self._fd)
                marks.write(self._end, force=True)
                marks.sync()
            except OSError as e:
                log.warning("%s: could not seal the log's synced mark at close (%s)", marks.path, e)

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
                _fs.FS.close(self._fd)
                self._fd = -1
            self._close_marks()

    def stats(self) -> dict[str, int]:
        return {
            "commits": self.commits,
            "syncs": self.syncs,
            "replayed": self.replayed,
            "bytes": self._end,
            "torn_bytes_dropped": self.torn_bytes_dropped,
            "unsynced_records_dropped": self.unsynced_records_dropped,
        }


def _tail_finding(raw: bytes, path: str, bad: int, version: int, mark: int) -> str:
    """What open would do with the bad record at ``bad``, in check's words: cut a torn or
    unsynced tail, or refuse damage (:func:`_judge_bad` decides, as at open)."""
    try:
        dropped = _judge_bad(raw, path, bad, version, mark)
    except CorruptionError as e:
        return str(e)
    if dropped:
        return (f"{path}: unsynced tail of {len(raw) - bad} bytes at offset {bad}, {dropped} intact record(s) "
                f"after a damaged one that no sync covered (cut on next open)")
    return f"{path}: torn tail of {len(raw) - bad} bytes at offset {bad} (cut on next open)"


def check_dir(path: str) -> list[str]:
    """Read-only check of ``<db>/txlog`` for ``armdb.check``.

    Besides the framing (header, magic, length, CRC) every record's txid and, for an
    unsealed record, every row is checked as open checks it before replay (sealed bodies
    need the log key, which check does not take)."""
    from . import seqmap
    from .replay import FixedGeometry, check_row, fixed_geometry, gsn_limit

    fs = _fs.FS
    findings: list[str] = []
    if not fs.exists(path):
        return findings
    collections = os.path.join(os.path.dirname(path), "collections")
    geometries: dict[str, FixedGeometry] = {}
    seq_path = os.path.join(os.path.dirname(path), "seqmap")
    try:
        reserved = seqmap.decode(fs.read_file(seq_path), seq_path).get("gsn") if fs.exists(seq_path) else None
    except FormatError:
        reserved = None  # armdb.check reports the seqmap itself
    limit = gsn_limit(reserved)

    def geometry(name: str) -> FixedGeometry:
        if name not in geometries:
            geometries[name] = fixed_geometry(os.path.join(collections, name))
        return geometries[name]

    names = fs.listdir(path)
    logs = sorted(n for n in names if _NAME_RE.match(n))
    for n in names:
        if n.endswith(".tmp"):
            findings.append(f"{os.path.join(path, n)}: leftover temporary file")
    for name in logs:
        p = os.path.join(path, name)
        raw = fs.read_file(p)
        try:
            _number, version = _file_header_fields(raw, p)
        except FormatError as e:
            findings.append(str(e))
            continue
        mark = _syncmark.read_mark(path, raw[:FILE_HEADER_SIZE])[0] if version >= MARKED_VERSION else 0
        if mark > len(raw):  # open refuses the log: synced records are gone
            findings.append(
                f"{p}: the log file ends at offset {len(raw)}, below offset {mark}, which its synced mark "
                f"({_syncmark.MARK_NAME}) says a completed sync covered: synced records are missing, and "
                f"open refuses the log"
            )
        recs, _, bad = _records_at(raw, FILE_HEADER_SIZE)
        if bad is not None:
            findings.append(_tail_finding(raw, p, bad, version, mark))
        for offset, txid, flags, body in recs:
            rec = _Logged(txid, flags, body, p, offset)
            try:
                _check_txid(rec)
                if not flags & FLAG_SEALED:
                    for row in _rows(body, rec.where):
                        check_row(row, rec.where, collections, geometry, limit)
            except (CorruptionError, FormatError) as e:
                findings.append(str(e))
    return findings
