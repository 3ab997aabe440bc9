"""Encryption keys for the offline tools: key files, and which key opens what (SPEC C4).

``armdb.check``, ``armdb.salvage`` and ``python -m armdb stats`` read a database that is
not open.  Its encrypted parts are the Bitcask collections created with
``encryption_key`` (maps, and the ``<queue>.payload`` body stores of var queues) and the
transaction log's sealed records (``TxConfig(log_encryption_key=...)``).  Each keeps a
key check value beside its data (a collection's ``collection.meta``, the log's in
``db.meta``), so a key can be matched to what it opens without reading any record:
:func:`resolve_keys` does that, and refuses a key that opens nothing with ``WrongKey``
before anything else is read or written.

A key file (:func:`read_key_file`) holds one 32-byte key, written as users naturally
write one: the raw bytes (``head -c 32 /dev/urandom > key``), 64 hex digits
(``openssl rand -hex 32 > key``) or standard/URL-safe base64 (``openssl rand -base64 32
> key``), text forms with or without one trailing newline.  Anything else is refused
with ``KeyFileError``; a file that other users can read is accepted, and
:func:`key_file_warning` says so (the command line prints it).

Lock policy: none; callers hold the database's directory lock.  All file access goes
through ``armdb._fs``.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field

from . import _fs, logformat
from ._crypto import KEY_LEN, Sealer
from .bitcask.format import META_NAME, _decode_meta
from .errors import ArmdbError, ConfigError, KeyFileError, WrongKey
from .layout import COLLECTIONS, META_FILE, QUEUE_META, check_meta

__all__ = ["Keys", "key_file_warning", "normalize_keys", "read_key_file", "resolve_keys"]

#: A key file is never larger than this (64 hex digits with a CRLF, base64 with padding).
_MAX_KEY_FILE = 256
_HEX = re.compile(rb"[0-9a-fA-F]{64}")
_B64 = re.compile(rb"[A-Za-z0-9+/_-]{43}=?")
_HOW = "write 32 random bytes (head -c 32 /dev/urandom > FILE) or 64 hex digits (openssl rand -hex 32 > FILE)"


def read_key_file(path: str | os.PathLike[str]) -> bytes:
    """The 32-byte key held by the key file ``path``.

    Accepted: exactly 32 raw bytes (not all printable: a 32-character password is not a
    key); 64 hex digits; 43 or 44 characters of standard or URL-safe base64 that decode
    to 32 bytes.  The text forms may end with one newline (``\\n`` or ``\\r\\n``).

    Raises
    ------
    KeyFileError
        The file cannot be read, is not a regular file, or holds anything else.
    """
    p = os.fspath(path)
    fs = _fs.FS
    try:
        fd = fs.open(p, os.O_RDONLY)
    except OSError as e:
        raise KeyFileError(f"cannot read the key file {p} ({e.strerror or e}); give the path of the file "
                           f"that holds the key") from None
    try:
        st = fs.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(f"the key file {p} is not a regular file; give the path of the file that holds the key")
        if st.st_size > _MAX_KEY_FILE:
            raise KeyFileError(f"the key file {p} holds {st.st_size} bytes, far more than a key; {_HOW.replace('FILE', p)}")
        raw = fs.pread(fd, _MAX_KEY_FILE + 1, 0)
    finally:
        fs.close(fd)
    return _parse_key(raw, p)


def _parse_key(raw: bytes, path: str) -> bytes:
    how = _HOW.replace("FILE", path)
    if len(raw) == KEY_LEN:
        if all(0x20 <= b < 0x7F for b in raw):
            kind = _looks_like(raw)
            raise KeyFileError(
                f"the key file {path} holds 32 characters of text{'' if kind == 'text' else f' ({kind})'}, not a "
                f"key (a password is not a key): a key is 32 random bytes or their hex or base64 form; {how}"
            )
        return raw
    text = raw[:-2] if raw.endswith(b"\r\n") else raw[:-1] if raw.endswith(b"\n") else raw
    if _HEX.fullmatch(text):
        return bytes.fromhex(text.decode())
    if _B64.fullmatch(text):
        padded = text if len(text) == 44 else text + b"="
        try:
            key = base64.b64decode(padded.replace(b"-", b"+").replace(b"_", b"/"), validate=True)
        except (binascii.Error, ValueError):
            key = b""
        if len(key) == KEY_LEN:
            return key
    if not raw:
        raise KeyFileError(f"the key file {path} is empty; {how}")
    raise KeyFileError(f"the key file {path} holds {len(raw)} bytes ({_looks_like(text)}), which is not a 32-byte key; {how}")


def _looks_like(text: bytes) -> str:
    """A short description of a refused key file's content, without showing it."""
    stripped = text.strip()
    if stripped and re.fullmatch(rb"[0-9a-fA-F]+", stripped):
        n = len(stripped)
        return f"{n} hex digits, a {n // 2}-byte key" if n % 2 == 0 else f"{n} hex digits"
    if stripped and all(0x20 <= b < 0x7F for b in stripped):
        return "text"
    return "binary data"


