"""Pseudorandom permutations of ``range(m)`` computed on demand, vectorised over numpy.

A materialised permutation of 10^10 samples would need 80 GB; a Feistel network over the
smallest power-of-four domain that holds ``m``, with cycle walking back into ``[0, m)``,
maps any index to its image in a handful of integer operations and needs no memory. The
domain is at most 4m, so cycle walking takes under 4 steps on average.

Every function accepts per-element parameters (domain size and key as arrays), so one call
can evaluate positions that fall into many different windows of an epoch at once.
"""

from __future__ import annotations

import numpy as np

from .arrays import ArrayLike, Int64s, UInt64s

__all__ = ["derive_key", "feistel_permute", "splitmix64"]

_ROUNDS = 4
_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)
_M1 = _U64(0xBF58476D1CE4E5B9)
_M2 = _U64(0x94D049BB133111EB)


def splitmix64(x: ArrayLike) -> UInt64s:
    """The splitmix64 finaliser: a bijective, well-mixing hash of uint64 values."""
    x = np.asarray(x, dtype=_U64)
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> _U64(30))) * _M1
        z = (z ^ (z >> _U64(27))) * _M2
        return z ^ (z >> _U64(31))


def derive_key(*parts: int) -> int:
    """A 64-bit key from integers (seed, epoch, window, ...): the same parts always give the
    same key, and nearby parts give unrelated keys."""
    h = np.uint64(0x243F6A8885A308D3)
    for p in parts:
        p = int(p)
        if p < 0:
            raise ValueError(f"key parts must be non-negative, got {p}")
        h = splitmix64(np.array([h ^ np.uint64(p & 0xFFFFFFFFFFFFFFFF)], dtype=_U64))[0]
    return int(h)


def _half_bits(m: Int64s) -> Int64s:
    # smallest h with 4**h >= m (and h >= 1 so the halves are never empty)
    bits = np.ceil(np.log2(np.maximum(m, 2).astype(np.float64))).astype(np.int64)
    # float log2 can be off by one near large powers of two; correct it exactly
    bits = np.where((np.int64(1) << np.minimum(bits, 62)) < m, bits + 1, bits)
    bits = np.where((bits > 1) & ((np.int64(1) << np.maximum(bits - 1, 0)) >= m), bits - 1, bits)
    return np.maximum((bits + 1) // 2, 1)


def _feistel_round_trip(x: UInt64s, half_bits: Int64s, key: UInt64s) -> UInt64s:
    h = half_bits.astype(_U64)
    mask = (_U64(1) << h) - _U64(1)
    left = x >> h
    right = x & mask
    with np.errstate(over="ignore"):
        for r in range(_ROUNDS):
            f = splitmix64(right ^ (key + _U64(r) * _GOLDEN)) & mask
            left, right = right, left ^ f
    return (left << h) | right


def feistel_permute(index: ArrayLike, m: ArrayLike, key: ArrayLike) -> Int64s:
    """The image of ``index`` (each in ``[0, m)``) under the permutation of ``range(m)``
    named by ``key``. ``m`` and ``key`` may be scalars or arrays shaped like ``index``."""
    idx = np.asarray(index, dtype=np.int64)
    m_arr = np.broadcast_to(np.asarray(m, dtype=np.int64), idx.shape)
    if idx.size == 0:
        return idx.copy()
    if np.any(idx < 0) or np.any(idx >= m_arr):
        raise ValueError("feistel_permute: an index lies outside [0, m)")
    key_arr = np.broadcast_to(np.asarray(key, dtype=_U64), idx.shape)
    h = _half_bits(m_arr)
    out = idx.astype(_U64)
    todo = np.arange(idx.size)
    mu = m_arr.astype(_U64)
    # Cycle walking: re-apply the permutation of the 4**h domain until the value lands in
    # [0, m). Because it is a permutation of the larger domain, this is a bijection on [0, m).
    while todo.size:
        x = out[todo]
        y = _feistel_round_trip(x, h[todo], key_arr[todo])
        out[todo] = y
        still = y >= mu[todo]
        todo = todo[still]
    return out.astype(np.int64)
