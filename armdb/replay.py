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
"""

from __future__ import annotations

import os
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from . import _fs
from ._core import fixed as _k
from .config import Config, FixedConfig
from .errors import CorruptionError, EncryptionKeyRequired
from .fixed import TORN, FixedStore

if TYPE_CHECKING:
    from .bitcask import BitcaskStore
    from .db import Db


class Replayer:
    def __init__(self, db: Db) -> None:
        self.db = db
        self._fixed: dict[str, FixedStore] = {}
        self._bitcask: dict[str, BitcaskStore | None] = {}
        self.deferred: dict[str, list[tuple[bytes, bytes | None, int]]] = {}

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
            from .db import QUEUE_META
            from .queue import _decode_meta

            d = self.db.collection_dir(name)
            meta_path = os.path.join(d, QUEUE_META)
            if not _fs.FS.exists(meta_path):
                raise CorruptionError(
                    f"the transaction log names queue collection {name!r}, which does not exist; "
                    f"restore the database from a backup"
                )
            meta = _decode_meta(_fs.FS.read_file(meta_path), meta_path)
            fx = FixedStore(d, int(meta["shard_count"]), int(meta["key_size"]), int(meta["value_size"]),
                            FixedConfig(grow_step=1, enable_fsync=True))
            self._fixed[name] = fx
        return fx

    def _bitcask_store(self, name: str) -> BitcaskStore | None:
        if name not in self._bitcask:
            try:
                self._bitcask[name] = self.db.open_bitcask(name, Config(), register=False)
            except EncryptionKeyRequired:
                self._bitcask[name] = None
        return self._bitcask[name]

    def apply(self, row: list[Any]) -> None:
        kind = row[0]
        if kind == "F":
            _, name, shard, slot, version, status, body = row
            sh = self._fixed_store(name).shards[shard]
            sh.ensure_capacity(slot + 1)
            if sh.status[slot] == TORN or _k.compare(version, int(sh.versions[slot])) == _k.NEWER:
                sh.replay_write(slot, status, body, version)
        elif kind == "B":
            _, name, key, value, gsn = row
            store = self._bitcask_store(name)
            if store is None:
                self.deferred.setdefault(name, []).append((key, value, gsn))
            else:
                store.apply(key, value, gsn)
        else:
            raise CorruptionError(f"unknown transaction log row kind {kind!r}; restore from a backup")
