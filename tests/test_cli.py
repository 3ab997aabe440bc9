"""The command line (SPEC C1-C3): demo, stats DIR, bench (its workloads at tiny sizes)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import armdb
from armdb import _bench, cli

from .conftest import child_env

SUMMARY = re.compile(
    r"demo: (?P<jobs>[\d,]+) jobs: done (?P<done>[\d,]+), retried (?P<retried>[\d,]+), "
    r"dead-lettered (?P<dead>[\d,]+), elapsed [\d.]+ s, [\d,]+ jobs/s"
)


def _num(s: str) -> int:
    return int(s.replace(",", ""))


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "armdb", *args],
        env=child_env(), capture_output=True, text=True, timeout=timeout, check=False,
    )


# -- C1 ----------------------------------------------------------------------------------------


def test_c1_demo_runs() -> None:
    r = run_cli("demo", "--jobs", "200")
    assert r.returncode == 0, r.stderr
    assert "queue demo_jobs" in r.stdout
    for stat in ("len", "dead_len", "pushes", "acks", "nacks", "dead_lettered", "version_vector_bytes"):
        assert re.search(rf"^{stat}\s+[\d,]+$", r.stdout, re.MULTILINE), f"{stat} missing from the stats table"
    m = SUMMARY.search(r.stdout)
    assert m, r.stdout
    jobs, done, dead = _num(m["jobs"]), _num(m["done"]), _num(m["dead"])
    assert jobs == 200
    assert done + dead == 200
    assert dead == 1  # job 199 is poison
    assert _num(m["retried"]) >= 2  # the poison job's two retries at least
    assert "demo [" in r.stderr  # the progress bar
    assert re.search(r"^dead_len\s+1$", r.stdout, re.MULTILINE)
    assert re.search(r"^len\s+0$", r.stdout, re.MULTILINE)


def test_c1_demo_keeps_dir_and_stats_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "demo"
    r = run_cli("demo", "--dir", str(path), "--jobs", "50")
    assert r.returncode == 0, r.stderr
    assert f"database in {path}" in r.stdout
    s = cli.inspect_queue(str(path), "demo_jobs")
    assert (s.flavour, s.live, s.dead) == ("var", 0, 0)
    assert s.payload_bytes > 0


def test_c1_poison_schedule() -> None:
    assert [i for i in range(2000) if cli.is_poison(i)] == [199, 599, 999, 1399, 1799]


# -- C2 ----------------------------------------------------------------------------------------


Pings = armdb.queue("pings", payload=np.dtype([("doc", "<u8")]))


def _make_db(path: Path) -> None:
    """10 ready + 1 delayed rows; lease 3, dead-letter 1: live 10 = 7 ready + 2 leased + 1 delayed."""
    with armdb.Db.open(path) as db:
        q = db.open_queue(Pings)
        for i in range(10):
            q.push((i,))
        q.push((99,), delay=3600)
        leases = q.lease(3, lease_timeout=3600)
        q.nack(leases[0].token, dead=True)
        s = q.stats()
        assert (s.len, s.ready, s.leased, s.delayed, s.dead_len) == (10, 7, 2, 1, 1)


def _stat(out: str, name: str) -> int:
    m = re.search(rf"^{re.escape(name)}\s+([\d,]+)$", out, re.MULTILINE)
    assert m, f"{name!r} missing in:\n{out}"
    return _num(m[1])


def test_c2_stats_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "db"
    _make_db(path)
    assert cli.main(["stats", str(path)]) == 0
    out = capsys.readouterr().out
    assert "queue pings (fixed, 1 shard)" in out
    expected = {"live": 10, "ready": 7, "leased": 2, "delayed": 1, "dead": 1, "torn slots": 0,
                "slots allocated": 100_000}
    for name, value in expected.items():
        assert _stat(out, name) == value
    slot = armdb.fixed.slot_size_for(16, 32 + 8)  # key, header, the 8-byte inline payload
    assert _stat(out, "header file logical bytes") == 4096 + 100_000 * slot
    # The blocks of the whole file are allocated (fallocate at growth), rounded up to blocks.
    assert 0 < _stat(out, "header file logical bytes") <= _stat(out, "header file physical bytes")


def test_c2_stats_dir_in_a_child(tmp_path: Path) -> None:
    path = tmp_path / "db"
    _make_db(path)
    r = run_cli("stats", str(path))
    assert r.returncode == 0, r.stderr
    assert _stat(r.stdout, "ready") == 7


def test_c2_stats_of_a_locked_db_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "db"
    _make_db(path)
    with armdb.Db.open(path):
        assert cli.main(["stats", str(path)]) == 1
    err = capsys.readouterr().err
    assert "already open by process" in err


def test_c2_stats_of_a_non_database_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["stats", str(tmp_path / "nothing")]) == 1
    assert "not an armdb database" in capsys.readouterr().err
    assert not (tmp_path / "nothing").exists()  # nothing was created


def test_c2_stats_of_a_shard_whose_header_gives_an_impossible_slot_size_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A CRC-valid header page with slot size 0 made ``stats`` die with ZeroDivisionError
    (found while moving the offline reader into armdb.inspect): it is a FormatError now."""
    import struct
    import zlib

    path = tmp_path / "db"
    _make_db(path)
    data = path / "collections" / "pings" / "shard-000" / "fixed.data"
    raw = bytearray(data.read_bytes())
    head = struct.pack("<8sIIIII", b"ARMFIXD1", 1, 0, 16, 40, 0)
    raw[: len(head) + 4] = head + struct.pack("<I", zlib.crc32(head))
    data.write_bytes(bytes(raw))
    assert cli.main(["stats", str(path)]) == 1
    err = capsys.readouterr().err
    assert "FormatError" in err and "slot size 0" in err


