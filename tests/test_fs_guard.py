"""Guards on the OS seam (``armdb/_fs.py``) and the failpoint registry (``armdb._fail``, SPEC D8).

``armdb/_fs.py`` is the only module that may touch the operating system for
storage, so that fault-injecting and write-recording file systems see every call.
These tests read the package's source with ``tokenize`` (so strings, docstrings and
comments never count, and ``Db.open(`` or ``_fs.FS.open(`` method calls are not
mistaken for the builtin ``open(``) and fail naming ``file:line``.

They also keep ``armdb._fail.ALL`` honest: every ``_fail.point("...")`` name used in
the package is registered, and every registered name is reached somewhere.
"""

from __future__ import annotations

import errno
import io
import os
import re
import tokenize
from pathlib import Path

import pytest

from armdb import _fail

PKG = Path(__file__).resolve().parent.parent / "armdb"
SEAM = PKG / "_fs.py"

# module -> attribute calls that bypass the seam (storage I/O, syncs, renames, maps, locks)
FORBIDDEN_CALLS: dict[str, set[str]] = {
    "os": {
        "write",
        "pwrite",
        "pwritev",
        "writev",
        "read",
        "pread",
        "preadv",
        "open",
        "close",
        "fsync",
        "fdatasync",
        "sync",
        "ftruncate",
        "truncate",
        "posix_fallocate",
        "replace",
        "rename",
        "renames",
        "unlink",
        "remove",
        "rmdir",
        "removedirs",
        "mkdir",
        "makedirs",
        "listdir",
        "scandir",
        "fstat",
        "stat",
        "link",
        "symlink",
    },
    "mmap": {"mmap"},
    "np": {"memmap"},
    "numpy": {"memmap"},
    "fcntl": {"*"},
    "io": {"open", "FileIO"},
}
FORBIDDEN_IMPORTS = {"fcntl", "mmap"}


def modules() -> list[Path]:
    files = sorted(PKG.rglob("*.py")) + sorted(PKG.rglob("*.pyx")) + sorted(PKG.rglob("*.pxd"))
    return [p for p in files if p != SEAM]


def significant_tokens(path: Path) -> list[tokenize.TokenInfo]:
    """Every token except comments, strings and layout (Cython sources tokenize too)."""
    skip = {
        tokenize.COMMENT,
        tokenize.STRING,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENCODING,
        tokenize.ENDMARKER,
    }
    fstring = {
        getattr(tokenize, n)
        for n in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END")
        if hasattr(tokenize, n)
    }
    toks = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return [t for t in toks if t.type not in skip and t.type not in fstring]


def direct_os_calls(path: Path, root: Path = PKG.parent) -> list[str]:
    rel = path.relative_to(root)
    toks = significant_tokens(path)
    hits: list[str] = []
    for i, t in enumerate(toks):
        nxt = toks[i + 1].string if i + 1 < len(toks) else ""
        prev = toks[i - 1].string if i else ""
        if t.type != tokenize.NAME:
            continue
        # module.attr(   e.g. os.pwrite(, np.memmap(, fcntl.flock(
        if t.string in FORBIDDEN_CALLS and prev != "." and nxt == "." and i + 2 < len(toks):
            attr = toks[i + 2].string
            banned = FORBIDDEN_CALLS[t.string]
            if "*" in banned or attr in banned:
                hits.append(f"{rel}:{t.start[0]}: {t.string}.{attr}")
        # the builtin open(  (not a method call x.open(, not a definition def open()
        elif t.string == "open" and nxt == "(" and prev not in {".", "def"}:
            hits.append(f"{rel}:{t.start[0]}: builtin open(")
        # import fcntl / import mmap / from os import pwrite ...
        elif t.string in {"import", "from"} and prev not in {"."}:
            j = i + 1
            names = []
            while j < len(toks) and toks[j].start[0] == t.start[0]:
                names.append(toks[j].string)
                j += 1
            if t.string == "import" and any(n in FORBIDDEN_IMPORTS for n in names[:1]):
                hits.append(f"{rel}:{t.start[0]}: import {names[0]}")
            if t.string == "from" and names[:2] and names[0] in FORBIDDEN_CALLS and names[1] == "import":
                bad = [
                    n for n in names[2:] if n in FORBIDDEN_CALLS[names[0]] or "*" in FORBIDDEN_CALLS[names[0]]
                ]
                if bad:
                    hits.append(f"{rel}:{t.start[0]}: from {names[0]} import {', '.join(bad)}")
    return hits


