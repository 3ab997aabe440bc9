"""The Bitcask store: the read/write path of an open collection (SPEC S6-S12).

:class:`BitcaskStore` opens a collection (recovery is ``armdb.bitcask.recovery``),
appends records and keeps each shard's index (:meth:`BitcaskStore.put`,
:meth:`BitcaskStore.delete`, the ``*_locked`` hooks of the Db's transactions), reads
them back, syncs the active files and seals their synced marks, rotates a full active
file, counts, and closes.  Compaction (``armdb.bitcask.compaction``) runs after a
rotation or on :meth:`BitcaskStore.compact`.

Lock policy: ``armdb.bitcask.shard`` states it.  Every append, index update, rotation,
sync of the active file and index lookup (with the read of the record) holds the
shard's ``lock``; ``close`` takes ``compact_lock`` then ``lock`` of each shard in turn.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any, Self

from .. import _fail, _fs, _syncmark
from .._core.fixed import (
    PutKernel,
    bitcask_group,
    bitcask_index_apply,
    bitcask_index_put_new,
    bitcask_puts,
    bitcask_record,
    bitcask_tombs_restore,
    bitcask_tombs_settle,
    bitcask_tombs_take,
)
from .._crypto import Sealer
from .._objdict import install_own_dict, own_dict
from ..config import Config
from ..errors import (
    ArmdbError,
    ConfigError,
    CorruptionError,
    DbClosed,
    EncryptionKeyRequired,
    PayloadTypeError,
    StorageError,
    WrongKey,
)
from ..seqmap import MAX_RESERVED
from . import files as _files
from . import format as _format
from .compaction import _auto_compact, _compact_all
from .files import _DataFile, _HintBuilder, _new_nonce, _storage_error
from .format import (
    DATA_START,
    FLAG_ENCRYPTED,
    MARKED_DATA_VERSION,
    MAX_KEY_LEN,
    MAX_VALUE_LEN,
    META_NAME,
    REC_HEAD_SIZE,
    RECORD_MAGIC,
    SEQ_MASK,
    SYNCED_BEFORE,
    TOMBSTONE,
    _data_header,
    _data_name,
    _decode_meta,
    _Meta,
    _new_file_head,
    _pad8,
    _record_crc,
)
from .recovery import _apply_plan, _create, _load_shard, _scan_shard_files, _ShardPlan
from .shard import Entry, _Shard

log = logging.getLogger("armdb")

_MIN_FILE_SIZE = 4096

# Bound by assignment, not imported: CPython 3.11 compiles a method call on an imported
# name (``REC_HEAD.unpack_from(data)`` in every read, ``_U64.pack`` in every sealed
# write) to LOAD_ATTR, which builds a bound method per call, and a call on an assigned
# name to LOAD_METHOD, which does not.
REC_HEAD = _format.REC_HEAD
_U64 = _format._U64

GsnSource = Callable[[], int]


class BitcaskStore:
    """One Bitcask collection: sharded, append-only, crash-safe key/value storage of raw bytes.

    Open it with :meth:`open`.  Keys and values are ``bytes``.  See ``armdb.bitcask``
    for the on-disk layout and ``armdb.bitcask.shard`` for the lock policy.
    """

    def __init__(self) -> None:  # use BitcaskStore.open
        self.directory = ""
        self.config = Config()
        self._gsn: GsnSource = lambda: 0
        self._shards: list[_Shard] = []
        self._sealer: Sealer | None = None
        # An unencrypted store's put in one compiled call (set at open): see put.
        self._putter: PutKernel | None = None
        self._salt = b""
        self._encrypted = False
        self._poisoned: str | None = None
        self._closed = False
        self._compact_deferred = False  # write_locked rotated a shard: maybe_compact has work
        self._torn_dropped = 0
        self._unsynced_dropped = 0
        self._gsn_limit = MAX_RESERVED
        self._compaction_bytes = 0
        self._compactions = 0
        # Set by the Db: wakes its flusher to run a due timed sync (False: no flusher).
        self.kick: Callable[[], bool] | None = None
        install_own_dict(self)  # the compiled put (PutKernel) reads and writes its attributes in place

    def set_kick(self, kick: Callable[[], bool]) -> None:
        """Let timed syncs wake the Db's flusher (see :meth:`_maybe_sync`)."""
        self.kick = kick

    # -- opening ------------------------------------------------------------------------

    @classmethod
    def open(cls, directory: str, config: Config, gsn: GsnSource, *, gsn_limit: int | None = None) -> BitcaskStore:
        """Open or create the collection in ``directory``.

        Parameters
        ----------
        directory : str
            The collection folder (``<db>/<collection name>``); created if missing.
        config : Config
            Bitcask settings.  ``shard_count=None`` means the stored count (1 when
            creating).
        gsn : callable
            Returns the next global sequence number; called under a shard lock for
            every record appended by :meth:`put` and :meth:`delete`.  It must
            return numbers above :attr:`max_gsn`.
        gsn_limit : int, optional
            Every gsn on disk is below it: the end of the gsn block the database has
            reserved in its sequence map.  A record or file header at or above it is
            refused with CorruptionError.  Default: ``armdb.seqmap.MAX_RESERVED``.

        Returns
        -------
        BitcaskStore

        Raises
        ------
        ConfigError
            The shard count differs from the stored one, or a key was given for an
            unencrypted collection.
        EncryptionKeyRequired
            The collection is encrypted and no key was given.
        WrongKey
            The key does not match the collection's key check value.
        FormatError
            A file of another kind or an unknown version was found; nothing on
            disk was changed.
        CorruptionError
            A record that is not a torn tail fails its checks (the message names
            the file and offset); nothing on disk was changed.
        StorageError
            An I/O error.
        """
        _validate_config(config)
        self = cls()
        self.directory = directory
        self.config = config
        self._gsn = gsn
        self._gsn_limit = MAX_RESERVED if gsn_limit is None else min(gsn_limit, MAX_RESERVED)
        fs = _fs.FS
        meta_path = os.path.join(directory, META_NAME)
        try:
            if fs.exists(meta_path):
                meta = _decode_meta(fs.read_file(meta_path), meta_path)
            else:
                meta = _create(directory, config)
        except OSError as e:
            if isinstance(e, ArmdbError):
                raise
            raise _storage_error(e, f"cannot open collection {directory!r}") from e
        self._check_meta(meta, config, meta_path)
        self._encrypted = meta.encrypted
        self._salt = meta.salt
        plans: list[_ShardPlan] = []
        try:
            for i in range(meta.shard_count):
                plans.append(_scan_shard_files(directory, i, self._encrypted))
            unseal = self._unseal_key if self._sealer is not None else None
            for plan in plans:
                _load_shard(plan, self._encrypted, unseal, self._gsn_limit)
            for plan in plans:
                self._shards.append(_apply_plan(self, plan))
        except BaseException as exc:
            for plan in plans:
                plan.close_all()
            for sh in self._shards:
                sh.hint.abort()
            if isinstance(exc, OSError) and not isinstance(exc, ArmdbError):
                raise _storage_error(exc, f"cannot open collection {directory!r}") from exc
            raise
        if self._sealer is None:
            self._putter = PutKernel(self, self._shards, own_dict(self), vars(_fs), vars(_fail), vars(_files),
                                     _auto_compact, RECORD_MAGIC, MARKED_DATA_VERSION, MAX_KEY_LEN, MAX_VALUE_LEN,
                                     SEQ_MASK)
        return self

    @property
    def max_gsn(self) -> int:
        """The largest gsn in the collection (records and file headers); seeds the Db's counter."""
        return max((sh.highest for sh in self._shards), default=0)

    def _check_meta(self, meta: _Meta, config: Config, path: str) -> None:
        if config.shard_count is not None and config.shard_count != meta.shard_count:
            raise ConfigError(
                f"collection {self.directory!r} was created with shard_count={meta.shard_count}, "
                f"but the config asks for shard_count={config.shard_count}; the shard count is fixed "
                f"at creation: leave it unset or pass {meta.shard_count}"
            )
        key = config.encryption_key
        if meta.encrypted:
            if key is None:
                raise EncryptionKeyRequired(
                    f"collection {self.directory!r} is encrypted; open it with "
                    f"Config.balanced().encryption_key(<the 32-byte key>)"
                )
            self._sealer = Sealer(key)
            try:
                self._sealer.verify(meta.check)
            except WrongKey:
                raise WrongKey(
                    f"the encryption key given for collection {os.path.basename(self.directory)!r} does not "
                    f"match the key it was created with ({self.directory}); open it with the original key"
                ) from None
        elif key is not None:
            raise ConfigError(
                f"collection {self.directory!r} is not encrypted, but an encryption key was given; "
                f"open it without encryption_key (a collection's encryption is fixed at creation)"
            )

    def _unseal_key(self, key_field: bytes, gsn_word: int, off: int, path: str) -> bytes:
        assert self._sealer is not None
        return self._sealer.open(key_field, self._aad(b"K", gsn_word), what=f"{path}: key at offset {off}")

    def _new_data_file(self, sdir: str, fid: int, flags: int, base_gsn: int, *, tmp: bool) -> _DataFile:
        """Create a data file with its header.

        With ``tmp`` (a compaction output) it is ``<name>.tmp``, unsynced, renamed later.
        Otherwise it is created whole and durably by :meth:`armdb._fs.RealFS.create_file`
        (even without ``enable_fsync``: creation is rare, and a header torn by power loss
        could not be told from a foreign file).
        """
        fs = _fs.FS
        path = os.path.join(sdir, _data_name(fid))
        nonce = _new_nonce()
        header = _new_file_head(fid, flags, base_gsn, nonce)
        if not tmp:
            try:
                fd = fs.create_file(path, header)
            except _fs.SyncFailed as e:
                raise self._sync_failed(e, path) from e
            return _DataFile(fid, path, fd, DATA_START, flags, nonce, base_gsn)
        open_path = path + ".tmp"
        fd = fs.open(open_path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        try:
            fs.pwrite(fd, header, 0)
        except BaseException:
            fs.close(fd)
            try:
                fs.unlink(open_path)
            except OSError:
                pass
            raise
        return _DataFile(fid, path, fd, DATA_START, flags, nonce, base_gsn)

    # -- helpers ---------------------------------------------------------------------------

    def _aad(self, tag: bytes, gsn_word: int) -> bytes:
        return _format.record_aad(self._salt, tag, gsn_word)

    def _fsync(self, fn: Callable[[Any], None], arg: Any, what: str) -> None:
        """Run one fsync-like call; a failure poisons the store (S12) and raises StorageError."""
        try:
            fn(arg)
        except OSError as e:
            raise self._sync_failed(e, what) from e

    def _sync_failed(self, e: OSError, what: str) -> StorageError:
        """Poison the store after a failed sync (S12); returns the error to raise."""
        self._poisoned = f"sync of {what} failed: {e}"
        log.error(
            "fsync of %s failed (%s); collection %s refuses writes until the Db is reopened",
            what,
            e,
            self.directory,
        )
        return StorageError(
            e.errno or errno.EIO,
            f"fsync of {what} failed ({e.strerror or e}); the last writes may not be durable and "
            f"collection {self.directory!r} refuses further writes: reopen the Db",
        )

    def _check_open(self) -> None:
        if self._closed:
            raise DbClosed(f"collection {self.directory!r}")

    def check_writable(self) -> None:
        if self._closed:
            raise DbClosed(f"collection {self.directory!r}")
        if self._poisoned is not None:
            raise StorageError(
                errno.EIO,
                f"collection {self.directory!r} refuses writes after a failed sync "
                f"({self._poisoned}): reopen the Db",
            )

    @staticmethod
    def _key_arg(key: object) -> bytes:
        if type(key) is bytes:
            return key
        if isinstance(key, (bytes, bytearray, memoryview)):
            return bytes(key)
        raise PayloadTypeError(f"Bitcask keys are bytes, not {type(key).__name__}")

    @staticmethod
    def _key_len_ok(key: bytes) -> bytes:
        if len(key) > MAX_KEY_LEN:
            raise ConfigError(f"key of {len(key)} bytes is longer than the limit of {MAX_KEY_LEN} bytes")
        return key

    def _shard(self, key: bytes) -> _Shard:
        shards = self._shards
        return shards[0] if len(shards) == 1 else shards[zlib.crc32(key) % len(shards)]

    def _encode(self, key: bytes, value: bytes | None, gsn_word: int) -> tuple[bytes, bytes, int]:
        """Build a record; returns (record bytes, key field, value field length)."""
        if self._sealer is not None:
            kf = self._sealer.seal(key, self._aad(b"K", gsn_word))
            vf = b"" if value is None else self._sealer.seal(value, self._aad(b"V", gsn_word))
        else:
            kf = key
            vf = b"" if value is None else value
        return bitcask_record(gsn_word, kf, vf, RECORD_MAGIC), kf, len(vf)

    def _next_seq(self, sh: _Shard) -> int:
        seq = self._gsn()
        if not isinstance(seq, int) or not sh.highest < seq <= SEQ_MASK:
            raise self._bad_gsn(sh, seq)
        return seq

    @staticmethod
    def _bad_gsn(sh: _Shard, seq: object) -> ArmdbError:
        return ArmdbError(
            f"the gsn source returned {seq!r}, which is not above this shard's highest gsn "
            f"{sh.highest}; seed the Db's counter from BitcaskStore.max_gsn"
        )

    # -- writing ---------------------------------------------------------------------------

    def _write(self, sh: _Shard, key: bytes, value: bytes | None, seq: int) -> bool:
        """Append one record, update the index and run the timed sync when due (under
        ``sh.lock``); True if the shard rotated."""
        gsn_word = seq | (TOMBSTONE if value is None else 0)
        act = sh.active
        # Everything before this record was synced: say so (a rotation below keeps it
        # true, as a new data file is created durably).
        if act.version >= MARKED_DATA_VERSION and act.size == sh.synced:
            gsn_word |= SYNCED_BEFORE
        if self._sealer is None:  # _encode, one call less
            kf = key
            vlen = 0 if value is None else len(value)
            rec = bitcask_record(gsn_word, key, b"" if value is None else value, RECORD_MAGIC)
        else:
            rec, kf, vlen = self._encode(key, value, gsn_word)
        rotated = False
        if act.total and act.size + len(rec) > self.config.max_file_size:
            try:
                self._rotate(sh)
            except OSError as e:
                if isinstance(e, ArmdbError):
                    raise
                raise _storage_error(
                    e, f"starting a new data file after {act.path} failed; nothing was written"
                ) from e
            act = sh.active
            rotated = True
        off = act.size
        try:
            _fs.FS.pwrite(act.fd, rec, off)  # _pwrite, its frame saved on this path
        except OSError as e:
            raise self._append_failed(act, off, e) from e
        size = len(rec)
        act.size = off + size
        act.total += size
        sh.dirty = True
        sh.hint.add(gsn_word, off, vlen, kf)
        _fail.point("bitcask.after_append")
        index = sh.index
        if value is not None:
            if key not in index and key not in sh.tombs:
                index[key] = (act.fid, off, size, gsn_word, None)  # a new key: nothing older to mask
            else:
                self._index_update(sh, key, act.fid, off, size, gsn_word)
        elif (old := index.get(key)) is not None and old[4] is None and old[0] == act.fid:
            # The common delete (a var ack's body): a put in this same file that no older
            # file's record can outlive, so both it and the tombstone are garbage at once.
            del index[key]
            act.dead += old[2] + size
        else:
            self._index_update(sh, key, act.fid, off, size, gsn_word)
        sh.highest = seq
        # _maybe_sync, which every single write ran next, without its frame (sh.dirty is
        # set above): the timed sync when due.
        cfg = self.config
        if cfg.enable_fsync:
            now = time.monotonic()
            if not cfg.sync_interval or now - sh.last_sync >= cfg.sync_interval:
                self._sync_due(sh, now)
        return rotated

    def _pwrite(self, act: Any, data: bytes, off: int) -> None:
        """Append ``data`` at ``off`` of the active file, or undo the partial write."""
        try:
            _fs.FS.pwrite(act.fd, data, off)
        except OSError as e:
            raise self._append_failed(act, off, e) from e

    def _append_failed(self, act: Any, off: int, e: OSError) -> StorageError:
        """An append at ``off`` of the active file failed: cut the file back to ``off``
        (poison the store if that fails too); returns the error to raise."""
        try:
            _fs.FS.ftruncate(act.fd, off)
        except OSError:
            self._poisoned = f"could not undo a failed append to {act.path}"
        return _storage_error(e, f"append to {act.path} failed; nothing was written")

    @staticmethod
    def _group_flag(sh: _Shard) -> int:
        """The first record of an append says everything before it was synced, when so."""
        act = sh.active
        return SYNCED_BEFORE if act.version >= MARKED_DATA_VERSION and act.size == sh.synced else 0

    def _append_group(self, sh: _Shard, act: Any, data: bytes) -> int:
        """Append a group's records (under ``sh.lock``) to the active file ``act``; returns
        the offset they start at.  The one copy of these steps for every group write
        (:meth:`_write_group`, :meth:`write_puts_locked`, :meth:`delete_many_locked`)."""
        off = act.size
        self._pwrite(act, data, off)
        act.size = off + len(data)
        act.total += len(data)
        sh.dirty = True
        _fail.point("bitcask.after_append")
        return off

    def _write_group(self, sh: _Shard, items: list[tuple[bytes, bytes | None, int]], got: Any = None) -> bool:
        """:meth:`_write` of several records (gsns increasing) in one append; True if the
        shard rotated (then each record went on its own, as a rotation may fall between).
        ``got``: what :func:`bitcask_group` made of ``items`` already, if it ran."""
        act = sh.active
        if self._sealer is None:
            if got is None:
                got = bitcask_group(items, sh.index, 0, self._group_flag(sh), RECORD_MAGIC, act.fid, act.size,
                                    MAX_KEY_LEN, MAX_VALUE_LEN)
                assert got is not None, "write_many_locked passes checked items"
            data, hints, keys, entries, deletes = got
        else:
            recs: list[tuple[bytes, bytes, int, int]] = []  # record, key field, value length, gsn word
            flag = self._group_flag(sh)
            for key, value, seq in items:
                gsn_word = seq | (TOMBSTONE if value is None else 0) | flag
                flag = 0  # only the first record can say that everything before it was synced
                recs.append((*self._encode(key, value, gsn_word), gsn_word))
            data = b"".join([r[0] for r in recs])
            keys, entries, deletes = [], [], sum(1 for _, value, _ in items if value is None)
        if act.total and act.size + len(data) > self.config.max_file_size:
            rotated = False
            for key, value, seq in items:
                if value is not None or key in sh.index:  # a delete of a missing key writes nothing
                    rotated = self._write(sh, key, value, seq) or rotated
            return rotated
        off = self._append_group(sh, act, data)
        if self._sealer is not None:
            hint_add = sh.hint.add
            fid = act.fid
            for (key, _, _), (rec, kf, vlen, gsn_word) in zip(items, recs, strict=True):
                hint_add(gsn_word, off, vlen, kf)
                keys.append(key)
                entries.append((fid, off, len(rec), gsn_word, None))
                off += len(rec)
        else:
            sh.hint.add_raw(hints, len(keys))
        self._group_index(sh, keys, entries, deletes)
        sh.highest = items[-1][2]
        return False

    def _group_index(self, sh: _Shard, keys: list[bytes], entries: list[Any], deletes: int) -> None:
        """The index changes of a group write once its records are appended."""
        act = sh.active
        index, tombs, fid = sh.index, sh.tombs, act.fid
        if not deletes and not tombs and index.keys().isdisjoint(keys):
            index.update(zip(keys, entries))  # new keys only (a push's bodies): nothing older to mask
        else:
            # A new key, or the common delete (a var ack's body: a put in this same file
            # that no older file's record can outlive, so both it and the tombstone are
            # garbage at once, what _index_update concludes) by a compiled loop; any other
            # key the general way, in order.
            i, n = 0, len(keys)
            while i < n:
                dead, i = bitcask_index_apply(index, tombs, keys, entries, fid, i)
                act.dead += dead
                if i < n:
                    entry = entries[i]
                    self._index_update(sh, keys[i], fid, entry[1], entry[2], entry[3])
                    i += 1

    def _index_update(self, sh: _Shard, key: bytes, fid: int, off: int, size: int, gsn_word: int) -> None:
        old = sh.index.pop(key, None)
        old_put = old is not None
        if old is None:
            old = sh.tombs.pop(key, None)
        holders: frozenset[int] | None = None
        if old is not None:
            files = sh.files
            of = files.get(old[0])
            if of is not None:
                of.dead += old[2]
            # An overwrite in the active file of a key no older file holds (the common
            # case) leaves nothing to mask: holders stays None.
            if old[4] is not None or (old_put and old[0] != fid):
                hs = set(old[4] or ())
                if old_put:
                    hs.add(old[0])
                hs.discard(fid)
                holders = frozenset(h for h in hs if h in files) or None
        if gsn_word & TOMBSTONE:
            if holders is None:
                sh.files[fid].dead += size  # nothing older left to mask: garbage at once
            else:
                sh.tombs[key] = (fid, off, size, gsn_word, holders)
        else:
            sh.index[key] = (fid, off, size, gsn_word, holders)

    def _maybe_sync(self, sh: _Shard) -> None:
        """The timed sync, when due (:meth:`_write` runs the same test at its end)."""
        cfg = self.config
        if not cfg.enable_fsync or not sh.dirty:
            return
        now = time.monotonic()
        if cfg.sync_interval and now - sh.last_sync < cfg.sync_interval:
            return
        self._sync_due(sh, now)

    def _sync_due(self, sh: _Shard, now: float) -> None:
        """A timed sync is due (under ``sh.lock``)."""
        cfg = self.config
        # Wake the Db's flusher, which syncs without the lock (_sync_shard), rather than
        # make this writer and every thread waiting on the lock wait for the disk.
        kick = self.kick
        if cfg.sync_interval and kick is not None and _fs.background_sync_ok() and kick():
            sh.last_sync = now
            return
        self._sync_active_locked(sh)
        _fail.point("bitcask.after_sync")

    def _sync_active_locked(self, sh: _Shard) -> None:
        """``fdatasync`` the active file under ``sh.lock`` and record that it is synced."""
        self._fsync(_fs.FS.fdatasync, sh.active.fd, sh.active.path)
        self._synced_active(sh)
        sh.dirty = False
        sh.last_sync = time.monotonic()

    def _synced_active(self, sh: _Shard, size: int | None = None) -> None:
        """A completed sync just covered the active file up to ``size`` (all of it when
        None; under ``sh.lock``): later appends may carry the synced-before flag, and the
        synced mark moves.  The mark only sharpens open's verdict, so a failure to write
        it is logged, not raised."""
        act = sh.active
        if size is None:
            size = act.size
        sh.synced = size
        if sh.marks is not None:
            try:
                sh.marks.write(size)
            except OSError as e:
                log.warning("%s: could not write the synced mark (%s); open will rely on record flags", act.path, e)
                sh.marks = None

    def _seal_mark(self, sh: _Shard) -> None:
        """At a clean close: sync the active file, mark its end, sync it again, so that any
        bad byte found later in it is below the mark and refused as damage."""
        act = sh.active
        if sh.marks is None:
            return
        try:
            if sh.dirty or sh.synced != act.size:
                _fs.FS.fdatasync(act.fd)
                sh.dirty = False
            sh.synced = act.size
            sh.marks.seal(act.size)
        except OSError as e:
            log.warning("%s: could not seal the synced mark at close (%s)", act.path, e)

    def _rotate(self, sh: _Shard) -> None:
        """Seal the active file and start a new one (under ``sh.lock``)."""
        old = sh.active
        # The sealed file is synced even without enable_fsync: rotation is rare, and
        # it lets a log checkpoint (sync_now) sync only the active file.
        if sh.dirty:
            self._fsync(_fs.FS.fdatasync, old.fd, old.path)
        sh.dirty = False
        sh.last_sync = time.monotonic()
        fid = sh.next_fid
        new = self._new_data_file(sh.sdir, fid, old.flags & FLAG_ENCRYPTED, sh.highest, tmp=False)
        sh.next_fid = fid + 1
        sh.files[fid] = new
        sh.active = new
        sh.synced = new.size  # created durably, header and all
        if sh.marks is not None:
            sh.marks.rebind(new.fd, _data_header(new), new.size)
        else:  # a failed mark write stopped marks in the old file; the new one starts afresh
            sh.marks = _syncmark.MarkWriter(new.fd, _data_header(new), new.size)
        _fail.point("bitcask.after_rotate")
        hint, sh.hint = sh.hint, _HintBuilder(sh.sdir, new)
        try:
            hint.finish(old.size)
        except OSError as e:
            hint.abort()
            log.warning("could not write hint file %s: %s (the data file will be scanned)", hint.final, e)
        _fail.point("bitcask.after_hint")

    def put(self, key: bytes, value: bytes) -> int:
        """Store ``value`` under ``key``.

        Parameters
        ----------
        key : bytes
            At most :data:`MAX_KEY_LEN` bytes.
        value : bytes
            At most :data:`MAX_VALUE_LEN` bytes (may be empty).

        Returns
        -------
        int
            The gsn of the record written.

        Raises
        ------
        PayloadTypeError
            ``key`` or ``value`` is not bytes.
        ConfigError
            ``key`` or ``value`` is too long.
        StorageError
            The append or its sync failed; after a failed sync every later write
            fails too, until the Db is reopened (S12).
        DbClosed
            The store is closed.
        """
        if type(key) is not bytes or len(key) > MAX_KEY_LEN:
            key = self._key_len_ok(self._key_arg(key))
        if type(value) is not bytes or len(value) > MAX_VALUE_LEN:
            value = self._value_arg(value)
        shards = self._shards
        i = 0 if len(shards) == 1 else zlib.crc32(key) % len(shards)  # _shard
        putter = self._putter
        if putter is not None:
            # An unencrypted store: the steps below in one compiled call (PutKernel.put,
            # which writes the record as _write does, in the same order).
            return putter.put(i, key, value)
        sh = shards[i]
        lock = sh.lock
        lock.acquire()  # not ``with``, which looks up and binds __enter__ and __exit__ each time
        try:
            if self._closed or self._poisoned is not None:
                self.check_writable()
            seq = self._gsn()  # _next_seq, its frame saved on this path
            if type(seq) is not int or not sh.highest < seq <= SEQ_MASK:
                raise self._bad_gsn(sh, seq)
            rotated = self._write(sh, key, value, seq)  # and the timed sync, when due
        finally:
            lock.release()
        if rotated or sh.compact_due:
            _auto_compact(self, sh)
        return seq

    def delete(self, key: bytes) -> bool:
        """Delete ``key`` by appending a tombstone.

        Parameters
        ----------
        key : bytes

        Returns
        -------
        bool
            True if the key was present (a tombstone was written), False otherwise.

        Raises
        ------
        StorageError, DbClosed
            As for :meth:`put`.
        """
        key = self._key_arg(key)
        sh = self._shard(key)
        with sh.lock:
            self.check_writable()
            if key not in sh.index:
                return False
            seq = self._next_seq(sh)
            rotated = self._write(sh, key, None, seq)  # and the timed sync, when due
        if rotated or sh.compact_due:
            _auto_compact(self, sh)
        return True

    def apply(self, key: bytes, value: bytes | None, gsn: int) -> bool:
        """Replay one logged write idempotently (SPEC T2).

        The record is written with exactly ``gsn`` only if ``gsn`` is above the
        highest gsn of the key's shard; otherwise it was applied before.

        Parameters
        ----------
        key : bytes
        value : bytes or None
            The value, or None for a delete.
        gsn : int
            The gsn the transaction log assigned.

        Returns
        -------
        bool
            True if the step took effect now (a record was written, or a delete
            found no key), False if it was skipped as already applied.

        Raises
        ------
        StorageError, DbClosed, ConfigError, PayloadTypeError
            As for :meth:`put`.
        """
        key = self._key_len_ok(self._key_arg(key))
        if value is not None:
            value = self._value_arg(value)
        if not isinstance(gsn, int) or not 0 < gsn < MAX_RESERVED:
            raise ConfigError(f"gsn must be an int in [1, 2**56), got {gsn!r}")
        sh = self._shard(key)
        with sh.lock:
            self.check_writable()
            if gsn <= sh.highest:
                return False
            if value is None and key not in sh.index:
                return True
            rotated = self._write(sh, key, value, gsn)  # and the timed sync, when due
        if rotated or sh.compact_due:
            _auto_compact(self, sh)
        return True

    def _value_arg(self, value: object) -> bytes:
        if type(value) is not bytes:
            if not isinstance(value, (bytearray, memoryview)):
                raise PayloadTypeError(f"Bitcask values are bytes, not {type(value).__name__}")
            value = bytes(value)
        if len(value) > MAX_VALUE_LEN:
            raise ConfigError(
                f"value of {len(value)} bytes is larger than the limit of {MAX_VALUE_LEN} bytes"
            )
        return value  # type: ignore[return-value]

    def sync(self) -> None:
        """``fdatasync`` every shard's active file that has unsynced appends.

        Does nothing when ``enable_fsync`` is off.

        Raises
        ------
        StorageError
            A sync failed; the store is poisoned until reopened (S12).
        """
        if not self.config.enable_fsync or self._closed or self._poisoned is not None:
            return
        unlocked = _fs.background_sync_ok()
        for sh in self._shards:
            if unlocked:
                self._sync_shard(sh)
                continue
            with sh.lock:
                if sh.dirty and not self._closed and self._poisoned is None:
                    self._sync_active_locked(sh)

    def _sync_shard(self, sh: _Shard) -> None:
        """The flusher's sync of one shard, with the lock held only around it: writers
        append meanwhile.  It syncs a duplicate of the descriptor (a rotation or close may
        close the original), and counts as synced only the size it saw; the shard stays
        dirty if anything was appended since, and a sync under the lock (close, a log
        checkpoint) syncs again rather than wait for this one."""
        with sh.lock:
            if not sh.dirty or sh.flushing or sh.closed or self._closed or self._poisoned is not None:
                return
            act = sh.active
            size = act.size
            fd = _fs.FS.dup(act.fd)
            sh.flushing = True
            sh.last_sync = time.monotonic()
        err: OSError | None = None
        try:
            try:
                _fs.FS.fdatasync(fd)
            finally:
                _fs.FS.close(fd)
        except OSError as e:
            err = e
        with sh.lock:
            sh.flushing = False
            if err is not None:
                raise self._sync_failed(err, act.path) from err
            if sh.closed or self._closed or sh.active is not act:
                return  # closed or rotated: both synced the file themselves
            if size > sh.synced:
                self._synced_active(sh, size)
            if act.size == size:
                sh.dirty = False
        _fail.point("bitcask.after_sync")

    def sync_now(self) -> None:
        """``fdatasync`` every dirty active file even when ``enable_fsync`` is off.

        The transaction log calls this before it trims applied records: from then
        on the store's own files must hold what the log held.  (Rotation always
        syncs the file it seals, so older files need nothing here.)

        Raises
        ------
        StorageError
            The store is poisoned, or the sync failed (S12).
        """
        self.check_writable()
        for sh in self._shards:
            with sh.lock:
                self._check_open()  # a close may have closed the descriptors meanwhile
                if sh.dirty:
                    self._sync_active_locked(sh)

    # -- reading ---------------------------------------------------------------------------

    def _read(self, key: bytes) -> tuple[bytes, int] | None:
        sh = self._shard(key)
        with sh.lock:
            got = self._read_locked(sh, key)
        if got is None:
            return None
        path, e, data = got
        return self._decode_value(path, e, data, key), e[3] & SEQ_MASK

    def _read_locked(self, sh: _Shard, key: bytes) -> tuple[str, Entry, bytes] | None:
        """Look ``key`` up and read its record (the caller holds ``sh.lock``)."""
        self._check_open()
        e = sh.index.get(key)
        if e is None:
            return None
        f = sh.files[e[0]]
        try:
            return f.path, e, _fs.FS.pread(f.fd, e[2], e[1])
        except OSError as err:
            raise _storage_error(err, f"read of {f.path} at offset {e[1]} failed") from err

    def _decode_value(self, path: str, e: Entry, data: bytes, key: bytes) -> bytes:
        off = e[1]
        if len(data) >= REC_HEAD_SIZE:
            gsn_word, crc, vlen, magic, klen = REC_HEAD.unpack_from(data)
            n = REC_HEAD_SIZE + klen + vlen
            if (
                gsn_word == e[3]
                and magic == RECORD_MAGIC
                and _pad8(n) == len(data)
                and _record_crc(data, n) == crc
            ):
                if self._sealer is None:
                    if data[REC_HEAD_SIZE : REC_HEAD_SIZE + klen] == key:
                        return data[REC_HEAD_SIZE + klen : n]
                else:
                    return self._sealer.open(
                        memoryview(data)[REC_HEAD_SIZE + klen : n],
                        self._aad(b"V", gsn_word),
                        what=f"{path}: value at offset {off}",
                    )
        raise CorruptionError(
            f"{path}: record at offset {off} fails its checks (CRC, length or key); "
            f"the file is damaged: restore it from a backup (armdb.check lists every bad record)"
        )

    def get(self, key: bytes) -> bytes | None:
        """Return the value stored under ``key``, or None.

        Raises
        ------
        CorruptionError
            The record fails its CRC or (encrypted) its authentication tag.
        StorageError, DbClosed
        """
        r = self._read(self._key_arg(key))
        return None if r is None else r[0]

    def get_with_gsn(self, key: bytes) -> tuple[bytes, int] | None:
        """Return ``(value, gsn)`` for ``key``, or None; the gsn identifies this version."""
        return self._read(self._key_arg(key))

    def gsn_of(self, key: bytes) -> int | None:
        """Return the gsn of the key's current record without reading it (None if absent)."""
        key = self._key_arg(key)
        sh = self._shard(key)
        with sh.lock:
            self._check_open()
            e = sh.index.get(key)
        return None if e is None else e[3] & SEQ_MASK

    def __contains__(self, key: object) -> bool:
        k = self._key_arg(key)
        sh = self._shard(k)
        with sh.lock:
            self._check_open()
            return k in sh.index

    def __len__(self) -> int:
        self._check_open()
        return sum(len(sh.index) for sh in self._shards)

    def keys(self) -> Iterator[bytes]:
        """Iterate the keys (a snapshot per shard; order unspecified)."""
        self._check_open()
        for sh in self._shards:
            with sh.lock:
                ks = list(sh.index)
            yield from ks

    def __iter__(self) -> Iterator[bytes]:
        return self.keys()

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        """Iterate ``(key, value)`` pairs; keys deleted during iteration are skipped."""
        for key in self.keys():
            r = self._read(key)
            if r is not None:
                yield key, r[0]

    def shard_of(self, key: bytes) -> int:
        """The shard a key lives in: ``zlib.crc32(key) % shard_count`` (stable)."""
        return zlib.crc32(self._key_arg(key)) % len(self._shards)

    @property
    def shard_count(self) -> int:
        """Number of shards of the collection."""
        return len(self._shards)

    @property
    def encrypted(self) -> bool:
        """Whether the collection seals its records."""
        return self._encrypted

    @property
    def poisoned(self) -> bool:
        """Whether a failed sync made the store refuse writes (S12)."""
        return self._poisoned is not None

    def stats(self) -> dict[str, Any]:
        """Counters of the collection.

        Returns
        -------
        dict
            ``keys``, ``tombstones`` (kept on disk to mask older puts), ``files``,
            ``shards``, ``data_bytes`` (sum of data file sizes), ``live_bytes``,
            ``dead_bytes``, ``compaction_bytes`` (input bytes compacted since
            open), ``compactions``, ``torn_bytes_dropped``, ``poisoned``,
            ``encrypted``.
        """
        keys = tombs = files = data = live = dead = 0
        for sh in self._shards:
            with sh.lock:
                keys += len(sh.index)
                tombs += len(sh.tombs)
                files += len(sh.files)
                for f in sh.files.values():
                    data += f.size
                    live += f.total - f.dead
                    dead += f.dead
        return {
            "keys": keys,
            "tombstones": tombs,
            "files": files,
            "shards": len(self._shards),
            "data_bytes": data,
            "live_bytes": live,
            "dead_bytes": dead,
            "compaction_bytes": self._compaction_bytes,
            "compactions": self._compactions,
            "torn_bytes_dropped": self._torn_dropped,
            "unsynced_records_dropped": self._unsynced_dropped,
            "poisoned": self._poisoned is not None,
            "encrypted": self._encrypted,
        }

    # -- hooks for the Db's transactions ---------------------------------------------------
    #
    # A commit takes the shard locks of every key it writes, in the global order
    # given by ``lock_key``, then reads and writes through the ``*_locked``
    # methods below, which do not take the lock themselves (it is not
    # reentrant).  A rotation under the caller's lock does not compact inline
    # (compaction takes ``compact_lock`` before ``lock``); it flags the shard,
    # and the next direct write or :meth:`maybe_compact` compacts it.

    def lock_key(self, key: bytes) -> tuple[str, int]:
        """Sort key of the lock guarding ``key``: ``(shard folder, 0)``, like FixedStore shards."""
        return (self._shard(self._key_arg(key)).sdir, 0)

    def lock_for(self, key: bytes) -> threading.Lock:
        """The shard lock guarding ``key``."""
        return self._shard(self._key_arg(key)).lock

    def shard_lock(self, key: bytes) -> tuple[str, threading.Lock]:
        """``(lock_key(key)[0], lock_for(key))`` in one shard lookup (the commit hot path)."""
        if type(key) is not bytes:
            key = self._key_arg(key)
        shards = self._shards  # _shard, its frame saved on the commit path
        sh = shards[0] if len(shards) == 1 else shards[zlib.crc32(key) % len(shards)]
        return sh.sdir, sh.lock

    def all_locks(self) -> list[tuple[tuple[str, int], threading.Lock]]:
        """Every shard lock with its sort key (for commits that lock a whole collection)."""
        return [((sh.sdir, 0), sh.lock) for sh in self._shards]

    def get_locked(self, key: bytes) -> bytes | None:
        """:meth:`get` for a caller that already holds ``lock_for(key)``."""
        key = self._key_arg(key)
        got = self._read_locked(self._shard(key), key)
        if got is None:
            return None
        path, e, data = got
        return self._decode_value(path, e, data, key)

    def contains_locked(self, key: bytes) -> bool:
        """Whether ``key`` holds a value, for a caller that holds ``lock_for(key)`` (no read)."""
        self._check_open()
        key = self._key_arg(key)
        return key in self._shard(key).index

    def write_locked(self, key: bytes, value: bytes | None, gsn: int) -> bool:
        """Write one committed transaction row with exactly ``gsn`` (caller holds ``lock_for(key)``).

        Parameters
        ----------
        key : bytes
        value : bytes or None
            The value, or None for a delete.
        gsn : int
            The gsn the commit drew (under this lock, so above the shard's highest).

        Returns
        -------
        bool
            False for a delete of a missing key (nothing written), else True.

        Raises
        ------
        ArmdbError
            ``gsn`` is not above the shard's highest gsn (it was drawn outside the lock).
        StorageError, DbClosed, ConfigError, PayloadTypeError
            As for :meth:`put`.
        """
        if type(key) is not bytes or len(key) > MAX_KEY_LEN:
            key = self._key_len_ok(self._key_arg(key))
        if value is not None and (type(value) is not bytes or len(value) > MAX_VALUE_LEN):
            value = self._value_arg(value)
        shards = self._shards
        sh = shards[0] if len(shards) == 1 else shards[zlib.crc32(key) % len(shards)]  # _shard
        if sh.closed or self._poisoned is not None:
            # Only this shard's own state: a commit that holds this lock while close
            # begins (the store flagged closed, this shard not yet) applies in full.
            self.check_writable()
        if value is None and key not in sh.index:
            return False
        if not isinstance(gsn, int) or not sh.highest < gsn <= SEQ_MASK:
            raise ArmdbError(
                f"gsn {gsn!r} is not above this shard's highest gsn {sh.highest}; draw gsns for a "
                f"commit while holding the shard lock"
            )
        if self._write(sh, key, value, gsn):  # and the timed sync, when due
            sh.compact_due = True
            self._compact_deferred = True
        return True

    def tomb_locked(self, key: bytes, gsn: int) -> bool:
        """:meth:`write_locked` of the delete ``(key, None, gsn)`` (a var queue's lone ack
        of its body, ``armdb.tx.commit_settle``; the caller holds the key's shard lock):
        the same record, hint entry and index change.  An unencrypted store writes it by
        its compiled kernel (``PutKernel.tomb``, which a var queue's compiled ack also
        calls directly), which hands anything but the common case (several shards, a
        closed or fenced store, a missing key, a rotation due) to :meth:`write_locked`;
        an encrypted one goes there at once."""
        putter = self._putter
        if putter is not None:
            return putter.tomb(key, gsn)
        return self.write_locked(key, None, gsn)

    def _lone_plain_shard(self) -> _Shard | None:
        """The one shard of an unencrypted store with one shard, refused if it cannot be
        written (closed, fenced): the case the compiled group writes handle.  None for any
        other store, which takes the general group write."""
        shards = self._shards
        if len(shards) != 1 or self._sealer is not None:
            return None
        sh = shards[0]
        if sh.closed or self._poisoned is not None:
            self.check_writable()
        return sh

    def write_many_locked(self, items: list[tuple[bytes, bytes | None, int]]) -> None:
        """:meth:`write_locked` of a batch's committed rows (the caller holds the lock of
        every key's shard; gsns increase in item order): the records of each shard are
        appended to its data file in one write.  A delete of a missing key writes nothing."""
        shards = self._shards
        sh = self._lone_plain_shard()
        if sh is not None:
            # One shard, no key: the compiled group encoder checks the items and skips
            # deletes of missing keys in the same pass; anything it finds not plain goes
            # the general way below, which raises the matching error.
            act = sh.active
            got = bitcask_group(items, sh.index, sh.highest, self._group_flag(sh), RECORD_MAGIC, act.fid, act.size,
                                MAX_KEY_LEN, MAX_VALUE_LEN)
            if got is not None:
                if got[2]:
                    if self._write_group(sh, items, got):
                        sh.compact_due = True
                        self._compact_deferred = True
                    self._maybe_sync(sh)
                return
        groups: dict[int, list[tuple[bytes, bytes | None, int]]] = {}
        nsh = len(shards)
        prev = 0
        for item in items:
            key, value, gsn = item
            if len(key) > MAX_KEY_LEN or type(key) is not bytes or value is not None and (
                    type(value) is not bytes or len(value) > MAX_VALUE_LEN):
                key = self._key_len_ok(self._key_arg(key))
                if value is not None:
                    value = self._value_arg(value)
                item = (key, value, gsn)
            if type(gsn) is not int or not prev < gsn <= SEQ_MASK:
                raise ArmdbError(f"gsn {gsn!r} of a batch is not above the one before it ({prev}); draw a "
                                 f"commit's gsns in order")
            prev = gsn
            i = 0 if nsh == 1 else zlib.crc32(key) % nsh
            group = groups.get(i)
            if value is None and key not in shards[i].index and not _put_earlier(group, key):
                continue  # deleting a missing key writes nothing
            if group is None:
                groups[i] = [item]
            else:
                group.append(item)
        for i, group in groups.items():
            sh = shards[i]
            if sh.closed or self._poisoned is not None:
                self.check_writable()
            if group[0][2] <= sh.highest:  # the batch's gsns increase: its first one says it all
                raise ArmdbError(
                    f"gsn {group[0][2]!r} is not above this shard's highest gsn {sh.highest}; draw gsns for a "
                    f"commit while holding the shard lock"
                )
            if self._write_group(sh, group):
                sh.compact_due = True
                self._compact_deferred = True
            self._maybe_sync(sh)

    def write_puts_locked(self, keys: list[bytes], values: list[bytes], g0: int) -> None:
        """:meth:`write_many_locked` of puts, ``keys[i]`` with ``values[i]`` at gsn ``g0 + i``
        (a push batch's bodies; the caller holds every key's shard lock): the same records,
        hint entries and index, built from the two lists by a compiled loop
        (:func:`bitcask_puts`) with no item tuple a row.  Anything but one unencrypted
        shard with room in its active file goes through :meth:`write_many_locked`."""
        sh = self._lone_plain_shard()
        if sh is not None:
            act = sh.active
            got = bitcask_puts(keys, values, g0, sh.highest, self._group_flag(sh), RECORD_MAGIC, act.fid, act.size,
                               MAX_KEY_LEN, MAX_VALUE_LEN)
            if got is not None and not (act.total and act.size + len(got[0]) > self.config.max_file_size):
                data, hints, entries = got
                self._append_group(sh, act, data)
                sh.hint.add_raw(hints, len(keys))
                i = bitcask_index_put_new(sh.index, sh.tombs, keys, entries)  # new keys, the common case
                if i < len(keys):
                    self._group_index(sh, keys[i:], entries[i:], 0)
                sh.highest = g0 + len(keys) - 1
                self._maybe_sync(sh)
                return
        self.write_many_locked(list(zip(keys, values, range(g0, g0 + len(keys)), strict=True)))

    def delete_many_locked(self, keys: list[bytes], g0: int) -> None:
        """:meth:`write_many_locked` of the deletes ``(keys[i], None, g0 + i)`` (a var
        ``ack_many``'s bodies; the caller holds every key's shard lock): the same records,
        hint entries and index changes, built by compiled loops with no item tuple or index
        entry per key.  Anything but the common case (several shards, encryption, a
        rotation, a key not plain) goes through :meth:`write_many_locked`."""
        sh = self._lone_plain_shard() if keys else None
        if sh is not None:
            act = sh.active
            flag = self._group_flag(sh)
            index, fid = sh.index, act.fid
            # Each key's entry leaves the index as its tombstone is built (one lookup a
            # key), and goes back if the tombstones are not appended: the index changes
            # only with the append, as the records say.
            got = bitcask_tombs_take(keys, index, fid, g0, sh.highest, flag, RECORD_MAGIC, act.size, MAX_KEY_LEN)
            if got is not None:
                data, hints, kinds, taken = got
                if act.total and act.size + len(data) > self.config.max_file_size:
                    bitcask_tombs_restore(index, keys, kinds, taken)  # a rotation first: the general path
                else:
                    try:
                        off = self._append_group(sh, act, data)
                    except BaseException:
                        bitcask_tombs_restore(index, keys, kinds, taken)
                        raise
                    n, i = len(keys), 0
                    sh.hint.add_raw(hints, n)
                    while i < n:
                        dead, i, off, word = bitcask_tombs_settle(keys, kinds, taken, off, g0, flag, i)
                        act.dead += dead
                        if i < n:  # a delete of another case: the general update, in order
                            size = 20 + len(keys[i])
                            size += -size & 7
                            self._index_update(sh, keys[i], fid, off, size, word)
                            off += size
                            i += 1
                    sh.highest = g0 + n - 1
                    self._maybe_sync(sh)
                    return
        self.write_many_locked([(k, None, g0 + i) for i, k in enumerate(keys)])

    def maybe_compact(self) -> None:
        """Run the compactions that rotations under a caller's lock deferred (never raises)."""
        if not self._compact_deferred:
            return  # the common case: no rotation under a caller's lock since the last call
        self._compact_deferred = False
        for sh in self._shards:
            if sh.compact_due and not self._closed:
                _auto_compact(self, sh)

    def poison(self, reason: str) -> None:
        """Refuse every later write until reopen (e.g. after a commit failed after its log append).

        Writes after a failed apply could carry gsns above the logged rows, and the
        replay on the next open would then skip them; refusing writes keeps replay
        exact.
        """
        if self._poisoned is None:
            self._poisoned = reason
            log.error("collection %s refuses writes until reopen: %s", self.directory, reason)

    # -- compaction ------------------------------------------------------------------------

    def compact(self) -> int:
        """Compact every immutable file whose dead/total ratio exceeds ``compaction_threshold`` (S8).

        Returns
        -------
        int
            Bytes of input data files compacted.

        Raises
        ------
        CorruptionError
            An input record fails its checks (nothing is changed).
        StorageError, DbClosed
        """
        self.check_writable()
        return _compact_all(self, self._shards)

    # -- closing ---------------------------------------------------------------------------

    def close(self) -> None:
        """Sync (when ``enable_fsync``) and close every file.  A second call does nothing.

        Raises
        ------
        StorageError
            The final sync failed (the files are closed anyway).
        """
        if self._closed:
            return
        # Closed first: an operation racing the close finds the flag under the shard
        # lock (every descriptor use happens under it) and raises DbClosed, instead of
        # using a descriptor closed here, whose number another open file may reuse.
        self._closed = True
        err: BaseException | None = None
        for sh in self._shards:
            with sh.compact_lock, sh.lock:
                sh.closed = True
                if self.config.enable_fsync and sh.dirty and self._poisoned is None:
                    try:
                        self._fsync(_fs.FS.fdatasync, sh.active.fd, sh.active.path)
                        self._synced_active(sh)
                        sh.dirty = False
                    except StorageError as e:
                        err = err or e
                if self._poisoned is None and err is None:
                    self._seal_mark(sh)
                sh.marks = None
                sh.hint.abort()
                for f in sh.files.values():
                    try:
                        _fs.FS.close(f.fd)
                    except OSError:
                        pass
                sh.files = {}
                sh.index = {}
                sh.tombs = {}
        if err is not None:
            raise err

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._shards)} shards"
        return f"<BitcaskStore {self.directory!r} {state}>"


def _validate_config(config: Config) -> None:
    if not isinstance(config, Config):
        raise ConfigError("config must be an armdb.Config (Config.balanced()...build())")
    sc = config.shard_count
    if sc is not None and (not isinstance(sc, int) or isinstance(sc, bool) or sc < 1):
        raise ConfigError(f"shard_count must be an int of at least 1, got {sc!r}")
    if not isinstance(config.max_file_size, int) or config.max_file_size < _MIN_FILE_SIZE:
        raise ConfigError(
            f"max_file_size must be at least {_MIN_FILE_SIZE} bytes, got {config.max_file_size!r}"
        )
    if not 0 < config.compaction_threshold <= 1:
        raise ConfigError(f"compaction_threshold must be in (0, 1], got {config.compaction_threshold!r}")


def _put_earlier(group: list[tuple[bytes, bytes | None, int]] | None, key: bytes) -> bool:
    """Whether the last item of ``group`` (a batch's items for one shard so far) that writes
    ``key`` is a put: then a delete of ``key`` deletes something, although the shard's
    index does not hold it yet (the compiled group encoder asks the same)."""
    for k, value, _ in reversed(group or ()):
        if k == key:
            return value is not None
    return False
