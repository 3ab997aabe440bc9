"""Key files on the command line and keys in ``armdb.check`` / ``armdb.salvage`` (SPEC C4).

Two template databases are built once: ``clean`` (closed normally) and ``crashed`` (its
process ended with ``os._exit`` after logged commits, so its log holds sealed records
that open must replay).  Both have an encrypted map ``vault`` and an encrypted var queue
``jobs`` (payload store ``jobs.payload``) under ``KEY``, and the log key ``LOGKEY``.
Each test works on a copy.  The command line runs in this process (``cli.main``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest

import armdb
from armdb import Config, Db, QueueConfig, TxConfig, cli, logformat
from armdb.bitcask import DATA_START
from armdb.dbkeys import key_file_warning, read_key_file
from armdb.errors import ConfigError, CorruptionError, KeyFileError, WrongKey

from .conftest import run_child

KEY = bytes(range(32))
KEY2 = bytes(range(100, 132))
LOGKEY = bytes(range(160, 192))  # not all printable: a 32-character text file is refused as a password
OTHER = bytes(range(64, 96))


@dataclass
class Job:
    n: int
    s: str


Jobs = armdb.queue("jobs", payload=Job, var=True)

MAKE = """
import os, sys
from dataclasses import dataclass
import armdb
from armdb import Config, Db, QueueConfig, TxConfig

@dataclass
class Job:
    n: int
    s: str

path, crash = sys.argv[1], sys.argv[2] == "crash"
KEY, LOGKEY = {KEY!r}, {LOGKEY!r}
cfg = QueueConfig.balanced().payload_config(Config.balanced().encryption_key(KEY).build()).build()
db = Db.open(path, tx_config=TxConfig(log_encryption_key=LOGKEY))
q = db.open_queue(armdb.queue("jobs", payload=Job, var=True), cfg)
for i in range(5):
    q.push(Job(i, "x" * i))
m = db.open_map("vault", Config.balanced().encryption_key(KEY).build())
m.put("a", "SECRET-A")
db.tx().put(m, "c", "SECRET-C").commit()
q.ack(q.lease()[0].token)
if crash:
    os._exit(0)
