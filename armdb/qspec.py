"""Queue declarations and their payload codecs (SPEC Q1, Q9).

:func:`queue` makes a :class:`QueueSpec` at import time; its ``fingerprint`` is what
``queue.meta`` stores, so a queue reopened with another payload type is refused
(``SchemaMismatch``).  A fixed queue's payload is a NumPy record stored inline in its
row (:class:`FixedCodec`); a var queue's is msgpack in its ``<name>.payload`` collection
(:class:`VarCodec`), checked at push to read back as it was given.

A format module: it encodes and decodes payloads and runs no store.
"""

from __future__ import annotations

import dataclasses
import inspect
import struct
import typing
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import msgpack
import numpy as np

from ._core import plain as _plain
from ._core.plain import reads_back
from ._core.plainpack import pack_plain, unpack_plain
from ._pack import check_round_trip, decodes_all, packb, packer, unpackb
from .errors import ConfigError, PayloadTypeError, SchemaMismatch
from .layout import PAYLOAD_SUFFIX, validate_name
from .qrows import MAX_FIXED_PAYLOAD

__all__ = ["QueueSpec", "queue"]


T = TypeVar("T")


@dataclass(frozen=True)
class QueueSpec(Generic[T]):
    """A queue declaration made by :func:`queue` at import time; generic in the payload
    type, so that ``db.open_queue(spec)`` is a ``Queue[Job]`` to a type checker."""

    name: str
    payload: Any
    var: bool
    fingerprint: str

    @property
    def payload_name(self) -> str:
        return self.name + PAYLOAD_SUFFIX

    @property
    def dtype(self) -> np.dtype:
        return typing.cast(np.dtype, self.payload)


def _fixed_dtype(payload: Any) -> np.dtype:
    if isinstance(payload, type) and issubclass(payload, np.generic):
        payload = np.dtype(payload)
    if not isinstance(payload, np.dtype):
        raise ConfigError(
            f"a fixed queue's payload must be a NumPy dtype (e.g. np.dtype([('doc', '<u8')])), "
            f"not {payload!r}; for other types declare the queue with var=True"
        )
    if payload.hasobject:
        raise ConfigError("a fixed queue's dtype cannot hold Python objects; use var=True for those")
    if payload.itemsize > MAX_FIXED_PAYLOAD or payload.itemsize == 0:
        raise ConfigError(
            f"a fixed queue's payload is stored inline and must be 1..{MAX_FIXED_PAYLOAD} bytes, "
            f"got {payload.itemsize}; declare the queue with var=True for larger payloads"
        )
    return payload


def _var_fingerprint(payload: Any) -> str:
    if dataclasses.is_dataclass(payload) and isinstance(payload, type):
        hints = typing.get_type_hints(payload)
        fields = ",".join(f"{f.name}:{_type_name(hints.get(f.name, f.type))}" for f in dataclasses.fields(payload))
        return f"var:dataclass({fields})"
    if payload is typing.Any or payload is object:
        return "var:any"
    if isinstance(payload, type) and payload in _MSGPACK_TYPES:
        return f"var:{payload.__name__}"
    raise ConfigError(
        f"a var queue's payload must be a dataclass, bytes, or a msgpack type "
        f"(int, float, str, bool, list, dict, tuple, or object/typing.Any), not {payload!r}"
    )


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


_MSGPACK_TYPES = (bytes, str, int, float, bool, list, dict, tuple)


@typing.overload
def queue(name: str, *, payload: type[T], var: Literal[True]) -> QueueSpec[T]: ...
@typing.overload
def queue(name: str, *, payload: Any, var: Literal[False] = False) -> QueueSpec[np.void]: ...
@typing.overload
def queue(name: str, *, payload: Any, var: bool = False) -> QueueSpec[Any]: ...
def queue(name: str, *, payload: Any, var: bool = False) -> QueueSpec[Any]:
    """Declare a queue (Q1).  Call once per queue, at import time.

    Parameters
    ----------
    name : str
        Collection name, at most 120 characters of ``[a-z0-9_.-]``.
    payload : numpy.dtype or type
        For a fixed queue (``var=False``): a NumPy dtype of at most 4096 bytes,
        stored inline in the header slot.  For a var queue: a dataclass, ``bytes``,
        or a msgpack-serialisable type, stored in the ``name.payload`` collection.
    var : bool
        Store bodies in a separate Bitcask collection.

    Raises
    ------
    ConfigError
        A bad name, a payload that is not a dtype (fixed), or a too-large dtype.
    """
    validate_name(name, queue=True)
    if name.endswith(".payload"):
        raise ConfigError(f"queue name {name!r} must not end in '.payload' (reserved for its body collection)")
    if not isinstance(var, bool):
        raise ConfigError("var must be True or False")
    if var:
        return QueueSpec(name, payload, True, _var_fingerprint(payload))
    dtype = _fixed_dtype(payload)
    return QueueSpec(name, dtype, False, f"fixed:{dtype.descr!r}:{dtype.itemsize}")


