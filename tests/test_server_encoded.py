"""The owner passes a client's var payloads through as encoded bodies (SPEC P5, Q31, Q32):
``Queue._push_many_encoded`` checks each body once and stores it as it came,
``Queue._lease_batch_encoded`` hands stored bodies out as bytes, and the server puts them
on the wire without a decode or a second encode.  A body that would not read back as a
payload of the queue's type is refused before anything is stored."""

from __future__ import annotations

import collections
import dataclasses
import os
import struct
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

import armdb
from armdb import Config, Db, QueueConfig, TxConfig, wire
from armdb import server as server_mod
from armdb._pack import packb
from armdb.errors import PayloadTypeError


@dataclass
class Job:
    n: int
    tag: str


@dataclass
class Checked:  # a __post_init__: its bodies are rebuilt at push, never passed through unchecked
    n: int

    def __post_init__(self) -> None:
        if self.n < 0:
            raise ValueError("n must not be negative")


Jobs = armdb.queue("jobs", payload=Job, var=True)
Docs = armdb.queue("docs", payload=dict, var=True)
Pairs = armdb.queue("pairs", payload=tuple, var=True)
Anything = armdb.queue("anything", payload=typing.Any, var=True)
Checks = armdb.queue("checks", payload=Checked, var=True)
Fixed = armdb.queue("fixed", payload=np.dtype([("a", "<u4")]))

CASES: list[tuple[armdb.QueueSpec[Any], list[Any]]] = [
    (Jobs, [Job(1, "a"), Job(2, "b"), Job(3, "")]),
    (Docs, [{"n": 1, "blob": b"\x00\xff"}, {"k": [1, 2.5, None]}, {}]),
    (Pairs, [(1, "a"), (2, "b"), ()]),
    (Anything, [1, "two", [3, {"four": 4}]]),
    (Checks, [Checked(1), Checked(2), Checked(0)]),
]


def _bodies(q: armdb.Queue[Any], payloads: list[Any]) -> list[bytes]:
    """What a client sends: each payload's plain msgpack value, no layout tag."""
    codec: Any = q._codec
    return [packb(codec.plain(p)) for p in payloads]


@pytest.mark.parametrize("spec,payloads", CASES, ids=[c[0].name for c in CASES])
def test_q31_encoded_bodies_are_stored_as_they_came_and_leased_as_bytes(db: Db, spec: Any,
                                                                        payloads: list[Any]) -> None:
    # SPEC Q31, Q32, P5: pushed through the hook, leased through the hook as the same
    # bytes, and through the public lease_batch as the payloads themselves
    q = db.open_queue(spec)
    bodies = _bodies(q, payloads)
    assert q._push_many_encoded(bodies) == [1, 2, 3]
    b = q._lease_batch_encoded(5)
    assert b.payloads == bodies and list(b.ids) == [1, 2, 3] and list(b.attempts) == [1, 1, 1]
    assert q.release_many(b) == 3
    got = q.lease_batch(5)
    assert got.payloads == payloads
    assert q.ack_many(got) == 3 and q.len() == 0


BAD_BODIES = {
    "not msgpack": b"\xc1",
    "empty": b"",
    "truncated": b"\x92\x01",
    "two values": packb(["a", 1]) + b"\x01",
    "invalid utf-8": b"\x92\x01\xa2\xff\xfe",
    "an array as a map key": b"\x81\x91\x01\x02",
}


@pytest.mark.parametrize("why", list(BAD_BODIES))
def test_q31_a_body_that_would_not_read_back_is_refused_and_nothing_stored(db: Db, why: str) -> None:
    # SPEC Q31: all or nothing; a poison body never reaches the store
    q = db.open_queue(Jobs)
    good = _bodies(q, [Job(1, "a")])[0]
    with pytest.raises(PayloadTypeError, match="payload 1 of the batch: .*nothing was pushed"):
        q._push_many_encoded([good, BAD_BODIES[why], good])
    assert q.len() == 0 and q.stats().pushes == 0
    assert q._push_many_encoded([good]) == [1]  # the queue goes on; no id was used up by the refusal


@pytest.mark.parametrize("spec,body,what", [
    (Jobs, packb("a string"), "not the 2 fields of Job"),
    (Jobs, packb([1]), "not the 2 fields of Job"),
    (Jobs, packb([1, "a", 3]), "not the 2 fields of Job"),
    (Docs, packb([1, 2]), "is a list, not a dict"),
    (Pairs, packb({"a": 1}), "is a dict, not a tuple"),
    (Checks, packb([-1]), "cannot be built from the encoded fields"),
], ids=["str-for-dataclass", "too-few-fields", "too-many-fields", "list-for-dict", "dict-for-tuple",
        "post-init-refuses"])
