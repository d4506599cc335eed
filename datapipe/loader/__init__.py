"""Runtime: the prefetching, decoding StreamingDataset and its torch adapter.

- ``dataset``: ``StreamingDataset`` (plan, chunks, error policy, resume state).
- ``source``: the shards of one or more datasets and fetching one shard's bytes.
- ``prefetch``: fetching shards ahead of the reader within a byte budget.
- ``readers``: one reader per kind of shard, chosen once per shard, and reading a chunk.
- ``layouts``: the bounded cache of shard layouts, kept across epochs.
- ``mixing``, ``dataloader``: stream mixes, the torch ``DataLoader`` subclass. Samples are
  decoded by :mod:`datapipe.decode` (shared with ``open_dataset``).

Imports ``plan``, ``format``, ``storage`` (its stores and retry policy), ``datapipe.dataset``
and the leaves; never ``pack`` or ``checkpoint``.
"""

from typing import Any

from ..decode import DEFAULT_DECODERS, make_decoder
from .dataset import StreamingDataset, resolve_topology
from .mixing import Stream

__all__ = ["DEFAULT_DECODERS", "Stream", "StreamingDataLoader", "StreamingDataset", "make_decoder",
           "resolve_topology"]


def __getattr__(name: str) -> Any:  # torch is optional: import the DataLoader subclass on demand
    if name == "StreamingDataLoader":
        from .dataloader import StreamingDataLoader

        return StreamingDataLoader
    raise AttributeError(name)