# -- payload codecs ----------------------------------------------------------------------


_STRUCT_CODES = {"b": "b", "B": "B", "h": "h", "H": "H", "i": "i", "I": "I", "l": "q", "L": "Q", "q": "q",
                 "Q": "Q", "e": "e", "f": "f", "d": "d"}  # not "?": struct packs any object's truth value


def _struct_for(dt: np.dtype) -> struct.Struct | None:
    """A struct that packs a tuple exactly as NumPy would, for plain little-endian numeric
    fields laid out back to back; None for anything else (NumPy does those)."""
    fields = [dt] if dt.names is None else [dt.fields[n][0] for n in dt.names]  # type: ignore[index]
    offsets = [0] if dt.names is None else [dt.fields[n][1] for n in dt.names]  # type: ignore[index]
    codes = []
    pos = 0
    for f, off in zip(fields, offsets):
        if f.subdtype is not None or f.char not in _STRUCT_CODES or off != pos or f.byteorder == ">":
            return None
        codes.append(_STRUCT_CODES[f.char])
        pos += f.itemsize
    st = struct.Struct("<" + "".join(codes))
    return st if st.size == dt.itemsize else None


class FixedCodec:
    """A fixed queue's payload: one record (or scalar) of the queue's dtype, stored exactly
    or refused (SPEC Q35).

    A value that NumPy would convert with a loss (a float with a fractional part into an
    integer field, an int out of range, a bytes or str longer than its field, a truthy
    object into a bool) raises ``PayloadTypeError`` naming the field; a lossless
    conversion (the int 6 into a float field, a shorter bytes that NumPy pads) is taken.
    A Python float into a narrower float field (``f4``, ``f2``) is rounded to the nearest
    value as NumPy assignment does; one that would overflow to infinity is refused.
    """

    def __init__(self, dtype: np.dtype) -> None:
        self.dtype = dtype
        self.size = dtype.itemsize
        self._struct = _struct_for(dtype) if dtype.names is not None else None
        self._nfields = len(dtype.names) if dtype.names is not None else 0
        # The struct fast path is exact for integer fields (struct refuses a float and
        # checks the range) and for a float field given a float (struct refuses overflow);
        # an int into a float field may not be exact, so it goes the checked way.
        floats = _float_fields(dtype) if self._struct is not None else ()
        self._float_at = floats[0] if len(floats) == 1 else -1  # the common case: one float field
        self._floats = floats if len(floats) > 1 else ()
        # The struct whose pack(*value) is encode(value) for any tuple of _nfields that it
        # packs (no float field to type-check first); None otherwise (armdb._core.qshard).
        self.plain_struct = self._struct if not floats else None

    def encode(self, value: Any) -> bytes:
        st = self._struct
        if (
            st is not None
            and type(value) is tuple
            and len(value) == self._nfields
            and (self._float_at < 0 or type(value[self._float_at]) is float)
            and (not self._floats or all(type(value[i]) is float for i in self._floats))
        ):
            try:
                return st.pack(*value)
            except (struct.error, OverflowError):
                pass  # out of range: NumPy's path below says which field
        dt = self.dtype
        if isinstance(value, (np.void, np.generic)) and value.dtype == dt:
            return value.tobytes()
        if isinstance(value, np.ndarray) and value.shape == () and value.dtype == dt:
            return value.tobytes()
        if dt.names is not None:
            if not isinstance(value, tuple) or len(value) != len(dt.names):
                got = f"a tuple of {len(value)}" if isinstance(value, tuple) else type(value).__name__
                raise PayloadTypeError(
                    f"payload for dtype {dt} must be a record of that dtype or a tuple of "
                    f"{len(dt.names)} fields, not {got} (the fields: {', '.join(dt.names)})"
                )
        elif not _scalar_fits(value, dt):
            raise PayloadTypeError(f"payload for dtype {dt} must be a matching scalar, not {value!r}")
        try:
            with np.errstate(all="ignore"):  # an overflow is judged below, as a loss
                arr = np.array(value, dtype=dt)
        except (ValueError, TypeError, OverflowError) as e:
            raise PayloadTypeError(f"payload {value!r} does not fit dtype {dt}: {_field_of(value, dt)}{e}") from None
        problem = _loss(value, arr[()], dt, "")
        if problem is not None:
            raise PayloadTypeError(f"payload {value!r} does not fit dtype {dt}: {problem}; nothing was written")
        return arr.tobytes()


