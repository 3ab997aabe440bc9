"""What ``L`` zero bytes do to a CRC-32 (zlib) register, for many registers at once.

The torn-tail-or-damage searches of the transaction log and of Bitcask data files check
every candidate record after a bad one in one forward pass, from the linearity of
CRC-32: a candidate's CRC follows from the running CRC at its start and end and this
shift (``v`` times ``x**(8L)`` modulo the polynomial).  Computed with numpy, one table
per power of two of ``L`` (the register map of ``2**k`` zero bytes, byte by byte).
"""

from __future__ import annotations

import numpy as np

_CRC_POLY = 0xEDB88320  # CRC-32 (zlib), bit-reflected
SHIFT_BITS = 48  # lengths below 2**48 bytes
_tables: np.ndarray | None = None


def _apply_map(table: np.ndarray, v: np.ndarray) -> np.ndarray:
    return table[0][v & 0xFF] ^ table[1][(v >> 8) & 0xFF] ^ table[2][(v >> 16) & 0xFF] ^ table[3][v >> 24]


def _shift_tables() -> np.ndarray:
    """``[k, byte position, byte value]``: the CRC register map of ``2**k`` zero bytes."""
    global _tables
    if _tables is None:
        one = []
        for i in range(256):
            c = i
            for _ in range(8):
                c = (c >> 1) ^ _CRC_POLY if c & 1 else c >> 1
            one.append(c)
        # The image of each register bit after one zero byte: s -> (s >> 8) ^ T[s & 0xFF].
        cols = np.array([((1 << i) >> 8) ^ one[(1 << i) & 0xFF] for i in range(32)], dtype=np.uint32)
        tables = np.zeros((SHIFT_BITS, 4, 256), dtype=np.uint32)
        for k in range(SHIFT_BITS):
            for b in range(4):
                row = tables[k, b]
                for j in range(8):  # the values with bit j as their top bit: those below, plus bit j
                    row[1 << j : 2 << j] = row[: 1 << j] ^ cols[8 * b + j]
            cols = _apply_map(tables[k], cols)  # 2**(k+1) zero bytes: the map twice
        _tables = tables
    return _tables


def crc_shift(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``values`` (uint32 CRC registers) after ``lengths`` zero bytes each."""
    tables = _shift_tables()
    out = values.astype(np.uint32)  # a copy
    top = int(lengths.max()).bit_length() if lengths.size else 0
    for k in range(min(top, SHIFT_BITS)):
        sel = np.flatnonzero((lengths >> k) & 1)
        if sel.size:
            out[sel] = _apply_map(tables[k], out[sel])
    return out
