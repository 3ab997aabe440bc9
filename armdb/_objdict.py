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

So each such class gives its instances a *combined* dict as the last step of its
``__init__`` (:func:`install_own_dict`), before any other thread can see the object:
the interpreter specializes on it (about 100 ns for the same method), and the compiled
code reads that same dict, handed to it by :func:`own_dict` (the compiled queue, which
imports no Python module of armdb, reads it as ``__dict__``).  Installed later, the copy
would race other threads' attribute writes, which would land in the dict it replaced.
"""

from __future__ import annotations

from typing import Any

_MARK = "_own_dict"  # set in the dict install_own_dict installed


def install_own_dict(obj: object) -> None:
    """Give ``obj`` a combined copy of its instance dict.  Only from its class's
    ``__init__``: no other thread may hold the object yet."""
    d = dict(vars(obj))
    d[_MARK] = True
    obj.__dict__ = d


def own_dict(obj: object) -> dict[str, Any]:
    """The instance dict ``install_own_dict`` gave ``obj``, for compiled code to read and
    write in place; ``TypeError`` for an object whose class does not install one."""
    d: dict[str, Any] = vars(obj)
    if _MARK not in d:
        raise TypeError(
            f"{type(obj).__name__} does not install its own instance dict (armdb._objdict.install_own_dict)"
        )
    return d
