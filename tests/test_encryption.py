"""Encrypted Bitcask collections fail closed and leak no plaintext (SPEC S10; docs/reliability.md, (g))."""

from __future__ import annotations

import os
import struct
import uuid
import zlib
from pathlib import Path
from typing import Any

import pytest

from armdb._crypto import OVERHEAD, Sealer
from armdb.bitcask import DATA_START, BitcaskStore, check_dir
from armdb.config import Config
from armdb.errors import ConfigError, CorruptionError, EncryptionKeyRequired, WrongKey
from armdb.maps import Map

KEY = bytes(range(32))
OTHER = bytes(range(1, 33))
SMALL = 64 * 1024

_opened: list[BitcaskStore] = []


@pytest.fixture(autouse=True)
def _close_stores() -> Any:
    yield
    while _opened:
        _opened.pop().close()


class Gsn:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> int:
        self.n += 1
        return self.n


def open_store(path: Path, key: bytes | None = KEY, **cfg: Any) -> BitcaskStore:
    cfg.setdefault("enable_fsync", False)
    g = Gsn()
    st = BitcaskStore.open(str(path), Config(encryption_key=key, **cfg), g)
    g.n = st.max_gsn
    _opened.append(st)
    return st


def close(st: BitcaskStore) -> None:
    _opened.remove(st)
    st.close()


def records(path: Path) -> list[tuple[int, int, int, int]]:
    """(offset, key_len, value_len, size) of each record in a data file."""
    raw = path.read_bytes()
    out = []
    pos = DATA_START
    while pos + 20 <= len(raw):
        _, _, vlen, magic, klen = struct.unpack_from("<QIIHH", raw, pos)
        if magic != 0xB17C:
            break
        n = 20 + klen + vlen
        out.append((pos, klen, vlen, n + (-n % 8)))
        pos += n + (-n % 8)
    return out


def flip(path: Path, at: int, *, fix_crc_of: int | None = None) -> None:
    """Flip one byte; optionally recompute the CRC of the record at ``fix_crc_of``."""
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x01
    if fix_crc_of is not None:
        off = fix_crc_of
        _, _, vlen, _, klen = struct.unpack_from("<QIIHH", raw, off)
        n = 20 + klen + vlen
        crc = zlib.crc32(bytes(raw[off + 12 : off + n]), zlib.crc32(bytes(raw[off : off + 8])))
        struct.pack_into("<I", raw, off + 8, crc)
    path.write_bytes(bytes(raw))


def every_file_bytes(root: Path) -> list[tuple[Path, bytes]]:
    return [(p, p.read_bytes()) for p in sorted(root.rglob("*")) if p.is_file()]


# -- Sealer ----------------------------------------------------------------------------------


def test_s10_sealer_round_trip_nonces_and_aad() -> None:
    s = Sealer(KEY)
    sealed = {s.seal(b"same plaintext", b"aad") for _ in range(10000)}
    assert len(sealed) == 10000  # a fresh random nonce every time
    assert len({b[:12] for b in sealed}) == 10000
    blob = next(iter(sealed))
    assert len(blob) == len(b"same plaintext") + OVERHEAD
    assert s.open(blob, b"aad") == b"same plaintext"
    with pytest.raises(CorruptionError, match="tag"):
        s.open(blob, b"other aad")
    with pytest.raises(CorruptionError, match="tag"):
        s.open(blob[:-1] + bytes([blob[-1] ^ 1]), b"aad")
    with pytest.raises(CorruptionError, match="shorter"):
        s.open(b"short")
    with pytest.raises(CorruptionError):
        Sealer(OTHER).open(blob, b"aad")


def test_s10_key_check_value() -> None:
    check = Sealer(KEY).key_check()
    Sealer(KEY).verify(check)
    with pytest.raises(WrongKey, match="does not match"):
        Sealer(OTHER).verify(check)
    with pytest.raises(WrongKey):
        Sealer(KEY).verify(b"garbage" * 8)


@pytest.mark.parametrize("bad", [b"short", bytes(33), "k" * 32])
def test_s9_bad_key_length_is_config_error(bad: Any) -> None:
    with pytest.raises(ConfigError, match="32 bytes"):
        Sealer(bad)


# -- fail closed -------------------------------------------------------------------------------


def test_s10_missing_key_wrong_key_and_key_on_plain(tmp_path: Path) -> None:
    st = open_store(tmp_path / "enc")
    st.put(b"k", b"v")
    close(st)
    before = every_file_bytes(tmp_path)
    with pytest.raises(EncryptionKeyRequired, match="encrypted"):
        open_store(tmp_path / "enc", key=None)
    with pytest.raises(WrongKey, match="does not match"):
        open_store(tmp_path / "enc", key=OTHER)
    assert every_file_bytes(tmp_path) == before
    assert open_store(tmp_path / "enc").get(b"k") == b"v"

    close(open_store(tmp_path / "plain", key=None))
    with pytest.raises(ConfigError, match="not encrypted"):
        open_store(tmp_path / "plain", key=KEY)


# -- no plaintext on disk -------------------------------------------------------------------------


