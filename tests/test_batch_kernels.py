"""The compiled loops of a var queue's batches: the msgpack of plain values
(armdb._core.plainpack: the bytes msgpack gives, read back as msgpack reads them, and
None, msgpack's path, for anything else) and the body cache's (armdb._core.bodycache).

A var queue's batches pack and decode payloads with these kernels.  They must not be a
second format: a body they write is the body ``msgpack.Packer(use_bin_type=True)``
writes, so older readers read it (docs/format.md), and a body they decode comes back
exactly as ``msgpack.unpackb(raw, raw=False, strict_map_key=False)`` gives it.
"""

from __future__ import annotations

import math
import random

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from armdb import Db, queue
from armdb._core.bodycache import cache_drop, cache_pop, cache_put_ids, longest
from armdb._core.plain import reads_back_one
from armdb._core.plainpack import pack_plain, unpack_plain

_P = msgpack.Packer(use_bin_type=True)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
                    st.text(max_size=40), st.binary(max_size=300))
keys = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False),
                 st.text(max_size=30), st.binary(max_size=8))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=20), st.tuples(inner, inner), st.dictionaries(keys, inner, max_size=20)),
    max_leaves=40)


def _unpack(raw: bytes):
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)


def _same(a, b) -> bool:
    """Equal, of the same types all the way down (NaN equal to NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


@settings(max_examples=150, deadline=None)
@given(st.lists(values, max_size=6))
def test_q1_plain_values_pack_to_msgpack_s_bytes_and_read_back_as_msgpack_reads(vs):
    # SPEC Q1: a pushed payload is stored as msgpack packs it and leased as msgpack decodes it
    raws = pack_plain(vs)
    assert raws == [_P.pack(v) for v in vs]
    back = unpack_plain(raws)
    assert back is not None
    assert all(_same(a, _unpack(r)) for a, r in zip(back, raws))


_strs = st.one_of(st.text(alphabet=st.characters(max_codepoint=127), min_size=28, max_size=300),
                 st.text(min_size=28, max_size=120), st.text(max_size=4))


@settings(max_examples=300)
@given(st.lists(st.one_of(st.dictionaries(_strs, st.one_of(_strs, st.integers(0, 9)), max_size=5),
                          st.lists(_strs, max_size=5)), max_size=4))
def test_q1_str_keys_and_values_around_the_str8_bounds_pack_as_msgpack_packs_them(vs):
    # SPEC Q1: the containers' inline str (fixstr under 32 bytes, str 8 under 256) and the
    # recursion's (longer, or not ASCII) write msgpack's bytes
    assert pack_plain(vs) == [_P.pack(v) for v in vs]


def test_q1_every_length_form_and_int_width():
    # SPEC Q1: the shortest int, str, bin, array and map forms, at each boundary
    vs = [0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63, 2**64 - 1, -1, -32, -33, -128, -129,
          -32768, -32769, -(2**31), -(2**31) - 1, -(2**63), 1.5, -0.0, math.inf, "", "a" * 31, "a" * 32,
          "a" * 255, "a" * 256, "a" * 65536, "é" * 40, b"", b"x" * 255, b"x" * 256, b"y" * 65536, [1] * 15,
          [1] * 16, list(range(65536)), {i: i for i in range(15)}, {i: i for i in range(16)},
          {i: None for i in range(65536)}, (1, (2, 3)), {None: 1, 2.5: 2, b"k": 3, True: 4}]
    raws = pack_plain(vs)
    assert raws == [_P.pack(v) for v in vs]
    assert unpack_plain(raws) == [_unpack(r) for r in raws]


def test_q1_a_float32_and_wider_forms_msgpack_writes_are_read_as_msgpack_reads_them():
    # SPEC Q1: bodies written by another packer (float 32, str 8 under 32 bytes, int 64 forms) decode the same
    raws = [msgpack.packb(1.5, use_single_float=True), b"\xd9\x01a", b"\xd3" + (5).to_bytes(8, "big"),
            b"\xcf" + (7).to_bytes(8, "big"), b"\xdc\x00\x01\xc0", b"\xde\x00\x01\xa1k\xc3"]
    assert unpack_plain(raws) == [_unpack(r) for r in raws]


def test_q1_short_strings_from_the_cache_are_the_right_ones():
    # SPEC Q1: the short-string cache never hands back another string of the same slot
    words = [f"k{i}" for i in range(2000)] + ["", "é", "日本"]
    raws = pack_plain([{w: w} for w in words] * 2)
    assert unpack_plain(raws) == [{w: w} for w in words] * 2


shape_keys = st.sampled_from(["doc_id", "reason", "tags", "text", "a", "", "é", "k" * 24, "k" * 25])
shaped = st.lists(st.tuples(st.lists(shape_keys, min_size=1, max_size=6), st.lists(values, min_size=6, max_size=6)),
                  min_size=1, max_size=4)


@settings(max_examples=200, deadline=None)
@given(shaped, st.lists(st.integers(0, 3), min_size=2, max_size=12))
def test_q1_maps_of_the_same_keys_decode_as_msgpack_decodes_each(shapes, picks):
    # SPEC Q1: a batch's maps that share their keys (a template copied, values replaced) come
    # back as msgpack decodes each: same keys in the same order, same values, whatever the
    # map before them held (other keys, fewer, a repeated key, a longer form of a key)
    bodies = []
    for j in picks:
        ks, vs = shapes[j % len(shapes)]
        bodies.append(b"".join([bytes([0x80 | len(ks)])] + [_P.pack(k) + _P.pack(v) for k, v in zip(ks, vs)]))
    bodies.append(b"\x82\xd9\x06doc_id\x01\xa6reason\x02")  # the first key in its str 8 form
    bodies.append(b"\x82\xa6doc_id\x01\xa6doc_id\x02")  # a key twice: the last value wins
    bodies.append(b"\x82\xa6doc_id\x01\xa6reason\xc1")  # a bad value after the keys: msgpack's to refuse
    got = unpack_plain(bodies[:-1])
    assert got is not None
    assert all(_same(a, _unpack(r)) for a, r in zip(got, bodies))
    # an immutable value may be shared between the maps; a list or a dict never is
    mutable = [id(v) for d in got for v in d.values() if isinstance(v, (list, dict))]
    assert len(mutable) == len(set(mutable))
    assert unpack_plain(bodies) is None


def test_q1_anything_not_plain_is_left_to_msgpack():
    # SPEC Q1: the kernels vouch for no value they do not know; msgpack's path decides
    for bad in ([2**64], [-(2**63) - 1], ["\ud800"], [{(1,): 2}], [{"a": [{"b": {(1,): 2}}]}], [object()],
                [msgpack.ExtType(1, b"x")], [True.__class__], [1, {"x": {1, 2}}]):
        assert pack_plain(bad) is None, bad
    deep: list = []
    for _ in range(600):
        deep = [deep]
    assert pack_plain([deep]) is None and not reads_back_one(deep)
    for bad in ([b"\xc1"], [b"\xd4\x01\x00"], [b"\xc7\x01\x05x"], [b"\x92\x01"], [b"\x01\x02"], [b"\xa2\xff\xfe"],
                [b"\x81\x91\x01\x02"], [b"\x81\x80\x01"], [b""], [b"\xc4\x05ab"], [bytearray(b"\x01")]):
        assert unpack_plain(bad) is None, bad


def test_q1_a_batch_of_plain_and_other_payloads_round_trips_through_a_queue(tmp_path):
    # SPEC Q1: what lease_batch returns is what push_many pushed, through either path
    spec = queue("pp", payload=object, var=True)
    vs = [{"doc_id": i, "tags": ["a", "b"], "t": (i, "x")} for i in range(50)] + [[1, {"k": 2.5}], "s", None]
    with Db.open(tmp_path) as db:
        q = db.open_queue(spec)
        q.push_many(vs)
        q.push_many([msgpack.ExtType(3, b"e"), {"k": 1}])  # not plain: msgpack's path, both ways
        got = q.lease_batch(100)
        want = [{"doc_id": i, "tags": ["a", "b"], "t": [i, "x"]} for i in range(50)] + [[1, {"k": 2.5}], "s", None,
                                                                                      msgpack.ExtType(3, b"e"),
                                                                                      {"k": 1}]
        assert list(got.payloads) == want
        assert q.ack_many(got) == len(want)


def test_q1_the_body_cache_loops_do_what_the_dict_operations_do():
    # SPEC Q1: a cached body is the pushed body; a lease of an uncached one reads the store
    cache: dict[int, bytes] = {7: b"old"}
    assert cache_put_ids(cache, [10, 11, 12], [b"a", b"bb" * 50, b"ccc"], 10, 3) == 7  # the 100-byte body is over budget
    assert list(cache.items()) == [(7, b"old"), (10, b"a"), (12, b"ccc")]
    assert cache_put_ids(cache, [13, 14, 15], [b"dd", b"eeee", b"f"], 10, 7) == 9  # full at 14: the rest is not cached
    assert list(cache.items()) == [(7, b"old"), (10, b"a"), (12, b"ccc"), (13, b"dd")]  # nothing evicted
    assert cache_drop(cache, np.array([10, 11, 7], dtype=np.uint64)) == 4
    assert cache == {12: b"ccc", 13: b"dd"}



@settings(max_examples=150, deadline=None)
@given(st.lists(values, max_size=6), st.sampled_from([dict, list, str, tuple, int, bool, bytes, object, None]))
def test_q1_pack_plain_of_one_payload_type_packs_those_values_alone(vs, top):
    # SPEC Q1: with a payload type, the batch packs as msgpack packs it only if each value is exactly that type
    want = pack_plain(vs)
    got = pack_plain(vs, top)
    if top is None or all(type(v) is top for v in vs):
        assert got == want
    else:
        assert got is None
    if got is not None:
        assert got == [_P.pack(v) for v in vs]


def test_q1_the_body_cache_pop_takes_all_or_nothing():
    # SPEC Q1: a batch lease takes its bodies out of the cache only when every one is there
    cache: dict[int, bytes] = {7: b"old", 10: b"a", 12: b"ccc"}
    assert cache_pop(cache, np.array([12, 10], dtype=np.uint64)) == ([b"ccc", b"a"], 4)
    assert cache == {7: b"old"}
    cache.update({10: b"a", 11: b"bb"})
    assert cache_pop(cache, np.array([10, 11, 13], dtype=np.uint64)) is None  # 13 missing: nothing taken
    assert cache == {7: b"old", 10: b"a", 11: b"bb"}
    assert cache_pop(cache, np.array([10, 10], dtype=np.uint64)) is None  # a repeat is found once
    assert cache == {7: b"old", 10: b"a", 11: b"bb"}
    assert cache_pop(cache, np.array([], dtype=np.uint64)) == ([], 0)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=12))
def test_q1_longest_is_the_first_longest_body(bodies):
    # SPEC Q1: push_many's size check finds the first longest body
    i = longest(bodies)
    if bodies:
        assert i == bodies.index(max(bodies, key=len))
    else:
        assert i == 0
    assert longest([*bodies, "not bytes"]) == -1


def test_q1_a_leased_batch_leaves_the_cache_and_a_nacked_row_comes_back_from_the_store(tmp_path):
    # SPEC Q1, Q32: the batch's bodies are taken out of the cache at lease; a retry reads the store
    spec = queue("lc", payload=dict, var=True)
    with Db.open(tmp_path) as db:
        q = db.open_queue(spec)
        ids = q.push_many([{"i": i} for i in range(5)])
        assert set(q._cache) == set(ids)
        b = q.lease_batch(5)
        assert [p["i"] for p in b.payloads] == list(range(5))
        assert q._cache == {} and q._cache_bytes == 0
        q.nack(b[2], delay=0)
        again = q.lease_batch(5)
        assert list(again.payloads) == [{"i": 2}] and list(again.ids) == [ids[2]]
        assert q.ack_many([lz for i, lz in enumerate(b) if i != 2]) == 4
        assert q.ack_many(again) == 1
        assert len(q) == 0 and q._cache == {} and q._cache_bytes == 0
        # Bodies only partly cached (one evicted): the store serves the missing one, and the
        # cached ones leave the cache too (every lease takes its rows' bodies out of it).
        ids = q.push_many([{"j": j} for j in range(3)])
        q._cache_drop(ids[1])
        b = q.lease_batch(3)
        assert [p["j"] for p in b.payloads] == [0, 1, 2]
        assert q._cache == {} and q._cache_bytes == 0
        assert q.ack_many(b) == 3
        assert q._cache == {} and q._cache_bytes == 0


def test_q1_truncated_maps_and_strings_are_left_to_msgpack():
    # SPEC Q1: a map whose short str keys or values run past the body is not plain; msgpack says why
    for bad in (b"\x82\xa0\x01", b"\x81\xa3ab", b"\x82\xa1k\x01\xa1", b"\xa5abc", b"\xd9\x1eabc", b"\x81\xbf" + b"k" * 30):
        assert unpack_plain([bad]) is None, bad
    ok = [b"\x81\xa0\x01", b"\x82\xa1k\x01\xa1j\xa2\xc3\xa9", b"\xba" + b"x" * 26, b"\xd9\x28" + "é".encode() * 20]
    assert unpack_plain(ok) == [_unpack(r) for r in ok]


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 90), st.integers(1, 120), st.integers(0, 40), st.integers(1, 3))
def test_q32_claim_new_leases_what_claim_block_leases(tmp_path_factory, rows, n, acked, max_attempts):
    # SPEC Q32: a var lease_batch's claim into arrays made to size (QueueShard.claim_new)
    # leases the rows, attempts and epochs that claim_block leases into the caller's
    # arrays, and dead-letters the same rows (expired leases past max_attempts)
    spec = queue("cn", payload=object, var=True)
    got = []
    for use_new in (True, False):
        with Db.open(tmp_path_factory.mktemp("db")) as db:
            q = db.open_queue(spec)
            if rows:
                q.push_many(list(range(rows)))
            first = q.lease_batch(60, lease_timeout=0.001)  # expire some leases: released or dead next
            q.ack_many([first[i] for i in range(min(acked, len(first)))])
            sh = q._shards[0]
            now = q._check() + 10
            with sh.lock:
                if use_new:
                    dead, shard_nos, dues, seqs, attempts, epochs = sh.claim_new(now, now + 1000, n, max_attempts)
                else:
                    dues, seqs = np.empty(n, np.uint64), np.empty(n, np.uint64)
                    attempts, epochs = np.empty(n, np.uint16), np.empty(n, np.uint32)
                    k, dead = sh.claim_block(now, now + 1000, n, max_attempts, dues, seqs, attempts, epochs,
                                             np.empty(0, np.uint8), 0)
                    dues, seqs, attempts, epochs = dues[:k], seqs[:k], attempts[:k], epochs[:k]
                    shard_nos = np.zeros(k, np.uint32)
            for a, dt in ((shard_nos, np.uint32), (dues, np.uint64), (seqs, np.uint64), (attempts, np.uint16),
                          (epochs, np.uint32)):
                assert a.dtype == dt and a.flags.c_contiguous and (a.flags.owndata or not use_new)
            assert len(dues) == len(seqs)  # (a released row's due is its old deadline: a time of this run)
            got.append((dead, shard_nos.tolist(), seqs.tolist(), attempts.tolist(), epochs.tolist()))
    assert got[0] == got[1]


def test_q1_short_strings_and_ints_inline_in_maps_and_lists_pack_as_msgpack_packs():
    # SPEC Q1: the container loops' inline forms (a str under 32 bytes copied by 8- and 4-byte
    # moves, an int) give msgpack's bytes at every length and next to the recursion's forms
    texts = ["x" * n for n in range(70)] + ["é", "é" * 20, "aé" * 12, "\u65e5" * 11]
    ints = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32, 2**63 - 1, 2**64 - 1, -1, -32, -33, -(2**63)]
    vs = [{t: t for t in texts}, texts, tuple(texts), {t: i for t, i in zip(texts, ints * 6)}, ints, tuple(ints),
          {i: [i, str(i)] for i in ints}, {"k": [texts[5], {"n": texts[40]}]}]
    raws = pack_plain(vs)
    assert raws == [_P.pack(v) for v in vs]
    assert pack_plain([{"k": 2**64}]) is None and pack_plain([[1, -(2**63) - 1]]) is None  # left to msgpack


def test_q1_the_body_cache_keys_ids_past_the_long_range():
    # SPEC Q1: a body's key is its id as an int, whatever its width (the one-digit path below 2**63)
    cache: dict[int, bytes] = {}
    assert cache_put_ids(cache, [2**63 - 2, 2**63 - 1, 2**63], [b"a", b"b", b"c"], 10, 0) == 3
    assert cache_put_ids(cache, [2**64 - 1], [b"d"], 10, 3) == 4
    assert list(cache) == [2**63 - 2, 2**63 - 1, 2**63, 2**64 - 1]


def _put_ids_reference(cache: dict[int, bytes], ids: list[int], bodies: list[bytes], budget: int, held: int) -> int:
    """Queue._cache_put's dict operations for each body while it fits in the room left,
    the first that does not (and is not longer than the whole budget) ending the batch:
    what cache_put_ids does in one call."""
    for i, body in zip(ids, bodies, strict=True):
        if held + len(body) <= budget:
            cache[i] = body
            held += len(body)
        elif len(body) <= budget:
            break
    return held


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.binary(max_size=60), max_size=30), st.booleans()), max_size=12),
       st.integers(0, 400))
def test_q1_a_push_batch_s_put_does_what_the_dict_operations_do(batches, budget):
    # SPEC Q1: a batch's bodies are cached under their ids while they fit in the budget; a
    # full cache keeps what it holds (nothing is evicted) and takes no more
    cache: dict[int, bytes] = {}
    model: dict[int, bytes] = {}
    held = want = 0
    next_id = 1
    for bodies, pop in batches:
        ids = list(range(next_id, next_id + len(bodies)))
        next_id += len(bodies)
        held = cache_put_ids(cache, ids, bodies, budget, held)
        want = _put_ids_reference(model, ids, bodies, budget, want)
        assert held == want == sum(map(len, cache.values())) <= max(budget, 0)
        assert list(cache.items()) == list(model.items())
        if pop and cache:  # a lease takes the oldest; its bytes leave the count and make room
            k = next(iter(cache))
            held -= len(cache.pop(k))
            want -= len(model.pop(k))
    with pytest.raises(ValueError):
        cache_put_ids({}, [1], [b"a", b"b"], 10, 0)
    with pytest.raises(TypeError):
        cache_put_ids({}, [1], ["a"], 10, 0)


@pytest.mark.parametrize("seed", range(4))
def test_q1_the_cache_loops_keep_the_oldest_bodies_through_puts_drops_and_pops(seed):
    # SPEC Q1: through batch puts, lone puts, drops, pops (a pop that misses puts back
    # what it took), clears and several caches, each cache holds what the dict operations
    # give, within its budget, and a full cache takes nothing new
    rng = random.Random(seed)
    caches: list[dict[int, bytes]] = [{} for _ in range(6)]
    models: list[dict[int, bytes]] = [{} for _ in range(6)]
    helds = [0] * 6
    budget = 2000
    next_id = 1
    for _ in range(3000):
        c = rng.randrange(len(caches)) if rng.random() < 0.3 else 0
        cache, model = caches[c], models[c]
        op = rng.random()
        if op < 0.35:
            n = rng.choice([1, 5, 50, 400])
            bodies = [rng.randbytes(rng.randrange(1, 40)) for _ in range(n)]
            ids = list(range(next_id, next_id + n))
            want = _put_ids_reference(model, ids, bodies, budget, sum(map(len, model.values())))
            helds[c] = cache_put_ids(cache, ids, bodies, budget, helds[c])
            assert helds[c] == want
            next_id += n
        elif op < 0.6 and model:  # a lease of the oldest rows, as a queue leases them
            ids = list(model)[: rng.randrange(1, 60)]
            got = cache_pop(cache, np.array(ids, dtype=np.uint64))
            assert got is not None and got[0] == [model.pop(i) for i in ids]
            helds[c] -= got[1]
        elif op < 0.8 and model:
            ids = rng.sample(sorted(model), min(len(model), rng.randrange(1, 30)))
            freed = cache_drop(cache, np.array(ids, dtype=np.uint64))
            assert freed == sum(len(model.pop(i)) for i in ids)
            helds[c] -= freed
        elif op < 0.9 and model:  # a pop that misses puts the bodies it took back, at the end
            ids = sorted(model)[: rng.randrange(1, 20)] + [10**12]
            assert cache_pop(cache, np.array(ids, dtype=np.uint64)) is None
            for i in ids[:-1]:
                model[i] = model.pop(i)
        elif op < 0.93:
            cache.clear()
            model.clear()
            helds[c] = 0
        else:  # a lone push's body (Queue._cache_put), by the dict itself
            body = b"x" * rng.randrange(1, 9)
            if helds[c] + len(body) <= budget:
                cache[next_id] = model[next_id] = body
                helds[c] += len(body)
            next_id += 1
        assert list(cache.items()) == list(model.items())
        assert helds[c] == sum(map(len, cache.values())) <= budget


class _Slots:
    """An instance whose ``__dict__`` is a split table (the packer reads it by PyDict_Next)."""

    def __init__(self, a: object, b: object) -> None:
        self.a = a
        self.b = b


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.text(max_size=6), st.integers(-3, 3), st.binary(max_size=3)),
                          st.one_of(st.text(max_size=40), st.integers(-(2**63), 2**64 - 1), st.none(),
                                    st.lists(st.text(max_size=5), max_size=3))), max_size=24),
       st.lists(st.integers(0, 23), max_size=12), st.booleans())
def test_q1_a_dict_s_table_read_in_place_packs_as_msgpack_packs(items, dels, readd):
    # SPEC Q1: the packer reads a dict's items from its entry table (pyfast.h) where the
    # table allows: the items msgpack packs, in dict order, after deletions (entries left
    # empty in the table), re-insertions (at the end), str keys only (the unicode table) or
    # others (the general table), and a split table (an instance's __dict__) by PyDict_Next
    d: dict[object, object] = {}
    for k, v in items:
        d[k] = v
    keys_now = list(d)
    for i in dels:
        if i < len(keys_now) and keys_now[i] in d:
            v = d.pop(keys_now[i])
            if readd:
                d[keys_now[i]] = v
    only_str = {k: v for k, v in d.items() if isinstance(k, str)}
    inst = _Slots(d, only_str)
    vs = [d, only_str, {"in": d, "list": [only_str, d]}, inst.__dict__]
    assert pack_plain(vs) == [_P.pack(v) for v in vs]
    assert [_unpack(r) for r in pack_plain(vs)] == [_unpack(_P.pack(v)) for v in vs]
