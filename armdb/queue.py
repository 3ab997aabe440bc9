"""Durable work queues (SPEC section 4, rules Q1-Q28).

A queue is two physical collections: ``<name>`` (a FixedStore of headers, one slot
per row) and, for a var queue, ``<name>.payload`` (a Bitcask store of msgpack
bodies keyed by the row id).  A slot body is the 16-byte row key followed by the
32-byte header and, for a fixed queue, the inline payload (layout in
docs/format.md).

Row key: ``due_ms: u64 BE`` then ``seq: u64 BE``; dead rows set bit 63 of the
first word (``DEAD_BIT | dead_at_ms``), so their key class sorts after every live
row.  Each shard is an ``armdb._core.qshard.QueueShard``: the FixedStore shard's
slots and two ordered indexes (``armdb._core.qindex.KeyIndex``), ``live`` (ready,
delayed and leased rows, with the lease deadline of each leased row) and ``dead``,
with push, claim and ack of one row compiled.

The row format is ``armdb.qrows``; every rule that changes a row (push, lease, nack,
dead-letter, retention) is ``armdb.transitions``, whose definitions the compiled claim
runs too.  ``db.tx()`` reaches a queue through the methods under "what a db.tx() commit
calls" below; the layers are in docs/architecture.md.

Lock policy: one lock per shard (``FixedShard.lock``) guards that shard's slots,
its indexes and its counters.  The lease scan runs under the shard lock, with the
GIL released while leases may have to be skipped; it skips unexpired leases without
creating a Python object.  With one shard the scan and the claims happen under one
hold of the lock; with several, the candidates of every shard are merged in key
order and each is claimed in a second short critical section that looks the row up
again and re-checks its state and visibility, so a row is never handed to two
callers.  A push to a var queue writes the body (the payload
store has its own locks) before it takes the shard lock to publish the header.
``Queue._cond`` (a Condition on its own lock) serves blocking waiters; it is
never held together with a shard lock.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import html
import itertools
import logging
import os
import threading
import time
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

import numpy as np

from . import _fail, _fs, transitions
from ._clock import MAX_DATETIME_MS, ms_to_datetime, system_clock, to_ms, to_seconds
from ._core.bodycache import cache_drop, cache_pop, cache_put_ids, longest
from ._core.fixed import ack_rows, log_record, push_body_rows, ring_next
from ._core.locks import Lock
from ._core.qindex import KeyIndex
from ._core.qshard import ABSENT, ACKED, DUPLICATE, FixedFast, QueueShard, VarFast
from ._objdict import install_own_dict, own_dict
from ._pack import packb
from .bitcask.format import MAX_VALUE_LEN
from .config import QueueConfig
from .errors import (
    ConfigError,
    CorruptionError,
    DbClosed,
    EncryptionKeyRequired,
    FormatError,
    NotALease,
    PayloadTypeError,
    ProcessBound,
    QueueAlreadyOpen,
    QueueFull,
    SchemaMismatch,
    StaleToken,
    as_storage_error,
)
from .fixed import DELETED, HEADER_PAGE, OCCUPIED, FixedStore
from .layout import QUEUE_META
from .logformat import FLAG_SYNCED_BEFORE, REC_MAGIC
from .qrows import (
    DEAD_BIT,
    HEADER_SIZE,
    KEY_SIZE,
    MAX_DUE_MS,
    ROW_DTYPE,
    ROW_SIZE,
    State,
    body_key,
    encode_meta,
    row_problems,
    rows_of,
    to_snapshot,
)
from .qrows import decode_meta as _decode_meta
from .qspec import FixedCodec, QueueSpec, VarCodec, evolve, queue

if TYPE_CHECKING:
    from .bitcask.store import BitcaskStore
    from .db import Db
    from .plan import Plan

log = logging.getLogger("armdb")

T = TypeVar("T")

class Commits(NamedTuple):
    """The logged commits a queue runs, handed in by ``Db.open_queue`` (armdb.tx sits above
    this module): ``settle(db, queue, token, ack, delay_ms=None, dead=False, poisoned=False)``,
    a var queue's ack or nack (``armdb.tx.commit_settle``), and ``dead_rows(db, queue, ids,
    redrive, delay_ms) -> int``, a redrive or purge of dead rows (``armdb.tx.commit_dead_rows``), and
    ``batch(db, queue, args)``, a ``push_many`` (``armdb.tx.commit_batch``), ``fence``, the
    failure handling after a log append that every commit shares
    (``armdb.tx._fence_after_log``), for the lone var ack that ``VarFast.ack`` commits, and
    ``ack_many(db, queue, shard_nos, dues, seqs, epochs, cached) -> int``, an ``ack_many``
    (``armdb.tx.commit_ack_many``)."""

    settle: Callable[..., None]
    dead_rows: Callable[..., int]
    batch: Callable[..., Any]
    fence: Callable[..., BaseException]
    ack_many: Callable[..., int]

# Handle identities are unique across processes, not just within one: a random
# per-process prefix, so a token carried over from a killed process (pickled, or
# held by a long-lived peer) never matches a handle of the next process (Q13).
_PROCESS_TAG = int.from_bytes(os.urandom(8), "big")
_handle_ids = itertools.count(1)

MAX_LEASE = 1_000_000  # rows one lease(n) call may ask for (docs/guide.md)
MAX_REMEMBERED = 100_000  # leases with their own timeout that extend() remembers per handle
RETRY_LIST_CAP = 1024
SWEEP_PERIOD = 1.0


# -- leases ----------------------------------------------------------------------------------


class LeaseToken(NamedTuple):
    """Proof of one lease: bound to the handle, the row key and the lease epoch (Q13).

    Immutable and hashable; a NamedTuple because the hot path creates one per lease.
    """

    handle: int
    shard: int
    due: int
    seq: int
    epoch: int


class Lease(NamedTuple, Generic[T]):
    """One leased row (Q11): ``id``, ``payload``, ``attempt`` (1 for the first
    delivery), ``deadline`` (UTC) and ``token``."""

    id: int
    payload: T
    attempt: int
    deadline: datetime
    token: LeaseToken


class Job(NamedTuple, Generic[T]):
    """One row as :meth:`Queue.peek` reads it (Q33): ``id``, ``state``
    (:class:`State`), ``attempts``, ``due`` (UTC; for a dead row, when it was
    dead-lettered) and ``payload`` (decoded; for a var row whose body cannot be decoded,
    a poisoned one, its raw bytes)."""

    id: int
    state: State
    attempts: int
    due: datetime
    payload: T


def lease_deadline(now: int, ms: int, given: object, name: str) -> int:
    """The deadline ``ms`` after ``now`` (a lease's, an extension's), or ``ConfigError``
    past the last one a ``Lease`` can carry: its ``deadline`` is a ``datetime``."""
    deadline = now + ms
    if deadline > MAX_DATETIME_MS:
        raise ConfigError(f"{name} reaches past the latest deadline armdb gives (the end of the year 9999), got {given!r}")
    return deadline


_U64 = (1 << 64) - 1  # the largest due or seq a token can carry
_U32 = (1 << 32) - 1  # the largest epoch


def as_token(lease: object) -> LeaseToken:
    """The token of a ``Lease`` or a ``LeaseToken`` itself (SPEC Q30); anything else is
    ``NotALease``, never ``StaleToken``, so ``except StaleToken`` cannot hide a wrong
    argument."""
    if isinstance(lease, LeaseToken):
        token = lease
    elif isinstance(lease, Lease) and isinstance(lease.token, LeaseToken):
        token = lease.token
    else:
        raise NotALease(
            f"expected a Lease (or its LeaseToken, lease.token) from Queue.lease(), got {type(lease).__name__}"
        )
    h, s, d, q, e = token
    if type(h) is not int or type(s) is not int or type(d) is not int or type(q) is not int or type(e) is not int:
        name, v = next((n, v) for n, v in zip(LeaseToken._fields, token, strict=True) if type(v) is not int)
        raise NotALease(
            f"this LeaseToken was altered: its {name} is {v!r}, not an int; pass the token that "
            f"Queue.lease() returned, unchanged"
        )
    if not (0 <= d <= _U64 and 0 <= q <= _U64 and 0 <= e <= _U32):  # the widths stored (the shard: _token_shard)
        name, v = next((n, v) for n, v, top in zip(LeaseToken._fields[2:], token[2:], (_U64, _U64, _U32), strict=True)
                       if not 0 <= v <= top)
        raise NotALease(
            f"this LeaseToken was altered: its {name} is {v}, out of range; pass the token that "
            f"Queue.lease() returned, unchanged"
        )
    return token


_GONE: Any = object()  # a claimed var row that is not handed out (Queue._read_payloads)


def _as_stored(body: bytes) -> bytes:
    """The "decode" of :meth:`Queue._lease_batch_encoded` for bodies stored plain."""
    return body


_DEADLINE_DTYPE = np.dtype("datetime64[ms]")
_NO_INLINE = np.empty(0, dtype=np.uint8)  # a var lease_batch's inline payloads: none


class LeaseBatch(Generic[T]):
    """Leases taken by one :meth:`Queue.lease_batch` call (Q32), as arrays.

    ``len(batch)`` and iteration (``Lease`` objects, made on demand) work as on the list
    ``lease`` returns; ``batch[i]`` is the i-th ``Lease``.  The arrays, one entry per
    lease in key order: ``ids`` (``uint64``), ``attempts`` (``uint16``, 1 for a first
    delivery), ``deadlines`` (``datetime64[ms]``, UTC) and ``payloads`` (for a fixed
    queue a structured array of its dtype, for a var queue a list).  Give the whole batch
    to :meth:`Queue.ack_many`, or single leases to ``ack``/``nack``/``extend``.
    """

    __slots__ = ("_cached", "_deadline", "_dues", "_epochs", "_handle", "_queue", "_shards", "attempts", "deadlines",
                 "ids", "payloads")

    def __init__(self, queue: str, handle: int, shards: np.ndarray, dues: np.ndarray, ids: np.ndarray,
                 attempts: np.ndarray, epochs: np.ndarray, deadline: tuple[int, datetime], payloads: Any) -> None:
        self._queue = queue
        # False (set by Queue._lease_batch_made, VarFast.lease_batch): the lease took its
        # bodies out of the queue's cache (Queue._batch_bodies), so its ack_many has none
        # to drop.
        self._cached = True
        self._handle = handle
        self._shards = shards
        self._dues = dues
        self._epochs = epochs
        self._deadline = deadline[1]
        self.ids = ids
        self.attempts = attempts
        self.deadlines = np.empty(len(ids), _DEADLINE_DTYPE)  # (np.full with a dtype name: 6 us)
        self.deadlines.fill(deadline[0])
        self.payloads = payloads

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Lease[T]:
        new = tuple.__new__
        seq = int(self.ids[i])
        token = new(LeaseToken, (self._handle, int(self._shards[i]), int(self._dues[i]), seq, int(self._epochs[i])))
        return new(Lease, (seq, self.payloads[i], int(self.attempts[i]), self._deadline, token))

    def __iter__(self) -> Iterator[Lease[T]]:
        for i in range(len(self.ids)):
            yield self[i]

    @property
    def tokens(self) -> list[LeaseToken]:
        """The ``LeaseToken`` of every lease, in order."""
        return [lz.token for lz in self]

    def __repr__(self) -> str:
        return f"<LeaseBatch of {len(self)} leases from queue {self._queue!r}>"


@dataclass(frozen=True)
class QueueStats:
    """A queue's counters and sizes (Q26).  Counters run since this open.

    ``poisoned`` counts the rows a lease dead-lettered because their body could not be
    read or decoded (also counted in ``dead_lettered``, not in ``nacks``).
    """

    name: str
    len: int
    dead_len: int
    ready: int
    leased: int
    delayed: int
    shards: int
    slots_allocated: int
    version_vector_bytes: int
    header_file_logical_bytes: int
    header_file_physical_bytes: int
    payload_writes: int
    compaction_bytes: int
    payload_compaction_bytes: int
    pushes: int
    acks: int
    nacks: int
    dead_lettered: int
    poisoned: int
    expired_leases: int
    repaired_on_open: int
    retention_retry_pending: int
    orphans_collected: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # How Jupyter groups the fields: what is in the queue now, what happened since this
    # open, and the files.  Sizes are shown in readable units.
    _GROUPS = (
        ("now", ("len", "ready", "leased", "delayed", "dead_len", "retention_retry_pending")),
        ("since this open", ("pushes", "acks", "nacks", "dead_lettered", "poisoned", "expired_leases",
                             "payload_writes", "repaired_on_open", "orphans_collected")),
        ("files", ("shards", "slots_allocated", "version_vector_bytes", "header_file_logical_bytes",
                   "header_file_physical_bytes", "compaction_bytes", "payload_compaction_bytes")),
    )

    def _repr_html_(self) -> str:
        d = self.to_dict()
        body = []
        for title, names in self._GROUPS:
            body.append(f"<tr><th colspan='2' style='text-align:left;padding-top:0.6em'>{title}</th></tr>")
            for k in names:
                v = _bytes(d[k]) if k.endswith("_bytes") else _fmt(d[k])
                body.append(f"<tr><td style='text-align:left;padding-left:1.2em'>{k}</td>"
                            f"<td style='text-align:right'>{v}</td></tr>")
        return (
            f"<table><caption style='font-weight:bold'>queue {html.escape(self.name)}</caption>"
            f"<tbody>{''.join(body)}</tbody></table>"
        )


def _fmt(v: Any) -> str:
    return f"{v:,}" if isinstance(v, int) else str(v)


def _bytes(n: int) -> str:
    """``12,582,912`` as ``12.0 MiB``: sizes in binary units, exact below 1 KiB."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{n:,} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


