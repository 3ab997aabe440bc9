"""armdb: embedded, crash-safe storage with a durable work queue.

Everything public is importable from here; exceptions also from ``armdb.errors``.
"""

from __future__ import annotations

try:
    from ._core import fixed as _fixed_kernels  # noqa: F401
except ImportError as _e:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "armdb's compiled extension (armdb._core) is missing or was built for another Python. "
        "Build it with `make build` (or `pip install -e .` in the repository, or "
        "`python setup.py build_ext --inplace`)."
    ) from _e

from . import errors
from .check import CheckReport, check
from ._fail import failpoints
from .config import Config, FixedConfig, QueueConfig, TxConfig
from .db import Db
from .queue import Lease, LeaseToken, Queue, QueueSpec, QueueStats, State, queue
from .errors import (
    ArmdbError,
    ConfigError,
    CorruptionError,
    DbClosed,
    DbLocked,
    EncryptionKeyRequired,
    FormatError,
    PayloadTypeError,
    QueueAlreadyOpen,
    QueueFull,
    SchemaMismatch,
    StaleToken,
    StorageError,
    StreamSourceRequiresTx,
    TxFailedAfterLog,
    WrongKey,
)

__version__ = "0.1.0"

__all__ = [
    "ArmdbError",
    "CheckReport",
    "Config",
    "ConfigError",
    "CorruptionError",
    "Db",
    "DbClosed",
    "DbLocked",
    "EncryptionKeyRequired",
    "FixedConfig",
    "FormatError",
    "PayloadTypeError",
    "QueueAlreadyOpen",
    "QueueConfig",
    "QueueFull",
    "SchemaMismatch",
    "StaleToken",
    "StorageError",
    "StreamSourceRequiresTx",
    "TxConfig",
    "TxFailedAfterLog",
    "WrongKey",
    "Lease",
    "LeaseToken",
    "Queue",
    "QueueSpec",
    "QueueStats",
    "State",
    "errors",
    "failpoints",
    "queue",
]
