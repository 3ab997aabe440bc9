"""The offline, read-only check of a Bitcask collection (SPEC D6).

:func:`check_dir` reads a collection that no store has open and reports, as readable
findings, everything open would refuse or repair: the meta file, every data file
header, every record's CRC and gsn, every hint file against its data file, a pending
compaction marker, a missing active file, and the tail open would cut (judged by the
same rule as open, :func:`armdb.bitcask.files._judge_bad`).  It changes nothing and
needs no encryption key: CRCs cover the sealed bytes.

Lock policy: none; the caller keeps the collection closed (``armdb.check`` holds the
database's directory lock).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from .. import _fs
from .._crypto import Sealer
from ..errors import CorruptionError, FormatError, WrongKey
from ..seqmap import MAX_RESERVED
from .files import (
    Scanned,
    _DataFile,
    _iter_hint,
    _judge_bad,
    _read_file_header,
    _Scan,
    _synced_mark,
    _ValidIndex,
)
from .format import (
    _DATA_RE,
    _HINT_RE,
    DATA_MAGIC,
    FLAG_COMPACTED,
    FLAG_ENCRYPTED,
    META_NAME,
    PENDING_NAME,
    REC_HEAD_SIZE,
    SEQ_MASK,
    TOMBSTONE,
    _appenders,
    _check_pending,
    _decode_meta,
    _decode_pending,
    _Header,
    _parse_header,
    _shard_dir,
    record_aad,
)
from .recovery import _check_active_present, _ShardPlan


def check_dir(
    directory: str,
    *,
    gsn_limit: int | None = None,
    decode: Callable[[bytes, bytes], object] | None = None,
    key: bytes | None = None,
) -> list[str]:
    """Check a Bitcask collection that is not open, without changing anything (SPEC D6).

    Verifies the meta file, every data file header, every record's CRC, every gsn
    (below ``gsn_limit``), and every hint file against its data file.  Needs no
    encryption key: CRCs cover the sealed bytes.  With the key of an encrypted
    collection it also opens every record's sealed key and value (their authentication
    tags: bytes altered with their CRC fixed up, or moved from another record, fail
    them) and decodes the plaintexts with ``decode``.

    Parameters
    ----------
    directory : str
        The collection folder.
    gsn_limit : int, optional
        The end of the gsns the database reserved in its sequence map; default
        ``armdb.seqmap.MAX_RESERVED``.
    decode : callable, optional
        Called with the key and value of every put record (a map's decoders); what it
        raises is reported as a finding.  For an encrypted collection only with ``key``.
    key : bytes, optional
        The collection's key (ignored for a collection that is not encrypted).

    Returns
    -------
    list of str
        Readable findings; empty when the collection is consistent.

    Raises
    ------
    WrongKey
        ``key`` is not the key the collection was created with.
    """
    fs = _fs.FS
    findings: list[str] = []
    meta_path = os.path.join(directory, META_NAME)
    try:
        meta = _decode_meta(fs.read_file(meta_path), meta_path)
    except (FormatError, CorruptionError) as e:
        return [str(e)]
    except OSError as e:
        return [f"{meta_path}: cannot read the meta file ({e})"]
    sealer: Sealer | None = None
    if meta.encrypted and key is not None:
        sealer = Sealer(key)
        try:
            sealer.verify(meta.check)
        except WrongKey:
            raise WrongKey(
                f"the key given for collection {os.path.basename(directory)!r} is not the key it was created "
                f"with ({directory}); give the original key"
            ) from None
    count = meta.shard_count
    present = sum(1 for name in fs.listdir(directory) if name.startswith("shard-"))
    if count > present:  # a huge count in a crafted meta file: one finding, not one per shard
        findings.append(f"{meta_path}: names {count} shards but {present} shard folder(s) exist")
        count = min(count, present + 1)
    for i in range(count):
        sdir = _shard_dir(directory, i)
        try:
            _check_shard(
                sdir,
                meta.encrypted,
                findings,
                MAX_RESERVED if gsn_limit is None else gsn_limit,
                None if meta.encrypted and sealer is None else decode,
                None if sealer is None else (sealer, meta.salt),
            )
        except OSError as e:
            findings.append(f"{sdir}: I/O error while checking ({e})")
    return findings


def _check_shard(
    sdir: str,
    encrypted: bool,
    findings: list[str],
    gsn_limit: int = MAX_RESERVED,
    decode: Callable[[bytes, bytes], object] | None = None,
    sealed: tuple[Sealer, bytes] | None = None,
) -> None:
    fs = _fs.FS
    if not fs.isdir(sdir):
        findings.append(f"{sdir}: shard folder is missing")
        return
    names = fs.listdir(sdir)
    data: dict[int, str] = {}
    hints: dict[int, str] = {}
    for name in names:
        path = os.path.join(sdir, name)
        if m := _DATA_RE.match(name):
            data[int(m.group(1))] = path
        elif m := _HINT_RE.match(name):
            hints[int(m.group(1))] = path
        elif name.endswith(".tmp"):
            findings.append(f"{path}: leftover temporary file (removed on next open)")
    want = FLAG_ENCRYPTED if encrypted else 0
    heads: dict[int, _Header] = {}
    all_heads: dict[int, _Header | None] = {}  # with None for a zero header, as open sees them
    for fid, path in sorted(data.items()):
        raw = _read_file_header(path)
        try:
            head = _parse_header(raw, path, DATA_MAGIC, "Bitcask data")
        except (FormatError, CorruptionError) as e:
            findings.append(str(e))
            continue
        all_heads[fid] = head
        if head is None:
            findings.append(f"{path}: data file header is missing or zero (offset 0)")
            continue
        if head.fid != fid:
            findings.append(f"{path}: header names file id {head.fid} (offset 12)")
        if head.flags & FLAG_ENCRYPTED != want:
            findings.append(f"{path}: encryption flag differs from the collection's (offset 10)")
        heads[fid] = head
    pending: list[int] = []
    if PENDING_NAME in names:
        path = os.path.join(sdir, PENDING_NAME)
        try:
            fids = _decode_pending(fs.read_file(path), path)
            _check_pending(fids, all_heads, path)
            pending = fids
            findings.append(
                f"{path}: an interrupted compaction is pending (files {fids}); the next open finishes it"
            )
        except (FormatError, CorruptionError) as e:
            findings.append(str(e))
    live = [fid for fid in sorted(all_heads) if fid not in pending]
    try:  # open's rule: a shard whose active data file is gone is refused
        _check_active_present(
            _ShardPlan(0, sdir), live, _appenders(all_heads, set(pending)), sorted(hints)
        )
    except CorruptionError as e:
        findings.append(str(e))
    appenders = [fid for fid, h in heads.items() if not h.flags & FLAG_COMPACTED]
    active = max(appenders) if appenders else None
    for fid, head in sorted(heads.items()):
        path = data[fid]
        fd = fs.open(path, os.O_RDONLY)
        try:
            size = fs.size(fd)
            dummy = _DataFile(fid, path, fd, size, head.flags, head.nonce, head.base_gsn, version=head.version)
            mark = _synced_mark(dummy, sdir)[0]
            if mark > size:  # open refuses the shard: synced records are gone
                findings.append(
                    f"{path}: the data file ends at offset {size}, below offset {mark}, which its synced mark "
                    f"says a completed sync covered: synced records are missing, and open refuses the shard"
                )
            records: dict[int, Scanned] = {}
            scan = _Scan(fd, size, encrypted, dummy.start)
            for rec in scan:
                records[rec[0]] = rec
            if scan.bad is not None:
                valid = _ValidIndex(fd, size, scan.bad, encrypted)  # one pass for every bad record
                nxt = valid.next_after(scan.bad)
                cut = _tail_cut(fid, path, fd, size, head, scan.bad, encrypted, mark) if fid == active else None
                if cut is not None:
                    findings.append(cut)
                else:
                    findings.append(f"{path}: corrupt record at offset {scan.bad}")
                    while nxt is not None:
                        # Report every further bad record too, resuming after each good run.
                        more = _Scan(fd, size, encrypted, start=nxt)
                        for rec in more:
                            records[rec[0]] = rec
                        if more.bad is None:
                            break
                        findings.append(f"{path}: corrupt record at offset {more.bad}")
                        nxt = valid.next_after(more.bad)
            dummy.fd = -1
            if sealed is not None:
                _check_sealed(path, fd, records, sealed[0], sealed[1], decode, findings, fid == active)
            elif decode is not None:
                _check_decode(path, fd, records, decode, findings)
        finally:
            fs.close(fd)
        _check_gsns(path, head, records, gsn_limit, findings)
        hpath = hints.get(fid)
        if hpath is not None:
            _check_hint(hpath, dummy, records, findings, encrypted)
    for fid, hpath in hints.items():
        if fid not in data:
            findings.append(f"{hpath}: hint file without its data file")


def _tail_cut(
    fid: int, path: str, fd: int, size: int, head: _Header, bad: int, encrypted: bool, mark: int
) -> str | None:
    """The finding for a bad record in the active data file that open would cut (a torn
    tail, or an unsynced tail a power cut reordered), or None where open refuses it as
    damage: :func:`_judge_bad` decides, as at open, from the file's synced ``mark``."""
    if mark > size:
        return None
    f = _DataFile(fid, path, fd, size, head.flags, head.nonce, head.base_gsn, version=head.version)
    try:
        dropped = _judge_bad(f, bad, encrypted, mark)
    except CorruptionError:
        return None
    if dropped:
        return (f"{path}: unsynced tail of {size - bad} bytes at offset {bad}, {dropped} intact record(s) after "
                f"a damaged one that no sync covered (cut on next open)")
    return f"{path}: torn tail of {size - bad} bytes at offset {bad} (truncated on next open)"


def _check_decode(
    path: str, fd: int, records: dict[int, Scanned], decode: Callable[[bytes, bytes], object], findings: list[str]
) -> None:
    """Report put records whose key or value the collection's decoders refuse (CRC-valid bytes
    that reads would fail on)."""
    bad: list[str] = []
    count = 0
    for off, gsn_word, klen, vlen, _rsize, kf in sorted(records.values()):
        if gsn_word & TOMBSTONE:
            continue
        value = _fs.FS.pread(fd, vlen, off + REC_HEAD_SIZE + klen)
        try:
            decode(kf, value)
        except Exception as e:  # noqa: BLE001 - a checker reports what a read would raise
            count += 1
            if len(bad) < 3:
                bad.append(f"offset {off}: {type(e).__name__}: {e}")
    if count:
        findings.append(f"{path}: {count} record(s) do not decode ({'; '.join(bad)})")


def _check_sealed(
    path: str,
    fd: int,
    records: dict[int, Scanned],
    sealer: Sealer,
    salt: bytes,
    decode: Callable[[bytes, bytes], object] | None,
    findings: list[str],
    active: bool,
) -> None:
    """Open every record's sealed key and value under the collection key (what open does
    with the keys, and a read with the value) and decode the plaintexts with ``decode``."""
    bad_keys: list[int] = []
    bad_values: list[int] = []
    undecodable: list[str] = []
    n_undecodable = 0
    for off, gsn_word, klen, vlen, _rsize, kf in sorted(records.values()):
        try:
            key = sealer.open(kf, record_aad(salt, b"K", gsn_word))
        except CorruptionError:
            bad_keys.append(off)
            continue
        if gsn_word & TOMBSTONE:
            continue
        try:
            value = sealer.open(_fs.FS.pread(fd, vlen, off + REC_HEAD_SIZE + klen), record_aad(salt, b"V", gsn_word))
        except CorruptionError:
            bad_values.append(off)
            continue
        if decode is not None:
            try:
                decode(key, value)
            except Exception as e:  # noqa: BLE001 - a checker reports what a read would raise
                n_undecodable += 1
                if len(undecodable) < 3:
                    undecodable.append(f"offset {off}: {type(e).__name__}: {e}")
    if bad_keys:
        what = "salvage with the key cuts the file there" if active else "restore the collection from a backup"
        findings.append(
            f"{path}: {len(bad_keys)} record(s) whose sealed key fails its authentication tag under the "
            f"collection key (altered or moved bytes; first at offset {bad_keys[0]}): open with the key refuses "
            f"the collection; {what}"
        )
    if bad_values:
        findings.append(
            f"{path}: {len(bad_values)} record(s) whose sealed value fails its authentication tag under the "
            f"collection key (altered or moved bytes; first at offset {bad_values[0]}): reading them raises "
            f"CorruptionError; restore the collection from a backup"
        )
    if n_undecodable:
        findings.append(f"{path}: {n_undecodable} record(s) do not decode ({'; '.join(undecodable)})")


def _check_gsns(path: str, head: _Header, records: dict[int, Scanned], limit: int, findings: list[str]) -> None:
    """Report gsns no write could have produced (open refuses the collection)."""
    if head.base_gsn >= limit:
        findings.append(f"{path}: file header holds base gsn {head.base_gsn} (offset 16), not below {limit}")
    beyond = sorted(off for off, rec in records.items() if rec[1] & SEQ_MASK >= limit)
    if beyond:
        seq = records[beyond[0]][1] & SEQ_MASK
        findings.append(
            f"{path}: {len(beyond)} record(s) hold a gsn not below {limit}, the end of the gsns the "
            f"database reserved (first: gsn {seq} at offset {beyond[0]})"
        )


def _check_hint(
    hpath: str, f: _DataFile, records: dict[int, Scanned], findings: list[str], encrypted: bool = False
) -> None:
    raw = _fs.FS.read_file(hpath)
    try:
        entries = _iter_hint(raw, hpath, f, encrypted, legacy=True)
    except (FormatError, CorruptionError) as e:
        findings.append(str(e))
        return
    if entries is None:
        findings.append(f"{hpath}: hint file is damaged or does not match {f.path} (rebuilt on next open)")
        return
    n = 0
    try:
        for off, gsn_word, klen, vlen, _, kf in entries:
            n += 1
            rec = records.get(off)
            if rec is None or rec[1] != gsn_word or rec[2] != klen or rec[3] != vlen or rec[5] != kf:
                findings.append(
                    f"{hpath}: entry {n - 1} does not match the record at offset {off} of {f.path}"
                )
                return
    except CorruptionError as e:
        findings.append(str(e))
        return
    if n != len(records):
        findings.append(f"{hpath}: holds {n} entries but {f.path} has {len(records)} valid records")
