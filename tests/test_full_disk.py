"""A full disk is a ``StorageError``, never a signal, and loses nothing (SPEC S2, S12, E).

``fixed.data`` and ``fixed.redo`` are memory-mapped and written through the map.  A
store into a page whose blocks were never allocated must allocate them at fault
time; on a full file system that fails with ``SIGBUS`` and kills the process.  So
the store allocates the blocks (``fallocate``) when it creates or grows a file,
before the new range is mapped, and a full disk shows up there, as an error from a
system call.

The first tests mount a real, size-limited tmpfs (root is needed; CI runs as root),
fill it, and run the workload in a child process, so that a ``SIGBUS`` ends the child
with exit code -7 and fails the test instead of killing pytest.  The last ones check
the allocation itself: the holes of a file an older armdb left sparse, and the
zero-writing fallback where a file system has no ``fallocate``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import armdb
from tests.reliability.journal import report_line

ROOT = Path(__file__).resolve().parent.parent
MOUNT_SIZE = "4m"
CHILD_TIMEOUT = 120

# Figures of this module's runs, for its RELIABILITY line (the CI figures table;
# "violations" counts the children a signal killed, the other counters add to it).
FIGURES = {"runs": 0, "pushes_returned": 0, "puts_returned": 0, "storage_errors": 0, "signals": 0,
           "untyped_exceptions": 0, "lost": 0, "check_failures": 0}


@pytest.fixture(scope="module", autouse=True)
def _summary(request: pytest.FixtureRequest) -> Iterator[None]:
    t0 = time.monotonic()
    yield
    f = FIGURES
    line = (
        f"RELIABILITY full-disk runs={f['runs']} pushes_returned={f['pushes_returned']} "
        f"puts_returned={f['puts_returned']} storage_errors={f['storage_errors']} "
        f"violations={f['signals']} signals={f['signals']} "
        f"untyped_exceptions={f['untyped_exceptions']} lost={f['lost']} "
        f"check_failures={f['check_failures']} fs=tmpfs:{MOUNT_SIZE} seconds={time.monotonic() - t0:.0f}"
    )
    report_line(line, request)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs mounted in the test's directory, unmounted afterwards."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    try:
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={MOUNT_SIZE}", "tmpfs", str(mnt)],
            capture_output=True, text=True, check=False,
        )
        problem = f"mount exited {r.returncode}: {r.stderr.strip()}" if r.returncode else ""
    except OSError as e:  # no mount(8) at all
        problem = f"mount(8) could not be run: {e}"
    if problem:
        pytest.fail(
            f"this test needs root (CAP_SYS_ADMIN) and mount(8) to mount a size-limited tmpfs at {mnt}: "
            f"{problem}",
            pytrace=False,
        )
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)


# The child: open a database on the small file system, fill the disk, push until the
# disk is full, and report on stdout (JSON) which calls returned and which raised.
CHILD = textwrap.dedent(
    r"""
    import errno, faulthandler, json, os, sys
    faulthandler.enable()
    import numpy as np
    import armdb
    from armdb import Db, FixedConfig, QueueConfig, Config
    from armdb.errors import ArmdbError, StorageError

    db_dir, filler, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    FIX = armdb.queue("fq", payload=np.dtype([("n", "<u8"), ("pad", "S56")]))
    VAR = armdb.queue("vq", payload=bytes, var=True)
    FIX_STEP, VAR_STEP = 256, 1024  # grow steps: 32 KiB and 64 KiB of header file
    def qconf(step):
        header = FixedConfig.balanced().grow_step(step).build()
        return QueueConfig.balanced().header_config(header).backoff_secs([0]).build()
    out = {"fixed": [], "var": [], "errors": [], "map": {}}

    def fill(leave):
        # Fill the file system completely, then give back ``leave`` bytes.
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        chunk = b"\xff" * 65536
        try:
            while True:
                os.write(fd, chunk)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
        os.close(fd)
        give_back(leave)

    def give_back(n):
        os.truncate(filler, max(0, os.stat(filler).st_size - n))

    def err(where, e):
        out["errors"].append([where, type(e).__name__, str(e)])

    def push(name, q, n):
        try:
            out[name].append([q.push(b"v%08d" % n if name == "var" else (n, b"f%d" % n)), n])
        except ArmdbError as e:
            err("push " + name, e)
            return False
        return True

    db = Db.open(db_dir)
    fq = db.open_queue(FIX, qconf(FIX_STEP))
    vq = db.open_queue(VAR, qconf(VAR_STEP))
    m = db.open_map("m", Config.balanced().build())
    if mode == "queues":
        n = 0
        for n in range(1, VAR_STEP - 64 + 1):
            assert push("var", vq, n)
        # 64 free header slots of the var queue, room for their bodies, less than its
        # next grow step: the header file's growth meets the full disk.
        fill(64 * 256 + 8192)
        failed = 0
        while failed < 5:
            n += 1
            failed += not push("var", vq, n)
        # Room again for some grow steps; push to both until each has failed several
        # times (a failure must not poison what follows: each later push fails the
        # same typed way or succeeds).
        give_back(384 * 1024)
        failed = {"fixed": 0, "var": 0}
        while min(failed.values()) < 5 and n < 100_000:
            n += 1
            for name, q in (("fixed", fq), ("var", vq)):
                if failed[name] < 5:
                    failed[name] += not push(name, q, n)
        out["pushes"] = n
        # A transaction whose push needs a new slot: refused before anything is logged.
        try:
            db.tx().put(m, b"tx-key", b"tx-value").push(fq, (0, b"tx")).durable().commit()
            out["tx"] = "committed"
        except ArmdbError as e:
            out["tx"] = type(e).__name__
            out["tx_error"] = str(e)
        # The disk is still full: rows the fixed queue already has keep leasing and acking.
        got = fq.lease(3)
        out["leased_fixed"] = [x.id for x in got]
        for x in got[:2]:
            fq.ack(x.token)
        out["acked_fixed"] = [x.id for x in got[:2]]
        out["nacked_fixed"] = []
        for x in got[2:]:
            fq.nack(x.token, delay=0)
            out["nacked_fixed"].append(x.id)
        try:
            out["leased_var"] = [x.id for x in vq.lease(2)]
        except ArmdbError as e:
            err("lease var", e)
    else:
        for i in range(20):
            m.put(b"k%d" % i, b"value-%d" % i * 20)
        fill(0)
        try:
            for i in range(20, 10_000):
                m.put(b"k%d" % i, b"value-%d" % i * 20)
                out["map"][str(i)] = True
        except ArmdbError as e:
            err("map put", e)
        out["map_after"] = {k.decode(): v.decode() for k, v in m.items() if int(k[1:]) < 20}
    try:
        db.close()
    except ArmdbError as e:
        err("close", e)
        db.shutdown()
    # Reopening while the disk is still full either works or is a StorageError.
    try:
        with Db.open(db_dir) as db:
            db.open_queue(FIX, qconf(FIX_STEP))
            db.open_queue(VAR, qconf(VAR_STEP))
            db.open_map("m", Config.balanced().build())
        out["reopen_full"] = "ok"
    except ArmdbError as e:
        out["reopen_full"] = type(e).__name__
    print("RESULT " + json.dumps(out))
    """
)


def run_child(db_dir: Path, filler: Path, mode: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(db_dir), str(filler), mode],
        capture_output=True, text=True, timeout=CHILD_TIMEOUT, env=env, cwd=str(ROOT), check=False,
    )
    FIGURES["runs"] += 1
    if r.returncode < 0:
        FIGURES["signals"] += 1
        name = signal.Signals(-r.returncode).name
        pytest.fail(f"the workload on a full disk was killed by {name} (exit {r.returncode}):\n{r.stderr[-3000:]}")
    assert r.returncode == 0, f"the workload child failed (exit {r.returncode}):\n{r.stderr[-3000:]}"
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, f"no result from the child:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    out = json.loads(line[len("RESULT "):])
    FIGURES["pushes_returned"] += len(out["fixed"]) + len(out["var"])
    FIGURES["puts_returned"] += len(out["map"])
    FIGURES["storage_errors"] += sum(cls == "StorageError" for _w, cls, _m in out["errors"])
    FIGURES["untyped_exceptions"] += sum(cls != "StorageError" for _w, cls, _m in out["errors"])
    return out


def test_s2_full_disk_push_is_a_storage_error_and_loses_nothing(small_fs: Path) -> None:
    """Push to a fixed and a var queue until the disk is full: the process survives,
    every failed push raised StorageError, rows already stored keep leasing and
    acking, and after freeing space a reopen has every push that returned."""
    import numpy as np

    db_dir, filler = small_fs / "db", small_fs / "filler"
    out = run_child(db_dir, filler, "queues")
    assert out["reopen_full"] in ("ok", "StorageError"), out["reopen_full"]
    kinds = {(where, cls) for where, cls, _msg in out["errors"] if where.startswith("push")}
    assert {w for w, _ in kinds} == {"push fixed", "push var"}, f"the disk never filled: {out['errors'][:4]}"
    assert {cls for _, cls in kinds} == {"StorageError"}, out["errors"][:6]
    # Both header files met the full disk while growing, and said so.
    for name in ("fixed", "var"):
        msgs = [msg for where, _c, msg in out["errors"] if where == "push " + name]
        assert any("fixed.data: the disk is full" in msg for msg in msgs), msgs[:3]
    # Several grow steps (256 slots each) succeeded before the disk filled.
    assert len(out["fixed"]) > 3 * 256 and len(out["var"]) > 1024, (len(out["fixed"]), len(out["var"]))
    assert len(out["acked_fixed"]) == 2, out
    assert out["tx"] == "StorageError" and "disk is full" in out["tx_error"], (out["tx"], out.get("tx_error"))
    bad = [e for e in out["errors"] if not e[0].startswith("push") and e[0] != "close"]
    assert not [e for e in bad if e[0] != "lease var"], bad
    assert all(cls == "StorageError" for _w, cls, _m in out["errors"]), out["errors"]

    filler.unlink()  # free the space, then reopen
    fix = armdb.queue("fq", payload=np.dtype([("n", "<u8"), ("pad", "S56")]))
    var = armdb.queue("vq", payload=bytes, var=True)
    acked = set(out["acked_fixed"])
    later = int(time.time() * 1000) + 7_200_000  # past the leases the child left open
    with armdb.Db.open(db_dir, clock=lambda: later) as db:
        def qconf(step: int) -> armdb.QueueConfig:
            return armdb.QueueConfig.balanced().header_config(
                armdb.FixedConfig.balanced().grow_step(step).build()).build()
        fq = db.open_queue(fix, qconf(256))
        vq = db.open_queue(var, qconf(1024))
        want_fixed = {i: n for i, n in out["fixed"] if i not in acked}
        want_var = {i: n for i, n in out["var"]}
        got_fixed = {x.id: x.payload for x in fq.lease(len(want_fixed) + 10)}
        got_var = {x.id: x.payload for x in vq.lease(len(want_var) + 10)}
        FIGURES["lost"] += len(set(want_fixed) - set(got_fixed)) + len(set(want_var) - set(got_var))
        assert set(got_fixed) == set(want_fixed), (
            f"fixed: {len(set(want_fixed) - set(got_fixed))} returned push(es) missing, "
            f"{len(set(got_fixed) - set(want_fixed))} unexpected"
        )
        assert set(got_var) == set(want_var), (
            f"var: {len(set(want_var) - set(got_var))} returned push(es) missing, "
            f"{len(set(got_var) - set(want_var))} unexpected"
        )
        for i, n in want_fixed.items():
            assert int(got_fixed[i]["n"]) == n and bytes(got_fixed[i]["pad"]) == b"f%d" % n
        assert db.open_map("m").get(b"tx-key") is None  # the refused transaction left nothing
        for i, n in want_var.items():
            assert got_var[i] == b"v%08d" % n
        # With room again, the queues grow and accept pushes.
        for k in range(1100):
            fq.push((k, b"again"))
            vq.push(b"again")  # past 2,048 rows: the var header file grows too
    rep = armdb.check(db_dir)
    FIGURES["check_failures"] += not rep.ok
    assert rep.ok, rep.findings


def test_s12_full_disk_map_put_is_a_storage_error_and_keeps_data(small_fs: Path) -> None:
    """A map put on a full disk raises StorageError; what was stored stays readable,
    in the process and after a reopen with space freed."""
    db_dir, filler = small_fs / "db", small_fs / "filler"
    out = run_child(db_dir, filler, "map")
    assert out["reopen_full"] in ("ok", "StorageError"), out["reopen_full"]
    puts = [e for e in out["errors"] if e[0] == "map put"]
    assert len(puts) == 1 and puts[0][1] == "StorageError", out["errors"]
    want = {f"k{i}": f"value-{i}" * 20 for i in range(20)}
    assert out["map_after"] == want
    filler.unlink()
    with armdb.Db.open(db_dir) as db:
        m = db.open_map("m")
        extra = [int(k) for k in out["map"]]
        FIGURES["lost"] += sum(m.get(b"k%d" % i) != (b"value-%d" % i * 20) for i in [*range(20), *extra])
        for i in range(20):
            assert m.get(b"k%d" % i) == (b"value-%d" % i * 20)
        for i in extra:
            assert m.get(b"k%d" % i) == (b"value-%d" % i * 20)
        m.put(b"after", b"room again")
    rep = armdb.check(db_dir)
    FIGURES["check_failures"] += not rep.ok
    assert rep.ok, rep.findings


# ------------------------------------------------------------- allocation without a tmpfs


def _sparse_copy(path: Path) -> None:
    """Rewrite ``path`` as an older armdb left it: only pages holding data allocated."""
    data = path.read_bytes()
    tmp = path.with_suffix(".sparse")
    with open(tmp, "wb") as f:
        for off in range(0, len(data), 4096):
            page = data[off : off + 4096]
            if any(page):
                f.seek(off)
                f.write(page)
        f.truncate(len(data))
    os.replace(tmp, path)


def test_s2_open_allocates_the_holes_of_a_sparse_header_file(tmp_path: Path) -> None:
    """A fixed.data / fixed.redo an older armdb extended sparse gets every block at the
    next open, so its stores cannot meet a full disk inside the map either."""
    import numpy as np

    spec = armdb.queue("fq", payload=np.dtype([("n", "<u8")]))
    with armdb.Db.open(tmp_path / "db") as db:
        q = db.open_queue(spec)
        ids = [q.push((i,)) for i in range(10)]
    files = sorted((tmp_path / "db").rglob("fixed.*"))
    assert {p.name for p in files} == {"fixed.data", "fixed.redo"}
    for p in files:
        _sparse_copy(p)
    data = next(p for p in files if p.name == "fixed.data")
    assert data.stat().st_blocks * 512 < data.stat().st_size // 10  # sparse now
    with armdb.Db.open(tmp_path / "db") as db:
        q = db.open_queue(spec)
        assert sorted(x.id for x in q.lease(20)) == ids
    for p in files:
        assert p.stat().st_blocks * 512 >= p.stat().st_size, p
    assert armdb.check(tmp_path / "db").ok


@pytest.mark.parametrize("errno_", [95, 22], ids=["EOPNOTSUPP", "EINVAL"])
def test_s2_without_fallocate_the_blocks_are_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, errno_: int
) -> None:
    """A file system without fallocate: the new range is written with zeros (through the
    seam), never skipped, and no byte of data changes."""
    import errno

    import numpy as np

    from armdb import _fs

    assert errno_ in (errno.EOPNOTSUPP, errno.EINVAL)

    def unsupported(fd: int, offset: int, length: int) -> None:
        raise OSError(errno_, os.strerror(errno_))

    path = tmp_path / "f"
    content = bytearray(3 * 4096 + 100)
    content[4096 + 7] = 1  # page 1 holds data, pages 0 and 2 and the tail do not
    with open(path, "wb") as f:
        f.seek(4096)
        f.write(content[4096 : 2 * 4096])
        f.truncate(len(content))
    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    writes: list[tuple[int, int]] = []

    class Counting(_fs.RealFS):
        def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> None:
            writes.append((offset, len(data)))
            super().pwrite(fd, data, offset)

    fs = Counting()
    fd = fs.open(str(path), os.O_RDWR)
    try:
        fs.fallocate(fd, 0, 5 * 4096)
    finally:
        fs.close(fd)
    assert path.read_bytes() == bytes(content) + bytes(5 * 4096 - len(content))
    assert path.stat().st_blocks * 512 >= 5 * 4096
    assert (4096, 4096) not in writes and all(not (o <= 4096 + 7 < o + n) for o, n in writes), writes

    # A whole database on such a file system: opens, grows, reopens, checks clean.
    spec = armdb.queue("fq", payload=np.dtype([("n", "<u8")]))
    qconf = armdb.QueueConfig.balanced().header_config(armdb.FixedConfig.balanced().grow_step(64).build()).build()
    with armdb.Db.open(tmp_path / "db") as db:
        q = db.open_queue(spec, qconf)
        ids = [q.push((i,)) for i in range(150)]  # two growths
    with armdb.Db.open(tmp_path / "db") as db:
        q = db.open_queue(spec, qconf)
        assert sorted(x.id for x in q.lease(200)) == ids
    data = next((tmp_path / "db").rglob("fixed.data"))
    assert data.stat().st_blocks * 512 >= data.stat().st_size
    assert armdb.check(tmp_path / "db").ok


def test_s2_a_real_allocation_error_is_not_papered_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only "not supported" falls back to writing; ENOSPC or EIO from fallocate is raised."""
    from armdb import _fs

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, os.strerror(28))

    monkeypatch.setattr(os, "posix_fallocate", full)
    path = tmp_path / "f"
    path.write_bytes(b"x")
    fs = _fs.RealFS()
    fd = fs.open(str(path), os.O_RDWR)
    try:
        with pytest.raises(OSError) as info:
            fs.fallocate(fd, 0, 8192)
        assert info.value.errno == 28
    finally:
        fs.close(fd)
    assert path.read_bytes() == b"x"
