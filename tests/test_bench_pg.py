"""The postgres rows of ``python -m armdb bench`` (armdb/_bench_pg.py) at a tiny size, on
the tests' server, so that they do not rot.  No speed is asserted."""

from __future__ import annotations

from typing import Any

import pytest

from armdb import _bench, _bench_pg


@pytest.fixture
def bench_dsn(pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(_bench_pg, "_dsn", pg_dsn)
    return pg_dsn


@pytest.mark.parametrize("case", _bench.PG_CASES, ids=lambda c: f"{c.workload}|{c.system.split(' (')[0]}")
def test_c3_postgres_bench_rows_tiny(case: _bench.Case, bench_dsn: str) -> None:
    # SPEC C3 (issue 19): every postgres row runs, in 1 and 4 processes, and reports a rate
    result = _bench.run_case(case, _bench.TINY)
    if result.status.startswith("not installed"):
        assert case.requires is not None and "pip install" in result.status
        return
    assert result.status == "ok", result.status
    assert len(result.values) == case.repeats_in(_bench.TINY) and all(v > 0 for v in result.values)


def test_c3_postgres_rows_compare_like_systems() -> None:
    # SPEC C3: each postgres workload has armdb.pg as its reference and the plain SQL peer
    # beside it, all at one durability, 1 and 4 processes, per job and batched
    workloads = {c.workload for c in _bench.PG_CASES}
    assert workloads == set(_bench_pg.WORKLOADS.values()) and len(workloads) == 4
    for w in workloads:
        rows = [c for c in _bench.PG_CASES if c.workload == w]
        assert [c.system.startswith("armdb.pg") for c in rows if c.reference] == [True]
        assert any(c.system.startswith("plain SQL") for c in rows)
        assert {c.durability for c in rows} == {_bench_pg.DURABILITY}
        assert all("postgres" in c.workload for c in rows)


def test_c3_postgres_bench_main_judges_the_target(bench_dsn: str, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # SPEC C3: `bench --only postgres/batch...` prints the rows and the 1.5× target of issue 19
    # (armdb.pg and the plain SQL peer only: the others ran above)
    monkeypatch.setattr(_bench, "PG_CASES", [c for c in _bench.PG_CASES if c.requires == "psycopg"])
    assert _bench.main(only=_bench_pg.WORKLOADS[("batch", 1)], sizes=_bench.TINY, dsn=bench_dsn) == 0
    out = capsys.readouterr().out
    assert "| armdb.pg (defaults) |" in out and "reference" in out
    assert "armdb.pg vs the best peer | ≥ 1.5× the best peer |" in out
    # the row of lease_batch(ack=) (issue 19, round 3) and its own line under the target
    assert "| armdb.pg (lease_batch(n, ack=previous)" in out
    assert "armdb.pg with lease_batch(ack=) vs the best peer | ≥ 1.5× the best peer |" in out


def test_c3_postgres_fresh_database_is_dropped(bench_dsn: str) -> None:
    # SPEC C3: each repeat runs in a database of its own, dropped afterwards
    import psycopg

    def names() -> set[Any]:
        with psycopg.connect(bench_dsn, autocommit=True) as c:
            return {r[0] for r in c.execute("SELECT datname FROM pg_database").fetchall()}

    before = names()
    _bench_pg.run_workload(_bench_pg.PlainSql, "cycle", 3, 1, warmup=1)
    assert names() == before