def key_file_warning(path: str | os.PathLike[str]) -> str | None:
    """A warning when the key file ``path`` can be read by its group or by other users
    (None otherwise, or when it cannot be examined)."""
    p = os.fspath(path)
    try:
        fd = _fs.FS.open(p, os.O_RDONLY)
    except OSError:
        return None
    try:
        mode = stat.S_IMODE(_fs.FS.fstat(fd).st_mode)
    finally:
        _fs.FS.close(fd)
    if mode & 0o044:
        who = "other users" if mode & 0o004 else "its group"
        return f"the key file {p} can be read by {who} (mode {mode:04o}); make it private: chmod 600 {p}"
    return None


def normalize_keys(keys: bytes | bytearray | Sequence[bytes] | None, name: str) -> list[bytes]:
    """``keys`` as a list of 32-byte keys; ``ConfigError`` for anything that is not one key
    or a sequence of them."""
    if keys is None:
        return []
    seq = [keys] if isinstance(keys, (bytes, bytearray)) else keys
    if isinstance(seq, str) or not isinstance(seq, Sequence):
        raise ConfigError(f"{name} must be a 32-byte key (bytes) or a list of them, got {type(keys).__name__}")
    out = []
    for k in seq:
        if not isinstance(k, (bytes, bytearray)) or len(k) != KEY_LEN:
            what = f"{len(k)} bytes" if isinstance(k, (bytes, bytearray)) else type(k).__name__
            raise ConfigError(f"{name}: a key must be {KEY_LEN} bytes (an AES-256 key), got {what}")
        out.append(bytes(k))
    return out


@dataclass(frozen=True)
class Keys:
    """Which key opens what, in one closed database (:func:`resolve_keys`).

    Attributes
    ----------
    collections : dict of str to bytes
        Encrypted collection name (its folder under ``collections/``) -> its key.
    locked : list of str
        Encrypted collections that no key given opens.
    log_key : bytes or None
        The transaction log key, when one was given or found among the keys.
    log_checked : bool
        ``log_key`` matched the check value ``db.meta`` keeps (False: the database has
        none, so only the sealed records themselves can tell).
    db_id : bytes
        The database id sealed log records are bound to.
    """

    collections: dict[str, bytes] = field(default_factory=dict)
    locked: list[str] = field(default_factory=list)
    log_key: bytes | None = None
    log_checked: bool = False
    db_id: bytes = b""


