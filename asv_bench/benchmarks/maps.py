"""Map benchmarks: ``put`` into a fresh map and ``get`` of existing keys (no fsync)."""

from __future__ import annotations

import tempfile

from armdb import Config, Db

from .common import BATCH, body

KEY_KINDS = ["int", "str"]


def _key(kind: str, i: int) -> int | str:
    return i if kind == "int" else f"doc:{i:08d}"


class _MapFixture:
    def __init__(self) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="armdb-asv-")
        self.db = Db.open(self.tmp.name)
        try:
            self.map = self.db.open_map("asv_map", Config.balanced().enable_fsync(False).build())
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        try:
            self.db.shutdown()
        finally:
            self.tmp.cleanup()


class MapPut:
    """``BATCH`` puts of a 100-byte dict into an empty map."""

    params = [KEY_KINDS]
    param_names = ["key"]
    number = 1
    warmup_time = 0.0
    repeat = (3, 20, 20.0)

    def setup(self, key: str) -> None:
        self.fx = _MapFixture()

    def teardown(self, key: str) -> None:
        self.fx.close()

    def time_put(self, key: str) -> None:
        m = self.fx.map
        for i in range(BATCH):
            m.put(_key(key, i), body(i))


class MapGet:
    """``BATCH`` gets of keys that exist (reads only: asv may batch calls)."""

    params = [KEY_KINDS]
    param_names = ["key"]

    def setup(self, key: str) -> None:
        self.fx = _MapFixture()
        for i in range(BATCH):
            self.fx.map.put(_key(key, i), body(i))

    def teardown(self, key: str) -> None:
        self.fx.close()

    def time_get(self, key: str) -> None:
        m = self.fx.map
        for i in range(BATCH):
            m.get(_key(key, i))