def test_c2_stats_of_a_db_without_queues(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    armdb.Db.open(tmp_path / "db").shutdown()
    assert cli.main(["stats", str(tmp_path / "db")]) == 0
    assert "no queues" in capsys.readouterr().out


# -- C3 ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", _bench.CASES, ids=lambda c: f"{c.workload}|{c.system}")
def test_c3_bench_workloads_tiny(case: _bench.Case) -> None:
    result = _bench.run_case(case, _bench.TINY)
    if result.status.startswith("not installed"):
        assert case.requires is not None
        assert "pip install" in result.status
        return
    assert result.status == "ok", result.status
    assert len(result.values) == case.repeats_in(_bench.TINY)
    assert all(v > 0 for v in result.values)


def test_c3_bench_missing_peer_says_how_to_install() -> None:
    case = replace(_bench.CASES[0], system="imaginary", requires="no_such_peer_module_xyz", reference=False)
    result = _bench.run_case(case, _bench.TINY)
    assert result.values == []
    assert result.status == "not installed: pip install -e '.[bench]'"
    table = _bench.markdown_table([result])
    assert "| imaginary |" in table and "not installed" in table


def test_c3_bench_failing_case_is_reported_not_raised() -> None:
    def boom(d: str, s: _bench.Sizes) -> float:
        raise RuntimeError("peer exploded")

    case = replace(_bench.CASES[0], system="broken", run=boom)
    result = _bench.run_case(case, _bench.TINY)
    assert result.status.startswith("error: RuntimeError: peer exploded")


def test_c3_bench_main_prints_tables_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "bench.json"
    assert _bench.main(json_path=str(out_json), only="cycle/fixed", sizes=_bench.TINY) == 0
    out = capsys.readouterr().out
    assert "| workload | system | durability | median |" in out
    assert "| cycle/fixed | armdb fixed queue (defaults) |" in out
    assert "| cycle/fixed | armdb fixed queue (tuned: no fsync" in out  # a tuned row names its settings
    assert "reference" in out
    assert "| target | goal | measured | met |" in out
    doc = json.loads(out_json.read_text())
    assert doc["command"] == "python -m armdb bench"
    assert {r["workload"] for r in doc["results"]} == {"cycle/fixed"}
    armdb_row = next(r for r in doc["results"] if r["system"].startswith("armdb"))
    assert armdb_row["median"] > 0 and armdb_row["reference"]


def test_c3_bench_ratios_are_within_the_run() -> None:
    fixed = [c for c in _bench.CASES if c.workload == "cycle/fixed"]
    a = _bench.CaseResult(fixed[0], [300.0, 100.0, 200.0])
    s = _bench.CaseResult(fixed[1], [50.0])
    assert _bench.speedup(a, s) == pytest.approx(4.0)
    scan = [c for c in _bench.CASES if c.workload.startswith("lease_scan")]
    a2 = _bench.CaseResult(scan[0], [10.0])
    s2 = _bench.CaseResult(scan[1], [30.0])
    assert _bench.speedup(a2, s2) == pytest.approx(3.0)  # lower is better: armdb 3× faster
    tuned = next(c for c in fixed if c.system == _bench.ARMDB_FIXED_TUNED)
    t = _bench.CaseResult(tuned, [4000.0])
    ts = _bench.targets([a, s, t, a2, s2], 400_000, 1_000_000)
    by_name = {t.name: t for t in ts}
    assert by_name["lease_scan/10k_outstanding"].met is True
    # the no-fsync target is judged on the tuned row: 80× SQLite, but far below 200k cycles/s
    assert by_name["cycle/fixed, no fsync (tuned row)"].met is False
    assert "4,000 cycles/s = 80.00× SQLite" in by_name["cycle/fixed, no fsync (tuned row)"].measured
    assert by_name["RAM per idle queue shard"].met is True


def test_c3_unknown_workload_filter_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--only", "no-such-workload"]) == 2


def test_c3_bench_interleaves_repeats_within_a_workload() -> None:
    calls: list[str] = []

    def fake(name: str):  # type: ignore[no-untyped-def]
        def run(d: str, s: _bench.Sizes) -> float:
            assert Path(d).is_dir()  # a fresh temporary directory per repeat
            calls.append(name)
            return 1.0

        return run

    base = _bench.CASES[0]
    cases = [
        replace(base, workload="w1", system="a", run=fake("a")),
        replace(base, workload="w1", system="b", run=fake("b"), reference=False),
        replace(base, workload="w2", system="c", run=fake("c")),
    ]
    progress: list[tuple[int, int]] = []
    results = _bench.run(replace(_bench.TINY, repeats=2), cases, lambda d, t, _label: progress.append((d, t)))
    assert calls == ["a", "b", "a", "b", "c", "c"]
    assert [len(r.values) for r in results] == [2, 2, 2]
    assert progress[-1] == (6, 6)


# -- C4: the command line speaks to users --------------------------------------------------------------


def test_c4_version_matches_the_package(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"armdb {armdb.__version__}"
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert f'version = "{armdb.__version__}"' in pyproject


def test_c4_stats_json_is_one_object_keyed_by_queue(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "db"
    _make_db(path)
    assert cli.main(["stats", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"pings"}
    pings = out["pings"]
    assert (pings["len"], pings["dead_len"], pings["ready"], pings["leased"], pings["delayed"]) == (10, 1, 7, 2, 1)
    assert pings["flavour"] == "fixed" and pings["shards"] == 1


def test_c4_output_into_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    path = tmp_path / "db"
    _make_db(path)
    # The reader is gone before the command writes a byte (it closes its end at once, and
    # the child takes far longer to import armdb): no traceback, SIGPIPE's exit status.
    p = subprocess.Popen([sys.executable, "-m", "armdb", "stats", str(path), "--json"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=child_env())
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()
    with p.stderr:
        err = p.stderr.read()
    assert p.wait(timeout=60) == 141 and err == b"", err