def test_guard_scanner_finds_what_it_should(tmp_path: Path) -> None:
    """The scanner itself: real calls are caught, method calls and prose are not."""
    src = tmp_path / "sample.py"
    src.write_text(
        '"""Docstring mentioning os.write( and open( freely."""\n'
        "import os\n"
        "import fcntl\n"
        "from os import pwrite\n"
        "x = open('f')  # os.fsync( in a comment\n"
        "os.fsync(3)\n"
        "np.memmap(f)\n"
        "db = Db.open(p)\n"
        "fd = _fs.FS.open(p, 0)\n"
        "def open(self): pass\n"
        "s = f'{os.path.join(a, b)}'\n"
        "os.path.exists(p)\n"
    )
    rel_hits = [h.split(": ", 1)[1] for h in direct_os_calls(src, tmp_path)]
    assert rel_hits == ["import fcntl", "from os import pwrite", "builtin open(", "os.fsync", "np.memmap"]


def test_guard_no_direct_os_calls_outside_fs_module() -> None:
    files = modules()
    assert any(p.name == "db.py" for p in files) and any(p.name == "fixed.pyx" for p in files)
    hits = [h for p in files for h in direct_os_calls(p)]
    assert not hits, "direct OS calls outside armdb/_fs.py (go through armdb._fs.FS):\n" + "\n".join(hits)


POINT_RE = re.compile(r"""_fail\.point\(\s*(?P<q>["'])(?P<name>[^"']+)(?P=q)\s*\)""")
ANY_POINT_RE = re.compile(r"""_fail\.point\(""")


def failpoint_uses() -> dict[str, list[str]]:
    uses: dict[str, list[str]] = {}
    for path in sorted(PKG.rglob("*.py")) + sorted(PKG.rglob("*.pyx")):
        if path.name == "_fail.py":
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for m in POINT_RE.finditer(line):
                uses.setdefault(m.group("name"), []).append(f"{path.relative_to(PKG.parent)}:{lineno}")
    return uses


def test_guard_failpoint_calls_use_literal_names() -> None:
    """Every ``_fail.point(`` call names its point with a literal, so the registry check sees it."""
    bad = []
    for path in sorted(PKG.rglob("*.py")) + sorted(PKG.rglob("*.pyx")):
        if path.name == "_fail.py":
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if len(ANY_POINT_RE.findall(line)) != len(POINT_RE.findall(line)):
                bad.append(f"{path.relative_to(PKG.parent)}:{lineno}: {line.strip()}")
    assert not bad, "failpoints must be named with a string literal:\n" + "\n".join(bad)


def test_guard_every_failpoint_used_is_registered() -> None:
    uses = failpoint_uses()
    assert uses, "no failpoints found in armdb/"
    unknown = {n: w for n, w in uses.items() if n not in _fail.ALL}
    assert not unknown, "failpoints missing from armdb._fail.ALL:\n" + "\n".join(
        f"{n} at {', '.join(w)}" for n, w in sorted(unknown.items())
    )


def test_guard_every_registered_failpoint_is_used() -> None:
    unused = sorted(_fail.ALL - set(failpoint_uses()))
    assert not unused, f"failpoints in armdb._fail.ALL that nothing in armdb/ reaches: {unused}"


@pytest.mark.parametrize("name", sorted(_fail.ALL))
def test_guard_failpoint_names_are_dotted_lowercase(name: str) -> None:
    assert re.fullmatch(r"[a-z]+(\.[a-z_]+)+", name), name


def test_realfs_pwrite_writes_everything_and_raises_oserror(tmp_path) -> None:
    # RealFS.pwrite is armdb._core.atomicfile.pwrite_all (keeps the GIL): whole writes at
    # any offset, from bytes or a memoryview, and the errno of a failed write.
    from armdb import _fs

    fs = _fs.RealFS()
    fd = fs.open(str(tmp_path / "f"), os.O_RDWR | os.O_CREAT)
    try:
        fs.pwrite(fd, b"abc", 5)
        fs.pwrite(fd, memoryview(b"xyz123")[3:], 0)
        fs.pwrite(fd, b"", 100)
        assert fs.pread(fd, 100, 0) == b"123\0\0abc"
    finally:
        fs.close(fd)
    with pytest.raises(OSError) as err:
        fs.pwrite(fd, b"x", 0)  # closed descriptor
    assert err.value.errno == errno.EBADF


def test_realfs_pwrite_of_a_large_buffer_is_whole(tmp_path) -> None:
    # Writes above 256 KiB are made without the GIL; the bytes must be the same.
    from armdb import _fs

    fs = _fs.RealFS()
    data = bytes(range(256)) * 4096 + b"tail"  # 1 MiB + 4 bytes
    fd = fs.open(str(tmp_path / "big"), os.O_RDWR | os.O_CREAT)
    try:
        fs.pwrite(fd, data, 7)
        assert fs.pread(fd, len(data), 7) == data
    finally:
        fs.close(fd)