def _float_fields(dt: np.dtype) -> tuple[int, ...]:
    """The positions of the float fields of a record that :func:`_struct_for` packs."""
    return tuple(i for i, name in enumerate(dt.names or ()) if dt.fields[name][0].kind == "f")  # type: ignore[index]


def _field_of(value: tuple, dt: np.dtype) -> str:
    """``"field 'name': "`` for the first field of a record that NumPy cannot convert."""
    if dt.names is None:
        return ""
    for name, v in zip(dt.names, value):
        fdt = dt.fields[name][0]  # type: ignore[index]
        try:
            with np.errstate(all="ignore"):
                stored = np.array(v, dtype=fdt)[()]
        except (ValueError, TypeError, OverflowError):
            return f"field {name!r}: "
        if _loss(v, stored, fdt, name) is not None:  # NumPy takes alone what it refused in the record
            return f"field {name!r}: "
    return ""


def _loss(given: Any, stored: Any, dt: np.dtype, where: str) -> str | None:
    """What converting ``given`` to ``dt`` lost (``stored`` is what NumPy made of it), or
    None when it is exact (or a float rounded into a narrower float field)."""
    if dt.names is not None:
        for name, g, s in zip(dt.names, given, stored, strict=True):
            problem = _loss(g, s, dt.fields[name][0], f"{where}.{name}" if where else name)  # type: ignore[index]
            if problem is not None:
                return problem
        return None
    field = f"field {where!r}" if where else "the value"
    if dt.subdtype is not None:
        base, shape = dt.subdtype
        if np.shape(given) != shape:
            return f"{field} {given!r} is not an array of shape {shape}"
        for g, s in zip(np.asarray(given, dtype=object).ravel(), np.asarray(stored).ravel(), strict=True):
            problem = _loss(g, s, base, where)
            if problem is not None:
                return problem
        return None
    kind = dt.kind
    if kind in "fc":
        if isinstance(given, (float, complex, np.floating, np.complexfloating)):
            if np.all(np.isfinite(given)) and not np.all(np.isfinite(stored)):
                return f"{field} {given!r} overflows {dt}"
            return None
        # An int: exact or refused (Python compares a float with an int exactly; NumPy
        # would round the int first, so 2**60 + 1 would equal its float).
        exact = float(stored) == int(given) if kind == "f" and isinstance(given, (int, np.integer)) else stored == given
        if not exact:
            return f"{field} {given!r} is not exactly representable in {dt} (stored as {stored!r})"
        return None
    if kind in "iu":
        if stored != given:
            return f"{field} {given!r} is not an integer in the range of {dt} (stored as {stored!r})"
        return None
    if kind == "b":
        if stored != given or not isinstance(given, (bool, np.bool_, int, np.integer)):
            return f"{field} {given!r} is not a bool"
        return None
    if kind == "S":
        if isinstance(given, str):
            ok = given.isascii() and stored == given.encode("ascii").rstrip(b"\0")
        else:
            ok = isinstance(given, (bytes, np.bytes_)) and stored == bytes(given).rstrip(b"\0")
        if not ok:
            return f"{field} {given!r} does not fit {dt.itemsize} bytes (stored as {stored!r})"
        return None
    if kind == "U":
        if not isinstance(given, str) or stored != given.rstrip("\0"):
            return f"{field} {given!r} does not fit {dt.itemsize // 4} characters (stored as {stored!r})"
        return None
    if kind == "V":  # raw bytes: NumPy pads a shorter value with zeros and cuts a longer one
        raw = given.tobytes() if isinstance(given, np.void) else bytes(given) if isinstance(
            given, (bytes, bytearray, memoryview)) else None
        if raw is None or len(raw) > dt.itemsize or bytes(stored.tobytes()) != raw.ljust(dt.itemsize, b"\0"):
            return f"{field} {given!r} does not fit {dt.itemsize} raw bytes"
        return None
    if stored != given:  # datetime64, timedelta64 and the rest: equal after the round trip
        return f"{field} {given!r} does not convert to {dt} exactly (stored as {stored!r})"
    return None


