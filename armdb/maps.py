"""``Map``: a typed key/value handle over a Bitcask collection (SPEC D3, S9).

Keys are ``bytes``, ``str`` or ``int`` and keep their type: ``1``, ``"1"`` and
``b"1"`` are three different keys, and :meth:`Map.items` returns each as it was
put; how keys and values are stored is :mod:`armdb.mapcodec`.  Values decode with
``raw=False, strict_map_key=False``, so tuples come back as lists.  A value msgpack encodes but
cannot decode (a dict with a tuple key) is refused at ``put``, so one bad value never
breaks ``items()`` for the whole map.

The optional LRU cache (``Config.cache_bytes``) is charged the encoded size of
key and value.  It caches immutable decoded values (None, bool, int, float,
str, bytes) directly and containers as their msgpack bytes, so a caller who
mutates a returned list never changes what the next ``get`` returns.  Each
cached value remembers the gsn of the record it came from and is used only
while the store still points at that record, so writes that bypass this
handle (transactions, replay) can never make the cache stale.

Lock policy: one ``threading.Lock`` guards the cache's ``OrderedDict``; it is
never held while calling into the store.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from .bitcask import BitcaskStore
from .errors import CorruptionError, ProcessBound, StreamSourceRequiresTx
from .mapcodec import Key, decode_key, decode_value, encode_key, encode_value

__all__ = ["Map", "decode_key", "decode_value", "encode_key", "encode_value"]

_IMMUTABLE = (type(None), bool, int, float, str, bytes)
_ENTRY_OVERHEAD = 64  # rough per-entry bookkeeping charged to the cache budget


class _Cache:
    """A byte-bounded LRU of ``encoded key -> (gsn, is_packed, object, charge)``."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.used = 0
        self.data: OrderedDict[bytes, tuple[int, bool, Any, int]] = OrderedDict()
        self.lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, raw: bytes, gsn: int) -> tuple[bool, Any] | None:
        with self.lock:
            hit = self.data.get(raw)
            if hit is None or hit[0] != gsn:
                self.misses += 1
                return None
            self.data.move_to_end(raw)
            self.hits += 1
            return hit[1], hit[2]

    def put(self, raw: bytes, gsn: int, value: Any, packed: bytes) -> None:
        charge = len(raw) + len(packed) + _ENTRY_OVERHEAD
        if charge > self.budget:
            self.drop(raw)
            return
        if isinstance(value, _IMMUTABLE):
            entry = (gsn, False, value, charge)
        else:
            entry = (gsn, True, packed, charge)
        with self.lock:
            old = self.data.pop(raw, None)
            if old is not None:
                if old[0] > gsn:  # a newer version got here first
                    self.data[raw] = old
                    return
                self.used -= old[3]
            self.data[raw] = entry
            self.used += charge
            while self.used > self.budget:
                _, ev = self.data.popitem(last=False)
                self.used -= ev[3]

    def drop(self, raw: bytes) -> None:
        with self.lock:
            old = self.data.pop(raw, None)
            if old is not None:
                self.used -= old[3]