db.close()
"""


def _make(path: Path, crash: bool) -> None:
    code = MAKE.format(KEY=KEY, LOGKEY=LOGKEY).replace("sys.argv[1], sys.argv[2]", f"{str(path)!r}, {'crash' if crash else 'clean'!r}")
    r = run_child(code)
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def templates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("keys")
    out = {}
    for name in ("clean", "crashed"):
        _make(root / name, name == "crashed")
        out[name] = root / name
    return out


@pytest.fixture
def clean(templates: dict[str, Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(templates["clean"], tmp_path / "clean"))


@pytest.fixture
def crashed(templates: dict[str, Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(templates["crashed"], tmp_path / "crashed"))


def key_file(tmp_path: Path, key: bytes, form: str = "raw", name: str | None = None, mode: int = 0o600) -> str:
    p = tmp_path / (name or f"{form}-{key[:2].hex()}.key")
    data = {
        "raw": key,
        "hex": key.hex().encode(),
        "hexnl": key.hex().encode() + b"\n",
        "hexcrlf": key.hex().encode() + b"\r\n",
        "b64": base64.b64encode(key) + b"\n",
        "b64url": base64.urlsafe_b64encode(key).rstrip(b"="),
    }[form]
    p.write_bytes(data)
    p.chmod(mode)
    return str(p)


def hashes(path: Path) -> dict[str, str]:
    """Every file under ``path`` but LOCK (whose pid every lock taker rewrites) with its hash."""
    out = {}
    for dirpath, _dirs, files in os.walk(path):
        for n in files:
            p = os.path.join(dirpath, n)
            if os.path.relpath(p, path) != "LOCK":
                out[os.path.relpath(p, path)] = hashlib.sha256(Path(p).read_bytes()).hexdigest()
    return out


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = cli.main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


# -- the key file ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["raw", "hex", "hexnl", "hexcrlf", "b64", "b64url"])
def test_c4_key_file_forms_read_back_the_key(tmp_path: Path, form: str) -> None:  # SPEC C4
    assert read_key_file(key_file(tmp_path, KEY, form)) == KEY


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"", r"is empty; write 32 random bytes"),
        (bytes(31), r"holds 31 bytes \(binary data\), which is not a 32-byte key"),
        (bytes(range(32)) + b"\n", r"holds 33 bytes"),
        (b"correct horse battery staple 123", r"32 characters of text, not a key \(a password is not a key\)"),
        (os.urandom(16).hex().encode(), r"32 characters of text \(32 hex digits, a 16-byte key\)"),
        (os.urandom(24).hex().encode() + b"\n", r"48 hex digits, a 24-byte key"),
        (b"z" * 64 + b"\n", r"holds 65 bytes \(text\)"),
        (b"k" * 4096, r"holds 4096 bytes, far more than a key"),
    ],
)
def test_c4_key_file_garbage_is_refused(tmp_path: Path, content: bytes, match: str) -> None:  # SPEC C4
    p = tmp_path / "bad.key"
    p.write_bytes(content)
    with pytest.raises(KeyFileError, match=match):
        read_key_file(p)


def test_c4_key_file_missing_or_a_folder(tmp_path: Path) -> None:  # SPEC C4
    with pytest.raises(KeyFileError, match=r"cannot read the key file .*nope.* \(No such file"):
        read_key_file(tmp_path / "nope")
    with pytest.raises(KeyFileError, match=r"is not a regular file"):
        read_key_file(tmp_path)
    assert issubclass(KeyFileError, ConfigError)


def test_c4_key_file_readable_by_others_is_warned_about(tmp_path: Path, clean: Path, capsys: pytest.CaptureFixture[str]) -> None:  # SPEC C4
    private = key_file(tmp_path, KEY, "hexnl", name="private.key")
    shared = key_file(tmp_path, KEY, "hexnl", name="shared.key", mode=0o644)
    group = key_file(tmp_path, KEY, "hexnl", name="group.key", mode=0o640)
    assert key_file_warning(private) is None
    assert "other users (mode 0644); make it private: chmod 600" in (key_file_warning(shared) or "")
    assert "its group (mode 0640)" in (key_file_warning(group) or "")
    rc, out, err = run(capsys, "check", str(clean), "--key-file", shared)
    assert rc == 0, err
    assert f"warning: the key file {shared} can be read by other users" in err
    rc, out, err = run(capsys, "check", str(clean), "--key-file", private)
    assert rc == 0 and "warning" not in err


# -- check --------------------------------------------------------------------------------------------------


def test_c4_check_with_the_keys_verifies_everything(tmp_path: Path, crashed: Path, capsys: pytest.CaptureFixture[str]) -> None:  # SPEC C4
    k, lk = key_file(tmp_path, KEY, "hexnl"), key_file(tmp_path, LOGKEY, "raw")
    before = hashes(crashed)
    rc, out, err = run(capsys, "check", str(crashed), "--key-file", k, "--log-key-file", lk)
    assert rc == 0, out + err
    assert out.strip() == "armdb.check: OK (no findings)"
    assert hashes(crashed) == before
    report = armdb.check(crashed, encryption_key=KEY, log_encryption_key=LOGKEY)
    assert report.ok and report.unverified == []


def test_c4_check_log_key_defaults_to_a_key_file_key(tmp_path: Path, crashed: Path, capsys: pytest.CaptureFixture[str]) -> None:  # SPEC C4
    k, lk = key_file(tmp_path, KEY), key_file(tmp_path, LOGKEY)
    rc, out, err = run(capsys, "check", str(crashed), "--key-file", k, "--key-file", lk)
    assert rc == 0, out + err
    assert "not verified" not in out


def test_c4_check_without_keys_checks_structure_and_says_what_it_did_not_verify(crashed: Path, capsys: pytest.CaptureFixture[str]) -> None:  # SPEC C4
    rc, out, err = run(capsys, "check", str(crashed))
    assert rc == 0, out + err
    assert "not verified without a key (3)" in out
    assert re.search(r"txlog: \d+ sealed record\(s\).*give the log key", out)
    assert "collections/vault: encrypted, and no key given opens it" in out
    assert "collections/jobs.payload: encrypted" in out
    report = armdb.check(crashed, encryption_key=KEY)  # the log stays unverified
    assert report.ok and len(report.unverified) == 1 and "sealed record" in report.unverified[0]


def test_c4_each_collection_takes_its_own_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # SPEC C4
    path = tmp_path / "two"
    cfg = QueueConfig.balanced().payload_config(Config.balanced().encryption_key(KEY2).build()).build()
    with Db.open(path) as db:
        db.open_queue(Jobs, cfg).push(Job(1, "x"))
        db.open_map("vault", Config.balanced().encryption_key(KEY).build()).put("a", 1)
    report = armdb.check(path, encryption_key=[KEY2, KEY])
    assert report.ok and report.unverified == []
    report = armdb.check(path, encryption_key=KEY)
    assert report.ok and [u.split(":")[0] for u in report.unverified] == ["collections/jobs.payload"]
    k1, k2 = key_file(tmp_path, KEY), key_file(tmp_path, KEY2, "b64")
    rc, out, err = run(capsys, "check", str(path), "--key-file", k1, "--key-file", k2)
    assert (rc, out.strip()) == (0, "armdb.check: OK (no findings)"), err


@pytest.mark.parametrize("command", ["check", "stats", "salvage"])
@pytest.mark.parametrize("which", ["collection", "log"])
def test_c4_wrong_key_exits_2_and_changes_nothing(
    tmp_path: Path, crashed: Path, capsys: pytest.CaptureFixture[str], command: str, which: str
) -> None:  # SPEC C4
    wrong = key_file(tmp_path, OTHER, "hexnl", name="wrong.key")
    right = key_file(tmp_path, KEY, "hexnl", name="right.key")
    args = ["--key-file", wrong] if which == "collection" else ["--key-file", right, "--log-key-file", wrong]
    before = hashes(crashed)
    rc, out, err = run(capsys, command, str(crashed), *args)
    assert rc == 2, out + err
    assert out == ""
    flag = "--key-file" if which == "collection" else "--log-key-file"
    assert "WrongKey: the " in err and (f"({flag} {wrong})" in err or f"as {flag} {wrong}" in err), err
    assert "--log-key-file PATH for the transaction log" in err
    assert hashes(crashed) == before  # stats did not open (and so recover) the database either


@pytest.mark.parametrize("command", ["check", "stats", "salvage"])
@pytest.mark.parametrize(
    ("content", "match"), [(None, r"cannot read the key file"), (b"hunter2\n", r"not a 32-byte key"), (bytes(33), r"33 bytes")]
)
def test_c4_bad_key_file_exits_2_and_changes_nothing(
    tmp_path: Path, crashed: Path, capsys: pytest.CaptureFixture[str], command: str, content: bytes | None, match: str
) -> None:  # SPEC C4
    p = tmp_path / "k"
    if content is not None:
        p.write_bytes(content)
    before = hashes(crashed)
    rc, out, err = run(capsys, command, str(crashed), "--log-key-file", str(p))
    assert rc == 2 and out == ""
    assert re.search(rf"armdb {command}: KeyFileError: .*{match}", err), err
    assert hashes(crashed) == before


def test_c4_check_api_refuses_bad_keys(clean: Path) -> None:  # SPEC C4
    with pytest.raises(ConfigError, match=r"encryption_key: a key must be 32 bytes .* got 16 bytes"):
        armdb.check(clean, encryption_key=bytes(16))
    with pytest.raises(ConfigError, match=r"log_encryption_key must be one 32-byte key"):
        armdb.check(clean, log_encryption_key=[LOGKEY])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"a 32-byte key \(bytes\) or a list of them, got str"):
        armdb.check(clean, encryption_key="k" * 32)  # type: ignore[arg-type]
    with pytest.raises(WrongKey, match=r"encryption_key\[1\] opens none of its encrypted collections \(jobs.payload, vault\)"):
        armdb.check(clean, encryption_key=[KEY, OTHER])
    with pytest.raises(WrongKey, match=r"log key given \(log_encryption_key\) is not this database's log key"):
        armdb.check(clean, log_encryption_key=OTHER)


def test_c4_key_for_a_database_without_encryption_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # SPEC C4
    path = tmp_path / "plain"
    with Db.open(path) as db:
        db.open_map("docs").put("a", 1)
    assert armdb.check(path).unverified == []
    k = key_file(tmp_path, KEY)
    rc, out, err = run(capsys, "check", str(path), "--key-file", k)
    assert rc == 2
    assert "opens no collection (none of its collections is encrypted)" in err


# -- damage only the key can see ------------------------------------------------------------------------------


def _records(path: Path) -> list[tuple[int, int, int]]:
    """(offset, key_len, value_len) of each record of a Bitcask data file."""
    raw = path.read_bytes()
    out, pos = [], DATA_START
    while pos + 20 <= len(raw):
        _, _, vlen, magic, klen = struct.unpack_from("<QIIHH", raw, pos)
        if magic != 0xB17C:
            break
        out.append((pos, klen, vlen))
        n = 20 + klen + vlen
        pos += n + (-n % 8)
    return out


def _flip_with_crc(path: Path, rec: int, at: int) -> None:
    """Flip a byte of the Bitcask record at ``rec`` and fix its CRC up: only its tag can tell."""
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x40
    _, _, vlen, _, klen = struct.unpack_from("<QIIHH", raw, rec)
    n = 20 + klen + vlen
    struct.pack_into("<I", raw, rec + 8, zlib.crc32(bytes(raw[rec + 12 : rec + n]), zlib.crc32(bytes(raw[rec : rec + 8]))))
    path.write_bytes(bytes(raw))


def vault_file(db: Path) -> Path:
    return db / "collections" / "vault" / "shard-000" / "00000001.data"


def test_c4_altered_sealed_value_is_found_only_with_the_key(tmp_path: Path, clean: Path, capsys: pytest.CaptureFixture[str]) -> None:  # SPEC C4
    f = vault_file(clean)
    off, klen, vlen = _records(f)[0]
    _flip_with_crc(f, off, off + 20 + klen + vlen // 2)
    assert armdb.check(clean).ok  # the CRC holds
    rc, out, _ = run(capsys, "check", str(clean))
    assert rc == 0
    k = key_file(tmp_path, KEY, "hexnl")
    rc, out, err = run(capsys, "check", str(clean), "--key-file", k)
    assert rc == 1, out + err
    assert f"1 record(s) whose sealed value fails its authentication tag under the collection key (altered or moved bytes; first at offset {off})" in out
    assert "reading them raises CorruptionError" in out


def test_c4_altered_sealed_key_found_with_the_key_and_salvaged(tmp_path: Path, clean: Path, capsys: pytest.CaptureFixture[str]) -> None:  # SPEC C4
    f = vault_file(clean)
    recs = _records(f)
    off = recs[0][0]
    _flip_with_crc(f, off, off + 20 + 14)
    assert armdb.check(clean).ok
    with Db.open(clean) as db, pytest.raises(CorruptionError, match="authentication tag"):
        db.open_map("vault", Config.balanced().encryption_key(KEY).build())  # open with the key refuses it
    report = armdb.check(clean, encryption_key=KEY)
    assert not report.ok and any("sealed key fails its authentication tag" in x and "open with the key refuses" in x
                                 for x in report.findings), report
    k = key_file(tmp_path, KEY)
    assert armdb.salvage(clean, dry_run=True).cuts == []  # without the key nothing looks wrong
    before = hashes(clean)
    rc, out, err = run(capsys, "salvage", str(clean), "--dry-run", "--key-file", k)
    assert rc == 0, err
    assert "would cut 1 file(s)" in out and "its sealed key fails its authentication tag" in out
    assert hashes(clean) == before
    rc, out, err = run(capsys, "salvage", str(clean), "--key-file", k)
    assert rc == 0, err
    assert f"collections/vault/shard-000/00000001.data: at offset {off}" in out
    assert f"{len(recs) - 1} valid record(s) dropped" in out
    assert armdb.check(clean, encryption_key=KEY).ok
    with Db.open(clean) as db:
        m = db.open_map("vault", Config.balanced().encryption_key(KEY).build())
        assert m.get("a") is None  # the altered record (and those after it) are gone, kept in salvaged/
    assert (clean / "salvaged").is_dir()


def _sealed_records(db: Path) -> list[tuple[Path, int, int]]:
    """(file, offset, body length) of every sealed record in the log."""
    out = []
    for f in sorted((db / "txlog").glob("*.log")):
        raw = f.read_bytes()
        _n, version = logformat._file_header_fields(raw, str(f))
        recs, _, _ = logformat._records_at(raw, logformat.records_start(version))
        out += [(f, off, len(body)) for off, _t, flags, body in recs if flags & logformat.FLAG_SEALED]
    return out


def test_c4_altered_sealed_log_record_found_with_the_log_key_and_salvaged(
    tmp_path: Path, crashed: Path, capsys: pytest.CaptureFixture[str]
) -> None:  # SPEC C4
    sealed = _sealed_records(crashed)
    assert len(sealed) >= 2
    f, off, blen = sealed[0]
    raw = bytearray(f.read_bytes())
    raw[off + 24 + blen // 2] ^= 0x01
    head = logformat.REC_HEAD_SIZE - 4
    struct.pack_into("<I", raw, off + head, zlib.crc32(bytes(raw[off + 24 : off + 24 + blen]), zlib.crc32(bytes(raw[off : off + head]))))
    f.write_bytes(bytes(raw))
    assert armdb.check(crashed).ok  # framing and CRC hold
    with pytest.raises(CorruptionError, match="fails its tag under the right log key"):
        Db.open(crashed, tx_config=TxConfig(log_encryption_key=LOGKEY))
    lk = key_file(tmp_path, LOGKEY, "hex")
    rc, out, err = run(capsys, "check", str(crashed), "--log-key-file", lk)
    assert rc == 1, out + err
    assert f"transaction log record at offset {off}: the sealed body fails its authentication tag under the log key" in out
    rc, out, err = run(capsys, "salvage", str(crashed), "--log-key-file", lk)
    assert rc == 0, err
    assert f"txlog/{f.name}: at offset {off} (its sealed body fails its authentication tag under the log key" in out
    assert armdb.check(crashed, encryption_key=KEY, log_encryption_key=LOGKEY).ok
    with Db.open(crashed, tx_config=TxConfig(log_encryption_key=LOGKEY)):
        pass


# -- stats ----------------------------------------------------------------------------------------------------


def test_c4_stats_of_a_crashed_encrypted_database_needs_the_log_key(
    tmp_path: Path, crashed: Path, capsys: pytest.CaptureFixture[str]
) -> None:  # SPEC C4
    before = hashes(crashed)
    rc, out, err = run(capsys, "stats", str(crashed))
    assert rc == 2 and out == ""
    assert "EncryptionKeyRequired" in err and "pass the log key with --log-key-file PATH" in err
    assert hashes(crashed) == before
    k, lk = key_file(tmp_path, KEY, "b64"), key_file(tmp_path, LOGKEY, "hexnl")
    rc, out, err = run(capsys, "stats", str(crashed), "--json", "--key-file", k, "--log-key-file", lk)
    assert rc == 0, err
    stats = json.loads(out)
    assert stats["jobs"]["len"] == 4 and stats["jobs"]["dead_len"] == 0
    rc, out, err = run(capsys, "stats", str(crashed), "--key-file", k, "--key-file", lk)  # the log key among --key-file
    assert rc == 0 and "queue jobs (var, 1 shard)" in out, err


def test_c4_help_texts_name_the_key_options(capsys: pytest.CaptureFixture[str]) -> None:  # SPEC C4
    for command in ("stats", "check", "salvage"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        text = capsys.readouterr().out
        assert "--key-file PATH" in text and "--log-key-file PATH" in text
        assert "openssl rand -hex 32" in " ".join(text.split())
        assert not re.search(r"\b[A-Z]\d+\b", text)  # no rule ids



@pytest.mark.parametrize("where", ["keeping", "cutting"])
def test_c4_salvage_with_the_key_killed_mid_cut_then_run_again(tmp_path: Path, clean: Path, where: str) -> None:  # SPEC C4
    """SIGKILL while salvage keeps the tail (before the cut) or cuts the file: nothing is
    lost, the file is whole or cut, and salvage run again finishes the job."""
    f = vault_file(clean)
    recs = _records(f)
    off = recs[1][0] if len(recs) > 1 else recs[0][0]
    _flip_with_crc(f, off, off + 20 + 14)
    whole = f.read_bytes()
    patched = "write_file_atomic" if where == "keeping" else "ftruncate"
    code = f"""
    import os, signal
    import armdb
    from armdb import _fs
    def die(*a, **k):
        os.kill(os.getpid(), signal.SIGKILL)
    _fs.FS.{patched} = die
    armdb.salvage({str(clean)!r}, encryption_key={KEY!r})
    """
    r = run_child(code)
    assert r.returncode == -9, r.stderr
    # Killed before the cut: every record is as it was (the synced mark, bytes 32-63, may be cleared).
    assert f.read_bytes()[64:] == whole[64:]
    report = armdb.salvage(clean, encryption_key=KEY)
    assert [c.offset for c in report.cuts] == [off]
    assert f.read_bytes()[64:] == whole[64:off]
    kept = clean / report.cuts[0].kept_as  # type: ignore[operator]
    assert kept.read_bytes() == whole[off:]
    assert armdb.check(clean, encryption_key=KEY).ok
    with Db.open(clean) as db:
        m = db.open_map("vault", Config.balanced().encryption_key(KEY).build())
        assert m.get("a") == "SECRET-A" or off == recs[0][0]
