"""The PostgreSQL server of the tests: the logic lives in :mod:`armdb._pgserver`, shared
with the bench (``python -m armdb bench --only postgres``)."""

from armdb._pgserver import FALLBACK_USER, INSTALL_HINT, PORT, PgServer, find_bindir, start, wait_ready

__all__ = ["FALLBACK_USER", "INSTALL_HINT", "PORT", "PgServer", "find_bindir", "start", "wait_ready"]
