/* CPython objects read in place by armdb._core.plainpack's packer: a combined dict's
 * entry table, and a compact int's value.
 *
 * PyDict_Next costs about 50 instructions an item (a call, its checks, the table kind
 * branch); a payload dict's five items cost push_many(1000) about 280 instructions a
 * job.  The packer only reads the items in order, holding the GIL and running no Python
 * code meanwhile, so it walks the table itself: the keys object's layout, below, is the
 * one CPython 3.11, 3.12 and 3.13 share (Include/internal/pycore_dict.h, default GIL
 * builds).  Anything else -- another version, a free-threaded build, a split table (an
 * instance's __dict__) -- gets NULL and the caller keeps PyDict_Next: never a second
 * reading of the same dict, only a shorter path to the same items in the same order.
 */
#ifndef ARMDB_PYFAST_H
#define ARMDB_PYFAST_H

#include <Python.h>
#include <stdint.h>

#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030E0000 && !defined(Py_GIL_DISABLED) \
    && !defined(PYPY_VERSION) && !defined(Py_LIMITED_API)
#define ARMDB_DICT_ENTRIES 1

typedef struct {  /* struct _dictkeysobject, its fixed head */
    Py_ssize_t dk_refcnt;
    uint8_t dk_log2_size;
    uint8_t dk_log2_index_bytes;
    uint8_t dk_kind;             /* 0 general (hash, key, value), else unicode (key, value) */
    uint32_t dk_version;
    Py_ssize_t dk_usable;
    Py_ssize_t dk_nentries;
    char dk_indices[];           /* 1 << dk_log2_index_bytes bytes, then the entries */
} armdb_dictkeys;

#endif

/* The first entry's key slot of the exact dict ``d``'s table, with ``*count`` entries
 * of ``*stride`` pointers each (the value follows the key; a deleted entry's value is
 * NULL), or NULL where the table cannot be read so (the caller uses PyDict_Next). */
static inline PyObject** armdb_dict_entries(PyObject* d, Py_ssize_t* count, Py_ssize_t* stride) {
#ifdef ARMDB_DICT_ENTRIES
    PyDictObject* mp = (PyDictObject*)d;
    armdb_dictkeys* dk;
    if (mp->ma_values != NULL)
        return NULL;  /* a split table: values in their own array, in their own order */
    dk = (armdb_dictkeys*)mp->ma_keys;
    if (dk->dk_kind > 1)
        return NULL;  /* (a split kind: never with ma_values NULL, but not read as combined) */
    *count = dk->dk_nentries;
    *stride = dk->dk_kind == 0 ? 3 : 2;
    return (PyObject**)(dk->dk_indices + ((size_t)1 << dk->dk_log2_index_bytes)) + (dk->dk_kind == 0 ? 1 : 0);
#else
    (void)d; (void)count; (void)stride;
    return NULL;
#endif
}

/* 1 with ``*v`` set when the exact int ``o`` is compact (one digit: below 2**30 in
 * magnitude), else 0 and the caller converts it by PyLong_AsLongLongAndOverflow: the
 * same value, without that call's checks and loop (about 25 instructions an int; the
 * bench payload has two).  3.12 on: the unstable API's compact test; 3.11: the digit. */
static inline int armdb_compact_int(PyObject* o, long long* v) {
#if PY_VERSION_HEX >= 0x030C0000 && !defined(Py_LIMITED_API) && !defined(PYPY_VERSION)
    if (PyUnstable_Long_IsCompact((PyLongObject*)o)) {
        *v = (long long)PyUnstable_Long_CompactValue((PyLongObject*)o);
        return 1;
    }
    return 0;
#elif PY_VERSION_HEX >= 0x030B0000 && !defined(Py_LIMITED_API) && !defined(PYPY_VERSION)
    Py_ssize_t size = Py_SIZE(o);
    if (size == 0) {
        *v = 0;
        return 1;
    }
    if (size == 1 || size == -1) {
        *v = (long long)((PyLongObject*)o)->ob_digit[0];
        if (size < 0)
            *v = -*v;
        return 1;
    }
    return 0;
#else
    (void)o; (void)v;
    return 0;
#endif
}

/* A compact ASCII str's characters (the caller has checked PyUnicode_IS_COMPACT_ASCII):
 * they follow its PyASCIIObject, as CPython's own _PyUnicode_COMPACT_DATA finds them,
 * without PyUnicode_DATA's compact and ASCII tests again (the public layout, every
 * version). */
#define armdb_ascii_data(o) ((const char*)(((PyASCIIObject*)(o)) + 1))

#endif
