"""Partitioning an epoch's global order over ranks, and a rank's stream over workers.

The global order (see :mod:`.shuffle`) is one sequence of positions ``[0, N)``. A
:class:`Split` deals a space of positions to ``world`` ranks as contiguous blocks: rank r
reads ``[r*n, (r+1)*n)``. Contiguous blocks of a windowed order fall into few windows, so
ranks read mostly disjoint shards. Every rank yields exactly ``n`` samples: ``n = M // world``
when dropping (the last ``M % world`` positions are left out) or ``ceil(M / world)`` when
padding (positions past the end wrap around to the start, so fewer than ``world`` samples
repeat).

Ranks advance in lockstep, so "each rank consumed c samples" describes the whole progress
of a split. After a change of world size the positions not yet consumed (the tail of every
rank's block, plus a dropped tail) form a new, smaller space, dealt by a new split: a
:class:`Partition` is that chain of splits, the last one live. Composition maps a live
position back to a global one through O(ranks) interval tables.

Within a rank, DataLoader workers take turns by batch: worker w reads the rank's batches
w, w + W, w + 2W, ... of ``batch_size`` samples, which is exactly the order in which
``torch.utils.data.DataLoader`` collects batches from its workers, so the loader's output
is the rank's stream in order and "samples consumed" is a prefix of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from ..errors import PlanError
from .arrays import ArrayLike, Bools, Int64s

__all__ = ["Split", "Partition", "per_rank_count", "worker_batches", "batch_steps"]


def per_rank_count(space: int, world: int, drop_last: bool) -> int:
    """Samples each of ``world`` ranks yields from ``space`` positions."""
    if world < 1:
        raise PlanError(f"world size must be at least 1, got {world}")
    if space < 0:
        raise PlanError(f"a split cannot hold {space} positions")
    return space // world if drop_last else -(-space // world)


@dataclass(frozen=True)
class Split:
    """``world`` ranks each reading ``per_rank`` positions of a space of ``space``; each has
    consumed ``consumed`` of them."""

    space: int
    world: int
    per_rank: int
    consumed: int = 0

    def __post_init__(self) -> None:
        if self.world < 1 or self.space < 0 or self.per_rank < 0:
            raise PlanError(f"invalid split {self}")
        if self.per_rank not in (self.space // self.world, -(-self.space // self.world)):
            raise PlanError(
                f"invalid split {self}: {self.per_rank} per rank does not deal {self.space} "
                f"positions over {self.world} ranks"
            )
        if not 0 <= self.consumed <= self.per_rank:
            raise PlanError(f"invalid split {self}: consumed must lie in [0, {self.per_rank}]")

    @classmethod
    def fresh(cls, space: int, world: int, drop_last: bool) -> Split:
        return cls(space, world, per_rank_count(space, world, drop_last))

    def positions(self, rank: int, steps: ArrayLike) -> tuple[Int64s, Bools]:
        """(position in this split's space, is_padding) of ``rank``'s local ``steps``."""
        if not 0 <= rank < self.world:
            raise PlanError(f"rank {rank} outside world size {self.world}")
        s = np.asarray(steps, dtype=np.int64)
        if s.size and (s.min() < 0 or s.max() >= self.per_rank):
            raise PlanError(f"local steps must lie in [0, {self.per_rank})")
        v = rank * self.per_rank + s
        pad = v >= self.space
        if pad.any():
            v = np.where(pad, v % max(self.space, 1), v)
        return v, pad

    def remainder(self) -> tuple[Int64s, Int64s]:
        """(starts, lengths) of the intervals not yet consumed, in order, empty ones left out."""
        r = np.arange(self.world, dtype=np.int64)
        m, n = self.space, self.per_rank
        starts = np.minimum(r * n + self.consumed, m)
        ends = np.minimum((r + 1) * n, m)
        starts = np.append(starts, min(self.world * n, m))
        ends = np.append(ends, m)
        lengths = ends - starts
        keep = lengths > 0
        return starts[keep], lengths[keep]

    def remaining_space(self) -> int:
        return int(self.remainder()[1].sum())


@dataclass(frozen=True)
class Partition:
    """A chain of splits over an epoch of ``total`` positions; the last split is live."""

    total: int
    splits: tuple[Split, ...]
    _tables: list[tuple[Int64s, Int64s]] = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.splits:
            raise PlanError("a partition needs at least one split")
        if self.splits[0].space != self.total:
            raise PlanError(f"first split covers {self.splits[0].space} positions, the epoch {self.total}")
        for prev, nxt in zip(self.splits, self.splits[1:]):
            if prev.remaining_space() != nxt.space:
                raise PlanError("a split does not cover the remainder of the split before it")
        # interval tables of every frozen split, computed once: O(ranks) each
        for sp in self.splits[:-1]:
            starts, lengths = sp.remainder()
            self._tables.append((starts, np.concatenate(([0], np.cumsum(lengths)))))

    @classmethod
    def fresh(cls, total: int, world: int, drop_last: bool) -> Partition:
        return cls(total, (Split.fresh(total, world, drop_last),))

    @property
    def live(self) -> Split:
        return self.splits[-1]

    def with_consumed(self, consumed: int) -> Partition:
        return Partition(self.total, (*self.splits[:-1], replace(self.live, consumed=consumed)))

    def regroup(self, world: int, drop_last: bool) -> Partition:
        """The same progress dealt to a new world size: the live split is frozen and its
        remainder dealt afresh. Unchanged world size (and rule) keeps the live split."""
        live = self.live
        if world == live.world and live.per_rank == per_rank_count(live.space, world, drop_last):
            return self
        if live.consumed == 0:  # nothing read under the live split: replace it outright
            return Partition(self.total, (*self.splits[:-1], Split.fresh(live.space, world, drop_last)))
        return Partition(self.total, (*self.splits, Split.fresh(live.remaining_space(), world, drop_last)))

    def positions(self, rank: int, steps: ArrayLike) -> tuple[Int64s, Bools]:
        """(global position, is_padding) of ``rank``'s live local ``steps``."""
        v, pad = self.live.positions(rank, steps)
        for starts, cum in reversed(self._tables):
            i = np.searchsorted(cum, v, side="right") - 1
            v = starts[i] + (v - cum[i])
        return v, pad


def worker_batches(start: int, stop: int, batch_size: int, worker: int, num_workers: int) -> range:
    """Indices of the batches (counted from ``start``) that ``worker`` reads of local steps
    ``[start, stop)``."""
    if batch_size < 1 or num_workers < 1 or not 0 <= worker < num_workers:
        raise PlanError(f"invalid batch_size={batch_size}, worker={worker}, num_workers={num_workers}")
    n_batches = -(-max(stop - start, 0) // batch_size)
    return range(worker, n_batches, num_workers)


def batch_steps(start: int, stop: int, batch_size: int, batches: range) -> Int64s:
    """The local steps of ``batches`` (a slice of :func:`worker_batches`), in order."""
    if len(batches) == 0:
        return np.empty(0, dtype=np.int64)
    b = np.asarray(batches, dtype=np.int64)
    steps = (start + b * batch_size)[:, None] + np.arange(batch_size, dtype=np.int64)[None, :]
    steps = steps.ravel()
    return steps[steps < stop]
