"""Mixing several datasets with weights or repeat counts, deterministically per epoch.

Each :class:`Stream` contributes ``T_i`` samples to an epoch: ``repeat * N_i`` with a
repeat count, or ``epoch_size * w_i / sum(w)`` with weights (``epoch_size`` defaults to
the total of the streams with weights). Whole passes over a stream list every shard;
the fraction left over takes whole shards of a seeded per-epoch shard permutation and the
first samples of one more, so the choice changes each epoch and costs O(shards).

The result is a *virtual layout* (sample counts of virtual shards, each naming a real
shard) which the ordinary plan shuffles and partitions; resume works unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..errors import LoaderOptionError, PlanError
from ..options import check_float, check_mapping, check_path
from ..plan import derive_key

__all__ = ["Stream", "epoch_layout", "stream_targets", "check_layout_size", "MAX_VIRTUAL_SHARDS"]

#: the most shards an epoch's layout may list (a shard once per pass over its stream): the
#: layout is two int64 arrays of this length, built every epoch
MAX_VIRTUAL_SHARDS = 1 << 24
#: the most passes over one stream an epoch may ask for
MAX_REPEAT = float(1 << 20)


@dataclass(frozen=True)
class Stream:
    """One dataset in a mix: ``weight`` (relative share) or ``repeat`` (passes per epoch,
    may be fractional), not both; neither means ``repeat=1``."""

    url: str
    weight: float | None = None
    repeat: float | None = None
    storage_options: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        # frozen: the checked values are set through object.__setattr__
        object.__setattr__(self, "url", check_path("Stream(url)", self.url, error=LoaderOptionError))
        if self.weight is not None and self.repeat is not None:
            raise LoaderOptionError(f"stream {self.url}: give weight or repeat, not both")
        for name in ("weight", "repeat"):
            v = getattr(self, name)
            if v is not None:
                hint = f"stream {self.url}: {'a relative share' if name == 'weight' else 'passes per epoch'}"
                # checked, not converted: the value as given is part of the mix's fingerprint
                check_float(f"Stream({name})", v, min=0, max=MAX_REPEAT if name == "repeat" else None, hint=hint,
                            error=LoaderOptionError)
        if self.storage_options is not None:
            object.__setattr__(self, "storage_options", check_mapping(
                "Stream(storage_options)", self.storage_options, error=LoaderOptionError))

    def describe(self) -> list[Any]:
        return [self.url, self.weight, self.repeat]


def stream_targets(streams: list[Stream], sizes: list[int], epoch_size: int | None = None) -> list[int]:
    """Samples each stream contributes to one epoch."""
    if len(streams) != len(sizes):
        raise PlanError("one size per stream is needed")
    weights = {i: float(s.weight) for i, s in enumerate(streams) if s.weight is not None}
    weighted = list(weights)
    targets = [0] * len(streams)
    for i, s in enumerate(streams):
        if s.weight is None:
            targets[i] = round((1.0 if s.repeat is None else s.repeat) * sizes[i])
    if weighted:
        total_w = sum(weights.values())
        if total_w <= 0:
            raise PlanError("the weights of a mix sum to zero")
        size = sum(sizes[i] for i in weighted) if epoch_size is None else int(epoch_size)
        if size < 0:
            raise PlanError(f"epoch_size must be non-negative, got {epoch_size}")
        shares = [size * weights[i] / total_w for i in weighted]
        floors = [int(x) for x in shares]
        # largest remainders get the samples rounding left over, so the total is exact
        left = size - sum(floors)
        order = sorted(range(len(weighted)), key=lambda k: shares[k] - floors[k], reverse=True)
        for k in order[:left]:
            floors[k] += 1
        for k, i in enumerate(weighted):
            targets[i] = floors[k]
    for i, t in enumerate(targets):
        if t > 0 and sizes[i] == 0:
            raise PlanError(f"stream {streams[i].url} holds no sample but is asked for {t}")
    return targets


def check_layout_size(targets: list[int], sizes: list[int], shards: list[int], what: str) -> None:
    """:class:`LoaderOptionError` (naming ``what``: the mix's repeats or ``epoch_size``)
    when an epoch would list more than :data:`MAX_VIRTUAL_SHARDS` shards: each whole pass
    over a stream lists all its shards, and the layout is built every epoch."""
    total = sum((t // n + 1) * k for t, n, k in zip(targets, sizes, shards) if n > 0 and t > 0)
    if total > MAX_VIRTUAL_SHARDS:
        raise LoaderOptionError(f"{what}: an epoch of {sum(targets)} samples would list {total} shards (each pass "
                                f"over a stream lists all of its shards), more than {MAX_VIRTUAL_SHARDS}; ask "
                                "for fewer passes per epoch (or iterate more epochs)")


def epoch_layout(stream_counts: list[NDArray[Any]], targets: list[int], seed: int,
                 epoch: int) -> tuple[NDArray[Any], NDArray[Any]]:
    """(virtual shard sample counts, real global shard of each virtual shard) for one epoch.
    Real shards are numbered across the streams in order."""
    counts_out: list[NDArray[Any]] = []
    real_out: list[NDArray[Any]] = []
    base = 0
    for i, (counts, target) in enumerate(zip(stream_counts, targets)):
        counts = np.asarray(counts, dtype=np.int64)
        n = int(counts.sum())
        ids = base + np.arange(counts.size, dtype=np.int64)
        base += counts.size
        if target == 0 or n == 0:
            continue
        passes, rest = divmod(int(target), n)
        for _ in range(passes):
            counts_out.append(counts)
            real_out.append(ids)
        if rest:
            rng = np.random.Generator(np.random.PCG64(derive_key(seed, epoch, 3, i)))
            perm = rng.permutation(counts.size)
            cum = np.cumsum(counts[perm])
            k = int(np.searchsorted(cum, rest, side="left"))  # shards perm[:k+1] cover rest
            take = counts[perm[: k + 1]].copy()
            take[-1] -= int(cum[k]) - rest
            counts_out.append(take)
            real_out.append(ids[perm[: k + 1]])
    if not counts_out:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(counts_out), np.concatenate(real_out)