def _scalar_fits(value: Any, dt: np.dtype) -> bool:
    if isinstance(value, np.generic):
        return np.can_cast(value.dtype, dt, casting="same_kind")
    if isinstance(value, bool):
        return dt.kind == "b"
    if isinstance(value, int):
        return dt.kind in "iuf"
    if isinstance(value, float):
        return dt.kind == "f"
    if isinstance(value, complex):
        return dt.kind == "c"
    if isinstance(value, (str, bytes)):
        return dt.kind in "SU"
    return False


class VarCodec:
    def __init__(self, payload: Any) -> None:
        self.payload = payload
        self.is_dataclass = dataclasses.is_dataclass(payload)
        self.fields = [f.name for f in dataclasses.fields(payload)] if self.is_dataclass else []
        self.any = payload is typing.Any or payload is object
        # A lease rebuilds a dataclass as cls(*fields).  With the generated __init__
        # taking exactly the fields by position and no __post_init__, that sets the
        # fields and nothing else, so push only has to know msgpack decodes them;
        # otherwise (a __post_init__, init=False or keyword-only fields, a hand-written
        # __init__ of another signature) push rebuilds the value once to be sure.
        self.rebuild_at_push = self.is_dataclass and not _rebuilds_plainly(payload)
        # Whether a stored body is the plain msgpack value a client packs and unpacks
        # (no layout tag), which decodes to a payload whenever its shape is right:
        # accept_encoded and Queue._lease_batch_encoded pass such bodies through as bytes.
        self.stored_plain = not self.rebuild_at_push
        # Set by use_layouts, which replaces encode and decode on the instance: the batch
        # paths then encode and decode one by one through them.  (A flag, not a look in
        # the instance dict: asking for that dict makes it a split table, which slows
        # every attribute read of this codec; see armdb._objdict.)
        self.relayout = False
        # encode's and decode's common case, tested first: a payload of exactly this
        # (non-dataclass, not Any) type, packed by the compiled plain codec; and a body
        # that decodes to the payload as it is (no class to rebuild, no tuple).
        self._plain_type: Any = None if self.is_dataclass or self.any else payload
        self._decodes_as_is = not self.is_dataclass and payload is not tuple

    def encode(self, value: Any) -> bytes:
        tried = type(value) is self._plain_type
        if tried:
            got = pack_plain([value])
            if got is not None:
                return got[0]
        if self.is_dataclass:
            if type(value) is not self.payload:
                raise PayloadTypeError(
                    f"payload must be an instance of {self.payload.__name__}, not {type(value).__name__}"
                )
            obj: Any = [getattr(value, f) for f in self.fields]
        else:
            if self.payload is bytes and isinstance(value, (bytearray, memoryview)):
                value = bytes(value)  # bytes-like: stored, and leased, as bytes
            if not self.any and not _is_instance(value, self.payload):
                raise PayloadTypeError(
                    f"payload must be of type {self.payload.__name__}, not {type(value).__name__}"
                )
            obj = value
        if not self.rebuild_at_push and not tried:  # a value of the plain type was packed above if it could be
            got = pack_plain([obj])  # a plain value (the common payload): packed and vouched for in one pass
            if got is not None:
                return got[0]
        try:
            raw = packb(obj)
        except (TypeError, ValueError, OverflowError) as e:
            raise PayloadTypeError(f"payload cannot be serialised with msgpack: {self._which_field(value)}{e}; store "
                                   f"str, bytes, numbers, bools, None, lists and dicts of them") from None
        if self.rebuild_at_push:
            check_round_trip(value, raw, "payload", self._rebuild, self._fields_packed)
        else:
            check_round_trip(value, raw, "payload")
        return raw

    def encode_many(self, values: list[Any]) -> list[bytes] | None:
        """:meth:`encode` of each of ``values``, read-back checked together: by a compiled
        walk of plain values (:func:`armdb._core.plain.reads_back`), else by one decode of
        them all; None if any is refused (then :meth:`encode` of each says which and why).
        A class whose values push rebuilds to check them, or whose layout changed, is
        encoded one by one."""
        if self.rebuild_at_push or self.relayout:
            try:
                return [self.encode(v) for v in values]
            except PayloadTypeError:
                return None
        if self.is_dataclass:
            cls, fields = self.payload, self.fields
            if any(type(v) is not cls for v in values):
                return None
            objs = [[getattr(v, f) for f in fields] for v in values]
        elif self.any:
            objs = values
        else:
            tp = self.payload
            if tp is bytes or tp is int or tp is float:  # (their own conversions and exclusions)
                try:
                    return [self.encode(v) for v in values]
                except PayloadTypeError:
                    return None
            raws = pack_plain(values, tp)  # each exactly a tp, and plain (the common batch): one pass
            if raws is not None:
                return raws
            if set(map(type, values)) != {tp} and not all(isinstance(v, tp) for v in values):
                return None
            objs = values
        raws = pack_plain(objs)  # plain values (the common payload): packed by one compiled loop
        if raws is not None:
            return raws
        try:
            raws = list(map(packer().pack, objs))
        except (TypeError, ValueError, OverflowError):
            return None
        return raws if reads_back(objs) or decodes_all(raws) else None

    def plain(self, value: Any) -> Any:
        """``value`` checked as :meth:`encode` checks it, as the msgpack value ``encode``
        would pack (a dataclass: its field list), without packing it: the client sends a
        batch's payloads packed together (armdb.client)."""
        if self.is_dataclass:
            if type(value) is not self.payload:
                raise PayloadTypeError(
                    f"payload must be an instance of {self.payload.__name__}, not {type(value).__name__}"
                )
            return [getattr(value, f) for f in self.fields]
        if self.payload is bytes and isinstance(value, (bytearray, memoryview)):
            value = bytes(value)
        if not self.any and not _is_instance(value, self.payload):
            raise PayloadTypeError(f"payload must be of type {self.payload.__name__}, not {type(value).__name__}")
        return value

    def from_plain(self, obj: Any) -> Any:
        """The payload :meth:`decode` gives for the bytes of ``obj`` (a value msgpack
        decoded), without packing it again."""
        if self.is_dataclass:
            return self.payload(*obj)
        if self.payload is tuple:
            return tuple(obj)
        return obj

    def accept_encoded(self, raw: bytes) -> bytes:
        """The body to store for ``raw``, a payload encoded elsewhere as :meth:`plain` and
        msgpack give it (a client's push, armdb.server), checked once: it must be one
        complete msgpack value, nothing after it, that :meth:`decode` turns into a payload
        of the declared type (a dataclass: a list of its fields); with ``stored_plain``
        it is stored as it came, else it is decoded and encoded as :meth:`encode` does.

        Raises
        ------
        PayloadTypeError
            ``raw`` is not bytes, not msgpack, has bytes after its value, or is not a
            payload of the declared type."""
        if type(raw) is not bytes:
            raise PayloadTypeError(f"an encoded payload is bytes, not {type(raw).__name__}")
        try:
            obj = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        except Exception as e:  # noqa: BLE001 - msgpack raises several unrelated classes
            raise PayloadTypeError(f"the encoded payload is not one complete msgpack value ({type(e).__name__}: "
                                   f"{e}); encode payloads with the queue's own spec") from None
        if self.is_dataclass:
            if type(obj) is not list or len(obj) != len(self.fields):
                raise PayloadTypeError(f"the encoded payload is not the {len(self.fields)} fields of "
                                       f"{self.payload.__name__} (got {type(obj).__name__}); declare the same "
                                       f"payload class on both sides")
        elif not self.any and not _is_instance(obj, list if self.payload is tuple else self.payload):
            raise PayloadTypeError(f"the encoded payload is a {type(obj).__name__}, not a {self.payload.__name__}; "
                                   f"declare the same payload type on both sides")
        if self.stored_plain:
            return raw
        try:
            value = self.from_plain(obj)
        except Exception as e:  # noqa: BLE001 - the payload class refused the fields
            raise PayloadTypeError(f"{self.payload.__name__} cannot be built from the encoded fields "
                                   f"({type(e).__name__}: {e})") from None
        return self.encode(value)

    def accept_encoded_many(self, raws: list[bytes]) -> list[bytes] | None:
        """:meth:`accept_encoded` of each of ``raws``, when every one is accepted as it came
        and a compiled walk of the bytes shows it (``armdb._core.plain.bodies_decode``:
        one value each, decodable, of the declared outer type) without decoding them;
        None otherwise (then :meth:`accept_encoded` of each, which names what it refuses)."""
        if not self.stored_plain:
            return None
        if self.is_dataclass:
            kind, arity = _plain.KIND_FIELDS, len(self.fields)
        elif self.any:
            kind, arity = _plain.KIND_ANY, 0
        else:
            kind, arity = _BODY_KINDS.get(self.payload, -1), 0
        if kind < 0 or not _plain.bodies_decode(raws, kind, arity):
            return None
        return raws

    def _which_field(self, value: Any) -> str:
        """``"field 'x' of Job holds a set: "`` for the first dataclass field msgpack refuses."""
        for name in self.fields if self.is_dataclass else ():
            v = getattr(value, name)
            try:
                packb(v)
            except (TypeError, ValueError, OverflowError):
                return f"field {name!r} of {self.payload.__name__} holds a {type(v).__name__}: "
        return ""

    def use_layouts(self, layouts: list[Layout], current: int) -> None:
        """Read bodies written under any of ``layouts`` (the payload class's field lists
        over its history, SPEC Q36) and write new ones under ``layouts[current]``, which
        is the class's own.  Layout 0's bodies carry no tag; a later layout's start with
        :data:`LAYOUT_TAG` and its index (a dataclass body is otherwise a msgpack array,
        whose first byte is never 0xd5)."""
        if not self.is_dataclass or len(layouts) <= 1:
            return
        self.stored_plain = False  # bodies of older layouts are translated by decode
        self.relayout = True
        self._names = [[name for name, _type in layout] for layout in layouts]
        self._current = current
        self._prefix = b"" if current == 0 else LAYOUT_TAG + current.to_bytes(2, "big")
        init = {f.name for f in dataclasses.fields(self.payload) if f.init}
        self._init_fields = [f for f in self.fields if f in init]
        self.decode = self._decode_layout  # type: ignore[method-assign]
        encode = self.encode

        def encode_tagged(value: Any) -> bytes:
            return self._prefix + encode(value)

        self.encode = encode_tagged  # type: ignore[method-assign]

    def _decode_layout(self, raw: bytes) -> Any:
        """:meth:`decode` for a queue whose class changed (:meth:`use_layouts`)."""
        layout = 0
        if raw[:2] == LAYOUT_TAG:
            layout = int.from_bytes(raw[2:4], "big")
            raw = raw[4:]
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        if layout == self._current:
            return self.payload(*obj)
        if layout >= len(self._names) or not isinstance(obj, list):
            raise PayloadTypeError(f"a stored body names payload layout {layout}, which this queue never had")
        values = dict(zip(self._names[layout], obj))
        # A field the row lacks takes the class's default; a stored field the class no
        # longer has is dropped.
        return self.payload(**{name: values[name] for name in self._init_fields if name in values})

    def _rebuild(self, obj: Any) -> Any:
        """A dataclass payload from its decoded field list, as :meth:`decode` builds it."""
        return self.payload(*obj)

    def _fields_packed(self, value: Any) -> bytes:
        return packb([getattr(value, f) for f in self.fields])

    def decode_many(self, raws: list[bytes]) -> list[Any] | None:
        """:meth:`decode` of each of ``raws`` (bodies the write path stored: each one
        msgpack value) by one decode of them all; None if that fails (then :meth:`decode`
        of each finds which).  A class whose layout changed is decoded one by one."""
        if self.relayout:
            return None
        try:
            objs = unpack_plain(raws)  # bodies of plain values: one compiled loop, no join
            if objs is None:
                objs = unpackb(b"\xdd" + len(raws).to_bytes(4, "big") + b"".join(raws))
            if self.is_dataclass:
                cls = self.payload
                return [cls(*o) for o in objs]
            if self.payload is tuple:
                return [tuple(o) for o in objs]
        except Exception:  # noqa: BLE001 - whatever msgpack or the class raises: one by one
            return None
        return objs  # type: ignore[no-any-return]

    def decode(self, raw: bytes) -> Any:
        got = unpack_plain([raw])  # a body of plain values: the compiled loop; anything else msgpack
        if got is not None and self._decodes_as_is:
            return got[0]
        obj = got[0] if got is not None else msgpack.unpackb(raw, raw=False, strict_map_key=False)
        if self.is_dataclass:
            return self.payload(*obj)
        if self.payload is tuple:
            return tuple(obj)
        return obj


