"""armdb._core.locks.Lock, the compiled lock of the stores' shards, the log and the payload
cache, against threading.Lock, whose interface it has."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from armdb import _fs
from armdb._core.locks import Lock, draw_turns, serve_turns, take_for_plan, take_turns

calls = st.lists(
    st.one_of(
        st.just(("acquire", ())),
        st.just(("acquire", (False,))),
        st.tuples(st.just("acquire"), st.tuples(st.booleans(), st.sampled_from([-1, 0, 0.001, -2, 1e300]))),
        st.just(("release", ())),
        st.just(("locked", ())),
    ),
    max_size=40,
)


def _outcome(lock: Any, name: str, args: tuple[Any, ...]) -> object:
    try:
        return getattr(lock, name)(*args)
    except Exception as e:  # noqa: BLE001 - the same error class is the point
        return type(e)


@settings(max_examples=200, deadline=None)
@given(calls)
def test_q28_lock_answers_as_threading_lock(seq: list[tuple[str, tuple[Any, ...]]]) -> None:
    # SPEC Q28: the same results and errors as threading.Lock for any sequence of calls
    # in one thread (a blocking acquire of a held lock is left out: it would wait forever)
    ours, ref = Lock(), threading.Lock()
    for name, args in seq:
        if name == "acquire" and ref.locked() and (not args or (args[0] and args[1] < 0 and args[1] == -1)):
            continue
        assert _outcome(ours, name, args) == _outcome(ref, name, args), (name, args)
        assert ours.locked() == ref.locked()


def test_q28_lock_excludes_across_threads_and_times_out() -> None:
    # SPEC Q28: one holder at a time; a waiter gets it once released; a timeout gives False
    lock = Lock()
    count = 0

    def work() -> None:
        nonlocal count
        for _ in range(2000):
            with lock:
                n = count
                if n % 97 == 0:
                    time.sleep(0)  # another thread runs inside the critical section, unless excluded
                count = n + 1

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert count == 8000 and not lock.locked()
    assert lock.acquire()
    t0 = time.monotonic()
    assert lock.acquire(timeout=0.05) is False
    assert time.monotonic() - t0 >= 0.045
    threading.Timer(0.05, lock.release).start()  # any thread may release it, as threading.Lock
    assert lock.acquire(timeout=5) is True
    lock.release()


def test_q28_condition_waits_on_it() -> None:
    # SPEC Q28: threading.Condition works over it (the log's checkpoint waits so)
    cond = threading.Condition(Lock())
    ready: list[int] = []

    def put() -> None:
        with cond:
            ready.append(1)
            cond.notify_all()

    with cond:
        threading.Thread(target=put).start()
        assert cond.wait_for(lambda: ready, timeout=5)
    with pytest.raises(RuntimeError):
        cond.notify()  # not held: the Condition finds out through acquire(False)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_q28_a_signal_reaches_a_thread_blocked_on_it() -> None:
    # SPEC Q28: a blocked acquire runs signal handlers, whose exception propagates
    lock = Lock()
    lock.acquire()

    class Interrupted(Exception):
        pass

    def handler(signum: int, frame: object) -> None:
        raise Interrupted

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        with pytest.raises(Interrupted):
            lock.acquire()
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert lock.locked()
    lock.release()


# -- the apply turnstile (docs/transactions.md, "The apply turnstile") ------------------------


class _Log:
    """What take_for_plan reads of the transaction log: whether a checkpoint waits."""

    _idle_waiting = 0


def _ticket(lock: Any) -> int:
    """Draw a turn as a commit does: under the lock, right after its append."""
    assert take_for_plan([lock], True, _Log()) is (lock.pending > 0)
    return int(draw_turns([lock])[0])


def _apply(lock: Any, t: int, during: Any = None) -> None:
    take_turns([lock], [t])
    try:
        if during is not None:
            during()
    finally:
        serve_turns([lock], [t])
        lock.release()


# SPEC T7 (project choice): turns are served in the order they were drawn, whatever the
# order the waiters arrive in.
def test_t7_turns_are_served_in_ticket_order() -> None:
    lock = Lock()
    tickets = [_ticket(lock) for _ in range(12)]
    assert tickets == list(range(12)) and lock.pending == 12 and not lock.locked()
    order: list[int] = []
    threads = [threading.Thread(target=_apply, args=(lock, t, lambda t=t: order.append(t))) for t in reversed(tickets)]
    for th in threads:
        th.start()
        time.sleep(0.002)
    for th in threads:
        th.join(10)
    assert order == tickets and lock.pending == 0 and not lock.locked()


# SPEC T7 (project choice): a plain acquire waits until no logged commit waits on the
# shard, and makes blind commits wait with it; a blind commit plans on top otherwise.
def test_t7_acquire_waits_for_the_shard_to_drain() -> None:
    lock, other = Lock(), Lock()
    t = _ticket(lock)
    assert lock.acquire(False) is False and not lock.locked()
    assert lock.acquire(True, 0.02) is False and not lock.locked()
    assert take_for_plan([lock, other], True, _Log()) is True  # blind: on top of it
    assert lock.locked() and other.locked()
    lock.release()
    other.release()
    got = threading.Event()

    def direct() -> None:
        with lock:
            got.set()

    th = threading.Thread(target=direct)
    th.start()
    deadline = time.monotonic() + 5
    while lock.draining == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert lock.draining == 1 and not got.is_set()
    planned = threading.Event()

    def blind() -> None:  # waits with the drainer, holding nothing
        take_for_plan([lock], True, _Log())
        planned.set()
        lock.release()

    tb = threading.Thread(target=blind)
    tb.start()
    time.sleep(0.02)
    assert not planned.is_set() and not got.is_set() and not lock.locked()
    _apply(lock, t)
    th.join(5)
    tb.join(5)
    assert got.is_set() and planned.is_set() and lock.draining == 0 and lock.pending == 0 and not lock.locked()


# SPEC T7 (project choice): a committer that holds a shard with a waiting commit never
# blocks on another lock: it lets go and starts again once that lock is free.
def test_t7_a_committer_behind_others_backs_off_a_busy_lock() -> None:
    first, second = Lock(), Lock()
    t = _ticket(first)
    second.acquire()
    done = threading.Event()

    def commit() -> None:
        take_for_plan([first, second], True, _Log())
        done.set()
        first.release()
        second.release()

    th = threading.Thread(target=commit)
    th.start()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # it lets go of ``first`` while it waits
        time.sleep(0.005)
        if not first.locked():
            break
    assert not first.locked() and not done.is_set()
    _apply(first, t)  # the waiting commit can apply: nobody holds its shard
    second.release()
    th.join(5)
    assert done.is_set() and not first.locked() and not second.locked()


# SPEC T7 (project choice): the compiled kernels' take() waits too: a direct push into a
# header shard with a commit waiting to apply there returns only once it has applied.
def test_t7_a_direct_push_waits_for_a_logged_commit_on_its_shard(tmp_path: Any) -> None:
    from armdb import Db, FixedConfig, QueueConfig
    from armdb._bench import BenchFixed, _fixed_payload

    with Db.open(str(tmp_path / "db")) as db:
        header = FixedConfig.balanced().shard_count(1).enable_fsync(False).build()
        q = db.open_queue(BenchFixed, QueueConfig.balanced().header_config(header).build())
        q.push(_fixed_payload(0))
        lock = q._shards[0].lock
        t = _ticket(lock)
        done = threading.Event()

        def push() -> None:
            q.push(_fixed_payload(1))
            done.set()

        th = threading.Thread(target=push)
        th.start()
        time.sleep(0.05)
        assert not done.is_set() and q.len() == 1
        _apply(lock, t)
        th.join(5)
        assert done.is_set() and q.len() == 2


# SPEC T7 (project choice): a direct call is not kept out of a shard by a steady stream
# of durable commits on it: while it waits, committers step back.
def test_t7_direct_calls_are_not_starved_by_durable_commits(tmp_path: Any) -> None:
    from armdb import Config, Db, FixedConfig, QueueConfig
    from armdb._bench import BenchFixed, _fixed_payload

    with Db.open(str(tmp_path / "db")) as db:
        m = db.open_map("m", Config.balanced().shard_count(1).enable_fsync(False).build())
        header = FixedConfig.balanced().shard_count(1).enable_fsync(False).build()
        q = db.open_queue(BenchFixed, QueueConfig.balanced().header_config(header).build())
        stop = threading.Event()
        commits = [0] * 4

        def committer(t: int) -> None:
            i = 0
            while not stop.is_set():
                db.tx().put(m, f"{t}-{i}", i).push(q, _fixed_payload(i)).durable().commit()
                commits[t] += 1
                i += 1

        threads = [threading.Thread(target=committer, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        try:
            while sum(commits) < 20:
                time.sleep(0.001)
            before = sum(commits)
            for i in range(100):  # each waits for the commits ahead of it, then goes first
                q.push(_fixed_payload(i))
                m.put(f"direct-{i}", i)
            assert sum(commits) > before  # the commits went on meanwhile
        finally:
            stop.set()
            for th in threads:
                th.join(30)
        assert not any(th.is_alive() for th in threads)
        assert q.len() == sum(commits) + 100 and all(m.get(f"direct-{i}") == i for i in range(100))


class _HeldSync(_fs.RealFS):
    """The real file system, except that the log's ``fdatasync`` waits for ``go`` while
    ``hold`` is set."""

    def __init__(self) -> None:
        self.hold = False
        self.go = threading.Event()
        self.waiting = threading.Event()

    def fdatasync(self, fd: int) -> None:
        if self.hold:
            self.waiting.set()
            self.go.wait(10)
        super().fdatasync(fd)


# SPEC T7 (project choice): a blind commit that planned on top of a commit waiting for
# its sync, when a checkpoint starts right then, appends without waiting for the
# checkpoint, which waits for the very commit whose shard it holds.  (Had it waited,
# the three would wait for each other for ever.)
def test_t7_a_commit_behind_others_does_not_wait_for_a_checkpoint(tmp_path: Any) -> None:
    from armdb import Config, Db, TxConfig
    from armdb.tx import Tx

    fs = _HeldSync()
    with _fs.use(fs):
        db = Db.open(str(tmp_path / "db"), tx_config=TxConfig(checkpoint_bytes=1 << 30))
        m = db.open_map("m", Config.balanced().shard_count(1).enable_fsync(False).build())
        m.put("warm", 0)
        fs.hold = True
        first = threading.Thread(target=lambda: db.tx().put(m, "a", 1).durable().commit())
        first.start()  # logged, its locks released, its sync held
        assert fs.waiting.wait(10)
        checkpoint = threading.Thread(target=db.txlog.checkpoint)
        plan = Tx._plan

        def plan_then_checkpoint(self: Any, *args: Any) -> None:
            plan(self, *args)
            if not checkpoint.is_alive() and checkpoint.ident is None:
                checkpoint.start()  # it waits for the first commit to finish
                deadline = time.monotonic() + 10
                while not db.txlog._idle_waiting and time.monotonic() < deadline:
                    time.sleep(0.001)
                assert db.txlog._idle_waiting

        second_done = threading.Event()

        def second() -> None:
            Tx._plan = plan_then_checkpoint  # type: ignore[method-assign]
            try:
                db.tx().put(m, "b", 2).commit()
            finally:
                Tx._plan = plan  # type: ignore[method-assign]
            second_done.set()

        ts = threading.Thread(target=second)
        ts.start()
        deadline = time.monotonic() + 10
        while not db.txlog._idle_waiting and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.05)  # the second commit has appended by now (it does not wait)
        fs.hold = False
        fs.go.set()
        for th in (first, ts, checkpoint):
            th.join(10)
        alive = [th for th in (first, ts, checkpoint) if th.is_alive()]
        assert not alive, "the commits and the checkpoint wait for each other"
        assert second_done.is_set() and m.get("a") == 1 and m.get("b") == 2
        db.close()
