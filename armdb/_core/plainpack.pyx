# cython: language_level=3
"""msgpack of plain values, packed and unpacked by a compiled loop over a whole batch.

A var queue's ``push_many`` packs each payload with ``msgpack.Packer`` and checks that it
reads back (``armdb._core.plain``); its ``lease_batch`` decodes the bodies with
``msgpack.unpackb``.  For the common payload (a small dict of strings, numbers and lists)
those two calls were a third of a batched cycle's instructions: a Python call per value,
and on the way back a new string object and an interning per dict key.

:func:`pack_plain` packs *plain* values (exact ``dict``, ``list``, ``tuple`` of ``str``,
``bytes``, ``int``, ``float``, ``bool``, ``None``; dict keys scalars; no deeper than
``plain`` allows), giving the very bytes ``msgpack.Packer(use_bin_type=True)`` gives
(the shortest int, str and bin forms, ``float`` as float 64, maps in dict order).  Such
values read back by definition (``plain.reads_back``), so no check follows.  Anything
else (a subclass, a NumPy scalar, an int beyond 64 bits, a string with a lone surrogate)
gets None and the caller takes msgpack's path, which packs or refuses it as before.

:func:`unpack_plain` decodes bodies that hold only the msgpack types plain values pack
to (nil, bool, int, float 32/64, str, bin, array, map) as ``msgpack.unpackb(raw,
raw=False, strict_map_key=False)`` does: arrays as lists, map keys that are str interned,
invalid UTF-8 refused.  Short ASCII strings come from a small cache of interned strings
(equal strings are interchangeable: ``str`` is immutable).  A body with anything else
(an ext type, bytes after its value, a truncated value, an unhashable key) gets None and
the caller decodes with msgpack, which decodes it or says why not.  Never a second
format: the same bytes, read the same way.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_Copy, PyDict_Next, PyDict_SetItem, PyDict_Size
from cpython.float cimport PyFloat_AS_DOUBLE, PyFloat_FromDouble
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE, PyList_GetSlice, PyList_New, PyList_SET_ITEM
from cpython.long cimport (PyLong_AsLongLongAndOverflow, PyLong_AsUnsignedLongLong, PyLong_FromLongLong,
                           PyLong_FromUnsignedLongLong)
from cpython.object cimport PyObject, PyTypeObject
from cpython.ref cimport Py_INCREF, Py_XDECREF
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE
from cpython.unicode cimport PyUnicode_AsUTF8AndSize, PyUnicode_DecodeUTF8
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcmp, memcpy

from armdb._core._util cimport copy_bytes

cdef extern from "Python.h":
    void PyUnicode_InternInPlace(PyObject** p)
    object PyUnicode_New(Py_ssize_t size, Py_UCS4 maxchar)
    Py_ssize_t PyUnicode_GET_LENGTH(object o)
    void* PyUnicode_DATA(object o)
    bint PyUnicode_IS_COMPACT_ASCII(object o)

DEF _DEPTH = 500  # as armdb._core.plain: below msgpack's nesting limit of 511
DEF _CACHE = 256  # slots of the short-string cache (a power of two)
DEF _SHORT = 24   # the longest string the cache holds, in bytes


# -- packing ------------------------------------------------------------------------------

cdef struct Buf:
    uint8_t* p
    Py_ssize_t n
    Py_ssize_t cap


cdef int _grow(Buf* b, Py_ssize_t more) except -1:
    cdef Py_ssize_t cap = b.cap * 2
    cdef uint8_t* q
    if cap < b.n + more:
        cap = b.n + more + 256
    q = <uint8_t*>realloc(b.p, cap)
    if q == NULL:
        raise MemoryError()
    b.p = q
    b.cap = cap
    return 0


cdef inline uint8_t* _room(Buf* b, Py_ssize_t more) except NULL:
    """Space for ``more`` bytes at the end of ``b`` (which the caller then counts)."""
    if b.n + more > b.cap:
        _grow(b, more)
    return b.p + b.n


cdef inline void _be(uint8_t* p, uint64_t v, int w) noexcept nogil:
    cdef int i
    for i in range(w):
        p[i] = <uint8_t>(v >> (8 * (w - 1 - i)))


cdef inline int _tagged(uint8_t* p, uint8_t tag, uint64_t v, int w) noexcept nogil:
    p[0] = tag
    _be(p + 1, v, w)
    return 1 + w


cdef inline int _w_uint(uint8_t* p, uint64_t v) noexcept nogil:
    """A non-negative int as msgpack packs it (at most 9 bytes): the shortest form."""
    if v < 0x80:
        p[0] = <uint8_t>v
        return 1
    if v < 0x100:
        return _tagged(p, 0xcc, v, 1)
    if v < 0x10000:
        return _tagged(p, 0xcd, v, 2)
    if v < (<uint64_t>1 << 32):
        return _tagged(p, 0xce, v, 4)
    return _tagged(p, 0xcf, v, 8)


cdef inline int _w_neg(uint8_t* p, int64_t d) noexcept nogil:
    """A negative int as msgpack packs it: the shortest signed form."""
    if d >= -32:
        p[0] = <uint8_t>(<int8_t>d)
        return 1
    if d >= -128:
        return _tagged(p, 0xd0, <uint64_t>d, 1)
    if d >= -32768:
        return _tagged(p, 0xd1, <uint64_t>d, 2)
    if d >= -2147483648:
        return _tagged(p, 0xd2, <uint64_t>d, 4)
    return _tagged(p, 0xd3, <uint64_t>d, 8)


cdef inline int _w_len(uint8_t* p, Py_ssize_t n, uint8_t fix, Py_ssize_t fixmax, uint8_t t8, uint8_t t16,
                       uint8_t t32) noexcept nogil:
    """A str, bin, array or map header (at most 5 bytes): the fix form under ``fixmax``
    (0: none), else 8 (``t8`` 0: none), 16 or 32 bits."""
    if n < fixmax:
        p[0] = fix | <uint8_t>n
        return 1
    if t8 and n < 0x100:
        return _tagged(p, t8, <uint64_t>n, 1)
    if n < 0x10000:
        return _tagged(p, t16, <uint64_t>n, 2)
    return _tagged(p, t32, <uint64_t>n, 4)


cdef int _blob(Buf* b, const char* s, Py_ssize_t n, uint8_t fix, Py_ssize_t fixmax, uint8_t t8, uint8_t t16,
               uint8_t t32) except -1:
    cdef uint8_t* p = _room(b, 5 + n)
    cdef int h = _w_len(p, n, fix, fixmax, t8, t16, t32)
    copy_bytes(p + h, s, n)
    b.n += h + n
    return 0


cdef inline int _fixstr(Buf* b, const char* s, Py_ssize_t n) except -1:
    """A str of fewer than 256 bytes as :func:`_blob` writes it (msgpack's fixstr, one
    header byte, under 32 bytes; its str 8, two, from 32), inline in the container loops
    (most keys and values of a payload: a recursive call for a text of 32 bytes or more
    cost the bench's payload about 60 instructions)."""
    cdef uint8_t* p = _room(b, 2 + n)
    if n < 32:
        p[0] = 0xa0 | <uint8_t>n
        copy_bytes(p + 1, s, n)
        b.n += 1 + n
    else:
        p[0] = 0xd9
        p[1] = <uint8_t>n
        copy_bytes(p + 2, s, n)
        b.n += 2 + n
    return 0


cdef extern from "Python.h":
    void _gc_untrack "PyObject_GC_UnTrack"(void* op)
    # The packer's view of a value: borrowed pointers, no reference count touched.
    PyTypeObject* _type_of "Py_TYPE"(PyObject* o)
    PyTypeObject _STR "PyUnicode_Type"
    PyTypeObject _INT "PyLong_Type"
    PyTypeObject _FLOAT "PyFloat_Type"
    PyTypeObject _BOOL "PyBool_Type"
    PyTypeObject _BYTES "PyBytes_Type"
    PyTypeObject _DICT "PyDict_Type"
    PyTypeObject _LIST "PyList_Type"
    PyTypeObject _TUPLE "PyTuple_Type"
    PyObject* _NONE "Py_None"
    PyObject* _TRUE "Py_True"
    bint _ascii "PyUnicode_IS_COMPACT_ASCII"(PyObject* o)
    Py_ssize_t _ulen "PyUnicode_GET_LENGTH"(PyObject* o)
    const char* _utf8 "PyUnicode_AsUTF8AndSize"(PyObject* o, Py_ssize_t* n)
    long long _as_ll "PyLong_AsLongLongAndOverflow"(PyObject* o, int* overflow)
    unsigned long long _as_ull "PyLong_AsUnsignedLongLong"(PyObject* o)
    double _fval "PyFloat_AS_DOUBLE"(PyObject* o)
    Py_ssize_t _bsize "PyBytes_GET_SIZE"(PyObject* o)
    char* _bdata "PyBytes_AS_STRING"(PyObject* o)
    Py_ssize_t _dsize "PyDict_GET_SIZE"(PyObject* o)
    int _dnext "PyDict_Next"(PyObject* o, Py_ssize_t* pos, PyObject** k, PyObject** v)
    Py_ssize_t _lsize "PyList_GET_SIZE"(PyObject* o)
    PyObject* _litem "PyList_GET_ITEM"(PyObject* o, Py_ssize_t i)
    Py_ssize_t _tsize "PyTuple_GET_SIZE"(PyObject* o)
    PyObject* _titem "PyTuple_GET_ITEM"(PyObject* o, Py_ssize_t i)
    PyObject* _err_occurred "PyErr_Occurred"()
    void _err_clear "PyErr_Clear"()


cdef extern from "pyfast.h":
    PyObject** _dict_entries "armdb_dict_entries"(PyObject* d, Py_ssize_t* count, Py_ssize_t* stride)
    bint _compact_int "armdb_compact_int"(PyObject* o, long long* v)
    const char* _ascii_data "armdb_ascii_data"(PyObject* o)


cdef inline int _int(Buf* b, PyObject* o) except -1:
    """An exact int, as :func:`_pack` packs it (1: beyond 64 bits, not plain), inline in
    the container loops too."""
    cdef int overflow = 0
    cdef long long d = _as_ll(o, &overflow)
    cdef unsigned long long u
    cdef uint8_t* p = _room(b, 9)
    if overflow == 0:
        b.n += _w_uint(p, <uint64_t>d) if d >= 0 else _w_neg(p, <int64_t>d)
        return 0
    if overflow < 0:
        return 1
    u = _as_ull(o)
    if u == <unsigned long long>-1 and _err_occurred() != NULL:  # above 64 bits
        _err_clear()
        return 1
    b.n += _w_uint(p, <uint64_t>u)
    return 0


cdef int _pack(Buf* b, PyObject* o, int depth, bint key) except -1:
    """Pack ``o``; 1 if it is not plain (nothing to trust in ``b`` then).  ``o`` is
    borrowed from its container, which the caller keeps alive."""
    cdef PyTypeObject* t = _type_of(o)
    cdef double f
    cdef uint64_t bits
    cdef const char* s
    cdef Py_ssize_t n, i, pos = 0, count = 0, stride = 0
    cdef PyObject* k
    cdef PyObject* v
    cdef PyObject** ents
    cdef uint8_t* p
    cdef long long d
    if t == &_STR:
        if _ascii(o):
            s = _ascii_data(o)
            n = _ulen(o)
        else:
            s = _utf8(o, &n)
            if s == NULL:  # a lone surrogate: msgpack refuses it, on the caller's path
                _err_clear()
                return 1
        if n > 0xFFFFFFFFLL:  # (a C literal: unsuffixed, Cython boxes n to compare)
            return 1
        return _blob(b, s, n, 0xa0, 32, 0xd9, 0xda, 0xdb)
    if t == &_INT:
        return _int(b, o)
    if o == _NONE or t == &_BOOL:
        p = _room(b, 1)
        p[0] = 0xc0 if o == _NONE else 0xc3 if o == _TRUE else 0xc2
        b.n += 1
        return 0
    if t == &_FLOAT:
        f = _fval(o)
        memcpy(&bits, &f, 8)
        p = _room(b, 9)
        b.n += _tagged(p, 0xcb, bits, 8)
        return 0
    if t == &_BYTES:
        n = _bsize(o)
        if n > 0xFFFFFFFFLL:  # (a C literal: unsuffixed, Cython boxes n to compare)
            return 1
        return _blob(b, _bdata(o), n, 0, 0, 0xc4, 0xc5, 0xc6)
    if key or depth >= _DEPTH:  # a container key does not read back; too deep for msgpack
        return 1
    if t == &_DICT:
        n = _dsize(o)
        if n > 0xFFFFFFFFLL:  # (a C literal: unsuffixed, Cython boxes n to compare)
            return 1
        p = _room(b, 5)
        b.n += _w_len(p, n, 0x80, 16, 0, 0xde, 0xdf)
        # The items in the table's order, read in place where the table allows
        # (pyfast.h), else by PyDict_Next: the same items in the same order.
        ents = _dict_entries(o, &count, &stride)
        while True:
            if ents != NULL:
                if count == 0:
                    break
                k = ents[0]
                v = ents[1]
                ents += stride
                count -= 1
                if v == NULL:  # a deleted entry
                    continue
            elif not _dnext(o, &pos, &k, &v):
                break
            # An ASCII str key or value under 256 bytes inline; anything else by the recursion.  (The
            # value's three branches repeat the list loop's: one inline helper for both
            # measured 127 instructions a job more on push_many(1000), round 9.)
            if _type_of(k) == &_STR and _ascii(k) and _ulen(k) < 256:
                _fixstr(b, _ascii_data(k), _ulen(k))
            elif _pack(b, k, depth + 1, True):
                return 1
            if _type_of(v) == &_STR and _ascii(v) and _ulen(v) < 256:
                _fixstr(b, _ascii_data(v), _ulen(v))
            elif _type_of(v) == &_INT:
                if _compact_int(v, &d):  # (pyfast.h: a one-digit int read in place, no call)
                    p = _room(b, 9)
                    b.n += _w_uint(p, <uint64_t>d) if d >= 0 else _w_neg(p, <int64_t>d)
                elif _int(b, v):
                    return 1
            elif (_type_of(v) == &_LIST or _type_of(v) == &_TUPLE) and depth + 1 < _DEPTH:
                if _seq(b, v, _type_of(v) == &_LIST, depth + 1):
                    return 1
            elif _pack(b, v, depth + 1, False):
                return 1
        return 0
    if t == &_LIST or t == &_TUPLE:
        return _seq(b, o, t == &_LIST, depth)
    return 1


cdef int _seq(Buf* b, PyObject* o, bint is_list, int depth) except -1:
    """A list (``is_list``) or tuple at ``depth`` (below ``_DEPTH``) as :func:`_pack` packs
    it; 1 if an item is not plain.  Its own function, which the map loop calls directly
    for a list value: through _pack (its prologue and type tests) the bench payload's
    two-tag list cost push_many(1000) about 60 instructions a job more."""
    cdef Py_ssize_t n = _lsize(o) if is_list else _tsize(o), i
    cdef PyObject* v
    cdef uint8_t* p
    if n > 0xFFFFFFFFLL:  # (a C literal: unsuffixed, Cython boxes n to compare)
        return 1
    p = _room(b, 5)
    b.n += _w_len(p, n, 0x90, 16, 0, 0xdc, 0xdd)
    for i in range(n):
        v = _litem(o, i) if is_list else _titem(o, i)
        if _type_of(v) == &_STR and _ascii(v) and _ulen(v) < 256:
            _fixstr(b, _ascii_data(v), _ulen(v))
        elif _type_of(v) == &_INT:
            if _int(b, v):
                return 1
        elif _pack(b, v, depth + 1, False):
            return 1
    return 0


def pack_plain(list values, object top=None):
    """The msgpack bytes of each of ``values`` (as ``msgpack.Packer(use_bin_type=True)``
    packs it), or None if any value is not plain (the module's docstring) or, given
    ``top``, is not exactly of that type (a var queue's payload type, checked in the
    same pass)."""
    cdef Buf b
    cdef Py_ssize_t i, n = PyList_GET_SIZE(values)
    cdef list out = PyList_New(n)
    cdef PyObject* v
    b.p = <uint8_t*>malloc(4096)
    if b.p == NULL:
        raise MemoryError()
    b.cap = 4096
    try:
        for i in range(n):
            b.n = 0
            v = <PyObject*>PyList_GET_ITEM(values, i)
            if top is not None and _type_of(v) != <PyTypeObject*>top:
                return None
            if _pack(&b, v, 0, False):
                return None
            raw = PyBytes_FromStringAndSize(<char*>b.p, b.n)
            Py_INCREF(raw)
            PyList_SET_ITEM(out, i, raw)
    finally:
        free(b.p)
    # Bytes only: no cycle can run through the list, so the collector need not traverse
    # its n items at each collection it survives (as _PyTuple_MaybeUntrack concludes for
    # a tuple of scalars).
    _gc_untrack(<PyObject*>out)
    return out


cdef object pack_one(object value):
    """``pack_plain([value])[0]``, or None where that is None: the msgpack bytes of one
    plain value, without the argument and result lists (a var queue's push,
    ``armdb._core.qshard.VarFast``, calls it from C; declared in plainpack.pxd)."""
    cdef Buf b
    b.p = <uint8_t*>malloc(4096)
    if b.p == NULL:
        raise MemoryError()
    b.cap = 4096
    b.n = 0
    try:
        if _pack(&b, <PyObject*>value, 0, False):
            return None
        return PyBytes_FromStringAndSize(<char*>b.p, b.n)
    finally:
        free(b.p)


def pack_one_plain(value):
    """:func:`pack_one` from Python (its tests compare it with :func:`pack_plain` and msgpack)."""
    return pack_one(value)


# -- unpacking ----------------------------------------------------------------------------

cdef PyObject* _cache[_CACHE]  # interned short ASCII strings, owned; NULL: empty slot
cdef object _BAD = object()    # "not a plain body": the caller decodes with msgpack


DEF _TPL_KEYS = 16  # the most keys a map template holds


cdef struct Tpl:
    # The last top-level map decoded in this unpack_plain call, when all its keys are
    # short fixstr and distinct: the dict (owned), its keys (borrowed from it), where
    # each key's and each value's msgpack bytes lie in its body (alive: the call's list
    # holds the bodies), and how a map with the same bytes there may take the value
    # (share): 1, the same object (an immutable value: str, bytes, int, float, bool,
    # None); 2, a shallow copy (a list of such values; a new list, as a decode makes);
    # 0, decoded (anything else).
    PyObject* d
    const uint8_t* p
    Py_ssize_t n
    Py_ssize_t off[_TPL_KEYS]
    Py_ssize_t ln[_TPL_KEYS]
    Py_ssize_t voff[_TPL_KEYS]
    Py_ssize_t vln[_TPL_KEYS]
    uint8_t share[_TPL_KEYS]
    PyObject* keys[_TPL_KEYS]
    PyObject* vals[_TPL_KEYS]  # (borrowed from the dict)


cdef struct Src:
    const uint8_t* p
    Py_ssize_t n
    Py_ssize_t at
    Tpl* tpl  # NULL: no template (nested maps never use one)


cdef inline uint64_t _get_be(Src* s, int w) noexcept:
    cdef uint64_t v = 0
    cdef int i
    for i in range(w):
        v = (v << 8) | s.p[s.at + i]
    s.at += w
    return v


cdef object _short_str(const uint8_t* p, Py_ssize_t n, bint key):
    """The string of the ``n`` (at most ``_SHORT``) bytes at ``p``: from the cache when it
    holds it, else decoded (a key interned, as msgpack interns it) and, when ASCII, cached
    in place of the slot's string; ``_BAD`` for invalid UTF-8."""
    cdef uint32_t h = <uint32_t>n * 0x9E3779B1u
    cdef PyObject* c
    cdef PyObject* fresh
    if n:
        h = (h ^ p[0]) * 16777619u
        h = (h ^ p[n - 1]) * 16777619u
        h = (h ^ p[n >> 1]) * 16777619u
        h = (h ^ p[n >> 2]) * 16777619u
    h = (h ^ (h >> 15)) & (_CACHE - 1)
    c = _cache[h]
    if c != NULL and PyUnicode_GET_LENGTH(<object>c) == n and _same(<const uint8_t*>PyUnicode_DATA(<object>c), p, n):
        return <object>c  # (a cached string is compact ASCII: its characters are its bytes)
    s = _decode_str(p, n, key)
    if s is _BAD or PyUnicode_GET_LENGTH(s) != n:  # invalid, or not ASCII: not cached
        return s
    fresh = <PyObject*>s
    Py_INCREF(s)  # the cache's reference
    Py_XDECREF(_cache[h])
    _cache[h] = fresh
    return s


cdef inline bint _same(const uint8_t* a, const uint8_t* b, Py_ssize_t n) noexcept nogil:
    """Whether the ``n`` bytes at ``a`` and ``b`` are equal (short strings: no call).
    The last word of 8 (or 4) bytes overlaps the one before, for no byte loop at the end."""
    cdef uint64_t x, y
    cdef uint32_t u, v
    if n >= 8:
        while n > 8:
            memcpy(&x, a, 8)
            memcpy(&y, b, 8)
            if x != y:
                return False
            a += 8
            b += 8
            n -= 8
        memcpy(&x, a + n - 8, 8)
        memcpy(&y, b + n - 8, 8)
        return x == y
    if n >= 4:
        memcpy(&u, a, 4)
        memcpy(&v, b, 4)
        if u != v:
            return False
        memcpy(&u, a + n - 4, 4)
        memcpy(&v, b + n - 4, 4)
        return u == v
    while n > 0:
        if a[0] != b[0]:
            return False
        a += 1
        b += 1
        n -= 1
    return True


cdef inline bint _is_ascii(const uint8_t* p, Py_ssize_t n) noexcept nogil:
    cdef uint64_t acc = 0, w
    cdef uint8_t tail = 0
    while n >= 8:
        memcpy(&w, p, 8)
        acc |= w
        p += 8
        n -= 8
    while n > 0:
        tail |= p[0]
        p += 1
        n -= 1
    return (acc & 0x8080808080808080ULL) == 0 and tail < 0x80


cdef object _decode_str(const uint8_t* p, Py_ssize_t n, bint key):
    if _is_ascii(p, n):
        # The compact ASCII string UTF-8 decoding gives, made directly: its characters
        # are its bytes.
        s = PyUnicode_New(n, 127)
        memcpy(PyUnicode_DATA(s), p, n)
    else:
        try:
            s = PyUnicode_DecodeUTF8(<const char*>p, n, NULL)
        except UnicodeDecodeError:
            return _BAD
    if key:
        s = _intern(s)
    return s


cdef object _intern(object s):
    cdef PyObject* q = <PyObject*>s
    Py_INCREF(s)
    PyUnicode_InternInPlace(&q)
    r = <object>q
    Py_XDECREF(q)
    return r


cdef object _unpack(Src* s, int depth, bint key):
    cdef uint8_t t
    cdef Py_ssize_t n, i
    cdef int w
    if s.at >= s.n:
        return _BAD
    t = s.p[s.at]
    s.at += 1
    if t < 0x80:
        return <long>t
    if t >= 0xe0:
        return <long>(<int8_t>t)
    if 0xa0 <= t <= 0xbf:
        n = t & 0x1f
    elif t == 0xd9 or t == 0xda or t == 0xdb:
        w = 1 << (t - 0xd9)
        if s.at + w > s.n:
            return _BAD
        n = <Py_ssize_t>_get_be(s, w)
    elif t <= 0x8f:  # fixmap
        return _map(s, t & 0x0f, depth, key)
    elif t <= 0x9f:  # fixarray
        return _array(s, t & 0x0f, depth, key)
    else:
        return _other(s, t, depth, key)
    if s.at + n > s.n:
        return _BAD
    i = s.at
    s.at += n
    if n <= _SHORT:
        return _short_str(s.p + i, n, key)
    return _decode_str(s.p + i, n, key)


cdef object _other(Src* s, uint8_t t, int depth, bint key):
    cdef Py_ssize_t n, i
    cdef int w
    cdef uint64_t u
    cdef uint32_t u32
    cdef float f32
    cdef double f64
    if t == 0xc0:
        return None
    if t == 0xc2:
        return False
    if t == 0xc3:
        return True
    if 0xcc <= t <= 0xcf:  # uint 8..64
        w = 1 << (t - 0xcc)
        if s.at + w > s.n:
            return _BAD
        return PyLong_FromUnsignedLongLong(_get_be(s, w))
    if 0xd0 <= t <= 0xd3:  # int 8..64
        w = 1 << (t - 0xd0)
        if s.at + w > s.n:
            return _BAD
        u = _get_be(s, w)
        if w == 1:
            return <long>(<int8_t>u)
        if w == 2:
            return <long>(<int16_t>u)
        if w == 4:
            return <long>(<int32_t>u)
        return PyLong_FromLongLong(<int64_t>u)
    if t == 0xca:
        if s.at + 4 > s.n:
            return _BAD
        u32 = <uint32_t>_get_be(s, 4)
        memcpy(&f32, &u32, 4)
        return PyFloat_FromDouble(<double>f32)
    if t == 0xcb:
        if s.at + 8 > s.n:
            return _BAD
        u = _get_be(s, 8)
        memcpy(&f64, &u, 8)
        return PyFloat_FromDouble(f64)
    if 0xc4 <= t <= 0xc6:  # bin 8..32
        w = 1 << (t - 0xc4)
        if s.at + w > s.n:
            return _BAD
        n = <Py_ssize_t>_get_be(s, w)
        if s.at + n > s.n:
            return _BAD
        i = s.at
        s.at += n
        return PyBytes_FromStringAndSize(<const char*>(s.p + i), n)
    if t == 0xdc or t == 0xdd:
        w = 2 if t == 0xdc else 4
        if s.at + w > s.n:
            return _BAD
        return _array(s, <Py_ssize_t>_get_be(s, w), depth, key)
    if t == 0xde or t == 0xdf:
        w = 2 if t == 0xde else 4
        if s.at + w > s.n:
            return _BAD
        return _map(s, <Py_ssize_t>_get_be(s, w), depth, key)
    return _BAD  # an ext type (or the unused 0xc1): msgpack's to decode


cdef object _array(Src* s, Py_ssize_t n, int depth, bint key):
    cdef Py_ssize_t i
    if key or depth >= _DEPTH or n > s.n - s.at:  # (each item takes a byte at least)
        return _BAD
    cdef list out = PyList_New(n)
    for i in range(n):
        x = _unpack(s, depth + 1, False)
        if x is _BAD:
            return _BAD  # (the items not set are NULL, which the list's free skips)
        Py_INCREF(x)
        PyList_SET_ITEM(out, i, x)
    return out


cdef object _map(Src* s, Py_ssize_t n, int depth, bint key):
    cdef Py_ssize_t i
    if key or depth >= _DEPTH or n > s.n - s.at:
        return _BAD
    cdef Tpl* tp = s.tpl if depth == 0 else NULL
    if tp != NULL and tp.d != NULL and tp.n == n:
        out = _map_like(s, tp, n)
        if out is not None:
            return out
    cdef bint plain_keys = tp != NULL and n <= _TPL_KEYS
    cdef Py_ssize_t offs[_TPL_KEYS]
    cdef Py_ssize_t voffs[_TPL_KEYS]
    cdef Py_ssize_t vends[_TPL_KEYS]
    cdef dict out2 = {}
    cdef uint8_t t
    cdef Py_ssize_t m
    for i in range(n):
        t = s.p[s.at] if s.at < s.n else 0  # (0: not a str, for _unpack to refuse)
        m = t & 0x1f
        if 0xa0 <= t <= 0xbf and m <= _SHORT and s.at + 1 + m <= s.n:
            # A short str key (the common map): from the string cache, without _unpack's dispatch.
            if plain_keys:
                offs[i] = s.at
            k = _short_str(s.p + s.at + 1, m, True)
            s.at += 1 + m
        else:
            plain_keys = False
            k = _unpack(s, depth + 1, True)
        if k is _BAD:
            return _BAD
        if plain_keys:
            voffs[i] = s.at
        v = _unpack(s, depth + 1, False)
        if v is _BAD:
            return _BAD
        if plain_keys:
            vends[i] = s.at
        PyDict_SetItem(out2, k, v)  # (k a scalar: a container key was refused as _BAD)
    if plain_keys and n and PyDict_Size(out2) == n:
        _remember(tp, out2, s.p, offs, voffs, vends, n)
    return out2


cdef void _remember(Tpl* tp, dict d, const uint8_t* p, Py_ssize_t* offs, Py_ssize_t* voffs, Py_ssize_t* vends,
                    Py_ssize_t n) noexcept:
    """Make ``d`` (a map of ``n`` distinct short fixstr keys, the ``i``-th key's bytes at
    ``p + offs[i]``, its value's from ``p + voffs[i]`` to ``p + vends[i]``) the template
    of the maps that follow."""
    cdef Py_ssize_t pos = 0, i = 0
    cdef PyObject* k
    cdef PyObject* v
    Py_INCREF(d)
    Py_XDECREF(tp.d)
    tp.d = <PyObject*>d
    tp.p = p
    tp.n = n
    while PyDict_Next(d, &pos, &k, &v):  # (insertion order: the body's key order)
        tp.keys[i] = k
        tp.off[i] = offs[i]
        tp.ln[i] = 1 + (p[offs[i]] & 0x1f)
        tp.voff[i] = voffs[i]
        tp.vln[i] = vends[i] - voffs[i]
        tp.vals[i] = v
        tp.share[i] = _share_kind(<object>v)
        i += 1


cdef inline bint _immutable(object v) noexcept:
    cdef type t = type(v)
    return t is str or t is int or v is None or t is float or t is bool or t is bytes


cdef uint8_t _share_kind(object v) noexcept:
    """A template value's ``share`` (see Tpl)."""
    cdef Py_ssize_t i
    if _immutable(v):
        return 1
    if type(v) is not list:
        return 0
    for i in range(PyList_GET_SIZE(v)):
        if not _immutable(<object>PyList_GET_ITEM(v, i)):
            return 0
    return 2


cdef object _map_like(Src* s, Tpl* tp, Py_ssize_t n):
    """The map at ``s`` (``n`` entries) when its keys are the template's, in its order:
    a copy of the template's dict (one allocation and copy of its table, no insert of a
    new key) with each value replaced by this map's (a lookup that finds the key at once:
    the same interned string), but an immutable value whose bytes are the template's:
    that one is the template's object (msgpack values are self-delimiting, so the same
    bytes are the same value; sharing an immutable object is as the string cache does),
    and a list of immutable values with the template's bytes is a new list of the
    template's items (mutable containers are never shared).
    The same dict a fresh decode builds: equal keys (the very objects), equal values, the
    same order.  None, with ``s`` where it was, when a key differs (then the general
    decode); ``_BAD`` as that decode gives it."""
    cdef Py_ssize_t i, m, start = s.at
    cdef dict out = PyDict_Copy(<object>tp.d)
    for i in range(n):
        m = tp.ln[i]
        if s.at + m > s.n or not _same(s.p + s.at, tp.p + tp.off[i], m):
            s.at = start
            return None
        s.at += m
        m = tp.vln[i]
        if tp.share[i] and s.at + m <= s.n and _same(s.p + s.at, tp.p + tp.voff[i], m):
            s.at += m
            if tp.share[i] == 1:
                continue  # the copy holds the template's object, equal to this one
            v = PyList_GetSlice(<object>tp.vals[i], 0, PyList_GET_SIZE(<object>tp.vals[i]))
            PyDict_SetItem(out, <object>tp.keys[i], v)
            continue
        v = _unpack(s, 1, False)
        if v is _BAD:
            return _BAD
        PyDict_SetItem(out, <object>tp.keys[i], v)
    return out


def unpack_plain(list raws):
    """Each of ``raws`` (``bytes``, one msgpack value each) decoded as
    ``msgpack.unpackb(raw, raw=False, strict_map_key=False)`` decodes it, or None if any
    is not plain (the module's docstring): then decode with msgpack."""
    cdef Py_ssize_t i, n = PyList_GET_SIZE(raws)
    cdef list out = PyList_New(n)  # (items NULL until set, which the list's free skips)
    cdef Src s
    cdef Tpl tpl
    cdef object raw
    tpl.d = NULL
    s.tpl = &tpl if n > 1 else NULL  # (a lone body: no map follows to use a template)
    try:
        for i in range(n):
            raw = <object>PyList_GET_ITEM(raws, i)
            if type(raw) is not bytes:
                return None
            s.p = <const uint8_t*>PyBytes_AS_STRING(raw)
            s.n = PyBytes_GET_SIZE(raw)
            s.at = 0
            x = _unpack(&s, 0, False)
            if x is _BAD or s.at != s.n:
                return None
            Py_INCREF(x)
            PyList_SET_ITEM(out, i, x)
        return out
    finally:
        Py_XDECREF(tpl.d)


cdef object unpack_one(bytes raw, bint* ok):
    """``unpack_plain([raw])[0]`` with ``ok`` set, or ``ok`` cleared where that is None:
    one body decoded without the argument and result lists (a var queue's ``lease(1)``,
    ``armdb._core.qshard.VarFast``, calls it from C; declared in plainpack.pxd)."""
    cdef Src s
    s.tpl = NULL  # (a lone body: no map follows to use a template)
    s.p = <const uint8_t*>PyBytes_AS_STRING(raw)
    s.n = PyBytes_GET_SIZE(raw)
    s.at = 0
    x = _unpack(&s, 0, False)
    if x is _BAD or s.at != s.n:
        ok[0] = False
        return None
    ok[0] = True
    return x


def unpack_one_plain(bytes raw not None):
    """:func:`unpack_one` from Python, ``(ok, value)`` (its tests compare it with
    :func:`unpack_plain` and msgpack)."""
    cdef bint ok = False
    x = unpack_one(raw, &ok)
    return ok, x