def resolve_keys(
    directory: str,
    keys: Sequence[bytes],
    log_key: bytes | None,
    *,
    labels: Sequence[str] | None = None,
    log_label: str = "log_encryption_key",
) -> Keys:
    """Match ``keys`` (collection keys) and ``log_key`` to the database at ``directory``.

    Each encrypted collection takes the key whose check value its meta file holds.  With
    no ``log_key``, the log takes the key among ``keys`` that matches ``db.meta``'s log
    check value, if any.  ``labels`` name the keys in messages (default
    ``encryption_key[i]``).  Meta files that cannot be read are left to the caller's
    checks (they are findings, not key errors).

    Raises
    ------
    WrongKey
        ``log_key`` is not the log key ``db.meta`` records, or a key of ``keys`` opens no
        encrypted collection and is not the log key either.
    """
    names = list(labels) if labels is not None else (
        ["encryption_key"] if len(keys) == 1 else [f"encryption_key[{i}]" for i in range(len(keys))]
    )
    fs = _fs.FS
    log_check, db_id = b"", b""
    meta_path = os.path.join(directory, META_FILE)
    try:
        meta = check_meta(fs.read_file(meta_path), meta_path)
        log_check, db_id = meta.log_key_check, meta.db_id
    except (OSError, ArmdbError):
        pass  # reported by the caller's own reading of db.meta
    sealers = [Sealer(k) for k in keys]
    used = [False] * len(keys)
    found: dict[str, bytes] = {}
    locked: list[str] = []
    encrypted: list[str] = []
    cdir = os.path.join(directory, COLLECTIONS)
    for name in sorted(fs.listdir(cdir)) if fs.isdir(cdir) else []:
        d = os.path.join(cdir, name)
        mpath = os.path.join(d, META_NAME)
        if not fs.isdir(d) or fs.exists(os.path.join(d, QUEUE_META)) or not fs.exists(mpath):
            continue
        try:
            cmeta = _decode_meta(fs.read_file(mpath), mpath)
        except (OSError, ArmdbError):
            continue
        if not cmeta.encrypted:
            continue
        encrypted.append(name)
        for i, s in enumerate(sealers):
            if _opens(s, cmeta.check):
                found[name] = keys[i]
                used[i] = True
                break
        else:
            locked.append(name)
    checked = False
    if log_key is not None:
        if not log_check and not _has_sealed_records(os.path.join(directory, logformat.DIR)):
            # Nothing to judge it by; opening with it would make it the database's log key.
            raise WrongKey(
                f"the transaction log key given ({log_label}) is not a key of the database {directory}: it was "
                f"never given a log key (db.meta records none and its log holds no sealed record); leave it out"
            )
        if log_check:
            if not _opens(Sealer(log_key), log_check):
                raise WrongKey(
                    f"the transaction log key given ({log_label}) is not this database's log key (db.meta keeps "
                    f"its check value); give the key its log was written with"
                )
            checked = True
    elif log_check:
        for i, s in enumerate(sealers):
            if _opens(s, log_check):
                log_key, checked, used[i] = keys[i], True, True
                break
    for i, ok in enumerate(used):
        if not ok:
            what = f"none of its encrypted collections ({', '.join(encrypted)})" if encrypted else (
                "no collection (none of its collections is encrypted)"
            )
            raise WrongKey(
                f"the key given as {names[i]} opens {what} and is not the transaction log key of the database "
                f"{directory} either; give the key its encrypted collections were created with"
            )
    return Keys(found, locked, log_key, checked, db_id)


def _has_sealed_records(txlog_dir: str) -> bool:
    """Whether a log file in ``txlog_dir`` holds a sealed record (a database from before
    log key check values, whose log key only its records can tell)."""
    fs = _fs.FS
    if not fs.isdir(txlog_dir):
        return False
    for name in fs.listdir(txlog_dir):
        if not logformat._NAME_RE.match(name):
            continue
        path = os.path.join(txlog_dir, name)
        try:
            raw = fs.read_file(path)
            _number, version = logformat._file_header_fields(raw, path)
        except (OSError, ArmdbError):
            continue
        recs, _end, _bad = logformat._records_at(raw, logformat.records_start(version))
        if any(flags & logformat.FLAG_SEALED for _o, _t, flags, _b in recs):
            return True
    return False


def _opens(sealer: Sealer, check: bytes) -> bool:
    try:
        sealer.verify(check)
    except WrongKey:
        return False
    return True