# -- the queue ---------------------------------------------------------------------------------


# A queue shard (armdb._core.qshard.QueueShard): its FixedStore shard (``fixed``, whose
# ``lock`` it shares), the two ordered indexes ``live`` and ``dead``, the counters since
# open (changed only under ``lock``, summed by Queue.stats), and the compiled push,
# lease and ack of one row.
_Shard = QueueShard


def _each_payload(fn: Callable[[Any], bytes], payloads: Iterable[Any]) -> list[bytes]:
    """``fn`` (an encoder, or the check of an encoded body) of each payload of a batch;
    a refusal names the payload and says nothing was pushed."""
    out: list[bytes] = []
    for i, p in enumerate(payloads):
        try:
            out.append(fn(p))
        except PayloadTypeError as e:
            raise type(e)(f"payload {i} of the batch: {e}; nothing was pushed") from None
    return out


class Queue(Generic[T]):
    """A handle on an open queue.  Get one with ``db.open_queue(spec, config)``.

    Safe to share between threads (Q28).  Its operations are ``push``, ``lease``,
    ``ack``, ``nack``, ``len``, ``dead_len``, ``next_delay``, ``wait_due_timeout``,
    ``due``, and the read-only ``stats`` and ``snapshot``.
    """

    def __init__(self, db: Db, spec: QueueSpec, config: QueueConfig, commits: Commits) -> None:
        self._db = db
        self.spec = spec
        self.name = spec.name
        self.config = config
        self._handle = (_PROCESS_TAG << 32) | next(_handle_ids)
        self._seq_name = "q:" + spec.name  # the seqmap name of its row ids
        self._codec: FixedCodec | VarCodec = VarCodec(spec.payload) if spec.var else FixedCodec(spec.dtype)
        # Looked up once for the hot path (config is frozen, the seqmap lives as long as the Db).
        self._encode = self._codec.encode
        self._decode: Any = getattr(self._codec, "decode", None)  # a var body's decode (lease(1))
        self._next_id = db.seqmap.next
        self._max_depth = config.max_depth
        self._max_attempts = config.max_attempts
        self._lease_ms = int(round(config.lease_timeout * 1000))  # the default lease, in ms
        self._lease_timeouts: dict[tuple[int, int], int] = {}  # (id, epoch) -> ms: leases not of _lease_ms
        self._retention_ms = transitions.retention_ms(config)
        # Key, header and inline payload: the row image a settle reads and rewrites.
        self._row_size = ROW_SIZE + (0 if spec.var else spec.dtype.itemsize)
        self._all_lock_items: list[tuple[str, threading.Lock]] | None = None  # _tx_all_locks, once open
        self._commit_settle = commits.settle  # a var queue's ack and nack (Q14): armdb.tx.commit_settle
        self._commit_dead_rows = commits.dead_rows  # redrive and purge_dead (Q34)
        self._commit_batch = commits.batch  # push_many (Q31)
        self._commit_ack_many = commits.ack_many  # ack_many (Q32)
        self._fence_after_log = commits.fence  # VarFast.ack's commit fails as every commit does
        self._name_field = packb(spec.name)  # the name as the log's compiled F rows carry it
        # The packed start of a body's log row, ["B", payload name, ... (armdb._core.fixed.push_body_rows, tomb_rows).
        self._body_row_head = b"\x95" + packb("B") + packb(spec.payload_name)
        self._payload_name = spec.payload_name
        # A var ack's log record body, the list of its two rows ["F", name, shard, slot,
        # version, DELETED, b""] and ["B", payload name, key, None, gsn], is packed in one
        # compiled call from these packed starts of its rows (armdb._core.fixed.ack_rows).
        self._ack_heads = (b"\x97" + packb("F") + self._name_field, self._body_row_head)
        # A var ack's two locks per header shard, in the global order (armdb.tx.commit_settle),
        # when the body store has one shard (set at open); None: found per ack.
        self._ack_locks: list[tuple[threading.Lock, threading.Lock]] | None = None
        self._body_sealed = False  # whether the bodies are encrypted (set at open)
        self._clock = db.clock
        self._cond = threading.Condition(threading.Lock())
        self._closed = False
        self._payload: BitcaskStore | None = None
        self._headers: FixedStore | None = None
        self._shards: list[_Shard] = []
        # A fixed queue's push, lease and ack in one compiled call each (FixedFast), a var
        # queue's push and lease (VarFast), which hand anything but the common arguments
        # back to _push, _lease and _ack.
        self._fast: FixedFast | None = None
        self._counter_lock = threading.Lock()  # guards the counters below (per-shard ones live on _Shard)
        # A new value at every push and nack (next() on a count is atomic under the GIL,
        # and never repeats one): waiters compare it to detect missed wakeups.
        self._gens = itertools.count(1)
        self._gen = 0
        self._last_deadline = (-1, ms_to_datetime(0))  # (ms, datetime) of the last lease deadline
        self._nwaiters = 0
        self._payload_writes = 0
        self._pushed_bodies = 0  # lone pushes' body writes (_put_body, under _cache_lock): payload_writes adds them
        self._orphans_collected = 0
        self._poisoned = 0  # rows dead-lettered at lease because their body cannot be decoded
        # Raw var bodies by id (payload_config.cache_bytes): push fills it while a body
        # fits in the budget, a lease takes its rows' bodies out of it (so an ack has none
        # to drop), and every other way a row with a cached body goes (retention, purge,
        # a batch ack of bodies it did not take, a push that failed after its body, close)
        # drops its entry.  A full cache takes no new body: it keeps the oldest pushes,
        # which a queue leases first, and nothing is ever evicted (an eviction of the
        # oldest, as before, left a backlog larger than the cache reading every lease from
        # the data file, and cost a push into a full cache a put and an eviction).
        # Guarded by _cache_lock.
        self._cache: dict[int, bytes] = {}
        self._cache_bytes = 0
        self._cache_budget = config.payload_config.cache_bytes if spec.var else 0
        self._cache_lock = Lock()  # (armdb._core.locks: a cheaper acquire than threading.Lock)
        self._retry: list[int] = []
        self._retry_overflow = False
        self._retention_paused = False
        self._next_retention = 0
        install_own_dict(self)  # its compiled calls read and write its attributes in place

    # -- open and recovery ---------------------------------------------------------------
    def _open(self) -> None:
        db = self._db
        fs = _fs.FS
        hdir = db.collection_dir(self.name)
        meta_path = os.path.join(hdir, QUEUE_META)
        hcfg = self.config.header_config
        value_size = HEADER_SIZE + (0 if self.spec.var else self.spec.dtype.itemsize)
        if fs.exists(meta_path):
            meta = _decode_meta(fs.read_file(meta_path), meta_path)
            if meta["var"] != self.spec.var:
                stored, given = ("var", "fixed") if meta["var"] else ("fixed", "var")
                raise SchemaMismatch(
                    f"queue {self.name!r} was created as a {stored} queue and cannot be opened as a {given} "
                    f"queue; declare it as it was created"
                )
            shard_count = int(meta["shard_count"])
            layouts, layout = meta.get("layouts"), int(meta.get("layout", 0))
            if meta["fingerprint"] != self.spec.fingerprint:
                # A dataclass payload may have gained a defaulted field or lost one (Q36):
                # the new layout joins the history before any body is written with it.
                layouts, layout = evolve(self.name, meta["fingerprint"], layouts, self.spec.payload,
                                         self.spec.fingerprint)
                fs.write_file_atomic(meta_path, encode_meta(
                    self.spec.var, self.spec.fingerprint, shard_count, int(meta["value_size"]), layouts, layout))
            if layouts:
                self._codec.use_layouts(layouts, layout)  # type: ignore[union-attr]
                self._encode = self._codec.encode
                self._decode = self._codec.decode  # type: ignore[union-attr]
            if hcfg.shard_count is not None and hcfg.shard_count != shard_count:
                raise ConfigError(
                    f"queue {self.name!r} has {shard_count} header shard(s); it was reopened with "
                    f"shard_count={hcfg.shard_count}. The count is fixed at creation: leave it unset"
                )
        else:
            if fs.exists(hdir):
                for leftover in fs.listdir(hdir):
                    if leftover.endswith(".tmp"):  # a crash between tmp write and rename
                        fs.unlink(os.path.join(hdir, leftover))
            if fs.exists(hdir) and fs.listdir(hdir):
                raise ConfigError(f"{self.name!r} is already a collection of another kind; choose another name")
            shard_count = hcfg.shard_count or 1
            fs.makedirs(hdir)
            fs.write_file_atomic(meta_path, encode_meta(self.spec.var, self.spec.fingerprint, shard_count, value_size))
        if self.spec.var:
            # First, so that a missing or wrong key refuses the open before the header
            # store is touched (it may create its redo file or extend to a grow step).
            self._payload = db.open_bitcask(self.spec.payload_name, self.config.payload_config)
        try:
            self._headers = FixedStore(hdir, shard_count, KEY_SIZE, value_size, hcfg)
        except BaseException:
            if self._payload is not None:
                self._payload.close()
                db._stores.pop(self.spec.payload_name, None)
            raise
        try:
            psize = 0 if self.spec.var else self._codec.size  # type: ignore[union-attr]
            self._shards = [_Shard(s, psize, s.write_hook_always) for s in self._headers]
            if not self.spec.var:  # fixed queues get finished Lease objects from the shards
                for sh in self._shards:
                    sh.set_lease_types(Lease, LeaseToken, self._handle, self.spec.dtype)
            max_seq = 0
            for sh in self._shards:
                max_seq = max(max_seq, self._recover_shard(sh))
            db.seqmap.advance(self._seq_name, max_seq)
            if self._payload is not None:
                self._drop_headers_without_body()
                self._orphan_pass()
                self._body_sealed = self._payload.encrypted  # fixed at open (the ack's key check)
                body_locks = self._payload.all_locks()
                if len(body_locks) == 1:
                    ((bdir, _), block), = body_locks
                    self._ack_locks = [(sh.lock, block) if sh.fixed.directory < bdir else (block, sh.lock)
                                       for sh in self._shards]
            self._schedule_retention()
            if not self.spec.var:
                codec = typing.cast(FixedCodec, self._codec)
                self._fast = FixedFast(
                    self, db, self._shards, db.clock is system_clock, db.clock, ms_to_datetime, db.seqmap,
                    self._seq_name, self._encode, codec.plain_struct, len(self.spec.dtype.names or ()),
                    self._lease_ms, self._max_attempts, MAX_LEASE, MAX_DUE_MS, self._max_depth is None,
                    self._lease_timeouts, self._gens, Lease, LeaseToken, self._handle)
                # The public push, lease and ack of a fixed queue are the compiled ones
                # themselves, bound as instance attributes (which shadow the methods
                # below): one call, no Python frame between the user and FixedFast.
                # They take the same arguments and hand all but the common case to
                # _push, _lease and _ack, which raise what the methods document.
                own_dict(self).update(push=self._fast.push, lease=self._fast.lease, ack=self._fast.ack)
            else:
                var = VarFast(
                    self, db, self._shards, db.clock is system_clock, db.clock, ms_to_datetime, db.seqmap,
                    self._seq_name, self._encode, None, 0,
                    self._lease_ms, self._max_attempts, MAX_LEASE, MAX_DUE_MS, self._max_depth is None,
                    self._lease_timeouts, self._gens, Lease, LeaseToken, self._handle)
                body_store = typing.cast("BitcaskStore", self._payload)
                var.set_var(body_store.put, body_store._putter if len(body_store._shards) == 1 else None,
                            self._cache, self._cache_lock, self._decode, self._read_payloads,
                            _fail, _GONE, self._commit_settle)
                vcodec = typing.cast(VarCodec, self._codec)
                var.set_plain(vcodec._plain_type, vcodec._decodes_as_is)
                if self._ack_locks is not None and not self._body_sealed:
                    # The common ack's commit in VarFast.ack itself (commit_settle's steps,
                    # without its frame); other stores keep commit_settle.
                    var.set_ack(body_store, self._ack_locks, *self._ack_heads, self._fence_after_log, ack_rows,
                                log_record, vars(_fs), REC_MAGIC, FLAG_SYNCED_BEFORE)
                # lease_batch: the Python method bound here, before the compiled one
                # shadows it, for every call but the common batch.
                var.set_batch(LeaseBatch, self.name, self.lease_batch, self._lease_batch_var, vcodec.decode_many)
                var.set_ack_many(self.ack_many, self._commit_ack_many)  # (likewise)
                self._fast = var
                # As a fixed queue's: the compiled push, lease(1), lease_batch, ack and
                # ack_many shadow the methods below, and hand all but the common case to
                # _push, _lease, lease_batch, _ack and ack_many.  A var ack's commit is
                # armdb.tx.commit_settle.
                own_dict(self).update(push=var.push, lease=var.lease, ack=var.ack, lease_batch=var.lease_batch,
                                  ack_many=var.ack_many)
        except BaseException:
            self._headers.close()
            if self._payload is not None:
                self._payload.close()
                db._stores.pop(self.spec.payload_name, None)
            raise

    def _recover_shard(self, sh: _Shard) -> int:
        fx = sh.fixed
        for slot in fx.torn_slots():
            # A torn slot was being written when the process died; its row (if the
            # write was an update) cannot be trusted.  Free it so check() is clean (S4).
            fx.repair_torn(int(slot))
        occ = fx.occupied_slots()
        if occ.size == 0:
            return 0
        rows = rows_of(fx.slots, occ)
        due = rows["due"].astype(np.uint64)
        seq = rows["seq"].astype(np.uint64)
        self._judge_rows(fx, occ, rows, due, seq)
        hdr = rows["header"]
        dead = (due & np.uint64(DEAD_BIT)) != 0
        leased = hdr["state"] == State.LEASED
        # A leased row without a plausible deadline is served as an expired lease.
        deadline = np.where(leased, hdr["deadline"], 0).astype(np.int64)
        np.maximum(deadline, 0, out=deadline)
        slots = occ.astype(np.uint32)
        try:
            sh.live = KeyIndex.from_arrays(due[~dead], seq[~dead], slots[~dead], deadline[~dead])
            sh.dead = KeyIndex.from_arrays(due[dead], seq[dead], slots[dead], np.zeros(int(dead.sum()), np.int64))
        except ValueError as e:  # the rules above leave nothing the index refuses; kept typed anyway
            raise CorruptionError(f"{fx.path}: queue rows cannot be indexed ({e}); restore the queue "
                                  f"from a backup (armdb.check lists every problem)") from None
        return int(seq.max())

    def _judge_rows(self, fx: Any, occ: np.ndarray, rows: np.ndarray, due: np.ndarray, seq: np.ndarray) -> None:
        """Refuse the shard if a CRC-valid row breaks a rule (:func:`row_problems`); log
        and count the rows open repairs in memory."""
        for p in row_problems(rows, fx.index, len(self._shards), self.spec.var, due=due, seq=seq):
            if p.action == "report":
                continue
            k = int(p.bad.sum())
            where = occ[p.bad][:5].tolist()
            ids = rows["seq"][p.bad][:5].tolist()
            if p.action == "refuse":
                offsets = [HEADER_PAGE + s * fx.slot_size for s in where]
                raise CorruptionError(
                    f"{fx.path}: {k} row(s) {p.what} (slots {where} at offsets {offsets}, row ids {ids}); "
                    f"armdb never writes such a row, so the file was changed outside armdb: restore the "
                    f"queue from a backup (armdb.check lists every problem)"
                )
            fx.repaired_on_open += k
            log.warning("queue %s: %s: %d row(s) %s (slots %s, row ids %s); served as expired leases",
                        self.name, fx.path, k, p.what, where, ids)

    def _drop_headers_without_body(self) -> None:
        """Free rows whose body is missing (I4): never serve a header without its body.

        Process crashes cannot cause this (bodies are written before headers); a power
        loss in the default (non-durable) mode can, because the header page and the body
        append reach the disk independently.  Such a push was never durable; the row is
        dropped, counted in ``repaired_on_open`` and logged.
        """
        assert self._payload is not None
        present = {int.from_bytes(k, "big") for k in self._payload.keys()}
        for sh in self._shards:
            with sh.lock:
                for idx in (sh.live, sh.dead):
                    due, seq, slot, _ = idx.to_arrays()
                    for d, q, sl in zip(due.tolist(), seq.tolist(), slot.tolist()):
                        if q in present:
                            continue
                        sh.fixed.free(sl)
                        idx.remove(d, q)
                        sh.fixed.repaired_on_open += 1
                        log.warning("queue %s: row %d has no body (lost by a power cut before its sync); "
                                    "dropped", self.name, q)

    def _orphan_pass(self) -> None:
        """Delete bodies no header points at (a crash between body and header, Q15)."""
        assert self._payload is not None
        referenced: set[int] = set()
        for sh in self._shards:
            with sh.lock:
                for idx in (sh.live, sh.dead):
                    referenced.update(int(s) for s in idx.to_arrays()[1])
        orphans = [k for k in self._payload.keys() if int.from_bytes(k, "big") not in referenced]
        for i, k in enumerate(orphans):
            self._payload.delete(k)
            if i == len(orphans) // 2:
                _fail.point("queue.orphan_sweep.mid")
        if orphans:
            log.info("queue %s: collected %d orphan payload bodies", self.name, len(orphans))
        self._orphans_collected += len(orphans)
        self._retry.clear()
        self._retry_overflow = False

    def _on_db_close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        with self._cache_lock:  # a handle kept after close holds no bodies
            self._cache.clear()
            self._cache_bytes = 0

    # -- helpers -------------------------------------------------------------------------------
    def _check(self) -> int:
        """Raise DbClosed if closed; run retention when due; return now (ms)."""
        if self._closed or self._db._closed:
            raise DbClosed(f"queue {self.name!r} (its Db is closed){self._db._closed_why}")
        now = int(self._clock())
        if now >= self._next_retention:
            self._sweep(raise_errors=False, now=now)
        return now

    @staticmethod
    def _header(sh: _Shard, slot: int) -> tuple[int, int, int, int, int, int, int]:
        return sh.fixed.sf.header(slot, KEY_SIZE)

    def _payload_bytes(self, sh: _Shard, slot: int) -> bytes:
        return sh.fixed.sf.body(slot, KEY_SIZE + HEADER_SIZE, self._codec.size)  # type: ignore[union-attr]

    _key_bytes = staticmethod(body_key)  # a var row's body key in <name>.payload

    # -- push (Q9, Q15, Q16, Q20) -------------------------------------------------------------
    def push(self, payload: T, *, delay: timedelta | float | None = None) -> int:
        """Insert a ready row due at ``now + delay``; return its id.

        Raises
        ------
        PayloadTypeError
            The payload does not match the declared type, or would not read back as it
            was pushed (a dict with a tuple key, a dataclass its class cannot rebuild
            from the stored fields); nothing is written.
        QueueFull
            ``max_depth`` live rows already exist.
        DbClosed
            The database is closed.
        """
        # On an open queue this method is shadowed by the compiled push (FixedFast.push
        # for a fixed queue, VarFast.push for a var one: see _open), which hands all but
        # the common case to _push.
        return self._push(payload, delay)

    def _push(self, payload: T, delay: timedelta | float | None) -> int:
        now = self._check()
        delay_ms = self._delay_ms(delay, now)
        body = self._encode(payload)
        cap = self._max_depth
        if cap is not None and self.len() >= cap:
            raise QueueFull(
                f"queue {self.name!r} holds {cap} live rows (max_depth); ack or dead-letter work, "
                f"or open it with a larger max_depth"
            )
        return self._push_body(body, now, delay_ms)

    def _push_body(self, body: bytes, now: int, delay_ms: int) -> int:
        """A lone push of an encoded payload once ``max_depth`` was checked (:meth:`_push`,
        and a one-job batch, which checks it with the batch's message)."""
        seq = self._next_id(self._seq_name)
        sh = self._shards[seq % len(self._shards)]
        if self._payload is not None:
            try:
                self._put_body(self._payload, seq, body)
                with sh.lock:
                    sh.push(now + delay_ms, seq, now, seq, b"")
            except BaseException:
                # A body cached for a row whose header was not written would hold its
                # budget until close: no lease takes it, nothing evicts it.
                self._cache_drop(seq)
                raise
        else:
            with sh.lock:
                sh.push(now + delay_ms, seq, now, 0, body)
        self._notify()
        return seq

    @staticmethod
    def _delay_ms(delay: timedelta | float | None, now: int) -> int:
        delay_ms = 0 if delay is None else to_ms(delay, "delay")
        if delay_ms < 0 or now + delay_ms >= MAX_DUE_MS:
            raise ConfigError(f"delay must not be negative and is at most {MAX_DUE_MS - now} ms, got {delay!r}")
        return delay_ms

    # -- batches (Q31, Q32) -------------------------------------------------------------------------
    def push_many(self, payloads: Iterable[T] | np.ndarray, *, delay: timedelta | float | None = None) -> Any:
        """Push every payload of ``payloads`` in one call, all or nothing; return their ids,
        increasing in input order.

        A fixed queue also takes a 1-D NumPy array of its dtype: its rows are written by a
        compiled loop (no Python object per row) and the ids come back as a ``uint64``
        array.  Otherwise give a sequence (a list, a tuple, any iterable) and get a list.

        The batch is one logged commit: after a crash, either every row of it exists or
        none does.  Its log record holds every row, so a batch is bounded by the log's
        record size (1 GiB: a million rows of up to about 1,000 bytes).  A batch of one
        payload is pushed as :meth:`push` pushes it (no log record; the same outcome),
        except in an encrypted queue.

        Raises
        ------
        PayloadTypeError
            A payload does not match the queue's type (the error names which one), or the
            array has another dtype or shape; nothing is written.
        QueueFull
            The batch would take the queue past ``max_depth`` (judged on the whole batch);
            nothing is written.
        EncryptionKeyRequired
            A var queue with encrypted bodies, in a Db without a log key (the batch is
            logged, like a transaction).
        """
        now = self._check()
        delay_ms = self._delay_ms(delay, now)
        if isinstance(payloads, np.ndarray) and self._payload is None:
            arr = self._batch_array(payloads)
            n = len(arr)
            if n == 0:
                return np.empty(0, dtype=np.uint64)
            first = self._commit_batch(self._db, self, (arr.view(np.uint8).reshape(-1), n, delay_ms))
            return np.arange(first, first + n, dtype=np.uint64)
        if type(payloads) is not list and (isinstance(payloads, (str, bytes, bytearray, memoryview, dict))
                                           or not isinstance(payloads, Iterable)):
            raise PayloadTypeError(
                f"push_many takes a sequence of payloads (e.g. a list), not {type(payloads).__name__}; "
                f"push one payload with push()"
            )
        if self._payload is not None:
            if not isinstance(payloads, list):
                payloads = list(payloads)
            got = typing.cast(VarCodec, self._codec).encode_many(payloads)
        else:
            got = None
        if got is not None:
            bodies = got
        else:  # one by one: which payload is refused, and why
            bodies = _each_payload(self._encode, payloads)
        return self._push_encoded(bodies, now, delay_ms)

    def _push_many_encoded(self, bodies: list[bytes], *, delay: timedelta | float | None = None) -> list[int]:
        """:meth:`push_many` of a var queue's payloads already encoded (a client's batch,
        armdb.server): each body is checked once to read back as a payload of the queue's
        type (``VarCodec.accept_encoded``) and stored as it came, with no decode and second
        encode.  All or nothing, raising what ``push_many`` raises."""
        now = self._check()
        delay_ms = self._delay_ms(delay, now)
        if self._payload is None:
            raise PayloadTypeError(f"queue {self.name!r} is a fixed queue: push its records, not encoded bodies")
        codec = typing.cast(VarCodec, self._codec)
        checked = codec.accept_encoded_many(bodies)
        return self._push_encoded(checked if checked is not None else _each_payload(codec.accept_encoded, bodies),
                                  now, delay_ms)

    def _push_encoded(self, bodies: list[bytes], now: int, delay_ms: int) -> list[int]:
        """The commit of :meth:`push_many` once its payloads are encoded bodies."""
        n = len(bodies)
        if n == 0:
            return []
        if self._payload is not None:
            i = longest(bodies)  # (a compiled loop: max(map(len, ...)) cost a Python call a body)
            if i < 0:
                i = bodies.index(max(bodies, key=len))
            if len(bodies[i]) > MAX_VALUE_LEN:
                raise ConfigError(
                    f"payload {i} of the batch encodes to {len(bodies[i]):,} bytes, above the limit of "
                    f"{MAX_VALUE_LEN:,}; nothing was pushed"
                )
        if n == 1 and not self._body_sealed:
            # One job (a producer's tail batch, a client's lone push_many): the lone push
            # (a var body's record and a header slot, no log record) costs about a fourth
            # of a one-row batch commit and has the same outcome: all or nothing, the same
            # checks.  An encrypted queue keeps the batch's logged commit, which needs the
            # log key, so that push_many asks for the key whatever the batch's length.
            self._check_room(1)  # (the batch's message)
            return [self._push_body(bodies[0], now, delay_ms)]
        if self._payload is not None:
            # The plan leaves the ids in ``ids``, the same int objects it keys the cached
            # bodies with (no second int a row: about 90 instructions a row).
            ids: list[int] = []
            self._commit_batch(self._db, self, (bodies, n, delay_ms, ids))
            return ids
        else:
            first = self._commit_batch(self._db, self, (b"".join(bodies), n, delay_ms))
        return list(range(first, first + n))

    def _batch_array(self, arr: np.ndarray) -> np.ndarray:
        """A fixed queue's batch as a contiguous 1-D array of its exact dtype."""
        want = self.spec.dtype
        if arr.ndim != 1:
            raise PayloadTypeError(
                f"push_many takes a 1-D array of the queue's dtype; got an array of shape {arr.shape} "
                f"(flatten it, or pass one row per element)"
            )
        if arr.dtype != want:
            raise PayloadTypeError(
                f"queue {self.name!r} stores {want}; got an array of {arr.dtype}. Build the array with "
                f"dtype=queue.spec.dtype (arr.astype(...) if you accept the conversion)"
            )
        return np.ascontiguousarray(arr)

    def lease_batch(self, n: int = 1, *, lease_timeout: timedelta | float | None = None,
                    ack: LeaseBatch[T] | Iterable[Lease[T] | LeaseToken] | None = None) -> LeaseBatch[T]:
        """Lease like :meth:`lease` (same rules, key order) and return the leases as a
        :class:`LeaseBatch` of arrays, filled by a compiled loop with no Python object per
        row: for a fixed queue the payloads are one structured array; for a var queue each
        body is then read and decoded (a body that cannot be is dead-lettered alone, as in
        :meth:`lease`).

        ``ack``: leases to ack first, as :meth:`ack_many` takes them (typically the batch
        the worker just finished).  Here the acks commit first (one ``ack_many``), then
        the lease runs; if the acks raise, nothing is acked and nothing is leased.  An
        empty ``ack`` (an empty batch or list) leases only.  On ``armdb.pg`` the two are
        one transaction.

        Raises
        ------
        ConfigError
            As for :meth:`lease`; nothing changes.
        StaleToken, NotALease
            As for :meth:`ack_many`, for ``ack``; nothing is acked nor leased.
        """
        if ack is not None and not (isinstance(ack, LeaseBatch) and not len(ack)):
            self._lease_arg(n, lease_timeout, "lease_batch")  # a bad argument raises before anything is acked
            self.ack_many(ack)
        return self._lease_batch(n, lease_timeout, None)

    def _lease_batch_encoded(self, n: int, *, lease_timeout: timedelta | float | None = None) -> LeaseBatch[bytes]:
        """:meth:`lease_batch` of a var queue whose payloads are the stored bodies (decrypted),
        as bytes a client decodes (armdb.server puts them in its reply as they are): each is
        one msgpack value as ``VarCodec.plain`` gives it.  Bodies stored otherwise (a payload
        class with a ``__post_init__``, or whose fields changed) are decoded and encoded again
        in that form; one that cannot be is dead-lettered as :meth:`lease` does."""
        if self._payload is None:
            raise PayloadTypeError(f"queue {self.name!r} is a fixed queue: lease_batch gives its records")
        codec = typing.cast(VarCodec, self._codec)
        if codec.stored_plain:
            return self._lease_batch(n, lease_timeout, _as_stored)
        decode, plain = codec.decode, codec.plain
        return self._lease_batch(n, lease_timeout, lambda raw: packb(plain(decode(raw))))

    def _lease_batch(self, n: int, lease_timeout: timedelta | float | None,
                     decode: Callable[[bytes], Any] | None) -> LeaseBatch[Any]:
        """:meth:`lease_batch`; a var queue's bodies are given by ``decode`` (None: the codec's)."""
        lease_ms = self._lease_arg(n, lease_timeout, "lease_batch")
        now = self._check()
        deadline = lease_deadline(now, lease_ms, lease_timeout, "lease_timeout")
        last = self._last_deadline
        if last[0] != deadline:
            last = self._last_deadline = (deadline, ms_to_datetime(deadline))
        var = self._payload is not None
        shards = self._shards
        if var and len(shards) == 1:  # the common var batch: the arrays made by the claim, to size
            with shards[0].lock:
                dead, shard_nos, dues, seqs, attempts, epochs = shards[0].claim_new(now, deadline, n,
                                                                                     self._max_attempts)
            if dead:
                self._note_dead(now)
            return self._lease_batch_var(shard_nos, dues, seqs, attempts, epochs, lease_ms, last, decode)
        shard_nos = np.zeros(n, dtype=np.uint32)
        dues = np.empty(n, dtype=np.uint64)
        seqs = np.empty(n, dtype=np.uint64)
        attempts = np.empty(n, dtype=np.uint16)
        epochs = np.empty(n, dtype=np.uint32)
        payloads: Any
        if var:  # no inline payloads: one empty array for every var lease (nothing is written to it)
            payloads = raw = _NO_INLINE
        else:
            payloads = np.empty(n, dtype=self.spec.dtype)
            raw = payloads.view(np.uint8).reshape(-1)
        got = dead = 0
        if len(shards) == 1:
            with shards[0].lock:
                got, dead = shards[0].claim_block(now, deadline, n, self._max_attempts, dues, seqs, attempts, epochs,
                                                  raw, 0)
        while len(shards) > 1 and got < n:
            # Each shard leases its share of the first due rows of all shards, in its key order.
            share = collections.Counter(c[2] for c in self._scan(now, n - got))
            if not share:
                break
            progressed = False
            for shard_no, k in sorted(share.items()):
                sh = shards[shard_no]
                with sh.lock:
                    g, d = sh.claim_block(now, deadline, k, self._max_attempts, dues, seqs, attempts, epochs, raw, got)
                shard_nos[got:got + g] = shard_no
                got += g
                dead += d
                progressed = progressed or g > 0 or d > 0
            if not progressed:
                break
        if dead:
            self._note_dead(now)
        if len(shards) > 1 and got > 1:
            order = np.lexsort((seqs[:got], dues[:got]))  # the shards' leases merged in key order
            shard_nos, dues, seqs = shard_nos[order], dues[order], seqs[order]
            attempts, epochs = attempts[order], epochs[order]
            if not var:
                payloads = payloads[order]
        elif got < n:
            shard_nos, dues, seqs = shard_nos[:got].copy(), dues[:got].copy(), seqs[:got].copy()
            attempts, epochs = attempts[:got].copy(), epochs[:got].copy()
            if not var:
                payloads = payloads[:got].copy()
        if var:
            return self._lease_batch_var(shard_nos, dues, seqs, attempts, epochs, lease_ms, last, decode)
        return self._lease_batch_made(shard_nos, dues, seqs, attempts, epochs, lease_ms, last, payloads, True)

    def _lease_batch_var(self, shard_nos: np.ndarray, dues: np.ndarray, seqs: np.ndarray, attempts: np.ndarray,
                         epochs: np.ndarray, lease_ms: int, last: tuple[int, datetime],
                         decode: Callable[[bytes], Any] | None) -> LeaseBatch[Any]:
        """The end of a var :meth:`_lease_batch`: the claimed rows' bodies, decoded (a row
        whose body is gone or poisoned is dropped from the batch), then the batch."""
        payloads, keep, cached = self._batch_bodies(shard_nos, dues, seqs, epochs, decode)
        if keep is not None:
            shard_nos, dues, seqs, attempts, epochs = (
                shard_nos[keep], dues[keep], seqs[keep], attempts[keep], epochs[keep])
        return self._lease_batch_made(shard_nos, dues, seqs, attempts, epochs, lease_ms, last, payloads, cached)

    def _lease_batch_made(self, shard_nos: np.ndarray, dues: np.ndarray, seqs: np.ndarray, attempts: np.ndarray,
                          epochs: np.ndarray, lease_ms: int, last: tuple[int, datetime], payloads: Any,
                          cached: bool) -> LeaseBatch[Any]:
        """The :class:`LeaseBatch` of a :meth:`_lease_batch`'s leases."""
        if lease_ms != self._lease_ms and len(seqs):
            self._remember_timeouts(self._batch_tokens(shard_nos, dues, seqs, epochs), lease_ms)
        batch: LeaseBatch[Any] = LeaseBatch(self.name, self._handle, shard_nos, dues, seqs, attempts, epochs, last,
                                            payloads)
        batch._cached = cached
        return batch

    def _batch_bodies(self, shard_nos: np.ndarray, dues: np.ndarray, seqs: np.ndarray,
                      epochs: np.ndarray, decode: Callable[[bytes], Any] | None = None
                      ) -> tuple[list[Any], np.ndarray | None, bool]:
        """The decoded payloads of a var batch's leases (:meth:`_read_payloads`), None or
        the mask of the leases to hand out, and whether the cache may still hold their
        bodies (False: they were taken out of it here)."""
        if decode is None and len(seqs) > 1 and self._cache:
            # The common batch: every body in the cache, decoded together, with no Python
            # object per row but the payloads.  The bodies leave the cache as they are
            # taken: decoded, they are not needed again unless a lease ends without an ack
            # (then the next lease reads the store), and the batch's ack_many has no
            # cache entries to drop (one dict operation a body less in all).
            bodies = self._cache_pop(seqs)  # (contiguous uint64, as _lease_batch makes it)
            if bodies is not None:
                out = typing.cast(VarCodec, self._codec).decode_many(bodies)
                if out is not None:
                    return out, None, False
        got = self._read_payloads(list(zip(shard_nos.tolist(), dues.tolist(), seqs.tolist(), epochs.tolist(),
                                           strict=True)), decode)
        if _GONE not in got:
            return got, None, True
        return [p for p in got if p is not _GONE], np.array([p is not _GONE for p in got], dtype=bool), True

    def _read_payloads(self, rows: list[tuple[int, int, int, int]],
                       decode: Callable[[bytes], Any] | None = None) -> list[Any]:
        """The decoded payload of each claimed var row ``(shard, due, seq, epoch)``, or
        ``_GONE``.  Bodies are read after the claim, the cached ones taken out of the cache
        under one hold of its lock (a leased row's body is not needed there again: its ack
        has none to drop, and a lease that ends without an ack reads it back from the
        store), and decoded together (one msgpack decode for the batch).  A row whose
        body is gone (its lease expired and it was settled elsewhere) is dropped; one whose
        body fails its checks or does not decode (msgpack, the payload class) is this row's
        problem alone: dropped and dead-lettered (:meth:`_dead_letter_poisoned`).  I/O
        errors and DbClosed propagate.  ``decode`` replaces the codec's, body by body
        (:meth:`_lease_batch_encoded`)."""
        codec = typing.cast(VarCodec, self._codec)  # (a fixed queue's leases come from QueueShard)
        custom = decode is not None
        if decode is None:
            decode = codec.decode
        if len(rows) == 1 and self._cache and not custom:  # lease(1): the cached body, decoded alone
            seq = rows[0][2]
            with self._cache_lock:
                body = self._cache.pop(seq, None)
                if body is not None:
                    self._cache_bytes -= len(body)
            if body is not None:
                try:
                    return [codec.decode(body)]
                except Exception:  # noqa: BLE001 - the general path below dead-letters it
                    pass
        bodies: list[bytes | None] = [None] * len(rows)
        missing = len(rows)
        if self._cache:
            with self._cache_lock:
                take = self._cache.pop
                taken = 0
                for i, row in enumerate(rows):
                    body = take(row[2], None)
                    if body is not None:
                        bodies[i] = body
                        taken += len(body)
                        missing -= 1
                self._cache_bytes -= taken
        if not missing and len(rows) > 1 and not custom:
            out = codec.decode_many(typing.cast(list[bytes], bodies))
            if out is not None:
                return out
        out = []
        poisoned: list[tuple[LeaseToken, Exception]] = []
        for (shard_no, due, seq, epoch), body in zip(rows, bodies, strict=True):
            err: Exception
            try:
                if body is None:
                    body = self._body_for_lease(shard_no, due, seq, epoch)
                if body is None:
                    out.append(_GONE)
                    continue
            except (CorruptionError, FormatError) as e:
                err = e
            else:
                try:
                    out.append(decode(body))
                    continue
                except Exception as e:  # noqa: BLE001 - whatever the decoder raises
                    err = e
            poisoned.append((LeaseToken(self._handle, shard_no, due, seq, epoch), err))
            out.append(_GONE)
        if poisoned:
            self._dead_letter_poisoned(poisoned)
        return out

    def _batch_tokens(self, shards: np.ndarray, dues: np.ndarray, seqs: np.ndarray,
                      epochs: np.ndarray) -> list[LeaseToken]:
        h = self._handle
        return [LeaseToken(h, k, d, q, e)
                for k, d, q, e in zip(shards.tolist(), dues.tolist(), seqs.tolist(), epochs.tolist(), strict=True)]

    def _token_list(self, leases: object, call: str, hint: str) -> list[LeaseToken]:
        """The tokens of a list of leases (or tokens) given to ``call``: ``NotALease`` for
        one lease or anything else, ``StaleToken`` for a token of another handle."""
        if isinstance(leases, (Lease, LeaseToken)) or not isinstance(leases, Iterable):
            raise NotALease(
                f"{call} takes a LeaseBatch or a list of Lease objects (or tokens), got {type(leases).__name__}{hint}"
            )
        toks = [as_token(x) for x in leases]
        handle, nsh = self._handle, len(self._shards)
        for t in toks:
            if t[0] != handle or not 0 <= t[1] < nsh:  # (handle, shard: by index, a NamedTuple's field costs a call)
                self._token_shard(t)  # its StaleToken for a token of another handle
        return toks

    def ack_many(self, leases: LeaseBatch[T] | Iterable[Lease[T] | LeaseToken]) -> int:
        """Ack every lease of a :class:`LeaseBatch` (or of a sequence of ``Lease`` objects
        or tokens) in one commit, all or nothing; return how many were acked.

        For a var queue the commit is one log record for the whole batch; one lease is
        acked as :meth:`ack` acks it.

        Raises
        ------
        StaleToken
            A lease is no longer held (acked, nacked, dead-lettered, or leased again since),
            comes from another queue handle, or appears twice; nothing is acked.
        NotALease
            An item is neither a ``Lease`` nor a ``LeaseToken``.
        """
        if isinstance(leases, LeaseBatch):
            if leases._handle != self._handle:
                raise StaleToken(
                    f"this batch was leased from queue {leases._queue!r} through another handle (or before a "
                    f"reopen); ack it on that handle, or lease again from queue {self.name!r}; nothing was acked"
                )
            if len(leases) < 2:
                return self._ack_few(leases.tokens)
            shard_nos, dues, seqs, epochs = leases._shards, leases._dues, leases.ids, leases._epochs
            cached = leases._cached
        else:
            cached = True
            toks = self._token_list(leases, "ack_many", "; ack one lease with ack()")
            if len(toks) < 2:
                return self._ack_few(toks)
            # The tokens' fields as columns (each token is a 5-tuple, each value checked
            # against its width by as_token): one transpose, then an array of each column.
            _handles, shard_col, due_col, seq_col, epoch_col = zip(*toks)
            shard_nos = np.array(shard_col, np.uint32)
            dues = np.array(due_col, np.uint64)
            seqs = np.array(seq_col, np.uint64)
            epochs = np.array(epoch_col, np.uint32)
        self._check()
        if self._lease_timeouts:
            for q, e in zip(seqs.tolist(), epochs.tolist(), strict=True):
                self._lease_timeouts.pop((q, e), None)
        return self._commit_ack_many(self._db, self, shard_nos, dues, seqs, epochs, cached)

    def _ack_few(self, toks: list[LeaseToken]) -> int:
        """:meth:`ack_many` of no lease, or of one (a Worker's batch on a thin queue): the
        lone ack, whose compiled path costs about a fourth of a one-row batch commit and
        does the same, without the arrays of one (6 of the 10 us a list of one took)."""
        if toks:
            self.ack(toks[0])
        else:
            self._check()
        return len(toks)

    def _put_body(self, store: BitcaskStore, seq: int, body: bytes) -> None:
        """A lone push's body: written first (Q15), counted, and cached (:meth:`_cache_put`),
        the count and the cache under one hold of the cache's lock (taken by acquire and
        release: a ``with`` binds ``__enter__`` and ``__exit__`` at every pass)."""
        store.put(seq.to_bytes(8, "big"), body)  # qrows.body_key
        lock = self._cache_lock
        lock.acquire()
        try:
            self._pushed_bodies += 1
            size = self._cache_bytes + len(body)
            if size <= self._cache_budget:
                self._cache[seq] = body
                self._cache_bytes = size
        finally:
            lock.release()
        _fail.point("queue.var_push.after_body")

    def _cache_put(self, seq: int, body: bytes) -> None:
        """Cache ``seq``'s body if it fits in the room the budget has left; a full cache
        takes no new body (it keeps the oldest, which the queue leases first)."""
        with self._cache_lock:
            size = self._cache_bytes + len(body)
            if size <= self._cache_budget:
                self._cache[seq] = body
                self._cache_bytes = size

    def _cache_put_ids(self, ids: list[int], bodies: list[bytes]) -> None:
        """:meth:`_cache_put` of a batch's bodies (``ids[i]`` is ``bodies[i]``'s id) while
        they fit, under one hold of the cache's lock, by one compiled call."""
        budget = self._cache_budget
        if budget <= 0:
            return
        with self._cache_lock:
            self._cache_bytes = cache_put_ids(self._cache, ids, bodies, budget, self._cache_bytes)

    def _cache_drop_many(self, ids: np.ndarray) -> None:
        """:meth:`_cache_drop` of a batch's ids (``uint64``), under one hold of the
        cache's lock, by a compiled loop."""
        if self._cache:
            with self._cache_lock:
                self._cache_bytes -= cache_drop(self._cache, ids)

    def _cache_pop(self, ids: np.ndarray) -> list[bytes] | None:
        """The cached bodies of ``ids`` (``uint64``), taken out of the cache, or None (and
        the cache unchanged) unless all of them are cached: a batch lease's bodies, under
        one hold of the cache's lock, by a compiled loop."""
        with self._cache_lock:
            got = cache_pop(self._cache, ids)
            if got is None:
                return None
            self._cache_bytes -= got[1]
            return got[0]

    def _cache_get(self, seq: int) -> bytes | None:
        if not self._cache:
            return None
        with self._cache_lock:
            return self._cache.get(seq)

    def _cache_drop(self, seq: int) -> None:
        """Drop ``seq``'s cached body, if any (the lock by acquire and release: see _put_body)."""
        lock = self._cache_lock
        lock.acquire()
        try:
            body = self._cache.pop(seq, None)
            if body is not None:
                self._cache_bytes -= len(body)
        finally:
            lock.release()

    def _notify(self) -> None:
        """Wake blocking and async waiters at once (Q19).

        The generation changes first, without the lock; a waiter counts itself in
        ``_nwaiters`` before it compares the generation (both under the lock).  So
        either the waiter sees the new generation and does not sleep, or this push
        sees the waiter and notifies it (taking the lock, so only once it waits).
        """
        self._gen = next(self._gens)
        if self._nwaiters:
            with self._cond:
                self._cond.notify_all()
        waker = self._db._waker
        if waker is not None and waker._waiters:
            waker.poke()

    # -- lease (Q9-Q11) ---------------------------------------------------------------------------
    def lease(self, n: int = 1, *, lease_timeout: timedelta | float | None = None) -> list[Lease[T]]:
        """Lease up to ``n`` due rows in key order; never blocks, may return ``[]``.

        A row is due when it is ready and its due time has come, or leased with an
        expired deadline.  A row whose lease expired after ``max_attempts``
        deliveries is dead-lettered instead.  A var row whose body cannot be read or
        decoded (it fails its checks, or the payload class refuses the stored fields)
        is dead-lettered alone, logged at WARNING and counted in ``stats().poisoned``;
        the other rows are returned.

        ``n`` is at most :data:`MAX_LEASE` (1,000,000) per call; lease more in batches.

        Raises
        ------
        ConfigError
            ``n`` is not an int in ``1..MAX_LEASE``, or a non-positive ``lease_timeout``;
            nothing changes.
        """
        # On an open queue this method is shadowed by the compiled lease (FixedFast.lease,
        # or VarFast.lease for a var queue: see _open), which hands all but the common case
        # to _lease.
        return self._lease(n, lease_timeout)

    def _lease(self, n: int, lease_timeout: timedelta | float | None) -> list[Lease[T]]:
        lease_ms = self._lease_arg(n, lease_timeout, "lease")
        now = self._check()
        deadline = lease_deadline(now, lease_ms, lease_timeout, "lease_timeout")
        # One datetime per millisecond of deadlines: a datetime costs more than a lease.
        last = self._last_deadline
        if last[0] != deadline:
            last = self._last_deadline = (deadline, ms_to_datetime(deadline))
        dl = last[1]
        # Fixed queue: the Leases.  Var queue: (due, seq, shard, attempt, epoch, b""), for
        # the body is read after the claim.
        out: list[Any] = []
        if len(self._shards) == 1:
            # Scan and claim under one hold of the lock: with one shard there is no
            # merge between the phases, and a candidate found under the lock is still there.
            sh = self._shards[0]
            with sh.lock:
                dead = sh.claim(now, deadline, n, self._max_attempts, 0, out, dl)
            if dead:
                self._note_dead(now)
        while len(self._shards) > 1 and len(out) < n:
            want = n - len(out)
            cands = self._scan(now, want)
            if not cands:
                break
            progressed = False
            for due, seq, shard_no, slot in cands:
                if len(out) >= n:
                    break
                got = self._claim(shard_no, due, seq, slot, now, deadline, dl)
                if got is None:
                    continue
                progressed = True
                if got is not False:
                    out.append(got)
            if not progressed:
                break
        if self._payload is None:
            if lease_ms != self._lease_ms and out:
                self._remember_timeouts((lz.token for lz in out), lease_ms)
            return out
        handle = self._handle
        new = tuple.__new__  # the NamedTuples without their Python-level __new__
        payloads = self._read_payloads([(row[2], row[0], row[1], row[4]) for row in out])
        leases: list[Lease[T]] = [
            new(Lease, (seq, payload, attempt, dl, new(LeaseToken, (handle, shard_no, due, seq, epoch))))
            for (due, seq, shard_no, attempt, epoch, _), payload in zip(out, payloads, strict=True)
            if payload is not _GONE]
        if lease_ms != self._lease_ms and leases:
            self._remember_timeouts((lz.token for lz in leases), lease_ms)
        return leases

    def _lease_arg(self, n: object, lease_timeout: timedelta | float | None, call: str) -> int:
        """Check the arguments of a lease call; returns the lease timeout in ms."""
        if type(n) is not int and (not isinstance(n, int) or isinstance(n, bool)) or n < 1:  # type: ignore[operator]
            raise ConfigError(f"{call}(n) needs an int n >= 1, got {n!r}")
        if n > MAX_LEASE:  # type: ignore[operator]
            raise ConfigError(
                f"{call}(n) takes at most {MAX_LEASE:,} rows per call, got {n:,}; lease in batches"
            )
        if lease_timeout is None:
            return self._lease_ms
        timeout = to_seconds(lease_timeout, "lease_timeout")
        if timeout < 0.001:
            raise ConfigError(f"lease_timeout must be positive, at least 1 ms, got {lease_timeout!r}")
        return int(round(timeout * 1000))

    def _remember_timeouts(self, tokens: Iterable[LeaseToken], lease_ms: int) -> None:
        """Leases taken with a timeout other than the queue's: what ``extend`` without
        ``by`` extends them by (Q29).  Bounded: past :data:`MAX_REMEMBERED` the oldest are
        forgotten (such a lease is then extended by the queue's timeout)."""
        with self._counter_lock:
            timeouts = self._lease_timeouts
            for tok in tokens:
                timeouts[(tok.seq, tok.epoch)] = lease_ms
            while len(timeouts) > MAX_REMEMBERED:
                # pop, not del: an ack or nack on another thread may forget the same one
                timeouts.pop(next(iter(timeouts)), None)

    def extend(self, lease: Lease[T] | LeaseToken, *, by: timedelta | float | None = None) -> datetime:
        """Move a lease's deadline to ``now + by`` and return it (UTC) (Q29).

        Works on an unexpired lease and on an expired one that nobody leased again; the
        token stays valid.  A header update, crash-safe like a lease: after a reopen the
        row's deadline is the last one an ``extend`` returned (or a later one).

        Parameters
        ----------
        lease : Lease or LeaseToken
        by : timedelta or float seconds, optional
            Default: the lease timeout this lease was taken with.

        Raises
        ------
        StaleToken
            The row was leased again, acked, nacked or dead-lettered; nothing changes.
        ConfigError
            ``by`` is not positive.
        NotALease
            ``lease`` is neither a ``Lease`` nor a ``LeaseToken``.
        """
        token = as_token(lease)
        now = self._check()
        if by is None:
            by_ms = self._lease_timeouts.get((token.seq, token.epoch), self._lease_ms)
        else:
            by_ms = to_ms(by, "by")
            if by_ms <= 0:
                raise ConfigError(f"by must be positive, at least 1 ms, got {by!r}")
        deadline = lease_deadline(now, by_ms, by, "by")
        sh = self._token_shard(token)
        with sh.lock:
            slot, _hdr = self._validate_locked(sh, token)
            fixed = sh.fixed
            image = transitions.extend(fixed.sf.body(slot, 0, self._row_size), deadline)
            fixed.write(slot, image, ring_next(int(fixed.versions[slot])))
            sh.live.set_deadline(token.due, token.seq, deadline)
        return ms_to_datetime(deadline)

    def release_many(self, leases: LeaseBatch[T] | Iterable[Lease[T] | LeaseToken]) -> int:
        """Give back leases whose work has not started (P6); return how many were released.

        Each row is ready again at once, under its key (so in its place in key order), with
        the attempt its lease counted taken back: the next delivery has the attempt number
        this one had.  The token is stale from then on.  A lease no longer held (acked,
        nacked, dead-lettered, or expired and leased again) is left alone and not counted.
        A header update, crash-safe like a lease: after a crash the row is either still
        leased until its deadline or ready.

        Raises
        ------
        StaleToken
            A token comes from another queue handle (another queue, or before a reopen);
            nothing is released.
        NotALease
            An item is neither a ``Lease`` nor a ``LeaseToken``.
        """
        toks = self._token_list(leases, "release_many", "")
        self._check()
        released = 0
        for t in toks:
            sh = self._shards[t.shard]
            with sh.lock:
                cur = sh.live.get(t.due, t.seq)
                if cur is None:
                    continue
                slot = cur[0]
                hdr = self._header(sh, slot)
                if hdr[0] != State.LEASED or hdr[3] != t.epoch:
                    continue
                fixed = sh.fixed
                image = transitions.release(fixed.sf.body(slot, 0, self._row_size))
                fixed.write(slot, image, ring_next(int(fixed.versions[slot])))
                sh.live.set_deadline(t.due, t.seq, 0)
            released += 1
            if self._lease_timeouts:
                self._lease_timeouts.pop((t.seq, t.epoch), None)
        if released:
            self._notify()
        return released

    def _dead_letter_poisoned(self, poisoned: list[tuple[LeaseToken, Exception]]) -> None:
        """Dead-letter, one by one, the rows this lease claimed but cannot hand out.

        One body that cannot be read (corrupt, missing, or no longer decodable by the
        payload class) must not take the rest of the batch with it: retried with the
        batch, it would burn the attempts of every healthy row leased beside it.  Each
        such row goes through the explicit dead-letter transition of ``nack(dead=True)``;
        the reason is logged and the row counted in ``stats().poisoned``.
        """
        for token, err in poisoned:
            try:
                self._commit_settle(self._db, self, token, False, None, True, True)
            except StaleToken:
                # Our lease expired meanwhile and another caller took the row; it meets
                # the same body and dead-letters it.
                log.info("queue %s: row %d cannot be decoded (%s: %s); another caller holds it now",
                         self.name, token.seq, type(err).__name__, err)
                continue
            except EncryptionKeyRequired:
                # An encrypted queue in a Db without a log key cannot settle anything.  The
                # row stays leased and is never handed out; once its attempts are used up
                # the lease scan dead-letters it (that transition needs no log record).
                log.warning("queue %s: row %d cannot be decoded at lease (%s: %s); it stays leased "
                            "(dead-lettering it needs TxConfig(log_encryption_key=...)), the rest of the "
                            "batch is delivered", self.name, token.seq, type(err).__name__, err)
                continue
            with self._counter_lock:
                self._poisoned += 1
            log.warning("queue %s: row %d cannot be decoded at lease (%s: %s); dead-lettered it, and "
                        "delivered the rest of the batch", self.name, token.seq, type(err).__name__, err)

    def _body_for_lease(self, shard_no: int, due: int, seq: int, epoch: int) -> bytes | None:
        """A leased row's body, read after the claim (never under the header lock: a
        commit takes the payload shard's lock before the header shard's).

        In between, the lease can expire and the row be re-leased and acked elsewhere,
        which deletes the body.  A missing body is therefore corruption only if the row
        still holds this lease; otherwise the row is simply no longer ours (None).
        """
        assert self._payload is not None
        body = self._cache_get(seq)
        if body is None:
            body = self._payload.get(self._key_bytes(seq))
        if body is not None:
            return body
        sh = self._shards[shard_no]
        with sh.lock:
            cur = sh.live.get(due, seq)
            ours = cur is not None and self._header(sh, cur[0])[3] == epoch
        if ours:  # bodies are written before headers and deleted after them (Q15)
            raise FormatError(f"queue {self.name!r}: row {seq} has no body; run armdb.check")
        return None

    def _scan(self, now: int, want: int) -> list[tuple[int, int, int, int]]:
        """Phase 1: candidate keys from every shard, merged in key order."""
        cands: list[tuple[int, int, int, int]] = []
        for i, sh in enumerate(self._shards):
            with sh.lock:
                found = sh.live.candidates(now, want)
            cands.extend((due, seq, i, slot) for due, seq, slot in found)
        if len(self._shards) > 1:
            cands.sort()
            del cands[want:]
        return cands

    def _claim(self, shard_no: int, due: int, seq: int, slot: int, now: int, deadline: int, dl: datetime) -> Any:
        """Phase 2: re-check and lease one candidate under its shard lock.

        Returns the lease tuple, ``False`` if it was dead-lettered instead, or
        ``None`` if another caller took it first.
        """
        sh = self._shards[shard_no]
        with sh.lock:
            got = sh.claim_one(due, seq, slot, now, deadline, self._max_attempts, shard_no, dl)
        if got is False:
            self._note_dead(now)
        return got

    def _note_dead(self, now: int) -> None:
        """A row was dead-lettered at ``now``: bring the next retention pass forward."""
        keep = self._retention_ms
        if keep is not None:
            self._next_retention = min(self._next_retention, now + keep)

    def _settle_row(self, sh: _Shard, due: int, seq: int, slot: int, moved: transitions.Moved, now: int,
                    version: int = 0, *, nack: bool = True) -> None:
        """Apply a settle that :func:`armdb.transitions.nack` computed for the row keyed
        ``(due, seq)`` in ``slot`` (caller holds ``sh.lock``): its new image (``version`` 0:
        the next on the slot's ring), its key in the live or the dead index, the counters."""
        sh.fixed.write(slot, moved.image, version)
        sh.live.remove(due, seq)
        if moved.dead:
            sh.dead.insert(moved.due, seq, slot, 0)
            sh.dead_lettered += 1
            self._note_dead(now)
        else:
            sh.live.insert(moved.due, seq, slot, 0)
        if nack:
            sh.nacks += 1

    # -- settle (Q13, Q14) ------------------------------------------------------------------------
    def _token_shard(self, token: object) -> _Shard:
        """The shard a token points into, after the checks that need no lock (Q13)."""
        token = as_token(token)
        if token.handle != self._handle or not 0 <= token.shard < len(self._shards):
            raise StaleToken(
                f"this token was issued by another queue handle (another queue, or before a reopen); "
                f"lease the row again from queue {self.name!r}"
            )
        return self._shards[token.shard]

    def _validate_locked(self, sh: _Shard, token: LeaseToken) -> tuple[int, tuple[int, ...]]:
        """The row's slot and header if ``token`` still holds its lease (caller holds ``sh.lock``)."""
        cur = sh.live.get(token.due, token.seq)
        if cur is None:
            raise self._stale(token, True)
        slot = cur[0]
        hdr = self._header(sh, slot)
        if hdr[0] != State.LEASED or hdr[3] != token.epoch:
            raise self._stale(token, False)
        return slot, hdr

    def _holds(self, token: LeaseToken) -> bool:
        """Whether ``token`` still holds its lease (a settle or extend would accept it):
        one index lookup and one header read under the shard lock, nothing written.  The
        server prunes the tokens a connection remembers with it.  ``DbClosed`` once closed."""
        self._check()
        if token.handle != self._handle or not 0 <= token.shard < len(self._shards):
            return False
        sh = self._shards[token.shard]
        with sh.lock:
            cur = sh.live.get(token.due, token.seq)
            if cur is None:
                return False
            hdr = self._header(sh, cur[0])
            return bool(hdr[0] == State.LEASED and hdr[3] == token.epoch)

    @staticmethod
    def _stale(token: LeaseToken, absent: bool) -> StaleToken:
        if absent:
            return StaleToken(f"row {token.seq} was already acked, nacked or dead-lettered; nothing changed")
        return StaleToken(f"row {token.seq} was leased again since this token was issued; nothing changed")

    def _settle_begin(self, token: object) -> tuple[_Shard, int, tuple[int, ...]]:
        """Validate a token under its shard lock (caller must release ``sh.lock``)."""
        sh = self._token_shard(token)
        sh.lock.acquire()
        try:
            slot, hdr = self._validate_locked(sh, typing.cast(LeaseToken, token))
        except BaseException:
            sh.lock.release()
            raise
        return sh, slot, hdr

    def ack(self, token: Lease[T] | LeaseToken) -> None:
        """Remove a leased row (and its body, for a var queue).

        Parameters
        ----------
        token : Lease or LeaseToken
            What :meth:`lease` returned for the row, or its ``token``.

        Raises
        ------
        StaleToken
            The token is from another handle, or the row was leased again, acked,
            nacked or dead-lettered since; nothing changes.
        NotALease
            ``token`` is neither a ``Lease`` nor a ``LeaseToken``.
        """
        # On an open queue this method is shadowed by the compiled ack (FixedFast.ack for
        # a fixed queue, VarFast.ack for a var one, whose common token goes straight to
        # its commit: see _open), which hands all but the common case to _ack.
        self._ack(token)

    def _ack(self, token: Lease[T] | LeaseToken) -> None:
        token = as_token(token)
        if self._lease_timeouts:
            self._lease_timeouts.pop((token.seq, token.epoch), None)
        self._check()
        if self._payload is not None:
            # Header removal and body delete share one log commit (Q14), which trusts
            # the token's handle and shard: StaleToken here for another handle's.
            self._token_shard(token)
            self._commit_settle(self._db, self, token, True)
            return
        sh = self._token_shard(token)  # StaleToken for a token of another handle
        with sh.lock:
            r = sh.ack_token(token)
        if r != ACKED:
            raise self._stale(token, r == ABSENT)

    def nack(self, token: Lease[T] | LeaseToken, *, delay: timedelta | float | None = None,
             dead: bool = False) -> None:
        """Give a leased row back: ready again at ``now + backoff`` (or ``now + delay``),
        re-keyed; dead-lettered when its attempts reached ``max_attempts`` or ``dead=True``.

        Raises
        ------
        StaleToken
            As for :meth:`ack`; nothing changes.
        NotALease
            ``token`` is neither a ``Lease`` nor a ``LeaseToken``.
        """
        token = as_token(token)
        if self._lease_timeouts:
            self._lease_timeouts.pop((token.seq, token.epoch), None)
        now = self._check()
        delay_ms = nack_args(delay, dead)
        if self._payload is not None:
            # A var queue's transitions go through the transaction log (Q7, Q14).
            self._commit_settle(self._db, self, token, False, delay_ms, dead)
            return
        sh, slot, _hdr = self._settle_begin(token)
        try:
            moved = transitions.nack(sh.fixed.sf.body(slot, 0, self._row_size), now, self.config, delay_ms, dead)
            self._settle_row(sh, token.due, token.seq, slot, moved, now)
            sh.fixed.raise_sync_error()
        finally:
            sh.lock.release()
        self._notify()

    # -- counts and waiting (Q18, Q19) ------------------------------------------------------------
    def len(self) -> int:
        """Live rows: ready, delayed and leased (dead rows excluded)."""
        if self._closed or self._db.closed:
            raise DbClosed(f"queue {self.name!r} (its Db is closed)")
        return sum(len(sh.live) for sh in self._shards)

    def __len__(self) -> int:
        return self.len()

    def dead_len(self) -> int:
        """Dead-lettered rows not yet swept by retention."""
        if self._closed or self._db.closed:
            raise DbClosed(f"queue {self.name!r} (its Db is closed)")
        return sum(len(sh.dead) for sh in self._shards)

    def _next_due_ms(self, now: int) -> int:
        best = -1
        for sh in self._shards:
            with sh.lock:
                t = sh.live.next_due(now)
            if t >= 0 and (best < 0 or t < best):
                best = t
        return best

    def next_delay(self) -> timedelta | None:
        """``None`` when no live row exists, ``timedelta(0)`` when one is due now, else
        the time until the earliest due time or lease deadline (Q18)."""
        now = self._check()
        t = self._next_due_ms(now)
        if t < 0:
            return None
        return timedelta(milliseconds=max(0, t - now))

    def _wait_seconds(self) -> float | None:
        """0 when due now; else seconds to sleep before looking again (bounded by recheck)."""
        now = self._check()
        t = self._next_due_ms(now)
        if t >= 0 and t <= now:
            return 0.0
        recheck = self.config.wakeup_recheck
        if t < 0:
            return recheck
        return min(recheck, (t - now) / 1000)

    def wait_due_timeout(self, timeout: timedelta | float) -> bool:
        """Block until a row is due or ``timeout`` passes.  ``True`` is advisory (Q19).

        Raises
        ------
        DbClosed
            The database was closed before or while waiting.
        """
        limit = time.monotonic() + to_seconds(timeout, "timeout")
        while True:
            gen = self._gen
            wait = self._wait_seconds()
            if wait == 0:
                return True
            remaining = limit - time.monotonic()
            if remaining <= 0:
                return False
            with self._cond:
                if self._closed:
                    raise DbClosed(f"queue {self.name!r} (its Db was closed while waiting)")
                self._nwaiters += 1  # before the comparison: see _notify
                try:
                    if self._gen == gen:  # no push since we looked: sleep
                        self._cond.wait(min(remaining, typing.cast(float, wait)))
                finally:
                    self._nwaiters -= 1

    async def due(self) -> None:
        """Resolve when a row is due (advisory, like :meth:`wait_due_timeout`).

        Raises
        ------
        DbClosed
            The database shuts down while waiting.
        """
        loop = asyncio.get_running_loop()
        while True:
            gen = self._gen
            wait = self._wait_seconds()
            if wait == 0:
                return
            fut: asyncio.Future[None] = loop.create_future()
            self._db._waker.register(self, loop, fut, typing.cast(float, wait), gen)
            await fut

    # -- retention (Q22-Q25) --------------------------------------------------------------------------
    def _schedule_retention(self) -> None:
        keep = self._retention_ms
        if keep is None:
            self._next_retention = 1 << 62 if not self._retry and not self._retry_overflow else 0
            return
        first = -1
        for sh in self._shards:
            with sh.lock:
                k = sh.dead.min_key()
            if k is not None:
                t = transitions.dead_since(k[0]) + keep
                first = t if first < 0 else min(first, t)
        self._next_retention = (1 << 62) if first < 0 else first
        if self._retry or self._retry_overflow:
            self._next_retention = 0

    def _remember_retry(self, seq: int) -> None:
        if len(self._retry) < RETRY_LIST_CAP:
            self._retry.append(seq)
        else:
            self._retry_overflow = True
        self._next_retention = 0

    def _sweep(self, *, raise_errors: bool, now: int | None = None) -> None:
        """One retention pass: sweep expired dead rows, drain the body retry list."""
        if now is None:
            now = int(self._clock())
        first_error: BaseException | None = None
        keep = self._retention_ms
        if keep is not None:
            cutoff = now - keep
            for sh in self._shards:
                swept: list[int] = []
                try:
                    with sh.lock:
                        while True:
                            k = sh.dead.min_key()
                            if k is None or transitions.dead_since(k[0]) > cutoff:
                                break
                            slot = typing.cast(tuple[int, int], sh.dead.get(*k))[0]
                            sh.fixed.free(slot)
                            sh.dead.remove(*k)
                            swept.append(k[1])
                except Exception as e:
                    first_error = first_error or e
                for seq in swept:
                    self._cache_drop(seq)
                    _fail.point("queue.retention.after_delete")
                    if self._payload is not None:
                        try:
                            self._payload.delete(self._key_bytes(seq))
                        except Exception as e:
                            self._remember_retry(seq)
                            first_error = first_error or e
        if self._payload is not None and not self._retention_paused:
            pending, self._retry = self._retry, []
            for seq in pending:
                try:
                    self._payload.delete(self._key_bytes(seq))
                except Exception as e:
                    self._retry.append(seq)
                    first_error = first_error or e
            if self._retry_overflow and first_error is None:
                try:
                    self._orphan_pass()
                except Exception as e:
                    first_error = first_error or e
        self._schedule_retention()
        if first_error is not None:
            self._next_retention = now + 1000  # back off one second before trying again
            if raise_errors:
                raise first_error
            if not isinstance(first_error, DbClosed):  # a close raced the pass: nothing to report
                log.warning("queue %s: retention failed: %s", self.name, first_error)

    # -- inspection and dead letters (Q33, Q34) --------------------------------------------------------------
    def peek(self, n: int = 10, *, dead: bool = False) -> list[Job[T]]:
        """Read up to ``n`` rows without changing anything (Q33).

        Parameters
        ----------
        n : int
            How many rows, 1 to :data:`MAX_LEASE`.
        dead : bool
            Live rows in key order (due time, then id) when False; dead rows, oldest
            dead-lettered first, when True.

        Returns
        -------
        list of Job

        Raises
        ------
        ConfigError
            ``n`` is not an int in ``1..MAX_LEASE``, or ``dead`` is not a bool.
        """
        _check_count(n, "peek(n)")
        if not isinstance(dead, bool):
            raise ConfigError("dead must be True or False")
        self._check()
        found: list[tuple[int, int, int, int, bytes]] = []  # due, id, state, attempts, inline payload
        for sh in self._shards:
            with sh.lock:
                sh.fixed.check_open()
                due, seq, slot = (sh.dead if dead else sh.live).head(n)[:3]
                rows = rows_of(sh.fixed.slots, np.asarray(slot, dtype=np.intp))
                hdr = rows["header"]
                for i, sl in enumerate(np.asarray(slot).tolist()):
                    inline = b"" if self.spec.var else self._payload_bytes(sh, sl)
                    found.append((int(due[i]), int(seq[i]), int(hdr["state"][i]), int(hdr["attempts"][i]), inline))
        found.sort(key=lambda r: (r[0], r[1]))
        jobs: list[Job[T]] = []
        for due_word, seq_, state, attempts, inline in found[:n]:
            at = transitions.dead_since(due_word) if dead else due_word
            jobs.append(Job(seq_, State(state), attempts, ms_to_datetime(at), self._peek_payload(seq_, inline)))
        return jobs

    def _peek_payload(self, seq: int, inline: bytes) -> Any:
        if not self.spec.var:
            return np.frombuffer(inline, dtype=self.spec.dtype)[0]
        assert self._payload is not None
        raw = self._payload.get(body_key(seq))
        if raw is None:
            return None  # a body retention already removed (the row is going too)
        try:
            return self._codec.decode(raw)  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - a poisoned body: show what is stored
            return raw

    def redrive(self, ids: Any = None, *, delay: timedelta | float | None = None) -> int:
        """Move dead rows back to ready (Q34), in one commit.

        Each row keeps its id and body, is due at ``now + delay`` and has its attempts
        reset to 0; ids that are not dead rows of this queue are ignored.  After a crash
        either every row the call moves is ready or none is.

        Parameters
        ----------
        ids : iterable of int, optional
            The rows to move; every dead row when None.
        delay : timedelta or float seconds, optional
            When they are due again (default: now).

        Returns
        -------
        int
            How many rows moved.

        Raises
        ------
        QueueFull
            The moved rows would pass ``max_depth``; nothing moves.
        ConfigError
            ``ids`` holds something other than ints, or ``delay`` is negative.
        """
        delay_ms = 0 if delay is None else to_ms(delay, "delay")
        if delay_ms < 0:
            raise ConfigError(f"delay must not be negative, got {delay!r}")
        return self._commit_dead(_id_set(ids), True, delay_ms)

    def purge_dead(self, ids: Any = None) -> int:
        """Delete dead rows and their bodies (Q34), in one commit; ids that are not dead
        rows of this queue are ignored.  Returns how many were deleted.

        Raises
        ------
        ConfigError
            ``ids`` holds something other than ints.
        """
        return self._commit_dead(_id_set(ids), False, 0)

    def _commit_dead(self, ids: frozenset[int] | None, redrive: bool, delay_ms: int) -> int:
        self._check()
        return self._commit_dead_rows(self._db, self, ids, redrive, delay_ms)

    # -- inspection (Q26, Q27) ---------------------------------------------------------------------------
    def stats(self) -> QueueStats:
        """Counters and sizes of this queue (Q26)."""
        if self._closed or self._db.closed:
            raise DbClosed(f"queue {self.name!r} (its Db is closed)")
        now = int(self._clock())
        ready = leased = delayed = dead = 0
        for sh in self._shards:
            with sh.lock:
                r, lz, d = sh.live.count_due(now)
                dead += len(sh.dead)
            ready += r
            leased += lz
            delayed += d
        assert self._headers is not None
        shards = self._headers.shards
        pstats = self._payload.stats() if self._payload is not None else {}
        return QueueStats(
            name=self.name,
            len=ready + leased + delayed,
            dead_len=dead,
            ready=ready,
            leased=leased,
            delayed=delayed,
            shards=len(shards),
            slots_allocated=sum(s.capacity for s in shards),
            version_vector_bytes=sum(s.versions.nbytes for s in shards),
            header_file_logical_bytes=sum(s.logical_bytes() for s in shards),
            header_file_physical_bytes=sum(s.physical_bytes() for s in shards),
            payload_writes=self._payload_writes + self._pushed_bodies,
            compaction_bytes=0,  # FixedStore updates in place and never compacts (Q15)
            payload_compaction_bytes=int(pstats.get("compaction_bytes", 0)),
            pushes=sum(sh.pushes for sh in self._shards),
            acks=sum(sh.acks for sh in self._shards),
            nacks=sum(sh.nacks for sh in self._shards),
            dead_lettered=sum(sh.dead_lettered for sh in self._shards),
            poisoned=self._poisoned,
            expired_leases=sum(sh.expired_leases for sh in self._shards),
            repaired_on_open=self._headers.repaired_on_open,
            retention_retry_pending=len(self._retry),
            orphans_collected=self._orphans_collected,
        )

    def snapshot(self) -> np.ndarray:
        """Every live and dead header as a NumPy structured array (Q27).

        Fields: ``id`` (u8), ``state`` (u1, :class:`State`), ``due`` (datetime64[ms];
        for a dead row, when it was dead-lettered), ``attempts``, ``epoch``,
        ``deadline`` (datetime64[ms], NaT for a row never leased).  Rows come in key
        order per shard, live rows before dead ones.
        """
        if self._closed or self._db.closed:
            raise DbClosed(f"queue {self.name!r} (its Db is closed)")
        parts = []
        for sh in self._shards:
            with sh.lock:
                sh.fixed.check_open()  # DbClosed if a close unmapped the file meanwhile
                slots = np.concatenate([sh.live.to_arrays()[2], sh.dead.to_arrays()[2]]).astype(np.intp)
                # The rows are copied out of the map while the lock is held.
                parts.append(rows_of(sh.fixed.slots, slots))
        rows = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, ROW_DTYPE)
        return to_snapshot(rows)

    def snapshot_frame(self) -> Any:
        """:meth:`snapshot` as a ``pandas.DataFrame`` (Jupyter), with ``state`` a categorical
        of the :class:`State` names (READY, LEASED, DEAD).  Needs pandas (the ``notebook``
        extra); ``pandas.DataFrame(q.snapshot())`` is the same without the categorical."""
        import pandas as pd  # optional, heavy: only this method needs it (the notebook extra)

        df = pd.DataFrame(self.snapshot(), copy=False)
        df["state"] = pd.Categorical.from_codes(df["state"], categories=[s.name for s in State])
        return df

    # -- what a db.tx() commit calls (armdb.tx; private to armdb) ---------------------------------
    # A commit reaches a queue through these methods and the public ``name``, ``config``
    # and ``len()``, nothing else: it checks the handle (_belongs_to), encodes a payload
    # (_encode, bound at open), draws row ids from its plan by the queue's sequence name
    # (_seq_name, read at open), asks whether a log key is
    # needed (_body_sealed, read at open), collects the locks of its steps (_tx_locks, _tx_all_locks),
    # plans each push and settle into its armdb.plan.Plan under those locks (_tx_push,
    # _tx_settle), and afterwards counts body writes (_tx_count_payload_writes), wakes
    # waiters (_notify) or, when the commit failed after its log append, pauses retention
    # until the reopen (_tx_fence).  docs/architecture.md follows a var ack through them.

    def _belongs_to(self, db: Db) -> bool:
        return self._db is db

    def _tx_locks(self, locks: dict[str, threading.Lock], seq: int, token: object, *, body: bool = True) -> None:
        """Add the locks a push of row ``seq`` (``token`` None) or a settle of ``token``
        needs to ``locks`` (keyed by the global order, docs/transactions.md): its header
        shard's and, for a var queue, its body's payload shard's (not for a lone nack,
        ``body=False``: it leaves the body alone).  A token that names no shard of this
        handle adds nothing (the plan refuses it as stale)."""
        shards = self._shards
        if token is None:
            sh = shards[seq % len(shards)]
        else:
            if not (isinstance(token, LeaseToken) and 0 <= token.shard < len(shards)):
                return
            seq = token.seq
            sh = shards[token.shard]
        locks[sh.fixed.directory] = sh.lock
        if body and self._payload is not None:
            k, lock = self._payload.shard_lock(seq.to_bytes(8, "big"))  # qrows.body_key
            locks[k] = lock

    def _tx_ack_locks(self, sh: _Shard, key: bytes) -> dict[str, threading.Lock]:
        """The locks of a var ack of the row with body ``key`` in header shard ``sh``, by
        their global order keys (armdb.tx.commit_settle, when the body store has shards)."""
        k, lock = self._payload.shard_lock(key)  # type: ignore[union-attr]
        return {sh.fixed.directory: sh.lock, k: lock}

    def _tx_all_locks(self, locks: dict[str, threading.Lock]) -> None:
        """Add every lock of the queue: a change stream's destination (T7), a batch.
        The shards and their locks are fixed once the queue is open: listed once."""
        items = self._all_lock_items
        if items is None:
            items = [(sh.fixed.directory, sh.lock) for sh in self._shards]
            if self._payload is not None:
                items += [(k, lock) for (k, _), lock in self._payload.all_locks()]
            self._all_lock_items = items
        locks.update(items)

    def _tx_push(self, plan: Plan, seq: int, body: bytes, now: int, delay_ms: int) -> None:
        """Plan a push of row ``seq`` (its shard's lock held): a slot and its version, the
        logged rows (the body first, for a var queue), and how to apply them."""
        sh = self._shards[seq % len(self._shards)]
        fixed = sh.fixed
        due = now + delay_ms
        slot = fixed.alloc()
        plan.allocated.append((fixed, slot))
        version = ring_next(int(fixed.versions[slot]))
        payload = self._payload
        if payload is not None:
            row = transitions.push(seq, due, now, seq)
            key = body_key(seq)
            gsn = plan.gsn()
            plan.rows.append(["B", self.spec.payload_name, key, body, gsn])
            plan.add_bitcask(payload)
            plan.payload_writes[self] = plan.payload_writes.get(self, 0) + 1

            def apply_body() -> None:
                payload.write_locked(key, body, gsn)
                self._cache_put(seq, body)

            plan.apply.append(apply_body)
        else:
            row = transitions.push(seq, due, now, 0, body)
        plan.rows.append(["F", self.name, fixed.index, slot, version, OCCUPIED, row])
        if fixed not in plan.fixed:  # plan.add_fixed, one frame less
            plan.fixed.append(fixed)
        # A partial, not a closure: a closure makes a cell of each of the seven names it
        # reads, and every read of them here goes through its cell.
        plan.apply.append(functools.partial(_apply_push, sh, slot, row, version, due, seq))

    def _tx_settle(self, plan: Plan, token: object, ack: bool, delay_ms: int | None, dead: bool, poisoned: bool,
                   now: int) -> None:
        """Plan an ack or a nack of ``token`` (its locks held): ``StaleToken`` unless it
        still holds its lease; else the logged rows and how to apply them.  ``poisoned``:
        the dead-letter of a row whose body a lease could not decode (not counted as a nack)."""
        sh = self._token_shard(token)
        tok: LeaseToken = token  # type: ignore[assignment]  # _token_shard checked it (no typing.cast call here)
        fixed = sh.fixed
        if ack:
            # One call each to find the leased slot and, once logged, to free it.
            slot, version = sh.settle_slot(tok.due, tok.seq, tok.epoch)
            if slot < 0:
                raise self._stale(tok, version == ABSENT)
            plan.rows.append(["F", self.name, fixed.index, slot, version, DELETED, b""])
            plan.add_fixed(fixed)

            # (No cache entry to drop: the lease took the row's body out of the cache.)
            plan.apply.append(functools.partial(sh.ack_slot, tok.due, tok.seq, slot, version))
            payload = self._payload
            if payload is not None:
                key = tok.seq.to_bytes(8, "big")  # qrows.body_key
                gsn = plan.gsn()
                plan.rows.append(["B", self.spec.payload_name, key, None, gsn])
                plan.add_bitcask(payload)
                plan.apply.append(lambda: payload.write_locked(key, None, gsn))
            return
        slot, _hdr = self._validate_locked(sh, tok)
        version = ring_next(int(fixed.versions[slot]))
        moved = transitions.nack(fixed.sf.body(slot, 0, self._row_size), now, self.config, delay_ms, dead, poisoned)
        plan.rows.append(["F", self.name, fixed.index, slot, version, OCCUPIED, moved.image])
        plan.add_fixed(fixed)
        plan.apply.append(lambda: self._settle_row(sh, tok.due, tok.seq, slot, moved, now, version,
                                                   nack=not poisoned))

    def _tx_dead_rows(self, plan: Plan, ids: frozenset[int] | None, redrive: bool, delay_ms: int,
                      now: int) -> int:
        """Plan a redrive (or a purge) of the dead rows ``ids`` (every one: None), all this
        queue's locks held; returns how many rows it moves.  ``QueueFull`` when a redrive
        would pass ``max_depth`` (Q21, Q34)."""
        picked: list[tuple[_Shard, int, int, int]] = []  # shard, dead key due, id, slot
        wanted = None if ids is None else np.fromiter(ids, np.uint64, len(ids))
        for sh in self._shards:
            dues, seqs, slots = sh.dead.to_arrays()[:3]
            if wanted is not None:
                sel = np.isin(seqs, wanted)
                dues, seqs, slots = dues[sel], seqs[sel], slots[sel]
            for d, q, sl in zip(dues.tolist(), seqs.tolist(), slots.tolist(), strict=True):
                picked.append((sh, d, q, sl))
        cap = self._max_depth
        if redrive and cap is not None and picked:
            live = sum(len(sh.live) for sh in self._shards)
            if live + len(picked) > cap:
                raise QueueFull(
                    f"queue {self.name!r}: redriving {len(picked)} rows would leave {live + len(picked)} live rows, "
                    f"above max_depth={cap}; nothing moved"
                )
        payload = self._payload
        for sh, dkey, rid, slot in picked:
            fixed = sh.fixed
            version = ring_next(int(fixed.versions[slot]))
            plan.add_fixed(fixed)
            if redrive:
                moved = transitions.redrive(fixed.sf.body(slot, 0, self._row_size), now + delay_ms)
                plan.rows.append(["F", self.name, fixed.index, slot, version, OCCUPIED, moved.image])
                plan.apply.append(functools.partial(_apply_redrive, sh, dkey, rid, slot, moved, version))
            else:
                plan.rows.append(["F", self.name, fixed.index, slot, version, DELETED, b""])
                plan.apply.append(functools.partial(_apply_purge, sh, dkey, rid, slot, version))
                if payload is not None:
                    key = body_key(rid)
                    gsn = plan.gsn()
                    plan.rows.append(["B", self.spec.payload_name, key, None, gsn])
                    plan.add_bitcask(payload)
                    plan.apply.append(functools.partial(payload.write_locked, key, None, gsn))
        if not redrive:
            for _sh, _d, rid, _sl in picked:
                plan.apply.append(functools.partial(self._cache_drop, rid))
        return len(picked)

    def _check_room(self, n: int) -> None:
        """``QueueFull`` when a batch of ``n`` pushes would take the queue past ``max_depth``
        (Q21: judged on the whole batch)."""
        cap = self._max_depth
        if cap is not None:
            live = sum(len(sh.live) for sh in self._shards)
            if live + n > cap:
                raise QueueFull(
                    f"queue {self.name!r}: pushing {n} rows would leave {live + n} live rows, above "
                    f"max_depth={cap}; nothing was pushed"
                )

    def _tx_push_many(self, plan: Plan, payloads: Any, n: int, delay_ms: int, ids: list[int] | None = None, *,
                      now: int) -> int:
        """Plan the ``n`` pushes of a batch, every lock of the queue held (armdb.tx.commit_batch;
        returns the first id): ``payloads`` is the rows' bytes end to end (fixed) or the list
        of bodies (var); a var batch's ``ids``, if given, is filled with its ids.  ``QueueFull``
        on the whole batch (Q21).  An ``ack_many`` commits by armdb.tx.commit_ack_many, which
        calls :meth:`_tx_plan_acks` and :meth:`_tx_apply_acks`."""
        self._check_room(n)
        first = plan.draw_block(self._seq_name, n)
        payload = self._payload
        if payload is not None:
            # The bodies first: logged before the headers, applied before them (Q15).
            # Their log rows ["B", payload name, key (qrows.body_key), body, gsn] come
            # packed by a compiled loop, as the headers' do.
            g0 = plan.gsns(n)
            packed, keys = push_body_rows(self._body_row_head, first, payloads, g0)
            plan.packed.append((n, packed))
            plan.add_bitcask(payload)
            plan.payload_writes[self] = plan.payload_writes.get(self, 0) + n

            if ids is None:
                ids = []
            ids.clear()  # (a plan run again refills it)
            ids.extend(range(first, first + n))  # (no list of the range to copy, as ids[:] = range(...) makes)

            def apply_bodies() -> None:
                payload.write_puts_locked(keys, payloads, g0)
                self._cache_put_ids(ids, payloads)

            plan.apply.append(apply_bodies)
        self._plan_blocks(plan, lambda sh, i0, nsh, buf: sh.plan_push_block(
            self._name_field, first, i0, nsh, n, b"" if payload is not None else payloads, now + delay_ms, now,
            payload is not None, buf), first, n)
        return first

    def _plan_blocks(self, plan: Plan, make: Callable[..., Any], first: int, n: int) -> None:
        """Plan a push batch's header rows shard by shard (row ``i`` has id ``first + i``
        and lands in shard ``(first + i) % shards``): their slots, log rows and apply."""
        buf = bytearray()
        rows = 0
        nsh = len(self._shards)
        for k, sh in enumerate(self._shards):
            i0 = (k - first) % nsh
            if i0 >= n:
                continue
            slots, versions, images = make(sh, i0, nsh, buf)
            plan.undo.append(functools.partial(sh.unalloc_block, slots))
            plan.add_fixed(sh.fixed)
            plan.apply.append(functools.partial(sh.apply_push_block, slots, versions, images))
            rows += len(slots)
        plan.packed.append((rows, buf))  # (framed into the log record as it is: no copy)

    def _tx_plan_acks(self, shard_nos: np.ndarray, dues: np.ndarray, seqs: np.ndarray, epochs: np.ndarray,
                      buf: bytearray) -> list[tuple[_Shard, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """Plan the header side of an ``ack_many`` (ids distinct; every lock of the queue
        held, armdb.tx.commit_ack_many): one F row per ack appended to ``buf``, and per
        shard ``(shard, dues, seqs, slots, versions)`` for :meth:`_tx_apply_acks`;
        ``StaleToken`` (nothing planned) if any lease is no longer held."""
        planned = []
        shards = self._shards
        for k, sh in enumerate(shards):
            if len(shards) == 1:
                d, q, e = dues, seqs, epochs
            else:
                sel = shard_nos == k
                d, q, e = dues[sel], seqs[sel], epochs[sel]
                if not len(q):
                    continue
            slots, versions, bad, code = sh.plan_ack_block(self._name_field, d, q, e, buf)
            if slots is None:
                if code == DUPLICATE:  # each row lives in one shard: a repeat is seen there
                    raise StaleToken(f"row {int(q[bad])} appears twice in this batch; nothing was acked")
                tok = LeaseToken(self._handle, k, int(d[bad]), int(q[bad]), int(e[bad]))
                raise StaleToken(f"{self._stale(tok, code == ABSENT)} (nothing of this batch was acked)")
            planned.append((sh, d, q, slots, versions))
        return planned

    @staticmethod
    def _tx_apply_acks(planned: list[tuple[_Shard, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]) -> None:
        """Apply the logged header side of an ``ack_many`` (:meth:`_tx_plan_acks`)."""
        for sh, d, q, slots, versions in planned:
            sh.apply_ack_block(d, q, slots, versions)

    def _tx_count_payload_writes(self, n: int) -> None:
        with self._counter_lock:
            self._payload_writes += n

    def _tx_fence(self) -> None:
        """A commit touching this queue failed after its log append: no retention until
        the reopen replays it (Q25)."""
        self._retention_paused = True

    def __reduce__(self) -> Any:
        raise ProcessBound(
            "a Queue handle cannot be pickled or sent to another process: a handle belongs to the process that "
            "opened the database. Send payloads (and ids) instead, and let the owning process lease and "
            "settle (docs/operations.md, 'Processes')"
        )

    def __repr__(self) -> str:
        flavour = "var" if self.spec.var else "fixed"
        return f"<armdb.Queue {self.name!r} ({flavour})>"


def _apply_push(sh: _Shard, slot: int, row: Any, version: int, due: int, seq: int) -> None:
    """Apply a push that ``Queue._tx_push`` planned (the shard's lock held)."""
    sh.fixed.write(slot, row, version)
    sh.live.insert(due, seq, slot, 0)
    sh.pushes += 1


def _apply_redrive(sh: _Shard, dkey: int, rid: int, slot: int, moved: transitions.Moved, version: int) -> None:
    sh.fixed.write(slot, moved.image, version)
    sh.dead.remove(dkey, rid)
    sh.live.insert(moved.due, rid, slot, 0)


def _apply_purge(sh: _Shard, dkey: int, rid: int, slot: int, version: int) -> None:
    sh.fixed.free(slot, version)
    sh.dead.remove(dkey, rid)


def _check_count(n: object, what: str) -> None:
    if type(n) is not int or n < 1:
        raise ConfigError(f"{what} needs an int n >= 1, got {n!r}")
    if n > MAX_LEASE:
        raise ConfigError(f"{what} takes at most {MAX_LEASE:,} rows per call, got {n:,}")


def _id_set(ids: Any) -> frozenset[int] | None:
    """Row ids given to redrive or purge_dead: None (every dead row), or ints."""
    if ids is None:
        return None
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise ConfigError(f"ids must be an iterable of row ids (ints) or None, not {type(ids).__name__}")
    out = []
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 < int(i) < 1 << 64:
            raise ConfigError(f"ids must be row ids (positive ints), got {i!r}")
        out.append(int(i))
    return frozenset(out)


def nack_args(delay: timedelta | float | None, dead: object) -> int | None:
    """Check a nack's ``delay`` and ``dead`` (any backend, direct or in a transaction);
    returns the delay in ms, or None for the backoff."""
    if not isinstance(dead, bool):
        raise ConfigError("dead must be True or False")
    delay_ms = None if delay is None else to_ms(delay, "delay")
    if delay_ms is not None and delay_ms < 0:
        raise ConfigError(f"delay must not be negative, got {delay!r}")
    return delay_ms


def queue_args(spec: object, config: object) -> QueueConfig:
    """Check ``open_queue``'s arguments (any backend); returns the config (None: the defaults)."""
    if not isinstance(spec, QueueSpec):
        raise ConfigError("open_queue takes the QueueSpec returned by armdb.queue(...)")
    if config is None:
        config = QueueConfig.balanced().build()
    if not isinstance(config, QueueConfig):
        raise ConfigError("open_queue takes a built QueueConfig: QueueConfig.balanced()...build()")
    return config


def open_queue(db: Db, spec: QueueSpec, config: QueueConfig | None, commits: Commits) -> Queue[Any]:
    """``db.open_queue``: validate, open the physical collections, recover (Q2)."""
    config = queue_args(spec, config)
    with db._lock:
        db.check_open()
        if spec.name in db._queues:
            raise QueueAlreadyOpen(
                f"queue {spec.name!r} is already open in this Db; share the handle you have"
            )
        if spec.name in db._maps or spec.payload_name in db._maps:
            raise ConfigError(f"{spec.name!r} is open as a map; a name holds one collection")
        q: Queue[Any] = Queue(db, spec, config, commits)
        try:
            q._open()
        except OSError as e:
            raise as_storage_error(e, f"opening queue {spec.name!r}")
        db._queues[spec.name] = q
        assert q._headers is not None
        db.register_store(spec.name, q._headers)
        return q


# -- background: retention sweeper and the async wake worker -------------------------------------------


def _sweep_tick(db: Db) -> None:
    with db._lock:
        queues = list(db._queues.values())
    for q in queues:
        if not db.closed:
            q._sweep(raise_errors=False)


class Waker(threading.Thread):
    """Resolves ``await queue.due()`` futures from one thread (Q19).

    Each waiter is registered with the time it may sleep (bounded by the queue's
    ``wakeup_recheck``); the thread wakes at the earliest such time, or at once on
    a push (``poke``), and resolves the futures with ``loop.call_soon_threadsafe``.
    The coroutine then re-checks and registers again if nothing is due.  At
    shutdown every waiter gets ``DbClosed``.
    """

    def __init__(self, db: Db) -> None:
        super().__init__(name="armdb-wake", daemon=True)
        self._db_path = db.path
        self._cond = threading.Condition()
        self._waiters: list[tuple[float, Queue[Any], asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self.stop_event = threading.Event()

    def register(self, q: Queue[Any], loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None], wait: float,
                 gen: int) -> None:
        with self._cond:
            if self.stop_event.is_set():
                fut.set_exception(DbClosed(f"database {self._db_path!r}"))
                return
            self._waiters.append((time.monotonic() + wait, q, loop, fut))
            if q._gen != gen:  # a push came between the caller's check and now
                self._waiters[-1] = (0.0, q, loop, fut)
            self._cond.notify()

    def poke(self) -> None:
        with self._cond:
            if self._waiters:
                for i, (_, q, loop, fut) in enumerate(self._waiters):
                    self._waiters[i] = (0.0, q, loop, fut)
                self._cond.notify()

    def stop(self) -> None:
        self.stop_event.set()
        with self._cond:
            self._cond.notify()

    @staticmethod
    def _resolve(fut: asyncio.Future[None], exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)

    def run(self) -> None:
        while True:
            with self._cond:
                if self.stop_event.is_set():
                    waiters, self._waiters = self._waiters, []
                    break
                now = time.monotonic()
                ready = [w for w in self._waiters if w[0] <= now]
                self._waiters = [w for w in self._waiters if w[0] > now]
                if not ready:
                    timeout = min((w[0] for w in self._waiters), default=now + 3600) - now
                    self._cond.wait(max(0.0, timeout))
                    continue
            for _, _q, loop, fut in ready:
                try:
                    loop.call_soon_threadsafe(self._resolve, fut, None)
                except RuntimeError:  # the loop was closed; nobody is waiting any more
                    pass
        for _, _q, loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(self._resolve, fut, DbClosed(f"database {self._db_path!r}"))
            except RuntimeError:
                pass


def start_queue_workers(db: Db, worker_cls: Callable[..., Any]) -> list[Any]:
    """The TTL sweeper (a periodic worker) and the async wake worker, not yet started."""
    db._waker = Waker(db)
    return [worker_cls("armdb-ttl", db, SWEEP_PERIOD, _sweep_tick), db._waker]


__all__ = ["Lease", "LeaseToken", "Queue", "QueueSpec", "QueueStats", "State", "queue"]
