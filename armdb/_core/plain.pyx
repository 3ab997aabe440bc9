# cython: language_level=3
"""Which payloads msgpack reads back without trying: a compiled walk instead of a decode.

msgpack writes a few values it cannot read (``armdb._pack.check_round_trip``): a tuple
used as a dict key is stored as an array, and an array cannot be a dict key when read
back.  So every write path decodes what it encoded before storing it, and for a small
dict that decode (building the dict, its strings and lists again) cost more than the
rest of a batched push.  :func:`reads_back` walks the value instead: when it holds only
dicts, lists and tuples (exact types) of str, bytes, int, float, bool and None, no dict
key is a list, tuple or dict, and it is no deeper than msgpack packs, the decode cannot
fail and need not run.  Anything else (a subclass, a NumPy scalar, an ``ExtType``, a
container key) gets False, and the caller decodes as before: this is a shortcut of the
check, never a second rule.
"""

from cpython.dict cimport PyDict_Next
from cpython.object cimport PyObject

DEF _DEPTH = 500  # below msgpack's default nesting limit of 511


cdef bint _plain(object o, int depth):
    cdef type t = type(o)
    cdef Py_ssize_t pos = 0
    cdef PyObject* k
    cdef PyObject* v
    cdef type kt
    if t is str or t is bytes or t is int or t is float or t is bool or o is None:
        return True
    if depth >= _DEPTH:
        return False
    if t is dict:
        while PyDict_Next(o, &pos, &k, &v):
            kt = type(<object>k)
            if not (kt is str or kt is bytes or kt is int or kt is float or kt is bool or <object>k is None):
                return False
            if not _plain(<object>v, depth + 1):
                return False
        return True
    if t is list or t is tuple:
        for x in o:
            if not _plain(x, depth + 1):
                return False
        return True
    return False


def reads_back(list values):
    """True if every one of ``values`` is plain (see the module's docstring): then the
    msgpack encoding of each decodes, and to an equal value up to tuples becoming lists."""
    for v in values:
        if not _plain(v, 0):
            return False
    return True


def reads_back_one(value):
    """:func:`reads_back` of one value."""
    return _plain(value, 0)
