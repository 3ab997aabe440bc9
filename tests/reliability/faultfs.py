"""File systems for the power-loss (b) and I/O-fault (c) harnesses (docs/reliability.md).

Everything armdb does to storage goes through ``armdb._fs.FS``; :func:`armdb._fs.use`
installs one of the classes below for a block.

``RecordingFS``
    Forwards every call to the real file system and appends each *mutating* call,
    with its bytes, to ``trace``: file creation, ``mkdir``, ``pwrite``, ``ftruncate``
    (and ``O_TRUNC``; a ``fallocate`` that extends a file is recorded as one), ``rename``, ``unlink``, ``fsync``/``fdatasync``, ``msync``,
    ``fsync`` of a directory, and every store into a memory map (reported by the
    library through ``MappedFile.wrote``; recorded as a snapshot of each touched
    page, because the kernel writes back pages, not stores).  The workload adds its
    own events (``mark``) to the same trace, as ALICE uses the application's stdout,
    so every crash point knows which calls had returned.

``CrashModel``
    Replays a trace onto the directory it started from, up to a cut point, and
    builds the file images a power loss could leave there, in the style of SQLite
    ``src/test6.c``, ALICE and LazyFS:

    * a write, truncate or page store is durable once a sync of its file follows it
      (``fsync``/``fdatasync`` of the file; ``msync`` makes the truncates and the
      pages of its range durable);
    * a directory operation (create, mkdir, rename, unlink) is durable once the
      directory is fsynced (``ns_mode="strict"``, POSIX) or once *any* sync follows
      it (``ns_mode="journal"``: a journaling file system that commits metadata in
      order, like ext4 ``data=ordered``); pending ones may be reverted (a prefix of
      them survives);
    * pending data is treated by a *variant*: ``drop_all`` (LazyFS clear-cache,
      RocksDB ``DropUnsyncedFileData``), ``keep_all`` (a process crash),
      ``prefix`` (writes persist in order up to a random point, the boundary write
      possibly torn), ``subset`` (each pending write kept 3/8, dropped 3/8, torn
      1/4, as in test6.c), ``reorder`` (a subset applied in a random order),
      ``zero_extend`` (sizes grew but the new bytes read as zeros: "size before
      content").  A torn write keeps a prefix at sector or byte granularity, a
      suffix at sector granularity, a prefix followed by zeros, or garbage over a
      run of its own sectors (never outside its own byte range: SQLite's
      "powersafe overwrite").  A torn page keeps a random subset of its sectors.

``FaultFS``
    Counts calls per operation kind (open, write, sync, trunc, alloc, rename, unlink,
    mkdir, mmap, read) and raises ``OSError(EIO)`` or ``OSError(ENOSPC)`` at the k-th
    counted call, once or on every later call too
    (the SQLite ioerr loop).  Only calls made by the thread that created it are
    counted, so background threads cannot make the count nondeterministic.
"""

from __future__ import annotations

import errno as _errno
import hashlib
import os
import random
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from armdb import _fs
from armdb._fs import PAGE, MappedFile, RealFS

SECTOR = 512

# Trace records (tuples, for speed):
#   ("mkdir", path)                 ("create", path, ino)        ("rename", src, dst)
#   ("unlink", path)                ("w", ino, off, data)        ("p", ino, page_off, page_bytes)
#   ("t", ino, size)                ("fsync", ino)               ("msync", ino, off, length)
#   ("dsync", dirpath)              ("ev", name, payload)
SYNC_KINDS = frozenset({"fsync", "msync", "dsync"})
NS_KINDS = frozenset({"mkdir", "create", "rename", "unlink"})
DATA_KINDS = frozenset({"w", "p", "t"})


def fd_count() -> int:
    """Open file descriptors of this process (SQLite-style leak detection)."""
    return len(os.listdir("/proc/self/fd"))


# ---------------------------------------------------------------------------------------------
# Recording
# ---------------------------------------------------------------------------------------------