# -- schema evolution of dataclass payloads (SPEC Q36) ---------------------------------------

Layout = list[list[str]]  # [[field name, type name], ...] in the class's field order
LAYOUT_TAG = b"\xd5\x01"  # msgpack fixext2 of type 1: the two bytes after it are a layout index
MAX_LAYOUTS = 1 << 16


def layout_of(payload: Any) -> Layout:
    """The field names and type names of a dataclass payload, as its fingerprint lists them."""
    hints = typing.get_type_hints(payload)
    return [[f.name, _type_name(hints.get(f.name, f.type))] for f in dataclasses.fields(payload)]


def layout_from_fingerprint(fingerprint: str) -> Layout | None:
    """The layout a ``var:dataclass(...)`` fingerprint describes; None for another kind."""
    if not (fingerprint.startswith("var:dataclass(") and fingerprint.endswith(")")):
        return None
    body = fingerprint[len("var:dataclass(") : -1]
    out: Layout = []
    depth, start = 0, 0
    for i, ch in enumerate(body + ","):
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        elif ch == "," and depth == 0:
            item = body[start:i]
            if item:
                name, _, tp = item.partition(":")
                out.append([name, tp])
            start = i + 1
    return out


def evolve(name: str, stored_fingerprint: str, layouts: list[Layout] | None, payload: Any,
           declared: str) -> tuple[list[Layout], int]:
    """The layouts of a queue whose dataclass payload changed, and the index of the new
    class's own (appended unless an earlier layout is the same), or ``SchemaMismatch``.

    Compatible (SPEC Q36): adding a field with a default or ``default_factory``, removing
    a field.  Not: changing a field's type (against any layout that had the field), adding
    a field without a default, or changing the payload's kind."""
    new_fp = _var_fingerprint(payload) if dataclasses.is_dataclass(payload) else None
    stored = layout_from_fingerprint(stored_fingerprint)
    if new_fp is None or stored is None:
        raise SchemaMismatch(
            f"queue {name!r} stores payload schema {stored_fingerprint} but was declared with "
            f"{declared}; declare the original payload type (or use a new queue name)"
        )
    history = layouts if layouts else [stored]
    new = layout_of(payload)
    current = {fname: tp for fname, tp in stored}
    defaults = {f.name for f in dataclasses.fields(payload)
                if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}
    for fname, tp in new:
        for layout in history:
            old = next((t for n, t in layout if n == fname), None)
            if old is not None and old != tp:
                raise SchemaMismatch(
                    f"queue {name!r}: payload schema changed incompatibly: field {fname!r} of "
                    f"{payload.__name__} was stored as {old} and is now {tp}; declare the original payload "
                    f"type, or add a new field instead of changing a field's type"
                )
        if fname not in current and fname not in defaults:
            raise SchemaMismatch(
                f"queue {name!r}: payload schema changed incompatibly: field {fname!r} was added to "
                f"{payload.__name__} without a default, so rows stored before cannot be read; declare the "
                f"original payload type, or give the field a default or a default_factory"
            )
    if new in history:
        return history, history.index(new)
    if len(history) >= MAX_LAYOUTS:
        raise SchemaMismatch(f"queue {name!r} has had {MAX_LAYOUTS} payload layouts; use a new queue name")
    return [*history, new], len(history)


def _rebuilds_plainly(cls: type) -> bool:
    """Whether ``cls(*field_values)`` can only set the fields (see ``VarCodec``)."""
    if hasattr(cls, "__post_init__") or not cls.__dataclass_params__.init:  # type: ignore[attr-defined]
        return False
    names = []
    for f in dataclasses.fields(cls):
        if not f.init:
            return False
        names.append(f.name)
    try:
        params = list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):
        return False
    return [p.name for p in params] == names and all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)


# A declared payload type as the outer msgpack type its bodies must have (a tuple is
# stored as an array); a type not here is checked by decoding.
_BODY_KINDS: dict[Any, int] = {dict: _plain.KIND_MAP, list: _plain.KIND_ARRAY, tuple: _plain.KIND_ARRAY,
                               str: _plain.KIND_STR, bytes: _plain.KIND_BIN, int: _plain.KIND_INT,
                               float: _plain.KIND_FLOAT, bool: _plain.KIND_BOOL}


def _is_instance(value: Any, tp: type) -> bool:
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, float)
    return isinstance(value, tp)
