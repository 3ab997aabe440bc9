"""Opening a Bitcask collection whose active file is a worst case for torn-tail detection.

After the first bad record, open looks for a valid record at every 8-aligned offset to
tell a torn tail (cut) from damage (refused).  The crafted file makes every slot after
the header a candidate that claims to run to the end of the file, with no matching CRC:
checking each candidate directly was quadratic (17.5 s for 1 MiB); the forward pass
keeps it linear.  Each sample opens a fresh copy (open cuts the tail).
"""

from __future__ import annotations

import os
import struct
import tempfile

from armdb.bitcask import FILE_HEADER_SIZE, RECORD_MAGIC, BitcaskStore, _file_header
from armdb.config import Config

from .common import QUICK

SIZES = [64 * 1024, 1 << 20] if QUICK else [1 << 20, 8 << 20]


def worst_case_active(size: int) -> bytes:
    """Every slot reads as ``magic | 0 | vlen``: a candidate header running to the end."""
    out = bytearray(_file_header(1, 0, 0, 7))
    for c in range(FILE_HEADER_SIZE, size, 8):
        out += struct.pack("<HHI", RECORD_MAGIC, 0, max(size - (c - 8) - 24, 0))
    return bytes(out)


class OpenWorstCaseActive:
    """``BitcaskStore.open`` of a collection whose active file is ``size`` crafted bytes."""

    params = [SIZES]
    param_names = ["size"]
    number = 1
    warmup_time = 0.0
    repeat = (3, 10, 20.0)
    timeout = 120.0

    def setup(self, size: int) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="armdb-asv-")
        self.coll = os.path.join(self.tmp.name, "m")
        BitcaskStore.open(self.coll, Config(enable_fsync=False), lambda: 1).close()
        with open(os.path.join(self.coll, "shard-000", "00000001.data"), "wb") as f:
            f.write(worst_case_active(size))

    def teardown(self, size: int) -> None:
        self.tmp.cleanup()

    def time_open(self, size: int) -> None:
        BitcaskStore.open(self.coll, Config(enable_fsync=False), lambda: 1).close()
