"""Pseudorandom permutations of ``range(m)`` computed on demand, vectorised over numpy.

A materialised permutation of 10^10 samples would need 80 GB; a Feistel network over the
smallest power-of-four domain that holds ``m``, with cycle walking back into ``[0, m)``,
maps any index to its image in a handful of integer operations and needs no memory. The
domain is at most 4m, so cycle walking takes under 4 steps on average.

The permutation is part of the data order that resume states point into: its values
never change between versions (a test pins them). Only how fast they are computed may:
one domain and key per call runs on scalars in reused buffers, and the last few values of
a walk on Python ints, since a numpy call costs about a microsecond whatever its size.

Every function accepts per-element parameters (domain size and key as arrays), so one call
can evaluate positions that fall into many different windows of an epoch at once.
"""

from __future__ import annotations

import numpy as np

from ..errors import OptionError
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
            raise OptionError(f"key parts must be non-negative, got {p}")
        h = splitmix64(np.array([h ^ np.uint64(p & 0xFFFFFFFFFFFFFFFF)], dtype=_U64))[0]
    return int(h)


def _half_bits(m: Int64s) -> Int64s:
    # smallest h with 4**h >= m (and h >= 1 so the halves are never empty)
    bits = np.ceil(np.log2(np.maximum(m, 2).astype(np.float64))).astype(np.int64)
    # float log2 can be off by one near large powers of two; correct it exactly
    bits = np.where((np.int64(1) << np.minimum(bits, 62)) < m, bits + 1, bits)
    bits = np.where((bits > 1) & ((np.int64(1) << np.maximum(bits - 1, 0)) >= m), bits - 1, bits)
    return np.maximum((bits + 1) // 2, 1)


_M64 = (1 << 64) - 1
_GOLDEN_INT, _M1_INT, _M2_INT = int(_GOLDEN), int(_M1), int(_M2)
#: below this many values a cycle-walking step runs on Python ints: a numpy call costs
#: about a microsecond whatever its size, and the last steps of a walk hold a few values
_FEW = 16
_S30, _S27, _S31 = _U64(30), _U64(27), _U64(31)


def _round_keys(key: int) -> list[int]:
    return [(key + r * _GOLDEN_INT) & _M64 for r in range(_ROUNDS)]


def _round_trip_few(x: int, h: int, mask: int, round_keys: list[int]) -> int:
    """:func:`_round_trip` of one value, on Python ints."""
    left, right = x >> h, x & mask
    for rk in round_keys:
        z = ((right ^ rk) + _GOLDEN_INT) & _M64
        z = ((z ^ (z >> 30)) * _M1_INT) & _M64
        z = ((z ^ (z >> 27)) * _M2_INT) & _M64
        left, right = right, left ^ ((z ^ (z >> 31)) & mask)
    return (left << h) | right


def _round_trip(x: UInt64s, h: UInt64s | np.uint64, mask: UInt64s | np.uint64,
                round_keys: list[UInt64s] | list[np.uint64]) -> UInt64s:
    """One pass of the Feistel network over the ``4**h`` domain: ``_ROUNDS`` rounds of
    ``left, right = right, left ^ (splitmix64(right ^ round_key) & mask)``, computed in place
    in three buffers (a round allocates nothing)."""
    left = np.right_shift(x, h)
    right = np.bitwise_and(x, mask)
    f = np.empty_like(x)
    t = np.empty_like(x)
    for rk in round_keys:
        np.bitwise_xor(right, rk, out=f)
        f += _GOLDEN
        np.right_shift(f, _S30, out=t)
        f ^= t
        f *= _M1
        np.right_shift(f, _S27, out=t)
        f ^= t
        f *= _M2
        np.right_shift(f, _S31, out=t)
        f ^= t
        f &= mask
        f ^= left  # the new right half; the old left's buffer takes the next round's f
        left, right, f = right, f, left
    np.left_shift(left, h, out=left)
    left |= right
    return left


def _walk(out: UInt64s, m: int, h: int, key: int) -> None:
    """Cycle walking, in place, for values of one domain size ``m`` and one key: re-apply
    the permutation of the ``4**h`` domain until each value lands in ``[0, m)``. Because
    it is a permutation of the larger domain, this is a bijection on ``[0, m)``."""
    mask = (1 << h) - 1
    ints = _round_keys(key)
    keys = [_U64(k) for k in ints]
    hh, mm = _U64(h), _U64(mask)
    todo = np.arange(out.size)
    x = out
    while todo.size >= _FEW:
        y = _round_trip(x, hh, mm, keys)
        out[todo] = y
        still = y >= _U64(m)
        todo, x = todo[still], y[still]
    for i, v in zip(todo.tolist(), x.tolist()):
        v = _round_trip_few(v, h, mask, ints)
        while v >= m:
            v = _round_trip_few(v, h, mask, ints)
        out[i] = v


def _walk_mixed(out: UInt64s, m_arr: Int64s, h: Int64s, key_arr: UInt64s) -> None:
    """:func:`_walk` for values whose domain sizes and keys differ from one to the next."""
    todo = np.arange(out.size)
    hu = h.astype(_U64)
    mu = m_arr.astype(_U64)
    masks = (_U64(1) << hu) - _U64(1)
    with np.errstate(over="ignore"):
        rks = [key_arr + _U64(r) * _GOLDEN for r in range(_ROUNDS)]
    while todo.size:
        y = _round_trip(out[todo], hu[todo], masks[todo], [k[todo] for k in rks])
        out[todo] = y
        todo = todo[y >= mu[todo]]


def feistel_permute(index: ArrayLike, m: ArrayLike, key: ArrayLike) -> Int64s:
    """The image of ``index`` (each in ``[0, m)``) under the permutation of ``range(m)``
    named by ``key``. ``m`` and ``key`` may be scalars or arrays shaped like ``index``."""
    idx = np.asarray(index, dtype=np.int64)
    m_arr = np.broadcast_to(np.asarray(m, dtype=np.int64), idx.shape)
    if idx.size == 0:
        return idx.copy()
    if np.any(idx < 0) or np.any(idx >= m_arr):
        raise OptionError("feistel_permute: an index lies outside [0, m)")
    key_arr = np.broadcast_to(np.asarray(key, dtype=_U64), idx.shape)
    h = _half_bits(m_arr)
    # C order: the walks below write through out.reshape(-1), a view only of a C-ordered
    # array (of a transposed one it is a copy, and out would stay the indices)
    out = idx.astype(_U64, order="C")
    flat_m, flat_k = m_arr.reshape(-1), key_arr.reshape(-1)
    if (flat_m == flat_m[0]).all() and (flat_k == flat_k[0]).all():
        # one domain and one key (a chunk inside one window): scalars all the way
        _walk(out.reshape(-1), int(flat_m[0]), int(h.reshape(-1)[0]), int(flat_k[0]))
    else:
        _walk_mixed(out.reshape(-1), flat_m, h.reshape(-1), flat_k)
    return out.astype(np.int64)
