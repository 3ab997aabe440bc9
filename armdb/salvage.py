"""``armdb.salvage``: the explicit way out of an S7 refusal (docs/operations.md, "Salvage").

Open refuses a file in which a bad record has valid records after it (SPEC S7): that
is damage, not a torn write, and open never drops valid records on its own.  Such a
file is not always damage, though.  Without ``durable()`` or fsync, the kernel writes
unsynced pages back in any order, so a power cut can lose an appended record while a
later one survives (1.3-4.7% of the crash states of the power-loss harness,
docs/reliability.md).  The database is then consistent up to the hole and
cannot be opened.

``salvage`` is the step a user takes on purpose, after reading what it will drop: in
every file where open would refuse, it cuts the file at the bad record, so that the
next open finds a torn tail and keeps everything before it.  The records after the cut
are lost to the database, like the last writes of a non-durable commit after a power
loss; their bytes are kept in ``DIR/salvaged/`` so that nothing is destroyed.

It looks exactly where open refuses:

* the transaction log's files (``txlog/NNNNNNNN.log``): a damaged record with a valid
  record after it;
* the active (newest appendable) data file of every Bitcask shard: a corrupt record
  with a valid record after it.  Sealed files are never appended to after their sync;
  a bad record in one is damage that salvage does not touch.

Like :func:`armdb.check` it takes the directory lock (``DbLocked`` while the database is
open) and needs no encryption key: record CRCs cover the sealed bytes.  With the keys
(SPEC C4) it also finds what open refuses only once it holds them: a sealed log record
whose body fails its authentication tag under the log key, and a record of an encrypted
collection's active data file whose sealed key fails its tag under the collection key
(bytes altered with their CRC fixed up, or moved from elsewhere).  Such a file is cut at
that record the same way; every record kept before the cut opens under its key.  Keys
are matched and checked (``WrongKey``) before anything is cut.  All file access goes
through ``armdb._fs``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from . import _fs, _syncmark
from ._crypto import Sealer
from .bitcask.files import (
    _DataFile,
    _judge_bad,
    _next_valid,
    _read_file_header,
    _Scan,
    _synced_mark,
    _ValidIndex,
)
from .bitcask.format import (
    _DATA_RE,
    AREA_MARK_DATA_VERSION,
    DATA_MAGIC,
    META_NAME,
    PENDING_NAME,
    _appenders,
    _check_pending,
    _data_name,
    _decode_meta,
    _decode_pending,
    _Header,
    _parse_header,
    _shard_dir,
    data_start,
    record_aad,
)
from .dbkeys import Keys, normalize_keys, resolve_keys
from .errors import ConfigError, CorruptionError, FormatError, WrongKey
from .layout import COLLECTIONS, META_FILE, QUEUE_META, DirLock
from .logformat import (
    _NAME_RE,
    AREA_MARK_VERSION,
    FLAG_SEALED,
    _file_header_fields,
    _records_at,
    _valid_record_after,
    parse_records,
    records_below_mark,
    records_start,
    synced_mark,
)
from .logformat import DIR as TXLOG_DIR
from .logformat import _judge_bad as _judge_log_bad
from .logformat import (
    record_aad as log_record_aad,
)

__all__ = ["Cut", "SalvageReport", "salvage"]

SALVAGED_DIR = "salvaged"


@dataclass(frozen=True)
class Cut:
    """One file cut at a bad record.

    Attributes
    ----------
    path : str
        The file, relative to the database directory.
    offset : int
        Where the bad record starts; the file ends here after the cut.
    next_valid : int or None
        The first valid record after it, if any (None: the bad record lies below the
        offset a completed sync covered, which is why open refused).
    dropped_bytes : int
        Bytes cut away.
    dropped_records : int
        Valid records among them (lost to the database).
    kept_as : str or None
        Where the cut bytes were saved, relative to the database (None on a dry run).
    why : str or None
        Why the record at ``offset`` is bad when its CRC holds (its authentication tag
        fails under the key given); None for a record that fails its CRC.
    """

    path: str
    offset: int
    next_valid: int | None
    dropped_bytes: int
    dropped_records: int
    kept_as: str | None
    why: str | None = None


@dataclass(frozen=True)
class SalvageReport:
    """The result of :func:`salvage`: the files cut (or, on a dry run, that would be)."""

    dry_run: bool
    cuts: list[Cut] = field(default_factory=list)

    def __str__(self) -> str:
        if not self.cuts:
            return "armdb.salvage: nothing to cut (no file has a bad record that open would refuse)"
        verb = "would cut" if self.dry_run else "cut"
        lines = [f"armdb.salvage: {verb} {len(self.cuts)} file(s)"]
        for c in self.cuts:
            why = "below the synced mark" if c.next_valid is None else f"a valid record follows at {c.next_valid}"
            if c.why is not None:
                why = c.why if c.next_valid is None else f"{c.why}; a valid record follows at {c.next_valid}"
            line = (
                f"  - {c.path}: at offset {c.offset} ({why}); "
                f"{c.dropped_bytes} bytes, {c.dropped_records} valid record(s) dropped"
            )
            if c.kept_as is not None:
                line += f", kept in {c.kept_as}"
            lines.append(line)
        return "\n".join(lines)


def salvage(
    path: str | os.PathLike[str],
    *,
    dry_run: bool = False,
    encryption_key: bytes | Sequence[bytes] | None = None,
    log_encryption_key: bytes | None = None,
) -> SalvageReport:
    """Cut every file that open refuses under SPEC S7 at its bad record.

    Parameters
    ----------
    path : str or os.PathLike
        The database directory; it must not be open.
    dry_run : bool
        Report what would be cut and change nothing.
    encryption_key : bytes or sequence of bytes, optional
        The key (or keys) of its encrypted collections, as for :func:`armdb.check`:
        the active data file of an encrypted collection is also cut at a record whose
        sealed key fails its authentication tag.
    log_encryption_key : bytes, optional
        The transaction log key (default: the key among ``encryption_key`` that is the
        log's): a log file is also cut at a sealed record that does not open.

    Returns
    -------
    SalvageReport
        Every cut, with the bytes and valid records it drops.

    Raises
    ------
    FormatError
        ``path`` is not an armdb database.
    DbLocked
        The database is open, in this process or another one.
    ConfigError
        A key is not 32 bytes.
    WrongKey
        A key opens nothing in this database (as for :func:`armdb.check`); nothing is cut.
    """
    keys = normalize_keys(encryption_key, "encryption_key")
    if log_encryption_key is not None and not isinstance(log_encryption_key, (bytes, bytearray)):
        raise ConfigError(f"log_encryption_key must be one 32-byte key (bytes), got {type(log_encryption_key).__name__}")
    log_key = normalize_keys(log_encryption_key, "log_encryption_key")
    return _salvage(path, dry_run, keys, log_key[0] if log_key else None)


def _salvage(
    path: str | os.PathLike[str],
    dry_run: bool,
    keys: Sequence[bytes] = (),
    log_key: bytes | None = None,
    labels: Sequence[str] | None = None,
    log_label: str = "log_encryption_key",
) -> SalvageReport:
    """:func:`salvage` with validated keys; ``labels`` name them in ``WrongKey`` messages."""
    directory = os.path.abspath(os.fspath(path))
    fs = _fs.FS
    if not fs.exists(os.path.join(directory, META_FILE)):
        raise FormatError(f"{directory}: not an armdb database ({META_FILE} is missing); nothing to salvage")
    lock = DirLock(directory)
    try:
        resolved = resolve_keys(directory, keys, log_key, labels=labels, log_label=log_label)
        found = _log_cuts(directory, resolved) + _bitcask_cuts(directory, resolved)
        cuts = [c if dry_run else _cut(directory, c) for c in found]
    finally:
        lock.release()
    return SalvageReport(dry_run, cuts)


def _rel(directory: str, path: str) -> str:
    return os.path.relpath(path, directory)


def _log_cuts(directory: str, keys: Keys | None = None) -> list[Cut]:
    fs = _fs.FS
    d = os.path.join(directory, TXLOG_DIR)
    if not fs.isdir(d):
        return []
    keys = keys if keys is not None else Keys()
    sealer = Sealer(keys.log_key) if keys.log_key is not None else None
    sealed = opened = 0
    cuts = []
    for name in sorted(n for n in fs.listdir(d) if _NAME_RE.match(n)):
        p = os.path.join(d, name)
        raw = fs.read_file(p)
        try:
            _number, version = _file_header_fields(raw, p)
        except FormatError:
            continue  # open ignores a torn header without records, and refuses any other: not S7
        recs, end, bad = _records_at(raw, records_start(version))  # (one parse for every use below)
        if sealer is not None:
            tag_cut = None
            for offset, txid, flags, body in recs:
                if not flags & FLAG_SEALED:
                    continue
                sealed += 1
                try:
                    sealer.open(body, log_record_aad(version, keys.db_id, txid))
                    opened += 1
                except CorruptionError:
                    if tag_cut is None:
                        tag_cut = offset
            if tag_cut is not None:
                after = _valid_record_after(raw, tag_cut)
                kept = _valid_records(after, lambda pos: _log_run(raw, pos), lambda b: _valid_record_after(raw, b))
                why = "its sealed body fails its authentication tag under the log key"
                cuts.append(Cut(_rel(directory, p), tag_cut, after, len(raw) - tag_cut, kept, None, why))
                continue
        mark = synced_mark(raw, version, d)
        if bad is None:
            if records_below_mark(p, raw, end, None, mark) is not None:  # open refuses: synced records are gone
                why = "the records end below the synced mark: synced records are gone"
                cuts.append(Cut(_rel(directory, p), end, None, len(raw) - end, 0, None, why))
            continue
        try:
            _judge_log_bad(raw, p, bad, version, mark)
            continue  # a torn or unsynced tail: open cuts it itself
        except CorruptionError:
            pass
        after = _valid_record_after(raw, bad)
        kept = _valid_records(after, lambda pos: _log_run(raw, pos), lambda b: _valid_record_after(raw, b))
        cuts.append(Cut(_rel(directory, p), bad, after, len(raw) - bad, kept, None))
    if sealer is not None and sealed and not opened and not keys.log_checked:
        raise WrongKey(
            "the transaction log key given opens none of the log's sealed records (and db.meta keeps no check "
            "value to tell a wrong key from damage); give the key the log was written with; nothing was cut"
        )
    return cuts


def _bitcask_cuts(directory: str, keys: Keys | None = None) -> list[Cut]:
    fs = _fs.FS
    cdir = os.path.join(directory, COLLECTIONS)
    if not fs.isdir(cdir):
        return []
    cuts = []
    for name in sorted(fs.listdir(cdir)):
        d = os.path.join(cdir, name)
        if not fs.isdir(d) or fs.exists(os.path.join(d, QUEUE_META)) or not fs.exists(os.path.join(d, META_NAME)):
            continue  # queue header stores (slots, no records) and folders that are not collections
        meta_path = os.path.join(d, META_NAME)
        meta = _decode_meta(fs.read_file(meta_path), meta_path)
        key = None if keys is None else keys.collections.get(name)
        sealed = (Sealer(key), meta.salt) if key is not None and meta.encrypted else None
        for i in range(meta.shard_count):
            cut = _active_file_cut(directory, _shard_dir(d, i), meta.encrypted, sealed)
            if cut is not None:
                cuts.append(cut)
    return cuts


def _active_file_cut(
    directory: str, sdir: str, encrypted: bool, sealed: tuple[Sealer, bytes] | None = None
) -> Cut | None:
    """The cut of a shard's active data file, if open would refuse it (``armdb.bitcask.recovery._load_active``);
    with ``sealed`` (the collection's sealer and salt), also at the first record whose sealed key does not open."""
    fs = _fs.FS
    if not fs.isdir(sdir):
        return None
    names = fs.listdir(sdir)
    pending: set[int] = set()
    if PENDING_NAME in names:
        marker = os.path.join(sdir, PENDING_NAME)
        pending = set(_decode_pending(fs.read_file(marker), marker))
    heads = {
        int(m.group(1)): _read_header(os.path.join(sdir, n)) for n in names if (m := _DATA_RE.match(n))
    }
    if PENDING_NAME in names:  # a marker open refuses would point at the wrong active file
        _check_pending(sorted(pending), heads, os.path.join(sdir, PENDING_NAME))
    appenders = _appenders(heads, pending)  # as open picks the active file
    if not appenders or heads[appenders[-1]] is None:
        return None  # no data file; or a zero header, which open resets or refuses: not a cut here
    head = heads[appenders[-1]]
    assert head is not None
    p = os.path.join(sdir, _data_name(appenders[-1]))
    fd = fs.open(p, os.O_RDONLY)
    try:
        size = fs.size(fd)
        if sealed is not None:
            sealer, salt = sealed
            for off, gsn_word, _klen, _vlen, _rsize, kf in _Scan(fd, size, encrypted, start=data_start(head.version)):
                try:
                    sealer.open(kf, record_aad(salt, b"K", gsn_word))
                except CorruptionError:
                    after = _next_valid(fd, size, off, encrypted)
                    valid = _ValidIndex(fd, size, off, encrypted)
                    kept = _valid_records(after, lambda pos: _data_run(fd, size, encrypted, pos), valid.next_after)
                    why = "its sealed key fails its authentication tag under the collection key"
                    return Cut(_rel(directory, p), off, after, size - off, kept, None, why)
        _n, bad = _data_run(fd, size, encrypted, data_start(head.version))
        if bad is None:
            return None
        f = _DataFile(appenders[-1], p, fd, size, head.flags, head.nonce, head.base_gsn, version=head.version)
        mark = _synced_mark(f, sdir)[0]
        try:
            _judge_bad(f, bad, encrypted, mark)
            return None  # a torn or unsynced tail: open cuts it itself
        except CorruptionError:
            pass
        after = _next_valid(fd, size, bad, encrypted)
        valid = _ValidIndex(fd, size, bad, encrypted)  # one pass answers every later bad record
        kept = _valid_records(after, lambda pos: _data_run(fd, size, encrypted, pos), valid.next_after)
    finally:
        fs.close(fd)
    return Cut(_rel(directory, p), bad, after, size - bad, kept, None)


def _valid_records(
    pos: int | None, run: Callable[[int], tuple[int, int | None]], next_valid: Callable[[int], int | None]
) -> int:
    """The valid records from ``pos`` to the end of a file, across any later bad ones:
    ``run(pos)`` counts a run of valid records and gives the bad offset ending it (or
    None at the end), ``next_valid(bad)`` the next valid record after that."""
    kept = 0
    while pos is not None:
        n, bad = run(pos)
        kept += n
        pos = None if bad is None else next_valid(bad)
    return kept


def _log_run(raw: bytes, pos: int) -> tuple[int, int | None]:
    recs, _end, bad = parse_records(raw, pos)
    return len(recs), bad


def _data_run(fd: int, size: int, encrypted: bool, pos: int) -> tuple[int, int | None]:
    scan = _Scan(fd, size, encrypted, start=pos)
    return sum(1 for _ in scan), scan.bad


def _read_header(path: str) -> _Header | None:
    try:
        return _parse_header(_read_file_header(path), path, DATA_MAGIC, "Bitcask data")
    except (FormatError, CorruptionError):
        return None


def _has_mark_area(directory: str, rel: str, fd: int) -> bool:
    """Whether the file ``rel`` (a log file or a data file, open as ``fd``) keeps its synced
    mark in its own mark area."""
    raw = _fs.FS.pread(fd, 32, 0)
    path = os.path.join(directory, rel)
    if rel.split(os.sep)[0] == TXLOG_DIR:
        return _file_header_fields(raw, path)[1] >= AREA_MARK_VERSION
    head = _parse_header(raw, path, DATA_MAGIC, "Bitcask data")
    return head is not None and head.version >= AREA_MARK_DATA_VERSION


def _cut(directory: str, c: Cut) -> Cut:
    """Keep the bytes after ``c.offset`` in ``salvaged/``, durably, then cut the file there."""
    fs = _fs.FS
    path = os.path.join(directory, c.path)
    keep_dir = os.path.join(directory, SALVAGED_DIR)
    fs.makedirs(keep_dir)
    kept = os.path.join(keep_dir, f"{c.path.replace(os.sep, '__')}@{c.offset}")
    fd = fs.open(path, os.O_RDWR)
    try:
        tail = fs.pread(fd, c.dropped_bytes, c.offset)
        fs.write_file_atomic(kept, tail)  # before the cut: a crash in between loses nothing
        # The file's synced mark may lie past the cut: open would take the cut for lost
        # synced bytes.  Without a mark, open judges by the records' flags.
        if _has_mark_area(directory, c.path, fd):
            _syncmark.clear_area(fd)
        fs.ftruncate(fd, c.offset)
        fs.fsync(fd)
    finally:
        fs.close(fd)
    _syncmark.drop_side(os.path.dirname(path))  # (older formats kept the mark beside the file)
    return Cut(c.path, c.offset, c.next_valid, c.dropped_bytes, c.dropped_records, _rel(directory, kept), c.why)
