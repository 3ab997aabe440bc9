"""The queue rules have one definition (armdb/_core/qrow.pxd, exposed by armdb.transitions).

* The row offsets the kernels use are those of ``armdb.qrows.ROW_DTYPE``.
* The compiled push and claim (armdb._core.qshard) leave exactly the image that the
  Python face of the same rule computes, on random rows (a differential test), and
  both agree with a small pure-Python model of the rule written from docs/spec.md.
* A nack whose retry time would reach the dead key class is refused (it once wrote a
  ready row there, which the next open refused as corruption).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import armdb
from armdb import ConfigError, Db, QueueConfig, State, transitions
from armdb._core import qrow
from armdb._core.qshard import QueueShard
from armdb.config import FixedConfig
from armdb.fixed import FixedShard
from armdb.qrows import (
    DEAD_BIT,
    FLAG_DEAD_EXPLICIT,
    FLAG_POISONED,
    HEADER_SIZE,
    KEY_SIZE,
    MAX_DUE_MS,
    MAX_FIXED_PAYLOAD,
    ROW_DTYPE,
    ROW_SIZE,
    pack_row,
)

PSIZE = 8  # inline payload of the shard the differential tests use
NOW = 1_700_000_000_000
U32 = (1 << 32) - 1


# -- the layout ---------------------------------------------------------------------------------


def _flat_offsets(dtype: np.dtype, base: int = 0) -> dict[str, int]:
    out: dict[str, int] = {}
    assert dtype.names is not None
    for name in dtype.names:
        sub, off = dtype.fields[name][:2]  # type: ignore[index]
        if sub.names is not None:
            out.update(_flat_offsets(sub, base + off))
        else:
            out[name] = base + off
    return out


def test_q8_kernel_row_offsets_are_the_row_dtype() -> None:
    assert qrow.OFFSETS == _flat_offsets(ROW_DTYPE)
    assert qrow.SIZES == {"key": KEY_SIZE, "header": HEADER_SIZE, "row": ROW_SIZE, "max_payload": MAX_FIXED_PAYLOAD}
    assert ROW_DTYPE.itemsize == ROW_SIZE == KEY_SIZE + HEADER_SIZE
    assert qrow.STATES == {s.name: s.value for s in State}
    assert qrow.FLAGS == {"DEAD_EXPLICIT": FLAG_DEAD_EXPLICIT, "POISONED": FLAG_POISONED}
    # The byte order of every field: one row packed by armdb.qrows, read through the dtype.
    raw = pack_row(0x0102030405060708, 9, 1, 2, 3, 4, -5, 6, 7)
    row = np.frombuffer(raw, ROW_DTYPE)[0]
    assert (int(row["due"]), int(row["seq"])) == (0x0102030405060708, 9)
    assert tuple(int(x) for x in row["header"].tolist()) == (1, 2, 3, 4, -5, 6, 7)


# -- a model of the rules, from docs/spec.md (Q9, Q13, Q14) -------------------------------------------



def _fields(image: bytes) -> list[int]:
    due, seq = struct.unpack_from(">QQ", image)
    return [due, seq, *struct.unpack_from("<BBHIqQq", image, 16)]


def _image(f: list[int], rest: bytes) -> bytes:
    return struct.pack(">QQ", f[0], f[1]) + struct.pack("<BBHIqQq", *f[2:]) + rest


def model_lease(image: bytes, now: int, deadline: int, max_attempts: int) -> tuple[bytes, int]:
    f = _fields(image)
    expired = f[2] == State.LEASED
    if expired and f[4] >= max_attempts:
        f[0], f[2] = DEAD_BIT | now, State.DEAD
        return _image(f, image[ROW_SIZE:]), transitions.EXPIRED_DEAD
    f[2], f[4], f[5], f[6] = State.LEASED, (f[4] + 1) & 0xFFFF, (f[5] + 1) & U32, deadline
    return _image(f, image[ROW_SIZE:]), transitions.RELEASED if expired else transitions.LEASED


def model_nack(image: bytes, now: int, retry_at: int, dead: bool, poisoned: bool, max_attempts: int) -> tuple[bytes, int]:
    f = _fields(image)
    if dead or f[4] >= max_attempts:
        f[0], f[2] = DEAD_BIT | now, State.DEAD
        if dead:
            f[3] |= FLAG_DEAD_EXPLICIT | (FLAG_POISONED if poisoned else 0)
        return _image(f, image[ROW_SIZE:]), transitions.NACK_DEAD
    f[0], f[2] = retry_at, State.READY
    return _image(f, image[ROW_SIZE:]), transitions.RETRY


# -- random rows ------------------------------------------------------------------------------------


@st.composite
def due_rows(draw: st.DrawFn) -> bytes:
    """A row a lease scan could hand to the claim: ready and due, or an expired lease."""
    leased = draw(st.booleans())
    due = draw(st.integers(0, NOW))
    seq = draw(st.integers(1, (1 << 63) - 1))
    flags = draw(st.sampled_from([0, 0, 1, 2, 3]))
    attempts = draw(st.integers(0, 0xFFFF))
    epoch = draw(st.integers(0, U32))
    deadline = draw(st.integers(1, NOW)) if leased else draw(st.sampled_from([0, 0, NOW - 5, -3]))
    pid = draw(st.integers(0, (1 << 64) - 1))
    pushed = draw(st.integers(-(1 << 63), (1 << 63) - 1))
    payload = draw(st.binary(min_size=PSIZE, max_size=PSIZE))
    state = State.LEASED if leased else State.READY
    return pack_row(due, seq, state, flags, attempts, epoch, deadline, pid, pushed, payload)


@pytest.fixture(scope="module")
def shard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FixedShard, QueueShard]]:
    fx = FixedShard(str(tmp_path_factory.mktemp("qrow") / "shard"), 0, KEY_SIZE, HEADER_SIZE + PSIZE,
                    FixedConfig(grow_step=64))
    try:
        yield fx, QueueShard(fx, PSIZE, False)
    finally:
        fx.close()


def _index_deadline(image: bytes) -> int:
    f = _fields(image)
    return max(0, f[6]) if f[2] == State.LEASED else 0


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(image=due_rows(), ahead=st.integers(1, 10**9), max_attempts=st.integers(1, 0xFFFF))
def test_q9_compiled_claim_applies_the_lease_rule(shard: tuple[FixedShard, QueueShard], image: bytes, ahead: int,
                                                  max_attempts: int) -> None:
    fx, sh = shard
    now, deadline = NOW, NOW + ahead
    want, outcome = transitions.lease(image, now, deadline, max_attempts)
    assert (want, outcome) == model_lease(image, now, deadline, max_attempts)
    due, seq = struct.unpack_from(">QQ", image)
    with fx.lock:
        slot = fx.alloc()
        fx.write(slot, image)
        sh.live.insert(due, seq, slot, _index_deadline(image))
        before = (sh.dead_lettered, sh.expired_leases)
        got = sh.claim_one(due, seq, slot, now, deadline, max_attempts, 0)
        stored = fx.body(slot)[: ROW_SIZE + PSIZE]
        in_live, in_dead = sh.live.get(due, seq), sh.dead.get(DEAD_BIT | now, seq)
        # clean up for the next example
        if in_live is not None:
            sh.live.remove(due, seq)
        if in_dead is not None:
            sh.dead.remove(DEAD_BIT | now, seq)
        fx.free(slot)
    assert stored == want
    after = (sh.dead_lettered - before[0], sh.expired_leases - before[1])
    if outcome == transitions.EXPIRED_DEAD:
        assert got is False and in_live is None and in_dead == (slot, 0) and after == (1, 1)
    else:
        f = _fields(want)
        assert got[:5] == (due, seq, 0, f[4], f[5]) and got[5] == image[ROW_SIZE:]
        assert in_live == (slot, deadline) and in_dead is None
        assert after == (0, 1 if outcome == transitions.RELEASED else 0)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(due=st.integers(0, MAX_DUE_MS - 1), seq=st.integers(1, (1 << 63) - 1), now=st.integers(0, (1 << 62)),
       payload=st.binary(min_size=PSIZE, max_size=PSIZE))
def test_q9_compiled_push_writes_the_push_rule(shard: tuple[FixedShard, QueueShard], due: int, seq: int, now: int,
                                               payload: bytes) -> None:
    fx, sh = shard
    want = transitions.push(seq, due, now, 0, payload)
    assert want == pack_row(due, seq, State.READY, 0, 0, 0, 0, 0, now, payload)
    with fx.lock:
        slot = sh.push(due, seq, now, 0, payload)
        stored = fx.body(slot)[: ROW_SIZE + PSIZE]
        sh.live.remove(due, seq)
        fx.free(slot)
    assert stored == want


@settings(max_examples=400, deadline=None)
@given(image=due_rows(), wait=st.integers(0, 10**12), dead=st.booleans(), poisoned=st.booleans(),
       max_attempts=st.integers(1, 0xFFFF))
def test_q14_nack_rule_matches_the_model(image: bytes, wait: int, dead: bool, poisoned: bool, max_attempts: int) -> None:
    f = _fields(image)
    leased = _image([f[0], f[1], State.LEASED, *f[3:]], image[ROW_SIZE:])
    config = QueueConfig.balanced().max_attempts(max_attempts).build()
    moved = transitions.nack(leased, NOW, config, wait, dead, poisoned)
    want, outcome = model_nack(leased, NOW, NOW + wait, dead, poisoned, max_attempts)
    assert moved.image == want
    assert moved.dead == (outcome == transitions.NACK_DEAD)
    assert moved.due == struct.unpack_from(">Q", want)[0]


def test_q14_nack_without_delay_waits_the_backoff() -> None:
    config = QueueConfig.balanced().backoff_secs([1, 10, 60]).max_attempts(9).build()
    for attempts, wait in ((1, 1000), (2, 10_000), (3, 60_000), (7, 60_000)):
        image = pack_row(5, 1, State.LEASED, 0, attempts, 3, NOW + 9, 0, 4)
        assert transitions.nack(image, NOW, config, None, False).due == NOW + wait


# -- the bug the rule's one place showed --------------------------------------------------------------

Jobs = armdb.queue("jobs", payload=np.dtype([("a", "<u8")]))
VarJobs = armdb.queue("vjobs", payload=dict, var=True)


@pytest.mark.parametrize("how", ["fixed", "var", "tx"])
def test_q14_nack_delay_past_the_last_due_time_is_refused_and_changes_nothing(db_path: Path, how: str) -> None:
    """``nack(delay=...)`` with a retry time at or past 2**63 ms wrote a READY row into the
    dead key class, and the next open refused the queue as corrupt."""
    spec = Jobs if how == "fixed" else VarJobs
    huge = MAX_DUE_MS / 1000  # seconds: a retry time past 2**63 ms from any now
    with Db.open(db_path) as db:
        q = db.open_queue(spec)
        q.push((1,) if spec is Jobs else {"a": 1})
        (lease,) = q.lease(1)
        with pytest.raises(ConfigError, match="delay must not be negative and is at most"):
            if how == "tx":
                db.tx().nack(q, lease.token, delay=huge).commit()
            else:
                q.nack(lease.token, delay=huge)
        assert q.stats().leased == 1
        q.nack(lease.token, delay=huge, dead=True)  # a dead-letter needs no retry time
        assert q.dead_len() == 1
    with Db.open(db_path) as db:
        assert db.open_queue(spec).dead_len() == 1
    assert armdb.check(db_path).ok
