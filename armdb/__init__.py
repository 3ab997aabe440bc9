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
from ._fail import failpoints
from ._version import __version__ as __version__
from .check import CheckReport, check
from .client import Client, connect
from .config import Config, FixedConfig, QueueConfig, TxConfig
from .db import Db
from .errors import (
    ArmdbError,
    ConfigError,
    CorruptionError,
    DbClosed,
    DbLocked,
    EncryptionKeyRequired,
    FormatError,
    KeyFileError,
    NotALease,
    PayloadTypeError,
    ProcessBound,
    QueueAlreadyOpen,
    QueueFull,
    ReadOnly,
    ReplicaMismatch,
    ReplicationError,
    ReplicationFrameError,
    SchemaMismatch,
    ServerGone,
    StaleToken,
    StorageError,
    StreamSourceRequiresTx,
    TxFailedAfterLog,
    WrongKey,
)
from .queue import Job, Lease, LeaseBatch, LeaseToken, Queue, QueueSpec, QueueStats, State, queue
from .salvage import Cut, SalvageReport, salvage
from .streams import Change, SchemaRegistry
from .worker import Worker

__all__ = [
    "ArmdbError",
    "Change",
    "CheckReport",
    "check",
    "Client",
    "connect",
    "Config",
    "ConfigError",
    "CorruptionError",
    "Cut",
    "Db",
    "DbClosed",
    "DbLocked",
    "EncryptionKeyRequired",
    "FixedConfig",
    "FormatError",
    "Job",
    "KeyFileError",
    "Lease",
    "LeaseBatch",
    "LeaseToken",
    "NotALease",
    "PayloadTypeError",
    "ProcessBound",
    "Queue",
    "QueueAlreadyOpen",
    "QueueConfig",
    "QueueFull",
    "QueueSpec",
    "QueueStats",
    "ReadOnly",
    "ReplicaMismatch",
    "ReplicationError",
    "ReplicationFrameError",
    "SalvageReport",
    "SchemaMismatch",
    "ServerGone",
    "StaleToken",
    "SchemaRegistry",
    "State",
    "StorageError",
    "StreamSourceRequiresTx",
    "TxConfig",
    "TxFailedAfterLog",
    "Worker",
    "WrongKey",
    "errors",
    "failpoints",
    "queue",
    "salvage",
]
