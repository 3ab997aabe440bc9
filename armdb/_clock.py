"""The clock seam (SPEC D7): wall-clock milliseconds, the value armdb persists."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from ._core.qshard import wall_ms
from .errors import ConfigError

Clock = Callable[[], int]


# The default clock: milliseconds since the Unix epoch, ``time.time_ns() // 1_000_000``
# read with one C call (clock_gettime(CLOCK_REALTIME)); every queue operation reads it.
system_clock: Clock = wall_ms

#: What a clock given to ``Db.open`` may return: integer milliseconds since the Unix
#: epoch from 2000-01-01 up to 2200-01-01 (UTC).  A clock in seconds or microseconds,
#: a negative number, a float, ``None`` or a string falls outside and is refused.
MIN_CLOCK_MS = 946_684_800_000
MAX_CLOCK_MS = 7_258_118_400_000


def checked_clock(clock: Callable[[], object]) -> Clock:
    """Wrap a user's clock so that every reading is plausible milliseconds (an ``int``).

    A reading of another type, or outside 2000-01-01 .. 2200-01-01, raises
    ``ConfigError`` at the call that made it, before anything is written with it.
    The check is one type test and two comparisons per reading (the default
    ``system_clock`` is not wrapped).  Integer types other than ``int`` (numpy
    integers) are converted; floats are refused even when integral, so a clock's
    readings are accepted or refused by their type, never by their value's luck.
    """

    def read() -> int:
        ms = clock()
        if ms.__class__ is int and MIN_CLOCK_MS <= ms < MAX_CLOCK_MS:
            return ms
        return _slow_check(ms)

    read.__wrapped__ = clock  # type: ignore[attr-defined]
    return read


def _slow_check(ms: object) -> int:
    """The reading was not a plausible ``int``: convert another integer type, or refuse."""
    n: int | None = None
    if not isinstance(ms, (bool, float)):
        try:
            n = operator.index(ms)  # type: ignore[arg-type]
        except TypeError:
            n = None
    if n is not None and MIN_CLOCK_MS <= n < MAX_CLOCK_MS:
        return n
    hint = ""
    if isinstance(ms, float) and math.isfinite(ms) and MIN_CLOCK_MS <= ms < MAX_CLOCK_MS:
        hint = "; return an int, e.g. int(time.time() * 1000)"
    elif n is not None and MIN_CLOCK_MS <= n // 1000 < MAX_CLOCK_MS:
        hint = "; this looks like microseconds: divide by 1000"
    elif n is not None and MIN_CLOCK_MS <= n * 1000 < MAX_CLOCK_MS:
        hint = "; this looks like seconds: multiply by 1000"
    raise ConfigError(
        f"the clock returned {ms!r} ({type(ms).__name__}); a clock must return wall-clock "
        f"milliseconds since the Unix epoch as an int from {MIN_CLOCK_MS} (2000-01-01) up to "
        f"{MAX_CLOCK_MS} (2200-01-01), like time.time_ns() // 1_000_000{hint}"
    )


def to_seconds(value: object, name: str) -> float:
    """A duration given as ``timedelta`` or seconds (int/float) as float seconds."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ConfigError(f"{name} must be a finite number of seconds, got {value!r}")
        return float(value)
    raise ConfigError(f"{name} must be a datetime.timedelta or a number of seconds, not {type(value).__name__}")


def to_ms(value: object, name: str) -> int:
    """A duration as whole milliseconds (rounded to nearest)."""
    return int(round(to_seconds(value, name) * 1000))


# The last millisecond ms_to_datetime can give: 9999-12-31 23:59:59.999 UTC.
MAX_DATETIME_MS = 253_402_300_799_999


def ms_to_datetime(ms: int) -> datetime:
    """Persisted milliseconds as a timezone-aware UTC datetime."""
    return datetime.fromtimestamp(ms / 1000, tz=UTC)
