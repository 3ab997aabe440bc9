"""``armdb._core.fixed.crc32`` (the Bitcask hint file's running CRC) against ``zlib.crc32``
for each argument type it takes: ``bytes`` read in place, short or long, and any other
contiguous buffer of bytes."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from armdb._core import fixed as K


@pytest.fixture(params=[True, False], ids=["clmul", "table"])
def kernel(request: pytest.FixtureRequest) -> object:
    was = K.use_clmul()
    K.use_clmul(request.param)
    yield None
    K.use_clmul(was)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(st.binary(max_size=300), st.binary(min_size=4090, max_size=9000)),
       crc=st.integers(0, 2**32 - 1))
def test_s7_crc32_of_any_buffer_equals_zlib(kernel: object, data: bytes, crc: int) -> None:
    # SPEC S7: the hint file's CRC is zlib's, whatever holds the bytes
    want = zlib.crc32(data, crc)
    assert K.crc32(data, crc) == want
    assert K.crc32(bytearray(data), crc) == want
    assert K.crc32(np.frombuffer(data, dtype=np.uint8), crc) == want
    assert K.crc32(memoryview(data), crc) == want
    assert K.crc32(data) == zlib.crc32(data)


def test_s7_crc32_refuses_what_is_not_a_buffer_of_bytes() -> None:
    with pytest.raises(TypeError):
        K.crc32("text")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        K.crc32(np.zeros(4, dtype=np.uint32))


@pytest.mark.parametrize("n", [(1 << 20) - 1, 1 << 20, (1 << 20) + 7, 3 << 20])
def test_s7_crc32_of_a_long_buffer_equals_zlib(kernel: object, n: int) -> None:
    # SPEC S7: from 1 MiB on the CRC gives the GIL up while it runs; shorter ones keep it
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    want = zlib.crc32(data, 0x5EED)
    assert K.crc32(data, 0x5EED) == want
    assert K.crc32(bytearray(data), 0x5EED) == want
    assert K.crc32(memoryview(data)[1:], 0x5EED) == zlib.crc32(data[1:], 0x5EED)
