"""SPEC Q36: dataclass payloads evolve as users expect.

Adding a field with a default (or ``default_factory``) and removing a field are
compatible: rows written before decode with the default for a field they lack, and a
stored field the class no longer has is dropped.  Changing a field's type, or adding a
field without a default, raises ``SchemaMismatch`` naming the field.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import armdb
from armdb import Db, QueueConfig
from armdb.errors import FormatError, SchemaMismatch
from armdb.qrows import decode_meta
from armdb.qspec import LAYOUT_TAG

from .conftest import FakeClock


def cfg() -> QueueConfig:
    return QueueConfig.balanced().build()


@dataclass
class JobV1:
    doc: int
    reason: str


@dataclass
class JobV2:  # a field added with a default
    doc: int
    reason: str
    priority: int = 5


@dataclass
class JobV3:  # 'reason' removed, a default_factory added
    doc: int
    priority: int = 5
    tags: list[str] = field(default_factory=list)


def _queue(cls: type) -> armdb.QueueSpec:
    # The same queue name, declared with another class (what a new release of a pipeline does).
    return armdb.queue("jobs", payload=cls, var=True)


def _lease_all(q: armdb.Queue) -> list:
    out = []
    while batch := q.lease(16):
        for lease in batch:
            out.append(lease.payload)
            q.ack(lease.token)
    return out


def test_q36_added_defaulted_field_old_rows_decode_with_the_default(tmp_path: Path):
    with Db.open(tmp_path / "db", clock=FakeClock()) as db:
        q = db.open_queue(_queue(JobV1), cfg())
        q.push(JobV1(1, "old"))
    with Db.open(tmp_path / "db", clock=FakeClock()) as db:
        q = db.open_queue(_queue(JobV2), cfg())
        q.push(JobV2(2, "new", priority=9))
        got = sorted(_lease_all(q), key=lambda j: j.doc)
    assert got == [JobV2(1, "old", 5), JobV2(2, "new", 9)]


def test_q36_removed_field_is_dropped_and_history_is_kept_across_reopens(tmp_path: Path):
    path = tmp_path / "db"
    with Db.open(path, clock=FakeClock()) as db:
        db.open_queue(_queue(JobV1), cfg()).push(JobV1(1, "v1"))
    with Db.open(path, clock=FakeClock()) as db:
        db.open_queue(_queue(JobV2), cfg()).push(JobV2(2, "v2", 7))
    with Db.open(path, clock=FakeClock()) as db:
        db.open_queue(_queue(JobV3), cfg()).push(JobV3(3, 1, ["x"]))
    meta = decode_meta((path / "collections" / "jobs" / "queue.meta").read_bytes(), "queue.meta")
    assert [[n for n, _t in lay] for lay in meta["layouts"]] == [
        ["doc", "reason"], ["doc", "reason", "priority"], ["doc", "priority", "tags"]]
    assert meta["layout"] == 2 and meta["fingerprint"] == _queue(JobV3).fingerprint
    with Db.open(path, clock=FakeClock()) as db:
        got = sorted(_lease_all(db.open_queue(_queue(JobV3), cfg())), key=lambda j: j.doc)
    # rows of every earlier layout decode; 'reason' is dropped, 'tags' defaults to []
    assert got == [JobV3(1, 5, []), JobV3(2, 7, []), JobV3(3, 1, ["x"])]


def test_q36_going_back_to_an_earlier_class_reuses_its_layout(tmp_path: Path):
    path = tmp_path / "db"
    with Db.open(path, clock=FakeClock()) as db:
        db.open_queue(_queue(JobV1), cfg()).push(JobV1(1, "a"))
    with Db.open(path, clock=FakeClock()) as db:
        db.open_queue(_queue(JobV2), cfg()).push(JobV2(2, "b", 3))
    with Db.open(path, clock=FakeClock()) as db:  # a rollback to the first release
        q = db.open_queue(_queue(JobV1), cfg())
        q.push(JobV1(3, "c"))
        got = sorted(_lease_all(q), key=lambda j: j.doc)
    assert got == [JobV1(1, "a"), JobV1(2, "b"), JobV1(3, "c")]
    meta = decode_meta((path / "collections" / "jobs" / "queue.meta").read_bytes(), "queue.meta")
    assert len(meta["layouts"]) == 2 and meta["layout"] == 0


def test_q36_bodies_of_a_later_layout_carry_its_tag(tmp_path: Path):
    path = tmp_path / "db"
    with Db.open(path, clock=FakeClock()) as db:
        db.open_queue(_queue(JobV1), cfg()).push(JobV1(1, "a"))
    with Db.open(path, clock=FakeClock()) as db:
        q = db.open_queue(_queue(JobV2), cfg())
        raw = q._codec.encode(JobV2(2, "b", 3))
    assert raw[:2] == LAYOUT_TAG and struct.unpack(">H", raw[2:4])[0] == 1


@dataclass
class JobTypeChanged:
    doc: str  # was int
    reason: str


@dataclass
class JobNoDefault:
    doc: int
    reason: str
    owner: str  # added without a default


@pytest.mark.parametrize(("cls", "match"), [
    (JobTypeChanged, r"field 'doc'.*stored as int and is now str"),
    (JobNoDefault, r"field 'owner' was added .* without a default"),
])
def test_q36_incompatible_change_raises_schema_mismatch_naming_the_field(tmp_path: Path, cls, match):
    path = tmp_path / "db"
    with Db.open(path, clock=FakeClock()) as db:
        db.open_queue(_queue(JobV1), cfg()).push(JobV1(1, "a"))
    meta_path = path / "collections" / "jobs" / "queue.meta"
    before = meta_path.read_bytes()
    with Db.open(path, clock=FakeClock()) as db:
        with pytest.raises(SchemaMismatch, match=match):
            db.open_queue(_queue(cls), cfg())
        assert meta_path.read_bytes() == before  # nothing changed
        assert _lease_all(db.open_queue(_queue(JobV1), cfg())) == [JobV1(1, "a")]


def test_q36_a_type_change_against_any_earlier_layout_is_refused(tmp_path: Path):
    # 'reason' was a str in layout 0, dropped in layout 1; re-adding it as an int would
    # decode layout 0's strings as the wrong type.
    @dataclass
    class NoReason:
        doc: int

    @dataclass
    class ReasonInt:
        doc: int
        reason: int = 0

    path = tmp_path / "db"
    with Db.open(path, clock=FakeClock()) as db:
        db.open_queue(_queue(JobV1), cfg()).push(JobV1(1, "a"))
    with Db.open(path, clock=FakeClock()) as db:
        db.open_queue(_queue(NoReason), cfg())
    with Db.open(path, clock=FakeClock()) as db, pytest.raises(SchemaMismatch, match="field 'reason'"):
        db.open_queue(_queue(ReasonInt), cfg())


def test_q36_other_payload_kinds_still_match_exactly(tmp_path: Path):
    with Db.open(tmp_path / "db", clock=FakeClock()) as db:
        db.open_queue(armdb.queue("jobs", payload=dict, var=True), cfg())
    with Db.open(tmp_path / "db", clock=FakeClock()) as db, pytest.raises(SchemaMismatch, match="payload schema"):
        db.open_queue(_queue(JobV2), cfg())


def test_q36_damaged_layouts_in_queue_meta_are_a_format_error(tmp_path: Path):
    from armdb.qrows import encode_meta

    path = tmp_path / "db"
    with Db.open(path, clock=FakeClock()) as db:
        db.open_queue(_queue(JobV1), cfg())
    meta_path = path / "collections" / "jobs" / "queue.meta"
    meta = decode_meta(meta_path.read_bytes(), "m")
    bad = encode_meta(True, meta["fingerprint"], meta["shard_count"], meta["value_size"],
                      [[["doc", "int"]]], 3)  # the current layout index is past the list
    os.chmod(meta_path, 0o600)
    meta_path.write_bytes(bad)
    with Db.open(path, clock=FakeClock()) as db, pytest.raises(FormatError, match="payload layouts"):
        db.open_queue(_queue(JobV1), cfg())


def test_q36_rows_of_the_old_layout_survive_a_crash_after_the_change(tmp_path: Path):
    # The new layout is in queue.meta (written atomically) before any body uses it: a
    # process killed right after pushing with the new class leaves rows of both layouts
    # that the next open reads.
    from .conftest import run_child

    path = tmp_path / "db"
    with Db.open(path) as db:
        db.open_queue(_queue(JobV1), cfg()).push(JobV1(1, "old"))
    code = f"""
    import os, signal
    from dataclasses import dataclass
    import armdb
    @dataclass
    class JobV2:
        doc: int
        reason: str
        priority: int = 5
    JobV2.__qualname__ = JobV2.__name__ = "JobV2"
    db = armdb.Db.open({str(path)!r})
    q = db.open_queue(armdb.queue("jobs", payload=JobV2, var=True), armdb.QueueConfig.balanced().build())
    q.push(JobV2(2, "new", 8))
    os.kill(os.getpid(), signal.SIGKILL)
    """
    r = run_child(code)
    assert r.returncode == -9, r.stderr
    with Db.open(path) as db:  # the child's clock: the real one
        got = sorted(_lease_all(db.open_queue(_queue(JobV2), cfg())), key=lambda j: j.doc)
    assert got == [JobV2(1, "old", 5), JobV2(2, "new", 8)]
    assert armdb.check(path).ok


def test_q36_fields_are_dataclass_fields():
    # (guards the test classes: the layouts above follow dataclasses.fields order)
    assert [f.name for f in dataclasses.fields(JobV3)] == ["doc", "priority", "tags"]
