"""The epoch order's permutation never changes between versions: a resume state is a count
of samples taken in that order, so a new version computing other values would resume a
job onto samples it already saw. The values below were printed by the first version of
``feistel_permute``; the reference here is written from the definition, independently of
the vectorised code."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from datapipe.plan import epoch_order, feistel_permute

#: (m, key, indices, their images), as the first version computed them
PINNED = [
    (1, 0x0, [0, 0, 0], [0, 0, 0]),
    (1, 0x1, [0, 0, 0], [0, 0, 0]),
    (1, 0xffffffffffffffff, [0, 0, 0], [0, 0, 0]),
    (1, 0x2bdc545d6b4b87, [0, 0, 0], [0, 0, 0]),
    (2, 0x0, [1, 1, 1], [0, 0, 0]),
    (2, 0x1, [1, 1, 1], [0, 0, 0]),
    (2, 0xffffffffffffffff, [1, 1, 1], [1, 1, 1]),
    (2, 0x2bdc545d6b4b87, [1, 1, 1], [1, 1, 1]),
    (3, 0x0, [0, 0, 0], [1, 1, 1]),
    (3, 0x1, [0, 0, 0], [2, 2, 2]),
    (3, 0xffffffffffffffff, [0, 0, 0], [2, 2, 2]),
    (3, 0x2bdc545d6b4b87, [0, 0, 0], [0, 0, 0]),
    (5, 0x0, [2, 3, 4], [4, 2, 3]),
    (5, 0x1, [2, 3, 4], [0, 3, 4]),
    (5, 0xffffffffffffffff, [2, 3, 4], [0, 1, 2]),
    (5, 0x2bdc545d6b4b87, [2, 3, 4], [2, 4, 3]),
    (17, 0x0, [9, 15, 4], [9, 12, 0]),
    (17, 0x1, [9, 15, 4], [13, 11, 12]),
    (17, 0xffffffffffffffff, [9, 15, 4], [12, 14, 15]),
    (17, 0x2bdc545d6b4b87, [9, 15, 4], [16, 1, 10]),
    (1000, 0x0, [394, 857, 554], [498, 789, 662]),
    (1000, 0x1, [394, 857, 554], [396, 498, 772]),
    (1000, 0xffffffffffffffff, [394, 857, 554], [874, 369, 916]),
    (1000, 0x2bdc545d6b4b87, [394, 857, 554], [546, 974, 585]),
    (20000, 0x0, [16931, 3513, 1785], [18266, 5847, 6572]),
    (20000, 0x1, [16931, 3513, 1785], [2158, 9176, 15678]),
    (20000, 0xffffffffffffffff, [16931, 3513, 1785], [1388, 7445, 17600]),
    (20000, 0x2bdc545d6b4b87, [16931, 3513, 1785], [6673, 647, 2075]),
    (65537, 0x0, [5269, 19642, 31527], [200, 10987, 62098]),
    (65537, 0x1, [5269, 19642, 31527], [63034, 62112, 22477]),
    (65537, 0xffffffffffffffff, [5269, 19642, 31527], [12099, 38088, 63364]),
    (65537, 0x2bdc545d6b4b87, [5269, 19642, 31527], [42514, 60916, 14630]),
    (10000000000, 0x0, [1242832764, 6706244146, 6471895115], [6877587510, 292712579, 4276058386]),
    (10000000000, 0x1, [1242832764, 6706244146, 6471895115], [6175942717, 7451155034, 7410887304]),
    (10000000000, 0xffffffffffffffff, [1242832764, 6706244146, 6471895115], [578009689, 8848130884, 9841848914]),
    (10000000000, 0x2bdc545d6b4b87, [1242832764, 6706244146, 6471895115], [9623544078, 6345200062, 3024857097]),
]

_M64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def reference(i: int, m: int, key: int) -> int:
    """4 Feistel rounds over the smallest power-of-four domain holding m (halves of h bits,
    h >= 1), round r keyed by key + r * golden, cycle-walked back into [0, m)."""
    h = 1
    while 4**h < m:
        h += 1
    mask = (1 << h) - 1
    x = i
    while True:
        left, right = x >> h, x & mask
        for r in range(4):
            f = _splitmix64(right ^ ((key + r * 0x9E3779B97F4A7C15) & _M64)) & mask
            left, right = right, left ^ f
        x = (left << h) | right
        if x < m:
            return x


def test_pinned_values_of_the_first_version():
    for m, key, idx, want in PINNED:
        assert feistel_permute(np.array(idx), m, key).tolist() == want, (m, key)
        assert [reference(i, m, key) for i in idx] == want, (m, key)


@given(m=st.integers(1, 2**40), key=st.integers(0, 2**64 - 1), data=st.data())
@settings(max_examples=150, deadline=None)
def test_one_domain_and_key_matches_the_reference(m, key, data):
    # sizes on both sides of the switch to Python ints for the tail of a walk
    idx = data.draw(st.lists(st.integers(0, m - 1), min_size=1, max_size=300))
    assert feistel_permute(np.array(idx), m, key).tolist() == [reference(i, m, key) for i in idx]


@given(pairs=st.lists(st.tuples(st.integers(1, 10**6), st.integers(0, 2**64 - 1), st.floats(0, 1, exclude_max=True)),
                      min_size=1, max_size=200))
@settings(max_examples=100, deadline=None)
def test_mixed_domains_and_keys_match_the_reference(pairs):
    m = np.array([p[0] for p in pairs], dtype=np.int64)
    key = np.array([p[1] for p in pairs], dtype=np.uint64)
    idx = np.array([int(p[2] * p[0]) for p in pairs], dtype=np.int64)
    got = feistel_permute(idx, m, key).tolist()
    assert got == [reference(int(i), int(n), int(k)) for i, n, k in zip(idx, m, key)]


@given(counts=st.lists(st.integers(0, 60), min_size=1, max_size=40), seed=st.integers(0, 2**32),
       window=st.integers(1, 6), data=st.data())
@settings(max_examples=80, deadline=None)
def test_window_order_is_the_same_however_positions_are_grouped(counts, seed, window, data):
    # positions in a few windows go one window at a time, many windows in one call: the
    # order of each position must not depend on which positions it was asked with
    order = epoch_order(np.array(counts), seed, 3, window)
    n = order.num_samples
    if n == 0:
        return
    asked = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=2 * n)), dtype=np.int64)
    together = order.locate(asked)
    alone = [order.locate(np.array([p])) for p in asked.tolist()]
    assert together[0].tolist() == [int(a[0][0]) for a in alone]
    assert together[1].tolist() == [int(a[1][0]) for a in alone]


def test_index_arrays_of_any_memory_order_are_permuted():
    # a transposed (Fortran-ordered) index array: the flat view of its copy must be the
    # one permuted, else the call returns the indices themselves
    idx = np.arange(48).reshape(6, 8)
    for m, key in ((48, 5), (10**10, 2**64 - 1)):
        for x in (idx, idx.T, np.asfortranarray(idx), idx.T[::2], idx[:, ::3]):
            want = [[reference(int(i), m, key) for i in row] for row in x.tolist()]
            assert feistel_permute(x, m, key).tolist() == want, (m, x.flags["C_CONTIGUOUS"])
            # per-element domains and keys, shaped (and ordered) like the indices
            keys = np.asfortranarray(np.arange(x.size, dtype=np.uint64).reshape(x.shape) + np.uint64(key % 7))
            want = [[reference(int(i), m, int(k)) for i, k in zip(r, kr)] for r, kr in zip(x.tolist(), keys.tolist())]
            assert feistel_permute(x, np.full(x.shape, m), keys).tolist() == want
