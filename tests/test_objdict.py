"""``armdb._objdict.own_dict``: the instance dict a compiled kernel reads and writes is the
object's live, combined ``__dict__``, installed once (docs/performance.md, round 14)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import armdb
from armdb._objdict import install_own_dict, own_dict


class _Thing:
    def __init__(self, own: bool) -> None:
        self.a = 1
        self.b = "two"
        if own:
            install_own_dict(self)


def test_own_dict_is_the_dict_the_class_installed() -> None:
    t = _Thing(own=True)
    d = own_dict(t)
    assert d is vars(t) and own_dict(t) is d  # installed once, at construction
    assert (t.a, t.b) == (1, "two")
    t.c = 3  # a later attribute lands in the same dict
    d["a"] = 10  # and a write through the dict is the attribute
    assert d["c"] == 3 and t.a == 10


def test_own_dict_refuses_an_object_that_installed_none() -> None:
    # A dict copied after construction could lose another thread's attribute write.
    with pytest.raises(TypeError, match="install_own_dict"):
        own_dict(_Thing(own=False))


def test_the_compiled_var_queue_reads_the_live_dicts(tmp_path: Path) -> None:
    # The compiled var queue took the dicts of the Db, the queue, its body store and the
    # log at open and at its first ack; an instance attribute set afterwards must reach
    # it, so no one replaced a dict it holds.
    with armdb.Db.open(tmp_path / "db") as db:
        q = db.open_queue(armdb.queue("jobs", payload=dict, var=True))
        for i in range(2):
            q.push({"n": i})
        (first,) = q.lease(1)
        q.ack(first.token)  # the compiled ack: it takes the log's dict here
        for obj in (db, q, q._payload, db.txlog):
            assert vars(obj) is own_dict(obj)
        seen: list[bytes] = []
        append = db.txlog.append_body

        def recording(body: bytes, parts: Any = None, behind: bool = False) -> int:
            seen.append(bytes(body))
            return append(body, parts, behind)

        db.txlog.append_body = recording  # type: ignore[method-assign]
        (second,) = q.lease(1)
        q.ack(second.token)
        assert len(seen) == 1 and len(q) == 0
