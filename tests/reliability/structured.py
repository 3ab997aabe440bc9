"""Structure-aware crafting for harness (d2): decode a golden file, set one field, re-seal.

Every record and file kind armdb writes has a *crafter* here: it finds the targets of
its kind in a golden database (a file, a record of a file, a slot, a log row), and
for each field of that kind a table of boundary and hostile values (0, -1, ``2**k +- 1``
for k in 7, 8, 15, 16, 31, 32, 60, 63, 64 where the width allows, lengths past the
end of the file, names with ``/``, ``..``, NUL, absolute paths, wrong msgpack types,
nested depth bombs, ...).  :func:`craft` sets one value and re-seals what the format
seals: every CRC is recomputed, and where the layout is encrypted the fields are
sealed again with the test's keys (``bcd_workloads.KEY`` for the collections,
``LOG_KEY`` for the transaction log), so a decoder sees a file that passes every
integrity check and must judge the content itself.

A case is ``(golden, kind, target, field, value index)``: plain data, so the parent
can sample and count cases while the children (``test_structured_mutation.py``)
craft and evaluate them.  Value tables are deterministic functions of the target's
decoded content, so parent and child agree on every index.

Names in value tables may hold the placeholder ``@CASE@``: the child replaces it with
the absolute path of the case folder (which holds ``db`` and the canary), so an
absolute path in a crafted name points at a place the harness watches.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import msgpack

from armdb import bitcask, txlog
from armdb import fixed as _fixed
from armdb._crypto import Sealer

from ..marks import has_area
from .bcd_workloads import KEY, LOG_KEY

CASE_DIR = "@CASE@"
KS = (7, 8, 15, 16, 31, 32, 60, 63, 64)

# ---------------------------------------------------------------------------------------------
# The catalogue: every kind and its fields (the coverage the harness asserts)
# ---------------------------------------------------------------------------------------------

_SLOT_FIELDS = ("status", "version", "due", "seq", "state", "flags", "attempts", "epoch", "deadline",
                "payload_id", "pushed", "payload", "pad")
_HWM_FIELDS = ("hwm_magic", "hwm_generation", "hwm_mark")
_FILE_HEAD_FIELDS = ("magic", "version", "flags", "file_id", "base_gsn", "nonce")

FIELDS: dict[str, tuple[str, ...]] = {
    "log_header": ("magic", "version", "flags", "number"),
    "log_record": ("magic", "flags", "txid", "body_len", "body", "tail", "row", "F.collection", "F.shard", "F.slot",
                   "F.version", "F.status", "F.body", "B.collection", "B.key", "B.value", "B.gsn"),
    "fixed_header": ("magic", "version", "slot_size", "key_size", "value_size", "shard", *_HWM_FIELDS),
    "fixed_slot": _SLOT_FIELDS,
    "redo": ("magic", "version", "slot_size", *_HWM_FIELDS, "rec_magic", "rec_slot", "rec_length",
             "image.status", "image.version", "image.due", "image.seq", "image.state", "image.attempts",
             "image.pad"),
    "bitcask_header": _FILE_HEAD_FIELDS,
    "bitcask_record": ("gsn", "tombstone", "reserved_bits", "value_len", "magic", "key_len", "key", "value",
                       "pad", "tail"),
    "hint_header": _FILE_HEAD_FIELDS,
    "hint_entry": ("gsn", "tombstone", "reserved_bits", "offset", "value_len", "key_len", "key"),
    "hint_trailer": ("magic", "data_size", "count"),
    "collection_meta": ("magic", "version", "flags", "shard_count", "salt", "check_len", "check"),
    "queue_meta": ("magic", "version", "length", "body", "var", "fingerprint", "shard_count", "key_size",
                   "value_size", "missing", "extra"),
    "db_meta": ("magic", "version", "ident_magic", "db_id", "check_len", "log_key_check"),
    "pending": ("magic", "version", "reserved", "count", "fid"),
    "seqmap": ("magic", "version", "length", "body", "value", "name", "extra"),
    "lock_file": ("entry", "content"),
    "synced_mark": ("mark", "generation", "binding", "area"),
}

# Kinds whose content must never change what an open serves: a hint is a cache, and a
# compaction marker in these goldens can name no real compaction input.  For these an
# open that serves a state other than the golden's is a violation (silent_loss).
CACHE_KINDS = ("hint_header", "hint_entry", "hint_trailer", "pending")


@dataclass(frozen=True)
class Case:
    golden: str
    kind: str
    target: str  # "<rel path>" or "<rel path>#<record or slot>"
    field: str
    vi: int  # index into the field's value table for this target

    def key(self) -> tuple[str, str, str, str, int]:
        return (self.golden, self.kind, self.target, self.field, self.vi)


# ---------------------------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------------------------


class Raw:
    """Bytes spliced verbatim into a msgpack document (hostile encodings)."""

    def __init__(self, b: bytes) -> None:
        self.b = b

    def __repr__(self) -> str:
        return f"Raw({self.b[:12]!r}{'...' if len(self.b) > 12 else ''} {len(self.b)}B)"


def mp(o: Any) -> bytes:
    """msgpack with :class:`Raw` leaves and containers of any content."""
    if isinstance(o, Raw):
        return o.b
    if isinstance(o, (list, tuple)):
        n = len(o)
        head = bytes([0x90 | n]) if n < 16 else (b"\xdc" + struct.pack(">H", n) if n < 1 << 16 else b"\xdd" + struct.pack(">I", n))
        return head + b"".join(mp(x) for x in o)
    if isinstance(o, dict):
        n = len(o)
        head = bytes([0x80 | n]) if n < 16 else (b"\xde" + struct.pack(">H", n) if n < 1 << 16 else b"\xdf" + struct.pack(">I", n))
        return head + b"".join(mp(k) + mp(v) for k, v in o.items())
    return msgpack.packb(o, use_bin_type=True)


RAWS: list[tuple[str, Any]] = [
    ("depth_bomb_list", Raw(b"\x91" * 100_000 + b"\xc0")),
    ("depth_bomb_map", Raw(b"\x81\xc0" * 100_000 + b"\xc0")),
    ("array32_claims_4G", Raw(b"\xdd\xff\xff\xff\xff")),
    ("map32_claims_4G", Raw(b"\xdf\xff\xff\xff\xff")),
    ("bin32_claims_4G", Raw(b"\xc6\xff\xff\xff\xff")),
    ("str32_claims_4G", Raw(b"\xdb\xff\xff\xff\xff")),
    ("str_bad_utf8", Raw(b"\xa2\xff\xfe")),
    ("reserved_c1", Raw(b"\xc1")),
    ("ext_unknown", Raw(b"\xd4\x05\x00")),
    ("timestamp_bad_len", Raw(b"\xc7\x03\xff\x00\x00\x00")),
    ("timestamp_huge", Raw(b"\xd7\xff" + b"\xff" * 8)),
    ("map_unhashable_key", Raw(b"\x81\x90\xc0")),
    ("truncated_list", Raw(b"\x92\x01")),
    ("trailing_extra", Raw(b"\xc0\xc0")),
]

TYPES: list[tuple[str, Any]] = [
    ("nil", None), ("true", True), ("false", False), ("float", 1.5), ("nan", math.nan), ("inf", math.inf),
    ("str", "x"), ("bin", b"x"), ("list0", []), ("list1", [1]), ("map0", {}), ("map1", {"a": 1}),
    ("ext", msgpack.ExtType(5, b"x")), ("u64max", 2**64 - 1), ("i64min", -(2**63)),
]


def int_values(bits: int, extra: tuple[int, ...] = ()) -> list[tuple[str, int]]:
    """0, 1, -1 and 2**k +- 1 for every k that fits, wrapped into ``bits`` (two's complement)."""
    raw = [0, 1, -1]
    for k in KS:
        if k <= bits:
            raw += [2**k - 1, 2**k, 2**k + 1]
    raw += list(extra)
    out: list[tuple[str, int]] = []
    seen: set[int] = set()
    for v in raw:
        w = v % (1 << bits)
        if w not in seen:
            seen.add(w)
            out.append((f"{w:#x}", w))
    return out


def mp_int_values(extra: tuple[int, ...] = ()) -> list[tuple[str, Any]]:
    """msgpack integers at the boundaries, then wrong types and hostile encodings."""
    raw = [0, 1, -1, -(2**31) - 1, -(2**63)]
    for k in KS:
        raw += [v for v in (2**k - 1, 2**k, 2**k + 1) if v < 2**64]
    raw += [v for v in extra if -(2**63) <= v < 2**64]
    out: list[tuple[str, Any]] = []
    seen: set[int] = set()
    for v in raw:
        if v not in seen:
            seen.add(v)
            out.append((str(v), v))
    return out + [(lab, v) for lab, v in TYPES if not isinstance(v, int) or isinstance(v, bool)] + RAWS


def name_values(others: tuple[str, ...]) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = [
        ("empty", ""), ("slash", CASE_DIR + "/"), ("dot", "."), ("dotdot", ".."), ("up1", "../x"), ("up2", "../../x"),
        ("up3", "../../../x"), ("up4", "../../../../x"), ("up_canary", "../../canary/x"),
        ("up_canary_queue", "../../canary/collections/fq"), ("abs", CASE_DIR + "/abs"),
        ("abs_canary_queue", CASE_DIR + "/canary/collections/fq"), ("nul", "a\0b"), ("nul_end", "fq\0"),
        ("sub", "a/b"), ("trailing_slash", "fq/"), ("upper", "FQ"), ("long129", "x" * 129), ("long300", "x" * 300),
        ("unicode", "\u00e9"), ("space", "a b"), ("reserved_payload", "x.payload"), ("missing", "nope"),
    ]
    out += [(f"other:{o}", o) for o in others]
    return out + [(lab, v) for lab, v in TYPES if not isinstance(v, str)] + [RAWS[6]]


def bytes_values(orig: bytes, *, big: bool = True) -> list[tuple[str, bytes]]:
    out = [("empty", b""), ("one_zero", b"\0"), ("short", orig[:-1]), ("long", orig + b"\0"),
           ("ff", b"\xff" * max(1, len(orig))), ("zero", bytes(max(1, len(orig)))), ("k64-1", b"a" * 65535),
           ("k64", b"a" * 65536)]
    if big:
        out.append(("m1", b"\0" * (1 << 20)))
    return out


def magic_values(m: bytes) -> list[tuple[str, bytes]]:
    others = [b"ARMDBMT1", b"ARMSEQ01", b"ARMQUEU1", b"ARMFIXD1", b"ARMREDO1", b"ARMTXLG1", b"ARMDBBCM",
              b"ARMDBBCD", b"ARMDBBCH", b"ARMDBBCP", b"ARMHWM01"]
    out = [("zero", bytes(8)), ("foreign", b"XXXXXXXX"), ("last_bit", m[:-1] + bytes([m[-1] ^ 1])),
           ("torn_prefix", m[:5] + bytes(3)), ("ff", b"\xff" * 8)]
    out += [(f"as:{o.decode()}", o) for o in others if o != m]
    return out


def _dedupe(vals: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    seen: set[str] = set()
    out = []
    for lab, v in vals:
        if lab not in seen:
            seen.add(lab)
            out.append((lab, v))
    return out


# ---------------------------------------------------------------------------------------------
# Small codecs
# ---------------------------------------------------------------------------------------------

_U32 = struct.Struct("<I")


def _crc(b: bytes | bytearray) -> int:
    return zlib.crc32(b) & 0xFFFFFFFF


def _read(root: str, rel: str) -> bytes:
    with open(os.path.join(root, rel), "rb") as f:
        return f.read()


def _files(root: str) -> list[str]:
    out = []
    for dirpath, _dirs, names in os.walk(root):
        for fn in names:
            if fn != "LOCK":
                out.append(os.path.relpath(os.path.join(dirpath, fn), root))
    return sorted(out)


def _framed(magic: bytes, version: int, body: bytes, n: int | None = None) -> bytes:
    """The frame of seqmap and queue.meta: magic, u32 version, u32 length, body, CRC."""
    raw = magic + struct.pack("<II", version, len(body) if n is None else n) + body
    return raw + _U32.pack(_crc(raw))


def _hwm(magic: bytes, gen: int, mark: int) -> bytes:
    body = struct.pack("<8sQQ", magic, gen, mark)
    return body + _U32.pack(_crc(body))


@dataclass
class BcRecord:
    off: int
    size: int  # padded size
    gsn_word: int
    key_field: bytes
    value_field: bytes


def parse_bitcask(raw: bytes) -> list[BcRecord]:
    out = []
    pos = bitcask.DATA_START
    while pos + bitcask.REC_HEAD_SIZE <= len(raw):
        gw, _crc_, vlen, magic, klen = bitcask.REC_HEAD.unpack_from(raw, pos)
        if magic != bitcask.RECORD_MAGIC:
            break
        n = bitcask.REC_HEAD_SIZE + klen + vlen
        if pos + n > len(raw):
            break
        k = raw[pos + 20 : pos + 20 + klen]
        v = raw[pos + 20 + klen : pos + n]
        size = n + (-n % 8)
        out.append(BcRecord(pos, size, gw, k, v))
        pos += size
    return out


def encode_bitcask_record(gsn_word: int, key_field: bytes, value_field: bytes, *, magic: int = bitcask.RECORD_MAGIC,
                          klen: int | None = None, vlen: int | None = None, pad: bytes | None = None) -> bytes:
    kl = len(key_field) if klen is None else klen
    vl = len(value_field) if vlen is None else vlen
    head = struct.pack("<QIIHH", gsn_word & 0xFFFFFFFFFFFFFFFF, 0, vl & 0xFFFFFFFF, magic, kl & 0xFFFF)
    rec = bytearray(head + key_field + value_field)
    n = len(rec)
    rec += (pad if pad is not None else bytes(-n % 8))[: -n % 8] if -n % 8 else b""
    return bytes(rec)


def _reseal_bitcask_crc(buf: bytearray, off: int) -> None:
    """Recompute the CRC of the record at ``off`` from its stated lengths (clipped at the end)."""
    _gw, _c, vlen, _m, klen = bitcask.REC_HEAD.unpack_from(buf, off)
    end = min(len(buf), off + 20 + klen + vlen)
    crc = zlib.crc32(bytes(buf[off + 12 : end]), zlib.crc32(bytes(buf[off : off + 8])))
    struct.pack_into("<I", buf, off + 8, crc & 0xFFFFFFFF)


def coll_of(rel: str) -> str:
    parts = rel.split(os.sep)
    return parts[1]


def salt_of(root: str, coll: str) -> tuple[bytes, bool]:
    raw = _read(root, os.path.join("collections", coll, bitcask.META_NAME))
    _m, _v, flags, _sc, salt, _cl = bitcask.META_HEAD.unpack_from(raw)
    return salt, bool(flags & bitcask.FLAG_ENCRYPTED)


_SEALER = Sealer(KEY)
_LOG_SEALER = Sealer(LOG_KEY)


def _aad(salt: bytes, tag: bytes, gsn_word: int) -> bytes:
    return salt + tag + struct.pack("<Q", gsn_word & 0xFFFFFFFFFFFFFFFF)


# ---------------------------------------------------------------------------------------------
# Golden context (decoded once per golden and cached)
# ---------------------------------------------------------------------------------------------


@dataclass
class GoldenInfo:
    name: str
    root: str
    files: list[str]
    queues: dict[str, bool]  # queue name -> var
    maps: list[str]
    log_rel: str
    log_template: list[tuple[int, int, list[Any]]]  # (txid, flags, rows) appended/kept in the log
    collections: tuple[str, ...]
    log_version: int = 1  # the log file's format version (how its sealed bodies are bound)
    db_id: bytes = b""  # the database id of db.meta (format 2), part of a sealed body's AAD


_INFO: dict[str, GoldenInfo] = {}


def golden_info(name: str, root: str, queues: dict[str, bool], maps: list[str]) -> GoldenInfo:
    key = root
    if key in _INFO:
        return _INFO[key]
    files = _files(root)
    logs = sorted(f for f in files if f.startswith("txlog" + os.sep) and f.endswith(".log"))
    log_rel = logs[-1]
    raw = _read(root, log_rel)
    log_version = struct.unpack_from("<I", raw, 8)[0]
    parts = _db_meta_parts(_read(root, "db.meta"))
    db_id = parts[3] if parts is not None else b""
    recs = txlog.parse_records(raw, txlog.RECORDS_START)[0]
    template: list[tuple[int, int, list[Any]]] = []
    for txid, flags, body in recs:
        plain = _LOG_SEALER.open(body, _log_aad(log_version, db_id, txid)) if flags & txlog.FLAG_SEALED else body
        template.append((txid, flags, msgpack.unpackb(plain, raw=False)))
    if not template:
        template = [_synth_record(root, files, queues, maps)]
    colls = tuple(sorted(os.listdir(os.path.join(root, "collections"))))
    info = GoldenInfo(name, root, files, queues, maps, log_rel, template, colls, log_version, db_id)
    _INFO[key] = info
    return info


def _max_gsn(root: str, files: list[str]) -> int:
    best = 0
    for rel in files:
        if rel.endswith(".data") and "shard-" in rel and not rel.endswith("fixed.data"):
            for r in parse_bitcask(_read(root, rel)):
                best = max(best, r.gsn_word & bitcask.SEQ_MASK)
    return best


def _fixed_files(files: list[str]) -> list[str]:
    return [f for f in files if f.endswith("fixed.data")]


def _geometry(raw: bytes) -> tuple[int, int, int]:
    slot_size, key_size, value_size, _sh = _fixed.decode_header(raw[: _fixed.HEADER_PAGE], "golden")
    return slot_size, key_size, value_size


def _occupied_slots(raw: bytes) -> list[int]:
    slot_size, _k, _v = _geometry(raw)
    n = (len(raw) - _fixed.HEADER_PAGE) // slot_size
    out = []
    for i in range(n):
        off = _fixed.HEADER_PAGE + i * slot_size
        meta = _U32.unpack_from(raw, off)[0]
        if meta & 3 == 1:
            out.append(i)
    return out


def _first_free(raw: bytes) -> int:
    slot_size, _k, _v = _geometry(raw)
    n = (len(raw) - _fixed.HEADER_PAGE) // slot_size
    for i in range(n):
        off = _fixed.HEADER_PAGE + i * slot_size
        if not any(raw[off : off + slot_size]):
            return i
    return n - 1


def _synth_record(root: str, files: list[str], queues: dict[str, bool], maps: list[str]) -> tuple[int, int, list[Any]]:
    """A valid commit record for a golden whose log is empty: a slot update of a live row
    (F), and for a var queue or a map a Bitcask row (B) with a gsn above every stored one."""
    rows: list[Any] = []
    encrypted_log = False
    for q, var in queues.items():
        rel = next(f for f in _fixed_files(files) if f.split(os.sep)[1] == q)
        raw = _read(root, rel)
        slot_size, key_size, value_size = _geometry(raw)
        s = _occupied_slots(raw)[0]
        off = _fixed.HEADER_PAGE + s * slot_size
        version = _U32.unpack_from(raw, off)[0] >> 2
        body = raw[off + 8 : off + 8 + key_size + value_size]
        rows.append(["F", q, 0, s, (version + 1) % (1 << 30) or 1, 1, body])
        if var:
            seq = int.from_bytes(body[8:16], "big")
            key = seq.to_bytes(8, "big")
            pcoll = q + ".payload"
            salt, enc = salt_of(root, pcoll)
            encrypted_log = encrypted_log or enc
            value = msgpack.packb(b"x", use_bin_type=True)
            for f in files:
                if f.startswith(os.path.join("collections", pcoll)) and f.endswith(".data"):
                    for r in parse_bitcask(_read(root, f)):
                        kf, vf = r.key_field, r.value_field
                        if enc:
                            kf = _SEALER.open(kf, _aad(salt, b"K", r.gsn_word))
                            vf = _SEALER.open(vf, _aad(salt, b"V", r.gsn_word)) if vf else vf
                        if kf == key and not r.gsn_word & bitcask.TOMBSTONE:
                            value = vf
            rows.append(["B", pcoll, key, value, _max_gsn(root, files) + 1])
    for m in maps:
        rows.append(["B", m, b"bk001", msgpack.packb(b"v" * 40, use_bin_type=True), _max_gsn(root, files) + 1])
    return (1, txlog.FLAG_SEALED if encrypted_log else 0, rows)


def _encode_log_record(txid: int, flags: int, body: bytes, *, magic: int = txlog.REC_MAGIC,
                       body_len: int | None = None) -> bytes:
    bl = len(body) if body_len is None else body_len
    head = struct.pack("<IIQI", magic & 0xFFFFFFFF, flags & 0xFFFFFFFF, txid & 0xFFFFFFFFFFFFFFFF, bl & 0xFFFFFFFF)
    rec = bytearray(head + b"\0\0\0\0" + body)
    rec += bytes(-len(rec) % 8)
    return bytes(rec)


def _log_file(info: GoldenInfo, header: bytes | None, records: list[bytes]) -> bytes:
    raw = _read(info.root, info.log_rel)
    head = raw[: txlog.RECORDS_START] if header is None else header
    return head + b"".join(records)


def _seal_log_crcs(buf: bytearray) -> None:
    """Recompute the CRC of every record in a log file (stated lengths, clipped)."""
    pos = txlog.RECORDS_START
    while pos + txlog.REC_HEAD_SIZE <= len(buf):
        _m, _f, _t, bl = struct.unpack_from("<IIQI", buf, pos)
        end = min(len(buf), pos + 24 + bl)
        crc = zlib.crc32(bytes(buf[pos + 24 : end]), zlib.crc32(bytes(buf[pos : pos + 20])))
        struct.pack_into("<I", buf, pos + 20, crc & 0xFFFFFFFF)
        nxt = pos + 24 + bl
        nxt += -nxt % 8
        if nxt <= pos or nxt > len(buf):
            break
        pos = nxt


# ---------------------------------------------------------------------------------------------
# Crafters: targets(info) -> [target]; values(info, target, field) -> [(label, value)];
# apply(info, target, field, value) -> {rel: bytes}
# ---------------------------------------------------------------------------------------------


class Crafter:
    kind = ""

    def targets(self, info: GoldenInfo) -> list[str]:
        raise NotImplementedError

    def fields_for(self, info: GoldenInfo, target: str) -> tuple[str, ...]:
        return FIELDS[self.kind]

    def values(self, info: GoldenInfo, target: str, field: str) -> list[tuple[str, Any]]:
        raise NotImplementedError

    def apply(self, info: GoldenInfo, target: str, field: str, value: Any) -> dict[str, bytes]:
        raise NotImplementedError


def _split(target: str) -> tuple[str, int]:
    rel, _, idx = target.partition("#")
    return rel, int(idx) if idx else -1


def _db_meta_parts(raw: bytes) -> tuple[bytes, int, bytes, bytes, bytes] | None:
    """``(magic, version, ident magic, db id, log key check)`` of a format 2 ``db.meta``
    (16-byte head and CRC, then ``ident magic (8) | db id (16) | u32 n | check (n) | CRC``)."""
    if len(raw) < 16 + 28 + 4:
        return None
    magic, version = struct.unpack_from("<8sI", raw)
    imagic, db_id, n = struct.unpack_from("<8s16sI", raw, 16)
    return magic, version, imagic, db_id, raw[44 : 44 + n]


class DbMeta(Crafter):
    kind = "db_meta"

    def targets(self, info: GoldenInfo) -> list[str]:
        return ["db.meta"]

    def fields_for(self, info: GoldenInfo, target: str) -> tuple[str, ...]:
        has_ident = _db_meta_parts(_read(info.root, target)) is not None
        return FIELDS[self.kind] if has_ident else ("magic", "version")

    def values(self, info: GoldenInfo, target: str, field: str) -> list[tuple[str, Any]]:
        parts = _db_meta_parts(_read(info.root, target))
        if field == "magic":
            return magic_values(b"ARMDBMT1")
        if field == "ident_magic":
            return magic_values(b"ARMDBID1")
        if field == "db_id":
            assert parts is not None
            d = parts[3]
            return [("zero", bytes(16)), ("ff", b"\xff" * 16), ("flipped", bytes([d[0] ^ 1]) + d[1:]), ("short", d[:15]),
                    ("long", d + b"\0")]
        if field == "log_key_check":
            assert parts is not None
            c = parts[4]
            other = Sealer(KEY).key_check()  # a valid check value of another key
            return [("empty", b""), ("zero58", bytes(58)), ("other_key", other), ("one", b"\1"),
                    ("flipped", (bytes([c[0] ^ 1]) + c[1:]) if c else b"\1" * 58)]
        return int_values(32, (2, 3))

    def apply(self, info: GoldenInfo, target: str, field: str, value: Any) -> dict[str, bytes]:
        raw = _read(info.root, target)
        magic, version = struct.unpack_from("<8sI", raw)
        if field == "magic":
            magic = value
        elif field == "version":
            version = value
        head = struct.pack("<8sI", magic, version)
        out = head + _U32.pack(_crc(head))
        parts = _db_meta_parts(raw)
        if parts is not None:
            _m, _v, imagic, db_id, check = parts
            n = None
            if field == "ident_magic":
                imagic = value
            elif field == "db_id":
                db_id = value
            elif field == "check_len":
                n = value
            elif field == "log_key_check":
                check = value
            ident = imagic + db_id + _U32.pack(len(check) if n is None else n) + check
            out += ident + _U32.pack(_crc(ident))
        return {target: out}


class Framed(Crafter):
    """seqmap and queue.meta: magic, u32 version, u32 length, msgpack map body, CRC."""

    magic = b""

    def _decode(self, raw: bytes) -> tuple[int, dict[Any, Any]]:
        version, n = struct.unpack_from("<II", raw, 8)
        return version, msgpack.unpackb(raw[16 : 16 + n], raw=False)

    def values(self, info: GoldenInfo, target: str, field: str) -> list[tuple[str, Any]]:
        raw = _read(info.root, target)
        _v, body = self._decode(raw)
        n = len(raw) - 20
        if field == "magic":
            return magic_values(self.magic)
        if field == "version":
            return int_values(32)
        if field == "length":
            return int_values(32, (n - 1, n + 1, n + 4, len(raw), len(raw) + 1))
        if field == "body":
            return [*TYPES, *RAWS, ("empty", Raw(b"")), ("list_of_map", [body])]
        return self.values_of(body, field)

    def values_of(self, body: dict[Any, Any], field: str) -> list[tuple[str, Any]]:
        raise NotImplementedError

    def apply(self, info: GoldenInfo, target: str, field: str, value: Any) -> dict[str, bytes]:
        raw = _read(info.root, target)
        version, body = self._decode(raw)
        magic, n = self.magic, None
        new_body: Any = dict(body)
        if field == "magic":
            magic = value
        elif field == "version":
            version = value
        elif field == "length":
            n = value
        elif field == "body":
            new_body = value
        else:
            new_body = self.set_in(new_body, field, value)
        return {target: _framed(magic, version, mp(new_body), n)}

    def set_in(self, body: dict[Any, Any], field: str, value: Any) -> Any:
        raise NotImplementedError


class QueueMeta(Framed):
    kind = "queue_meta"
    magic = b"ARMQUEU1"

    def targets(self, info: GoldenInfo) -> list[str]:
        return [f for f in info.files if f.endswith("queue.meta")]

    def values_of(self, body: dict[Any, Any], field: str) -> list[tuple[str, Any]]:
        if field == "var":
            return [("flipped", not body["var"]), *mp_int_values()[:8], *TYPES]
        if field == "fingerprint":
            fp = body["fingerprint"]
            return [("other_kind", "fixed:x" if fp.startswith("var") else "var:<class 'bytes'>"), ("empty", ""),
                    ("long1m", "x" * (1 << 20)), *name_values(()), *TYPES]
        if field in ("shard_count", "key_size", "value_size"):
            v = int(body[field])
            return mp_int_values((v - 1, v + 1, 2 * v, 2000, 4096, 1 << 20))
        if field == "missing":
            return [(k, k) for k in body]
        if field == "extra":
            return [("str_key", ("zz", 1)), ("int_key", (5, 1)), ("nil_key", (None, 1)), ("bin_key", (b"k", 1)),
                    ("dup_var", ("var", 7))]
        raise KeyError(field)

    def set_in(self, body: dict[Any, Any], field: str, value: Any) -> Any:
        if field == "missing":
            body.pop(value, None)
        elif field == "extra":
            k, v = value
            if k == "var":  # a second "var" entry: splice the raw map with a duplicate key
                items = list(body.items()) + [("var", v)]
                return Raw(bytes([0x80 | len(items)]) + b"".join(mp(a) + mp(b) for a, b in items))
            body[k] = v
        else:
            body[field] = value
        return body


class SeqMapKind(Framed):
    kind = "seqmap"
    magic = b"ARMSEQ01"

    def targets(self, info: GoldenInfo) -> list[str]:
        if "seqmap" not in info.files:
            return []
        _v, body = self._decode(_read(info.root, "seqmap"))
        return ["seqmap"] + [f"seqmap#{i}" for i in range(len(body))]

    def fields_for(self, info: GoldenInfo, target: str) -> tuple[str, ...]:
        if "#" in target:
            return ("value", "name")
        return ("magic", "version", "length", "body", "extra")

    def values(self, info: GoldenInfo, target: str, field: str) -> list[tuple[str, Any]]:
        rel, idx = _split(target)
        raw = _read(info.root, rel)
        _v, body = self._decode(raw)
        if field == "value":
            v = int(list(body.values())[idx])
            return mp_int_values((v - 1, v + 1, 2**60 - 1, 2**60, 2**64 - 2))
        if field == "name":
            return [("q_up", "q:../../x"), ("q_abs", "q:" + CASE_DIR + "/abs"), ("q_missing", "q:nope"),
                    ("q_nul", "q:a\0b"), ("empty", ""), ("int_key", 5), ("nil_key", None), ("bin_key", b"gsn"),
                    ("float_key", 1.5), ("long", "q:" + "x" * 300)]
        if field == "extra":
            return [("q_up_big", ("q:../../x", 2**63)), ("int_key", (7, 1)), ("bin_gsn", (b"gsn", 2**62)),
                    ("list_value", ("q:zz", [1])), ("many", ("many", None))]
        return super().values(info, rel, field)

    def apply(self, info: GoldenInfo, target: str, field: str, value: Any) -> dict[str, bytes]:
        rel, idx = _split(target)
        raw = _read(info.root, rel)
        version, body = self._decode(raw)
        if field in ("value", "name"):
            items = list(body.items())
            k, v = items[idx]
            items[idx] = (k, value) if field == "value" else (value, v)
            b = Raw(bytes([0x80 | len(items)]) + b"".join(mp(a) + mp(c) for a, c in items))
            return {rel: _framed(self.magic, version, mp(b))}
        if field == "extra":
            k, v = value
            if k == "many":  # 50,000 names: a reserved_end per name, each read at open
                d = dict(body)
                d.update({f"q:n{i}": 2**40 + i for i in range(50_000)})
                return {rel: _framed(self.magic, version, mp(d))}
            items = list(body.items()) + [(k, v)]
            b = Raw(bytes([0x80 | len(items)]) + b"".join(mp(a) + mp(c) for a, c in items))
            return {rel: _framed(self.magic, version, mp(b))}
        return super().apply(info, rel, field, value)


class CollectionMeta(Crafter):
    kind = "collection_meta"

    def targets(self, info: GoldenInfo) -> list[str]:
        return [f for f in info.files if f.endswith(bitcask.META_NAME)]

    def values(self, info: GoldenInfo, target: str, field: str) -> list[tuple[str, Any]]:
        raw = _read(info.root, target)
        _m, _v, flags, sc, salt, cl = bitcask.META_HEAD.unpack_from(raw)
        check = raw[bitcask.META_HEAD.size : bitcask.META_HEAD.size + cl]
        if field == "magic":
            return magic_values(bitcask.META_MAGIC)
        if field in ("version", "flags", "check_len"):
            return int_values(16, (cl + 1, cl - 1, len(raw)) if field == "check_len" else (2, 3))
        if field == "shard_count":
            return int_values(32, (sc + 1, 2000, 4096, 1 << 20))
        if field == "salt":
            return [("zero", bytes(16)), ("ff", b"\xff" * 16), ("flipped", bytes([salt[0] ^ 1]) + salt[1:])]
        if field == "check":
            other = _SEALER.seal(b"not the key check constant....", b"armdb.kcv")
            return [("empty", b""), ("zero58", bytes(58)), ("sealed_other", other),
                    ("flipped", (bytes([check[0] ^ 1]) + check[1:]) if check else b"\x01"), ("k64-1", b"a" * 65535)]
        raise KeyError(field)

    def apply(self, info: GoldenInfo, target: str, field: str, value: Any) -> dict[str, bytes]:
        raw = _read(info.root, target)
        m, v, flags, sc, salt, cl = bitcask.META_HEAD.unpack_from(raw)
        check = raw[bitcask.META_HEAD.size : bitcask.META_HEAD.size + cl]
        stated = None
        if field == "magic":
            m = value
        elif field == "version":
            v = value
        elif field == "flags":
            flags = value
        elif field == "shard_count":
            sc = value
        elif field == "salt":
            salt = value
        elif field == "check_len":
            stated = value
        elif field == "check":
            check = value
        body = bitcask.META_HEAD.pack(m, v, flags, sc, salt, len(check) if stated is None else stated) + check
        return {target: body + _U32.pack(_crc(body))}


class FixedHeader(Crafter):
    kind = "fixed_header"

    def targets(self, info: GoldenInfo) -> list[str]:
        return _fixed_files(info.files)

    def values(self, info: GoldenInfo, target: str, field: str) -> list[tuple[str, Any]]:
        raw = _read(info.root, target)
        ss, ks, vs = _geometry(raw)
        if field in ("magic", "hwm_magic"):
            return magic_values(_fixed.MAGIC if field == "magic" else _fixed.HWM_MAGIC)
        if field in ("version", "shard"):
            return int_values(32, (2,))
        if field in ("slot_size", "key_size", "value_size"):
            v = {"slot_size": ss, "key_size": ks, "value_size": vs}[field]
            return int_values(32, (v - 1, v + 1, 2 * v, v // 2, 4096, 1 << 20))
        cap = (len(raw) - _fixed.HEADER_PAGE) // ss
        if field == "hwm_generation":
            return int_values(64, (2, 3))
        if field == "hwm_mark":
            occ = len(_occupied_slots(raw))
            return int_values(64, (occ + 1, cap, cap + 1, cap * 1000))
        raise KeyError(field)

    def apply(self, info: GoldenInfo, target: str, field: str, value: Any) -> dict[str, bytes]:
        b = bytearray(_read(info.root, target))
        if field.startswith("hwm_"):
            redo = _read(info.root, os.path.join(os.path.dirname(target), _fixed.REDO_NAME))
            gen, mark = _fixed.read_hwm(bytes(b[: _fixed.HEADER_PAGE]), redo[:64])
            magic = _fixed.HWM_MAGIC
            gen = gen + 1 if gen % 2 == 0 else gen + 2  # copy A holds odd generations: make it the newest
            if field == "hwm_magic":
                magic = value
            elif field == "hwm_generation":
                gen = value
            else:
                mark = value
            b[512:540] = _hwm(magic, gen, mark)
            return {target: bytes(b)}
        if field == "magic":
            b[0:8] = value
        else:
            off = {"version": 8, "slot_size": 12, "key_size": 16, "value_size": 20, "shard": 24}[field]
            struct.pack_into("<I", b, off, value)
        struct.pack_into("<I", b, 28, _crc(b[:28]))
        return {target: bytes(b)}


# slot offsets of the queue row fields (docs/format.md "Queue rows"): (offset, size, big-endian, signed)
_SLOT_LAYOUT = {
    "due": (8, 8, True), "seq": (16, 8, True), "state": (24, 1, False), "flags": (25, 1, False),
    "attempts": (26, 2, False), "epoch": (28, 4, False), "deadline": (32, 8, False),
    "payload_id": (40, 8, False), "pushed": (48, 8, False),
}


def _slot_values(raw: bytes, slot: int, field: str, seqmap_end: int, other_seqs: list[int]) -> list[tuple[str, Any]]:
    ss, ks, vs = _geometry(raw)
    off = _fixed.HEADER_PAGE + slot * ss
    s = raw[off : off + ss]
    if field == "status":
        return [(str(v), v) for v in range(4)]
    if field == "version":
        v = _U32.unpack_from(s, 0)[0] >> 2
        return int_values(30, (v - 1, v + 1, v + 2**29, v - 2**29, v + 2**29 + 1))
    if field == "payload":
        n = 8 + ks + vs - 56
        if n <= 0:
            return []
        return [("zero", bytes(n)), ("ff", b"\xff" * n), ("flipped", bytes([s[56] ^ 1]) + s[57 : 56 + n])]
    if field == "pad":
        n = ss - (8 + ks + vs)
        if n <= 0:
            return []
        return [("ff", b"\xff" * n), ("one", b"\x01" + bytes(n - 1))]
    o, size, _be = _SLOT_LAYOUT[field]
    cur = int.from_bytes(s[o : o + size], "big" if _be else "little")
    extra: tuple[int, ...] = (cur - 1, cur + 1)
    if field in ("seq", "payload_id"):
        extra += (seqmap_end - 1, seqmap_end, seqmap_end + 1, *other_seqs[:3])
    if field == "due":
        extra += (1 << 63 | cur, (1 << 63) - 1)
    if field == "deadline":
        extra += (-(2**63), 2**63 - 1)
    return int_values(8 * size, extra)


def _set_slot_field(s: bytearray, field: str, value: Any) -> None:
    if field == "status":
        meta = _U32.unpack_from(s, 0)[0]
        struct.pack_into("<I", s, 0, (meta & ~3) | value)
    elif field == "version":
        meta = _U32.unpack_from(s, 0)[0]
        struct.pack_into("<I", s, 0, ((value << 2) | (meta & 3)) & 0xFFFFFFFF)
    elif field in ("payload", "pad"):
        start = 56 if field == "payload" else len(s) - len(value)
        s[start : start + len(value)] = value
    else:
        o, size, be = _SLOT_LAYOUT[field]
        s[o : o + size] = value.to_bytes(size, "big" if be else "little")
    struct.pack_into("<I", s, 4, _crc(bytes(s[0:4]) + bytes(s[8:])))


def _seqmap_info(info: GoldenInfo, rel: str) -> int:
    if "seqmap" not in info.files:
        return 1
    raw = _read(info.root, "seqmap")
    n = struct.unpack_from("<I", raw, 12)[0]
    d = msgpack.unpackb(raw[16 : 16 + n], raw=False)
    return int(d.get("q:" + rel.split(os.sep)[1], 1))


def _seqs(raw: bytes) -> list[int]:
    ss, _k, _v = _geometry(raw)
    return [int.from_bytes(raw[_fixed.HEADER_PAGE + i * ss + 16 : _fixed.HEADER_PAGE + i * ss + 24], "big")
            for i in _occupied_slots(raw)]


class FixedSlot(Crafter):
    kind = "fixed_slot"

    def targets(self, info: GoldenInfo) -> list[str]:
        out = []
        for rel in _fixed_files(info.files):
            raw = _read(info.root, rel)
            out += [f"{rel}#{i}" for i in _occupied_slots(raw)]
            out.append(f"{rel}#free")
        return out

    def fields_for(self, info: GoldenInfo, target: str) -> tuple[str, ...]:
        rel, _ = target.split("#")
        ss, ks, vs = _geometry(_read(info.root, rel))
        out = [f for f in _SLOT_FIELDS if not (f == "payload" and 8 + ks + vs <= 56) and not (f == "pad" and ss == 8 + ks + vs)]
        return tuple(out)

    def _slot(self, info: GoldenInfo, target: str) -> tuple[str, int, bool]:
        rel, idx = target.split("#")
        raw = _read(info.root, rel)
        if idx == "free":
            return rel, _first_free(raw), True
        return rel, int(idx), False

    def values(self, info: GoldenInfo, target: str, field: str) -> list[tuple[str, Any]]:
        rel, slot, free = self._slot(info, target)
        raw = _read(info.root, rel)
        src = _occupied_slots(raw)[0] if free else slot
        seqs = _seqs(raw)
        return _slot_values(raw, src, field, _seqmap_info(info, rel), [x for x in seqs if x != seqs[0]] + seqs[:1])

    def apply(self, info: GoldenInfo, target: str, field: str, value: Any) -> dict[str, bytes]:
        rel, slot, free = self._slot(info, target)
        b = bytearray(_read(info.root, rel))
        ss, _k, _v = _geometry(b)
        src = _occupied_slots(bytes(b))[0] if free else slot
        s = bytearray(b[_fixed.HEADER_PAGE + src * ss : _fixed.HEADER_PAGE + (src + 1) * ss])
        _set_slot_field(s, field, value)
        off = _fixed.HEADER_PAGE + slot * ss
        b[off : off + ss] = s
        return {rel: bytes(b)}


class Redo(Crafter):
    kind = "redo"

    def targets(self, info: GoldenInfo) -> list[str]:
        return [f for f in info.files if f.endswith(_fixed.REDO_NAME)]

    def _base(self, info: GoldenInfo, target: str) -> tuple[bytes, bytes, int, int]:
        redo = _read(info.root, target)
        data_rel = os.path.join(os.path.dirname(target), _fixed.FILE_NAME)
        data = _read(info.root, data_rel)
        ss, _k, _v = _geometry(data)
        rec = struct.unpack_from("<IIII", redo, 64) if len(redo) >= 80 else (0, 0, 0, 0)
        slot = rec[1] if rec[0] == 0x4F444552 and rec[1] in _occupied_slots(data) else _occupied_slots(data)[0]
        return redo, data, ss, slot

    def values(self, info: GoldenInfo, target: str, field: str) -> list[tuple[str, Any]]:
        redo, data, ss, slot = self._base(info, target)
        cap = (len(data) - _fixed.HEADER_PAGE) // ss
        if field in ("magic", "hwm_magic"):
            return magic_values(_fixed.REDO_MAGIC if field == "magic" else _fixed.HWM_MAGIC)
        if field in ("version", "rec_magic"):
            return int_values(32, (2, 0x4F444552 ^ 1))
        if field in ("slot_size", "rec_length"):
            return int_values(32, (ss - 1, ss + 1, 2 * ss, len(redo)))
        if field == "hwm_generation":
            return int_values(64, (2, 4))
        if field == "hwm_mark":
            return int_values(64, (cap, cap + 1, cap * 1000))
        if field == "rec_slot":
            return int_values(32, (cap - 1, cap, cap + 1, *[s for s in _occupied_slots(data) if s != slot][:2]))
        sub = field.split(".", 1)[1]
        return _slot_values(data, slot, sub, _seqmap_info(info, target), _seqs(data))

    def apply(self, info: GoldenInfo, target: str, field: str, value: Any) -> dict[str, bytes]:
        redo, data, ss, slot = self._base(info, target)
        r = bytearray(redo)
        out: dict[str, bytes] = {}
        if field in ("magic", "version", "slot_size"):
            if field == "magic":
                r[0:8] = value
            else:
                struct.pack_into("<I", r, 8 if field == "version" else 12, value)
            struct.pack_into("<I", r, 16, _crc(r[:16]))
            out[target] = bytes(r)
            return out
        if field.startswith("hwm_"):
            gen, mark = _fixed.read_hwm(data[: _fixed.HEADER_PAGE], redo[:64])
            magic = _fixed.HWM_MAGIC
            gen = gen + 1 if gen % 2 == 1 else gen + 2  # copy B holds even generations
            if field == "hwm_magic":
                magic = value
            elif field == "hwm_generation":
                gen = value
            else:
                mark = value
            r[32:60] = _hwm(magic, gen, mark)
            out[target] = bytes(r)
            return out
        # The record: rebuilt from the slot it names, then the named slot is torn in
        # fixed.data (its CRC broken), so that open restores the crafted image.
        off = _fixed.HEADER_PAGE + slot * ss
        image = bytearray(data[off : off + ss])
        rec_magic, rec_slot, rec_len = 0x4F444552, slot, ss
        if field == "rec_magic":
            rec_magic = value
        elif field == "rec_slot":
            rec_slot = value
        elif field == "rec_length":
            rec_len = value
        else:
            _set_slot_field(image, field.split(".", 1)[1], value)
        head = struct.pack("<III", rec_magic, rec_slot, rec_len)
        crc = _crc(head + bytes(image[:8]))
        need = 80 + ss
        if len(r) < need:
            r += bytes(need - len(r))
        r[64:80] = head + _U32.pack(crc)
        r[80 : 80 + ss] = image
        d = bytearray(data)
        d[off + 4] ^= 0xFF  # tear the slot: its stored CRC no longer matches
        out[target] = bytes(r)
        out[os.path.join(os.path.dirname(target), _fixed.FILE_NAME)] = bytes(d)
        return out


def _bitcask_files(info: GoldenInfo, ext: str) -> list[str]:
    return [f for f in info.files if f.endswith(ext) and "shard-" in f and not f.endswith("fixed.data")]


class FileHead(Crafter):
    ext = ".data"
    magic = bitcask.DATA_MAGIC

    def targets(self, info: GoldenInfo) -> list[str]:
        return _bitcask_files(info, self.ext)

    def values(self, info: GoldenInfo, target: str, field: str) -> list[tuple[str, Any]]:
        raw = _read(info.root, target)
        _m, _v, _fl, fid, base, nonce, _c = bitcask.FILE_HEAD.unpack_from(raw)
        if field == "magic":
            return magic_values(self.magic)
        if field in ("version", "flags"):
            return int_values(16, (2, 3))
        if field == "file_id":
            others = [int(os.path.basename(f)[:8]) for f in _bitcask_files(info, ".data") if os.path.dirname(f) == os.path.dirname(target)]
            return int_values(32, (fid - 1, fid + 1, *others))
        if field == "base_gsn":
            return int_values(64, (2**60 - 1, 2**60, base + 1))
        if field == "nonce":
            return int_values(32, (nonce ^ 1,))
        raise KeyError(field)

    def apply(self, info: GoldenInfo, target: str, field: str, value: Any) -> dict[str, bytes]:
        b = bytearray(_read(info.root, target))
        vals = list(bitcask.FILE_HEAD.unpack_from(b))
        i = {"magic": 0, "version": 1, "flags": 2, "file_id": 3, "base_gsn": 4, "nonce": 5}[field]
        vals[i] = value
        head = bitcask.FILE_HEAD.pack(*vals[:6], 0)[:28]
        b[0:32] = head + _U32.pack(_crc(head))
        return {target: bytes(b)}


class BitcaskHeader(FileHead):
    kind = "bitcask_header"


class HintHeader(FileHead):
    kind = "hint_header"
    ext = ".hint"
    magic = bitcask.HINT_MAGIC


# A bad tail after the last valid record (harness field "tail"): a torn-looking record
# followed by candidates at every 32 bytes, each a plausible head whose stated length runs
# to the end of the file and whose CRC is wrong.  Deciding "torn tail or corruption" must
# take linear time: CRC-checking every candidate to the end is quadratic (a 1 MiB file
# took 9.8 s), past the hang bound.
TAILS: list[tuple[str, int]] = [("candidates_64k", 64 << 10), ("candidates_1m", 1 << 20), ("candidates_2m", 2 << 20)]


def _log_tail(start: int, size: int) -> bytes:
    out = bytearray(size)
    end = start + size
    for p in range(0, size - 32, 32):
        struct.pack_into("<IIQII", out, p, txlog.REC_MAGIC, 0, 1, end - (start + p) - 24, 0)
    return bytes(out)


def _bitcask_tail(start: int, size: int, encrypted: bool) -> bytes:
    out = bytearray(size)
    end = start + size
    klen = 28 if encrypted else 8
    for p in range(0, size - 64, 32):
        vlen = end - (start + p) - 20 - klen
        struct.pack_into("<QIIHH", out, p, 1, 0, vlen, bitcask.RECORD_MAGIC, klen)
    return bytes(out)


def _is_active(info: GoldenInfo, rel: str) -> bool:
    """The newest data file of its shard that is not a compaction output."""
    d = os.path.dirname(rel)
    fids = []
    for f in _bitcask_files(info, ".data"):
        if os.path.dirname(f) == d:
            flags = bitcask.FILE_HEAD.unpack_from(_read(info.root, f))[2]
            if not flags & bitcask.FLAG_COMPACTED:
                fids.append(f)
    return bool(fids) and max(fids) == rel


def _plain_key_values(coll: str, orig: bytes, others: list[bytes]) -> list[tuple[str, bytes]]:
    if coll.endswith(".payload"):
        extra = [("id0", bytes(8)), ("idmax", b"\xff" * 8), ("id7", orig[:7]), ("id9", orig + b"\0")]
    else:
        extra = [("tag_unknown", b"x" + orig[1:]), ("str_bad_utf8", b"s\xff\xfe"), ("int_huge", b"i" + b"\x7f" * 300),
                 ("tag_only", orig[:1]), ("str_nul", b"sa\0b")]
    extra += [(f"dup{i}", o) for i, o in enumerate(others[:2])]
    return _dedupe(extra + bytes_values(orig, big=False))


def _plain_value_values(orig: bytes) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = [(lab, r.b) for lab, r in RAWS]
    out += [(f"mp_{lab}", mp(v)) for lab, v in TYPES]
    out += [("tombstone_like", b"")]
    return _dedupe(out + bytes_values(orig))


class BitcaskRecord(Crafter):
    kind = "bitcask_record"

    def targets(self, info: GoldenInfo) -> list[str]:
        out = []
        for rel in _bitcask_files(info, ".data"):
            out += [f"{rel}#{i}" for i in range(len(parse_bitcask(_read(info.root, rel))))]
        return out

    def _ctx(self, info: GoldenInfo, target: str) -> tuple[str, bytes, list[BcRecord], int, bytes, bool]:
        rel, idx = _split(target)
        raw = _read(info.root, rel)
        recs = parse_bitcask(raw)
        salt, enc = salt_of(info.root, coll_of(rel))
        return rel, raw, recs, idx, salt, enc

    def _plain(self, r: BcRecord, salt: bytes, enc: bool) -> tuple[bytes, bytes]:
        if not enc:
            return r.key_field, r.value_field
        k = _SEALER.open(r.key_field, _aad(salt, b"K", r.gsn_word))
        v = _SEALER.open(r.value_field, _aad(salt, b"V", r.gsn_word)) if r.value_field else b""
        return k, v

    def values(self, info: GoldenInfo, target: str, field: str) -> list[tuple[str, Any]]:
        rel, raw, recs, idx, salt, enc = self._ctx(info, target)
        r = recs[idx]
        seq = r.gsn_word & bitcask.SEQ_MASK
        if field == "gsn":
            return int_values(60, (seq - 1, seq + 1, max(x.gsn_word & bitcask.SEQ_MASK for x in recs)))
        if field == "tombstone":
            return [("flipped", 1 - (r.gsn_word >> 63))]
        if field == "reserved_bits":
            return [(str(v), v) for v in range(1, 8)]
        if field in ("value_len", "key_len"):
            cur = len(r.value_field) if field == "value_len" else len(r.key_field)
            past = len(raw) - r.off
            return int_values(32 if field == "value_len" else 16, (cur - 1, cur + 1, cur + 8, past, past + 1))
        if field == "magic":
            return int_values(16, (bitcask.RECORD_MAGIC ^ 1,))
        if field == "pad":
            n = -(20 + len(r.key_field) + len(r.value_field)) % 8
            return [("ff", b"\xff" * n)] if n else []
        if field == "tail":
            return TAILS
        k, v = self._plain(r, salt, enc)
        if field == "key":
            others = [self._plain(x, salt, enc)[0] for x in recs if x is not r]
            return _plain_key_values(coll_of(rel), k, [o for o in others if o != k])
        if field == "value":
            return _plain_value_values(v)
        raise KeyError(field)

    def fields_for(self, info: GoldenInfo, target: str) -> tuple[str, ...]:
        rel, raw, recs, idx, salt, enc = self._ctx(info, target)
        r = recs[idx]
        pad = -(20 + len(r.key_field) + len(r.value_field)) % 8
        last_of_active = idx == len(recs) - 1 and _is_active(info, rel)
        return tuple(f for f in FIELDS[self.kind] if (f != "pad" or pad) and (f != "tail" or last_of_active))

    def apply(self, info: GoldenInfo, target: str, field: str, value: Any) -> dict[str, bytes]:
        rel, raw, recs, idx, salt, enc = self._ctx(info, target)
        r = recs[idx]
        gw = r.gsn_word
        k, v = self._plain(r, salt, enc)
        klen = vlen = None
        magic = bitcask.RECORD_MAGIC
        pad = None
        if field == "gsn":
            gw = (gw & ~bitcask.SEQ_MASK) | value
        elif field == "tombstone":
            gw = gw ^ (1 << 63)
        elif field == "reserved_bits":
            gw = (gw & ~(0x7 << 60)) | (value << 60)
        elif field == "value_len":
            vlen = value
        elif field == "key_len":
            klen = value
        elif field == "magic":
            magic = value
        elif field == "pad":
            pad = value
        elif field == "key":
            k = value
        elif field == "value":
            v = value
        if enc:
            kf = _SEALER.seal(k, _aad(salt, b"K", gw))
            vf = _SEALER.seal(v, _aad(salt, b"V", gw)) if (r.value_field or field == "value") else b""
        else:
            kf, vf = k, v
        rec = encode_bitcask_record(gw, kf, vf, magic=magic, klen=klen, vlen=vlen, pad=pad)
        b = bytearray(raw[: r.off] + rec + raw[r.off + r.size :])
        _reseal_bitcask_crc(b, r.off)
        _shift_marks(b, r.off, len(b) - len(raw))
        out = {rel: bytes(b)}
        if field == "tail":
            b += _bitcask_tail(len(b), value, enc)
            out[rel] = bytes(b)
        return out


def _parse_hint(raw: bytes) -> tuple[list[tuple[int, int, int, int, bytes, int]], int]:
    """Entries ``(gsn_word, offset, vlen, klen, key, entry_offset)`` and the trailer offset."""
    out = []
    pos = 32
    end = len(raw) - 32
    while pos + bitcask.HINT_ENTRY.size <= end:
        gw, off, vl, kl = bitcask.HINT_ENTRY.unpack_from(raw, pos)
        key = raw[pos + bitcask.HINT_ENTRY.size : pos + bitcask.HINT_ENTRY.size + kl]
        out.append((gw, off, vl, kl, key, pos))
        pos += bitcask.HINT_ENTRY.size + kl
    return out, end


def _hint_file(head: bytes, entries: bytes, data_size: int, count: int, magic: bytes = bitcask.HINT_END_MAGIC) -> bytes:
    tr = struct.pack("<8sQQI", magic, data_size, count, _crc(entries))
    return head + entries + tr + _U32.pack(_crc(tr))


class HintEntry(Crafter):
    kind = "hint_entry"

    def targets(self, info: GoldenInfo) -> list[str]:
        out = []
        for rel in _bitcask_files(info, ".hint"):
            out += [f"{rel}#{i}" for i in range(len(_parse_hint(_read(info.root, rel))[0]))]
        return out

    def values(self, info: GoldenInfo, target: str, field: str) -> list[tuple[str, Any]]:
        rel, idx = _split(target)
        raw = _read(info.root, rel)
        ents, _end = _parse_hint(raw)
        gw, off, vl, kl, key, _p = ents[idx]
        data_size = struct.unpack_from("<Q", raw, len(raw) - 24)[0]
        if field == "gsn":
            return int_values(60, ((gw & bitcask.SEQ_MASK) + 1, (gw & bitcask.SEQ_MASK) - 1))
        if field == "tombstone":
            return [("flipped", 1 - (gw >> 63))]
        if field == "reserved_bits":
            return [(str(v), v) for v in range(1, 8)]
        if field == "offset":
            return int_values(64, (off + 8, off - 8, data_size, data_size - 8, *[e[1] for e in ents if e[1] != off][:2]))
        if field == "value_len":
            return int_values(32, (vl + 1, vl - 1, vl + 8, data_size))
        if field == "key_len":
            return int_values(16, (kl + 1, kl - 1))
        if field == "key":
            others = [e[4] for e in ents if e[4] != key]
            return [*[(f"other{i}", o) for i, o in enumerate(others[:3])], ("flipped", bytes([key[0] ^ 1]) + key[1:]),
                    ("empty", b""), ("long", key + b"\0")]
        raise KeyError(field)

    def apply(self, info: GoldenInfo, target: str, field: str, value: Any) -> dict[str, bytes]:
        rel, idx = _split(target)
        raw = _read(info.root, rel)
        ents, end = _parse_hint(raw)
        data_size = struct.unpack_from("<Q", raw, len(raw) - 24)[0]
        parts = []
        for i, (gw, off, vl, kl, key, _p) in enumerate(ents):
            if i == idx:
                if field == "gsn":
                    gw = (gw & ~bitcask.SEQ_MASK) | value
                elif field == "tombstone":
                    gw ^= 1 << 63
                elif field == "reserved_bits":
                    gw = (gw & ~(0x7 << 60)) | (value << 60)
                elif field == "offset":
                    off = value
                elif field == "value_len":
                    vl = value
                elif field == "key_len":
                    kl = value
                elif field == "key":
                    key, kl = value, len(value)
            parts.append(bitcask.HINT_ENTRY.pack(gw, off, vl, kl & 0xFFFF) + key)
        return {rel: _hint_file(raw[:32], b"".join(parts), data_size, len(ents))}


class HintTrailer(Crafter):
    kind = "hint_trailer"

    def targets(self, info: GoldenInfo) -> list[str]:
        return _bitcask_files(info, ".hint")

    def values(self, info: GoldenInfo, target: str, field: str) -> list[tuple[str, Any]]:
        raw = _read(info.root, target)
        _m, size, count, _c1, _c2 = bitcask.HINT_TRAILER.unpack_from(raw, len(raw) - 32)
        if field == "magic":
            return magic_values(bitcask.HINT_END_MAGIC)
        if field == "data_size":
            return int_values(64, (size - 1, size + 1, size - 8, size + 8))
        return int_values(64, (count - 1, count + 1))

    def apply(self, info: GoldenInfo, target: str, field: str, value: Any) -> dict[str, bytes]:
        raw = _read(info.root, target)
        m, size, count, _c1, _c2 = bitcask.HINT_TRAILER.unpack_from(raw, len(raw) - 32)
        if field == "magic":
            m = value
        elif field == "data_size":
            size = value
        else:
            count = value
        return {target: _hint_file(raw[:32], raw[32 : len(raw) - 32], size, count, m)}


class Pending(Crafter):
    """compaction.pending, written into a shard that has none (the goldens hold no real
    compaction input, so every file a marker names is live data)."""

    kind = "pending"

    def targets(self, info: GoldenInfo) -> list[str]:
        dirs = sorted({os.path.dirname(f) for f in _bitcask_files(info, ".data")})
        return [os.path.join(d, bitcask.PENDING_NAME) for d in dirs]

    def _fids(self, info: GoldenInfo, target: str) -> list[int]:
        d = os.path.dirname(target)
        return sorted(int(os.path.basename(f)[:8]) for f in _bitcask_files(info, ".data") if os.path.dirname(f) == d)

    def values(self, info: GoldenInfo, target: str, field: str) -> list[tuple[str, Any]]:
        fids = self._fids(info, target)
        if field == "magic":
            return magic_values(bitcask.PENDING_MAGIC)
        if field in ("version", "reserved"):
            return int_values(16, (2,))
        if field == "count":
            return int_values(32, (0, 2, 1000))
        vals: list[tuple[str, Any]] = [(f"fid{f}", [f]) for f in fids]
        vals += [("all", fids), ("active", [fids[-1]]), ("missing", [fids[-1] + 50])]
        vals += [(lab, [v]) for lab, v in int_values(32)]
        return _dedupe(vals)

    def apply(self, info: GoldenInfo, target: str, field: str, value: Any) -> dict[str, bytes]:
        fids = [self._fids(info, target)[-1] + 50]  # the template names a file that is gone
        magic, version, reserved, count = bitcask.PENDING_MAGIC, 1, 0, None
        if field == "magic":
            magic = value
        elif field == "version":
            version = value
        elif field == "reserved":
            reserved = value
        elif field == "count":
            count = value
        else:
            fids = list(value)
        body = struct.pack("<8sHHI", magic, version, reserved, len(fids) if count is None else count)
        body += b"".join(_U32.pack(f) for f in fids)
        return {target: body + _U32.pack(_crc(body))}


class LogHeader(Crafter):
    kind = "log_header"

    def targets(self, info: GoldenInfo) -> list[str]:
        return [info.log_rel]

    def values(self, info: GoldenInfo, target: str, field: str) -> list[tuple[str, Any]]:
        number = int(os.path.basename(target)[:8])
        if field == "magic":
            return magic_values(txlog.FILE_MAGIC)
        if field in ("version", "flags"):
            return int_values(32, (2, 3, 4))
        return int_values(64, (number - 1, number + 1))

    def apply(self, info: GoldenInfo, target: str, field: str, value: Any) -> dict[str, bytes]:
        raw = _read(info.root, target)
        magic, version, flags, number = struct.unpack_from("<8sIIQ", raw)
        if field == "magic":
            magic = value
        elif field == "version":
            version = value
        elif field == "flags":
            flags = value
        else:
            number = value
        head = struct.pack("<8sIIQ", magic, version, flags, number)
        head = head + _U32.pack(_crc(head))
        head += bytes(txlog.RECORDS_START - len(head))
        return {target: _log_file(info, head, _template_records(info))}


def _log_aad(version: int, db_id: bytes, txid: int) -> bytes:
    """What a sealed log body is bound to (``armdb.txlog.record_aad``; format 1: the txid)."""
    txid &= 0xFFFFFFFFFFFFFFFF
    record_aad = getattr(txlog, "record_aad", None)
    if record_aad is None:
        return txid.to_bytes(8, "little")
    return bytes(record_aad(version, db_id, txid))


def _seal_body(info: GoldenInfo, flags: int, txid: int, plain: bytes) -> bytes:
    if not flags & txlog.FLAG_SEALED:
        return plain
    return _LOG_SEALER.seal(plain, _log_aad(info.log_version, info.db_id, txid))


def _template_records(info: GoldenInfo) -> list[bytes]:
    return [_encode_log_record(txid, flags, _seal_body(info, flags, txid, mp(rows))) for txid, flags, rows in info.log_template]


_F_ROW = ("kind", "collection", "shard", "slot", "version", "status", "body")
_B_ROW = ("kind", "collection", "key", "value", "gsn")


class LogRecord(Crafter):
    kind = "log_record"

    def targets(self, info: GoldenInfo) -> list[str]:
        out = []
        for ri, (_t, _f, rows) in enumerate(info.log_template):
            out.append(f"{info.log_rel}#{ri}")
            out += [f"{info.log_rel}#{ri}.{j}" for j in range(len(rows))]
        return out

    def _ctx(self, info: GoldenInfo, target: str) -> tuple[int, int]:
        _rel, _, idx = target.partition("#")
        ri, _, j = idx.partition(".")
        return int(ri), int(j) if j else -1

    def fields_for(self, info: GoldenInfo, target: str) -> tuple[str, ...]:
        ri, j = self._ctx(info, target)
        if j < 0:
            return ("magic", "flags", "txid", "body_len", "body", "tail")
        kind = info.log_template[ri][2][j][0]
        return ("row", *(f"{kind}.{f}" for f in (_F_ROW if kind == "F" else _B_ROW)[1:]))

    def values(self, info: GoldenInfo, target: str, field: str) -> list[tuple[str, Any]]:
        ri, j = self._ctx(info, target)
        txid, flags, rows = info.log_template[ri]
        if field in ("magic", "flags", "body_len"):
            blen = len(_seal_body(info, flags, txid, mp(rows)))
            extra = (blen - 1, blen + 1, blen + 8, txlog.MAX_BODY, txlog.MAX_BODY + 1) if field == "body_len" else (2, 3)
            return int_values(32, extra)
        if field == "txid":
            return int_values(64, (txid - 1, txid + 1))
        if field == "tail":
            return TAILS
        if field == "body":
            return [*TYPES, *RAWS, ("empty", Raw(b"")), ("rows_10k_empty", [[]] * 10_000),
                    ("dup_rows", rows * 2), ("rows_as_map", {"rows": rows})]
        row = rows[j]
        if field == "row":
            return [("int", 5), ("nil", None), ("str", row[0]), ("empty", []), ("kind_only", [row[0]]),
                    ("short", row[:-1]), ("long", [*row, 0]), ("kind_X", ["X", *row[1:]]), ("kind_int", [1, *row[1:]]),
                    ("kind_bin", [row[0].encode(), *row[1:]]), ("kind_lower", [row[0].lower(), *row[1:]]),
                    ("as_map", dict(enumerate(row))), RAWS[0]]
        name = field.split(".", 1)[1]
        cur = row[(_F_ROW if row[0] == "F" else _B_ROW).index(name)]
        if name == "collection":
            return name_values(tuple(c for c in info.collections if c != cur))
        if name in ("shard", "slot", "version", "status", "gsn"):
            extra: tuple[int, ...] = (cur - 1, cur + 1)
            if name == "slot":
                extra += (2**31, 2**40)
            if name == "version":
                extra += (cur + 2**29, 2**30)
            if name == "status":
                extra += (3,)
            return mp_int_values(extra)
        if name in ("body", "key"):
            return [*bytes_values(cur, big=name == "body"), *TYPES]
        if name == "value":
            return [*_plain_value_values(cur or b""), *TYPES]
        raise KeyError(field)

    def apply(self, info: GoldenInfo, target: str, field: str, value: Any) -> dict[str, bytes]:
        ri, j = self._ctx(info, target)
        recs = []
        for i, (txid, flags, rows) in enumerate(info.log_template):
            if i != ri:
                recs.append(_encode_log_record(txid, flags, _seal_body(info, flags, txid, mp(rows))))
                continue
            magic, body_len = txlog.REC_MAGIC, None
            new_rows: Any = [list(r) for r in rows]
            new_flags, new_txid = flags, txid
            if field == "magic":
                magic = value
            elif field == "flags":
                new_flags = value
            elif field == "txid":
                new_txid = value
            elif field == "body_len":
                body_len = value
            elif field == "body":
                new_rows = value
            elif field == "tail":
                pass  # the record stays valid; a bad tail follows it (below)
            elif field == "row":
                new_rows[j] = value
            else:
                kind, name = field.split(".", 1)
                new_rows[j][(_F_ROW if kind == "F" else _B_ROW).index(name)] = value
            # The body is sealed as the template was (flags changes only the stated flags).
            body = _seal_body(info, flags, new_txid, mp(new_rows))
            recs.append(_encode_log_record(new_txid, new_flags, body, magic=magic, body_len=body_len))
        b = bytearray(_log_file(info, None, recs))
        _seal_log_crcs(b)
        if field == "tail":
            b += _log_tail(len(b), value)
        return {info.log_rel: bytes(b)}


class LockFile(Crafter):
    """``LOCK``: not a format file, but a path open and check write through.  An entry is
    ``(kind, target)``, made by the child: a symbolic or hard link to a canary file, a
    dangling link, a folder, a fifo; a content is the bytes of a regular ``LOCK``."""

    kind = "lock_file"

    def targets(self, info: GoldenInfo) -> list[str]:
        return ["LOCK"]

    def values(self, info: GoldenInfo, target: str, field: str) -> list[tuple[str, Any]]:
        if field == "entry":
            return [("symlink_canary", ("symlink", CASE_DIR + "/canary/db.meta")),
                    ("symlink_canary_rel", ("symlink", "../canary/seqmap")),
                    ("symlink_dangling", ("symlink", CASE_DIR + "/nowhere/x")),
                    ("hardlink_canary", ("hardlink", CASE_DIR + "/canary/db.meta")),
                    ("directory", ("dir", "")), ("fifo", ("fifo", ""))]
        return [("empty", b""), ("garbage", b"xyz\n"), ("negative", b"-1\n"), ("huge_pid", b"9" * 40 + b"\n"),
                ("m1", b"1" * (1 << 20)), ("nul", bytes(8)), ("bad_utf8", b"\xff\xfe\n")]

    def apply(self, info: GoldenInfo, target: str, field: str, value: Any) -> dict[str, Any]:
        return {target: value}


class SyncedMark(Crafter):
    """The synced mark area of a log file (format 4) or a Bitcask data file (format 3):
    bytes 32-63, two 16-byte cells ``u64 mark | u32 generation | u32 CRC-32 of the 12
    bytes and the BLAKE2b-64 digest of the file's 32-byte header``.  The crafted cell is
    made the newest (unless its generation is the field) and bound to its own file's
    header (unless the binding is the field)."""

    kind = "synced_mark"

    def targets(self, info: GoldenInfo) -> list[str]:
        return [
            f"{f}#{c}"
            for f in info.files
            if f.endswith((".log", ".data")) and has_area(f, _read(info.root, f))
            for c in (0, 1)
        ]

    def _ctx(self, info: GoldenInfo, target: str) -> tuple[str, bytes, int, bytes, list[str]]:
        rel, cell = _split(target)
        raw = _read(info.root, rel)
        d = os.path.dirname(rel)
        others = sorted(f for f in info.files if os.path.dirname(f) == d and f.endswith((".log", ".data")) and f != rel)
        return rel, raw, cell, raw[:32], others

    def values(self, info: GoldenInfo, target: str, field: str) -> list[tuple[str, Any]]:
        rel, raw, cell, _head, others = self._ctx(info, target)
        mark, gen, _c = struct.unpack_from("<QII", raw, _MARK_AREA + 16 * cell)
        if field == "mark":
            return int_values(64, (mark - 1, mark + 1, mark + 8, len(raw) - 1, len(raw) + 4096))
        if field == "generation":
            return int_values(32, (gen - 1, gen + 1))
        if field == "binding":
            return [*[(f"other:{os.path.basename(o)}", o) for o in others[:2]], ("zero_header", None)]
        # the whole area: zero (no mark), all ones, garbage, the two cells swapped
        area = raw[_MARK_AREA : _MARK_AREA + 32]
        return [("zero", bytes(32)), ("ones", b"\xff" * 32), ("garbage", random.Random(5).randbytes(32)),
                ("swapped", area[16:] + area[:16])]

    def apply(self, info: GoldenInfo, target: str, field: str, value: Any) -> dict[str, bytes]:
        rel, raw, cell, head, _others = self._ctx(info, target)
        b = bytearray(raw)
        if field == "area":
            b[_MARK_AREA : _MARK_AREA + 32] = value
            return {rel: bytes(b)}
        at = _MARK_AREA + 16 * cell
        mark, gen, _c = struct.unpack_from("<QII", b, at)
        other_gen = struct.unpack_from("<QII", b, _MARK_AREA + 16 * (1 - cell))[1]
        gen = max(gen, other_gen) + 1
        if field == "mark":
            mark = value
        elif field == "generation":
            gen = value
        else:
            head = bytes(32) if value is None else _read(info.root, value)[:32]
        body = struct.pack("<QI", mark, gen & 0xFFFFFFFF)
        b[at : at + 16] = body + _U32.pack(_crc(body + _digest8(head)))
        return {rel: bytes(b)}


_MARK_AREA = 32  # where a marked file's mark area starts (armdb._syncmark.AREA_OFFSET)


def _shift_marks(b: bytearray, off: int, delta: int) -> None:
    """Re-seal the synced mark of the file ``b`` after a record at ``off`` changed size by
    ``delta``: a mark past the record moves with the records it covered (else a shorter
    record would be refused as "the file ends below its synced mark", not judged)."""
    if not delta or not has_area(".data", bytes(b[:64])):
        return
    digest = _digest8(bytes(b[:32]))
    for c in range(2):
        at = _MARK_AREA + 16 * c
        mark, gen, crc = struct.unpack_from("<QII", b, at)
        if crc == _crc(bytes(b[at : at + 12]) + digest) and mark > off:
            body = struct.pack("<QI", max(0, mark + delta), gen)
            b[at : at + 16] = body + _U32.pack(_crc(body + digest))


def _digest8(header: bytes) -> bytes:
    return hashlib.blake2b(header, digest_size=8).digest()


CRAFTERS: dict[str, Crafter] = {c.kind: c for c in (
    LogHeader(), LogRecord(), FixedHeader(), FixedSlot(), Redo(), BitcaskHeader(), BitcaskRecord(), HintHeader(),
    HintEntry(), HintTrailer(), CollectionMeta(), QueueMeta(), DbMeta(), Pending(), SeqMapKind(), LockFile(),
    SyncedMark(),
)}
assert set(CRAFTERS) == set(FIELDS)


def enumerate_cases(info: GoldenInfo) -> list[Case]:
    out = []
    for kind, c in CRAFTERS.items():
        for target in c.targets(info):
            for field in c.fields_for(info, target):
                n = len(c.values(info, target, field))
                out += [Case(info.name, kind, target, field, vi) for vi in range(n)]
    return out


def sealed_content(info: GoldenInfo, case: Case) -> bool:
    """The crafted value sits inside a sealed field: a keyless ``check`` cannot read it, so
    only the open (with the key) can judge it."""
    if case.kind == "log_record" and (case.field in ("body", "row") or case.field[:2] in ("F.", "B.")):
        ri = int(case.target.partition("#")[2].partition(".")[0])
        return bool(info.log_template[ri][1] & txlog.FLAG_SEALED)
    if case.kind == "bitcask_record" and case.field in ("key", "value"):
        return salt_of(info.root, coll_of(case.target.partition("#")[0]))[1]
    return False


def _subst(o: Any, case_dir: str) -> Any:
    if isinstance(o, str):
        return o.replace(CASE_DIR, case_dir)
    if isinstance(o, list):
        return [_subst(x, case_dir) for x in o]
    if isinstance(o, tuple):
        return tuple(_subst(x, case_dir) for x in o)
    return o


def craft(info: GoldenInfo, case: Case, case_dir: str) -> tuple[str, dict[str, Any]]:
    """``(value label, {rel path: crafted bytes, or (entry kind, target) for LOCK})``."""
    c = CRAFTERS[case.kind]
    label, value = c.values(info, case.target, case.field)[case.vi]
    return label, c.apply(info, case.target, case.field, _subst(value, case_dir))
