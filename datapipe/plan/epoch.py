"""An epoch's plan: its order (:mod:`.shuffle`) and its partition over ranks
(:mod:`.partition`), with the resume state of a few integers (:mod:`.resume`)."""

from __future__ import annotations

from typing import Any

from .arrays import ArrayLike, Bools, Int64s
from .partition import Partition
from .quality import order_quality
from .resume import OrderKey, layout_fingerprint, make_state, read_state
from .shuffle import check_counts, epoch_order

__all__ = ["EpochPlan"]


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