class RecordingMappedFile(MappedFile):
    """A mapped file whose ``wrote`` records a snapshot of every page a store touched."""

    def __init__(self, fs: RecordingFS, fd: int, length: int) -> None:
        super().__init__(fs, fd, length)
        self.rec = fs

    def wrote(self, offset: int, length: int) -> None:
        rec = self.rec
        ino = rec.fd_ino.get(self.fd)
        if ino is None:
            return
        end = min(self.length, offset + length)
        p = offset - offset % PAGE
        with rec.lock:
            while p < end:
                q = min(p + PAGE, self.length)
                rec._add(("p", ino, p, self.array[p:q].tobytes()))
                p = q


class RecordingFS(RealFS):
    """Forward to the real file system and record every mutating call (see module docstring)."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.lock = threading.RLock()
        self.trace: list[tuple[Any, ...]] = []
        self.fd_ino: dict[int, int] = {}
        self.names: dict[str, int] = {}  # relpath -> inode (volatile namespace)
        self.dirs: set[str] = set()
        self.shadow: dict[int, bytearray] = {}  # inode -> volatile content (sanity check)
        self.base_files: dict[str, bytes] = {}
        self.base_ino: dict[str, int] = {}
        self.base_dirs: set[str] = set()
        self._next_ino = 1
        self.recording = True
        for dirpath, dirnames, filenames in os.walk(self.root):
            rel = os.path.relpath(dirpath, self.root)
            if rel != ".":
                self.base_dirs.add(rel)
                self.dirs.add(rel)
            for fn in filenames:
                p = os.path.join(rel, fn) if rel != "." else fn
                with open(os.path.join(dirpath, fn), "rb") as f:
                    data = f.read()
                ino = self._new_ino()
                self.base_files[p] = data
                self.base_ino[p] = ino
                self.names[p] = ino
                self.shadow[ino] = bytearray(data)

    # -- helpers -------------------------------------------------------------------------------
    def _new_ino(self) -> int:
        ino = self._next_ino
        self._next_ino += 1
        return ino

    def _rel(self, path: str) -> str | None:
        a = os.path.abspath(path)
        if a == self.root:
            return "."
        if a.startswith(self.root + os.sep):
            return a[len(self.root) + 1 :]
        return None

    def _add(self, rec: tuple[Any, ...]) -> None:
        if not self.recording:
            return
        self.trace.append(rec)
        kind = rec[0]
        if kind == "w":
            buf = self.shadow[rec[1]]
            off, data = rec[2], rec[3]
            if len(buf) < off:
                buf.extend(bytes(off - len(buf)))
            buf[off : off + len(data)] = data
        elif kind == "p":
            buf = self.shadow[rec[1]]
            off, data = rec[2], rec[3]
            if off < len(buf):
                n = min(len(data), len(buf) - off)
                buf[off : off + n] = data[:n]
        elif kind == "t":
            buf = self.shadow[rec[1]]
            if rec[2] < len(buf):
                del buf[rec[2] :]
            else:
                buf.extend(bytes(rec[2] - len(buf)))

    def mark(self, name: str, payload: Any = None) -> None:
        """Add a workload event (an acknowledgement) to the trace."""
        with self.lock:
            self.trace.append(("ev", name, payload))

    # -- descriptors -----------------------------------------------------------------------------
    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        with self.lock:
            rel = self._rel(path)
            existed = os.path.exists(path)
            fd = super().open(path, flags, mode)
            if rel is None:
                return fd
            ino = self.names.get(rel)
            if ino is None or not existed:
                ino = self._new_ino()
                self.names[rel] = ino
                self.shadow[ino] = bytearray()
                self._add(("create", rel, ino))
            elif flags & os.O_TRUNC:
                self._add(("t", ino, 0))
            self.fd_ino[fd] = ino
            return fd

    def close(self, fd: int) -> None:
        with self.lock:
            self.fd_ino.pop(fd, None)
            super().close(fd)

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> None:
        with self.lock:
            super().pwrite(fd, data, offset)
            ino = self.fd_ino.get(fd)
            if ino is not None:
                self._add(("w", ino, offset, bytes(data)))

    def ftruncate(self, fd: int, size: int) -> None:
        with self.lock:
            super().ftruncate(fd, size)
            ino = self.fd_ino.get(fd)
            if ino is not None:
                self._add(("t", ino, size))

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        # Allocation changes no byte; past the end it extends the file, which the crash
        # model sees as a truncate to the new size (a zero-filling fallback's writes
        # are recorded by pwrite itself).
        with self.lock:
            size = super().size(fd)
            super().fallocate(fd, offset, length)
            ino = self.fd_ino.get(fd)
            if ino is not None and offset + length > size:
                self._add(("t", ino, offset + length))

    def fsync(self, fd: int) -> None:
        with self.lock:
            super().fsync(fd)
            ino = self.fd_ino.get(fd)
            if ino is not None:
                self._add(("fsync", ino))

    def fdatasync(self, fd: int) -> None:
        with self.lock:
            super().fdatasync(fd)
            ino = self.fd_ino.get(fd)
            if ino is not None:
                self._add(("fsync", ino))

    # -- paths -----------------------------------------------------------------------------------
    def makedirs(self, path: str) -> None:
        with self.lock:
            missing = []
            p = os.path.abspath(path)
            while not os.path.isdir(p):
                missing.append(p)
                p = os.path.dirname(p)
            # Record the new entries first: RealFS.makedirs fsyncs each parent as it
            # creates a directory, and those syncs must come after the mkdir they cover.
            for m in reversed(missing):
                r = self._rel(m)
                if r is not None and r != ".":
                    self.dirs.add(r)
                    self._add(("mkdir", r))
            super().makedirs(path)

    def rename(self, src: str, dst: str) -> None:
        with self.lock:
            super().rename(src, dst)
            a, b = self._rel(src), self._rel(dst)
            if a is not None and b is not None and a in self.names:
                self.names[b] = self.names.pop(a)
                self._add(("rename", a, b))

    def unlink(self, path: str) -> None:
        with self.lock:
            super().unlink(path)
            rel = self._rel(path)
            if rel is not None and rel in self.names:
                del self.names[rel]
                self._add(("unlink", rel))

    def fsync_dir(self, path: str) -> None:
        with self.lock:
            super().fsync_dir(path)
            rel = self._rel(path)
            if rel is not None:
                self._add(("dsync", rel))

    # -- memory maps -----------------------------------------------------------------------------
    def mmap(self, fd: int, length: int) -> MappedFile:
        return RecordingMappedFile(self, fd, length)

    def _msync(self, mf: MappedFile, offset: int, length: int) -> None:
        with self.lock:
            super()._msync(mf, offset, length)
            ino = self.fd_ino.get(mf.fd)
            if ino is not None:
                self._add(("msync", ino, offset, length))

    # -- sanity ----------------------------------------------------------------------------------
    def verify_shadow(self) -> list[str]:
        """Compare the recorded (volatile) content with the real files: a mismatch means a
        mutation bypassed the seam (for example a store into a map never reported)."""
        problems = []
        for rel, ino in sorted(self.names.items()):
            real = os.path.join(self.root, rel)
            try:
                with open(real, "rb") as f:
                    data = f.read()
            except OSError as e:
                problems.append(f"{rel}: recorded but unreadable ({e})")
                continue
            if bytes(self.shadow[ino]) != data:
                n = min(len(data), len(self.shadow[ino]))
                first = next((i for i in range(n) if data[i] != self.shadow[ino][i]), n)
                problems.append(
                    f"{rel}: on disk {len(data)} bytes, recorded {len(self.shadow[ino])}; first difference at {first}"
                )
        for dirpath, _dirs, files in os.walk(self.root):
            for fn in files:
                rel = os.path.relpath(os.path.join(dirpath, fn), self.root)
                if rel not in self.names:
                    problems.append(f"{rel}: exists but was never recorded")
        return problems


# ---------------------------------------------------------------------------------------------
# Crash states
# ---------------------------------------------------------------------------------------------

VARIANTS = ("drop_all", "keep_all", "prefix", "subset", "reorder", "zero_extend")


@dataclass
class _Inode:
    base: bytes
    ops: list[list[Any]] = field(default_factory=list)  # [record, durable]


@dataclass
class Image:
    """A materialisable crash state: directories and whole-file contents (relative paths)."""

    cut: int
    variant: str
    dirs: set[str]
    files: dict[str, bytes]
    notes: list[str] = field(default_factory=list)

    def digest(self) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        for d in sorted(self.dirs):
            h.update(b"D" + d.encode() + b"\0")
        for p in sorted(self.files):
            h.update(b"F" + p.encode() + b"\0" + len(self.files[p]).to_bytes(8, "little"))
            h.update(self.files[p])
        return h.digest()

    def materialize(self, target: str) -> None:
        os.makedirs(target, exist_ok=True)
        if os.listdir(target):  # merging into leftovers would check a state that never existed
            raise AssertionError(f"materialize: {target} is not empty")
        for d in sorted(self.dirs, key=lambda s: s.count(os.sep)):
            os.makedirs(os.path.join(target, d), exist_ok=True)
        for p, data in self.files.items():
            with open(os.path.join(target, p), "wb") as f:
                f.write(data)


class CrashModel:
    """Replay a recorded trace up to a cut point and build power-loss images (module docstring).

    Use :meth:`advance` to move the cut forward (the model is incremental) and
    :meth:`image` to build one crash state at the current cut.
    """

    def __init__(self, rec: RecordingFS, *, ns_mode: str = "journal") -> None:
        if ns_mode not in ("journal", "strict"):
            raise ValueError(ns_mode)
        self.ns_mode = ns_mode
        self.trace = rec.trace
        self.base_dirs = set(rec.base_dirs)
        self.base_names = dict(rec.base_ino)
        self.inodes: dict[int, _Inode] = {ino: _Inode(rec.base_files[p]) for p, ino in rec.base_ino.items()}
        self.ns: list[list[Any]] = []  # [record, durable]
        self.cut = 0

    # -- building the model ----------------------------------------------------------------------
    def advance(self, to: int) -> None:
        trace = self.trace
        while self.cut < to:
            rec = trace[self.cut]
            self.cut += 1
            kind = rec[0]
            if kind in DATA_KINDS:
                self.inodes[rec[1]].ops.append([rec, False])
            elif kind in NS_KINDS:
                if kind == "create":
                    self.inodes.setdefault(rec[2], _Inode(b""))
                self.ns.append([rec, False])
            elif kind in SYNC_KINDS:
                if kind == "fsync":
                    for op in self.inodes[rec[1]].ops:
                        op[1] = True
                elif kind == "msync":
                    lo = rec[2] - rec[2] % PAGE
                    hi = rec[2] + rec[3]
                    for op in self.inodes[rec[1]].ops:
                        r = op[0]
                        if r[0] != "p" or lo <= r[2] < hi:
                            op[1] = True
                if self.ns_mode == "journal":
                    for op in self.ns:
                        op[1] = True
                elif kind == "dsync":
                    d = rec[1]
                    for op in self.ns:
                        if not op[1] and _parent_of(op[0]) == d:
                            op[1] = True

    def pending_count(self) -> int:
        n = sum(1 for op in self.ns if not op[1])
        for ino in self.inodes.values():
            n += sum(1 for op in ino.ops if not op[1])
        return n

    # -- images ----------------------------------------------------------------------------------
    def image(self, variant: str, rng: random.Random) -> Image:
        notes: list[str] = []
        names, dirs = self._namespace(variant, rng, notes)
        files = {}
        for path, ino in names.items():
            files[path] = self._content(self.inodes[ino], variant, rng, notes, path)
        return Image(self.cut, variant, dirs, files, notes)

    def _namespace(
        self, variant: str, rng: random.Random, notes: list[str]
    ) -> tuple[dict[str, int], set[str]]:
        names = dict(self.base_names)
        dirs = set(self.base_dirs)
        pending = [op for op in self.ns if not op[1]]
        if variant == "drop_all":
            keep_n = 0
        elif variant == "keep_all" or not pending:
            keep_n = len(pending)
        else:
            keep_n = rng.choice((0, len(pending), rng.randint(0, len(pending))))
        if keep_n < len(pending):
            notes.append(f"ns: {len(pending) - keep_n} of {len(pending)} pending directory ops reverted")
        kept_pending = 0
        for op in self.ns:
            if not op[1]:
                if kept_pending >= keep_n:
                    continue
                kept_pending += 1
            rec = op[0]
            kind = rec[0]
            if kind == "mkdir":
                if _dirname(rec[1]) in dirs or _dirname(rec[1]) == "":
                    dirs.add(rec[1])
            elif kind == "create":
                if _dirname(rec[1]) in dirs or _dirname(rec[1]) == "":
                    names[rec[1]] = rec[2]
            elif kind == "rename":
                if rec[1] in names and (_dirname(rec[2]) in dirs or _dirname(rec[2]) == ""):
                    names[rec[2]] = names.pop(rec[1])
            elif kind == "unlink":
                names.pop(rec[1], None)
        return names, dirs

    def _content(self, ino: _Inode, variant: str, rng: random.Random, notes: list[str], path: str) -> bytes:
        ops = ino.ops
        buf = bytearray(ino.base)
        pend_idx = [i for i, op in enumerate(ops) if not op[1]]
        if not pend_idx:
            for op in ops:
                _apply(buf, op[0])
            return bytes(buf)
        if variant == "zero_extend":
            size = len(ino.base)
            for op in ops:
                r = op[0]
                if op[1]:
                    _apply(buf, r)
                if r[0] == "t":
                    size = r[2]
                elif r[0] == "w":
                    size = max(size, r[2] + len(r[3]))
            if len(buf) < size:
                notes.append(f"{path}: zero-extended {len(buf)}->{size}")
                buf.extend(bytes(size - len(buf)))
            elif len(buf) > size:
                del buf[size:]
            return bytes(buf)
        # Decide each pending op: keep (K), drop (D) or tear (T).
        decision: dict[int, str] = {}
        if variant == "drop_all":
            decision = {i: "D" for i in pend_idx}
        elif variant == "keep_all":
            decision = {i: "K" for i in pend_idx}
        elif variant == "prefix":
            j = rng.randint(0, len(pend_idx))
            for n, i in enumerate(pend_idx):
                decision[i] = "K" if n < j else "D"
            if j < len(pend_idx) and rng.random() < 0.5:
                decision[pend_idx[j]] = "T"
        else:  # subset, reorder: test6.c odds
            for i in pend_idx:
                r = rng.random()
                decision[i] = "K" if r < 0.375 else ("D" if r < 0.75 else "T")
        order = list(range(len(ops)))
        if variant == "reorder":
            # Permute the kept/torn pending pwrites among their own positions; truncates
            # and page snapshots keep their places (a page holds the newest content).
            movable = [i for i in pend_idx if ops[i][0][0] == "w"]
            shuffled = movable[:]
            rng.shuffle(shuffled)
            pos = dict(zip(movable, shuffled))
            order = [pos.get(i, i) for i in order]
        dropped = torn = 0
        for i in order:
            op = ops[i]
            r = op[0]
            d = "K" if op[1] else decision[i]
            if d == "K":
                _apply(buf, r)
            elif d == "D":
                dropped += 1
            else:
                torn += 1
                _tear(buf, r, rng)
        if dropped or torn:
            notes.append(
                f"{path}: {variant} kept {len(pend_idx) - dropped - torn}, dropped {dropped}, torn {torn}"
            )
        return bytes(buf)

    def images(self, variants: Iterable[str], rng: random.Random) -> Iterator[Image]:
        for v in variants:
            yield self.image(v, rng)


def _dirname(p: str) -> str:
    d = os.path.dirname(p)
    return d


def _parent_of(rec: tuple[Any, ...]) -> str:
    return _dirname(rec[1]) or "."


def _apply(buf: bytearray, r: tuple[Any, ...]) -> None:
    kind = r[0]
    if kind == "w":
        off, data = r[2], r[3]
        if len(buf) < off:
            buf.extend(bytes(off - len(buf)))
        buf[off : off + len(data)] = data
    elif kind == "p":
        off, data = r[2], r[3]
        if off < len(buf):  # a page beyond EOF is never written back
            n = min(len(data), len(buf) - off)
            buf[off : off + n] = data[:n]
    elif kind == "t":
        if r[2] < len(buf):
            del buf[r[2] :]
        else:
            buf.extend(bytes(r[2] - len(buf)))


def _tear(buf: bytearray, r: tuple[Any, ...], rng: random.Random) -> None:
    kind = r[0]
    if kind == "t":
        if rng.random() < 0.5:
            _apply(buf, r)
        return
    off, data = r[2], r[3]
    n = len(data)
    if n == 0:
        return
    if kind == "p":
        if off >= len(buf):
            return
        n = min(n, len(buf) - off)
        for s in range(0, n, SECTOR):
            if rng.random() < 0.5:
                e = min(n, s + SECTOR)
                buf[off + s : off + e] = data[s:e]
        return
    # A pwrite: split at absolute sector boundaries.
    bounds = sorted({0, n} | {b - off for b in range(off - off % SECTOR + SECTOR, off + n, SECTOR)})
    how = rng.randrange(5)
    if how == 0:  # prefix, sector granularity
        k = bounds[rng.randrange(len(bounds) - 1)] if len(bounds) > 2 else rng.randrange(n)
        part, tail = data[:k], b""
    elif how == 1:  # prefix, byte granularity
        k = rng.randrange(n)
        part, tail = data[:k], b""
    elif how == 2:  # prefix then zeros (size updated before content)
        k = rng.randrange(n)
        part, tail = data[:k], bytes(n - k)
    elif how == 3 and len(bounds) > 2:  # suffix, sector granularity (linear tearing at the front)
        k = bounds[rng.randrange(1, len(bounds) - 1)]
        if len(buf) < off + k:
            buf.extend(bytes(off + k - len(buf)))
        buf[off + k : off + n] = data[k:]
        return
    else:  # garbage over a run of the write's own sectors
        i = rng.randrange(len(bounds) - 1)
        j = rng.randrange(i + 1, len(bounds))
        a, b = bounds[i], bounds[j]
        garbage = bytes(rng.getrandbits(8) for _ in range(b - a))
        part = data[:a] + garbage
        tail = b""
    full = part + tail
    if len(buf) < off:
        buf.extend(bytes(off - len(buf)))
    buf[off : off + len(full)] = full


def cut_points(trace: list[tuple[Any, ...]], *, exhaustive: bool = False) -> list[int]:
    """Where to cut: every op (exhaustive), else every persistence point and event boundary.

    A cut ``k`` means the first ``k`` trace records happened.  Cuts just before and
    just after each sync (the B3 persistence points), after each event, and the end.
    """
    n = len(trace)
    if exhaustive:
        return list(range(n + 1))
    cuts = {0, n}
    for i, r in enumerate(trace):
        if r[0] in SYNC_KINDS:
            cuts.add(i)
            cuts.add(i + 1)
        elif r[0] == "ev":
            cuts.add(i + 1)
    return sorted(cuts)


# ---------------------------------------------------------------------------------------------
# Fault injection
# ---------------------------------------------------------------------------------------------

ALL_KINDS = frozenset({"open", "write", "sync", "trunc", "alloc", "rename", "unlink", "mkdir", "mmap", "read"})
MUTATING_KINDS = ALL_KINDS - {"read"}


class FaultFS(RealFS):
    """Raise ``OSError(err)`` at the ``fail_at``-th counted call (1-based), and on every
    later one too when ``persistent``.  ``fail_at=0`` only counts (the dry run).

    ``kinds`` selects which operation kinds are counted (default: every mutating kind
    plus ``open``).  A failing ``write`` writes the first half of its data first when
    ``partial`` is set (a short write followed by an error); a failing ``alloc``
    (``fallocate``, block allocation when a file is created or grows) then extends the
    file by half the range first, as a file system that ran out of space half way may.
    """

    def __init__(
        self,
        fail_at: int = 0,
        *,
        err: int = _errno.EIO,
        persistent: bool = False,
        kinds: Iterable[str] | None = None,
        partial: bool = False,
    ) -> None:
        self.fail_at = fail_at
        self.err = err
        self.persistent = persistent
        self.kinds = frozenset(kinds) if kinds is not None else MUTATING_KINDS
        bad = self.kinds - ALL_KINDS
        if bad:
            raise ValueError(f"unknown kinds {sorted(bad)}")
        self.partial = partial
        self.thread = threading.get_ident()
        self.count = 0
        self.per_kind: dict[str, int] = {}
        self.fired: list[tuple[int, str, str]] = []
        self.active = True
        self.paths: dict[int, str] = {}  # fd -> path, to name what failed

    def _hit(self, kind: str, detail: str) -> bool:
        """Count a call; True if it must fail."""
        if not self.active or kind not in self.kinds or threading.get_ident() != self.thread:
            return False
        self.count += 1
        self.per_kind[kind] = self.per_kind.get(kind, 0) + 1
        if self.fail_at and (self.count == self.fail_at or (self.persistent and self.count > self.fail_at)):
            self.fired.append((self.count, kind, detail))
            return True
        return False

    def _raise(self, detail: str) -> None:
        raise OSError(self.err, f"{os.strerror(self.err)} (injected at call {self.count}: {detail})")

    @property
    def first_kind(self) -> str | None:
        return self.fired[0][1] if self.fired else None

    # -- descriptors -----------------------------------------------------------------------------
    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        if self._hit("open", path):
            self._raise(f"open {path}")
        fd = super().open(path, flags, mode)
        self.paths[fd] = path
        return fd

    def pread(self, fd: int, n: int, offset: int) -> bytes:
        if self._hit("read", str(fd)):
            self._raise(f"pread fd {fd}")
        return super().pread(fd, n, offset)

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> None:
        if self._hit("write", str(fd)):
            if self.partial and len(data) > 1:
                super().pwrite(fd, memoryview(data)[: len(data) // 2], offset)
            self._raise(f"pwrite fd {fd} ({len(data)} bytes at {offset})")
        super().pwrite(fd, data, offset)

    def fsync(self, fd: int) -> None:
        if self._hit("sync", str(fd)):
            self._raise(f"fsync fd {fd}")
        super().fsync(fd)

    def fdatasync(self, fd: int) -> None:
        if self._hit("sync", str(fd)):
            self._raise(f"fdatasync fd {fd}")
        super().fdatasync(fd)

    def ftruncate(self, fd: int, size: int) -> None:
        if self._hit("trunc", str(fd)):
            self._raise(f"ftruncate fd {fd} to {size}")
        super().ftruncate(fd, size)

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        if length > 0 and self._hit("alloc", str(fd)):
            size = super().size(fd)
            half = offset + length // 2
            if self.partial and half > size:
                super().ftruncate(fd, half)
            self._raise(f"fallocate fd {fd} ({length} bytes at {offset})")
        super().fallocate(fd, offset, length)

    # -- paths -----------------------------------------------------------------------------------
    def makedirs(self, path: str) -> None:
        if not os.path.isdir(path) and self._hit("mkdir", path):
            self._raise(f"mkdir {path}")
        super().makedirs(path)

    def rename(self, src: str, dst: str) -> None:
        if self._hit("rename", dst):
            self._raise(f"rename {src} -> {dst}")
        super().rename(src, dst)

    def unlink(self, path: str) -> None:
        if self._hit("unlink", path):
            self._raise(f"unlink {path}")
        super().unlink(path)

    def fsync_dir(self, path: str) -> None:
        if self._hit("sync", path):
            self._raise(f"fsync of directory {path}")
        super().fsync_dir(path)

    # -- memory maps -----------------------------------------------------------------------------
    def mmap(self, fd: int, length: int) -> MappedFile:
        if self._hit("mmap", str(fd)):
            self._raise(f"mmap fd {fd} ({length} bytes)")
        return super().mmap(fd, length)

    def _msync(self, mf: MappedFile, offset: int, length: int) -> None:
        if self._hit("sync", f"msync fd {mf.fd}"):
            self._raise(f"msync fd {mf.fd} ({length} bytes at {offset})")
        super()._msync(mf, offset, length)


__all__ = [
    "ALL_KINDS",
    "MUTATING_KINDS",
    "VARIANTS",
    "CrashModel",
    "FaultFS",
    "Image",
    "RecordingFS",
    "RecordingMappedFile",
    "_fs",
    "cut_points",
    "fd_count",
]
