"""Named failpoints at every durable boundary (SPEC D8; harness (a2) in docs/reliability.md).

``ARMDB_FAILPOINT=name`` makes the process call ``os._exit(86)`` the first time it
reaches ``point(name)``; ``ARMDB_FAILPOINT=name:n`` lets it pass ``n`` times first.
``os._exit`` runs no ``finally`` block, no atexit hook and flushes no Python
buffer, so it is as close to SIGKILL as Python gets.  Every name lives in
:data:`ALL`, so tests can be parametrized over the registry and a new point
cannot go untested.  While no failpoint is set, :func:`point` is a compiled function
that does nothing (``armdb._core.atomicfile.disarmed_point``): callers spell it
``_fail.point(...)``, looked up at each call, so :func:`_configure` (and a test that
replaces it) rebinds it for every caller.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ._core.atomicfile import disarmed_point

EXIT_CODE = 86

ALL: frozenset[str] = frozenset(
    {
        # Bitcask
        "bitcask.after_append",
        "bitcask.after_sync",
        "bitcask.after_rotate",
        "bitcask.after_hint",
        # FixedStore
        "fixed.after_slot_write",
        "fixed.after_redo_sync",
        "fixed.after_flush",
        "fixed.after_grow",
        # queues
        "queue.var_push.after_body",
        "queue.orphan_sweep.mid",
        "queue.retention.after_delete",
        # transaction log
        "txlog.after_append",
        "txlog.after_sync",
        "txlog.after_apply",
        "txlog.after_rotate",
        "txlog.after_trim",
        "seqmap.after_write",
        # compaction
        "compaction.after_new_file",
        "compaction.after_hint",
        "compaction.before_unlink",
        # metadata and recovery
        "meta.after_tmp_write",
        "recovery.mid_replay",
    }
)

_name: str | None = None
_skip = 0


def _configure(spec: str | None) -> None:
    global _name, _skip, point
    if not spec:
        _name, _skip = None, 0
        point = disarmed_point
        return
    name, _, skip = spec.partition(":")
    if name not in ALL:
        raise ValueError(f"ARMDB_FAILPOINT names unknown failpoint {name!r}; see armdb.failpoints()")
    _name, _skip = name, int(skip or 0)
    point = armed_point


def armed_point(name: str) -> None:
    """Exit the process here if ``ARMDB_FAILPOINT`` selects ``name`` (:func:`point` while
    a failpoint is set)."""
    global _skip
    if _name is None or _name != name:
        return
    if _skip > 0:
        _skip -= 1
        return
    os._exit(EXIT_CODE)


point: Callable[[str], None] = armed_point
"""Exit the process here if ``ARMDB_FAILPOINT`` selects ``name`` (bound by :func:`_configure`)."""


def armed() -> bool:
    """Whether a failpoint is set in this process (compiled fast paths then call back)."""
    return _name is not None


def failpoints() -> list[str]:
    """Every failpoint name, sorted."""
    return sorted(ALL)


_configure(os.environ.get("ARMDB_FAILPOINT"))
