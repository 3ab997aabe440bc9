"""The database directory as hostile ground: the lock file, read-only inspection, what
``Db.open`` refuses to take over, file modes, and the clock (SPEC D1, D7, D9, D10).

Read-only directories: root ignores permission bits, so as root (CI) the read-only view
is a real read-only bind mount of the database; as another user it is the same directory
with its folders made ``0555``.  Either way the process cannot write there.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import armdb
from armdb import Config, ConfigError, Db, DbLocked, FixedConfig, QueueConfig, cli
from armdb.check import check

from .conftest import FakeClock

PAYLOAD = np.dtype([("doc", "<u8"), ("flags", "<u4")])
Pings = armdb.queue("pings", payload=PAYLOAD)
SMALL = QueueConfig.balanced().header_config(FixedConfig.balanced().grow_step(8).build()).build()


@dataclass
class Job:
    doc_id: int
    reason: str


Jobs = armdb.queue("jobs", payload=Job, var=True)


def tree(path: Path) -> dict[str, tuple[str, int]]:
    """Content hash (or link target) and mode of every entry under ``path``."""
    out: dict[str, tuple[str, int]] = {}
    for p in sorted(path.rglob("*")):
        st = p.lstat()
        if stat.S_ISLNK(st.st_mode):
            digest = "-> " + os.readlink(p)
        elif stat.S_ISREG(st.st_mode):
            digest = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            digest = "<dir>"
        out[str(p.relative_to(path))] = (digest, st.st_mode)
    return out


def small_db(path: Path) -> None:
    """A closed database with a fixed queue (ready, leased, dead rows), a var queue and a map."""
    with Db.open(path, clock=FakeClock()) as db:
        q = db.open_queue(Pings, SMALL)
        for i in range(5):
            q.push((i, i))
        leases = q.lease(2)
        q.nack(leases[0].token, dead=True)
        jobs = db.open_queue(Jobs)
        jobs.push(Job(1, "a"))
        db.open_map("m").put("k", "v")


@contextlib.contextmanager
def read_only_view(path: Path, mountpoint: Path) -> Iterator[Path]:
    """``path`` as a directory this process cannot write (see the module docstring)."""
    if os.geteuid() == 0:
        mountpoint.mkdir()
        subprocess.run(["mount", "--bind", str(path), str(mountpoint)], check=True)
        try:
            subprocess.run(["mount", "-o", "remount,bind,ro", str(mountpoint)], check=True)
            assert not os.access(mountpoint, os.W_OK)
            yield mountpoint
        finally:
            subprocess.run(["umount", str(mountpoint)], check=True)
        return
    dirs = [path, *(p for p in path.rglob("*") if p.is_dir() and not p.is_symlink())]
    modes = {d: d.stat().st_mode for d in dirs}
    for d in reversed(dirs):
        d.chmod(0o555)
    try:
        assert not os.access(path, os.W_OK)
        yield path
    finally:
        for d in dirs:
            d.chmod(stat.S_IMODE(modes[d]))


# ---------------------------------------------------------------- the lock file (D1)


def test_d1_lock_symlink_is_refused_and_its_target_untouched(db_path: Path, tmp_path: Path) -> None:
    small_db(db_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (db_path / "LOCK").unlink()
    (db_path / "LOCK").symlink_to(victim)
    before = tree(db_path)
    with pytest.raises(ConfigError, match=r"LOCK.* symbolic link.*remove"):
        Db.open(db_path)
    with pytest.raises(ConfigError, match=r"LOCK.* symbolic link.*remove"):
        check(db_path)
    assert victim.read_text() == "precious\n"
    assert tree(db_path) == before
    (db_path / "LOCK").unlink()  # what the message says to do
    with Db.open(db_path) as db:
        assert db.open_map("m").get("k") == "v"


def test_d1_dangling_lock_symlink_creates_nothing(tmp_path: Path) -> None:
    db_path = tmp_path / "db"
    db_path.mkdir()
    target = tmp_path / "elsewhere" / "planted"
    (tmp_path / "elsewhere").mkdir()
    (db_path / "LOCK").symlink_to(target)
    with pytest.raises(ConfigError, match="symbolic link"):
        Db.open(db_path)
    assert not target.exists()
    assert sorted(os.listdir(db_path)) == ["LOCK"]


def test_d1_lock_hard_link_to_another_file_is_refused(db_path: Path, tmp_path: Path) -> None:
    small_db(db_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (db_path / "LOCK").unlink()
    os.link(victim, db_path / "LOCK")
    with pytest.raises(ConfigError, match=r"LOCK.*other (hard )?links.*remove"):
        Db.open(db_path)
    with pytest.raises(ConfigError, match=r"LOCK.*other (hard )?links"):
        check(db_path)
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_d1_lock_that_is_not_a_regular_file_is_refused(db_path: Path, kind: str) -> None:
    small_db(db_path)
    lock = db_path / "LOCK"
    lock.unlink()
    if kind == "directory":
        lock.mkdir()
    else:
        os.mkfifo(lock)
    with pytest.raises(ConfigError, match=rf"LOCK.* is a {kind}.*remove"):
        Db.open(db_path)
    with pytest.raises(ConfigError, match=rf"LOCK.* is a {kind}"):
        check(db_path)
    with read_only_view(db_path, db_path.parent / "ro") as ro:  # read-only inspection too
        with pytest.raises(ConfigError, match=rf"LOCK.* is a {kind}"):
            check(ro)


def test_d1_lock_is_private_and_not_inherited(db_path: Path) -> None:
    with Db.open(db_path) as db:
        fd = db._dirlock.fd  # type: ignore[union-attr]
        assert os.get_inheritable(fd) is False
        assert os.fstat(fd).st_nlink == 1


# ---------------------------------------------------------- read-only inspection (D10)


def test_d10_check_on_a_read_only_directory_writes_nothing(db_path: Path, tmp_path: Path) -> None:
    small_db(db_path)
    (db_path / "LOCK").write_text("424242\n")  # a stale pid that check must leave alone
    before = tree(db_path)
    with read_only_view(db_path, tmp_path / "ro") as ro:
        report = check(ro)
        assert report.ok, report.findings
        assert tree(ro) == before
    assert tree(db_path) == before


def test_d10_check_on_a_read_only_copy_without_a_lock_file(db_path: Path, tmp_path: Path) -> None:
    small_db(db_path)
    (db_path / "LOCK").unlink()  # e.g. a backup that left it out
    before = tree(db_path)
    with read_only_view(db_path, tmp_path / "ro") as ro:
        assert check(ro).ok
    assert tree(db_path) == before


def test_d10_read_only_check_still_sees_a_live_owner(db_path: Path, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        small_db(db_path)  # a non-root view chmods the open database's folders: keep it short
    with Db.open(db_path, clock=FakeClock()) as db:
        db.open_map("m").put("k", "v")
        with read_only_view(db_path, tmp_path / "ro") as ro:
            with pytest.raises(DbLocked, match=rf"process {os.getpid()}\b"):
                check(ro)
            assert cli.main(["check", str(ro)]) == 2
            assert cli.main(["stats", str(ro)]) == 1


def test_d10_cli_stats_and_check_on_a_read_only_directory(
    db_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    small_db(db_path)
    before = tree(db_path)
    with read_only_view(db_path, tmp_path / "ro") as ro:
        assert cli.main(["stats", str(ro)]) == 0
        out = capsys.readouterr().out
        assert "queue pings (fixed, 1 shard)" in out
        assert "queue jobs (var" in out
        assert "read-only" in out
        assert cli.main(["check", str(ro)]) == 0
        assert "OK" in capsys.readouterr().out
    assert tree(db_path) == before


def test_d10_check_on_a_writable_directory_takes_the_lock_as_before(db_path: Path) -> None:
    small_db(db_path)
    (db_path / "LOCK").write_text("424242\n")
    assert check(db_path).ok
    assert (db_path / "LOCK").read_text().strip() == str(os.getpid())
    with Db.open(db_path):
        with pytest.raises(DbLocked):
            check(db_path)
    assert cli.main(["check", str(db_path)]) == 0


def test_cli_check_exit_codes(db_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", str(tmp_path / "missing")]) == 2
    assert not (tmp_path / "missing").exists()
    small_db(db_path)
    (db_path / "collections" / "pings" / "queue.meta").write_bytes(b"garbage")
    assert cli.main(["check", str(db_path)]) == 1
    assert "queue.meta" in capsys.readouterr().out


# --------------------------------------------------- what Db.open refuses to take over (D9)


def test_d9_empty_path_raises_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="empty"):
        Db.open("")
    assert os.listdir(tmp_path) == []


def test_d9_non_empty_directory_without_db_meta_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "photos"
    other.mkdir()
    (other / "cat.jpg").write_bytes(b"\xff\xd8 not a database")
    (other / "sub").mkdir()
    before = tree(other)
    with pytest.raises(ConfigError, match=r"not empty.*db\.meta"):
        Db.open(other)
    assert tree(other) == before  # no LOCK, no db.meta, no collections/


def test_d9_a_lock_file_alone_is_a_creation_cut_short(tmp_path: Path) -> None:
    # A crash between taking the lock and writing db.meta leaves LOCK (and maybe db.meta.tmp).
    d = tmp_path / "db"
    d.mkdir()
    (d / "LOCK").write_text("999999\n")
    (d / "db.meta.tmp").write_bytes(b"half")
    with Db.open(d) as db:
        db.open_map("m").put(1, 2)
    assert check(d).ok


def test_d9_missing_and_empty_directories_become_databases(tmp_path: Path) -> None:
    nested = tmp_path / "a" / "b" / "db"
    with Db.open(nested) as db:
        db.open_map("m").put(1, 2)
    assert (nested / "db.meta").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    Db.open(empty).shutdown()
    assert (empty / "db.meta").is_file()
    with Db.open(nested) as db:  # and an existing database opens as before
        assert db.open_map("m").get(1) == 2


def test_d9_path_must_be_text(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="path"):
        Db.open(os.fsencode(tmp_path / "db"))  # type: ignore[arg-type]
    assert not (tmp_path / "db").exists()


# ------------------------------------------------------------------------ file modes


def every_kind_workload(path: Path) -> None:
    """Create every kind of file armdb writes: fixed and var queues, a map with rotated,
    compacted and hinted files, logged transactions, id blocks, a reopen, a check."""
    clock = FakeClock()
    small_files = Config.balanced().max_file_size(64 * 1024).build()
    with Db.open(path, clock=clock) as db:
        q = db.open_queue(Pings, SMALL)
        jobs = db.open_queue(Jobs)
        m = db.open_map("m", small_files)
        for i in range(3000):  # past an id block, so the seqmap is rewritten
            q.push((i, i))
        leases = q.lease(10)
        q.ack(leases[0].token)
        q.nack(leases[1].token, dead=True)
        for i in range(200):  # rotates the map's active file
            m.put(i, "x" * 500)
        for i in range(100):
            m.put(i, "y")
        m.store.compact()  # rewrites the live part of the first file, with a hint
        for i in range(50):
            jobs.push(Job(i, "r"))
        with db.tx() as tx:
            tx.put(m, "k", "v").push(jobs, Job(99, "tx"))
        (lz,) = jobs.lease(1)
        db.tx().ack(jobs, lz.token).put(m, "done", 1).commit()
    with Db.open(path, clock=clock) as db:
        db.open_queue(Pings, SMALL).push((1, 1))
        db.open_queue(Jobs).push(Job(1, "again"))
        assert db.open_map("m", small_files).get("k") == "v"
    assert check(path).ok


def loose_modes(path: Path) -> list[str]:
    """Every entry at or under ``path`` that its group or other users may access."""
    out = []
    for p in [path, *path.rglob("*")]:
        mode = p.lstat().st_mode
        if not stat.S_ISLNK(mode) and mode & 0o077:
            out.append(f"{p.relative_to(path.parent)}: {stat.filemode(mode)}")
    return out


@pytest.mark.parametrize("umask", [0o022, 0o000], ids=["umask022", "umask000"])
def test_new_files_and_folders_are_private_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    path = tmp_path / "parent" / "db"  # a missing parent is created private too
    old = os.umask(umask)
    try:
        every_kind_workload(path)
    finally:
        os.umask(old)
    names = {p.name for p in path.rglob("*")}
    assert {"LOCK", "db.meta", "seqmap", "fixed.data", "queue.meta"} <= names
    assert any(n.endswith(".hint") for n in names) and any(n.endswith(".data") for n in names)
    assert loose_modes(path.parent) == []


def test_existing_modes_are_kept(db_path: Path) -> None:
    small_db(db_path)
    shared = [db_path, db_path / "db.meta", db_path / "seqmap", db_path / "LOCK", db_path / "collections"]
    for p in shared:
        p.chmod(0o750 if p.is_dir() else 0o640)
    every_kind_workload(db_path)  # rewrites seqmap (tmp + rename) and LOCK
    for p in shared:
        assert stat.S_IMODE(p.stat().st_mode) == (0o750 if p.is_dir() else 0o640), p


def test_a_setgid_folder_shares_new_files_with_its_group(tmp_path: Path) -> None:
    path = tmp_path / "db"
    path.mkdir()
    path.chmod(0o2750)  # chmod g+rxs: the group may read what armdb creates here
    old = os.umask(0o022)
    try:
        every_kind_workload(path)
    finally:
        os.umask(old)
    for p in path.rglob("*"):
        mode = stat.S_IMODE(p.stat().st_mode)
        if p.is_dir():
            assert mode == 0o2750, (p, oct(mode))
        else:
            assert mode == 0o640, (p, oct(mode))


# ---------------------------------------------------------------------- the clock (D7)

NOW_MS = 1_700_000_000_000
BAD_CLOCKS = {
    "microseconds": (NOW_MS * 1000, "microseconds"),
    "seconds": (NOW_MS // 1000, "seconds"),
    "negative": (-5, "int from"),
    "zero": (0, "int from"),
    "year_2300": (10_500_000_000_000, "int from"),
    "none": (None, "NoneType"),
    "string": (str(NOW_MS), "str"),
    "bytes": (b"1700000000000", "bytes"),
    "float": (float(NOW_MS), "return an int"),
    "fractional_float": (NOW_MS + 0.5, "return an int"),
    "nan": (float("nan"), "float"),
    "bool": (True, "bool"),
    "list": ([NOW_MS], "list"),
}


@pytest.mark.parametrize("kind", sorted(BAD_CLOCKS))
def test_d7_clock_returning_no_plausible_milliseconds_is_refused_at_open(tmp_path: Path, kind: str) -> None:
    value, hint = BAD_CLOCKS[kind]
    path = tmp_path / "db"
    with pytest.raises(ConfigError, match="the clock returned") as ei:
        Db.open(path, clock=lambda: value)
    assert hint in str(ei.value)
    assert repr(value) in str(ei.value)
    assert not path.exists()  # refused before anything was created


def test_d7_numpy_integer_clock_is_accepted(db_path: Path) -> None:
    with Db.open(db_path, clock=lambda: np.int64(NOW_MS)) as db:
        q = db.open_queue(Pings, SMALL)
        rid = q.push((1, 1))
        (due,) = q.snapshot()["due"][q.snapshot()["id"] == rid]
        assert due == np.datetime64(NOW_MS, "ms")


@pytest.mark.parametrize("kind", ["none", "microseconds", "string", "float", "negative"])
def test_d7_clock_turning_bad_later_raises_at_the_call_and_writes_nothing(db_path: Path, kind: str) -> None:
    reading: list[object] = [NOW_MS]
    with Db.open(db_path, clock=lambda: reading[0]) as db:
        q = db.open_queue(Pings, SMALL)
        jobs = db.open_queue(Jobs)
        m = db.open_map("m")
        kept = q.push((1, 1))
        reading[0] = BAD_CLOCKS[kind][0]
        calls = [
            lambda: q.push((2, 2)),
            lambda: q.lease(1),
            lambda: q.stats(),
            lambda: jobs.push(Job(1, "x")),
            lambda: db.tx().put(m, "k", "v").push(jobs, Job(2, "y")).commit(),
            lambda: db.sweep_expired_now(),
        ]
        for call in calls:
            with pytest.raises(ConfigError, match="the clock returned"):
                call()
        reading[0] = NOW_MS + 1000  # the clock is fixed: everything works again
        assert q.len() == 1 and jobs.len() == 0 and "k" not in m
        (lz,) = q.lease(1)
        assert lz.id == kept
        q.ack(lz.token)
    assert check(db_path).ok


def test_d10_check_falls_back_to_read_only_where_lock_cannot_be_written(db_path: Path) -> None:
    """A writable folder whose LOCK belongs to someone else (EACCES on opening it for
    writing): check inspects read-only instead of failing."""
    import errno

    from armdb import _fs

    small_db(db_path)
    (db_path / "LOCK").write_text("424242\n")
    before = tree(db_path)

    class LockNotOurs(_fs.RealFS):
        def open(self, path: str, flags: int, mode: int = _fs.FILE_MODE) -> int:
            if path.endswith("LOCK") and flags & (os.O_RDWR | os.O_WRONLY):
                raise PermissionError(errno.EACCES, "Permission denied", path)
            return super().open(path, flags, mode)

    with _fs.use(LockNotOurs()):
        report = check(db_path)
        assert cli.main(["check", str(db_path)]) == 0
    assert report.ok, report.findings
    assert tree(db_path) == before
