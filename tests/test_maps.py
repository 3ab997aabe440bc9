"""The ``Map`` handle over a Bitcask store (SPEC D3, S9), tested at store level."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from armdb.bitcask import BitcaskStore, check_dir
from armdb.config import Config
from armdb.errors import DbClosed, PayloadTypeError, StreamSourceRequiresTx
from armdb.maps import Map, decode_key, encode_key, encode_value


class Gsn:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> int:
        self.n += 1
        return self.n


_opened: list[BitcaskStore] = []


@pytest.fixture(autouse=True)
def _close_stores() -> Any:
    yield
    while _opened:
        _opened.pop().close()


def open_map(path: Path, *, cache_bytes: int = 0, closed: list[bool] | None = None, **cfg: Any) -> Map:
    g = Gsn()
    cfg.setdefault("enable_fsync", False)
    store = BitcaskStore.open(str(path), Config(cache_bytes=cache_bytes, **cfg), g)
    g.n = store.max_gsn
    _opened.append(store)
    flag = closed if closed is not None else [False]

    def closed_check() -> None:
        if flag[0]:
            raise DbClosed()

    return Map(store, closed_check, name=path.name)


KEYS: list[Any] = [
    b"",
    b"1",
    b"\x00\xff",
    "",
    "1",
    "naïve ☃ 𝄞",
    0,
    1,
    -1,
    127,
    128,
    -128,
    -129,
    255,
    2**63,
    -(2**63) - 1,
    2**200 + 7,
    -(2**200),
]

VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -5,
    2**64 - 1,
    -(2**63),
    1.5,
    float("inf"),
    "",
    "text ☃",
    b"",
    b"\x00bytes",
    [],
    [1, "a", b"b", None],
    {},
    {"a": 1, "b": [1, 2, {"c": b"d"}]},
    {1: "int keys", b"k": "bytes keys"},
    {"nested": {"deeper": [[[]], {"x": [1.25, None]}]}},
]


def test_d3_every_key_and_value_kind_round_trips(tmp_path: Path) -> None:
    m = open_map(tmp_path / "m", shard_count=3)
    expected = {}
    for i, k in enumerate(KEYS):
        v = VALUES[i % len(VALUES)]
        m.put(k, v)
        expected[(type(k), k)] = v
    for i, v in enumerate(VALUES):
        m.put(f"v{i}", v)
        expected[(str, f"v{i}")] = v
    for (_, k), v in expected.items():
        assert m.get(k) == v and type(m.get(k)) is type(v)
    m.store.close()
    m = open_map(tmp_path / "m")
    got = {(type(k), k): v for k, v in m.items()}
    assert got == expected
    assert len(m) == len(expected)
    m.store.close()
    assert check_dir(str(tmp_path / "m")) == []


def test_d3_one_string_and_bytes_are_three_keys(tmp_path: Path) -> None:
    m = open_map(tmp_path / "m")
    m.put(1, "int")
    m.put("1", "str")
    m.put(b"1", "bytes")
    assert len(m) == 3
    assert (m.get(1), m.get("1"), m.get(b"1")) == ("int", "str", "bytes")
    items = sorted(m.items(), key=lambda kv: kv[1])
    assert items == [(b"1", "bytes"), (1, "int"), ("1", "str")]
    assert [type(k) for k, _ in items] == [bytes, int, str]
    assert m.delete("1") is True
    assert m.delete("1") is False
    assert 1 in m and b"1" in m and "1" not in m
    assert sorted(map(repr, m.keys())) == ["1", "b'1'"]


def test_d3_get_default_and_missing(tmp_path: Path) -> None:
    m = open_map(tmp_path / "m")
    assert m.get("nope") is None
    assert m.get("nope", 42) == 42
    m.put("none", None)
    assert m.get("none", 42) is None  # a stored None is not "missing"
    assert "none" in m


@pytest.mark.parametrize("bad", [1.0, True, False, None, bytearray(b"x"), ("t",), object(), "\ud800"])
def test_d3_wrong_key_type_raises_payload_type_error(tmp_path: Path, bad: Any) -> None:
    m = open_map(tmp_path / "m")
    with pytest.raises(PayloadTypeError, match="key"):
        m.put(bad, 1)
    with pytest.raises(PayloadTypeError, match="key"):
        m.get(bad)
    with pytest.raises(PayloadTypeError, match="key"):
        _ = bad in m
    with pytest.raises(PayloadTypeError, match="key"):
        m.delete(bad)
    with pytest.raises(TypeError):  # PayloadTypeError is also a TypeError
        m.put(bad, 1)
    assert len(m) == 0


@pytest.mark.parametrize("bad", [object(), {1, 2}, 2**64, [1, object()], {"k": lambda: 0}])
def test_q1_unencodable_value_raises_and_writes_nothing(tmp_path: Path, bad: Any) -> None:
    m = open_map(tmp_path / "m")
    m.put("a", 1)
    before = m.store.stats()
    files = {p: p.read_bytes() for p in (tmp_path / "m").rglob("*.data")}
    with pytest.raises(PayloadTypeError, match="msgpack"):
        m.put("b", bad)
    with pytest.raises(PayloadTypeError, match="msgpack"):
        m.put("a", bad)  # an existing key keeps its value
    assert m.get("a") == 1 and "b" not in m and len(m) == 1
    assert m.store.stats() == before
    assert {p: p.read_bytes() for p in (tmp_path / "m").rglob("*.data")} == files


def test_key_encoding_is_tagged_and_canonical() -> None:
    assert encode_key(b"x") == b"bx"
    assert encode_key("x") == b"sx"
    assert encode_key(0) == b"i\x00"
    assert encode_key(-1) == b"i\xff"
    assert encode_key(128) == b"i\x00\x80"
    seen = set()
    for k in KEYS:
        raw = encode_key(k)
        assert decode_key(raw) == k and type(decode_key(raw)) is type(k)
        seen.add(raw)
    assert len(seen) == len(KEYS)
    for n in range(-70000, 70000, 7):
        assert decode_key(encode_key(n)) == n
    with pytest.raises(PayloadTypeError, match="unknown type tag"):
        decode_key(b"zzz")


def test_s9_cache_is_bounded_and_never_stale(tmp_path: Path) -> None:
    m = open_map(tmp_path / "m", cache_bytes=4096)
    for i in range(200):
        m.put(i, {"i": i, "pad": "x" * 50})
    for i in range(200):
        assert m.get(i) == {"i": i, "pad": "x" * 50}
    s = m.cache_stats()
    assert 0 < s["bytes"] <= s["budget"] == 4096
    assert 0 < s["entries"] < 200
    # Hits come back equal, and mutating a returned container does not change the cache.
    got = m.get(199)
    got["i"] = "mutated"
    assert m.get(199) == {"i": 199, "pad": "x" * 50}
    assert m.cache_stats()["hits"] >= 1
    # A write that bypasses the handle (as transactions and replay do) is seen at once.
    m.store.put(encode_key(199), b"\xa3new")
    assert m.get(199) == "new"
    m.store.delete(encode_key(198))
    assert m.get(198, "gone") == "gone"
    m.delete(197)
    assert m.get(197) is None


def test_s9_cache_disabled_by_default(tmp_path: Path) -> None:
    m = open_map(tmp_path / "m")
    m.put("a", [1])
    assert m.get("a") == [1]
    assert m.cache_stats()["entries"] == 0


def test_d2_closed_map_raises_db_closed(tmp_path: Path) -> None:
    closed = [False]
    m = open_map(tmp_path / "m", closed=closed)
    m.put("a", 1)
    closed[0] = True
    for op in (
        lambda: m.get("a"),
        lambda: m.put("a", 2),
        lambda: m.delete("a"),
        lambda: "a" in m,
        lambda: len(m),
        lambda: list(m.items()),
    ):
        with pytest.raises(DbClosed):
            op()
    closed[0] = False
    assert m.get("a") == 1


def test_t6_stream_source_refuses_direct_writes(tmp_path: Path) -> None:
    g = Gsn()
    store = BitcaskStore.open(str(tmp_path / "m"), Config(enable_fsync=False), g)
    _opened.append(store)
    m = Map(store, lambda: None, name="src", stream_source=True)
    with pytest.raises(StreamSourceRequiresTx, match=r"db\.tx"):
        m.put("a", 1)
    with pytest.raises(StreamSourceRequiresTx, match=r"db\.tx"):
        m.delete("a")
    assert len(m) == 0
    # A commit writes through the locked hook, with the gsn it drew under the lock.
    raw = encode_key("a")
    with store.lock_for(raw):
        g.n += 1
        m._tx_write(raw, encode_value({"x": 1}), g.n)
        assert store.get_locked(raw) == encode_value({"x": 1})
    assert m.get("a") == {"x": 1}
    assert m.stats()["keys"] == 1 and "cache_hits" in m.stats()


def test_map_survives_compaction_and_reopen(tmp_path: Path) -> None:
    m = open_map(tmp_path / "m", shard_count=2, max_file_size=64 * 1024, cache_bytes=1 << 16)
    model: dict[Any, Any] = {}
    for i in range(6000):
        k = [i % 97, str(i % 89), b"%d" % (i % 83)][i % 3]
        v = {"i": i, "s": "y" * (i % 40)}
        m.put(k, v)
        model[k] = v
        if i % 17 == 0:
            m.delete(k)
            model.pop(k)
    assert m.store.stats()["compactions"] > 0
    assert dict(m.items()) == model
    m.store.close()
    m = open_map(tmp_path / "m")
    assert dict(m.items()) == model
    m.store.close()
    assert check_dir(str(tmp_path / "m")) == []
