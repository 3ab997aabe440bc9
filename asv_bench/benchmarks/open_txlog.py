"""Opening a database whose transaction log is a worst case for the torn-tail search.

The log is crafted: a record head every 24 bytes, each claiming a body that runs to the
end of the file and failing its CRC.  Open must decide whether the first bad record is a
torn tail (no valid record after it: cut, open goes on) or damage (a valid record after
it: ``CorruptionError``).  Checking each candidate on its own CRC'd the whole rest of the
file per candidate, quadratic in the file size (a 1 MiB log took seconds); the search is
now one pass.  ``torn``: no valid record, open cuts the tail.  ``damaged``: one valid
record at the very end, which the search must reach; the record carries no synced-before
flag and no synced mark covers the file, so open cuts it as an unsynced tail (a flagged
record there would make open refuse the file as damage, after the same one pass).
"""

from __future__ import annotations

import os
import struct
import tempfile

import armdb
from armdb import Db, txlog

from .common import QUICK

SIZES = [1 << 18] if QUICK else [1 << 20, 1 << 23]


def crafted_log(size: int, *, valid_at_end: bool) -> bytes:
    raw = bytearray(txlog._file_header(1)) + bytearray(size - txlog.FILE_HEADER_SIZE)
    tail = txlog.encode_record(3, b"tail", 0) if valid_at_end else b""
    end = size - len(tail)
    end -= end % 8
    for p in range(txlog.FILE_HEADER_SIZE, end - txlog.REC_HEAD_SIZE, 24):
        struct.pack_into("<IIQI", raw, p, txlog.REC_MAGIC, 0, 1, size - p - txlog.REC_HEAD_SIZE)
    raw[end : end + len(tail)] = tail
    return bytes(raw[:size])


class OpenCraftedLog:
    """``Db.open`` of a database whose only log file is ``size`` crafted bytes."""

    params = [SIZES, ["torn", "damaged"]]
    param_names = ["size", "case"]
    number = 1
    repeat = 3
    timeout = 120

    def setup(self, size: int, case: str) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="armdb-asv-")
        self.path = self.tmp.name
        Db.open(self.path).close()
        logdir = os.path.join(self.path, txlog.DIR)
        for name in os.listdir(logdir):
            os.unlink(os.path.join(logdir, name))
        with open(os.path.join(logdir, "00000001.log"), "wb") as f:
            f.write(crafted_log(size, valid_at_end=case == "damaged"))

    def teardown(self, size: int, case: str) -> None:
        self.tmp.cleanup()

    def time_open(self, size: int, case: str) -> None:
        try:
            Db.open(self.path).close()
        except armdb.CorruptionError:
            if case != "damaged":
                raise
