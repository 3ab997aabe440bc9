"""Bad input to replication (R1, R6): a port that is not an armdb primary, a primary of
another database, damaged or hostile frames, a directory that is a database of its own.
Each raises or records a clear ``armdb.errors`` class, and nothing is applied."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import armdb
from armdb.layout import check_meta
from armdb.replication import MAGIC, VERSION, _encode_state, _finish_swap, encode_frame

from .test_replication import LOCAL, Primary, contents, schema, settle
from .test_replication import primary as primary  # noqa: F401 (a fixture)


class FakePrimary:
    """A loopback server that answers each connection with ``script(conn)``."""

    def __init__(self, script: Callable[[socket.socket], None]) -> None:
        self.sock = socket.create_server(LOCAL)
        self.address = self.sock.getsockname()[:2]
        self.script = script
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.recv(4096)  # the follower's hello
                    self.script(conn)
                    time.sleep(0.3)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def fake() -> Iterator[Callable[[Callable[[socket.socket], None]], FakePrimary]]:
    made: list[FakePrimary] = []

    def make(script: Callable[[socket.socket], None]) -> FakePrimary:
        made.append(FakePrimary(script))
        return made[-1]

    yield make
    for f in made:
        f.close()


def hello(**over: Any) -> bytes:
    h = {"magic": MAGIC, "version": VERSION, "db_id": b"x" * 16, "stream": b"s" * 16, "mode": "snapshot", "seq": 0}
    h.update(over)
    return encode_frame(h)


def _head(n: int, crc: int) -> bytes:
    h = struct.pack(">II", n, crc)
    return h + struct.pack(">I", zlib.crc32(h))


HUGE = _head(1 << 31, 0)  # a header that is sound but announces a length no frame has
BAD_HEAD = _head(10, 0)[:-1] + b"\x00"  # a header whose own CRC fails


def applied(path: Path) -> list[str]:
    """What the follower wrote beyond its own lock and position files."""
    return sorted(n for n in os.listdir(path) if n not in ("LOCK", "replica.state"))


def wait_error(follower: Any, text: str) -> None:
    end = time.monotonic() + 10
    while time.monotonic() < end:
        err = follower.status()["last_error"] or ""
        if text in err:
            return
        time.sleep(0.01)
    raise AssertionError(follower.status())


# SPEC R1 (bad input): a port that speaks something else
def test_r1_a_port_that_is_not_an_armdb_primary(tmp_path: Path, fake: Any) -> None:
    http = fake(lambda c: c.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"))
    with pytest.raises(armdb.ReplicationError, match="does not answer as an armdb primary"):
        armdb.Db.follow(tmp_path / "f", primary=http.address)
    assert applied(tmp_path / "f") == []
    closer = fake(lambda c: None)  # accepts, then hangs up
    with pytest.raises(armdb.ReplicationError, match="does not answer as an armdb primary"):
        armdb.Db.follow(tmp_path / "f", primary=closer.address)
    msgpack_but_not_ours = fake(lambda c: c.sendall(encode_frame({"hello": "world"})))
    with pytest.raises(armdb.ReplicationError, match="does not answer as an armdb primary"):
        armdb.Db.follow(tmp_path / "f", primary=msgpack_but_not_ours.address)
    free = socket.create_server(LOCAL)
    port = free.getsockname()[1]
    free.close()
    with pytest.raises(armdb.ReplicationError, match="cannot connect to the primary"):
        armdb.Db.follow(tmp_path / "f", primary=("127.0.0.1", port))
    with pytest.raises(armdb.ConfigError, match="primary must be"):
        armdb.Db.follow(tmp_path / "f", primary="127.0.0.1:7070")  # type: ignore[arg-type]
    assert applied(tmp_path / "f") == []


# SPEC R6 (bad input): a frame of an unknown version
def test_r6_a_primary_of_another_replication_version(tmp_path: Path, fake: Any) -> None:
    future = fake(lambda c: c.sendall(hello(version=VERSION + 1)))
    with pytest.raises(armdb.ReplicationFrameError, match="replication version"):
        armdb.Db.follow(tmp_path / "f", primary=future.address)
    assert applied(tmp_path / "f") == []


# SPEC R6: a frame whose CRC fails is never applied; the follower drops the connection
def test_r6_a_frame_with_a_bad_crc_is_not_applied(tmp_path: Path, fake: Any) -> None:
    def script(c: socket.socket) -> None:
        c.sendall(hello() + encode_frame(["S", 0]))
        frame = bytearray(encode_frame(["D", "collections"]))
        frame[-1] ^= 0x40  # one bit of the body flipped: the CRC no longer matches
        c.sendall(bytes(frame))

    bad = fake(script)
    follower = armdb.Db.follow(tmp_path / "f", primary=bad.address)
    try:
        wait_error(follower, "CRC")
        assert applied(tmp_path / "f") == []
        assert not follower.status()["snapshot_complete"]
        with pytest.raises(armdb.ReplicationError, match="not finished copying"):
            follower.promote()
    finally:
        follower.close()
    assert isinstance(armdb.ReplicationFrameError("x"), armdb.CorruptionError)


# SPEC R6: a length that no frame has, a path outside the directory, a frame out of order
@pytest.mark.parametrize(
    ("payload", "text"),
    [
        (HUGE, "claims"),
        (BAD_HEAD, "header failed its CRC"),
        (hello() + encode_frame(["S", 0]) + encode_frame(["W", "../evil", 0, b"x"]), "not inside a database"),
        (hello() + encode_frame(["S", 0]) + encode_frame(["W", "/etc/evil", 0, b"x"]), "not inside a database"),
        (hello() + encode_frame(["S", 0]) + encode_frame(["C", "LOCK", True]), "never replicated"),
        (hello() + encode_frame(["S", 0]) + encode_frame(["E", 0]) + encode_frame([2, "D", "x"]), "where 1 was next"),
        (hello() + encode_frame(["S", 0]) + encode_frame(["Z", "x"]), "unknown"),
        (hello() + encode_frame(["S", 0]) + encode_frame(["W", "x"]), "cannot read"),
    ],
)
def test_r6_hostile_frames_are_refused(tmp_path: Path, fake: Any, payload: bytes, text: str) -> None:
    if payload in (HUGE, BAD_HEAD):
        srv = fake(lambda c: c.sendall(payload))
        with pytest.raises(armdb.ReplicationError, match="does not answer as an armdb primary"):
            armdb.Db.follow(tmp_path / "f", primary=srv.address)
        assert applied(tmp_path / "f") == []
        return
    srv = fake(lambda c: c.sendall(payload))
    follower = armdb.Db.follow(tmp_path / "f", primary=srv.address)
    try:
        wait_error(follower, text)
    finally:
        follower.close()
    assert applied(tmp_path / "f") == []
    assert not (tmp_path / "evil").exists()


# SPEC R1 (bad input): a primary of another database
def test_r1_a_primary_of_another_database_is_refused(tmp_path: Path, primary: Primary, clock: Any) -> None:
    follower = armdb.Db.follow(tmp_path / "f", primary=primary.address)
    primary.load(0, 5)
    settle(primary, follower)
    follower.close()
    before = {p: p.read_bytes() for p in (tmp_path / "f").rglob("*") if p.is_file() and p.name != "LOCK"}
    other = Primary(tmp_path / "other", clock)
    try:
        with pytest.raises(armdb.ReplicaMismatch, match="another database"):
            armdb.Db.follow(tmp_path / "f", primary=other.address)
    finally:
        other.db.close()
    after = {p: p.read_bytes() for p in (tmp_path / "f").rglob("*") if p.is_file() and p.name != "LOCK"}
    assert after == before  # nothing applied


# SPEC R1 (bad input): a directory that is a database of its own, or holds something else
def test_r1_a_normal_database_cannot_become_a_follower(tmp_path: Path, primary: Primary) -> None:
    armdb.Db.open(tmp_path / "mine").close()
    with pytest.raises(armdb.ReplicationError, match="database of its own"):
        armdb.Db.follow(tmp_path / "mine", primary=primary.address)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("mine")
    with pytest.raises(armdb.ConfigError, match="not empty"):
        armdb.Db.follow(tmp_path / "junk", primary=primary.address)
    assert armdb.check(tmp_path / "mine").ok


# SPEC R6: a state file that fails its CRC is refused, not guessed
def test_r6_a_damaged_position_file_is_refused(tmp_path: Path, primary: Primary) -> None:
    follower = armdb.Db.follow(tmp_path / "f", primary=primary.address)
    follower.close()
    state = tmp_path / "f" / "replica.state"
    raw = bytearray(state.read_bytes())
    assert len(raw) == 8192  # two copies, written alternately in place
    raw[30] ^= 1  # one copy torn: the other one is read
    state.write_bytes(bytes(raw))
    armdb.Db.follow(tmp_path / "f", primary=primary.address).close()
    raw = bytearray(state.read_bytes())
    for base in (0, 4096):  # both copies damaged (each CRC made wrong for its bytes): refused, not guessed
        n = struct.unpack_from("<I", raw, base + 12)[0]
        good = zlib.crc32(bytes(raw[base + 12 : base + 24 + min(n, 4000)]))
        struct.pack_into("<I", raw, base + 8, good ^ 0x5A5A5A5A)
    state.write_bytes(bytes(raw))
    with pytest.raises(armdb.ReplicationError, match="damaged"):
        armdb.Db.follow(tmp_path / "f", primary=primary.address)


# SPEC R1, R3, R6: a re-copy is built beside the complete copy, which stays promotable
def test_r6_a_recopy_cut_short_leaves_the_complete_copy_promotable(tmp_path: Path, primary: Primary,
                                                                    clock: Any) -> None:
    follower = armdb.Db.follow(tmp_path / "f", primary=primary.address)
    primary.load(0, 10)
    settle(primary, follower)
    primary.db.close()
    settle(primary, follower)
    follower.close()
    db_id = check_meta((tmp_path / "primary" / "db.meta").read_bytes(), "db.meta").db_id

    def restarted_primary_that_dies_mid_copy(c: socket.socket) -> None:
        c.sendall(hello(db_id=db_id, stream=b"n" * 16) + encode_frame(["S", 0]) + encode_frame(["D", "collections"])
                  + encode_frame(["C", "db.meta", True]) + encode_frame(["T", "db.meta", 0]))

    fake_p = FakePrimary(restarted_primary_that_dies_mid_copy)
    try:
        f2 = armdb.Db.follow(tmp_path / "f", primary=fake_p.address)
        end = time.monotonic() + 10
        while not (f2.status()["recopying"] and (tmp_path / "f.resync" / "db.meta").exists()):
            assert time.monotonic() < end, f2.status()
            time.sleep(0.01)
        assert (tmp_path / "f.resync" / "db.meta").stat().st_size == 0  # the new copy, half built
        db = f2.promote(clock=clock, schema=schema())
    finally:
        fake_p.close()
    try:
        got = contents(db)
    finally:
        db.close()
    assert not (tmp_path / "f.resync").exists()
    want = armdb.Db.open(tmp_path / "primary", clock=clock, schema=schema())
    try:
        assert got == contents(want)
    finally:
        want.close()


# SPEC R6: a crash in the middle of swapping a re-copy in leaves one whole copy
@pytest.mark.parametrize("crash_after", ["first_rename", "before_rename"])
def test_r6_an_interrupted_swap_is_finished_or_undone(tmp_path: Path, primary: Primary, crash_after: str) -> None:
    follower = armdb.Db.follow(tmp_path / "f", primary=primary.address)
    primary.load(0, 3)
    settle(primary, follower)
    follower.close()
    f, staging, old = tmp_path / "f", tmp_path / "f.resync", tmp_path / "f.old"
    shutil.copytree(f, staging)
    marker = {"db_id": b"x", "stream": b"new!" * 4, "seq": 0, "complete": True}
    (staging / "replica.state").write_bytes(_encode_state(marker))
    if crash_after == "first_rename":
        f.rename(old)  # the crash came between the two renames: the complete re-copy wins
    else:
        (staging / "replica.state").unlink()  # not yet marked complete: it is dropped
    _finish_swap(str(f), str(staging))
    assert f.is_dir() and not staging.exists() and not old.exists()
    state = (f / "replica.state").read_bytes()
    assert (b"new!" in state) == (crash_after == "first_rename")
