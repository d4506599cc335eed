"""The order of one epoch: global position -> (shard, sample within shard).

An order is a pure function of (per-shard sample counts, seed, epoch, window) and never of
ranks or workers (DESIGN.md invariant 4). Algorithms live in the plain ``ALGORITHMS``
registry, mosaicml style; each builds an object whose :meth:`locate` maps an array of global
positions to shard and sample indices, vectorised, in O(shards) memory:

- ``"window"``: shards in a seeded random order, cut into consecutive windows of ``window``
  shards; the samples of each window are shuffled together by an on-demand Feistel
  permutation. ``window >= num_shards`` is a full global shuffle. A reader then needs only
  the shards of one window (plus prefetch) at a time.
- ``"none"``: stored order (shard 0 sample 0, shard 0 sample 1, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from ..errors import PlanError
from .arrays import ArrayLike, Int64s, UInt64s
from .permutation import derive_key, feistel_permute

__all__ = ["ALGORITHMS", "EpochOrder", "NoShuffle", "WindowShuffle", "check_counts", "epoch_order"]


def check_counts(counts: object) -> Int64s:
    """The per-shard sample counts as a read-only int64 array, or :class:`PlanError`."""
    arr = np.asarray(counts)
    if arr.ndim != 1:
        raise PlanError(f"per-shard sample counts must be a 1-d array, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise PlanError(f"per-shard sample counts must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and arr.min() < 0:
        raise PlanError(f"shard {int(np.argmin(arr))} has a negative sample count")
    arr = np.array(arr, dtype=np.int64)
    arr.flags.writeable = False
    return arr


class EpochOrder(Protocol):
    num_samples: int
    num_shards: int

    def locate(self, positions: ArrayLike) -> tuple[Int64s, Int64s]:
        """(shard index, sample index within that shard) of each global position."""
        ...


class NoShuffle:
    """Stored order."""

    def __init__(self, counts: ArrayLike, seed: int = 0, epoch: int = 0, window: int = 1) -> None:
        self.counts = check_counts(counts)
        self.num_shards = int(self.counts.size)
        self.starts = np.concatenate(([0], np.cumsum(self.counts)))
        self.num_samples = int(self.starts[-1])

    def locate(self, positions: ArrayLike) -> tuple[Int64s, Int64s]:
        p = _check_positions(positions, self.num_samples)
        shard = np.searchsorted(self.starts, p, side="right") - 1
        return shard, p - self.starts[shard]


#: positions spread over fewer windows than this are permuted one window at a time
_FEW_WINDOWS = 8


class WindowShuffle:
    """Shard order permuted, samples shuffled across windows of ``window`` shards."""

    def __init__(self, counts: ArrayLike, seed: int, epoch: int, window: int) -> None:
        self.counts = check_counts(counts)
        if int(window) < 1:
            raise PlanError(f"window must be at least 1 shard, got {window}")
        self.seed, self.epoch = int(seed), int(epoch)
        self.num_shards = n = int(self.counts.size)
        self.window = min(int(window), max(n, 1))
        rng = np.random.Generator(np.random.PCG64(derive_key(self.seed, self.epoch, 1)))
        #: shard_order[j] = the shard read in slot j of this epoch
        self.shard_order = rng.permutation(n).astype(np.int64)
        slot_counts = self.counts[self.shard_order]
        #: slot_starts[j] = first global offset of slot j in the concatenation of slots
        self.slot_starts = np.concatenate(([0], np.cumsum(slot_counts)))
        self.num_samples = int(self.slot_starts[-1])
        #: window w covers slots [w * window, (w+1) * window)
        self.window_starts = self.slot_starts[:: self.window].copy()
        if self.window_starts[-1] != self.num_samples:
            self.window_starts = np.append(self.window_starts, self.num_samples)
        self.window_sizes = np.diff(self.window_starts)
        base = derive_key(self.seed, self.epoch, 2)
        self._base_key = np.uint64(base)

    def _window_keys(self, w: Int64s) -> UInt64s:
        """The permutation key of each window in ``w``."""
        with np.errstate(over="ignore"):
            keys: UInt64s = self._base_key ^ (w.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
        return keys

    def window_of(self, positions: ArrayLike) -> Int64s:
        return np.searchsorted(self.window_starts, positions, side="right") - 1

    def locate(self, positions: ArrayLike) -> tuple[Int64s, Int64s]:
        p = _check_positions(positions, self.num_samples)
        w = self.window_of(p)
        start = self.window_starts[w]
        lo, hi = (int(w.min()), int(w.max())) if w.size else (0, -1)
        if hi - lo < _FEW_WINDOWS:
            # a chunk's positions lie in one window or two: one call per window, on scalars
            inner = np.empty_like(p)
            keys = self._window_keys(np.arange(lo, hi + 1)).tolist()
            for v, key in zip(range(lo, hi + 1), keys):
                sel = w == v if hi > lo else slice(None)
                inner[sel] = feistel_permute(p[sel] - start[sel], int(self.window_sizes[v]), key)
        else:
            inner = feistel_permute(p - start, self.window_sizes[w], self._window_keys(w))
        q = start + inner
        slot = np.searchsorted(self.slot_starts, q, side="right") - 1
        return self.shard_order[slot], q - self.slot_starts[slot]


def _check_positions(positions: ArrayLike, n: int) -> Int64s:
    p = np.asarray(positions, dtype=np.int64)
    if p.size and (p.min() < 0 or p.max() >= n):
        raise PlanError(f"positions must lie in [0, {n}), got [{p.min()}, {p.max()}]")
    return p


ALGORITHMS: dict[str, Callable[..., EpochOrder]] = {
    "window": WindowShuffle,
    "none": NoShuffle,
}


def epoch_order(counts: ArrayLike, seed: int, epoch: int, window: int, algorithm: str = "window") -> EpochOrder:
    """The order of ``epoch`` under the registered ``algorithm``."""
    try:
        make = ALGORITHMS[algorithm]
    except KeyError:
        raise PlanError(f"unknown shuffle algorithm {algorithm!r}; known: {sorted(ALGORITHMS)}") from None
    if int(seed) < 0 or int(epoch) < 0:
        raise PlanError(f"seed and epoch must be non-negative, got seed={seed} epoch={epoch}")
    return make(counts, seed, epoch, window)