class Map:
    """A persistent dict-like map over a Bitcask collection (SPEC D3).

    Created by ``db.open_map(name, config)``; not meant to be constructed by
    users.

    Parameters
    ----------
    store : BitcaskStore
        The open collection.
    closed_check : callable
        Called before every operation; raises ``DbClosed`` when the Db is closed.
    cache_bytes : int, optional
        Budget of the decoded-value cache; defaults to ``store.config.cache_bytes``
        (0 disables the cache).
    name : str, optional
        The collection name, for ``repr``.
    stream_source : bool, optional
        The map is the source of a change stream: direct ``put``/``delete``
        raise ``StreamSourceRequiresTx`` (writes go through ``db.tx()``, T6).
    """

    def __init__(
        self,
        store: BitcaskStore,
        closed_check: Callable[[], None],
        *,
        cache_bytes: int | None = None,
        name: str = "",
        stream_source: bool = False,
    ) -> None:
        self._store = store
        self._closed_check = closed_check
        self.stream_source = stream_source
        self.name = name
        budget = store.config.cache_bytes if cache_bytes is None else cache_bytes
        self._cache = _Cache(budget) if budget > 0 else None

    @property
    def store(self) -> BitcaskStore:
        """The underlying collection (for the Db's transaction code)."""
        return self._store

    def get(self, key: Key, default: Any = None) -> Any:
        """Return the value stored under ``key``, or ``default``.

        Raises
        ------
        PayloadTypeError
            ``key`` is not bytes, str or int.
        CorruptionError
            The stored record fails its CRC or authentication tag.
        DbClosed
        """
        self._closed_check()
        raw = encode_key(key)
        cache = self._cache
        if cache is not None:
            gsn = self._store.gsn_of(raw)
            if gsn is None:
                return default
            hit = cache.get(raw, gsn)
            if hit is not None:
                packed, obj = hit
                return decode_value(obj) if packed else obj
        got = self._store.get_with_gsn(raw)
        if got is None:
            return default
        data, gsn = got
        try:
            value = decode_value(data)
        except CorruptionError as e:
            raise CorruptionError(f"map {self.name!r}, key {key!r}: {e}") from None
        if cache is not None:
            cache.put(raw, gsn, value, data)
        return value

    def put(self, key: Key, value: Any) -> None:
        """Store ``value`` under ``key``.

        The value is encoded before anything is written, so a value msgpack
        cannot encode writes nothing.

        Raises
        ------
        PayloadTypeError
            Bad key type, or a value msgpack cannot encode.
        StorageError
            The write or its sync failed (S12).
        DbClosed
        """
        self._closed_check()
        raw = encode_key(key)
        packed = encode_value(value)
        self._direct_write_check()
        gsn = self._store.put(raw, packed)
        if self._cache is not None:
            self._cache.put(raw, gsn, value, packed)

    def delete(self, key: Key) -> bool:
        """Delete ``key``; return whether it was present.

        Raises
        ------
        PayloadTypeError, StorageError, DbClosed
        """
        self._closed_check()
        raw = encode_key(key)
        self._direct_write_check()
        if self._cache is not None:
            self._cache.drop(raw)
        return self._store.delete(raw)

    def _direct_write_check(self) -> None:
        if self.stream_source:
            raise StreamSourceRequiresTx(
                f"map {self.name!r} is a change-stream source; write it inside db.tx() so its emitted "
                f"jobs commit with it"
            )

    def _tx_write(self, raw_key: bytes, raw_value: bytes | None, gsn: int) -> None:
        """Apply one committed transaction row (the caller holds the key's shard lock)."""
        cache = self._cache
        # Dropped only when there (the test without the cache lock): a hit is served only
        # at the gsn the store holds (_Cache.get), so an entry that a reader puts back
        # meanwhile is never served stale either way.
        if cache is not None and raw_key in cache.data:
            cache.drop(raw_key)
        self._store.write_locked(raw_key, raw_value, gsn)

    def stats(self) -> dict[str, Any]:
        """The collection's stats (``BitcaskStore.stats``) plus ``cache_*`` counters."""
        self._closed_check()
        out = self._store.stats()
        for k, v in self.cache_stats().items():
            out[f"cache_{k}"] = v
        return out

    def __contains__(self, key: object) -> bool:
        self._closed_check()
        return encode_key(key) in self._store

    def __len__(self) -> int:
        self._closed_check()
        return len(self._store)

    def keys(self) -> Iterator[Key]:
        """Iterate the keys, each with the type it was put with (order unspecified)."""
        self._closed_check()
        for raw in self._store:
            yield decode_key(raw)

    def __iter__(self) -> Iterator[Key]:
        return self.keys()

    def items(self) -> Iterator[tuple[Key, Any]]:
        """Iterate ``(key, value)`` pairs; keys keep the type they were put with.

        Raises
        ------
        CorruptionError
            A stored value does not decode; the message names its key.
        """
        self._closed_check()
        for raw, data in self._store.items():
            key = decode_key(raw)
            try:
                value = decode_value(data)
            except CorruptionError as e:
                raise CorruptionError(f"map {self.name!r}, key {key!r}: {e}") from None
            yield key, value

    def cache_stats(self) -> dict[str, int]:
        """Cache counters: ``entries``, ``bytes``, ``budget``, ``hits``, ``misses``."""
        c = self._cache
        if c is None:
            return {"entries": 0, "bytes": 0, "budget": 0, "hits": 0, "misses": 0}
        with c.lock:
            return {
                "entries": len(c.data),
                "bytes": c.used,
                "budget": c.budget,
                "hits": c.hits,
                "misses": c.misses,
            }

    def __reduce__(self) -> Any:
        raise ProcessBound(
            "a Map handle cannot be pickled or sent to another process: a handle belongs to the process that "
            "opened the database. Serve it (db.serve()) and use armdb.connect(path).open_map(name) in the "
            "other process (docs/processes.md)"
        )

    def __repr__(self) -> str:
        return f"<armdb.Map {self.name!r}>"
