"""What one ``db.tx()`` commit writes, before it is written (SPEC T2, T5).

A :class:`Plan` is filled under the commit's locks: by ``armdb.tx`` for map writes and
by each queue for its pushes and settles (``Queue._tx_push``, ``Queue._tx_settle``).  It
holds the rows the log record will carry, the steps that apply them once the record is
appended (and synced), the slots taken for new rows (given back if the commit is
refused), the stores it writes, and the ids it drew, which the commit reserves in the
seqmap only when it goes ahead.  It does no I/O of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol


class IdSource(Protocol):
    # The rest of each name's block reserved on disk (armdb.seqmap.SeqMap.next), read
    # without a lock: ``next()`` on one of its iterators is one atomic step under the GIL.
    _rest: dict[str, Iterator[int]]

    def draw(self, name: str) -> int: ...

    def draw_block(self, name: str, n: int) -> int: ...


_NO_BLOCK: Iterator[int] = iter(())


class Plan:
    """The logged rows of one commit and, in order, how to apply them.

    ``fixed`` and ``bitcask`` are short lists (a commit touches a handful of stores), so
    membership tests on them are cheaper than on sets.
    """

    __slots__ = ("_ids", "_rest", "allocated", "apply", "bitcask", "drawn", "fixed", "packed", "payload_writes", "rows",
                 "undo")

    def __init__(self, ids: IdSource) -> None:
        self._ids = ids
        self._rest = ids._rest
        self.rows: list[list[Any]] = []
        self.apply: list[Callable[[], object]] = []  # run after the log append (and sync)
        self.allocated: list[tuple[Any, int]] = []  # (FixedShard, slot) to give back on refusal
        self.undo: list[Callable[[], object]] = []  # what else to give back on refusal (a batch's slots)
        # Rows already packed as msgpack by a batch's compiled plan: (how many, bytes), logged
        # after ``rows`` in the same record (armdb.txlog.TxLog.append).
        self.packed: list[tuple[int, bytes | bytearray]] = []
        self.fixed: list[Any] = []  # FixedStore shards written
        self.bitcask: list[Any] = []  # Bitcask stores written
        self.payload_writes: dict[Any, int] = {}  # queue -> var bodies this commit writes
        self.drawn: dict[str, int] = {}  # seqmap name -> largest id drawn, reserved at commit

    def draw(self, name: str) -> int:
        """A new id of sequence ``name`` (a queue's row ids, ``"gsn"``), reserved on disk
        only if the commit goes ahead (T5).  An id from the rest of the block already
        reserved on disk needs nothing more; any other is remembered in ``drawn``."""
        n = next(self._rest.get(name, _NO_BLOCK), None)
        if n is not None:
            return n
        n = self._ids.draw(name)
        if n > self.drawn.get(name, 0):
            self.drawn[name] = n
        return n

    def draw_block(self, name: str, n: int) -> int:
        """The first of ``n`` consecutive new ids of sequence ``name`` (a batch of pushes),
        reserved on disk only if the commit goes ahead."""
        first = self._ids.draw_block(name, n)
        last = first + n - 1
        if last > self.drawn.get(name, 0):
            self.drawn[name] = last
        return first

    def gsn(self) -> int:
        """The gsn of a Bitcask record this commit writes (:meth:`draw` of ``"gsn"``, one
        call less)."""
        n = next(self._rest.get("gsn", _NO_BLOCK), None)
        if n is not None:
            return n
        n = self._ids.draw("gsn")
        if n > self.drawn.get("gsn", 0):
            self.drawn["gsn"] = n
        return n

    def gsns(self, n: int) -> int:
        """The first of ``n`` consecutive gsns (a batch's Bitcask records, in order)."""
        return self.draw_block("gsn", n)

    def add_fixed(self, shard: Any) -> None:
        if shard not in self.fixed:
            self.fixed.append(shard)

    def add_bitcask(self, store: Any) -> None:
        if store not in self.bitcask:
            self.bitcask.append(store)

    def give_back(self) -> None:
        """Return the slots allocated for a commit that does not go ahead."""
        for shard, slot in reversed(self.allocated):
            shard.unalloc(slot)
        self.allocated.clear()
        for fn in reversed(self.undo):
            fn()
        self.undo.clear()
