"""datapipe.checksum: the digest is xxh3-64 of the bytes whatever path computes it (the one
call below GIL_FREE_BYTES, the streaming one from there on) and whatever holds them."""

import numpy as np
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from datapipe.checksum import GIL_FREE_BYTES, Hasher, checksum, digest64, verify

sizes = st.one_of(st.integers(0, 64), st.integers(GIL_FREE_BYTES - 8, GIL_FREE_BYTES + 8),
                  st.integers(0, 3 * GIL_FREE_BYTES))


@given(size=sizes, seed=st.integers(0, 2**32 - 1))
@settings(max_examples=60, deadline=None)
def test_digest_is_xxh3_64_on_both_sides_of_the_threshold(size, seed):
    data = np.random.default_rng(seed).bytes(size)
    want = xxhash.xxh3_64_intdigest(data)
    for holder in (data, bytearray(data), memoryview(data)):
        assert digest64(holder) == want
        assert checksum(holder) == f"xxh3_64:{want:016x}"
    h = Hasher()
    h.update(data[: size // 2])
    h.update(data[size // 2:])
    assert h.hexdigest() == checksum(data)
    verify(data, checksum(data), "data")


def test_a_wide_memoryview_counts_its_bytes_not_its_items():
    # 8,192 int64 items are 64 KiB: below the threshold counted in items, above it in bytes
    arr = np.arange(GIL_FREE_BYTES // 4, dtype=np.int64)
    mv = memoryview(arr)
    assert len(mv) < GIL_FREE_BYTES <= mv.nbytes
    assert digest64(mv) == xxhash.xxh3_64_intdigest(arr.tobytes())