def test_q31_a_body_of_another_type_is_refused(db: Db, spec: Any, body: bytes, what: str) -> None:
    # SPEC Q31, P2: the shape the queue's payload type reads back, checked once by the owner
    q = db.open_queue(spec)
    with pytest.raises(PayloadTypeError, match=what):
        q._push_many_encoded([body])
    with pytest.raises(PayloadTypeError, match="bytes, not str"):
        q._push_many_encoded(["not bytes"])  # type: ignore[list-item]
    assert q.len() == 0


def test_q31_the_hooks_refuse_a_fixed_queue(db: Db) -> None:
    q = db.open_queue(Fixed)
    with pytest.raises(PayloadTypeError, match="fixed queue"):
        q._push_many_encoded([b"\x00\x00\x00\x00"])
    with pytest.raises(PayloadTypeError, match="fixed queue"):
        q._lease_batch_encoded(1)


def test_t4_encoded_bodies_of_an_encrypted_queue_are_encrypted(tmp_path: Path) -> None:
    # SPEC T4: the hook writes through the same commit as push_many: sealed on disk
    marker = "SECRET-MARKER-6d1f"
    cfg = QueueConfig.balanced().payload_config(Config.balanced().encryption_key(b"k" * 32).build()).build()
    path = tmp_path / "db"
    with Db.open(path, tx_config=TxConfig(log_encryption_key=b"l" * 32)) as db:
        q = db.open_queue(Docs, cfg)
        q._push_many_encoded(_bodies(q, [{"secret": marker, "i": i} for i in range(3)]))
        b = q._lease_batch_encoded(3)
        assert [msgpack.unpackb(x) for x in b.payloads] == [{"secret": marker, "i": i} for i in range(3)]
    for root, _dirs, files in os.walk(path):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                assert marker.encode() not in fh.read(), f


@dataclass
class V1:
    n: int
    reason: str


@dataclass
class V2:  # a field added: bodies of V1 are translated when read
    n: int
    reason: str
    priority: int = 5


def test_q36_a_queue_whose_class_changed_passes_plain_bodies_both_ways(tmp_path: Path) -> None:
    # SPEC Q36: a stored body of an older layout, or one tagged with the current layout, is
    # handed out as the plain field list of the current class; a client's plain body of the
    # current class is stored tagged, as push_many stores it
    path = tmp_path / "db"
    with Db.open(path) as db:
        db.open_queue(armdb.queue("jobs", payload=V1, var=True)).push(V1(1, "old"))
    with Db.open(path) as db:
        q = db.open_queue(armdb.queue("jobs", payload=V2, var=True))
        q.push(V2(2, "new", 1))  # stored with the current layout's tag
        q._push_many_encoded([packb([3, "client", 9])])
        b = q._lease_batch_encoded(5)
        assert [msgpack.unpackb(x) for x in b.payloads] == [[1, "old", 5], [2, "new", 1], [3, "client", 9]]
        q.release_many(b)
        assert [lz.payload for lz in q.lease(5)] == [V2(1, "old", 5), V2(2, "new", 1), V2(3, "client", 9)]


# -- through the socket -------------------------------------------------------------------------



def _raw(path: str) -> Any:
    import socket

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    s.sendall(wire.frame({"armdb": wire.MAGIC, "versions": [wire.VERSION]}))
    _reply(s)
    return s


