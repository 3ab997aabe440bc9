"""A var ``ack_many``'s body deletes by one index lookup a key (``bitcask_tombs_take``,
``bitcask_tombs_settle``, ``bitcask_tombs_restore``) against the store's group write
(``bitcask_group``: the same records and hint entries) and a Python reference of the
index side, and the store's batch delete leaving the index as it was when its append
fails."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from armdb import _fail, _fs
from armdb._core.fixed import bitcask_group, bitcask_tombs_restore, bitcask_tombs_settle, bitcask_tombs_take
from armdb.bitcask import RECORD_MAGIC, TOMBSTONE
from armdb.errors import StorageError

from .test_bitcask import Gsn, open_store

FID = 7
# An index entry: (fid, offset, size, gsn word, holders); the common delete's is a put in
# the active file FID with no older holder.
entries = st.one_of(
    st.tuples(st.just(FID), st.integers(0, 2**40), st.integers(24, 4000), st.integers(1, 2**60), st.none()),
    st.tuples(st.sampled_from([3, FID]), st.integers(0, 2**40), st.integers(24, 4000), st.integers(1, 2**60),
              st.just(frozenset({2}))),
    st.tuples(st.just(3), st.integers(0, 2**40), st.integers(24, 4000), st.integers(1, 2**60), st.none()),
)


def record_size(key: bytes) -> int:
    """A tombstone record's bytes in a data file: its 20-byte head and key, padded to 8."""
    size = 20 + len(key)
    return size + (-size & 7)


def take_reference(keys: list[bytes], index: dict[bytes, Any], fid: int) -> tuple[list[int], list[Any]] | None:
    """Each key's entry looked up in order: a put in file ``fid`` with no older holder
    (the common delete) is taken out of ``index`` (kind 1); any other case stays for the
    store's general update (kind 2), so a key named again after it is found again, while
    a key named again after being taken is missing.  None, with ``index`` as it was, at a
    missing key (deleting it writes nothing: the general path judges the batch)."""
    kinds: list[int] = []
    taken: list[Any] = []
    for k in keys:
        if k not in index:
            for key, kind, entry in zip(keys, kinds, taken, strict=False):
                if kind == 1:
                    index[key] = entry
            return None
        entry = index[k]
        if entry[0] == fid and entry[4] is None:
            del index[k]
            kinds.append(1)
            taken.append(entry)
        else:
            kinds.append(2)
            taken.append(None)
    return kinds, taken


def settle_reference(keys: list[bytes], kinds: list[int], taken: list[Any], off: int, g0: int, flag: int,
                     start: int) -> tuple[int, int, int, int]:
    """The dead bytes of a batch's tombstones appended from file offset ``off`` (the
    record of ``keys[start]``): a taken key's put and its tombstone are dead at once; the
    first key of another case stops the walk, for the store's general update.  Returns
    the dead bytes, the key stopped at (``len(keys)``: none), its record offset and gsn
    word (the first record written carries ``flag``)."""
    dead, at = 0, off
    for i in range(start, len(keys)):
        if kinds[i] != 1:
            return dead, i, at, (g0 + i) | TOMBSTONE | (flag if i == 0 else 0)
        dead += taken[i][2] + record_size(keys[i])
        at += record_size(keys[i])
    return dead, len(keys), at, 0


def _reference(keys: list[bytes], index: dict[bytes, Any], g0: int, highest: int, flag: int, off: int) -> Any:
    """The records and hint entries of the store's group write for the deletes, and the
    index side by :func:`take_reference` and :func:`settle_reference`; None where the
    group write refuses the batch or a key is missing."""
    got = bitcask_group([(k, None, g0 + i) for i, k in enumerate(keys)], index, highest, flag, RECORD_MAGIC, FID,
                        off, 100, 2**32)
    if got is None or not keys:
        return None
    took = take_reference(keys, index, FID)
    if took is None:
        return None
    kinds, taken = took
    data, hints, written, _entries, deletes = got
    assert written == keys and deletes == len(keys)
    return data, hints, _walk(keys, index, off, lambda at, i: settle_reference(keys, kinds, taken, at, g0, flag, i))


def _taken(keys: list[bytes], index: dict[bytes, Any], g0: int, highest: int, flag: int, off: int) -> Any:
    got = bitcask_tombs_take(keys, index, FID, g0, highest, flag, RECORD_MAGIC, off, 100)
    if got is None:
        return None
    data, hints, kinds, taken = got
    return data, hints, _walk(keys, index, off,
                              lambda at, i: bitcask_tombs_settle(keys, kinds, taken, at, g0, flag, i))


