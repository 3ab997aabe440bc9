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


# -- bodies encoded elsewhere --------------------------------------------------------------
#
# A client packs a batch's payloads and the owner stores each body as it came once it
# knows the body decodes to a payload of the queue's type (``VarCodec.accept_encoded``).
# Decoding 64 small dicts to check them cost the owner more than storing them.
# :func:`bodies_decode` walks the bytes instead: each must be exactly one msgpack value,
# its strings valid UTF-8, no map key an array or a map, no extension type, no deeper
# than _DEPTH, and its outer type the one asked for.  Such a body decodes (``raw=False,
# strict_map_key=False``) to a value of that type.  Anything else gets False and the
# caller decodes as before, which names what is wrong: a shortcut, never a second rule.

KIND_ANY, KIND_MAP, KIND_ARRAY, KIND_FIELDS, KIND_STR, KIND_BIN, KIND_INT, KIND_FLOAT, KIND_BOOL = range(9)


cdef inline bint _utf8(const unsigned char* p, Py_ssize_t n) noexcept nogil:
    """Whether ``p[:n]`` is well-formed UTF-8 (what Python's strict decoder accepts:
    no overlong form, no surrogate, nothing above U+10FFFF)."""
    cdef Py_ssize_t i = 0
    cdef unsigned char c, lo, hi
    cdef int more, k
    while i < n:
        c = p[i]
        if c < 0x80:
            i += 1
            continue
        lo, hi = 0x80, 0xBF
        if 0xC2 <= c <= 0xDF:
            more = 1
        elif c == 0xE0:
            more, lo = 2, 0xA0
        elif 0xE1 <= c <= 0xEC or c == 0xEE or c == 0xEF:
            more = 2
        elif c == 0xED:
            more, hi = 2, 0x9F
        elif c == 0xF0:
            more, lo = 3, 0x90
        elif 0xF1 <= c <= 0xF3:
            more = 3
        elif c == 0xF4:
            more, hi = 3, 0x8F
        else:
            return False
        if i + more >= n:  # truncated
            return False
        if not (lo <= p[i + 1] <= hi):
            return False
        for k in range(2, more + 1):
            if not (0x80 <= p[i + k] <= 0xBF):
                return False
        i += more + 1
    return True


cdef int[10] _WIDTH = [4, 8, 1, 2, 4, 8, 1, 2, 4, 8]  # the bytes after 0xCA .. 0xD3


cdef inline Py_ssize_t _be(const unsigned char* p, int width) noexcept nogil:
    cdef Py_ssize_t v = 0
    cdef int k
    for k in range(width):
        v = (v << 8) | p[k]
    return v


cdef Py_ssize_t _skip(const unsigned char* p, Py_ssize_t end, Py_ssize_t off, int depth, bint key) noexcept nogil:
    """The offset after the one value at ``p[off]``, or -1 if it is not one the module
    comment allows (``key``: it is a map key, which may not be an array or a map)."""
    cdef unsigned char c
    cdef Py_ssize_t n, i
    cdef int w
    cdef bint is_map
    if off >= end:
        return -1
    c = p[off]
    off += 1
    if c <= 0x7F or c >= 0xE0 or c == 0xC0 or c == 0xC2 or c == 0xC3:  # ints, nil, bools
        return off
    if 0xA0 <= c <= 0xBF or 0xD9 <= c <= 0xDB:  # str
        if c <= 0xBF:
            n = c & 0x1F
        else:
            w = 1 << (c - 0xD9)
            if off + w > end:
                return -1
            n = _be(p + off, w)
            off += w
        if n > end - off or not _utf8(p + off, n):
            return -1
        return off + n
    if 0xC4 <= c <= 0xC6:  # bin
        w = 1 << (c - 0xC4)
        if off + w > end:
            return -1
        n = _be(p + off, w)
        off += w
        return -1 if n > end - off else off + n
    if 0xCA <= c <= 0xD3:  # float32/64, uint8-64, int8-64
        w = _WIDTH[c - 0xCA]
        return -1 if off + w > end else off + w
    if key or depth >= _DEPTH:
        return -1
    if 0x80 <= c <= 0x9F or 0xDC <= c <= 0xDF:  # a map (its items: key, value, ...) or an array
        is_map = c <= 0x8F or c >= 0xDE
        if c <= 0x9F:
            n = c & 0x0F
        else:
            w = 2 if c == 0xDC or c == 0xDE else 4
            if off + w > end:
                return -1
            n = _be(p + off, w)
            off += w
        if n > end - off:
            return -1
        if is_map:
            n *= 2
        for i in range(n):
            off = _skip(p, end, off, depth + 1, is_map and not (i & 1))
            if off < 0:
                return -1
        return off
    return -1  # 0xC1 (never used), extension types


cdef bint _kind_is(const unsigned char* p, Py_ssize_t end, int kind, Py_ssize_t arity) noexcept nogil:
    """Whether the value at ``p[0]`` (whole, already walked) is of ``kind``."""
    cdef unsigned char c = p[0]
    if kind == 0:
        return True
    if kind == 1:
        return 0x80 <= c <= 0x8F or c == 0xDE or c == 0xDF
    if kind == 2:
        return 0x90 <= c <= 0x9F or c == 0xDC or c == 0xDD
    if kind == 3:
        if 0x90 <= c <= 0x9F:
            return (c & 0x0F) == arity
        if c == 0xDC:
            return _be(p + 1, 2) == arity
        if c == 0xDD:
            return _be(p + 1, 4) == arity
        return False
    if kind == 4:
        return 0xA0 <= c <= 0xBF or 0xD9 <= c <= 0xDB
    if kind == 5:
        return 0xC4 <= c <= 0xC6
    if kind == 6:
        return c <= 0x7F or c >= 0xE0 or 0xCC <= c <= 0xD3
    if kind == 7:
        return c == 0xCA or c == 0xCB
    if kind == 8:
        return c == 0xC2 or c == 0xC3
    return False


def bodies_decode(list raws, int kind, Py_ssize_t arity=0):
    """True if each of ``raws`` (bytes) is exactly one msgpack value that decodes, to a
    value of ``kind`` (``KIND_*``; ``KIND_FIELDS``: an array of ``arity`` items); False
    if any is not, or may not be (decode it to learn why)."""
    cdef bytes raw
    cdef const unsigned char* p
    cdef Py_ssize_t n
    for obj in raws:
        if type(obj) is not bytes:
            return False
        raw = <bytes>obj
        p = <const unsigned char*><char*>raw
        n = len(raw)
        if n == 0 or _skip(p, n, 0, 0, False) != n or not _kind_is(p, n, kind, arity):
            return False
    return True
