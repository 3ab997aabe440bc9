"""The offline reader of queue files: what ``armdb.check`` and ``python -m armdb stats``
read from a database that is not open (SPEC C2, D6).

Both read a queue's ``queue.meta`` and each ``shard-NNN/fixed.data`` through
:func:`read_shard`: the header page, every slot's status from the CRC-checking kernel
(``armdb._core.fixed.validate``), and the rows of the occupied slots decoded by
``armdb.qrows.rows_of``, the same decoder a queue's open uses on its mapped slots.
Nothing here writes; all file access goes through ``armdb._fs``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _fs
from ._core import fixed as _k
from .errors import FormatError
from .fixed import FILE_NAME, HEADER_PAGE, OCCUPIED, TORN, collection_shards, decode_header, slot_size_for
from .layout import COLLECTIONS, PAYLOAD_SUFFIX, QUEUE_META
from .qrows import DEAD_BIT, HEADER_SIZE, KEY_SIZE, State, decode_meta, rows_of

__all__ = ["QueueFileStats", "ShardRows", "inspect_queue", "queue_names", "read_queue_meta", "read_shard"]


def read_queue_meta(qdir: str) -> dict[str, Any]:
    """A queue's ``queue.meta``, checked (``FormatError`` otherwise, see ``armdb.qrows.decode_meta``)."""
    path = os.path.join(qdir, QUEUE_META)
    return decode_meta(_fs.FS.read_file(path), path)


def slot_status(table: np.ndarray) -> np.ndarray:
    """Per-slot status (free / occupied / deleted / torn) of a slot table, from the
    CRC-checking kernel; ``table`` is not changed."""
    slots = np.ascontiguousarray(table)
    if not slots.flags.writeable:
        slots = slots.copy()
    versions = np.zeros(slots.shape[0], dtype=np.uint32)
    status = np.zeros(slots.shape[0], dtype=np.uint8)
    _k.validate(slots, versions, status)
    return status


@dataclass(frozen=True)
class ShardRows:
    """One queue shard file as :func:`read_shard` found it."""

    slot_size: int
    key_size: int
    value_size: int
    shard: int  # the shard number its header page gives
    count: int  # whole slots in the file
    tail: bytes  # bytes after the last whole slot
    table: np.ndarray  # (count, slot_size) uint8: the slots as stored
    status: np.ndarray  # per slot: FREE, OCCUPIED, DELETED or TORN
    occupied: np.ndarray  # the occupied slots whose CRC holds
    rows: np.ndarray  # their rows (armdb.qrows.ROW_DTYPE)


def read_shard(raw: bytes, path: str) -> ShardRows:
    """Decode a queue shard's ``fixed.data`` as read from ``path``.

    Raises ``FormatError`` for a header page that is not a valid one (``armdb.fixed.decode_header``),
    or whose slot size is not the one its key and value sizes make (a queue's open refuses
    such a file too; its slots cannot be read).
    """
    slot_size, key_size, value_size, shard = decode_header(raw[:HEADER_PAGE], path)
    if key_size != KEY_SIZE or value_size < HEADER_SIZE or slot_size != slot_size_for(key_size, value_size):
        raise FormatError(
            f"{path}: header page gives slot size {slot_size} for keys of {key_size} and values of "
            f"{value_size} bytes, which is not a queue shard's geometry; restore the file from a backup"
        )
    whole = (len(raw) - HEADER_PAGE) // slot_size  # negative for a file cut inside its header page
    n = max(0, whole)
    if n:
        table = np.frombuffer(raw, dtype=np.uint8, offset=HEADER_PAGE, count=n * slot_size).reshape(n, slot_size)
    else:
        table = np.zeros((0, slot_size), dtype=np.uint8)
    status = slot_status(table)
    occ = np.flatnonzero(status == OCCUPIED)
    return ShardRows(slot_size, key_size, value_size, shard, n, raw[HEADER_PAGE + whole * slot_size :], table,
                     status, occ, rows_of(table, occ))


