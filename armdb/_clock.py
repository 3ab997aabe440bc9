"""The clock seam (SPEC D7): wall-clock milliseconds, the value armdb persists."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from ._core.qshard import wall_ms
from .errors import ConfigError

Clock = Callable[[], int]


# The default clock: milliseconds since the Unix epoch, ``time.time_ns() // 1_000_000``
# read with one C call (clock_gettime(CLOCK_REALTIME)); every queue operation reads it.
system_clock: Clock = wall_ms


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


def ms_to_datetime(ms: int) -> datetime:
    """Persisted milliseconds as a timezone-aware UTC datetime."""
    return datetime.fromtimestamp(ms / 1000, tz=UTC)