def test_s10_no_plaintext_canary_in_any_file(tmp_path: Path) -> None:
    coll = tmp_path / "enc"
    canary = b"CANARY-" + uuid.uuid4().hex.encode()
    st = open_store(coll, shard_count=2, max_file_size=SMALL, compaction_threshold=0.3)
    m = Map(st, lambda: None)
    for i in range(3000):
        k = i % 150
        st.put(canary + b"-key-%d" % k, canary + b"-value-%d" % i + b"." * 60)
        m.put(canary.decode() + str(k), {"note": canary.decode(), "i": i})
        if i % 7 == 0:
            st.delete(canary + b"-key-%d" % ((k + 3) % 150))
    s = st.stats()
    assert s["compactions"] > 0 and s["encrypted"]
    assert list((coll / "shard-000").glob("*.hint")), "hint files must exist for this test"
    hits = [p for p, raw in every_file_bytes(tmp_path) if canary in raw or canary.hex().encode() in raw]
    assert hits == []
    st.compact()
    close(st)
    hits = [p for p, raw in every_file_bytes(tmp_path) if canary in raw]
    assert hits == []
    # The index is rebuilt by unsealing keys (from hints and scans alike).
    st = open_store(coll, max_file_size=SMALL)
    assert st.get(canary + b"-key-%d" % (2999 % 150)) == canary + b"-value-2999" + b"." * 60
    assert Map(st, lambda: None).get(canary.decode() + "149") == {"note": canary.decode(), "i": 2999}
    close(st)
    assert check_dir(str(coll)) == []  # the check needs no key


# -- tampering --------------------------------------------------------------------------------------


def _three_records(coll: Path) -> Path:
    st = open_store(coll)
    for i in range(3):
        st.put(b"key%d" % i, b"value%d" % i * 5)
    close(st)
    (f,) = sorted((coll / "shard-000").glob("*.data"))
    return f


def test_s10_tampered_value_fails_its_tag_on_read(tmp_path: Path) -> None:
    coll = tmp_path / "enc"
    f = _three_records(coll)
    off, klen, _, _ = records(f)[1]
    # Flip a ciphertext byte of the value AND fix the CRC, so only the GCM tag can notice.
    flip(f, off + 20 + klen + 12 + 3, fix_crc_of=off)
    st = open_store(coll)  # keys still unseal: the open succeeds
    assert st.get(b"key0") == b"value0" * 5 and st.get(b"key2") == b"value2" * 5
    with pytest.raises(CorruptionError, match=rf"00000001\.data: value at offset {off}.*tag"):
        st.get(b"key1")


def test_s10_tampered_key_fails_its_tag_on_open(tmp_path: Path) -> None:
    coll = tmp_path / "enc"
    f = _three_records(coll)
    off, _, _, _ = records(f)[1]
    flip(f, off + 20 + 12, fix_crc_of=off)
    with pytest.raises(CorruptionError, match=rf"00000001\.data: key at offset {off}.*tag"):
        open_store(coll)


def test_s10_tampered_byte_without_crc_fix_is_corruption(tmp_path: Path) -> None:
    coll = tmp_path / "enc"
    f = _three_records(coll)
    off, klen, _, _ = records(f)[0]
    flip(f, off + 20 + klen + 20)
    with pytest.raises(CorruptionError, match=rf"00000001\.data.*offset {off}\b"):
        open_store(coll)
    assert any(f"corrupt record at offset {off}" in x for x in check_dir(str(coll)))


def test_s10_swapped_values_between_records_fail(tmp_path: Path) -> None:
    coll = tmp_path / "enc"
    st = open_store(coll)
    st.put(b"a", b"x" * 10)
    st.put(b"b", b"y" * 10)  # same sizes, so the sealed values can be swapped in place
    close(st)
    (f,) = sorted((coll / "shard-000").glob("*.data"))
    (o1, k1, v1, _), (o2, k2, v2, _) = records(f)
    raw = bytearray(f.read_bytes())
    a = bytes(raw[o1 + 20 + k1 : o1 + 20 + k1 + v1])
    b = bytes(raw[o2 + 20 + k2 : o2 + 20 + k2 + v2])
    raw[o1 + 20 + k1 : o1 + 20 + k1 + v1] = b
    raw[o2 + 20 + k2 : o2 + 20 + k2 + v2] = a
    f.write_bytes(bytes(raw))
    for off in (o1, o2):
        flip(f, 0, fix_crc_of=off)  # recompute the CRC (the flip of byte 0 is undone below)
        flip(f, 0)
    st = open_store(coll)
    with pytest.raises(CorruptionError, match="tag"):
        st.get(b"a")
    with pytest.raises(CorruptionError, match="tag"):
        st.get(b"b")


def test_s10_encrypted_compaction_and_reopen(tmp_path: Path) -> None:
    coll = tmp_path / "enc"
    st = open_store(coll, max_file_size=SMALL)
    model = {}
    for i in range(4000):
        k = b"k%03d" % (i % 120)
        v = os.urandom(i % 90)
        st.put(k, v)
        model[k] = v
    assert st.stats()["compactions"] > 0
    assert dict(st.items()) == model
    close(st)
    st = open_store(coll, max_file_size=SMALL)
    assert dict(st.items()) == model
    close(st)
    with pytest.raises(WrongKey):
        open_store(coll, key=OTHER)
    assert check_dir(str(coll)) == []


def test_s10_wrong_key_message_names_the_collection(tmp_path):
    # A wrong key is refused naming the collection it was given for.
    from armdb import Config, Db
    from armdb.errors import WrongKey

    with Db.open(tmp_path / "db") as db:
        db.open_map("secrets", Config.balanced().encryption_key(b"k" * 32).build())
    with Db.open(tmp_path / "db") as db:
        with pytest.raises(WrongKey, match="collection 'secrets'"):
            db.open_map("secrets", Config.balanced().encryption_key(b"x" * 32).build())
