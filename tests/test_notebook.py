"""The inspection notebook and the two things it relies on (SPEC Q26, Q27).

``docs/examples/inspect.ipynb`` is executed with nbclient in a real ``python3``
kernel (ipykernel from this interpreter's environment; jupyter_client starts the
kernel with ``sys.executable``), so it cannot rot.  It needs the ``notebook``
extra: nbclient, nbformat, ipykernel, pandas and matplotlib.
"""

from __future__ import annotations

import dataclasses
import html.parser
import tracemalloc
import warnings
from pathlib import Path

import numpy as np

import armdb
from armdb import Db, QueueConfig, QueueStats, State

from .conftest import ROOT, FakeClock

NOTEBOOK = ROOT / "docs" / "examples" / "inspect.ipynb"

# Every stat SPEC Q26 names; QueueStats may have more (it has orphans_collected).
Q26_STATS = [
    "len", "dead_len", "ready", "leased", "delayed", "shards", "slots_allocated",
    "version_vector_bytes", "header_file_logical_bytes", "header_file_physical_bytes",
    "payload_writes", "compaction_bytes", "payload_compaction_bytes", "pushes", "acks",
    "nacks", "dead_lettered", "expired_leases", "repaired_on_open", "retention_retry_pending",
]

Pings = armdb.queue("nb_pings", payload=np.dtype([("doc", "<u8"), ("flags", "<u4")]))


def _workload(db: Db, clock: FakeClock) -> armdb.Queue:
    """A queue holding rows in every state: ready, delayed, leased and dead.

    Ends with rows 7-12 ready, 4-5 leased, 6 and 13 delayed, 2 and 3 dead.
    """
    q = db.open_queue(Pings, QueueConfig.balanced().max_attempts(2).backoff_secs([10]).lease_timeout(30).build())
    for i in range(12):
        q.push((i, 0))  # ids 1..12
    q.push((100, 0), delay=600)  # id 13
    first = q.lease(3)  # rows 1, 2, 3
    q.ack(first[0].token)
    q.nack(first[1].token, dead=True)  # row 2 dead at t0
    clock.advance(40)  # row 3's lease expires
    (again,) = q.lease(1)  # row 3 comes first in key order: attempt 2
    assert (again.id, again.attempt) == (3, 2)
    q.nack(again.token)  # attempts reached max_attempts: dead at t0 + 40 s
    q.lease(2)  # rows 4 and 5 stay leased
    (later,) = q.lease(1)
    q.nack(later.token, delay=5)  # row 6 is delayed again
    return q


