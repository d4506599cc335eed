"""How well an order shuffles, in two figures a user can weigh against a window size.

- ``mean_shards_per_batch``: distinct shards among the samples of a batch, averaged over
  batches. Stored order gives about 1; a full global shuffle gives about ``batch_size``
  (when there are many shards). Correlated batches (LitData#797) show up here.
- ``position_correlation``: Pearson correlation between where a sample is stored (its
  index in stored order) and where it is delivered. Stored order gives 1, a good shuffle
  about 0; shard-order-only shuffles give values between.

Both are computed from a bounded sample of batches spread over the whole epoch, so the
cost does not grow with the dataset.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import PlanError
from .arrays import ArrayLike
from .shuffle import EpochOrder

__all__ = ["sequence_quality", "order_quality"]


def sequence_quality(stored_index: ArrayLike, shard: ArrayLike, batch_size: int,
                     delivered_index: ArrayLike | None = None) -> dict[str, Any]:
    """Quality of a delivered sequence, given each delivered sample's stored index and
    shard (as any loader can record them). ``delivered_index`` defaults to 0, 1, 2, ...;
    sequences are cut into consecutive batches of ``batch_size``."""
    stored = np.asarray(stored_index, dtype=np.float64)
    shard = np.asarray(shard, dtype=np.int64)
    if stored.shape != shard.shape or stored.ndim != 1:
        raise PlanError("stored_index and shard must be 1-d arrays of the same length")
    if batch_size < 1:
        raise PlanError(f"batch_size must be at least 1, got {batch_size}")
    delivered = (np.arange(stored.size, dtype=np.float64) if delivered_index is None
                 else np.asarray(delivered_index, dtype=np.float64))
    n_batches = stored.size // batch_size
    if n_batches:
        b = np.sort(shard[: n_batches * batch_size].reshape(n_batches, batch_size), axis=1)
        distinct = 1 + (np.diff(b, axis=1) != 0).sum(axis=1)
        mean_shards = float(distinct.mean())
    else:
        mean_shards = float("nan")
    if stored.size > 1 and stored.std() > 0 and delivered.std() > 0:
        corr = float(np.corrcoef(stored, delivered)[0, 1])
    else:
        corr = float("nan")
    return {
        "batch_size": int(batch_size),
        "batches_measured": int(n_batches),
        "mean_shards_per_batch": mean_shards,
        "position_correlation": corr,
    }


def order_quality(order: EpochOrder, counts: ArrayLike, batch_size: int = 256,
                  max_batches: int = 512) -> dict[str, Any]:
    """Quality of an epoch order, measured on up to ``max_batches`` batches spread evenly
    over the epoch."""
    n = order.num_samples
    n_batches = n // batch_size if batch_size >= 1 else 0
    if n_batches == 0:
        raise PlanError(f"an epoch of {n} samples holds no full batch of {batch_size}")
    chosen = np.unique(np.linspace(0, n_batches - 1, num=min(max_batches, n_batches)).astype(np.int64))
    positions = (chosen[:, None] * batch_size + np.arange(batch_size)[None, :]).ravel()
    shard, sample = order.locate(positions)
    starts = np.concatenate(([0], np.cumsum(np.asarray(counts, dtype=np.int64))))
    out = sequence_quality(starts[shard] + sample, shard, batch_size, delivered_index=positions)
    out["num_samples"] = int(n)
    out["num_shards"] = int(order.num_shards)
    return out
