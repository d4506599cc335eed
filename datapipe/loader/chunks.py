"""The plan stage of a pass: the worker's share of an epoch's plan, cut into chunks.

A loader's plan is an :class:`~datapipe.plan.EpochPlan` over per-unit counts: shards of
samples for :class:`~datapipe.loader.StreamingDataset` (virtual shards of a mix, each naming
a real shard, see :mod:`.mixing`), logical chunks of sequences for a token loader
(:mod:`datapipe.plan.tokens`). An :class:`EpochPlanner` makes it for an epoch (fresh, or from
a resume state); :func:`pass_chunks` cuts the worker's share of the rank's stream into
:class:`Chunk` s of whole batches (:func:`datapipe.plan.worker_chunk_steps`), each naming the
unit and the index within it of every item. That is all the fetch stage
(:mod:`.prefetch`) needs: which units to fetch, in order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from numpy.typing import NDArray

from ..plan import EpochPlan, first_use, worker_batches, worker_chunk_steps

__all__ = ["Chunk", "EpochPlanner", "PassKey", "chained_chunks", "epoch_chunks", "pass_chunks", "share_size"]


@dataclass
class Chunk:
    """Consecutive items of a worker's stream: ``steps`` (plan steps), and for each item the
    unit it is read from (``shard``: a shard, a Parquet row group, a chunk of token
    sequences) and its index there (``sample``)."""

    number: int
    steps: NDArray[Any]
    shard: NDArray[Any]
    sample: NDArray[Any]
    shards: list[int] = field(default_factory=list)  # distinct, in order of first use
    #: the fetch each shard is read from (set by the Prefetcher when it plans the chunk)
    slots: dict[int, Any] = field(default_factory=dict, repr=False)
    #: which pass of a chain of passes the chunk belongs to (see StreamingDataset's
    #: prefetch into the next epoch); 0 for the first. The last chunk of a pass hands the
    #: next pass's first the fetches both read (once landed whole), so a chain's fetches are
    #: :func:`datapipe.plan.chunk_fetches` of its chunks as one run; a pass of its own (a
    #: new prefetcher: always with a cache) fetches what :func:`datapipe.plan.fetch_order` says.
    tag: int = 0
    #: what the fetch of each of ``shards`` gave, in that order: the fetched unit, or the
    #: exception its fetch raised (set by the fetch stage when it hands the chunk on)
    fetched: list[Any] = field(default_factory=list, repr=False)

    @classmethod
    def make(cls, number: int, steps: NDArray[Any], shard: NDArray[Any], sample: NDArray[Any],
             tag: int = 0) -> Chunk:
        return cls(number, steps, shard, sample, first_use(shard).tolist(), tag=tag)


class PassKey(NamedTuple):
    """What a pass's chunks depend on besides the dataset's fixed settings."""

    epoch: int
    rank: int
    world: int
    worker: int
    num_workers: int
    batch_size: int
    chunk_samples: int


@dataclass(frozen=True)
class EpochPlanner:
    """Makes an epoch's plan: ``planner(world, epoch)`` is a fresh epoch's
    :class:`~datapipe.plan.EpochPlan` for ``world`` ranks and the real unit of each of its
    units (``layout(epoch)`` gives both: a mix lists a shard once per pass over its stream;
    None when they are the same). It holds what the plan depends on, not the loader (the
    prefetch thread runs it for the next epoch, and must not keep the loader alive)."""

    layout: Callable[[int], tuple[NDArray[Any], NDArray[Any] | None]]
    seed: int
    window: int
    algorithm: str
    drop_last: bool
    fingerprint: str

    def __call__(self, world: int, epoch: int) -> tuple[EpochPlan, NDArray[Any] | None]:
        counts, real = self.layout(epoch)
        return EpochPlan(counts, seed=self.seed, epoch=epoch, window=self.window, algorithm=self.algorithm,
                         world=world, drop_last=self.drop_last, fingerprint=self.fingerprint), real

    def resumed(self, world: int, state: dict[str, Any]) -> tuple[EpochPlan, NDArray[Any] | None]:
        """The plan ``state`` was saved under (its epoch's), regrouped for ``world`` ranks."""
        counts, real = self.layout(state["epoch"])
        return EpochPlan.from_state(counts, state, seed=self.seed, window=self.window, algorithm=self.algorithm,
                                    world=world, drop_last=self.drop_last, fingerprint=self.fingerprint), real


def epoch_chunks(plan: EpochPlan, real: NDArray[Any] | None, key: PassKey, number: int = 0, tag: int = 0,
                 skip: int = 0) -> Iterator[Chunk]:
    """The worker's share of the rank's stream in ``plan``, as chunks numbered from
    ``number`` (:func:`datapipe.plan.worker_chunk_steps`: the first chunks are small and
    grow to full size, so the reader starts on the first batch while the prefetcher still
    plans the rest of the window), without the share's first ``skip`` steps."""
    for steps in worker_chunk_steps(plan.start, plan.per_rank, key.batch_size, key.worker, key.num_workers,
                                    key.chunk_samples, skip):
        # padding samples (repeats that even out the ranks) are read like any other
        unit, index, _padding = plan.rank_samples(key.rank, steps)
        yield Chunk.make(number, steps, unit if real is None else real[unit], index, tag)
        number += 1


def chained_chunks(first: Iterator[Chunk], make: Callable[[int, int], tuple[EpochPlan, NDArray[Any] | None]],
                   key: PassKey, step: int) -> Iterator[Chunk]:
    """The chunks of the pass ``key`` describes (``first``), then those of the passes that
    follow it if each next epoch is the last plus ``step`` (0 or 1), tagged 0, 1, 2, ...:
    the prefetcher fetches the next epoch's first shards while the consumer finishes this
    one. It stops after a pass that has no chunks for this worker."""
    number, tag, epoch, chunks = 0, 0, key.epoch, first
    while True:
        empty = True
        for chunk in chunks:
            empty = False
            number = chunk.number + 1
            yield chunk
        if empty:
            return
        tag, epoch = tag + 1, epoch + step
        plan, real = make(key.world, epoch)
        chunks = epoch_chunks(plan, real, key, number, tag)


def pass_chunks(plan: EpochPlan, real: NDArray[Any] | None, key: PassKey, skip: int = 0,
                then: EpochPlanner | None = None, step: int = 1) -> Iterator[Chunk]:
    """The plan stage's output for the pass ``key``: its chunks (the worker's first ``skip``
    steps left out), then, with ``then``, the chunks of the passes ``then`` plans after it
    (see :func:`chained_chunks`)."""
    chunks = epoch_chunks(plan, real, key, skip=skip)
    return chunks if then is None else chained_chunks(chunks, then, key, step)


def share_size(start: int, stop: int, batch_size: int, worker: int, num_workers: int) -> int:
    """Steps of ``[start, stop)`` that ``worker`` reads (whole batches in turn, the last one
    possibly short), counted without listing them."""
    batches = worker_batches(start, stop, batch_size, worker, num_workers)
    total, n_batches = max(stop - start, 0), len(range(0, max(stop - start, 0), batch_size))
    n = len(batches) * batch_size
    if len(batches) and batches[-1] == n_batches - 1:  # the pass's last batch, maybe short, is this worker's
        n -= n_batches * batch_size - total
    return n

