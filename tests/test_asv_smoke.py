"""Every asv benchmark runs once at its smallest parameters, so none of them rots.

The benchmarks are called directly (``setup_cache``, ``setup``, the benchmark,
``teardown``), as asv would, with ``ARMDB_ASV_QUICK=1`` so that sizes shrink.  No
speed is asserted.  A benchmark whose ``setup`` raises ``NotImplementedError`` is
one asv skips; here it is reported as a skip.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ASV = Path(__file__).resolve().parent.parent / "asv_bench"
PREFIXES = ("time_", "timeraw_", "track_", "mem_", "peakmem_")

os.environ["ARMDB_ASV_QUICK"] = "1"  # read when the benchmark modules are imported
if str(ASV) not in sys.path:
    sys.path.insert(0, str(ASV))


def benchmark_modules() -> list[str]:
    return sorted(
        f"benchmarks.{p.stem}" for p in (ASV / "benchmarks").glob("*.py") if p.stem not in {"__init__", "common"}
    )


def smallest(values: list[Any]) -> list[Any]:
    """The smallest of a numeric parameter list; every value of any other kind (flavours...)."""
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return [min(values)]
    return list(values)


def param_combos(cls: type) -> list[tuple[Any, ...]]:
    params = getattr(cls, "params", [])
    if not params:
        return [()]
    if not isinstance(params[0], list):  # a single parameter list
        params = [params]
    return list(itertools.product(*(smallest(p) for p in params)))


def benchmarks() -> Iterator[Any]:
    for modname in benchmark_modules():
        mod = importlib.import_module(modname)
        for cname, cls in sorted(vars(mod).items()):
            if not inspect.isclass(cls) or cls.__module__ != mod.__name__ or cname.startswith("_"):
                continue
            for mname in sorted(n for n in dir(cls) if n.startswith(PREFIXES)):
                for combo in param_combos(cls):
                    yield pytest.param(cls, mname, combo, id=f"{modname.split('.')[-1]}.{cname}.{mname}{list(combo)}")


_CACHES: dict[type, Any] = {}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("asv-cache")


@pytest.mark.parametrize(("cls", "method", "params"), list(benchmarks()))
def test_asv_benchmark_runs_once(cls: type, method: str, params: tuple[Any, ...], cache_dir: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    bench = cls()
    args: list[Any] = list(params)
    if hasattr(bench, "setup_cache"):
        if cls not in _CACHES:
            monkeypatch.chdir(cache_dir)  # asv runs setup_cache in a scratch directory
            _CACHES[cls] = bench.setup_cache()
        args = [_CACHES[cls], *args]
    if hasattr(bench, "setup"):
        bench.setup(*args)  # no benchmark skips itself (asv's NotImplementedError): every one must run
    try:
        result = getattr(bench, method)(*args)
        if method.startswith("track_"):
            assert isinstance(result, (int, float)) and result >= 0
    finally:
        if hasattr(bench, "teardown"):
            bench.teardown(*args)


def test_asv_collects_benchmarks() -> None:
    names = {p.id.split("[")[0] for p in benchmarks()}
    for required in (
        "queue.LeaseScan.time_lease_scan_10k_outstanding",
        "queue.ColdOpen.time_open_1m_rows",
        "queue.Push.time_push",
        "queue.LeaseAck.time_lease_ack",
        "queue.Cycle.time_cycle",
        "queue.Footprint.track_version_vector_bytes",
        "queue.QueueRss.track_rss_per_queue",
        "maps.MapPut.time_put",
        "maps.MapGet.time_get",
        "tx.TxCommit.time_commit",
        "tx.TxCommitThreads.time_commit_8_threads",
    ):
        assert required in names


def test_asv_conf_is_valid() -> None:
    raw = (ASV / "asv.conf.json").read_text()
    conf = json.loads(re.sub(r"^\s*//.*$", "", raw, flags=re.MULTILINE))  # asv allows // comments
    assert conf["benchmark_dir"] == "benchmarks"
    assert conf["repo"] == ".."
    # virtualenv builds older commits; `asv run --python=same` still benchmarks this checkout
    assert conf["environment_type"] == "virtualenv"
    assert all("--no-deps" in c for c in conf["build_command"] if "pip wheel" in c)
