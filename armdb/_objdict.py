"""Instance dicts that compiled code reads and writes in place.

Some compiled kernels (``armdb._core``) read and write a few plain attributes of the
objects they serve (the ``Db``, a ``Queue``, a Bitcask store, the transaction log)
straight from the objects' instance dicts, without the attribute protocol's walk of
the type.  Asking CPython 3.11 for such a dict (``vars(obj)``, ``obj.__dict__``) makes
it: for an object of a class whose instances share their keys (up to 30 attributes) it
is a *split* table, and the interpreter does not specialize attribute access on an
object whose dict is split.  Every ``self.x`` of that object in Python then took the
generic path: a 2-row durable commit cost 7.5% more instructions (126,772 against
117,919) once the log's dict had been asked for, and a method reading ten attributes
of such an object took 216-225 ns against 84-90 ns (docs/performance.md, round 14).

:func:`own_dict` gives the object a *combined* copy of its dict instead, once, and
returns it: the interpreter specializes on it (about 100 ns for the same method), and
the compiled code reads and writes the same dict.  Every place that hands an
object's dict to compiled code asks here, so that none keeps a dict the object has
since replaced.
"""

from __future__ import annotations

from typing import Any

_MARK = "_own_dict"  # set in a dict own_dict installed: the object keeps it from then on


def own_dict(obj: object) -> dict[str, Any]:
    """The instance dict of ``obj`` as a combined table, installed on first use."""
    d: dict[str, Any] = vars(obj)
    if _MARK not in d:
        d = dict(d)
        d[_MARK] = True
        obj.__dict__ = d
    return d
