"""The replication rows of ``python -m armdb bench`` run at their smallest sizes, so they
do not rot (figures are never asserted: docs/performance.md has them)."""

from __future__ import annotations

import pytest

from armdb import _bench

CASES = [c for c in _bench.CASES if c.workload.startswith("replication/")]


def test_every_replication_workload_has_rows() -> None:
    names = {c.workload for c in CASES}
    assert {"replication/lag-fixed-p50", "replication/lag-fixed-p99", "replication/lag-var-100B-p50",
            "replication/lag-var-100B-p99", "replication/cycle-fixed", "replication/durable-commit"} <= names


# SPEC R1, R4: the lag under the fixed and var cycles, the cycle with a follower, and a
# durable commit with sync_replicas(1), each against no replica where it has one
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.workload}/{c.system[:24]}")
def test_replication_row_runs(case: _bench.Case) -> None:
    result = _bench.run_case(case, _bench.TINY)
    assert result.status == "ok", result.status
    assert len(result.values) == case.repeats_in(_bench.TINY)
    assert all(v >= 0 for v in result.values), result.values
    if case.higher_is_better:
        assert all(v > 0 for v in result.values), result.values
