"""Pure planning: the order of an epoch, its partition over ranks and workers, resume.

No I/O, no clocks, no global state: everything here is a function of (per-shard sample
counts, seed, epoch, window, topology), testable without files.

Holds: ``epoch`` (``EpochPlan``: an epoch's order and partition), ``shuffle`` (epoch orders,
the ``ALGORITHMS`` registry), ``permutation`` (on-demand Feistel permutations), ``partition``
(splits over ranks and workers, elastic regrouping), ``resume`` (the state of a few
integers), ``quality`` (how well an order shuffles), ``future`` (a worker's chunks and the
shard fetches they make, for a cache's schedule), ``tokens`` (token sequences as the
planner's units: ``ConcatLayout``, ``DocumentLayout``, ``data_parallel``), ``mixture``
(exact per-batch mixtures with weights that change mid-run: ``MixturePlan``), ``arrays``
(the numpy array types). May import only :mod:`datapipe.errors`, :mod:`datapipe.options`,
:mod:`datapipe.checksum` and numpy.

    plan = EpochPlan(counts, seed=0, epoch=3, window=16, world=8, drop_last=False)
    shard, sample, pad = plan.rank_samples(rank=2, steps=np.arange(0, 1024))
    state = plan.state_dict(consumed=1024)
    plan2 = EpochPlan.from_state(counts, state, seed=0, window=16, world=4)  # elastic
"""

from __future__ import annotations

from .arrays import ArrayLike, Bools, Int64s
from .epoch import EpochPlan
from .future import chunk_fetches, chunk_shards, fetch_order, first_use, worker_chunk_steps
from .mixture import MixtureBatch, MixturePlan, WorkerSteps, mixture_counts, worker_steps
from .partition import Partition, Split, batch_steps, per_rank_count, worker_batches
from .permutation import derive_key, feistel_permute
from .quality import order_quality, sequence_quality
from .resume import OrderKey, layout_fingerprint, make_state, read_state
from .shuffle import ALGORITHMS, EpochOrder, NoShuffle, WindowShuffle, check_counts, epoch_order
from .tokens import (
    CHUNK_TOKENS,
    TABLE_MAGIC,
    ConcatLayout,
    DocumentLayout,
    DocumentTable,
    PackedChunk,
    Pieces,
    cu_seqlens,
    data_parallel,
    position_ids,
)

__all__ = [
    "ALGORITHMS",
    "ArrayLike",
    "Bools",
    "CHUNK_TOKENS",
    "ConcatLayout",
    "DocumentLayout",
    "DocumentTable",
    "TABLE_MAGIC",
    "EpochOrder",
    "EpochPlan",
    "Int64s",
    "MixtureBatch",
    "MixturePlan",
    "PackedChunk",
    "Pieces",
    "NoShuffle",
    "OrderKey",
    "Partition",
    "Split",
    "WindowShuffle",
    "batch_steps",
    "check_counts",
    "chunk_fetches",
    "chunk_shards",
    "cu_seqlens",
    "data_parallel",
    "derive_key",
    "epoch_order",
    "feistel_permute",
    "fetch_order",
    "first_use",
    "layout_fingerprint",
    "make_state",
    "mixture_counts",
    "order_quality",
    "per_rank_count",
    "position_ids",
    "read_state",
    "sequence_quality",
    "worker_batches",
    "worker_chunk_steps",
    "worker_steps",
    "WorkerSteps",
]