@dataclass(frozen=True)
class QueueFileStats:
    """What ``stats DIR`` reads from one queue's files (no handle needed)."""

    name: str
    flavour: str
    shards: int
    live: int
    ready: int
    leased: int
    expired: int
    delayed: int
    dead: int
    torn: int
    slots_allocated: int
    header_file_logical_bytes: int
    header_file_physical_bytes: int
    payload_bytes: int


def inspect_queue(db_path: str, name: str, now_ms: int | None = None) -> QueueFileStats:
    """Count a queue's rows by state from its ``fixed.data`` files, read-only.

    Queue declarations live in code, so the command line cannot call
    ``db.open_queue``; it reads the header store instead.  A slot counts when its
    status is occupied and its CRC holds (the kernel's own validation); torn slots
    are counted apart.  ``leased`` includes expired leases, as ``QueueStats`` does;
    ``expired`` says how many of them are past their deadline.
    """
    fs = _fs.FS
    qdir = os.path.join(db_path, COLLECTIONS, name)
    meta = read_queue_meta(qdir)
    now = int(time.time_ns() // 1_000_000) if now_ms is None else now_ms
    counts = {"ready": 0, "leased": 0, "expired": 0, "delayed": 0, "dead": 0, "torn": 0}
    slots = logical = physical = 0
    shard_dirs = collection_shards(qdir)
    for sdir in shard_dirs:
        path = os.path.join(sdir, FILE_NAME)
        if not fs.exists(path):
            continue
        logical += fs.file_size(path)
        physical += fs.physical_size(path)
        sr = read_shard(fs.read_file(path), path)
        slots += sr.count
        if sr.count == 0:
            continue
        counts["torn"] += int((sr.status == TORN).sum())
        rows = sr.rows
        due = rows["due"].astype(np.uint64)
        dead = (due & np.uint64(DEAD_BIT)) != 0
        state = rows["header"]["state"]
        deadline = rows["header"]["deadline"].astype(np.int64)
        leased = ~dead & (state == State.LEASED)
        waiting = ~dead & ~leased
        counts["dead"] += int(dead.sum())
        counts["leased"] += int(leased.sum())
        counts["expired"] += int((leased & (deadline <= now)).sum())
        counts["ready"] += int((waiting & (due <= np.uint64(now))).sum())
        counts["delayed"] += int((waiting & (due > np.uint64(now))).sum())
    payload_bytes = 0
    pdir = os.path.join(db_path, COLLECTIONS, name + PAYLOAD_SUFFIX)
    if meta.get("var") and fs.isdir(pdir):
        payload_bytes = _tree_bytes(pdir)
    return QueueFileStats(
        name=name,
        flavour="var" if meta.get("var") else "fixed",
        shards=len(shard_dirs),
        live=counts["ready"] + counts["leased"] + counts["delayed"],
        ready=counts["ready"],
        leased=counts["leased"],
        expired=counts["expired"],
        delayed=counts["delayed"],
        dead=counts["dead"],
        torn=counts["torn"],
        slots_allocated=slots,
        header_file_logical_bytes=logical,
        header_file_physical_bytes=physical,
        payload_bytes=payload_bytes,
    )


def _tree_bytes(path: str) -> int:
    """Total size of the files under ``path``."""
    fs = _fs.FS
    total = 0
    for entry in fs.listdir(path):
        full = os.path.join(path, entry)
        total += _tree_bytes(full) if fs.isdir(full) else fs.file_size(full)
    return total


def queue_names(db_path: str) -> list[str]:
    """Names of the queues in a database directory: folders holding a ``queue.meta``."""
    fs = _fs.FS
    cdir = os.path.join(db_path, COLLECTIONS)
    if not fs.isdir(cdir):
        return []
    return [n for n in fs.listdir(cdir) if fs.exists(os.path.join(cdir, n, QUEUE_META))]
