"""Stubs for the compiled ``armdb._core.fixed`` (see fixed.pyx)."""

import numpy as np
import numpy.typing as npt

FREE: int
OCCUPIED: int
DELETED: int
TORN: int
RING_BITS: int
RING_MASK: int
RING_HALF: int
OLDER: int
EQUAL: int
NEWER: int
STALE: int

def crc32(data: bytes | npt.NDArray[np.uint8], crc: int = 0) -> int: ...
def slot_crc(meta: int, body: bytes | npt.NDArray[np.uint8]) -> int: ...
def ring_next(version: int) -> int: ...
def compare(a: int, b: int) -> int: ...
def compare_many(a: npt.NDArray[np.uint32], b: npt.NDArray[np.uint32], out: npt.NDArray[np.int8]) -> None: ...
def validate(
    slots: npt.NDArray[np.uint8], versions: npt.NDArray[np.uint32], status: npt.NDArray[np.uint8]
) -> tuple[int, int]: ...
REDO_OFFSET: int
REDO_HEAD: int
REDO_MAGIC: int

def redo_record(redo: npt.NDArray[np.uint8], slot_size: int) -> tuple[int, bytes] | None: ...
def restore_slot(
    slots: npt.NDArray[np.uint8], versions: npt.NDArray[np.uint32], i: int, image: bytes
) -> int: ...

class SlotFile:
    occupied: int
    dirty_lo: int
    dirty_hi: int
    hwm: int
    writes: int
    def __init__(self, base: int) -> None: ...
    def bind(
        self,
        slots: npt.NDArray[np.uint8],
        versions: npt.NDArray[np.uint32],
        status: npt.NDArray[np.uint8],
        redo: npt.NDArray[np.uint8],
    ) -> None: ...
    def release(self) -> None: ...
    def put(self, i: int, st: int, body: bytes, version: int = 0, copy: bool = True) -> int: ...
    def commit(self) -> int: ...
    def mark(self, i: int) -> None: ...
    def header(self, i: int, off: int) -> tuple[int, int, int, int, int, int, int]: ...
    def body(self, i: int, off: int, n: int) -> bytes: ...
