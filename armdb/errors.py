"""Every exception armdb raises on purpose (SPEC section 6).

One module shared by the pure-Python layer and the Cython kernels (the kernels
return status codes; their Python wrappers map them to these classes).  Each
message says what happened and what to do about it.
"""

from __future__ import annotations

__all__ = [
    "ArmdbError",
    "ConfigError",
    "CorruptionError",
    "DbClosed",
    "DbLocked",
    "EncryptionKeyRequired",
    "FormatError",
    "KeyFileError",
    "NotALease",
    "PayloadTypeError",
    "ProcessBound",
    "QueueAlreadyOpen",
    "QueueFull",
    "ReadOnly",
    "ReplicaMismatch",
    "ReplicationError",
    "ReplicationFrameError",
    "SchemaMismatch",
    "ServerGone",
    "StaleToken",
    "StorageError",
    "StreamSourceRequiresTx",
    "TxFailedAfterLog",
    "WrongKey",
]


class ArmdbError(Exception):
    """Base class of every error armdb raises on purpose."""


class DbLocked(ArmdbError):
    """The database directory is locked by another open ``Db`` (this or another process)."""

    def __init__(self, path: str, pid: int | None) -> None:
        self.path = path
        self.pid = pid
        owner = f"process {pid}" if pid else "another process (pid unknown)"
        super().__init__(
            f"database {path!r} is already open by {owner}; close that Db first "
            f"(a crashed owner releases the lock automatically)"
        )


class DbClosed(ArmdbError):
    """An operation was attempted on a closed or shut-down ``Db``."""

    def __init__(self, what: str = "this Db") -> None:
        super().__init__(f"{what} is closed; open the database again with armdb.Db.open(path)")


class ServerGone(DbClosed):
    """A client (``armdb.connect``) finds no serving owner: none listens on the socket, the
    owner exited or crashed, it did not answer within the client's timeout, or the client
    was closed.  A ``DbClosed``, so code written for a direct ``Db`` handles it the same."""

    def __init__(self, message: str) -> None:
        ArmdbError.__init__(self, message)


class ConfigError(ArmdbError, ValueError):
    """A configuration value or an argument is invalid."""


class FormatError(ArmdbError):
    """A file has an unknown magic number or an unsupported format version."""


class SchemaMismatch(ArmdbError):
    """A queue was reopened with an incompatible payload schema or flavour."""


class QueueAlreadyOpen(ArmdbError):
    """The same queue was opened twice in one ``Db``."""


class QueueFull(ArmdbError):
    """A push would take a queue above its ``max_depth``."""


class StaleToken(ArmdbError):
    """A lease token no longer matches its row (re-leased, settled, other queue, or old open)."""


class PayloadTypeError(ArmdbError, TypeError):
    """A payload does not match the queue's declared payload type."""


class ProcessBound(ArmdbError, TypeError):
    """A ``Db``, ``Queue`` or ``Map`` handle was pickled (to send it to another process):
    a handle belongs to the process that opened it."""


class NotALease(ArmdbError, TypeError):
    """``ack``, ``nack`` or a transaction's settle was given something other than a
    ``Lease`` or its ``LeaseToken`` (a wrong argument, never reported as ``StaleToken``)."""


class KeyFileError(ConfigError):
    """A key file given to the command line (``--key-file``, ``--log-key-file``) cannot be
    read or does not hold a 32-byte key."""


class EncryptionKeyRequired(ArmdbError):
    """An encrypted collection or transaction log was used without its key."""


class WrongKey(ArmdbError):
    """The encryption key given does not match the key the collection was created with."""


class CorruptionError(ArmdbError):
    """Stored bytes fail their checksum or authentication tag."""


class StorageError(ArmdbError, OSError):
    """An I/O operation failed; after a failed sync the collection refuses writes until reopen."""


class TxFailedAfterLog(ArmdbError):
    """A transaction was logged but applying it failed; the next open replays it."""


class StreamSourceRequiresTx(ArmdbError):
    """A change-stream source map was written outside ``db.tx()``."""



class ReadOnly(ArmdbError):
    """A write reached a database that only follows a primary (R2): write to the primary,
    or promote the follower first."""


class ReplicationError(ArmdbError):
    """Replication could not start or go on: the address does not answer as an armdb
    primary, or the follower's directory is not a follower."""


class ReplicaMismatch(ReplicationError):
    """The primary is another database than the one this follower copies (its ``db.meta``
    identity differs)."""


class ReplicationFrameError(ReplicationError, CorruptionError):
    """A replication frame failed its CRC, its length, its version or its sequence; nothing
    of it was applied."""

# -- raised when armdb's own bookkeeping breaks ---------------------------------------------------
# Never caused by bad input, so not in __all__ (tests/reliability/test_bad_input.py gives every
# class there a bad input).  The kernels return status codes; one function per kernel module
# (e.g. armdb._core.qindex.raise_status) turns them into these, MemoryError for memory.


class InternalError(ArmdbError, RuntimeError):
    """armdb's in-memory bookkeeping broke one of its own rules (a bug in armdb).  Reopen the
    database; ``armdb.check`` says whether the files are sound."""


class IndexConflict(InternalError, KeyError):
    """A queue index was asked to add a key it already holds (a row id handed out twice)."""

    __str__ = BaseException.__str__  # a message, not KeyError's repr of its argument


def as_storage_error(e: OSError, what: str) -> OSError:
    """``e`` itself if it is already an armdb error, else a ``StorageError`` that says
    what failed, chained to ``e``.  Use as ``raise as_storage_error(e, ...)`` (no
    ``from``: chaining an exception to itself makes a cycle)."""
    if isinstance(e, ArmdbError):
        return e
    err = StorageError(
        e.errno or 5,
        f"{what} failed: {e.strerror or e}"
        + (f" ({e.filename})" if e.filename else "")
        + "; check the disk, its free space and permissions, then try again",
    )
    err.__cause__ = e
    return err


# What an S7 refusal (a bad record with valid ones after it) adds to "restore from a backup".
SALVAGE_HINT = (
    "After a power loss without durable() or fsync, unsynced writes can reach the disk out of order "
    "and leave exactly this; 'python -m armdb salvage DIR' then cuts the file at the bad record and "
    "keeps the cut bytes (docs/operations.md, Salvage)"
)
