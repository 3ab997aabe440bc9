"""Applying logged rows to their stores at ``Db.open`` (SPEC T2).

The replayer opens each collection a logged row names (FixedStore geometry from
the queue's ``queue.meta``; Bitcask stores with their stored shard count), applies
each row idempotently, syncs, and closes everything again before ``Db.open``
returns; the collections are opened anew when the application asks for them.

* A FixedStore row carries the slot version the commit wrote.  It is applied
  only where that version is NEWER than the slot's on the 30-bit ring (S3), or
  where the slot is torn (a crash during the very write the log describes).
* A Bitcask row carries its gsn; ``BitcaskStore.apply`` writes it only when the
  gsn is above the shard's highest.
* Rows for an encrypted Bitcask collection cannot be sealed without its key,
  which only the application holds: they are kept in ``deferred`` and applied by
  ``Db.open_bitcask`` when the collection is opened with its key.

Every row is input (a CRC only proves the bytes are the ones written, not who wrote
them): before any row is applied, every row of every record is checked by
:func:`check_row` against the naming rule, the collection's stored meta and its files
(shard in range, slot within reach of the file, body within the slot, gsn in range).
Anything else is ``CorruptionError`` naming the log file and offset, and nothing is
created or written.  ``armdb.check`` runs the same checks (``armdb.txlog.check_dir``).

Layer: above the stores and the formats it checks rows against, below the log that
drives it (``TxLog._replay``); it reaches the ``Db`` only through the object passed in.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from . import _fs
from ._core import fixed as _k
from .bitcask import MAX_KEY_LEN, MAX_VALUE_LEN, META_NAME
from .config import QUEUE_GROW_STEP, Config, FixedConfig
from .errors import ConfigError, CorruptionError, EncryptionKeyRequired, FormatError, PayloadTypeError
from .fixed import (
    DELETED,
    FILE_NAME,
    FREE,
    HEADER_PAGE,
    OCCUPIED,
    REDO_NAME,
    TORN,
    FixedStore,
    judge_redo_header,
    read_hwm,
    slot_size_for,
)
from .layout import COLLECTIONS, PAYLOAD_SUFFIX, QUEUE_META, validate_name
from .mapcodec import decode_key, decode_value
from .qrows import ROW_DTYPE, decode_meta, key_of, row_problems
from .seqmap import MAX_RESERVED

if TYPE_CHECKING:
    from .bitcask.store import BitcaskStore
    from .db import Db


# How far past the end of its file a logged slot may lie.  A slot is handed out only
# after its file grew to hold it (``FixedShard.grow``: ftruncate, then the slot), so a
# log record can name a slot past the file's end only when a power loss lost that
# growth: the new size reaches the disk with the store's next sync (its own sync every
# ``sync_interval``, and every log checkpoint, which syncs every store before the
# records it covers are trimmed), not with the log's fdatasync.  What can be lost is
# the growth since the store's last completed sync: a few grow steps at most, one per
# ``grow_step`` pushes.  The bound allows far more, 16 default grow steps (1.6 million
# slots) or the file's own size again, whichever is larger, and still stops a 100-byte
# record from growing a file to terabytes (slot 2**31 once made 274 GB).  A database
# whose headers use a grow_step above 1.6 million slots could, after a power loss,
# have a legitimate log past this bound; docs/format.md says so.
REPLAY_GROWTH_SLOTS = 16 * QUEUE_GROW_STEP
RING_MASK = (1 << 30) - 1  # slot versions live on a 30-bit ring; a written one is never 0


def slot_limit(capacity: int) -> int:
    """The first slot index a logged row may not name, for a file of ``capacity`` slots."""
    return capacity + max(capacity, REPLAY_GROWTH_SLOTS)


@dataclass(frozen=True)
class FixedGeometry:
    """What a logged slot row is checked against: from ``queue.meta`` and the file sizes."""

    shard_count: int
    var: bool
    key_size: int
    value_size: int
    body_size: int
    capacities: tuple[int, ...]  # slots in each shard's fixed.data, as found before replay


def fixed_geometry(directory: str) -> FixedGeometry:
    """Read a queue header collection's geometry without opening (or changing) it.

    Raises ``FormatError`` for a damaged ``queue.meta`` (see ``armdb.qrows.decode_meta``)."""

    fs = _fs.FS
    meta_path = os.path.join(directory, QUEUE_META)
    meta = decode_meta(fs.read_file(meta_path), meta_path)
    slot_size = slot_size_for(meta["key_size"], meta["value_size"])
    capacities = []
    for i in range(meta["shard_count"]):
        data = os.path.join(directory, f"shard-{i:03d}", FILE_NAME)
        size = fs.file_size(data) if fs.exists(data) else 0
        capacities.append(max(0, (size - HEADER_PAGE) // slot_size))
    return FixedGeometry(meta["shard_count"], meta["var"], meta["key_size"], meta["value_size"], slot_size - 8,
                         tuple(capacities))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def row_collection(row: Any, where: str) -> tuple[str, str]:
    """Check a row's shape and the name it gives; returns ``(kind, name)`` ("F" or "B").

    The name must follow the collection naming rule (``armdb.db.validate_name``: queue
    names for slot rows, map or ``<queue>.payload`` names for Bitcask rows), so that no
    path the log gives can leave ``<db>/collections``."""
    if not isinstance(row, list) or not row or not isinstance(row[0], str):
        raise bad_record(where, f"row {_short(row)} is not a list starting with its kind")
    kind = row[0]
    if kind not in ("F", "B"):
        raise bad_record(where, f"row of unknown kind {_short(kind)}")
    if len(row) != (7 if kind == "F" else 5):
        raise bad_record(where, f"{kind} row has {len(row)} fields, not {7 if kind == 'F' else 5}")
    name = row[1]
    try:
        if kind == "F":
            validate_name(name, queue=True)
        elif isinstance(name, str) and name.endswith(PAYLOAD_SUFFIX):
            validate_name(name[: -len(PAYLOAD_SUFFIX)], queue=True)
        else:
            validate_name(name)
    except ConfigError:
        raise bad_record(where, f"row names collection {_short(name)}, which is not a valid collection name") from None
    return kind, name


def check_row(
    row: Any, where: str, collections: str, geometry: Callable[[str], FixedGeometry], gsn_limit: int
) -> None:
    """Check one logged row before anything is applied; ``CorruptionError`` otherwise.

    ``collections`` is ``<db>/collections``; ``geometry(name)`` gives a queue header
    collection's :class:`FixedGeometry` (cached by the caller); ``gsn_limit`` is the end
    of the gsn block reserved in the seqmap (every logged gsn was reserved before the
    commit was logged), see :func:`gsn_limit`."""
    fs = _fs.FS
    kind, name = row_collection(row, where)
    d = os.path.join(collections, name)
    is_queue = fs.exists(os.path.join(d, QUEUE_META))
    if kind == "F":
        if not is_queue:
            raise bad_record(where, f"row names queue collection {name!r}, which does not exist")
        _, _, shard, slot, version, status, body = row
        g = geometry(name)
        if not _is_int(shard) or not 0 <= shard < g.shard_count:
            raise bad_record(where, f"row for {name!r} names shard {_short(shard)}; the queue has {g.shard_count}")
        limit = slot_limit(g.capacities[shard])
        if not _is_int(slot) or not 0 <= slot < limit:
            raise bad_record(
                where,
                f"row for {name!r} shard {shard} names slot {_short(slot)}, beyond what its file of "
                f"{g.capacities[shard]} slots can have grown to ({limit})",
            )
        if not _is_int(version) or not 1 <= version <= RING_MASK:
            raise bad_record(where, f"row for {name!r} has slot version {_short(version)}, not 1 to {RING_MASK}")
        if status not in (OCCUPIED, DELETED) or not _is_int(status):
            raise bad_record(where, f"row for {name!r} has slot status {_short(status)}")
        if not isinstance(body, bytes) or len(body) > g.body_size:
            size = f"{len(body)} bytes" if isinstance(body, bytes) else type(body).__name__
            raise bad_record(where, f"row for {name!r} has a slot body of {size}; a slot body holds {g.body_size}")
        if status == OCCUPIED:
            _check_queue_row(body, name, shard, g, where)
    else:
        if is_queue or not fs.exists(os.path.join(d, META_NAME)):
            raise bad_record(where, f"row names map collection {name!r}, which does not exist")
        _, _, key, value, gsn = row
        if not isinstance(key, bytes) or len(key) > MAX_KEY_LEN:
            raise bad_record(where, f"row for {name!r} has a key that is not bytes of at most {MAX_KEY_LEN}")
        if value is not None and (not isinstance(value, bytes) or len(value) > MAX_VALUE_LEN):
            raise bad_record(where, f"row for {name!r} has a value that is neither bytes nor None")
        if not name.endswith(PAYLOAD_SUFFIX):  # a map's: its keys and values must read back
            try:
                decode_key(key)
                if value is not None:
                    decode_value(value)
            except (PayloadTypeError, CorruptionError) as e:
                raise bad_record(where, f"row for map {name!r} holds a key or value the map cannot read ({e})") from None
        if not _is_int(gsn) or not 1 <= gsn < gsn_limit:
            raise bad_record(
                where,
                f"row for {name!r} has gsn {_short(gsn)}, not from 1 to below {gsn_limit}, the end of the "
                f"gsns the database has reserved",
            )


def _check_queue_row(body: bytes, name: str, shard: int, g: FixedGeometry, where: str) -> None:
    """A logged occupied slot holds one queue row: the rules open applies to stored rows
    (``armdb.qrows.row_problems``; a row id stored twice is left to that check after replay)."""
    if len(body) < ROW_DTYPE.itemsize:
        raise bad_record(where, f"row for {name!r} has a slot body of {len(body)} bytes, shorter than a queue row")
    row = np.frombuffer(body, dtype=ROW_DTYPE, count=1)
    for p in row_problems(row, shard, g.shard_count, g.var, duplicates=False):
        if p.action == "refuse":
            raise bad_record(where, f"row for {name!r} shard {shard} holds a queue row that {p.what}")


@dataclass(frozen=True)
class LoggedSlot:
    """One logged slot write (an ``F`` row that :func:`check_row` accepted), in log order."""

    slot: int
    version: int
    status: int
    body: bytes
    where: str


# Where a slot holds its row id: after the 8-byte slot header, at the row's "seq" field.
_SEQ_AT = 8 + ROW_DTYPE.fields["seq"][1]  # type: ignore[index]
# Slots read at a time when a shard's stored row ids are scanned (bounded memory).
_SCAN_SLOTS = 16384


def replay_conflicts(data_path: str, slot_size: int, writes: list[LoggedSlot], limit: int = 5) -> list[tuple[str, str]]:
    """The row ids the replay of ``writes`` would leave twice in one shard, read-only.

    Simulates what the replay does to the shard's ``fixed.data``: the shard's open (the
    redo record healing a torn slot, never-written slots below the high-water mark
    becoming deleted ones), then each logged slot written where it is torn or its logged
    version is NEWER on the 30-bit ring (:meth:`Replayer.apply`).  The row ids of the
    occupied slots it writes are compared with those of every other occupied slot of the
    shard.  A queue row lives in one slot for its whole life (updates rewrite it in
    place), so a legitimate log never leaves a row id in two slots; the queue's open
    refuses a shard that holds one twice.  Returns ``(where, what)`` for at most ``limit``
    conflicts (``where``: the log record of the write), empty when there is none.
    """
    fs = _fs.FS
    n = 0
    page = b""
    status = np.zeros(0, dtype=np.uint8)
    versions = np.zeros(0, dtype=np.uint32)
    # The row ids the log writes into occupied slots (a superset of those it leaves), and
    # every stored slot that holds one of them: slot -> row id.
    logged = {key_of(w.body)[1] for w in writes if w.status == OCCUPIED}
    logged_ids = np.array(sorted(logged), dtype=np.uint64)
    holders: dict[int, int] = {}
    if fs.exists(data_path):
        fd = fs.open(data_path, os.O_RDONLY)
        try:
            n = max(0, (fs.size(fd) - HEADER_PAGE) // slot_size)
            page = fs.pread(fd, HEADER_PAGE, 0)
            status = np.zeros(n, dtype=np.uint8)
            versions = np.zeros(n, dtype=np.uint32)
            for lo in range(0, n, _SCAN_SLOTS):  # bounded memory: a chunk of slots at a time
                hi = min(n, lo + _SCAN_SLOTS)
                raw = fs.pread(fd, (hi - lo) * slot_size, HEADER_PAGE + lo * slot_size)
                chunk = np.frombuffer(raw.ljust((hi - lo) * slot_size, b"\0"), dtype=np.uint8)
                chunk = chunk.reshape(hi - lo, slot_size).copy()
                _k.validate(chunk, versions[lo:hi], status[lo:hi])
                ids = chunk[:, _SEQ_AT : _SEQ_AT + 8].copy().view(">u8").reshape(-1).astype(np.uint64)
                for i in np.flatnonzero((status[lo:hi] == OCCUPIED) & np.isin(ids, logged_ids)).tolist():
                    holders[lo + i] = int(ids[i])
        finally:
            fs.close(fd)

    # The shard's open: the redo record heals a torn slot (FixedShard._apply_redo) ...
    redo_page = b""
    redo_path = os.path.join(os.path.dirname(data_path), REDO_NAME)
    if fs.exists(redo_path):
        redo = fs.read_file(redo_path)
        try:
            valid = judge_redo_header(redo, redo_path, slot_size)
        except FormatError:
            valid = False  # the shard's open refuses it by itself
        if valid:
            redo_page = redo[: _k.REDO_OFFSET]
            rec = _k.redo_record(np.frombuffer(redo, dtype=np.uint8), slot_size)
            if rec is not None and rec[0] < n and status[rec[0]] == TORN:
                slot, image = rec
                one = np.zeros((1, slot_size), dtype=np.uint8)
                v = np.zeros(1, dtype=np.uint32)
                st = _k.restore_slot(one, v, 0, image)
                if st >= 0:
                    status[slot], versions[slot] = st, v[0]
                    holders.pop(slot, None)
                    healed_id = key_of(bytes(one[0, 8:]))[1]  # after the 8-byte slot header
                    if st == OCCUPIED and healed_id in logged:
                        holders[slot] = healed_id
    # ... and never-written slots below the high-water mark become deleted (fill_holes).
    _, mark = read_hwm(page, redo_page)
    used = np.flatnonzero(status != FREE)
    top = min(n, max(mark, int(used[-1]) + 1 if used.shape[0] else 0))
    holes = np.flatnonzero(status[:top] == FREE)
    status[holes] = DELETED
    versions[holes] = _k.ring_next(0)

    # The replay: each logged slot's state as it leaves it, (version, status, body, where).
    state: dict[int, tuple[int, int, bytes | None, str | None]] = {}
    for w in writes:
        if w.slot not in state:
            state[w.slot] = (int(versions[w.slot]), int(status[w.slot]), None, None) if w.slot < n else (0, FREE, None, None)
        version, st, _, _ = state[w.slot]
        if st == TORN or _k.compare(w.version, version) == _k.NEWER:
            state[w.slot] = (w.version, w.status, w.body, w.where)
    written: dict[int, tuple[int, str]] = {}  # row id -> (slot, where) of a written occupied slot
    out: list[tuple[str, str]] = []
    for slot, (_, st, body, where) in sorted(state.items()):
        if where is None or st != OCCUPIED or body is None:
            continue
        seq = key_of(body)[1]
        if seq in written:
            out.append((where, f"writes row id {seq} into slot {slot} while the log also writes it into slot "
                               f"{written[seq][0]}"))
        else:
            written[seq] = (slot, where)
    for slot, seq in sorted(holders.items()):
        if len(out) >= limit:
            break
        if seq not in written or state.get(slot, (0, 0, None, None))[3] is not None:
            continue  # not a row id the replay leaves, or a slot it rewrites (its stored row does not stand)
        other, where = written[seq]
        out.append((where, f"writes row id {seq} into slot {other}, but slot {slot} of the shard holds that row "
                           f"and the log does not rewrite it"))
    return out[:limit]


def gsn_limit(reserved: int | None) -> int:
    """The first gsn no logged row can carry, from the seqmap's reserved end for "gsn"."""
    return MAX_RESERVED if reserved is None else min(reserved, MAX_RESERVED)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def bad_record(where: str, what: str) -> CorruptionError:
    """The error for a logged record that passes its CRC but breaks a rule (open refuses it)."""
    return CorruptionError(
        f"{where}: {what}; the record passes its CRC but armdb never wrote it. Restore the database "
        f"from a backup"
    )


