"""Type checkers see the payload type through a queue (operations issue, item 8).

``armdb.queue("jobs", payload=Job, var=True)`` is a ``QueueSpec[Job]``, ``db.open_queue``
of it a ``Queue[Job]`` and its leases ``Lease[Job]``; and mypy finds the package (and its
``py.typed``) in the editable install ``make test`` makes.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

USER_CODE = '''
from dataclasses import dataclass

import numpy as np

import armdb


@dataclass
class Job:
    doc: int


Jobs = armdb.queue("jobs", payload=Job, var=True)
Pings = armdb.queue("pings", payload=np.dtype("<u8"))


def work(db: armdb.Db) -> int:
    q = db.open_queue(Jobs)
    reveal_type(q)
    for lease in q.lease(4):
        reveal_type(lease.payload)
        q.ack(lease)
        return lease.payload.doc
    reveal_type(db.open_queue(Pings).lease(1)[0].payload)
    return 0
'''


def test_q1_a_type_checker_sees_the_payload_type(tmp_path: Path) -> None:
    (tmp_path / "user.py").write_text(textwrap.dedent(USER_CODE))
    r = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--cache-dir", str(tmp_path / ".mypy"), "user.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    revealed = [line.split("Revealed type is ", 1)[1] for line in out.splitlines() if "Revealed type is" in line]
    assert revealed[0] == '"armdb.queue.Queue[user.Job]"', out
    assert revealed[1] == '"user.Job"', out
    assert revealed[2] == '"numpy.void"', out
