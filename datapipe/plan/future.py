"""A worker's future shard reads: the chunks it reads and the shard fetches they make.

A DataLoader worker reads its share of a rank's stream (see :func:`.partition.worker_batches`)
in chunks of whole batches. The first chunk holds one batch and each next one four times as
many, up to ``chunk_samples`` (so reading starts at once while the rest is planned).

The loader's prefetcher fetches, for each chunk, the distinct shards its samples come from in
order of first use, except the shards the chunk before it also reads: those it hands over from
one chunk to the next without fetching them again. That rule depends on nothing but the
chunks, so the fetches a pass makes are a pure function of the plan, and a cache can be told
them in advance (:func:`fetch_order`): this epoch's remaining fetches and the next epoch's,
for eviction by next use and for the node's merged future.

Cost: one pass over the samples the worker reads (the same ``locate`` calls the loader makes),
vectorised; the result holds one entry per fetch (about the shards the worker touches).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from ..errors import PlanError
from .arrays import Bools, Int64s
from .partition import batch_steps, worker_batches

__all__ = ["chunk_fetches", "fetch_order", "first_use", "worker_chunk_steps"]


class _RankPlan(Protocol):
    """What :func:`fetch_order` needs of an ``EpochPlan``."""

    @property
    def start(self) -> int: ...

    @property
    def per_rank(self) -> int: ...

    def rank_samples(self, rank: int, steps: Any) -> tuple[Int64s, Int64s, Bools]: ...


def worker_chunk_steps(start: int, stop: int, batch_size: int, worker: int, num_workers: int,
                       chunk_samples: int, skip: int = 0) -> Iterator[Int64s]:
    """The local steps of each chunk ``worker`` reads of ``[start, stop)``, in order: whole
    batches, one in the first chunk, four times as many in each next, at most
    ``max(1, chunk_samples // batch_size)`` batches per chunk. ``skip``: leave out the
    worker's first ``skip`` steps (those it handed out before a resume), the chunks cut as
    without it."""
    if chunk_samples < 1:
        raise PlanError(f"chunk_samples must be at least 1, got {chunk_samples}")
    batches = worker_batches(start, stop, batch_size, worker, num_workers)
    per_chunk = max(1, chunk_samples // batch_size)
    i, size = 0, 1
    while i < len(batches):
        take = min(size, per_chunk)
        steps = batch_steps(start, stop, batch_size, batches[i : i + take])
        i, size = i + take, size * 4
        if skip >= len(steps):
            skip -= len(steps)
            continue
        yield steps[skip:] if skip else steps
        skip = 0


def first_use(shards: Any) -> Int64s:
    """The distinct values of ``shards`` in order of first occurrence."""
    arr = np.asarray(shards, dtype=np.int64)
    uniq, first = np.unique(arr, return_index=True)
    out: Int64s = uniq[np.argsort(first)]
    return out


def chunk_fetches(chunk_shards: Iterable[Sequence[int]]) -> Iterator[int]:
    """The shard fetches of a pass whose chunks read ``chunk_shards`` (each chunk's distinct
    shards in order of first use): every shard of a chunk except those the chunk before it
    reads, which the prefetcher hands over."""
    previous: set[int] = set()
    for shards in chunk_shards:
        for g in shards:
            if g not in previous:
                yield int(g)
        previous = set(int(g) for g in shards)


def chunk_shards(plan: _RankPlan, real: Any, rank: int, worker: int, num_workers: int, batch_size: int,
                 chunk_samples: int, skip: int = 0) -> Iterator[list[int]]:
    """The shards each chunk of ``worker`` of ``rank`` reads (real shard numbers,
    ``real[virtual shard]``, in order of first use), reading ``plan`` from its resume point
    (``plan.start``, and the worker's first ``skip`` steps left out) to the end."""
    real_arr = np.asarray(real, dtype=np.int64)
    for steps in worker_chunk_steps(plan.start, plan.per_rank, batch_size, worker, num_workers, chunk_samples, skip):
        vshard, _sample, _pad = plan.rank_samples(rank, steps)
        yield first_use(real_arr[vshard]).tolist()


def fetch_order(plan: _RankPlan, real: Any, rank: int, worker: int, num_workers: int, batch_size: int,
                chunk_samples: int, skip: int = 0) -> Int64s:
    """The shards ``worker`` of ``rank`` fetches, in order, reading ``plan`` from its resume
    point (``plan.start``, and the worker's first ``skip`` steps left out) to the end: real
    shard numbers (``real[virtual shard]``), one entry per fetch, repeats where a shard is
    fetched again by a later chunk (:func:`chunk_fetches` of :func:`chunk_shards`)."""
    shards = chunk_shards(plan, real, rank, worker, num_workers, batch_size, chunk_samples, skip)
    return np.fromiter(chunk_fetches(shards), dtype=np.int64)
