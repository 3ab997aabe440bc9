"""The Bitcask engine: append-only, CRC-checked records with an in-RAM index (SPEC S6-S12).

A collection is a directory holding ``collection.meta`` and one subfolder per
shard (``shard-000/`` ...).  Each shard appends records to data files
``NNNNNNNN.data`` and keeps a dict from key to the location of the key's latest
record.  ``docs/format.md (section "Bitcask data and hint files")`` describes every file byte by byte; the short
version:

* data file: a 32-byte file header (magic ``ARMDBBCD``, format version, flags,
  file id, base gsn, file nonce, CRC), then records, each 8-byte aligned:
  ``gsn:u64 | crc32:u32 | value_len:u32 | magic:u16 | key_len:u16 | key | value | pad``.
  ``gsn`` bit 63 marks a tombstone; bits 0-59 are the sequence number.  The CRC
  covers the gsn, ``value_len``, the record magic, ``key_len``, key and value, so
  a zero-filled region never validates (S11): its magic is 0 and its stored CRC
  0 while the CRC of 16 zero bytes is not.
* hint file ``NNNNNNNN.hint``: the index entries of one immutable data file
  (written at rotation and by compaction) so that open need not read values.
* ``compaction.pending``: the list of input files a compaction has replaced,
  written before they are unlinked so that a crash cannot leave half of them.

Encrypted collections seal the key and the value of each record separately with
AES-256-GCM (``armdb._crypto``); the AAD is the collection salt, a field tag and
the record's gsn word.  Hint files copy the sealed key bytes.  No plaintext key
or value reaches any file.

The package, formats below runtimes (each module imports only those above it here):

* ``format``: the pure codecs and constants of every file (no I/O);
* ``files``: reading and writing one shard's files: the scan, hints, the search for a
  valid record after a bad one, the verdict on a bad tail, the synced mark;
* ``shard``: a shard's in-RAM state and its locks (the lock policy);
* ``recovery``: open-time recovery of a shard;
* ``compaction``: compaction, in copy, publish, commit and retire steps;
* ``store``: :class:`BitcaskStore`, the read/write path;
* ``check``: :func:`check_dir`, the offline read-only check.

Lock policy: ``armdb.bitcask.shard`` states it; each module's docstring says which
locks it takes.
"""

from __future__ import annotations

# The public names (``__all__``); then, re-exported as ``X as X``, the names that tests
# and benchmarks read and craft files by (``armdb.bitcask.DATA_START`` ...).  armdb's
# own modules import them from the submodule that owns them.
from .check import check_dir
from .files import _next_valid as _next_valid
from .files import _Scan as _Scan
from .files import _ValidIndex as _ValidIndex
from .format import AREA_MARK_DATA_VERSION as AREA_MARK_DATA_VERSION
from .format import DATA_MAGIC as DATA_MAGIC
from .format import DATA_START as DATA_START
from .format import DATA_VERSION as DATA_VERSION
from .format import FILE_HEAD as FILE_HEAD
from .format import FILE_HEADER_SIZE as FILE_HEADER_SIZE
from .format import FLAG_COMPACTED as FLAG_COMPACTED
from .format import FLAG_ENCRYPTED as FLAG_ENCRYPTED
from .format import FORMAT_VERSION, MAX_KEY_LEN, MAX_VALUE_LEN
from .format import HINT_END_MAGIC as HINT_END_MAGIC
from .format import HINT_ENTRY as HINT_ENTRY
from .format import HINT_MAGIC as HINT_MAGIC
from .format import HINT_TRAILER as HINT_TRAILER
from .format import META_HEAD as META_HEAD
from .format import META_MAGIC as META_MAGIC
from .format import META_NAME as META_NAME
from .format import PENDING_MAGIC as PENDING_MAGIC
from .format import PENDING_NAME as PENDING_NAME
from .format import REC_HEAD as REC_HEAD
from .format import REC_HEAD_SIZE as REC_HEAD_SIZE
from .format import RECORD_MAGIC as RECORD_MAGIC
from .format import SEQ_MASK as SEQ_MASK
from .format import SYNCED_BEFORE as SYNCED_BEFORE
from .format import TOMBSTONE as TOMBSTONE
from .format import _encode_meta as _encode_meta
from .format import _encode_pending as _encode_pending
from .format import _file_header as _file_header
from .format import _Meta as _Meta
from .format import _pad8 as _pad8
from .format import _plausible as _plausible
from .format import _record_crc as _record_crc
from .store import BitcaskStore

__all__ = ["FORMAT_VERSION", "MAX_KEY_LEN", "MAX_VALUE_LEN", "BitcaskStore", "check_dir"]