class _Table(html.parser.HTMLParser):
    """Collects the ``<th>``/``<td>`` pairs of each ``<tbody>`` row and the caption."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self.caption = ""
        self._in: str | None = None
        self._body = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "tbody":
            self._body = True
        elif tag == "tr" and self._body:
            self.rows.append([])
        elif tag in ("th", "td", "caption"):
            self._in = tag
            if tag != "caption" and self._body:
                self.rows[-1].append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == "tbody":
            self._body = False
        if tag == self._in:
            self._in = None

    def handle_data(self, data: str) -> None:
        if self._in == "caption":
            self.caption += data
        elif self._in in ("th", "td") and self._body:
            self.rows[-1][-1] += data


def test_q26_stats_html_table(db: Db, clock: FakeClock) -> None:
    q = _workload(db, clock)
    stats = q.stats()
    assert isinstance(stats, QueueStats)
    parser = _Table()
    parser.feed(stats._repr_html_())
    assert parser.caption == f"queue {Pings.name}"
    # Grouped: what the queue holds now, the counters since this open (labelled so), the
    # files; every stat once, sizes in readable units.
    assert [row[0] for row in parser.rows if len(row) == 1] == ["now", "since this open", "files"]
    table = {row[0]: row[1] for row in parser.rows if len(row) == 2}
    fields = [f.name for f in dataclasses.fields(QueueStats) if f.name != "name"]
    assert sorted(table) == sorted(fields) and len(parser.rows) == len(fields) + 3
    assert set(Q26_STATS) <= set(table)
    for name in fields:
        value = getattr(stats, name)
        if name.endswith("_bytes") and value >= 1024:
            assert table[name].endswith(("KiB", "MiB", "GiB")), (name, table[name])
        else:
            assert table[name] in (f"{value:,}", f"{value:,} B"), name
    assert table["header_file_logical_bytes"] == "12.2 MiB"  # 4096 + 100,000 slots of 128 bytes
    # The workload reached every state, so the table is not all zeros.
    assert (stats.ready, stats.leased, stats.delayed, stats.dead_len) == (6, 2, 2, 2)
    assert (stats.pushes, stats.acks, stats.nacks, stats.dead_lettered, stats.expired_leases) == (13, 1, 3, 2, 1)
    assert stats.version_vector_bytes == 400_000
    assert stats.header_file_logical_bytes == 4096 + 100_000 * 128  # 8 + 16 + 32 + 12 bytes, to a power of 2


def test_q27_snapshot_to_dataframe(db: Db, clock: FakeClock) -> None:
    import pandas as pd

    q = _workload(db, clock)
    snap = q.snapshot()
    assert snap.dtype.names == ("id", "state", "due", "attempts", "epoch", "deadline")
    df = pd.DataFrame(snap, copy=False)
    assert list(df.columns) == ["id", "state", "due", "attempts", "epoch", "deadline"]
    assert df["due"].dtype == np.dtype("datetime64[ms]")
    assert df["deadline"].dtype == np.dtype("datetime64[ms]")
    assert df["state"].dtype == np.uint8
    assert df["id"].dtype == np.uint64
    assert len(df) == q.len() + q.dead_len() == 12
    states = df["state"].value_counts().to_dict()
    assert states == {State.READY: 8, State.LEASED: 2, State.DEAD: 2}
    never_leased = df[df["attempts"] == 0]
    assert never_leased["deadline"].isna().all() and len(never_leased) == 7
    assert df.loc[df["state"] == State.LEASED, "deadline"].notna().all()
    # A dead row's `due` is when it was dead-lettered (SPEC Q27).
    dead = df[df["state"] == State.DEAD].sort_values("id")
    start = np.datetime64(clock.ms - 40_000, "ms")
    assert list(dead["due"]) == [start, np.datetime64(clock.ms, "ms")]


def test_q27_dataframe_copies_once(db: Db, clock: FakeClock) -> None:
    """``pd.DataFrame(snap, copy=False)`` holds one copy of the snapshot at its peak."""
    import pandas as pd

    q = db.open_queue(Pings, QueueConfig.balanced().build())
    for i in range(20_000):
        q.push((i, 0))
    q.lease(500)
    snap = q.snapshot()
    pd.DataFrame(snap[:10], copy=False)  # warm up pandas' lazy imports outside the measurement
    tracemalloc.start()
    try:
        df = pd.DataFrame(snap, copy=False)
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(df) == 20_000
    assert peak < 1.5 * snap.nbytes, (peak, snap.nbytes)


def test_notebook_is_saved_clean() -> None:
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code
    assert all(c.outputs == [] and c.execution_count is None for c in code)
    assert NOTEBOOK.stat().st_size < 20_000


def test_notebook_executes(tmp_path: Path) -> None:
    import nbclient
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    with warnings.catch_warnings():
        # jupyter_client/jupyter_core may warn about their own configuration (paths,
        # platformdirs, zmq event loops); only errors in the notebook matter here.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", RuntimeWarning)
        client = nbclient.NotebookClient(
            nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
        )
        client.execute()  # raises CellExecutionError on any error in a cell
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    errors = [o for o in outputs if o.output_type == "error"]
    assert not errors, errors
    data = [o.data for o in outputs if "data" in o]
    html = [d["text/html"] for d in data if "text/html" in d]
    assert any("<caption" in h and "queue index_jobs" in h for h in html), "stats() did not render as a table"
    assert any("image/png" in d for d in data), "the chart was not drawn"
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "live 30, dead 4" in text


def test_q27_snapshot_frame_has_state_as_a_categorical(db: Db, clock: FakeClock) -> None:
    q = _workload(db, clock)
    df = q.snapshot_frame()
    assert list(df.columns) == ["id", "state", "due", "attempts", "epoch", "deadline"]
    assert str(df["state"].dtype) == "category"
    assert list(df["state"].cat.categories) == ["READY", "LEASED", "DEAD"]
    counts = df["state"].value_counts()
    assert (counts["READY"], counts["LEASED"], counts["DEAD"]) == (8, 2, 2)
    assert len(df) == len(q.snapshot())
