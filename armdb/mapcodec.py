"""How a map stores its keys and values (SPEC D3, S9): the codec of a Bitcask map record.

Keys are ``bytes``, ``str`` or ``int`` and keep their type: ``1``, ``"1"`` and
``b"1"`` are three different keys.  On disk a key is one type tag byte followed by
its bytes:

======  =====================================================================
tag     body
======  =====================================================================
``b``   the bytes as given
``s``   the string as UTF-8
``i``   the int as big-endian two's complement in ``(bit_length + 8) // 8``
        bytes (so every int, negative or beyond 64 bits, has one encoding)
======  =====================================================================

``bool`` is refused as a key (it would silently become ``1``/``0``), as are
``bytearray`` and other types.  Values are any object msgpack can encode
(``use_bin_type=True``) and decode back; they decode with ``raw=False,
strict_map_key=False``, so tuples come back as lists.

A format module: the map handle (armdb.maps), the transaction builder, log replay and
check all encode or decode map records through it.
"""

from __future__ import annotations

from typing import Any

import msgpack

from ._core.plainpack import pack_plain
from ._pack import check_round_trip, packb
from .errors import CorruptionError, PayloadTypeError

__all__ = ["Key", "decode_key", "decode_value", "encode_key", "encode_value"]

Key = bytes | str | int

_TAG_BYTES = 0x62  # b"b"
_TAG_STR = 0x73  # b"s"
_TAG_INT = 0x69  # b"i"


def encode_key(key: object) -> bytes:
    """Encode a map key as its type tag byte followed by its bytes.

    Parameters
    ----------
    key : bytes, str or int

    Returns
    -------
    bytes

    Raises
    ------
    PayloadTypeError
        For any other type (``bool``, ``bytearray``, ``float``, ...), or a string
        that is not valid Unicode (lone surrogates).
    """
    # Exact types only: bool (an int subclass) or an IntEnum would not come back as put.
    if type(key) is str:
        try:
            return b"s" + key.encode("utf-8")
        except UnicodeEncodeError as e:
            raise PayloadTypeError(f"map key {key!r} is not valid Unicode ({e.reason})") from None
    if type(key) is int:
        return b"i" + key.to_bytes((key.bit_length() + 8) // 8, "big", signed=True)
    if type(key) is bytes:
        return b"b" + key
    raise PayloadTypeError(f"map keys are bytes, str or int, not {type(key).__name__}")


def decode_key(raw: bytes) -> Key:
    """Decode a key produced by :func:`encode_key`.

    Raises
    ------
    PayloadTypeError
        If ``raw`` does not start with a known type tag, or a str key is not UTF-8.
    """
    tag = raw[0] if raw else -1
    if tag == _TAG_BYTES:
        return raw[1:]
    if tag == _TAG_STR:
        try:
            return raw[1:].decode("utf-8")
        except UnicodeDecodeError as e:
            raise PayloadTypeError(f"stored map key {raw[:16]!r} is not valid UTF-8 ({e.reason}); "
                                   f"is this a map collection?") from None
    if tag == _TAG_INT:
        return int.from_bytes(raw[1:], "big", signed=True)
    raise PayloadTypeError(f"stored map key {raw[:16]!r} has an unknown type tag; is this a map collection?")


def encode_value(value: object) -> bytes:
    """Serialise a map value with msgpack.

    Raises
    ------
    PayloadTypeError
        If msgpack cannot encode the value (an arbitrary object, an int beyond
        64 bits, ...) or could not decode it back (a tuple dict key).
    """
    got = pack_plain([value])  # a plain value (the common one): packed and vouched for in one pass
    if got is not None:
        return got[0]  # type: ignore[no-any-return]
    try:
        raw = packb(value)
    except (TypeError, ValueError, OverflowError) as e:
        raise PayloadTypeError(
            f"map value of type {type(value).__name__} cannot be serialised with msgpack ({e}); "
            f"store dicts, lists, str, bytes, numbers, bools or None"
        ) from None
    check_round_trip(value, raw, "map value")
    return raw


def decode_value(raw: bytes) -> Any:
    """Deserialise a value produced by :func:`encode_value`.

    Raises
    ------
    CorruptionError
        The stored bytes do not decode: they passed their CRC, so they were written as
        they are, by something other than :meth:`Map.put` (or by an armdb that still
        accepted dict keys msgpack cannot read back).
    """
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as e:  # noqa: BLE001 - msgpack's errors are ValueErrors, TypeErrors and its own
        raise CorruptionError(
            f"a stored map value ({len(raw)} bytes) cannot be decoded ({type(e).__name__}: {e}); "
            f"put a new value under its key or delete it"
        ) from None