class Replayer:
    def __init__(self, db: Db) -> None:
        self.db = db
        self._fixed: dict[str, FixedStore] = {}
        self._bitcask: dict[str, BitcaskStore | None] = {}
        self.deferred: dict[str, list[tuple[bytes, bytes | None, int]]] = {}
        self._geometry: dict[str, FixedGeometry] = {}
        self._writes: dict[tuple[str, int], list[LoggedSlot]] = {}  # (queue, shard) -> its logged slot writes

    def __enter__(self) -> Self:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        errors: list[BaseException] = []
        for fx in self._fixed.values():
            try:
                for sh in fx.shards:
                    # A logged slot written past one whose unsynced write a power cut lost
                    # raised the mark over a hole; the sync must not record it (S11).
                    sh.fill_holes()
                    sh.sync_now()
            except BaseException as ex:  # noqa: BLE001 - close everything even if one fails; re-raised below
                errors.append(ex)
            try:
                fx.close()
            except BaseException as ex:  # noqa: BLE001 - re-raised below
                errors.append(ex)
        for st in self._bitcask.values():
            if st is not None:
                try:
                    st.close()
                except BaseException as ex:  # noqa: BLE001 - re-raised below
                    errors.append(ex)
        if errors and et is None:
            raise errors[0]

    def _fixed_store(self, name: str) -> FixedStore:
        fx = self._fixed.get(name)
        if fx is None:
            g = self.geometry(name)
            fx = FixedStore(self.db.collection_dir(name), g.shard_count, g.key_size, g.value_size,
                            FixedConfig(grow_step=1, enable_fsync=True))
            self._fixed[name] = fx
        return fx

    def geometry(self, name: str) -> FixedGeometry:
        """The queue header collection's geometry as found before replay (cached)."""
        g = self._geometry.get(name)
        if g is None:
            g = self._geometry[name] = fixed_geometry(self.db.collection_dir(name))
        return g

    def check(self, row: Any, where: str) -> None:
        """Check one row (:func:`check_row`) before any row is applied."""
        check_row(row, where, os.path.join(self.db.path, COLLECTIONS), self.geometry,
                  gsn_limit(self.db.seqmap.reserved("gsn")))
        if row[0] == "F":
            _, name, shard, slot, version, status, body = row
            self._writes.setdefault((name, shard), []).append(LoggedSlot(slot, version, status, body, where))

    def _bitcask_store(self, name: str) -> BitcaskStore | None:
        if name not in self._bitcask:
            try:
                self._bitcask[name] = self.db.open_bitcask(name, Config(), register=False)
            except EncryptionKeyRequired:
                self._bitcask[name] = None
        return self._bitcask[name]

    def check_images(self) -> None:
        """Refuse, before anything is written, logged slot writes that would leave a row id
        in two slots of a shard (:func:`replay_conflicts`); called once every row passed
        :meth:`check`, before the first :meth:`apply`."""
        for (name, shard), writes in self._writes.items():
            g = self.geometry(name)
            data = os.path.join(self.db.collection_dir(name), f"shard-{shard:03d}", FILE_NAME)
            for where, what in replay_conflicts(data, g.body_size + 8, writes)[:1]:
                raise bad_record(where, f"queue {name!r} shard {shard}: the record {what}")

    def apply(self, row: list[Any]) -> None:
        """Apply one row that :meth:`check` accepted (every row is checked before the first
        is applied, and then :meth:`check_images`)."""
        kind = row[0]
        if kind == "F":
            _, name, shard, slot, version, status, body = row
            sh = self._fixed_store(name).shards[shard]
            sh.ensure_capacity(slot + 1)
            if sh.status[slot] == TORN or _k.compare(version, int(sh.versions[slot])) == _k.NEWER:
                sh.replay_write(slot, status, body, version)
        else:
            _, name, key, value, gsn = row
            store = self._bitcask_store(name)
            if store is None:
                self.deferred.setdefault(name, []).append((key, value, gsn))
            else:
                store.apply(key, value, gsn)
