"""The in-RAM state of one Bitcask shard, its locks, and what recovery and compaction use
of the store that owns it.

A shard (:class:`_Shard`) is the index from key to the location of the key's latest
record, the tombstones still needed, the table of open data files, the active file and
its hint builder and synced-mark writer.  ``armdb.bitcask.store`` reads and writes it;
``armdb.bitcask.recovery`` builds it at open; ``armdb.bitcask.compaction`` rewrites its
immutable files.

Lock policy
-----------
Each shard has two locks:

``_Shard.lock`` (a ``threading.Lock``)
    Guards everything mutable in the shard: the index, the tombstone table, the
    file table and its counters, the active file's end offset and the hint
    builder.  Every append, index update, rotation and index lookup holds it.
    Readers hold it while they look a key up *and* ``pread`` the record, so a
    location can never be used after compaction closed its file: lookup and read
    are one atomic step, and compaction swaps locations and closes input files
    only under this lock.  Tag and CRC checks of the bytes read run outside it.
    It is held across ``fdatasync`` of the active file in the write path,
    ``sync()`` and rotation, on purpose: a write that returns after its sync must
    be durable, and the descriptor being synced must not be closed or replaced
    underneath; the cost is bounded by ``sync_interval``.

``_Shard.compact_lock``
    Serialises compaction of one shard (automatic after rotation, or
    ``compact()``) and ``close()``.  Compaction copies records from immutable
    input files without holding ``lock`` (nobody writes those files, and only the
    holder of ``compact_lock`` closes them); it takes ``lock`` in short sections to
    classify a batch of records and to commit the new locations.

Locks are never nested across shards; ``compact_lock`` is always taken before
``lock``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .. import _syncmark
from .._core.locks import Lock
from .files import _DataFile, _HintBuilder

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._crypto import Sealer
    from ..config import Config
    from ..errors import StorageError

# An index entry (and a tombstone entry) is a tuple
#   (file_id, offset, record_size, gsn_word, holders)
# ``holders`` is None or a frozenset of ids of *other* files that may still hold
# an older put of the key.  A tombstone is kept (on disk and in ``tombs``) while
# one of its holders exists, so that the older put cannot come back; once none
# does, the tombstone is garbage: its bytes count as dead and compaction drops it.
Entry = tuple[int, int, int, int, "frozenset[int] | None"]


@dataclass(eq=False, slots=True)
class _Shard:
    idx: int
    sdir: str
    files: dict[int, _DataFile]
    active: _DataFile
    index: dict[bytes, Entry]
    tombs: dict[bytes, Entry]
    highest: int
    next_fid: int
    hint: _HintBuilder
    lock: Lock = field(default_factory=Lock)  # armdb._core.locks: a cheaper acquire than threading.Lock
    compact_lock: threading.Lock = field(default_factory=threading.Lock)
    dirty: bool = False
    last_sync: float = 0.0
    compact_due: bool = False  # rotated under a caller's lock: compact at the next chance
    closed: bool = False  # close closed this shard's descriptors (set under ``lock``)
    synced: int = 0  # the active file's offset that a completed sync covered
    flushing: bool = False  # the flusher is syncing the active file outside ``lock``
    marks: _syncmark.MarkWriter | None = None  # writes that offset into the active file's mark area


class _Host(Protocol):
    """What open's recovery (``armdb.bitcask.recovery``) and compaction
    (``armdb.bitcask.compaction``) use of the store they run for: its settings, its
    sealer, its state flags and counters, and the steps that poison it on a failed sync
    (S12) or that belong to the write path (creating a data file, rotation).
    :class:`armdb.bitcask.store.BitcaskStore` is the one implementation."""

    directory: str
    config: Config
    _sealer: Sealer | None
    _encrypted: bool
    _poisoned: str | None
    _closed: bool
    _torn_dropped: int
    _unsynced_dropped: int
    _compaction_bytes: int
    _compactions: int

    def _aad(self, tag: bytes, gsn_word: int) -> bytes: ...

    def _fsync(self, fn: Callable[[Any], None], arg: Any, what: str) -> None: ...

    def _sync_failed(self, e: OSError, what: str) -> StorageError: ...

    def _new_data_file(self, sdir: str, fid: int, flags: int, base_gsn: int, *, tmp: bool) -> _DataFile: ...

    def _synced_active(self, sh: _Shard) -> None: ...

    def _rotate(self, sh: _Shard) -> None: ...
