"""``packb`` for the hot paths: one reusable ``msgpack.Packer`` per thread.

``msgpack.packb`` builds a new ``Packer`` on every call, which costs more than
packing a 100-byte payload (0.8 us against 0.35 us on the CI machine).  A Packer
keeps a buffer, so it is not shared between threads; it resets that buffer when a
value fails to pack, so an error leaves it ready for the next call.

``check_round_trip`` is the one check every write path (queue push, map put, their
``db.tx()`` steps, change streams) runs on a value before storing it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from ._core.plain import reads_back_one
from .errors import PayloadTypeError

_tls = threading.local()


def _plain(obj: Any) -> Any:
    """msgpack's ``default``: a NumPy bool, int, float, bytes or str scalar is stored as
    its Python value (a lease gives that back); anything else stays unstorable."""
    if isinstance(obj, np.generic) and obj.dtype.kind in "biufSU":
        return obj.item()
    raise TypeError(f"can not serialize {type(obj).__name__!r} object")


def packer() -> msgpack.Packer:
    """This thread's packer (what :func:`packb` packs with): a batch binds its ``pack``
    once instead of looking it up per value."""
    try:
        return _tls.packer
    except AttributeError:
        p = _tls.packer = msgpack.Packer(use_bin_type=True, default=_plain)
        return p


def packb(obj: Any) -> bytes:
    """``msgpack.packb(obj, use_bin_type=True)``, NumPy scalars taken as their Python value."""
    try:
        packer = _tls.packer
    except AttributeError:
        packer = _tls.packer = msgpack.Packer(use_bin_type=True, default=_plain)
    return packer.pack(obj)  # type: ignore[no-any-return]


def decodes_all(raws: list[bytes]) -> bool:
    """True if every one of ``raws`` decodes as the readers decode it: one msgpack decode
    of them all as one array, for :func:`check_round_trip` of a batch of plain values
    (for which the decode is the whole check).  False says some value does not: check
    them one by one to learn which and why."""
    try:
        unpackb(b"\xdd" + len(raws).to_bytes(4, "big") + b"".join(raws))
    except Exception:  # noqa: BLE001 - whatever msgpack raises, some value is refused
        return False
    return True


def unpackb(raw: bytes) -> Any:
    """Decode stored msgpack as every reader does (tuples come back as lists)."""
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)


_SCALARS = frozenset({bytes, str, int, float, bool, type(None)})
_KEY_RULE = (
    "dict keys must be str, int, bytes, float, bool or None to be read back (msgpack stores a "
    "tuple key as a list, which cannot be a dict key again)"
)


def check_round_trip(value: Any, raw: bytes, what: str, rebuild: Callable[[Any], Any] | None = None,
                     reencode: Callable[[Any], bytes] | None = None) -> None:
    """Refuse ``value`` (encoded as ``raw``) unless the readers can decode it back.

    msgpack writes some values it cannot read: a tuple dict key is stored as an array,
    and an array cannot be a key when read back.  Stored, such a value would fail every
    later read (a queue's lease, a map's ``items()``), so every write path calls this
    before it writes anything.  ``rebuild`` turns the decoded object into the value a
    reader gets (a dataclass payload: ``cls(*fields)``, which runs ``__post_init__``) and
    ``reencode`` encodes that again: it must give ``raw`` back.

    For plain msgpack types only the decode runs, and not at all for a scalar: once
    msgpack decodes them they encode to the same bytes (tuples become lists, as
    documented), so a comparison would find nothing and double the cost.  Nor for
    exact dicts, lists and tuples of scalars without a container key, which a compiled
    walk recognises (``armdb._core.plain``): their decode cannot fail.

    Raises
    ------
    PayloadTypeError
        Saying what cannot be read back (for a tuple key, where it is).
    """
    if rebuild is None and (type(value) in _SCALARS or reads_back_one(value)):
        return  # (reads_back_one: plain containers of scalars, which the decode cannot refuse)
    try:
        back = unpackb(raw)
    except Exception as e:  # noqa: BLE001 - whatever msgpack raises, the value is refused
        bad = _find_bad_key(value, what, 0)
        if bad is not None:
            raise PayloadTypeError(f"{_KEY_RULE}: {bad}") from None
        raise PayloadTypeError(
            f"{what} cannot be read back once stored ({type(e).__name__}: {e}); store dicts with str, int "
            f"or bytes keys, lists, str, bytes, numbers, bools or None"
        ) from None
    if rebuild is None:
        return
    try:
        obj = rebuild(back)
    except Exception as e:  # noqa: BLE001 - the user's class refused its own stored fields
        raise PayloadTypeError(
            f"{what} {_short(value)} cannot be rebuilt from its stored fields: "
            f"{type(e).__name__}: {e}. Fields are stored with msgpack, so tuples come back as lists, and "
            f"fields declared with init=False cannot be passed back to the class"
        ) from None
    try:
        again = raw if reencode is None else reencode(obj)
    except Exception as e:  # noqa: BLE001 - e.g. __post_init__ set a field msgpack cannot encode
        raise PayloadTypeError(
            f"{what} {_short(value)} does not read back as it was written: it reads back as {_short(obj)}, "
            f"which cannot be encoded again ({type(e).__name__}: {e})"
        ) from None
    if again != raw:
        raise PayloadTypeError(
            f"{what} {_short(value)} does not read back as it was written: it reads back as {_short(obj)} "
            f"(does __post_init__ change a field every time it runs?)"
        )


def _short(obj: Any) -> str:
    r = repr(obj)
    return r if len(r) <= 80 else r[:77] + "..."


def _find_bad_key(obj: Any, path: str, depth: int) -> str | None:
    """Where ``obj`` holds a dict key msgpack cannot read back, as ``path['a'][1] has the key (1, 2)``."""
    if depth > 600:  # deeper than msgpack packs
        return None
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(k, (list, tuple, dict)):
                return f"{path} has the key {_short(k)}"
            found = _find_bad_key(v, f"{path}[{_short(k)}]", depth + 1)
            if found is not None:
                return found
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            found = _find_bad_key(v, f"{path}[{i}]", depth + 1)
            if found is not None:
                return found
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            found = _find_bad_key(getattr(obj, f.name, None), f"{path}.{f.name}", depth + 1)
            if found is not None:
                return found
    return None
