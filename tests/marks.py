"""Test helpers for the synced mark (SPEC S7) that current-format files keep in their own
mark area: bytes 32-63 of a log file (format 4) or a Bitcask data file (format 3).

Tests use them to build the state a crash leaves before any sync (no mark), to plant a
crafted mark, and to compare files around a refused call without the mark area, which a
background sync or the Db's own close moves forward whatever the call did (and without a
log file's allocated zeros, which the close cuts).
"""

from __future__ import annotations

import struct
from pathlib import Path

from armdb import _syncmark, bitcask, logformat, txlog

AREA = slice(_syncmark.AREA_OFFSET, _syncmark.AREA_OFFSET + _syncmark.AREA_SIZE)


def has_area(name: str, raw: bytes) -> bool:
    """Whether a file named ``name`` whose bytes are ``raw`` has a mark area."""
    if len(raw) < AREA.stop:
        return False
    if name.endswith(".log") and raw[:8] == txlog.FILE_MAGIC:
        return struct.unpack_from("<I", raw, 8)[0] >= txlog.AREA_MARK_VERSION
    if name.endswith(".data") and raw[:8] == bitcask.DATA_MAGIC:
        return struct.unpack_from("<H", raw, 8)[0] >= bitcask.AREA_MARK_DATA_VERSION
    return False
    version = struct.unpack_from("<I", raw, 8)[0] if name.endswith(".log") else struct.unpack_from("<H", raw, 8)[0]
    if name.endswith(".log") and raw[:8] == txlog.FILE_MAGIC:
        return version >= txlog.AREA_MARK_VERSION
    if name.endswith(".data") and raw[:8] == bitcask.DATA_MAGIC:
        return version >= bitcask.AREA_MARK_DATA_VERSION
    return False


def without_area(name: str, raw: bytes) -> bytes:
    """``raw`` with its mark area zeroed, if it has one."""
    if not has_area(name, raw):
        return raw
    return raw[: AREA.start] + bytes(_syncmark.AREA_SIZE) + raw[AREA.stop :]


def log_records_end(raw: bytes) -> int:
    """Where the records of a log file (format 4) whose bytes are ``raw`` end: its end, or
    where the zeros allocated after its records start."""
    return logformat._records_at(raw, logformat.RECORDS_START)[1]


def comparable(name: str, raw: bytes) -> bytes:
    """``raw`` as a test compares it around a refused call: :func:`without_area`, and a
    log file without the zeros allocated after its records, which a clean close cuts."""
    raw = without_area(name, raw)
    if has_area(name, raw) and name.endswith(".log"):
        raw = raw[: log_records_end(raw)]
    return raw


def clear(path: Path) -> None:
    """Forget the synced mark of a log or data file, as a crash before any sync would."""
    raw = path.read_bytes()
    assert has_area(path.name, raw), path
    path.write_bytes(without_area(path.name, raw))


def read(path: Path) -> tuple[int, int]:
    """``(mark, generation)`` of a log or data file (``(0, 0)``: none)."""
    return _syncmark.read_area(path.read_bytes())


def plant(path: Path, mark: int, generation: int = 7) -> None:
    """Write a valid cell naming ``mark`` into both cells of the file's mark area."""
    raw = bytearray(path.read_bytes())
    assert has_area(path.name, bytes(raw)), path
    cell = _syncmark.cell(bytes(raw[: _syncmark.IDENTITY_SIZE]), mark, generation)
    raw[AREA] = cell + cell
    path.write_bytes(bytes(raw))


def active_data_file(shard: Path) -> Path:
    """The newest data file of a Bitcask shard folder (the active one, absent compaction)."""
    return max(shard.glob("*.data"))
