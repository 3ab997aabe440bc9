"""Configuration builders (SPEC S5, S9, Q4-Q7, T3-T4).

Builders are frozen dataclasses: every setter returns a new builder and only
records the value; ``build()`` validates everything at once and returns a frozen
config.  Durations accept a ``timedelta`` or seconds as ``int``/``float``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ._clock import to_seconds
from .errors import ConfigError

__all__ = [
    "QUEUE_GROW_STEP",
    "Config",
    "ConfigBuilder",
    "FixedConfig",
    "FixedConfigBuilder",
    "QueueConfig",
    "QueueConfigBuilder",
    "TxConfig",
]

QUEUE_GROW_STEP = 100_000
MAX_ATTEMPTS = 0xFFFF
MIN_FILE_SIZE = 64 * 1024
KEY_LEN = 32
# The most shards a collection can have: checked when a config is built and when a meta
# file is read, so a damaged or hostile meta file cannot make open create and map
# thousands of shard files (docs/format.md).
MAX_SHARD_COUNT = 256


def _int(value: object, name: str, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name} must be an int, not {type(value).__name__}")
    if value < minimum:
        raise ConfigError(f"{name} must be at least {minimum}, got {value}")
    return value


def _shards(value: object) -> int | None:
    if value is None:
        return None
    n = _int(value, "shard_count", 1)
    if n > MAX_SHARD_COUNT:
        raise ConfigError(f"shard_count must be at most {MAX_SHARD_COUNT}, got {n}")
    return n


def _bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, not {value!r}")
    return value


def _key(value: object, name: str) -> bytes | None:
    if value is None:
        return None
    if not isinstance(value, (bytes, bytearray)) or len(value) != KEY_LEN:
        raise ConfigError(f"{name} must be {KEY_LEN} bytes (an AES-256 key), e.g. os.urandom(32)")
    return bytes(value)


# A map's cache of decoded values and a var queue's cache of raw bodies, per collection:
# SQLite's default page cache (2,000 KiB).  On by default: it costs no safety (a cached
# value is used only while it is its key's latest record), and without it every lease of
# a var row reads its body back from the file it was just written to (docs/tuning.md).
DEFAULT_CACHE_BYTES = 2000 * 1024


# -- FixedStore -------------------------------------------------------------------


@dataclass(frozen=True)
class FixedConfig:
    """Validated FixedStore settings (S5).  ``shard_count=None`` means "the stored count"."""

    shard_count: int | None = None
    grow_step: int = 4096
    sync_interval: float = 0.05
    enable_fsync: bool = True
    reversed: bool = False

    @staticmethod
    def balanced() -> FixedConfigBuilder:
        return FixedConfigBuilder()


@dataclass(frozen=True)
class FixedConfigBuilder:
    _values: tuple[tuple[str, Any], ...] = ()

    def _set(self, name: str, value: Any) -> FixedConfigBuilder:
        return FixedConfigBuilder(self._values + ((name, value),))

    def shard_count(self, n: int) -> FixedConfigBuilder:
        return self._set("shard_count", n)

    def grow_step(self, n: int) -> FixedConfigBuilder:
        return self._set("grow_step", n)

    def sync_interval(self, d: timedelta | float) -> FixedConfigBuilder:
        return self._set("sync_interval", d)

    def enable_fsync(self, on: bool = True) -> FixedConfigBuilder:
        return self._set("enable_fsync", on)

    def reversed(self, on: bool = True) -> FixedConfigBuilder:
        return self._set("reversed", on)

    def build(self) -> FixedConfig:
        v = dict(self._values)
        return FixedConfig(
            shard_count=_shards(v.get("shard_count")),
            grow_step=_int(v.get("grow_step", 4096), "grow_step", 1),
            sync_interval=_nonneg(v.get("sync_interval", 0.05), "sync_interval"),
            enable_fsync=_bool(v.get("enable_fsync", True), "enable_fsync"),
            reversed=_bool(v.get("reversed", False), "reversed"),
        )


def _nonneg(value: object, name: str) -> float:
    s = to_seconds(value, name)
    if s < 0:
        raise ConfigError(f"{name} must not be negative, got {s} s")
    return s


def _positive(value: object, name: str) -> float:
    s = to_seconds(value, name)
    if s < 0.001:
        raise ConfigError(f"{name} must be positive, at least 1 ms (times are kept in milliseconds), got {s} s")
    return s


# -- Bitcask ----------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """Validated Bitcask settings (S9).  ``shard_count=None`` means "the stored count"."""

    shard_count: int | None = None
    max_file_size: int = 256 * 1024 * 1024
    compaction_threshold: float = 0.3
    enable_fsync: bool = True
    sync_interval: float = 0.05
    cache_bytes: int = DEFAULT_CACHE_BYTES
    encryption_key: bytes | None = field(default=None, repr=False)

    @staticmethod
    def balanced() -> ConfigBuilder:
        return ConfigBuilder()


@dataclass(frozen=True)
class ConfigBuilder:
    _values: tuple[tuple[str, Any], ...] = ()

    def _set(self, name: str, value: Any) -> ConfigBuilder:
        return ConfigBuilder(self._values + ((name, value),))

    def shard_count(self, n: int) -> ConfigBuilder:
        return self._set("shard_count", n)

    def max_file_size(self, n: int) -> ConfigBuilder:
        return self._set("max_file_size", n)

    def compaction_threshold(self, ratio: float) -> ConfigBuilder:
        return self._set("compaction_threshold", ratio)

    def enable_fsync(self, on: bool = True) -> ConfigBuilder:
        return self._set("enable_fsync", on)

    def sync_interval(self, d: timedelta | float) -> ConfigBuilder:
        return self._set("sync_interval", d)

    def cache_bytes(self, n: int) -> ConfigBuilder:
        return self._set("cache_bytes", n)

    def encryption_key(self, key: bytes) -> ConfigBuilder:
        return self._set("encryption_key", key)

    def build(self) -> Config:
        v = dict(self._values)
        ratio = v.get("compaction_threshold", 0.3)
        if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0 < ratio <= 1:
            raise ConfigError(f"compaction_threshold must be a number in (0, 1], got {ratio!r}")
        return Config(
            shard_count=_shards(v.get("shard_count")),
            max_file_size=_int(v.get("max_file_size", 256 * 1024 * 1024), "max_file_size", MIN_FILE_SIZE),
            compaction_threshold=float(ratio),
            enable_fsync=_bool(v.get("enable_fsync", True), "enable_fsync"),
            sync_interval=_nonneg(v.get("sync_interval", 0.05), "sync_interval"),
            cache_bytes=_int(v.get("cache_bytes", DEFAULT_CACHE_BYTES), "cache_bytes", 0),
            encryption_key=_key(v.get("encryption_key"), "encryption_key"),
        )


# -- transactions -----------------------------------------------------------------


@dataclass(frozen=True)
class TxConfig:
    """Transaction settings (T3, T4): ``durable`` fsyncs the log before a commit returns.

    ``checkpoint_bytes``: once the log file grows past this many bytes, the commit that
    crosses it syncs every store and starts a fresh log file (after releasing its locks;
    other commits go on meanwhile).  Smaller means a shorter replay after a crash and
    more frequent store syncs.
    """

    durable: bool = False
    log_encryption_key: bytes | None = field(default=None, repr=False)
    checkpoint_bytes: int = 4 << 20

    def __post_init__(self) -> None:
        _bool(self.durable, "durable")
        _key(self.log_encryption_key, "log_encryption_key")
        _int(self.checkpoint_bytes, "checkpoint_bytes", 4096)


# -- queues -----------------------------------------------------------------------


@dataclass(frozen=True)
class QueueConfig:
    """Validated queue settings (Q4).  Times are stored as float seconds."""

    max_attempts: int = 5
    backoff_secs: tuple[float, ...] = (1.0, 10.0, 60.0, 300.0)
    lease_timeout: float = 30.0
    max_depth: int | None = None
    wakeup_recheck: float = 5.0
    dead_retention: float | None = None
    header_config: FixedConfig = field(
        default_factory=lambda: FixedConfig(grow_step=QUEUE_GROW_STEP)
    )
    payload_config: Config = field(default_factory=Config)

    @staticmethod
    def balanced() -> QueueConfigBuilder:
        return QueueConfigBuilder()

    def backoff_for(self, attempt: int) -> float:
        """Seconds to wait before the next delivery after ``attempt`` deliveries."""
        b = self.backoff_secs
        return b[min(max(attempt, 1) - 1, len(b) - 1)]


@dataclass(frozen=True)
class QueueConfigBuilder:
    _values: tuple[tuple[str, Any], ...] = ()

    def _set(self, name: str, value: Any) -> QueueConfigBuilder:
        return QueueConfigBuilder(self._values + ((name, value),))

    def max_attempts(self, n: int) -> QueueConfigBuilder:
        return self._set("max_attempts", n)

    def backoff_secs(self, secs: Any) -> QueueConfigBuilder:
        return self._set("backoff_secs", secs)

    def lease_timeout(self, d: timedelta | float) -> QueueConfigBuilder:
        return self._set("lease_timeout", d)

    def max_depth(self, n: int | None) -> QueueConfigBuilder:
        return self._set("max_depth", n)

    def wakeup_recheck(self, d: timedelta | float) -> QueueConfigBuilder:
        return self._set("wakeup_recheck", d)

    def dead_retention(self, d: timedelta | float | None) -> QueueConfigBuilder:
        return self._set("dead_retention", d)

    def header_config(self, cfg: FixedConfig) -> QueueConfigBuilder:
        return self._set("header_config", cfg)

    def payload_config(self, cfg: Config) -> QueueConfigBuilder:
        return self._set("payload_config", cfg)

    def build(self) -> QueueConfig:
        v = dict(self._values)
        backoff = v.get("backoff_secs", (1, 10, 60, 300))
        try:
            backoff_t = tuple(to_seconds(b, "backoff_secs item") for b in backoff)
        except TypeError:
            raise ConfigError("backoff_secs must be a list of seconds (or timedeltas)") from None
        if not backoff_t:
            raise ConfigError("backoff_secs must not be empty; give at least one delay, e.g. [1, 10, 60]")
        if any(b < 0 for b in backoff_t):
            raise ConfigError(f"backoff_secs must not hold negative delays, got {list(backoff_t)}")
        depth = v.get("max_depth")
        if depth is not None:
            depth = _int(depth, "max_depth", 1)
        retention = v.get("dead_retention")
        if retention is not None:
            retention = _positive(retention, "dead_retention")
        header = v.get("header_config", FixedConfig(grow_step=QUEUE_GROW_STEP))
        if not isinstance(header, FixedConfig):
            raise ConfigError("header_config takes a built FixedConfig: FixedConfig.balanced()...build()")
        payload = v.get("payload_config", Config())
        if not isinstance(payload, Config):
            raise ConfigError("payload_config takes a built Config: Config.balanced()...build()")
        attempts = _int(v.get("max_attempts", 5), "max_attempts", 1)
        if attempts > MAX_ATTEMPTS:
            raise ConfigError(f"max_attempts must be at most {MAX_ATTEMPTS} (a u16 in the row header), got {attempts}")
        return QueueConfig(
            max_attempts=attempts,
            backoff_secs=backoff_t,
            lease_timeout=_positive(v.get("lease_timeout", 30.0), "lease_timeout"),
            max_depth=depth,
            wakeup_recheck=_positive(v.get("wakeup_recheck", 5.0), "wakeup_recheck"),
            dead_retention=retention,
            # Queues must lease the earliest due row first (Q5).
            header_config=dataclasses.replace(header, reversed=False),
            payload_config=payload,
        )