def _walk(keys: list[bytes], index: dict[bytes, Any], off: int, settle: Any) -> list[Any]:
    """The store's loop over a batch's index side: ``settle(at, i)`` from key ``i`` on,
    and the general update's first step for the key of another case it stops at."""
    steps, i, at = [], 0, off
    while i < len(keys):
        dead, i, at, word = settle(at, i)
        steps.append((dead, i, at, word))
        if i < len(keys):
            # (what the general update does first: its key leaves the index; a key named
            # twice may have left at its first naming)
            index.pop(keys[i], None)
            at += record_size(keys[i])
            i += 1
    return steps


@settings(max_examples=300, deadline=None)
@given(present=st.dictionaries(st.binary(min_size=1, max_size=12), entries, max_size=20),
       extra=st.lists(st.binary(max_size=12), max_size=3), data=st.data(),
       g0=st.one_of(st.integers(1, 60), st.integers(2**60 - 40, 2**60 + 2)), highest=st.integers(0, 40),
       flag=st.sampled_from([0, 1 << 62]), off=st.integers(0, 2**40))
def test_s6_one_lookup_tombstones_equal_the_group_write(present: dict[bytes, Any], extra: list[bytes],
                                                               data: st.DataObject, g0: int, highest: int, flag: int,
                                                               off: int) -> None:
    # SPEC S6: the group write's records and hint entries, the reference's dead bytes and
    # stops, and the same index after; refused (None, the index unchanged) where a key is
    # missing, named twice or not plain, for the general path
    keys = data.draw(st.permutations(list(present) + extra)) if present or extra else []
    ref_index, new_index = dict(present), dict(present)
    want = _reference(keys, ref_index, g0, highest, flag, off)
    got = _taken(keys, new_index, g0, highest, flag, off)
    if got is None or want is None:
        assert got is None and want is None
        assert new_index == present and ref_index == present
        return
    assert got == want
    assert new_index == ref_index


@pytest.mark.parametrize("second", [(3, 0, 24, 1, None), (FID, 0, 24, 1, None)])
def test_s6_a_key_named_twice(second: Any) -> None:
    # SPEC S6: named again after its first naming left it for the general update (a put
    # in an older file), a key is found again and gets a second tombstone; named again
    # after it was taken, it is missing, and the batch goes to the general path
    present = {b"\x00": (FID, 0, 24, 1, None), b"\x01": second}
    keys = [b"\x00", b"\x01", b"\x01"]
    ref_index, new_index = dict(present), dict(present)
    want = _reference(keys, ref_index, 1, 0, 0, 0)
    got = _taken(keys, new_index, 1, 0, 0, 0)
    assert got == want
    assert (got is None) == (second[0] == FID)
    assert new_index == ref_index


@given(present=st.dictionaries(st.binary(min_size=1, max_size=12), entries, min_size=1, max_size=20),
       data=st.data())
def test_s6_taken_entries_go_back(present: dict[bytes, Any], data: st.DataObject) -> None:
    # SPEC S6: a batch whose tombstones are not appended leaves the index as it was
    keys = data.draw(st.permutations(list(present)))
    index = dict(present)
    got = bitcask_tombs_take(keys, index, FID, 1, 0, 0, RECORD_MAGIC, 0, 100)
    assert got is not None
    bitcask_tombs_restore(index, keys, got[2], got[3])
    assert index == present


@pytest.mark.parametrize("fault", ["pwrite", "after_append"])
def test_s6_a_failed_batch_delete_leaves_the_index_as_it_was(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                            fault: str) -> None:
    # SPEC S6, D8: the append of a batch's tombstones fails (the write, or right after
    # it): the index and the tombstone map are those before the batch, every body readable
    gsn = Gsn()
    s = open_store(tmp_path / "b", gsn)
    try:
        keys = [i.to_bytes(8, "big") for i in range(10)]
        for k in keys:
            s.put(k, b"v" * 50)
        sh = s._shards[0]
        index, tombs, dead = dict(sh.index), dict(sh.tombs), sh.active.dead

        def boom(*args: Any) -> None:
            raise OSError(5, "injected")

        if fault == "pwrite":
            monkeypatch.setattr(_fs.FS, "pwrite", boom)
        else:
            monkeypatch.setattr(_fail, "point", lambda name: boom() if name == "bitcask.after_append" else None)
        g0 = gsn.n + 1
        gsn.n += 6
        with s.lock_for(b""), pytest.raises((OSError, StorageError)):
            s.delete_many_locked(keys[2:8], g0)
        monkeypatch.undo()
        assert sh.index == index and sh.tombs == tombs and sh.active.dead == dead
        assert [s.get(k) for k in keys] == [b"v" * 50] * 10
    finally:
        s.close()