def _reply(s: Any) -> Any:
    def recv(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            k = s.recv(n - len(buf))
            if not k:
                raise ConnectionResetError("closed")
            buf += k
        return buf

    (n,) = struct.unpack(">I", recv(4))
    return msgpack.unpackb(recv(n), strict_map_key=False)


def _ask(s: Any, rid: int, op: str, **args: Any) -> Any:
    s.sendall(wire.frame([rid, op, args]))
    return _reply(s)


def test_p5_a_poison_body_from_a_client_is_refused_and_nothing_stored(owner: tuple[Db, server_mod.Server]) -> None:
    # SPEC P5, Q31: a client that sends bodies of its own making: one that is not msgpack,
    # or not a payload of the queue's type, is a PayloadTypeError reply naming it; nothing is
    # pushed, and the connection serves on.  A payload that is not bytes at all breaks the
    # protocol: that connection is closed, nothing pushed.
    db, srv = owner
    s = _raw(srv.path)
    try:
        assert _ask(s, 1, "open_queue", name="jobs", var=True, fingerprint=Jobs.fingerprint)[1] == wire.OK
        good = packb([1, "a"])
        for rid, bad in enumerate([b"\xc1\x00", packb({"n": 1}), packb([1, "a"]) + b"\x90"], start=2):
            _rid, status, err = _ask(s, rid, "push_many", q="jobs", ps=[good, bad])
            assert status == wire.ERR and err[0] == "PayloadTypeError" and "payload 1 of the batch" in err[1]
        assert _ask(s, 9, "len", q="jobs") == [9, wire.OK, 0]
        assert _ask(s, 10, "push_many", q="jobs", ps=[good, good]) == [10, wire.OK, [1, 2]]
        # the lease reply carries the stored bodies as one msgpack array, as they are
        _rid, status, got = _ask(s, 11, "lease_batch", q="jobs", n=5)
        assert status == wire.OK and isinstance(got[7], bytes)
        assert msgpack.unpackb(got[7]) == [[1, "a"], [1, "a"]]
        s.sendall(wire.frame([12, "push_many", {"q": "jobs", "ps": [good, 5]}]))
        with pytest.raises((ConnectionResetError, OSError)):
            _reply(s)
    finally:
        s.close()
    assert db._queues["jobs"].len() == 2  # the two of request 10, nothing else


def test_p2_a_client_batch_names_the_payload_that_cannot_be_read_back(owner: tuple[Db, server_mod.Server]) -> None:
    # SPEC P2, Q31: the owner refuses a body that does not read back; the client then says
    # which payload and why in encode's own words
    with armdb.connect(owner[0].path, timeout=10) as c:
        d = c.open_queue(Docs)
        with pytest.raises(PayloadTypeError, match=r"payload 2 of the batch: dict keys must be"):
            d.push_many([{"a": 1}, {"b": 2}, {(1, 2): "a tuple key"}])
        with pytest.raises(PayloadTypeError, match=r"payload 0 of the batch: payload must be of type dict"):
            d.push_many([[1, 2]])
        assert d.len() == 0
        ch = c.open_queue(Checks)  # a class with a __post_init__: encoded and checked as encode does
        assert ch.push_many([Checked(4), Checked(5)]) == [1, 2]
        assert [p.n for p in ch.lease_batch(5).payloads] == [4, 5]


def test_p5_leased_bodies_decode_to_each_queue_type(owner: tuple[Db, server_mod.Server]) -> None:
    # SPEC P5, Q32: the client decodes the stored bodies once, into its own payload type
    db, _ = owner
    with armdb.connect(db.path, timeout=10) as c:
        for spec, payloads in CASES:
            rq = c.open_queue(spec)
            rq.push_many(payloads)
            b = rq.lease_batch(10)
            assert b.payloads == payloads, spec.name
            assert [type(p) for p in b.payloads] == [type(p) for p in payloads]
            assert rq.ack_many(b) == 3


def test_q36_a_client_of_an_evolved_queue_gets_the_current_class(tmp_path: Path) -> None:
    # SPEC Q36, P2: rows of the older class reach the client translated
    path = tmp_path / "db"
    with Db.open(path) as db:
        db.open_queue(armdb.queue("jobs", payload=V1, var=True)).push(V1(1, "old"))
    db = Db.open(path)
    try:
        spec = armdb.queue("jobs", payload=V2, var=True)
        db.open_queue(spec)
        db.serve()
        with armdb.connect(path, timeout=10) as c:
            rq = c.open_queue(spec)
            rq.push_many([V2(2, "new")])
            assert rq.lease_batch(5).payloads == [V2(1, "old", 5), V2(2, "new", 5)]
    finally:
        db.shutdown()


def test_encoded_body_shape_matches_plain() -> None:
    # the server's array of bodies is what msgpack gives for the list of plain values
    codec: Any = armdb.qspec.VarCodec(Job)
    vals = [Job(i, "x" * i) for i in range(3)]
    bodies = [packb(codec.plain(v)) for v in vals]
    blob = server_mod._ARRAY32 + len(bodies).to_bytes(4, "big") + b"".join(bodies)
    assert msgpack.unpackb(blob) == [list(dataclasses.astuple(v)) for v in vals]


def test_p2_a_client_batch_of_values_the_compiled_codec_leaves_to_msgpack_round_trips(
        owner: tuple[Db, server_mod.Server]) -> None:
    # SPEC P2, Q1: the client packs and unpacks plain payloads with the compiled loop
    # (armdb._core.plainpack); values it does not take (a dict subclass, an extension type,
    # an int beyond 64 bits is refused by msgpack itself) go through msgpack, in the same batch
    plain = [{"n": i, "tags": ["a", "é"], "f": 1.5, "b": b"\x00"} for i in range(3)]
    odd = [{"od": collections.OrderedDict(a=1)}, {"ext": msgpack.ExtType(7, b"xy")}]
    with armdb.connect(owner[0].path, timeout=10) as c:
        q = c.open_queue(Anything)
        assert q.push_many(plain) == [1, 2, 3]
        assert q.lease_batch(10).payloads == plain
        assert q.push_many(odd) == [4, 5]
        assert q.lease_batch(10).payloads == [{"od": {"a": 1}}, {"ext": msgpack.ExtType(7, b"xy")}]
        with pytest.raises(PayloadTypeError, match="payload 1 of the batch"):
            q.push_many([{"ok": 1}, {"big": 2**70}])
