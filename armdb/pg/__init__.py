"""armdb on PostgreSQL: the same queue declarations and ``Queue`` API, for work that runs
on many machines (SPEC section 10; docs/postgres.md).

Install with the ``postgres`` extra (``pip install 'armdb[postgres]'``: psycopg 3 and
its pool).  ``armdb`` itself never imports this package; import it yourself::

    import armdb.pg
    with armdb.pg.connect("host=/run/postgresql dbname=jobs") as db:
        jobs = db.open_queue(SearchJobs, QueueConfig.balanced().build())
"""

from __future__ import annotations

try:
    import psycopg as _psycopg  # noqa: F401
    import psycopg_pool as _psycopg_pool  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError(
        f"armdb.pg needs psycopg 3 and its pool ({e}); install them with: pip install 'armdb[postgres]'"
    ) from e

from .db import PgDb, PgMap, PgTx, connect
from .queue import PgQueue
from .schema import FORMAT_VERSION

__all__ = ["FORMAT_VERSION", "PgDb", "PgMap", "PgQueue", "PgTx", "connect"]
