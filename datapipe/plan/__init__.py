"""Pure planning: the order of an epoch, its partition over ranks and workers, resume.

No I/O, no clocks, no global state: everything here is a function of (per-shard sample
counts, seed, epoch, window, topology), testable without files.

Holds: ``shuffle`` (epoch orders, the ``ALGORITHMS`` registry), ``permutation`` (on-demand
Feistel permutations), ``partition`` (splits over ranks and workers, elastic regrouping),
``resume`` (the state of a few integers), ``quality`` (how well an order shuffles),
``future`` (a worker's chunks and the shard fetches they make, for a cache's schedule),
``arrays`` (the numpy array types). May import only :mod:`datapipe.errors`, :mod:`datapipe.options`,
:mod:`datapipe.checksum` and numpy.

    plan = EpochPlan(counts, seed=0, epoch=3, window=16, world=8, drop_last=False)
    shard, sample, pad = plan.rank_samples(rank=2, steps=np.arange(0, 1024))
    state = plan.state_dict(consumed=1024)
    plan2 = EpochPlan.from_state(counts, state, seed=0, window=16, world=4)  # elastic
"""

from __future__ import annotations

from typing import Any

from .arrays import ArrayLike, Bools, Int64s
from .future import chunk_fetches, fetch_order, first_use, worker_chunk_steps
from .partition import Partition, Split, batch_steps, per_rank_count, worker_batches
from .permutation import derive_key, feistel_permute
from .quality import order_quality, sequence_quality
from .resume import OrderKey, layout_fingerprint, make_state, read_state
from .shuffle import ALGORITHMS, NoShuffle, WindowShuffle, check_counts, epoch_order

__all__ = [
    "ALGORITHMS",
    "EpochPlan",
    "NoShuffle",
    "OrderKey",
    "Partition",
    "Split",
    "WindowShuffle",
    "batch_steps",
    "check_counts",
    "chunk_fetches",
    "derive_key",
    "epoch_order",
    "feistel_permute",
    "fetch_order",
    "first_use",
    "layout_fingerprint",
    "order_quality",
    "per_rank_count",
    "sequence_quality",
    "worker_batches",
    "worker_chunk_steps",
]


class EpochPlan:
    """One epoch's order and its partition over ``world`` ranks."""

    def __init__(self, counts: Any, *, seed: int = 0, epoch: int = 0, window: int = 1 << 62,
                 algorithm: str = "window", world: int = 1, drop_last: bool = False,
                 fingerprint: str | None = None, partition: Partition | None = None) -> None:
        self.counts = check_counts(counts)
        self.order = epoch_order(self.counts, seed, epoch, window, algorithm)
        self.epoch = int(epoch)
        self.drop_last = bool(drop_last)
        self.key = OrderKey(
            fingerprint=fingerprint or layout_fingerprint(self.counts),
            num_samples=self.order.num_samples,
            algorithm=algorithm,
            seed=int(seed),
            window=int(window),
        )
        self.partition = partition or Partition.fresh(self.order.num_samples, world, drop_last)

    @classmethod
    def from_state(cls, counts: Any, state: dict[str, Any], *, seed: int = 0, window: int = 1 << 62,
                   algorithm: str = "window", world: int = 1, drop_last: bool = False,
                   fingerprint: str | None = None) -> EpochPlan:
        """The plan ``state`` was saved under, regrouped for ``world`` ranks (elastic). The
        state must match this layout, seed, window and algorithm (StateMismatchError)."""
        counts = check_counts(counts)
        key = OrderKey(fingerprint or layout_fingerprint(counts), int(counts.sum()), algorithm,
                       int(seed), int(window))
        epoch, part = read_state(state, key)
        return cls(counts, seed=seed, epoch=epoch, window=window, algorithm=algorithm,
                   drop_last=drop_last, fingerprint=key.fingerprint,
                   partition=part.regroup(world, drop_last))

    @property
    def world(self) -> int:
        return self.partition.live.world

    @property
    def per_rank(self) -> int:
        """Samples each rank yields under the live split (including those already consumed)."""
        return self.partition.live.per_rank

    @property
    def start(self) -> int:
        """Local step at which every rank continues."""
        return self.partition.live.consumed

    def rank_samples(self, rank: int, steps: ArrayLike) -> tuple[Int64s, Int64s, Bools]:
        """(shard, sample within shard, is_padding) of ``rank``'s local ``steps``."""
        pos, pad = self.partition.positions(rank, steps)
        shard, sample = self.order.locate(pos)
        return shard, sample, pad

    def state_dict(self, consumed: int) -> dict[str, Any]:
        """State after every rank consumed ``consumed`` samples of the live split."""
        return make_state(self.key, self.epoch, self.partition.with_consumed(int(consumed)))

    def quality(self, batch_size: int = 256, max_batches: int = 512) -> dict[str, Any]:
        return order_quality(self.order, self.counts, batch_size, max_batches)
